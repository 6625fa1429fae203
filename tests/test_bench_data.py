"""benchmarks/bench_data.py runs end to end on a small set, reports every layout and worker count, and leaves
nothing behind (no timing is asserted)."""
from __future__ import annotations


from tests.repo_scripts import load_script


def test_bench_data_small(tmp_path, capsys):
    bench = load_script("benchmarks/bench_data.py")
    out = bench.main(["--images", "40", "--min-regions", "3", "--max-regions", "9", "--dim", "32", "--batch", "8",
                      "--workers", "0", "1", "--epochs", "2", "--dir", str(tmp_path)])
    assert set(out["rates"]) == {"hdf5/0", "prepared/0", "hdf5/1", "prepared/1"}
    assert all(len(r) == 2 and min(r) > 0 for r in out["rates"].values())
    assert set(out["ratios"]) == {0, 1}
    printed = capsys.readouterr().out
    assert "ratio" in printed and "(estimate)" in printed
    assert list(tmp_path.iterdir()) == []  # the synthetic set is deleted

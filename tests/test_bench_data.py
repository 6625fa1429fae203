"""benchmarks/bench_data.py runs end to end on a small set, reports every layout and worker count, and leaves
nothing behind (no timing is asserted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_data_small(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "benchmarks" / "bench_data.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--images", "40", "--min-regions", "3", "--max-regions", "9", "--dim", "32", "--batch", "8",
                      "--workers", "0", "1", "--epochs", "2", "--dir", str(tmp_path)])
    assert set(out["rates"]) == {"hdf5/0", "prepared/0", "hdf5/1", "prepared/1"}
    assert all(len(r) == 2 and min(r) > 0 for r in out["rates"].values())
    assert set(out["ratios"]) == {0, 1}
    printed = capsys.readouterr().out
    assert "ratio" in printed and "(estimate)" in printed
    assert list(tmp_path.iterdir()) == []  # the synthetic set is deleted

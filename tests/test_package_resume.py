"""Packaging's decoding survives being stopped: finished shards are kept in the study's storage, a second run
decodes only the rest (no shard twice) and writes a results.zip byte-identical to an uninterrupted run's."""
from __future__ import annotations

import pytest

from tests.raycluster import tiny_data  # noqa: F401 - fixture
from tests.test_package import NAME, study, trained  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def test_a_decode_stopped_mid_way_continues_and_gives_the_same_zip(trained, tmp_path, monkeypatch):  # noqa: F811
    import launch.package as package
    from a2core.data.captions import read_image_info
    from launch.storage import open_location
    from launch.spec import load_study
    from tests.test_package import _study_file

    spec = load_study(_study_file(tmp_path, trained["data"], tmp_path / "studies", f"sqlite:///{tmp_path / 'm.db'}"))
    data_config = spec.trial_config({"fusion": "gate", "seed": 0})["data"]
    checkpoints = [str(trained["runs"][s]["best_checkpoint"]) for s in (0, 1)]
    root = trained["data"]
    val = read_image_info(root / "image_info_val2014.json")[:30]
    test = read_image_info(root / "image_info_test2014.json")[:12]
    splits = {"val2014": val, "test2014": test, "test": val[-10:]}  # Karpathy test images are val2014 images too
    options = dict(beam_size=3, max_len=12, batch_size=4, workers=0, address=None, endpoint_url=None,
                   verbose=False, shard_images=8)
    assert len(package.make_shards(splits, 8)) == 6  # 42 distinct images

    calls = []
    real = package.decode_shard

    def counted(checkpoints, data_config, shard, *args, **kwargs):
        calls.append(sorted(set().union(*shard.values())))
        if stop_after is not None and len(calls) > stop_after:
            raise KeyboardInterrupt  # what Ctrl-C or a killed driver does to a running decode
        return real(checkpoints, data_config, shard, *args, **kwargs)

    monkeypatch.setattr(package, "decode_shard", counted)
    keep = open_location(tmp_path / "studies").join("pkg", package.DECODED_DIR,
                                                    package.decode_key(checkpoints, splits, "test", beam_size=3))
    stop_after = 2
    with pytest.raises(KeyboardInterrupt):
        package.decode_all(checkpoints, data_config, splits, "test", keep=keep, **options)
    assert keep.listdir() == ["shard-00000.json", "shard-00001.json"]
    first = list(calls)
    stop_after, calls[:] = None, []
    resumed = package.decode_all(checkpoints, data_config, splits, "test", keep=keep, **options)
    assert (resumed["shards"], resumed["reused"]) == (6, 2)
    assert len(calls) == 4 and not set(map(tuple, calls)) & set(map(tuple, first[:2]))  # no shard twice
    assert len(keep.listdir()) == 6

    calls[:] = []
    whole = package.decode_all(checkpoints, data_config, splits, "test", keep=None, **options)  # uninterrupted
    assert len(calls) == 6
    assert whole["ensemble"] == resumed["ensemble"] and whole["single"] == resumed["single"]
    images = {"splits": splits, "sources": {}, "max_len": 12}
    files = ("captions_val2014_x_results.json", "captions_test2014_x_results.json")
    zips = []
    for name, decoded in (("resumed", resumed), ("whole", whole)):
        (tmp_path / name).mkdir()
        zips.append(package.write_submission(tmp_path / name, files, decoded, images, "x", verbose=False)["zip"])
    assert zips[0].read_bytes() == zips[1].read_bytes()


def test_estimate_states_the_decode_cost_and_trains_nothing(study, tmp_path, capsys):  # noqa: F811
    from launch.cli import main

    rc = main(["package", NAME, "--storage", str(study["storage"]), "--estimate", "--workers", "4"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "4-member ensemble, beam 5" in printed and "s per image for the ensemble" in printed
    assert "the server's 81,279 images" in printed and "on 4 worker(s)" in printed
    assert not (tmp_path / "a2-packages").exists()  # nothing written


def test_the_estimate_prices_the_ensemble_package_would_decode(study, monkeypatch, capsys):  # noqa: F811
    """Without --seeds, package decodes the best configuration's replicates when it has at least len(SEEDS) of them
    (`ensemble_seeds`): the estimate prices that many members, not len(SEEDS). Here len(SEEDS) is made 2, below
    the study's 3 seeds with a checkpoint (0, 1, 2)."""
    from launch import package
    from launch.cli import main

    monkeypatch.setattr(package, "SEEDS", (0, 1))
    assert main(["package", NAME, "--storage", str(study["storage"]), "--estimate"]) == 0
    assert "3-member ensemble, beam 5" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_a_killed_package_process_reruns_without_decoding_a_shard_twice(study, tmp_path):  # noqa: F811
    """`a2 package` as a process of its own, killed (SIGKILL: no handler runs) once a shard is in the study's
    storage and before the decoding ends; the rerun decodes only the shards not kept (the kept files are not
    written again) and its results.zip is byte-identical to that of an uninterrupted run of a copy of the study."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import launch.package as package

    whole_storage = tmp_path / "studies-whole"
    shutil.copytree(study["storage"], whole_storage)  # the same finished study, for the uninterrupted run
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}

    def a2(storage: Path, out: str, db: str) -> list[str]:
        return [sys.executable, "-m", "launch.cli", "package", NAME, "--storage", str(storage), "--seeds", "0", "1",
                "--no-train", "--workers", "0", "--beam-size", "3", "--batch-size", "2", "--shard-images", "3",
                "--out", str(tmp_path / out), "--tracking-uri", f"sqlite:///{tmp_path / db}"]

    kept = study["storage"] / NAME / package.DECODED_DIR
    shards = lambda: {p.name: p.stat().st_mtime_ns for p in kept.glob("*/shard-*.json")}  # noqa: E731
    proc = subprocess.Popen(a2(study["storage"], "out", "m.db"), cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not shards() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = shards()
    assert proc.returncode == -signal.SIGKILL and before, proc.stderr.read().decode()[-3000:]
    assert not (tmp_path / "out" / "results.zip").exists()

    rerun = subprocess.run(a2(study["storage"], "out", "m.db"), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = shards()
    assert len(before) < len(after)  # killed before the decoding's end
    assert f"{len(before)} of {len(after)} shards were decoded before" in rerun.stdout + rerun.stderr
    assert {name: after[name] for name in before} == before  # no kept shard decoded (written) again

    whole = subprocess.run(a2(whole_storage, "whole", "w.db"), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "decoded before" not in whole.stdout + whole.stderr
    assert (tmp_path / "out" / "results.zip").read_bytes() == (tmp_path / "whole" / "results.zip").read_bytes()

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
    from dashboards.storage import open_location
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


def test_plan_states_the_decode_cost_and_trains_nothing(study, tmp_path, capsys):  # noqa: F811
    from launch.cli import main

    rc = main(["package", NAME, "--storage", str(study["storage"]), "--plan", "--workers", "4"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "4-member ensemble, beam 5" in printed and "s per image for the ensemble" in printed
    assert "the server's 81,279 images" in printed and "on 4 worker(s)" in printed
    assert not (tmp_path / "a2-packages").exists()  # nothing written

"""Hostile or broken inputs are refused with one clear error naming the file, key, id or argument, within bounded
time and memory: YAML (duplicate keys, alias bombs, size, long integers), submission zips (a zip bomb, lying sizes,
path traversal, too many members), integers (5000-digit and out-of-int64 image ids), captions (empty splits,
`tokens` as a string, ints for sentences), seeds and the `a2` command's integer arguments."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from a2core.config import MAX_YAML_BYTES, Config, apply_overrides, load_yaml
from a2core.data import synthetic
from a2core.data.captions import read_image_info, read_karpathy
from a2core.data.dataset import CaptionData
from a2core.errors import ConfigError, DataError
from dashboards.submission import MAX_MEMBER_BYTES, MAX_MEMBERS, validate_zip
from launch.cli import main as cli
from launch.spec import load_study
from tests.raycluster import a2  # the `a2` command as a process of its own

ROOT = Path(__file__).resolve().parents[1]
VAL_IDS, TEST_IDS = [1, 2], [3]
VAL_NAME, TEST_NAME = "captions_val2014_a2_results.json", "captions_test2014_a2_results.json"
LIMIT_S, LIMIT_MB = 5, 300  # what a hostile file may cost before it is refused (CPU seconds, peak RSS)


def _measured(code: str) -> dict:
    """Run `code` in a fresh interpreter; it sets `out` (a dict). Adds its CPU seconds and peak RSS in MB (VmHWM:
    the peak of this process's own memory; getrusage's ru_maxrss would include the forking pytest's size)."""
    probe = (f"import resource, json, re\n{code}\n"
             "r = resource.getrusage(resource.RUSAGE_SELF)\n"
             "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())\n"
             "out.update(cpu_s=r.ru_utime + r.ru_stime, rss_mb=int(hwm[1]) / 1024)\n"
             "print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# -- YAML ----------------------------------------------------------------------------------------------------------
def test_duplicate_keys_are_refused_naming_key_and_line(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("name: x\ntrain:\n  batch_size: 8\n  warmup: 10\nmodel: {layers: 2}\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}: .*line 6.*duplicate key 'train' \(first on line 2\)"):
        load_yaml(path)
    # merge keys override on purpose: not duplicates
    path.write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert load_yaml(path)["other"] == {"x": 3, "y": 2}


def test_an_alias_bomb_is_refused_in_bounded_time_and_memory(tmp_path):
    lines = ['name: bomb', 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 16)]  # 10^16 strings
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert 900 < path.stat().st_size < 1500
    out = _measured(f"import io, contextlib\nfrom launch.cli import main\nerr = io.StringIO()\n"
                    f"with contextlib.redirect_stderr(err):\n    code = main(['study', 'validate', {str(path)!r}])\n"
                    f"out = {{'code': code, 'err': err.getvalue()}}")
    assert out["code"] == 2 and str(path) in out["err"] and "once aliases are expanded" in out["err"]
    assert out["cpu_s"] < LIMIT_S and out["rss_mb"] < LIMIT_MB


@pytest.mark.slow
def test_oversized_deep_and_long_integer_yaml_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError, match=rf"{big}: larger than {MAX_YAML_BYTES} bytes"):
        load_yaml(big)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")  # libyaml would crash the process on this
    with pytest.raises(ConfigError, match=rf"{deep}: YAML nested too deeply"):
        load_yaml(deep)
    digits = tmp_path / "digits.yaml"
    digits.write_text("train:\n  seed: " + "7" * 5000 + "\n")
    with pytest.raises(ConfigError, match=rf"{digits}: .*line 2.*integer of 5000 characters is too long"):
        load_yaml(digits)


def test_override_values_are_parsed_by_the_same_loader():
    assert apply_overrides({}, ["model.layers=3", "a.b=[1, 2]", "c=not: yaml: here"]) == \
        {"model": {"layers": 3}, "a": {"b": [1, 2]}, "c": "not: yaml: here"}
    with pytest.raises(ConfigError, match=r"x\.yaml: override 'train=\{seed: 1, seed: 2\}'.*duplicate key 'seed'"):
        apply_overrides({}, ["train={seed: 1, seed: 2}"], source="x.yaml")
    with pytest.raises(ConfigError, match=r"integer of 5000 characters"):
        apply_overrides({}, ["train.seed=" + "9" * 5000])


# -- seeds and command arguments ----------------------------------------------------------------------------------
def test_negative_seeds_are_refused_as_config_keys_and_in_seed_grids(tmp_path):
    for key in ("train.seed", "data.seed"):
        with pytest.raises(ConfigError, match=rf"{key}: must be in 0 \.\. 4294967295, got -1"):
            Config.from_dict({key.split(".")[0]: {key.split(".")[1]: -1}})
    with pytest.raises(ConfigError, match=r"train\.seed: must be in 0 \.\. 4294967295, got 4294967296"):
        Config.from_dict({"train": {"seed": 2**32}})
    with pytest.raises(ConfigError, match=r"search\.space\.seed\.grid: -1 gives an invalid train\.seed"):
        raw = load_yaml(ROOT / "studies" / "smoke.yaml")
        raw["search"].pop("replicates")  # a seed grid instead
        (tmp_path / "s.yaml").write_text(json.dumps(raw))  # JSON is YAML
        load_study(tmp_path / "s.yaml", ["search.space={seed: {grid: [0, -1]}}"])


@pytest.mark.parametrize("argv, argument", [
    (["decode", "--checkpoints", "c.pt", "--out", "r.json", "--max-len", "0"], "--max-len"),
    (["decode", "--checkpoints", "c.pt", "--out", "r.json", "--beam-size", "0"], "--beam-size"),
    (["decode", "--checkpoints", "c.pt", "--out", "r.json", "--batch-size", "-5"], "--batch-size"),
    (["decode", "--checkpoints", "c.pt", "--out", "r.json", "--batch-size", "9" * 5000], "--batch-size"),
    (["data", "synth", "--out", "x", "--seed", "-1"], "--seed"),
])
def test_non_positive_integer_arguments_are_refused_naming_them(argv, argument, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    assert exit_.value.code == 2
    assert f"argument {argument}: " in capsys.readouterr().err


def test_decode_refuses_a_max_len_beyond_the_models_positions(tmp_path):
    from a2core import checkpoint as ckpt
    from a2core.data.captions import SPECIALS
    from a2core.decode import decode_to_file
    from a2core.model.a2 import build_model

    cfg = Config.from_dict({"model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32}})
    model = build_model(cfg.model, len(SPECIALS), cfg.data.max_caption_len + 2)
    path = ckpt.save({"model": model.state_dict(), "config": cfg.to_dict(), "vocab": list(SPECIALS)}, tmp_path / "c.pt")
    with pytest.raises(ConfigError, match=r"--max-len: 24 is longer than these models can decode \(at most 23"):
        decode_to_file([str(path)], "test", str(tmp_path / "r.json"), max_len=24)
    with pytest.raises(ConfigError, match=r"--beam-size: must be >= 1, got 0"):
        decode_to_file([str(path)], "test", str(tmp_path / "r.json"), beam_size=0)



def test_a_model_for_short_training_captions_still_decodes_train_max_len_words(tmp_path):
    """data.max_caption_len 4 (training captions cut short) with the default train.max_len 20: the model the trainer
    and a checkpoint build has the positions of a 20-word beam, so the per-epoch validation, SCST's beams and the
    test evaluation after the last epoch do not fail on a caption that runs to max_len (the table was sized by the
    training captions alone: 8 positions)."""
    import torch

    from a2core import checkpoint as ckpt
    from a2core.data.captions import SPECIALS
    from a2core.decode import MinLengthStepper, ModelStepper, beam_search, decode_to_file
    from a2core.model.a2 import build_model

    cfg = Config.from_dict({"data": {"max_caption_len": 4},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 4,
                                      "feature_dim": 8}})
    assert cfg.longest_caption == 22 and Config.from_dict({}).longest_caption == 22  # the defaults' unchanged
    torch.manual_seed(0)
    model = build_model(cfg.model, len(SPECIALS) + 4, cfg.longest_caption)
    path = ckpt.save({"model": model.state_dict(), "config": cfg.to_dict(), "vocab": [*SPECIALS, "a", "b", "c", "d"]},
                     tmp_path / "c.pt")
    loaded, _, _ = ckpt.model_from_state(ckpt.load(str(path)))
    with torch.no_grad():
        # no <eos> before max_len words: every beam runs to max_len
        longest = MinLengthStepper(ModelStepper(loaded), eos=2, min_len=cfg.train.max_len)
        seqs, _ = beam_search(longest, torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool), 3, cfg.train.max_len)
    assert seqs.shape[1] == cfg.train.max_len + 1
    with pytest.raises(ConfigError, match=r"--max-len: 24 is longer than these models can decode \(at most 23"):
        decode_to_file([str(path)], "test", str(tmp_path / "r.json"), max_len=24)


# -- integers and captions -----------------------------------------------------------------------------------------
def _karpathy(tmp_path, images) -> Path:
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": images}))
    return path


def _image(cocoid, split="train", sentences=None):
    return {"cocoid": cocoid, "split": split, "sentences": sentences or [{"tokens": ["a", "dog"]}]}


def test_image_ids_too_long_negative_or_beyond_int64_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text('{"images": [{"id": ' + "1" * 5000 + "}]}")
    for read in (read_image_info, read_karpathy):
        with pytest.raises(DataError, match=rf"{path}: holds an integer of more than 4300 digits"):
            read(path)
    for bad in (-1, 2**63, True, "7"):
        path.write_text(json.dumps({"images": [{"id": 1}, {"id": bad}]}))
        with pytest.raises(DataError, match=rf"{path}: images\[1\] has no 'id' that is a non-negative 64-bit"):
            read_image_info(path)
    caps = _karpathy(tmp_path, [_image(1), _image(-4)])
    with pytest.raises(DataError, match=rf"{caps}: images\[1\] has no 'cocoid' that is a non-negative 64-bit"):
        read_karpathy(caps)


@pytest.mark.parametrize("sentences, message", [
    ([{"tokens": "a dog"}], r"sentences\[0\]\.tokens must be a list of strings, got 'a dog'"),
    ([{"tokens": ["a", 3]}], r"sentences\[0\]\.tokens must be a list of strings"),
    ([{"raw": 5}], r"sentences\[0\]\.raw is a int, not a string"),
    (["a dog"], r"sentences\[0\] is a str, not an object"),
    ("a dog", r"'sentences' is a str, not a list"),
])
def test_malformed_captions_are_refused_naming_file_and_image(tmp_path, sentences, message):
    path = _karpathy(tmp_path, [_image(1), _image(7, "val", sentences)])
    with pytest.raises(DataError, match=rf"{path}: image id 7: {message}"):
        read_karpathy(path)


@pytest.mark.parametrize("empty", ["train", "val"])
def test_an_empty_train_or_val_split_is_refused_before_training_and_in_the_spec(tmp_path, empty):
    syn = synthetic.generate(tmp_path / "syn", seed=1, images=20, test_images=2)
    doc = json.loads(Path(syn["captions"]).read_text())
    doc["images"] = [img for img in doc["images"] if img["split"].replace("restval", "train") != empty]
    caps = _karpathy(tmp_path, doc["images"])
    data_cfg = Config.from_dict({"data": {"kind": "coco", "captions": str(caps), "features": str(syn["features"])},
                                 "model": {"max_regions": 10}})
    data = CaptionData(data_cfg.data, 10)
    with pytest.raises(DataError, match=rf"{caps}: the {empty} split has no images"):
        data.check(("train", "val"))
    overrides = ["data.kind=coco", f"data.captions={caps}", f"data.features={syn['features']}"]
    with pytest.raises(ConfigError, match=rf"data\.captions: {caps}: the {empty} split has no images"):
        load_study(ROOT / "studies" / "smoke.yaml", overrides)


# -- submission zips ------------------------------------------------------------------------------------------------
def _zip(tmp_path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "results.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _results(ids) -> bytes:
    return json.dumps([{"image_id": i, "caption": "a dog"} for i in ids]).encode()


@pytest.mark.slow
def test_a_zip_bomb_is_refused_in_bounded_time_and_memory(tmp_path):
    path = tmp_path / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr(TEST_NAME, _results(TEST_IDS))
        with zf.open(VAL_NAME, "w", force_zip64=True) as f:  # 2 GiB of zeros, streamed
            block = bytes(1 << 20)
            for _ in range(2048):
                f.write(block)
    assert path.stat().st_size < 3 << 20
    out = _measured(f"from dashboards.submission import validate_zip\n"
                    f"r = validate_zip({str(path)!r}, {VAL_IDS}, {TEST_IDS}, alg='a2')\n"
                    f"out = {{'ok': r.ok, 'kinds': r.kinds(), 'text': str(r)}}")
    assert not out["ok"] and out["kinds"] == ["too_large"]
    assert f"{VAL_NAME}: declares {2 << 30} bytes uncompressed" in out["text"]
    assert out["cpu_s"] < LIMIT_S and out["rss_mb"] < LIMIT_MB


def test_a_member_whose_declared_size_lies_is_refused(tmp_path):
    """zipfile stops a member's stream at its declared size; the bytes beyond it fail the CRC check."""
    path = _zip(tmp_path, {VAL_NAME: _results(VAL_IDS) + b" " * 5000, TEST_NAME: _results(TEST_IDS)})
    with zipfile.ZipFile(path) as zf:  # rewrite the declared size in the central directory to a small lie
        info = zf.getinfo(VAL_NAME)
        offset = zf.start_dir + 24  # the first central-directory record's "uncompressed size" field
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[offset:offset + 4], "little") == info.file_size
    data[offset:offset + 4] = (100).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["unreadable"] and f"{VAL_NAME}: cannot be extracted (Bad CRC-32" in str(report)


def test_traversal_names_and_too_many_members_are_refused(tmp_path):
    path = _zip(tmp_path, {VAL_NAME: _results(VAL_IDS), TEST_NAME: _results(TEST_IDS), "../evil.json": b"[]"})
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert "unsafe_name" in report.kinds() and "../evil.json" in str(report)
    many = _zip(tmp_path, {f"f{i}.json": b"[]" for i in range(MAX_MEMBERS + 1)})
    report = validate_zip(many, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["too_many_members"] and f"holds {MAX_MEMBERS + 1} entries" in str(report)
    assert MAX_MEMBER_BYTES >= 16 << 20  # room for the 40,775 test-server captions (~3.5 MB)


def test_results_with_a_5000_digit_or_out_of_range_image_id_are_refused(tmp_path):
    long_id = b'[{"image_id": ' + b"1" * 5000 + b', "caption": "a dog"}]'
    path = _zip(tmp_path, {VAL_NAME: long_id, TEST_NAME: _results(TEST_IDS)})
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert "not_json" in report.kinds() and f"{VAL_NAME}: holds an integer of more than 4300 digits" in str(report)
    path = _zip(tmp_path, {VAL_NAME: _results(VAL_IDS + [-3, 2**63]), TEST_NAME: _results(TEST_IDS)})
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["bad_image_id"] and "2 entries have an image_id that is not" in str(report)
    ids = tmp_path / "info.json"
    ids.write_text('{"images": [{"id": ' + "2" * 5000 + "}]}")
    with pytest.raises(ValueError, match=rf"{ids}: holds an integer of more than 4300 digits"):
        read_image_info(ids)


def test_a_study_name_outside_the_storage_root_is_refused(tmp_path):
    for command in (["study", "status"], ["study", "resume"], ["study", "check"], ["mlflow", "sync"], ["package"]):
        done = a2(*command, "../storage/c1", cwd=tmp_path, timeout=120)
        assert done.returncode == 2, (command, done.stdout[-2000:])
        assert "study name '../storage/c1'" in done.stdout, (command, done.stdout[-2000:])


@pytest.mark.parametrize("text", ['{"name": "foo", "stor', "[1, 2]", '{"storage": 7}'])
def test_a_damaged_study_pointer_is_named_not_a_traceback(tmp_path, monkeypatch, text):
    """`.a2/studies/NAME.json` says where a study is; cut short or edited, `status`/`resume NAME` name it and say what
    to do (it was a JSONDecodeError or AttributeError traceback)."""
    from a2core.errors import StudyError
    from launch.location import POINTER_DIR, locate

    monkeypatch.chdir(tmp_path)
    (tmp_path / POINTER_DIR).mkdir(parents=True)
    (tmp_path / POINTER_DIR / "foo.json").write_text(text)
    with pytest.raises(StudyError, match=r"\.a2/studies/foo\.json: the pointer to study 'foo' is damaged.*; delete it "
                                         r"\(it only says where the study is\) or pass --storage ROOT"):
        locate("foo")


@pytest.mark.parametrize("text", ['{"down_seconds": 3', '[1]', '{"down_seconds": "x"}'])
def test_a_damaged_outage_file_warns_and_starts_the_figures_again(tmp_path, capsys, text):
    """tracking/outage.json holds figures for people (MLflow down time); a damaged one must not fail the driver that
    writes the study's summary: a warning names it, the figures restart from this driver's and the file is whole
    again."""
    from launch.layout import add_outage
    from launch.location import StudyLocation

    location = StudyLocation("s1", str(tmp_path))
    (tmp_path / "s1" / "tracking").mkdir(parents=True)
    (tmp_path / "s1" / "tracking" / "outage.json").write_text(text)
    totals = add_outage(location, down_seconds=2.0)
    assert totals == {"down_seconds": 2.0, "exported_late": 0, "pending": False}
    assert "outage.json is damaged; the MLflow outage figures start again" in capsys.readouterr().err
    assert json.loads((tmp_path / "s1" / "tracking" / "outage.json").read_text()) == totals
    assert add_outage(location, exported_late=3) == {"down_seconds": 2.0, "exported_late": 3, "pending": False}


def test_synth_replaces_only_a_data_set_and_bad_output_paths_are_one_line(tmp_path, capsys):
    """`a2 data synth --out` replaces its folder whole: a folder that is not a synthetic data set (a typo'd path) is
    refused with its files untouched, as is a file; an output path under a file, or a folder where `decode --out`
    writes a file, is one line naming the path, exit 2 (each was a traceback, or a silent delete with exit 0)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    assert cli(["data", "synth", "--out", str(mine), "--images", "20"]) == 2
    assert "mine: a folder that is not a synthetic data set (it holds no synthetic.json)" in capsys.readouterr().err
    assert os.listdir(mine) == ["thesis.txt"]
    (tmp_path / "afile").write_text("x")
    assert cli(["data", "synth", "--out", str(tmp_path / "afile"), "--images", "20"]) == 2
    assert "afile: is a file, not a folder to write a synthetic data set into" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "afile.old").exists()
    assert cli(["data", "synth", "--out", str(tmp_path / "afile" / "x"), "--images", "20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"a2: error: {tmp_path / 'afile'}") and len(err.splitlines()) == 1
    assert cli(["data", "synth", "--out", str(tmp_path / "syn"), "--images", "20"]) == 0
    # a data set: replaced whole
    assert cli(["data", "synth", "--out", str(tmp_path / "syn"), "--images", "20", "--seed", "1"]) == 0
    assert json.loads((tmp_path / "syn" / "synthetic.json").read_text())["seed"] == 1

    from a2core.atomic import atomic_write

    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError) as err:
        atomic_write(tmp_path / "folder", "{}")
    assert err.value.filename == str(tmp_path / "folder")  # not the temp file's name
    with pytest.raises(NotADirectoryError) as err:
        atomic_write(tmp_path / "afile" / "r.json", "{}")
    assert err.value.filename == str(tmp_path / "afile" / "r.json")


def test_json_nested_too_deep_is_refused_naming_the_file(tmp_path):
    """json recurses per level: 100,000 nested lists raised RecursionError (a traceback) from every JSON reader."""
    from a2core.errors import A2Error
    from a2core.metrics import load_results
    from dashboards.records import load_record

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for read in (load_results, load_record, read_image_info, read_karpathy):
        with pytest.raises(A2Error, match=r"deep\.json: not .*nested too deep to read"):
            read(deep)
    with zipfile.ZipFile(tmp_path / "deep.zip", "w") as zf:
        zf.writestr(VAL_NAME, "[" * 100_000 + "]" * 100_000)
        zf.writestr(TEST_NAME, "[]")
    report = validate_zip(tmp_path / "deep.zip", VAL_IDS, TEST_IDS)
    assert any(p.file == VAL_NAME and p.message == "is JSON nested too deep to read" for p in report.problems)


def test_a_study_past_the_trial_cap_is_refused_at_once(tmp_path):
    """100,000 replicates (200,000 trials): refused by the count before any trial's config is built. The seed list's
    duplicate check was quadratic: minutes before the refusal."""
    out = _measured(f"from launch.spec import load_study\nfrom a2core.errors import ConfigError\n"
                    f"try:\n    load_study({str(ROOT / 'studies' / 'smoke.yaml')!r}, ['search.replicates=100000'], "
                    f"check_files=False)\nexcept ConfigError as err:\n    out = {{'error': str(err)}}")
    assert "search: 200,000 trials (configurations x replicates) is past the cap of 10,000" in out["error"]
    assert out["cpu_s"] < LIMIT_S


def _killed_while_building(args: list[str], parent: Path, pattern: str, cwd: Path) -> list[Path]:
    """Start `a2 ARGS`, SIGKILL it once its building folder (`pattern` in `parent`) holds a file: what it left."""
    from tests.raycluster import a2_command, a2_env
    import signal
    import time

    proc = subprocess.Popen(a2_command(*args), cwd=cwd, env=a2_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(any(p.iterdir()) for p in parent.glob(pattern)):
            assert proc.poll() is None and time.monotonic() < deadline, "finished before it could be killed"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return list(parent.glob(pattern))


def test_a_killed_synth_or_prepare_leaves_a_folder_the_next_run_removes(tmp_path):
    """A SIGKILLed `a2 data synth` / `a2 data prepare` leaves its half-built folder hidden beside the target (for
    a COCO store, gigabytes); the next run on this host removes it. A live process's folder, another host's (a
    shared file system) and anything not named as a building folder are left alone."""
    import socket

    left = _killed_while_building(["data", "synth", "--out", str(tmp_path / "syn"), "--images", "4000"],
                                  tmp_path, ".syn.*.synth", tmp_path)
    assert len(left) == 1 and not (tmp_path / "syn").exists()
    host = socket.gethostname()
    kept = [tmp_path / f".syn.{host}.p{os.getpid()}.live.synth", tmp_path / ".syn.other-node.p1.x.synth",
            tmp_path / ".syn.notes"]
    for folder in kept:
        folder.mkdir()
    assert cli(["data", "synth", "--out", str(tmp_path / "syn"), "--images", "20"]) == 0
    assert not left[0].exists() and all(folder.is_dir() for folder in kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["syn"] + [p.name for p in kept])

    source = tmp_path / "big"
    source.mkdir()
    for i in range(3000):  # a .npz folder: prepare reads one file an image, slow enough to be caught
        np.savez(source / f"{i + 1}.npz", feat=np.ones((2, 4), np.float32))
    left = _killed_while_building(["data", "prepare", str(source), "--out", str(tmp_path / "st"),
                                   "--feature-dim", "4"], tmp_path, ".st.*.prepare", tmp_path)
    assert len(left) == 1 and not (tmp_path / "st").exists()
    for path in source.iterdir():
        if path.name != "1.npz":
            path.unlink()
    assert cli(["data", "prepare", str(source), "--out", str(tmp_path / "st"), "--feature-dim", "4"]) == 0
    assert not left[0].exists() and (tmp_path / "st" / "manifest.json").is_file()


def test_a_runaway_caption_that_exhausts_meteor_is_named_with_its_file_and_image(tmp_path, capsys):
    """A results file with a 100,000-word caption runs METEOR's JVM out of memory (its -Xmx2G, about 10 s): `a2
    evaluate` says so in one line naming the results file and the image (before: 'METEOR failed (Broken pipe)'
    with neither, so a 5,000-image file left its author searching)."""
    data = synthetic.generate(tmp_path / "syn", images=20)
    gts = json.loads(Path(data["captions"]).read_text())["images"]
    test_ids = [im["cocoid"] for im in gts if im["split"] == "test"]
    runaway = test_ids[1]
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": i, "caption": ("a red bus on a road " * 20_000).strip()
                                    if i == runaway else "a red bus"} for i in test_ids]))
    assert cli(["evaluate", "--results", str(results), "--captions", str(data["captions"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the scorers' progress lines: one line
    assert err.startswith(f"a2: error: {results}: METEOR failed on image {runaway} (its caption has 120,000 words)")
    assert "OutOfMemoryError" in err

"""One grammar on every `a2` subcommand: a wrong key or value is refused in one line, `a2: error: ...`, naming it
(exit 2), before anything starts or is written; overrides are `section.key=value` wherever a command takes them;
storage is `--storage ROOT` on every command that names a study (on a study file, its `storage` key)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from launch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "studies" / "smoke.yaml")


def wrong_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """subcommand -> (its argv with one wrong key or value, what the error line must say after `a2: error: `)."""
    missing = str(tmp / "missing")
    storage = ["--storage", str(tmp / "studies")]
    return {
        "data synth": (["data", "synth", "--out", missing, "--images", "0"], "data synth: argument --images"),
        "data prepare": (["data", "prepare", missing, "--out", str(tmp / "store")], missing),
        "data push": (["data", "push", missing, "s3://a2-bucket/x.a2feat"], missing),
        "data fetch": (["data", "fetch", missing, str(tmp / "copy")], missing),
        "train": (["train", "model.d_modle=8"], "model.d_modle: unknown key"),
        "evaluate": (["evaluate", "--results", missing, "--captions", missing], missing),
        "decode": (["decode", "model.d_model=8", "--checkpoints", missing, "--out", str(tmp / "r.json")],
                   "model.d_model: only data.* keys are read here"),
        "study validate": (["study", "validate", SMOKE, "model.d_modle=8"], "model.d_modle: unknown key"),
        "study run": (["study", "run", SMOKE, "model.d_modle=8", *storage], "model.d_modle: unknown key"),
        "study plan": (["study", "plan", SMOKE, "model.d_modle=8"], "model.d_modle: unknown key"),
        "study rehearse": (["study", "rehearse", SMOKE, "model.d_modle=8", *storage], "model.d_modle: unknown key"),
        "study resume": (["study", "resume", "no-such-study", *storage], "no-such-study"),
        "study status": (["study", "status", "no-such-study", *storage], "no-such-study"),
        "study check": (["study", "check", "no-such-study", *storage], "no-such-study"),
        "study compare": (["study", "compare", "no-such-study", *storage], "no-such-study"),
        "report": (["report", "no-such-study", *storage], "no-such-study"),
        "mlflow serve": (["mlflow", "serve", "--port", "0"], "mlflow serve: argument --port"),
        "mlflow sync": (["mlflow", "sync", "no-such-study", *storage], "no-such-study"),
        "results export": (["results", "export", "no-such-study", "--out", str(tmp / "r.json"), *storage],
                           "no-such-study"),
        "results show": (["results", "show", missing], missing),
        "package": (["package", "no-such-study", "model.d_model=8", *storage],
                    "model.d_model: only data.* keys are read here"),
        "submission validate": (["submission", "validate", missing, "--val-images", missing, "--test-images",
                                 missing], missing),
        "pipeline": (["pipeline", "model.d_modle=8", *storage], "model.d_modle: unknown key"),
    }


def leaf_commands(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= leaf_commands(sub, f"{prefix} {name}".strip()) or {f"{prefix} {name}".strip()}
    return found


def test_the_table_covers_every_subcommand(tmp_path):
    assert leaf_commands(build_parser()) == set(wrong_inputs(tmp_path))


@pytest.mark.parametrize("command", sorted(wrong_inputs(Path("/unused"))))
def test_every_subcommand_refuses_a_wrong_input_in_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv, says = wrong_inputs(tmp_path)[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusals exit
        code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith((" ", "usage: "))]
    assert code == 2 and len(err) == 1 and err[0].startswith("a2: error: ") and says in err[0], (code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no study folder made
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_storage_is_said_one_way_on_a_study_file(tmp_path, capsys):
    """`--storage ROOT` is the file's `storage` key: the plan reads it; both given and different is refused."""
    assert main(["study", "validate", SMOKE, "--storage", str(tmp_path / "a")]) == 0
    assert main(["study", "validate", SMOKE, f"storage={tmp_path / 'a'}", "--storage", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["study", "validate", SMOKE, f"storage={tmp_path / 'a'}", "--storage", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip() == (f"a2: error: storage: --storage {tmp_path / 'b'} and the override "
                                               f"storage={tmp_path / 'a'} differ; give one")
    for command in ("validate", "run", "plan", "rehearse"):
        [option] = [a for a in _subparser(command)._actions if "--storage" in a.option_strings]
        assert "storage root" in option.help


def _subparser(name: str) -> argparse.ArgumentParser:
    study = build_parser()._subparsers._group_actions[0].choices["study"]
    return study._subparsers._group_actions[0].choices[name]


def test_a_search_alias_written_as_a_top_level_key_says_what_to_write(capsys):
    assert main(["study", "validate", SMOKE, "fusion=gate"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"a2: error: {SMOKE}: fusion: unknown key here; fusion is a searched key: to give every trial one value write "
        f"search.space.fusion.grid=[VALUE] when the study searches it, else model.fusion=VALUE")


def test_overrides_are_taken_wherever_they_stand_on_the_line(tmp_path, capsys):
    """argparse ends a positional list at the first option: `a2 package NAME --address auto data.features=X` (the
    how-to's line) or `a2 study validate FILE --storage ROOT model.d_model=64` keep their overrides all the same;
    anything else unknown is still refused."""
    from launch.cli import parse

    args = parse(["package", "a2-x", "--storage", str(tmp_path), "--address", "auto", "data.features=/x.a2feat"])
    assert args.overrides == ["data.features=/x.a2feat"] and args.address == "auto"
    args = parse(["study", "validate", SMOKE, "train.xe_epochs=2", "--storage", str(tmp_path), "model.d_model=64"])
    assert args.overrides == ["train.xe_epochs=2", "model.d_model=64"]
    assert main(["study", "validate", SMOKE, "--storage", str(tmp_path), "model.d_modle=64"]) == 2
    assert "model.d_modle: unknown key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        parse(["study", "status", "x", "--storage", str(tmp_path), "model.d_model=64"])  # status takes none
    assert refused.value.code == 2 and "unrecognized arguments: model.d_model=64" in capsys.readouterr().err


def test_a_value_outside_a_keys_fixed_set_is_blamed_on_its_own_key(capsys):
    """`grid: [none, maxx]` says maxx is not a fusion, not that a dependent key's `when` names a missing value."""
    assert main(["study", "validate", SMOKE, "search.space.fusion.grid=[none,maxx]"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"a2: error: {SMOKE}: search.space.fusion.grid: 'maxx' gives an invalid model.fusion: unknown fusion 'maxx': "
        f"must be 'none', 'max', 'moving_average', 'exp_decay' or 'gate'")

"""The `a2` command's one lazy-loading mechanism (launch/cli.py): the parser is built without importing the modules
that do the work, every subcommand names its handler as "module:function", and that module is imported only when
its subcommand runs."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from launch.cli import build_parser, handler

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "mlflow", "scipy", "matplotlib", "pyarrow", "boto3", "pandas", "optuna")


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple, argparse.ArgumentParser]:
    """Every runnable subcommand of the `a2` parser: its words -> its parser."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {path: parser}
    return {k: v for name, child in subs[0].choices.items() for k, v in leaves(child, (*path, name)).items()}


def _loaded_after(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter; what it prints last is JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_subcommand_names_a_function_that_exists():
    commands = leaves(build_parser())
    assert len(commands) >= 20 and ("study", "validate") in commands and ("pipeline",) in commands
    for words, parser in commands.items():
        target = parser.get_default("handler")
        assert isinstance(target, str) and target.count(":") == 1, (words, target)
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), (words, target)


def test_plan_with_rehearsals_is_handled_by_the_rehearsal_module():
    plan = build_parser().parse_args(["study", "plan", "x.yaml"])
    with_rehearsals = build_parser().parse_args(["study", "plan", "x.yaml", "--rehearse", "3"])
    assert plan.handler == "launch.commands.plan:main" and plan.rehearse is None
    assert with_rehearsals.handler == "launch.commands.rehearse:plan_main" and with_rehearsals.rehearse == 3
    assert handler(with_rehearsals).__module__ == "launch.commands.rehearse"


def test_every_help_loads_nothing_heavy():
    """`a2 --help` and each subcommand's `--help`, all in one fresh interpreter: none loads a heavy package."""
    words = [list(w) for w in leaves(build_parser())]
    code = ("import contextlib, io, json, sys\nfrom launch.cli import main\n"
            "for words in [[]] + json.loads(sys.argv[1]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try:\n            main(words + ['--help'])\n        except SystemExit as e:\n"
            "            assert e.code == 0 and 'usage: a2' in out.getvalue(), (words, e.code)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    assert _loaded_after(code, json.dumps(words)) == []


def test_study_plan_loads_no_torch_ray_mlflow_or_matplotlib():
    """`a2 study plan` computes power (scipy) and may read a finished study's storage (pyarrow); nothing more."""
    code = ("import contextlib, io, json, sys\nfrom launch.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    rc = main(['study', 'plan', 'studies/smoke.yaml'])\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print(json.dumps({'rc': rc, 'out': out.getvalue(), 'heavy': heavy}))\n")
    result = _loaded_after(code)
    assert result["rc"] == 0 and "power" in result["out"].lower(), result["out"]
    assert not {"torch", "ray", "mlflow", "matplotlib", "boto3", "optuna"} & set(result["heavy"]), result["heavy"]


def test_study_status_compare_and_report_read_tunes_state_without_ray(tmp_path):
    """`a2 study status`, `a2 study compare` and `a2 report` read Tune's experiment state with plain JSON
    (`launch.verify.experiment_trials`): a finished study's record, its trials in Tune's own state file, is shown
    by a fresh interpreter that loads no Ray, torch, MLflow, boto3, optuna or pandas (matplotlib: the report's)."""
    from tests.studyfolder import fabricated_study
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    fab = fabricated_study(tmp_path, "light", epochs=2)
    folder = Path(fab.location.at().uri)
    storage, trials = experiment_storage(folder), []
    for n, (fusion, seed) in enumerate([("none", 0), ("gate", 0), ("none", 1), ("gate", 1)], 1):
        sampled = {"fusion": fusion, "seed": seed, **({"lambda": 0.05} if fusion == "gate" else {})}
        results = [{"epoch": e, "val/CIDEr": 90.0 + e + 5 * (fusion == "gate") + seed} for e in (1, 2)]
        fab.add(f"t{n}", sampled, results)
        trials.append(tune_trial(storage, f"t{n}", sampled, n, results=results))
    save_experiment_state(folder, trials)
    code = ("import contextlib, io, json, sys\nfrom launch.cli import main\nout, rcs = io.StringIO(), []\n"
            "with contextlib.redirect_stdout(out):\n"
            "    for words in (['study', 'status'], ['study', 'compare'], ['report', '--out', sys.argv[2]]):\n"
            "        rcs.append(main(words + ['light', '--storage', sys.argv[1]]))\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print(json.dumps({'rc': rcs, 'out': out.getvalue(), 'heavy': heavy}))\n")
    result = _loaded_after(code, str(tmp_path / "st"), str(tmp_path / "report"))
    assert result["rc"] == [0, 0, 0], result["out"]
    assert (tmp_path / "report" / "report.html").is_file()
    assert "4/8 trials finished" in result["out"] and "best trial t4" in result["out"], result["out"]
    assert "gate beats none by 5.0 val CIDEr" in result["out"], result["out"]
    assert not {"torch", "ray", "mlflow", "boto3", "optuna", "pandas"} & set(result["heavy"]), result["heavy"]

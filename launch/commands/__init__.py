"""The `a2` command's subcommands and `ray submit`'s entry point, one module per group of commands that load the same
things. A command only composes parts of `launch/` (and `dashboards/`, `a2core/`): it reads its arguments, calls the
parts and prints; it imports no other command, and no part imports a command (tests/test_import_graph.py).
`launch/cli.py`, the parser, names each handler as "launch.commands.module:function" and imports it only when its
subcommand runs. What more than one command reads of the parsed arguments is here."""
from __future__ import annotations

import sys

from a2core.config import ConfigError
from launch.spec import StudySpec, load_study


def driver_options(args) -> dict:
    """`run_study` / `resume_study` options of the parsed driver arguments (`a2 study run|resume`, `submit.py`)."""
    return {"address": args.address, "verbose": not args.quiet, "force": args.force, "stale_after": args.stale_after}



def study_overrides(args) -> list[str]:
    """The study file's key=value overrides, `--storage ROOT` among them as `storage=ROOT`: every command that names a
    study says where it lives the same way. Both given and different: ConfigError naming both."""
    overrides = list(args.overrides or [])
    if storage := getattr(args, "storage", None):
        written = [item for item in overrides if item.partition("=")[0].strip() == "storage"]
        if any(item.partition("=")[2].strip() != storage for item in written):
            raise ConfigError("storage", f"--storage {storage} and the override {written[-1]} differ; give one")
        overrides.append(f"storage={storage}")
    return overrides


def load_study_file(args, check_files: bool = True) -> StudySpec:
    """The study file of `a2 study run|plan ...` with its overrides (`study_overrides`), its warnings printed (a long
    warmup, T_P past the last step) as `a2 study validate` prints them."""
    spec = load_study(args.file, study_overrides(args), check_files=check_files)
    for warning in spec.warnings:
        print(f"a2: warning: {warning}", file=sys.stderr)
    return spec

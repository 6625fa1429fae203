"""Run a study on the Ray cluster this script runs in, as `a2 study run` does: the entry point of `ray submit` and
`ray job submit` (docs/how-to/cluster.md). Exit 0 when every trial finished, 1 otherwise, 2 on an invalid spec.

Where things are found, the same under both routes: Ray 2.60's `ray submit` copies this script to ~/submit.py on the
head and runs `python ~/submit.py ...` from the head's home; `ray job submit --working-dir .` runs it in a copy of
the working directory that Ray unpacks under its session folder (without what .gitignore ignores, so without
data/). A relative study path is the one in the working directory when that exists, else the one in the cluster's
copy of the repository (`--repo`, ~/a2tune, where `ray up` synced this tree and the setup commands fetched the
data); the study's relative data paths always resolve against that copy when it is there (else as `a2 study run`
resolves them: `launch.spec.study_root`). `ray submit` passes arguments unquoted (no spaces in overrides); the
storage and tracking URIs of a study submitted this way are s3://, http(s):// or absolute.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from a2core.errors import A2Error  # noqa: E402 (below: the package is importable only once sys.path has it)
from launch.defaults import add_lease_arguments  # noqa: E402 (argparse and constants: no Ray)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/commands/submit.py", description="run an a2 study on this Ray cluster")
    p.add_argument("study", help="study YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. search.num_samples=4")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else this machine's cluster)")
    p.add_argument("--resume", action="store_true", help="resume the study if it exists already, else run it")
    p.add_argument("--quiet", action="store_true", help="no live trial table")
    add_lease_arguments(p)
    p.add_argument("--repo", default="~/a2tune",
                   help="the cluster's copy of this repository (default ~/a2tune): relative study paths are also "
                        "looked up there, and the study's relative data paths resolve against it")
    return p


def load_submitted(study: str, overrides: list[str], repo: str):
    """The study as the cluster runs it: found in the working directory or below `repo`, its relative data paths
    resolved against `repo` when that is a copy of this repository (else against the study file's own root). An
    override cut in two by `ray submit` (which joins the arguments with spaces into one shell line) is refused
    saying so."""
    from a2core.errors import ConfigError
    from launch.location import study_path
    from launch.spec import is_checkout, load_study

    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "is not key=value: `ray submit` hands the arguments to the head's shell joined by "
                                    "spaces, so an override with a space arrives in pieces; write it without spaces, "
                                    "e.g. search.scheduler={fifo:{}}")

    copy = Path(repo).expanduser()
    return load_study(study_path(study, copy), overrides, root=copy if is_checkout(copy) else None)


def use_cluster_token() -> None:
    """Join a token-authenticated cluster without anything exported: a cluster started by ray-cluster*.yaml keeps
    its token in Ray's default file (~/.ray/auth_token) on the head, but a Ray client still runs with
    authentication disabled (and is refused) unless RAY_AUTH_MODE says `token`. Ray reads the token file itself."""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    use_cluster_token()
    # Ray reads RAY_AUTH_MODE when it is imported: the modules that import Ray only after use_cluster_token set it
    # (imported before, the client would run with authentication off and be refused by the token cluster)
    from launch.commands import driver_options
    from launch.driver import exit_code, resume_study, run_study
    from launch.location import STUDY_FILE, StudyLocation

    try:
        spec = load_submitted(args.study, args.overrides, args.repo)
        print(spec.summary(), flush=True)
        driver = driver_options(args)
        driver["address"] = args.address or os.environ.get("RAY_ADDRESS") or "auto"  # on a head: its cluster
        location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
        if args.resume and location.exists(STUDY_FILE):
            summary = resume_study(location, **driver)
        else:
            summary = run_study(spec, **driver)
    except A2Error as err:  # the same policy as the `a2` command: one line, exit 2; anything else is a bug
        print(f"submit: error: {err}", file=sys.stderr)
        return 2
    code = exit_code(summary)
    if code:
        failed = [t["trial_id"] for t in summary.get("trials", []) if t["state"] != "TERMINATED"]
        print(f"submit: study {spec.name} did not finish cleanly; trials not finished: {', '.join(failed) or '-'}",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

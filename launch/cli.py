"""The `a2` command: its whole parser, built here, and each subcommand's handler named as "module:function" in
`launch/commands/`.

Building the parser imports only argparse and `launch.defaults` (constants and the options `submit.py` shares), so
`a2 --help` and every `a2 ... --help` load none of the modules that do the work. `main` imports the one command
module whose function handles the subcommand given (`launch.commands.validate` for `a2 study validate`,
`launch.commands.plan` for `a2 study plan`, `launch.commands.study` for `a2 study run`, ...), and that module imports
what it needs at its top: `a2 study validate` and `a2 study plan` load no torch, Ray, MLflow or matplotlib
(tests/test_spec.py, tests/test_cli.py; start-up: benchmarks/bench_cli.py).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from a2core.errors import A2Error
from launch.defaults import (LEARNING_DROP, PACKAGE_OUT, PIPELINE_OUT, PIPELINE_STUDY,
                             REHEARSAL_STORAGE, SEEDS, SERVER_IMAGES, SHARD_IMAGES, add_lease_arguments)


def _int_at_least(low: int):
    """An argparse type: an integer >= `low` (argparse names the argument in its error and exits 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number too long for int() (Python's 4300-digit limit)
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text[:40]}")
    return value


def _user_path(text: str) -> str:
    """An argparse type: a local path with `~` expanded, as a study file's paths are (`launch.spec`). The shell
    expands `~` only at a word's start, so `--output-dir=~/runs` reaches here as written; unexpanded, it made a folder
    named `~`."""
    return os.path.expanduser(text)


# every command that names a study takes its storage this one way (on a study file: its `storage` key)
_STORAGE_HELP = "the study's storage root, a folder or s3://bucket/prefix (default: the study file's `storage`)"
_SEEDS_HELP = ("seeds of the ensemble (default: the best configuration's replicates when it has at least "
               f"{len(SEEDS)}, else {' '.join(map(str, SEEDS))})")


class _Parser(argparse.ArgumentParser):
    """argparse's parser with the `a2` command's one error prefix: a wrong argument reads `a2: error: study run:
    argument --address: ...` under the usage line, as a wrong key in a file reads `a2: error: FILE: KEY: ...`."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("a2").strip()
        self.exit(2, f"a2: error: {command + ': ' if command else ''}{message}\n")


def _command(sub, name: str, handler: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose function `handler` ("module:function", called with the parsed arguments) is imported only
    when it runs."""
    parser = sub.add_parser(name, **kwargs)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="a2", description="A2 Transformer studies: train, search, track, package.")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    synth = _command(data, "synth", "launch.commands.data:cmd_synth", help="write the synthetic COCO-format dataset")
    synth.add_argument("--out", type=_user_path, required=True, help="the dataset's folder, e.g. data/synth")
    synth.add_argument("--seed", type=non_negative_int, default=0, help="random seed of the dataset (default 0)")
    synth.add_argument("--images", type=positive_int, default=1500, help="Karpathy-split images (train/val/test)")
    synth.add_argument("--test-images", type=positive_int, default=None, help="test-server images (default images/10)")
    synth.add_argument("--test-split-images", type=positive_int, default=None,
                       help="images of the Karpathy test split (default images/4, as val; more are drawn last)")
    prep = _command(data, "prepare", "launch.commands.local:cmd_data_prepare",
                    help="convert region features (HDF5 or .npz directory) into a prepared store: float16 rows in one "
                         "memory-mappable file, an index and a checksummed manifest, read faster by the same loader "
                         "(data.features: OUT)")
    prep.add_argument("source", type=_user_path,
                      help="features.h5 ({image_id}_features datasets) or a directory of {image_id}.npz")
    prep.add_argument("--out", type=_user_path, required=True,
                      help="the store's folder, e.g. data/coco/features.a2feat (must not exist)")
    prep.add_argument("--feature-dim", type=positive_int, default=2048,
                      help="width of every region's feature vector (default 2048, bottom-up features)")
    push = _command(data, "push", "launch.commands.data:cmd_push",
                    help="upload a prepared store (or one data file) to S3, verified; a store's manifest goes last")
    push.add_argument("store", type=_user_path,
                      help="the store's local folder, or a file (dataset_coco.json, an image list)")
    push.add_argument("uri", help="s3://bucket/prefix/NAME.a2feat")
    push.add_argument("--endpoint-url", default=None, help="any S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")
    fetch = _command(data, "fetch", "launch.commands.data:cmd_fetch",
                     help="copy a prepared store onto this machine, SHA-256 verified; nothing to do when it holds that "
                          "version already (ray-cluster.yaml runs it per node)")
    fetch.add_argument("source", type=_user_path,
                       help="s3://bucket/prefix/NAME.a2feat or a local store folder (or one data file)")
    fetch.add_argument("target", type=_user_path, help="local path, e.g. ~/a2tune/data/coco/features.a2feat")
    fetch.add_argument("--endpoint-url", default=None, help="any S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")

    tr = _command(sub, "train", "launch.commands.local:cmd_train", help="one training run without Ray")
    tr.add_argument("--config", type=_user_path, help="YAML with data/model/train sections (a study file works too)")
    tr.add_argument("--output-dir", default=None, type=_user_path,
                    help="folder for checkpoints, history.json and test_scores.json (default: the config's top-level "
                         "output_dir, runs/a2; a folder holding an earlier run's checkpoints gets a new numbered "
                         "one, runs/a2-2, ...)")
    tr.add_argument("--resume", default=None, type=_user_path, help=(
        "checkpoint file to resume from; the run goes on in that file's run folder when the file is its last.pt "
        "(from another checkpoint of it, best.pt, in a numbered sibling, so the later last.pt is kept), unless "
        "--output-dir names another, which is numbered anew when it holds an earlier run's checkpoints"))
    tr.add_argument("overrides", nargs="*", help="key=value, e.g. model.fusion=max train.xe_epochs=3")

    ev = _command(sub, "evaluate", "launch.commands.local:cmd_evaluate", help="COCO metrics of a results file")
    ev.add_argument("--results", required=True, type=_user_path,
                    help="COCO results JSON: [{\"image_id\": ..., \"caption\": ...}]")
    ev.add_argument("--captions", required=True, type=_user_path, help="Karpathy dataset_coco.json")
    ev.add_argument("--split", default="test", help="Karpathy split to score against: train|val|test (default test)")
    ev.add_argument("--per-image", action="store_true", help="also print every image's scores")
    ev.add_argument("--spice", action="store_true", help="require SPICE (fails if its models are missing)")

    de = _command(sub, "decode", "launch.commands.local:cmd_decode",
                  help="beam-search captions with one checkpoint or an averaging ensemble")
    de.add_argument("--checkpoints", nargs="+", required=True, type=_user_path,
                    help="one checkpoint, or several whose output probabilities are averaged")
    de.add_argument("--split", default="test", help="train|val|test (Karpathy), or test2014/val2014 (server sets)")
    de.add_argument("--out", required=True, type=_user_path, help="the COCO results JSON to write")
    de.add_argument("--beam-size", type=positive_int, default=5, help="beams per image (default 5)")
    de.add_argument("--max-len", type=positive_int, default=20, help="longest caption in tokens (default 20)")
    de.add_argument("--batch-size", type=positive_int, default=50, help="images per beam-search batch (default 50)")
    de.add_argument("overrides", nargs="*", help="data.KEY=VALUE overrides of the checkpoint's data config, e.g. "
                                                 "data.features=/x.h5 (before --checkpoints, or after `--`)")

    _add_study_commands(sub.add_parser("study", help="hyperparameter studies on Ray Tune"))

    rp = _command(sub, "report", "launch.commands.show:cmd_report",
                  help="plots and an HTML page of a study, read from its storage")
    add_name(rp)
    rp.add_argument("--tracking-uri", default=None,
                    help="MLflow store whose study parent run gets the report (default: the study's)")
    rp.add_argument("--out", type=_user_path, default=None,
                    help="report folder (default: ./a2-reports/NAME; one that holds an "
                         "earlier report gets a new numbered folder NAME-2, ...)")

    ml = sub.add_parser("mlflow", help="MLflow tracking server").add_subparsers(dest="mlflow_command", required=True)
    serve = _command(ml, "serve", "launch.commands.serve:cmd_serve", help="start an MLflow tracking server for a team")
    serve.add_argument("--backend-store-uri", default="sqlite:///mlflow.db",
                       help="where runs are kept: sqlite:///path.db or postgresql://user@host/db (default sqlite:///mlflow.db)")
    serve.add_argument("--artifacts-destination", default=None, help="s3://bucket/prefix (default: ./mlartifacts)")
    serve.add_argument("--s3-endpoint-url", default=None, help="any S3-compatible endpoint")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    serve.add_argument("--port", type=positive_int, default=5000, help="port to listen on (default 5000)")  # dashboards.tracking.DEFAULT_PORT
    serve.add_argument("--workers", type=positive_int, default=1, help="server worker processes (default 1)")
    sync = _command(ml, "sync", "launch.commands.study:cmd_sync",
                    help="export a study's record to MLflow (what it missed while the server was down)")
    add_name(sync)
    add_lease_arguments(sync)  # a stale lease of a driver gone elsewhere: taken over as `resume --force` does

    rs = sub.add_parser("results", help="the result records kept under results/: written from a study, printed as "
                                        "tables").add_subparsers(dest="results_command", required=True)
    export = _command(rs, "export", "launch.commands.show:cmd_results_export",
                      help="write the record of `a2 study compare NAME --by KEY` (every trial's scores and per-image "
                           "CIDEr-D), read from the study's storage")
    add_name(export)
    export.add_argument("--by", default="fusion", help="group trials by this config key (default: fusion)")
    export.add_argument("--baseline", default=None, help="the value of --by to compare with (default: fusion none)")
    export.add_argument("--out", type=_user_path, required=True, help="the record file, e.g. results/NAME.json")
    export.add_argument("--spec", default="", help="the study file it was run from, as the record names it")
    export.add_argument("--measured", default="", help="where and when it was measured (machine, date)")
    export.add_argument("--note", default="", help="one line the record's table prints under it")
    show = _command(rs, "show", "launch.commands.show:cmd_results_show",
                    help="print a record's comparison table, recomputed by today's verdict rule")
    show.add_argument("record", type=_user_path, help="a record file, e.g. results/synthetic_fusions.json")

    package = _command(sub, "package", "launch.commands.package:main",
                       help="4-seed ensemble -> COCO server zip, leaderboard, upload")
    package.add_argument("name", help="study name")
    package.add_argument("overrides", nargs="*", help="data.KEY=VALUE overrides for decoding on this machine, e.g. "
                                                      "data.features=/x.h5")
    package.add_argument("--storage", default=None, help=_STORAGE_HELP)
    package.add_argument("--alg", default=None,
                         help="algorithm name in the results file names, [A-Za-z0-9-]+ (default: the study name)")
    package.add_argument("--seeds", nargs="+", type=int, default=None, help=_SEEDS_HELP)
    package.add_argument("--no-train", action="store_true",
                         help="refuse (naming them) instead of training missing seeds")
    package.add_argument("--out", type=_user_path, default=None,
                         help=f"output folder (default: ./{PACKAGE_OUT}/<name>; one that holds "
                              f"an earlier package gets a new numbered folder NAME-2, ...)")
    package.add_argument("--model-name", default=None, help="registered MLflow model name (default: the study name)")
    package.add_argument("--upload", default=None, help="s3://bucket/prefix/ to upload results.zip and the "
                                                        "leaderboard to (default: the study's prefix when on S3)")
    package.add_argument("--s3-endpoint-url", default=None, help="S3-compatible endpoint for --upload")
    package.add_argument("--replace", action="store_true",
                         help="replace a different results.zip/leaderboard.json already at the upload prefix "
                              "(default: refuse, nothing uploaded); says what it replaced")
    package.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the study's)")
    package.add_argument("--beam-size", type=positive_int, default=5, help="beams per image (default 5)")
    package.add_argument("--batch-size", type=positive_int, default=50, help="images per beam-search batch")
    package.add_argument("--shard-images", type=positive_int, default=SHARD_IMAGES,
                         help="images per decoding shard, the unit a killed package does not decode again")
    package.add_argument("--workers", type=non_negative_int, default=None,
                         help="Ray decoding tasks (default: one per GPU, else per CPU); 0 decodes in this process")
    package.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else local)")
    package.add_argument("--val-images", default=None, help="COCO image-info JSON of val2014 (default: the data's)")
    package.add_argument("--test-images", default=None, help="image_info_test2014.json (default: the data's)")
    package.add_argument("--quiet", action="store_false", dest="verbose", help="no live trial table while seeds train")
    package.add_argument("--estimate", action="store_true",
                         help="only state the decoding's cost: images and shards to decode, the ensemble's seconds "
                              "per image measured here on a few images (copies of the best checkpoint), and "
                              f"the time for them and for the server's {SERVER_IMAGES:,} images; trains and writes "
                              "nothing")

    sv = sub.add_parser("submission", help="COCO server submissions").add_subparsers(dest="sub_command", required=True)
    val = _command(sv, "validate", "launch.commands.validate:cmd_submission_validate",
                   help="check a results.zip against the server's image lists")
    val.add_argument("zip", help="the results.zip to check")
    val.add_argument("--val-images", required=True, help="COCO image-info JSON of val2014")
    val.add_argument("--test-images", required=True, help="image_info_test2014.json")
    val.add_argument("--alg", default=None, help="the algorithm name the file names must carry (default: any one)")

    pipeline = _command(sub, "pipeline", "launch.commands.pipeline:main",
                        help="the main job: smoke study, report, packaging, leaderboard")
    pipeline.add_argument("--study", type=_user_path, default=PIPELINE_STUDY,
                          help=f"study file (default: {PIPELINE_STUDY})")
    pipeline.add_argument("overrides", nargs="*", help="key=value overrides of the study, e.g. train.xe_epochs=2")
    pipeline.add_argument("--out", type=_user_path, default=None,
                          help=f"report and package folder (default: ./{PIPELINE_OUT}/<name>)")
    pipeline.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (overrides tracking.mlflow_uri)")
    pipeline.add_argument("--storage", default=None, help=_STORAGE_HELP)
    pipeline.add_argument("--seeds", nargs="+", type=int, default=None, help=_SEEDS_HELP)
    pipeline.add_argument("--alg", default=None, help="algorithm name in the results file names (default: study name)")
    pipeline.add_argument("--beam-size", type=positive_int, default=5, help="beams per image (default 5)")
    pipeline.add_argument("--workers", type=non_negative_int, default=None, help="Ray decoding tasks; 0 decodes in this process")
    pipeline.add_argument("--upload", default=None, help="s3://bucket/prefix/ for results.zip and the leaderboard")
    pipeline.add_argument("--replace", action="store_true",
                          help="replace a different results.zip/leaderboard.json already at the upload prefix "
                               "(default: refuse, nothing uploaded); says what it replaced")
    pipeline.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else local)")
    pipeline.add_argument("--quiet", action="store_true", help="no live trial tables")
    return p


# -- a2 study ------------------------------------------------------------------------------------------------------
def _add_study_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study_command", required=True)
    validate = _command(sub, "validate", "launch.commands.validate:cmd_validate",
                        help="validate a study file completely (nothing starts)")
    _add_study_file(validate)
    validate.add_argument("--cluster", type=_user_path, default=None, metavar="CLUSTER_YAML",
                          help="also check each S3 copy of the study's data that this cluster-launcher file's setup "
                               "commands fetch (`a2 data fetch`): there, and the same version as the local copy")

    run = _command(sub, "run", "launch.commands.study:cmd_run",
                   help="run a study on Ray Tune (a local Ray unless --address / RAY_ADDRESS)")
    _add_study_file(run)
    _add_driver_arguments(run)

    resume = _command(sub, "resume", "launch.commands.study:cmd_resume",
                      help="continue an interrupted study: finished trials stay, others resume")
    add_name(resume)
    _add_driver_arguments(resume)
    resume.add_argument("--restore-state", action="store_true",
                        help="first put back the whole copy (state-copies/) of each of Tune's files that is unreadable, "
                             "e.g. cut short by a full disk; each one put back is named")

    status = _command(sub, "status", "launch.commands.show:cmd_status", help="the trial table of a study, read from its storage")
    add_name(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--watch", type=_positive_float, nargs="?", const=30.0, default=None, metavar="SECONDS",
                        help="print it again every SECONDS (default 30) until every trial has ended or no driver "
                             "runs the study (Ctrl-C stops it: exit 130)")

    check = _command(sub, "check", "launch.commands.check:cmd_check",
                     help="verify a study's saved state and every checkpoint (exit 1 if one is unreadable, damaged or "
                          "mismatched; 2 if there is no such study or it cannot be read at all)")
    add_name(check)

    compare = _command(sub, "compare", "launch.commands.show:cmd_compare",
                       help="configurations of a study side by side, read from its storage")
    add_name(compare)
    compare.add_argument("--by", default="fusion", help="group trials by this config key (default: fusion)")
    compare.add_argument("--baseline", default=None, help="the value of --by to compare with (default: fusion none)")

    plan = _command(sub, "plan", "launch.commands.plan:main",
                    help="a study's steps, schedule, seeds and power, GPU-hours and cost, before it runs")
    _add_study_file(plan)
    plan.add_argument("--sd", type=float, default=None,
                      help="seed standard deviation of a seed's mean CIDEr (x100); default: measured in the study's "
                           "runs (their per-image scores where they have them)")
    plan.add_argument("--delta", type=float, nargs="+", default=None,
                      help="CIDEr differences to resolve (x100); default: the paper's Table 3 gaps")
    plan.add_argument("--images-per-second", type=float, default=None,
                      help="training images per second per GPU (default: the newest GPU record's for the study's "
                           "mode, benchmarks/records/gpu/, else the estimate in benchmarks/RESULTS.md)")
    plan.add_argument("--price-per-hour", type=float, default=None,
                      help="price of a worker node per hour (default: the on-demand list price of its type)")
    plan.add_argument("--cluster", type=_user_path,
                      default=str(Path(__file__).resolve().parents[1] / "ray-cluster.yaml"),
                      help="cluster-launcher file whose node types price the study: its GPU worker types and its head "
                           "(default: ray-cluster.yaml)")
    plan.add_argument("--rehearse", type=int, default=None, metavar="N", action=_Rehearse,
                      help="also N rehearsals without Ray (launch.rehearse): power and the chance of keeping the best "
                           "configuration with the study's early stopping, next to the closed-form power")
    _add_model_arguments(plan)

    rehearse = _command(sub, "rehearse", "launch.commands.rehearse:main",
                        help="every trial of a study through the real driver, scheduler, record and MLflow export, "
                             "with a stand-in trainer drawing scores from a stated model (nothing trains; never "
                             "packageable)")
    rehearse.add_argument("file", type=_user_path, help="the study file")
    rehearse.add_argument("overrides", nargs="*", help="key=value, e.g. search.replicates=3")
    _add_model_arguments(rehearse)
    rehearse.add_argument("--repeat", type=int, default=1,
                          help="rehearsals, each with new noise draws: the first on Ray, the rest without it (the same "
                               "searcher, scheduler and comparison code)")
    rehearse.add_argument("--time-scale", type=float, default=0.0,
                          help="a stand-in epoch sleeps the plan's epoch time x this (default 0: no sleeping)")
    rehearse.add_argument("--epoch-seconds", type=float, default=None,
                          help="an epoch's time on the cluster (default: the plan's estimate)")
    rehearse.add_argument("--storage", default=REHEARSAL_STORAGE,
                          help=f"the rehearsal's storage root, a folder or s3://bucket/prefix "
                               f"(default {REHEARSAL_STORAGE})")
    rehearse.add_argument("--tracking-uri", default=None, help="MLflow store (default: an SQLite file in --storage)")
    rehearse.add_argument("--address", default=None, help="Ray cluster to join (default: a local Ray with the study's "
                                                          "GPUs declared)")
    rehearse.add_argument("--quiet", action="store_true", help="no live trial table")


class _Rehearse(argparse.Action):
    """`a2 study plan --rehearse N`: the plan with rehearsals is handled by `launch.commands.rehearse` (Ray and
    optuna), the plan alone by `launch.commands.plan` (neither)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.handler = "launch.commands.rehearse:plan_main"


def _add_study_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=_user_path, help="the study file")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. search.num_samples=2 model.d_model=64")
    parser.add_argument("--storage", default=None, help=_STORAGE_HELP)


def _study_name(text: str) -> str:
    """An argparse type: a study's name, refusing a study file's path (`a2 study status studies/smoke.yaml`) with the
    name to give instead; the name's own rule is `launch.location.check_name`'s."""
    # a name is lowercase letters, digits and '-': a file of that name in the working folder is no mistake
    looks_like_path = "/" in text or "." in text
    if not (text.lower().endswith((".yaml", ".yml")) or (looks_like_path and Path(os.path.expanduser(text)).is_file())):
        return text
    name = None
    try:  # only on this mistake: yaml is not imported to parse a right command line
        import yaml

        name = (yaml.safe_load(Path(os.path.expanduser(text)).read_text(encoding="utf-8")) or {}).get("name")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass
    named = f", here `{name}`" if isinstance(name, str) else ""
    raise argparse.ArgumentTypeError(f"{text[:200]!r} is a study file; give the study's name (its `name:` key{named})")


def _storage_root(text: str) -> str:
    """An argparse type: a storage root, refusing a local file (it read as "lease.json: Not a directory")."""
    if "://" not in text and os.path.isfile(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text[:200]}: a file, not a storage folder (a folder or s3://bucket/prefix)")
    return text


def add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", type=_study_name, help="the study's name (its `name:` key)")
    parser.add_argument("--storage", type=_storage_root, default=None,
                        help="the study's storage root (default: where `run` put it)")


def _add_driver_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else local)")
    parser.add_argument("--quiet", action="store_true", help="no live trial table")
    add_lease_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The score model of a rehearsal (`launch.rehearse.score_model`)."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise draws (rehearsals are reproducible)")
    parser.add_argument("--from-record", default=None, metavar="RECORD",
                        help="a results record (results/*.json) whose arms' means and noise the scores are drawn "
                             "from (default: the paper's Table 3 by fusion, the plan's noise)")
    parser.add_argument("--mean", action="append", default=None, metavar="VALUE=CIDER",
                        help="a configuration's true mean by its fusion (or the record's key), e.g. gate=123.5")
    parser.add_argument("--drop", type=float, default=LEARNING_DROP,
                        help=f"the learning curve's drop: epoch e of E at 1 - drop (1 - e/E)^2 of the final mean "
                             f"(default {LEARNING_DROP})")


def handler(args: argparse.Namespace):
    """The function that handles the parsed subcommand, its module imported now."""
    module, _, function = args.handler.partition(":")
    return getattr(importlib.import_module(module), function)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, `key=value` overrides taken wherever they stand: argparse ends a positional list at
    the first option, so `a2 package NAME --address auto data.features=X` would leave the override unparsed."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if extra and (overrides != extra or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*(args.overrides or []), *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:  # output still buffered meets a closed pipe here, inside the try, not in the flush at exit
            sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`a2 ... | head -1`): what it did not read is not wanted, so no traceback. Python
        # flushes stdout again at exit, which would raise once more: point it at devnull first, and exit 1, as
        # Python itself does on EPIPE (https://docs.python.org/3/library/signal.html#note-on-sigpipe)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _run(argv: list[str] | None) -> int:
    args = parse(argv)
    try:
        return int(handler(args)(args) or 0)
    except A2Error as err:
        print(f"a2: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:  # not about a path the user named: a bug's traceback is worth more than a line
            raise
        # a path that cannot be read or written (a folder where a file goes, a file where a folder goes, read-only,
        # full): one line naming it, as every refusal of bad input is
        print(f"a2: error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("a2: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `a2` command. Each subcommand is a thin function over the package that owns the work.

Torch, Ray, MLflow, scipy and matplotlib are imported inside the command functions (or the modules' functions that
need them), so that `a2 --help` and `a2 study validate` load none of them and answer in well
under a second (tests/test_spec.py checks the modules).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from a2core.atomic import atomic_write, fresh_folder
from a2core.config import Config, apply_overrides, load_yaml
from a2core.data.captions import read_image_info
from a2core.data.synthetic import generate
from a2core.errors import A2Error
from dashboards.submission import validate_zip
from launch import package, pipeline, study
from launch.datastore import fetch, push
from launch.spec import SECTIONS, TOP_KEYS, check_sizes


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


# -- data / train / evaluate / decode ---------------------------------------------------------------------------
def cmd_data_synth(args) -> int:
    paths = generate(args.out, seed=args.seed, images=args.images, test_images=args.test_images,
                     test_split_images=args.test_split_images)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def cmd_data_prepare(args) -> int:
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        rate = done / max(time.monotonic() - started, 1e-9)
        print(f"\r{done}/{total} images  {rate:.0f}/s  about {(total - done) / max(rate, 1e-9):.0f}s left",
              end="" if done < total else "\n", file=sys.stderr, flush=True)

    from a2core.data.features import prepare  # torch: only when a store is prepared (`a2 --help` stays light)

    manifest = prepare(args.source, args.out, feature_dim=args.feature_dim, progress=progress)
    print(json.dumps({"store": args.out, **{k: manifest[k] for k in ("images", "rows", "feature_dim", "checksum")}},
                     indent=2))
    return 0


def cmd_data_fetch(args) -> int:
    print(json.dumps(fetch(args.source, args.target, endpoint_url=args.endpoint_url), indent=2))
    return 0


def cmd_data_push(args) -> int:
    manifest = push(args.store, args.uri, endpoint_url=args.endpoint_url)
    print(json.dumps({"uri": args.uri, **{k: v for k, v in manifest.items() if k in ("checksum", "sha256")}},
                     indent=2))
    return 0


def training_config(path: str | None, overrides: list[str]):
    """The a2core config of a config file or of a study file (its data / model / train sections; the search, at
    its defaults, is left out), with `key=value` overrides."""
    raw = load_yaml(path) if path else {}
    if path and ("name" in raw or "search" in raw):  # a study file
        study_only = set(TOP_KEYS) - set(SECTIONS)
        raw = {k: v for k, v in raw.items() if k not in study_only}
    config = Config.from_dict(apply_overrides(raw, overrides or [], source=path), source=path)
    check_sizes(config.to_dict(), path)  # a size past its cap (data.images=1e9): refused before any data is made
    return config


def cmd_train(args) -> int:
    from a2core.train import train  # torch: only in the commands that train, decode or score (`a2 --help` is fast)

    cfg = training_config(args.config, args.overrides)
    out = Path(args.output_dir or cfg.output_dir)
    if args.resume is None:
        out = fresh_folder(out, ("best.pt", "last.pt"), "run's checkpoints")
    result = train(cfg, report=_print_report, output_dir=out, resume_from=args.resume)
    history = atomic_write(out / "history.json", json.dumps(result["history"], indent=1))
    print(f"best val/CIDEr {result['best/val/CIDEr']:.2f} at epoch {result['best_epoch']} of {result['epochs']}")
    print(_test_summary(result, cfg, out))
    print(f"checkpoint: {result['best_checkpoint']}\nhistory:    {history}")
    return 0


def _test_summary(result: dict, cfg, out: Path) -> str:
    """The end-of-run test evaluation (the best epoch's checkpoint, beam search) as one line on the x100 scale, and
    kept in OUT/test_scores.json (written whole or not at all); or why the test split was not scored."""
    from a2core.metrics import METRIC_NAMES

    test = result.get("test") or {}
    scores = {name: test[f"test/{name}"] for name in METRIC_NAMES if f"test/{name}" in test}
    if not scores:
        why = ("train.test_at_end is false" if not cfg.train.test_at_end
               else "no test images, or no copy of the best checkpoint here")
        return f"test: not scored ({why})"
    per_image = result.get("test_per_image_cider") or {"ids": [], "scores": []}
    record = {"split": "test", "checkpoint": result["best_checkpoint"], "epoch": test.get("test/epoch"),
              "beam_size": cfg.train.beam_size, "images": len(per_image["ids"]), "scores": scores,
              "per_image_cider": dict(zip(map(str, per_image["ids"]), per_image["scores"]))}
    path = atomic_write(out / "test_scores.json", json.dumps(record, indent=1))
    shown = "  ".join(f"{name} {value:.2f}" for name, value in scores.items())
    return (f"test (epoch {record['epoch']}, beam {record['beam_size']}, {record['images']} images, x100): {shown}\n"
            f"test scores: {path}")


def _print_report(metrics: dict, checkpoint_dir) -> None:
    """One line per epoch: the scalar training and validation metrics (per-layer diagnostics left to the file)."""
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
             if isinstance(v, (int, float)) and (k.startswith(("train/", "val/")) and "/jsd/" not in k)]
    print(f"epoch {metrics['epoch']}: " + "  ".join(shown), flush=True)


def cmd_evaluate(args) -> int:
    from a2core.metrics import evaluate_results_file  # torch: as in `cmd_train`

    scores = evaluate_results_file(args.results, args.captions, split=args.split, per_image=args.per_image,
                                   spice=True if args.spice else None)
    print(json.dumps(scores, indent=2))
    return 0


def cmd_decode(args) -> int:
    from a2core.decode import decode_to_file  # torch: as in `cmd_train`

    out = decode_to_file(args.checkpoints, split=args.split, out=args.out, beam_size=args.beam_size,
                         max_len=args.max_len, batch_size=args.batch_size, data_overrides=args.data)
    print(json.dumps(out, indent=2))
    return 0


# -- studies and what follows them -----------------------------------------------------------------------------
def cmd_mlflow_serve(args) -> int:
    from dashboards.tracking import serve  # mlflow: only when a server starts

    return serve(args)


def cmd_results_export(args) -> int:
    from dashboards.records import export_record  # scipy: only when a record is written
    from launch.location import locate
    from launch.record import StudyRecord

    study_view = StudyRecord.load(locate(args.name, args.storage)).study()
    export_record(study_view, args.by, args.out, spec=args.spec, baseline=args.baseline, measured=args.measured,
                  note=args.note)
    print(f"record: {args.out}")
    return 0


def cmd_results_show(args) -> int:
    from dashboards.records import load_record, render_table  # scipy: only when a record is read

    print(render_table(load_record(args.record)))
    return 0


def cmd_submission_validate(args) -> int:
    report = validate_zip(args.zip, read_image_info(args.val_images), read_image_info(args.test_images), alg=args.alg)
    print(report)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a2", description="A2 Transformer studies: train, search, track, package.")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write the synthetic COCO-format dataset")
    synth.add_argument("--out", required=True, help="the dataset's folder, e.g. data/synth")
    synth.add_argument("--seed", type=non_negative_int, default=0, help="random seed of the dataset (default 0)")
    synth.add_argument("--images", type=positive_int, default=1500, help="Karpathy-split images (train/val/test)")
    synth.add_argument("--test-images", type=positive_int, default=None, help="test-server images (default images/10)")
    synth.add_argument("--test-split-images", type=positive_int, default=None,
                       help="images of the Karpathy test split (default images/4, as val; more are drawn last)")
    synth.set_defaults(func=cmd_data_synth)
    prep = data.add_parser("prepare", help="convert region features (HDF5 or .npz directory) into a prepared store: "
                                           "float16 rows in one memory-mappable file, an index and a checksummed "
                                           "manifest, read faster by the same loader (data.features: OUT)")
    prep.add_argument("source", help="features.h5 ({image_id}_features datasets) or a directory of {image_id}.npz")
    prep.add_argument("--out", required=True, help="the store's folder, e.g. data/coco/features.a2feat (must not exist)")
    prep.add_argument("--feature-dim", type=positive_int, default=2048,
                      help="width of every region's feature vector (default 2048, bottom-up features)")
    prep.set_defaults(func=cmd_data_prepare)
    push = data.add_parser("push", help="upload a prepared store (or one data file) to S3, verified; a store's "
                                        "manifest goes last")
    push.add_argument("store", help="the store's local folder, or a file (dataset_coco.json, an image list)")
    push.add_argument("uri", help="s3://bucket/prefix/NAME.a2feat")
    push.add_argument("--endpoint-url", default=None, help="any S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")
    push.set_defaults(func=cmd_data_push)
    fetch = data.add_parser("fetch", help="copy a prepared store onto this machine, SHA-256 verified; nothing to do "
                                          "when it holds that version already (ray-cluster.yaml runs it per node)")
    fetch.add_argument("source", help="s3://bucket/prefix/NAME.a2feat or a local store folder (or one data file)")
    fetch.add_argument("target", help="local path, e.g. ~/a2tune/data/coco/features.a2feat")
    fetch.add_argument("--endpoint-url", default=None, help="any S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")
    fetch.set_defaults(func=cmd_data_fetch)

    tr = sub.add_parser("train", help="one training run without Ray")
    tr.add_argument("--config", help="YAML with data/model/train sections (a study file works too)")
    tr.add_argument("--output-dir", default=None,
                    help="folder for checkpoints, history.json and test_scores.json (default: train.output_dir)")
    tr.add_argument("--resume", default=None, help="checkpoint file to resume from")
    tr.add_argument("overrides", nargs="*", help="key=value, e.g. model.fusion=max train.xe_epochs=3")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("evaluate", help="COCO metrics of a results file")
    ev.add_argument("--results", required=True, help="COCO results JSON: [{\"image_id\": ..., \"caption\": ...}]")
    ev.add_argument("--captions", required=True, help="Karpathy dataset_coco.json")
    ev.add_argument("--split", default="test", help="Karpathy split to score against: train|val|test (default test)")
    ev.add_argument("--per-image", action="store_true", help="also print every image's scores")
    ev.add_argument("--spice", action="store_true", help="require SPICE (fails if its models are missing)")
    ev.set_defaults(func=cmd_evaluate)

    de = sub.add_parser("decode", help="beam-search captions with one checkpoint or an averaging ensemble")
    de.add_argument("--checkpoints", nargs="+", required=True,
                    help="one checkpoint, or several whose output probabilities are averaged")
    de.add_argument("--split", default="test", help="train|val|test (Karpathy), or test2014/val2014 (server sets)")
    de.add_argument("--out", required=True, help="the COCO results JSON to write")
    de.add_argument("--beam-size", type=positive_int, default=5, help="beams per image (default 5)")
    de.add_argument("--max-len", type=positive_int, default=20, help="longest caption in tokens (default 20)")
    de.add_argument("--batch-size", type=positive_int, default=50, help="images per beam-search batch (default 50)")
    de.add_argument("--data", nargs="*", default=[], help="data.* overrides, e.g. data.features=/x.h5")
    de.set_defaults(func=cmd_decode)

    st = sub.add_parser("study", help="hyperparameter studies on Ray Tune")
    study.add_arguments(st)
    st.set_defaults(func=study.main)

    rp = sub.add_parser("report", help="plots and an HTML page of a study, read from its storage")
    study.add_name(rp)
    rp.add_argument("--tracking-uri", default=None,
                    help="MLflow store whose study parent run gets the report (default: the study's)")
    rp.add_argument("--out", default=None, help="report folder (default: ./a2-reports/NAME; one that holds an "
                                                "earlier report gets a new numbered folder NAME-2, ...)")
    rp.set_defaults(func=study.cmd_report)

    ml = sub.add_parser("mlflow", help="MLflow tracking server").add_subparsers(dest="mlflow_command", required=True)
    serve = ml.add_parser("serve", help="start an MLflow tracking server for a team")
    serve.add_argument("--backend-store-uri", default="sqlite:///mlflow.db",
                       help="where runs are kept: sqlite:///path.db or postgresql://user@host/db (default sqlite:///mlflow.db)")
    serve.add_argument("--artifacts-destination", default=None, help="s3://bucket/prefix (default: ./mlartifacts)")
    serve.add_argument("--s3-endpoint-url", default=None, help="any S3-compatible endpoint")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    serve.add_argument("--port", type=positive_int, default=5000, help="port to listen on (default 5000)")  # dashboards.tracking.DEFAULT_PORT
    serve.add_argument("--workers", type=positive_int, default=1, help="server worker processes (default 1)")
    serve.set_defaults(func=cmd_mlflow_serve)
    sync = ml.add_parser("sync", help="export a study's record to MLflow (what it missed while the server was down)")
    study.add_name(sync)
    sync.set_defaults(func=study.cmd_sync)

    rs = sub.add_parser("results", help="the result records kept under results/: written from a study, printed as "
                                        "tables").add_subparsers(dest="results_command", required=True)
    export = rs.add_parser("export", help="write the record of `a2 study compare NAME --by KEY` (every trial's "
                                          "scores and per-image CIDEr-D), read from the study's storage")
    study.add_name(export)
    export.add_argument("--by", default="fusion", help="group trials by this config key (default: fusion)")
    export.add_argument("--baseline", default=None, help="the value of --by to compare with (default: fusion none)")
    export.add_argument("--out", required=True, help="the record file, e.g. results/NAME.json")
    export.add_argument("--spec", default="", help="the study file it was run from, as the record names it")
    export.add_argument("--measured", default="", help="where and when it was measured (machine, date)")
    export.add_argument("--note", default="", help="one line the record's table prints under it")
    export.set_defaults(func=cmd_results_export)
    show = rs.add_parser("show", help="print a record's comparison table, recomputed by today's verdict rule")
    show.add_argument("record", help="a record file, e.g. results/synthetic_fusions.json")
    show.set_defaults(func=cmd_results_show)

    pk = sub.add_parser("package", help="4-seed ensemble -> COCO server zip, leaderboard, upload")
    package.add_arguments(pk)
    pk.set_defaults(func=package.main)

    sv = sub.add_parser("submission", help="COCO server submissions").add_subparsers(dest="sub_command", required=True)
    val = sv.add_parser("validate", help="check a results.zip against the server's image lists")
    val.add_argument("zip", help="the results.zip to check")
    val.add_argument("--val-images", required=True, help="COCO image-info JSON of val2014")
    val.add_argument("--test-images", required=True, help="image_info_test2014.json")
    val.add_argument("--alg", default=None, help="the algorithm name the file names must carry (default: any one)")
    val.set_defaults(func=cmd_submission_validate)

    pl = sub.add_parser("pipeline", help="the main job: smoke study, report, packaging, leaderboard")
    pipeline.add_arguments(pl)
    pl.set_defaults(func=pipeline.main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except A2Error as err:
        print(f"a2: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("a2: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

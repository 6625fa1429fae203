"""`a2 data prepare`, `a2 train`, `a2 evaluate` and `a2 decode`: a2core's work on this machine, without Ray
or MLflow (the `a2` command's parser, launch/cli.py, names these functions)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from a2core.atomic import atomic_write, check_output_path, fresh_folder
from a2core.checkpoint import HISTORY_FILE
from a2core.config import Config, apply_overrides, check_data_kind, get_dotted, load_yaml, set_dotted
from a2core.data.features import prepare
from a2core.decode import decode_to_file
from a2core.errors import CheckpointError, ConfigError, folder_instead
from a2core.metrics import METRIC_NAMES, evaluate_results_file
from a2core.train import StepProgress, train
from launch.spec import DATA_PATHS, SECTIONS, TOP_KEYS, check_runnable, study_root


def cmd_data_prepare(args) -> int:
    # an empty --out, or one under a file, named as such (it read ".: exists already" or "x.h5: File exists")
    check_output_path(args.out, "--out", folder=True)
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        rate = done / max(time.monotonic() - started, 1e-9)
        print(f"\r{done}/{total} images  {rate:.0f}/s  about {(total - done) / max(rate, 1e-9):.0f}s left",
              end="" if done < total else "\n", file=sys.stderr, flush=True)

    manifest = prepare(args.source, args.out, feature_dim=args.feature_dim, progress=progress)
    print(json.dumps({"store": args.out, **{k: manifest[k] for k in ("images", "rows", "feature_dim", "checksum")}},
                     indent=2))
    return 0


def training_config(path: str | None, overrides: list[str]):
    """The a2core config of a config file or of a study file (its data / model / train sections; the search, at
    its defaults, is left out), with `key=value` overrides. With a file, relative data paths (in it or in an
    override) mean what they mean to a study of that file: against its root (`launch.spec.study_root`), not the
    working directory; without one, the working directory's."""
    raw = load_yaml(path) if path else {}
    if path and ("name" in raw or "search" in raw):  # a study file
        study_only = set(TOP_KEYS) - set(SECTIONS)
        raw = {k: v for k, v in raw.items() if k not in study_only}
    raw = apply_overrides(raw, overrides or [], source=path)
    check_data_kind(raw.get("data"), path)
    if path:
        root = study_root(path)
        for key in DATA_PATHS:
            value = get_dotted(raw, key)
            if isinstance(value, str) and value and "://" not in value:
                set_dotted(raw, key, os.path.normpath(os.path.join(root, os.path.expanduser(value))))
    config = Config.from_dict(raw, source=path)
    check_runnable(config.to_dict(), path)  # a size past its cap (data.images=1e9), SCST with nothing to start from
    return config


def cmd_train(args) -> int:
    cfg = training_config(args.config, args.overrides)
    if args.output_dir is not None and not args.output_dir.strip():
        raise ConfigError("--output-dir", "is empty; name the folder for the run's checkpoints")
    # "runs/a2 holds an earlier run's ...; this run writes to runs/a2-3" is said once the run starts: a2core still
    # refuses a checkpoint or data that do not fit, and a refused run writes nowhere
    numbered: list[str] = []
    out, best_from = resumed_output(args.resume, args.output_dir, cfg.output_dir, say=numbered.append)
    # before the first epoch, not when its checkpoint is saved: a file in the way fails now
    check_output_path(out, "--output-dir" if args.output_dir is not None else "output_dir", folder=True,
                      source=None if args.output_dir is not None else args.config)

    def started() -> None:
        for line in numbered:
            print(line, flush=True)

    def report(metrics: dict, checkpoint_dir) -> None:
        _print_report(metrics, checkpoint_dir)
        if checkpoint_dir is not None:  # the history so far, with each epoch's checkpoint: a killed run keeps it
            history = json.loads((Path(checkpoint_dir) / HISTORY_FILE).read_text())
            atomic_write(out / "history.json", json.dumps(history, indent=1))

    with _progress_shown(sys.stderr) as progress:
        result = train(cfg, report=report, output_dir=out, resume_from=args.resume, best_from=best_from,
                       progress=progress, started=started)
    history = atomic_write(out / "history.json", json.dumps(result["history"], indent=1))
    print(f"best val/CIDEr {result['best/val/CIDEr']:.2f} at epoch {result['best_epoch']} of {result['epochs']}")
    print(_test_summary(result, cfg, out))
    print(f"checkpoint: {result['best_checkpoint'] or 'none (no copy of the best epoch here)'}\n"
          f"history:    {history}")
    return 0


def resumed_output(resume: str | None, output_dir: str | None, configured: str,
                   say=None) -> tuple[Path, Path | None]:
    """(the folder `a2 train` writes to, the best checkpoint so far when that is in another folder). A new run: the
    given or configured folder, numbered anew when it holds an earlier run's checkpoints. A resumed run goes on in
    the folder of the checkpoint it resumes from when that is a run's folder (best.pt or last.pt in it), no other
    folder is given (or that one is) and the checkpoint is that folder's newest (its last.pt); elsewhere never into
    a run's checkpoints, and its best.pt so far is read from its own folder. `say`: where a numbered folder's note
    goes (`fresh_folder`; printed when None)."""
    checkpoints = ("best.pt", "last.pt")
    if resume is None:
        return fresh_folder(output_dir or configured, checkpoints, "run's checkpoints", say), None
    if not Path(resume).is_file():
        why = folder_instead(resume, "checkpoint file (name its last.pt or best.pt)")
        raise CheckpointError(f"--resume {why or f'{resume}: no such checkpoint file'}")
    own = Path(resume).parent  # as given: the paths `a2 train` prints are the user's
    is_run = any((own / name).exists() for name in checkpoints)
    newest = own / "last.pt"
    out = Path(output_dir) if output_dir is not None else own if is_run else Path(configured)
    # an earlier checkpoint of the run (its best.pt), whether or not --output-dir names the run's folder: going on
    # there would write over the later last.pt, history and test scores, so it goes on in a numbered sibling, its
    # best so far read from here
    if out.resolve() == own.resolve() and (not newest.exists() or Path(resume).resolve() == newest.resolve()):
        return out, None
    best = own / "best.pt"
    return (fresh_folder(out, checkpoints, "run's checkpoints", say),
            best if is_run and best.is_file() else None)


@contextmanager
def _progress_shown(stream):
    """Progress within an epoch for `a2 train`, on `stream`: on a terminal a bar per epoch (`_EpochBar`), elsewhere
    (a log file, a pipe) a2core's `train.log_every` step lines; a2core's other INFO lines and warnings in both. Yields
    `train`'s `progress` callback (None without a terminal: the step lines are the progress)."""
    terminal = stream.isatty()
    bar = _EpochBar(stream) if terminal else None
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    if terminal:  # the bar shows what the step lines would; lines write above it
        handler.addFilter(lambda record: record.funcName != "_step_done")
        handler.setStream(_AboveBar(stream))
    logger = logging.getLogger("a2core")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield bar
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if bar is not None:
            bar.close()


class _EpochBar:
    """One tqdm bar per epoch: its optimizer steps, rate and time left, the running loss at the log points."""

    def __init__(self, stream):
        self.stream, self.bar, self.epoch = stream, None, None

    def __call__(self, progress: StepProgress) -> None:
        if self.bar is None or self.epoch != progress.epoch:
            self.close()
            self.epoch = progress.epoch
            self.bar = tqdm(total=progress.total, desc=f"epoch {progress.epoch} ({progress.stage})", unit="step",
                            file=self.stream, leave=False, dynamic_ncols=True)
        self.bar.update(progress.done - self.bar.n)
        if progress.metrics is not None:
            self.bar.set_postfix(loss=f"{progress.metrics['train/loss']:.4f}", refresh=False)
        if progress.done >= progress.total:  # validation follows: the bar goes, the epoch's line comes
            self.bar.refresh()  # its full count drawn once, whatever tqdm's redraw interval skipped on fast steps
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _AboveBar:
    """A stream whose lines tqdm writes above the bar it draws (`tqdm.write`)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        if text.rstrip("\n"):
            tqdm.write(text.rstrip("\n"), file=self.stream)

    def flush(self) -> None:
        self.stream.flush()


def _test_summary(result: dict, cfg, out: Path) -> str:
    """The end-of-run test evaluation (the best epoch's checkpoint, beam search) as one line on the x100 scale, and
    kept in OUT/test_scores.json (written whole or not at all); or why the test split was not scored."""
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
    scores = evaluate_results_file(args.results, args.captions, split=args.split, per_image=args.per_image,
                                   spice=True if args.spice else None)
    print(json.dumps(scores, indent=2))
    return 0


def cmd_decode(args) -> int:
    check_output_path(args.out, "--out", folder=False)  # before the split is decoded, not after
    out = decode_to_file(args.checkpoints, split=args.split, out=args.out, beam_size=args.beam_size,
                         max_len=args.max_len, batch_size=args.batch_size, data_overrides=args.overrides)
    print(json.dumps(out, indent=2))
    return 0

"""A study's results as pandas DataFrames, for a notebook or a script: its trials, its replicate groups, every
trial's epochs and its per-image scores, one row each, as Ray Tune's `ResultGrid.get_dataframe()` and
`mlflow.search_runs()` give theirs.

Made from the study's record as it is handed to the dashboards (`dashboards.runs.Study`, its trials, and the
record's replicate groups); `launch.frames.study_frames(name, storage)` reads that record from a study's storage (a
local folder or `s3://`) and hands back `StudyFrames`. Scores are on the x100 scale, as everywhere; a key that does
not apply to a trial's configuration (lambda of fusion none) is missing (NaN), not a value.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pandas as pd

from a2core.config import flatten
from dashboards.runs import TABLE_METRICS, ReplicateGroup, Study, searched_keys

# the trial columns every frame starts with, in this order (the rest: its searched keys, then its metrics)
TRIAL_COLUMNS = ("trial_id", "group", "fusion", "lambda", "seed", "state", "status", "stopped_early",
                 "epochs_done", "epochs_planned", "best_epoch", "best", "last", "test", "best_checkpoint", "train_run")
GROUP_COLUMNS = ("group", "best_group", "fusion", "lambda", "n", "mean", "low", "high", "values", "test_values",
                 "seeds", "trials", "best_trial", "stopped_early")
READERS = 16  # per-image files read at once (on S3 each is a request)
# the metrics a trial of the record keeps per epoch (`Trial.history`)
HISTORY_KEYS = ("train/loss", *(metric for _, metric in TABLE_METRICS))


@dataclass
class StudyFrames:
    """The frames of one study's record. `trials`, `groups` and `epochs` are made once, when first read;
    `per_image(split)` reads each trial's per-image file when called."""
    study: Study
    replicate_groups: list[ReplicateGroup] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.study.name

    @property
    def trials(self) -> pd.DataFrame:
        if not hasattr(self, "_trials"):
            self._trials = trials_frame(self.study)
        return self._trials

    @property
    def groups(self) -> pd.DataFrame:
        if not hasattr(self, "_groups"):
            self._groups = groups_frame(self.study, self.replicate_groups)
        return self._groups

    @property
    def epochs(self) -> pd.DataFrame:
        if not hasattr(self, "_epochs"):
            self._epochs = epochs_frame(self.study)
        return self._epochs

    def per_image(self, split: str = "test") -> pd.DataFrame:
        return per_image_frame(self.study, split)


def trials_frame(study: Study) -> pd.DataFrame:
    """One row per trial that has started, in the record's order, indexed by `trial_id`: `TRIAL_COLUMNS` (`group`:
    its replicate group, the config hash; `best`: the study metric at its best epoch; `test`: its selected
    checkpoint's test CIDEr when it ended; `stopped_early`: the scheduler stopped it), then every searched key by its
    dotted name (`model.lambda`, ...: the keys whose values differ between trials), then each metric it logged
    (`val/CIDEr`, `train/loss`, `diag/...`) at its best epoch where it was logged there, else its last value."""
    keys = searched_keys(study.runs)
    rows = []
    for trial in study.runs:
        params = flatten(trial.config)
        row = {"trial_id": trial.trial_id, "group": trial.config_hash, "fusion": trial.fusion, "lambda": trial.lam,
               "seed": trial.seed, "state": trial.state, "status": trial.status,
               "stopped_early": bool(trial.stopped_early), "epochs_done": trial.epochs_done,
               "epochs_planned": trial.epochs_planned, "best_epoch": trial.best_step, "best": trial.best_value,
               "last": trial.last, "test": trial.test, "best_checkpoint": trial.best_checkpoint,
               "train_run": trial.train_run}
        row.update({key: params.get(key) for key in keys if key not in ("model.fusion", "model.lambda")})
        row.update({metric: trial.score(metric) for metric in sorted(trial.final)})
        rows.append(row)
    frame = pd.DataFrame(rows, columns=_columns(TRIAL_COLUMNS, rows))
    return frame.set_index("trial_id", drop=False).rename_axis(None)


def groups_frame(study: Study, groups: list[ReplicateGroup]) -> pd.DataFrame:
    """One row per replicate group (trials whose configurations differ only in the seed), indexed by `group`, the
    config hash: `best_group` (the record's best configuration), its fusion and lambda, `n` seeds scored with the
    `mean` of their best metric and its 95% interval over seeds (`low`, `high`), the per-seed `values`, the
    `test_values` of those that ended, its `seeds` and `trials`, its best trial, whether the scheduler stopped it,
    then its other searched keys as sampled."""
    rows = []
    for g in groups:
        row = {"group": g.config_hash, "best_group": g.config_hash == study.best_group,
               **{key: g[key] for key in GROUP_COLUMNS[2:] if key != "stopped_early"},
               "stopped_early": bool(g.stopped_early)}
        row.update({key: value for key, value in g.sampled.items() if key not in row})
        rows.append(row)
    frame = pd.DataFrame(rows, columns=_columns(GROUP_COLUMNS, rows))
    return frame.set_index("group", drop=False).rename_axis(None)


def epochs_frame(study: Study) -> pd.DataFrame:
    """One row per trial and epoch it reported: `trial_id`, `group`, `seed`, `epoch`, then the per-epoch metrics the
    record keeps (`train/loss` and the table's val metrics, `HISTORY_KEYS`): learning curves."""
    points: dict[tuple[str, int], dict] = {}
    for trial in study.runs:
        for metric in HISTORY_KEYS:
            for epoch, value in trial.history.get(metric, []):
                points.setdefault((trial.trial_id, int(epoch)), {"trial_id": trial.trial_id,
                                                                 "group": trial.config_hash, "seed": trial.seed,
                                                                 "epoch": int(epoch)})[metric] = value
    rows = list(points.values())
    return pd.DataFrame(rows, columns=_columns(("trial_id", "group", "seed", "epoch"), rows))


def per_image_frame(study: Study, split: str = "test") -> pd.DataFrame:
    """One row per trial and image of `split`: `trial_id`, `group`, `seed`, `image_id` (text, as in COCO's files)
    and `cider` (CIDEr-D x100). "test": the selected checkpoint's scores on the held-out split, when the trial ended;
    "val": its best val epoch's. Trials without such scores have no rows. Pivot it for a trials x images table:
    `frame.pivot(index="image_id", columns="trial_id", values="cider")`."""
    if split not in ("val", "test"):
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")
    with ThreadPoolExecutor(READERS) as pool:
        scores = list(pool.map(lambda trial: trial.per_image(split), study.runs))
    rows = [{"trial_id": trial.trial_id, "group": trial.config_hash, "seed": trial.seed, "image_id": str(image),
             "cider": float(value)}
            for trial, by_image in zip(study.runs, scores) for image, value in sorted((by_image or {}).items())]
    return pd.DataFrame(rows, columns=["trial_id", "group", "seed", "image_id", "cider"])


def _columns(first: tuple, rows: list[dict]) -> list[str]:
    """`first`, then every other key of `rows` in the order it first appears."""
    out = list(first)
    for row in rows:
        out.extend(key for key in row if key not in out)
    return out


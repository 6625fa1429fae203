"""The search of a study: grid keys crossed with Optuna (TPE) over the sampled keys, and the trial scheduler.

Ray's `OptunaSearch` cannot hold `tune.grid_search` keys, and one TPE model over (fusion, seed, lambda, ...)
would spend samples unevenly across the cells a study must compare. `GridCrossedSearcher` keeps one Optuna
study per grid cell (fusion=gate,seed=0 ...):

- each cell's study asks a define-by-run space over the sampled keys that are active in that cell (`when`
  conditions: the exp_decay temperature only in exp_decay cells; conditions on a `choice` key are decided
  after it is sampled);
- the spec's `points_to_evaluate` (default: the paper's values) are enqueued in every cell first, so the
  paper defaults are each cell's first trial;
- suggestions go to the cells round-robin until every cell has `spec.samples_per_cell(cell)` trials, then
  `Searcher.FINISHED`; suggestions are flat dicts of the space's keys (`{"fusion": "gate", "seed": 0,
  "lambda": 0.031}`) and `spec.trial_config(suggestion)` turns one into an a2core config; the searcher keeps
  the trial id -> (cell, Optuna trial) map itself;
- `algorithm: random` uses a random sampler per cell; `algorithm: grid` asks nothing: the enqueued points are
  every trial.

How results reach Optuna
------------------------
Every result with the metric and `epoch` is reported as the Optuna trial's intermediate value at step
`epoch`. When a trial ends:

- it errored (after Tune's retries)                          -> FAIL;
- its last result has `epoch` < the planned epochs (XE + SCST): ASHA stopped it (or it ended early)
                                                             -> PRUNED, its value the last intermediate value;
- otherwise                                                  -> COMPLETE with the metric of its last result;
- no metric was ever reported                                -> FAIL.

Ray's own OptunaSearch tells ASHA-stopped trials as COMPLETE with their truncated value, so TPE learns from a
2-epoch CIDEr as if it were a finished run. Optuna's TPE ranks PRUNED trials below every COMPLETE one (and
among themselves by how far they got, then by their last value), which is what an ASHA stop means.

Each cell's sampler is seeded with `search.seed + cell index`. TPE uses `multivariate` and `group` (conditional
keys), `constant_liar` (concurrent trials of a cell get spread out) and a short random start-up:
`n_startup_trials = clamp(num_samples // 3, 1, 10)` trials (enqueued points count) before TPE models the cell.

State: `save`/`restore` pickle everything (spec, Optuna studies with their trials, the maps, the round-robin
position), so `Tuner.restore` continues the search where it stopped without repeating a suggestion.

`build_search(spec)` returns `(searcher, scheduler)`; `tune_config_kwargs(spec)` the matching arguments of
`ray.tune.TuneConfig` (the concurrency limit comes from `resources.max_concurrent_trials` through it; Tune wraps
the searcher in a `ConcurrencyLimiter`). The ASHA scheduler measures time in `epoch` (monotonic across XE and
SCST, unlike `training_iteration`, which restarts when Ray Train restores a worker group) with
`max_t` = the planned epochs; metric and mode come from the TuneConfig.
"""
from __future__ import annotations

import logging
import math
import pickle
import warnings
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search import Searcher

from launch.spec import Param, StudySpec

logger = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)

STATE_VERSION = 1
TIME_ATTR = "epoch"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _epoch(result: dict | None) -> int | None:
    value = (result or {}).get(TIME_ATTR)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def n_startup_trials(num_samples: int) -> int:
    return max(1, min(10, num_samples // 3))


class GridCrossedSearcher(Searcher):
    """One Optuna study per grid cell; suggestions round-robin over the cells (see the module docstring)."""

    def __init__(self, spec: StudySpec, metric: str | None = None, mode: str | None = None):
        super().__init__(metric=metric or spec.metric, mode=mode or spec.mode)
        self._spec = spec
        self._total_epochs = spec.total_epochs
        self._cells: list[dict] = spec.grid_cells()
        self._quota: list[int] = [spec.samples_per_cell(c) for c in self._cells]
        self._assigned: list[int] = [0] * len(self._cells)
        self._next_cell = 0
        self._studies: list[optuna.Study] = [self._new_study(i, c) for i, c in enumerate(self._cells)]
        self._trials: dict[str, tuple[int, optuna.trial.Trial]] = {}  # Tune trial id -> (cell, Optuna trial)
        self._configs: dict[str, dict] = {}  # Tune trial id -> suggestion
        self._progress: dict[str, tuple[int, float]] = {}  # Tune trial id -> (last epoch, its value)
        self._outcomes: dict[str, str] = {}  # Tune trial id -> COMPLETE | PRUNED | FAIL

    # -- Optuna ----------------------------------------------------------------------------------------------------
    def _sampler(self, index: int) -> optuna.samplers.BaseSampler:
        seed = self._spec.search["seed"] + index
        if self._spec.algorithm == "optuna":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.TPESampler(
                    seed=seed, n_startup_trials=n_startup_trials(self._spec.search["num_samples"]),
                    multivariate=True, group=True, constant_liar=True)
        return optuna.samplers.RandomSampler(seed=seed)

    def _new_study(self, index: int, cell: dict) -> optuna.Study:
        study = optuna.create_study(
            study_name=f"{self._spec.name}/{self._spec.cell_label(cell)}",
            direction="maximize" if self.mode == "max" else "minimize",
            sampler=self._sampler(index),
        )
        for point in self._spec.points_for_cell(cell):
            study.enqueue_trial(point)
        return study

    @staticmethod
    def _suggest_one(trial: optuna.trial.Trial, p: Param) -> Any:
        if p.kind == "choice":
            return trial.suggest_categorical(p.key, list(p.values))
        if p.kind == "randint":
            return trial.suggest_int(p.key, int(p.low), int(p.high))
        return trial.suggest_float(p.key, p.low, p.high, log=p.kind == "loguniform")

    # -- Searcher ----------------------------------------------------------------------------------------------------
    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        if metric and self._metric and metric != self._metric:
            raise ValueError(f"the study optimises {self._metric!r}, the TuneConfig says {metric!r}")
        if mode and self._mode and mode != self._mode:
            raise ValueError(f"the study's mode is {self._mode!r}, the TuneConfig says {mode!r}")
        self._metric = self._metric or metric
        self._mode = self._mode or mode
        return True

    def suggest(self, trial_id: str) -> dict | str | None:
        if trial_id in self._configs:  # asked again for the same trial: same answer
            return dict(self._configs[trial_id])
        n = len(self._cells)
        for k in range(n):
            index = (self._next_cell + k) % n
            if self._assigned[index] < self._quota[index]:
                break
        else:
            return Searcher.FINISHED
        self._next_cell = (index + 1) % n
        cell = self._cells[index]
        trial = self._studies[index].ask()
        config = dict(cell)
        config.update(self._spec.fill(cell, lambda p: self._suggest_one(trial, p)))
        self._assigned[index] += 1
        self._trials[trial_id] = (index, trial)
        self._configs[trial_id] = config
        return dict(config)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id not in self._trials or trial_id in self._outcomes:
            return
        value, epoch = _finite(result.get(self.metric)), _epoch(result)
        if value is None or epoch is None:
            return
        last = self._progress.get(trial_id)
        if last is not None and epoch <= last[0]:  # a restored worker group repeats epochs it had reported
            return
        self._trials[trial_id][1].report(value, epoch)
        self._progress[trial_id] = (epoch, value)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self._trials or trial_id in self._outcomes:
            return
        if result:
            self.on_trial_result(trial_id, result)
        index, trial = self._trials[trial_id]
        value = _finite(result.get(self.metric)) if result else None
        epoch = _epoch(result)
        if epoch is None and trial_id in self._progress:
            epoch = self._progress[trial_id][0]
        if error or (value is None and trial_id not in self._progress):
            state, values = TrialState.FAIL, None
        elif value is None or (epoch is not None and epoch < self._total_epochs):
            state, values = TrialState.PRUNED, None
        else:
            state, values = TrialState.COMPLETE, value
        try:
            self._studies[index].tell(trial, values, state=state)
        except Exception as exc:  # never let bookkeeping fail the study
            logger.warning("could not record trial %s in Optuna: %s", trial_id, exc)
        self._outcomes[trial_id] = state.name

    # -- inspection ----------------------------------------------------------------------------------------------
    @property
    def cells(self) -> list[dict]:
        return [dict(c) for c in self._cells]

    def study_of(self, cell: dict) -> optuna.Study:
        """The Optuna study of a grid cell (its trials, states, values, intermediate values)."""
        return self._studies[self._cells.index(cell)]

    def cell_of(self, trial_id: str) -> dict:
        return dict(self._cells[self._trials[trial_id][0]])

    def optuna_trial_number(self, trial_id: str) -> int:
        return self._trials[trial_id][1].number

    def outcome(self, trial_id: str) -> str | None:
        return self._outcomes.get(trial_id)

    def counts(self) -> list[tuple[dict, int, int]]:
        """(cell, suggested, planned) per cell."""
        return [(dict(c), a, q) for c, a, q in zip(self._cells, self._assigned, self._quota)]

    # -- state -----------------------------------------------------------------------------------------------------
    def get_state(self) -> dict:
        return {
            "version": STATE_VERSION,
            "metric": self._metric,
            "mode": self._mode,
            "spec": self._spec,
            "total_epochs": self._total_epochs,
            "cells": self._cells,
            "quota": self._quota,
            "assigned": self._assigned,
            "next_cell": self._next_cell,
            "studies": self._studies,  # pickled together with the trials below: they share the storage
            "trials": self._trials,
            "configs": self._configs,
            "progress": self._progress,
            "outcomes": self._outcomes,
        }

    def set_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"searcher state version {state.get('version')!r}, expected {STATE_VERSION}")
        self._metric, self._mode = state["metric"], state["mode"]
        self._spec = state["spec"]
        self._total_epochs = state["total_epochs"]
        self._cells, self._quota = state["cells"], state["quota"]
        self._assigned, self._next_cell = state["assigned"], state["next_cell"]
        self._studies, self._trials = state["studies"], state["trials"]
        self._configs, self._progress, self._outcomes = state["configs"], state["progress"], state["outcomes"]

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.get_state(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.set_state(pickle.load(f))


def build_scheduler(spec: StudySpec) -> TrialScheduler:
    ((kind, options),) = spec.search["scheduler"].items()
    if kind == "asha":
        return ASHAScheduler(time_attr=TIME_ATTR, max_t=spec.total_epochs, grace_period=options["grace_period"],
                             reduction_factor=options["reduction_factor"], brackets=options["brackets"])
    return FIFOScheduler()


def build_search(spec: StudySpec) -> tuple[GridCrossedSearcher, TrialScheduler]:
    """The searcher and scheduler of a study, for `ray.tune.TuneConfig(search_alg=..., scheduler=...)`."""
    return GridCrossedSearcher(spec), build_scheduler(spec)


def tune_config_kwargs(spec: StudySpec) -> dict:
    """Everything `ray.tune.TuneConfig(**kwargs)` needs for this study."""
    search_alg, scheduler = build_search(spec)
    return {
        "search_alg": search_alg,
        "scheduler": scheduler,
        "num_samples": spec.num_trials,
        "metric": spec.metric,
        "mode": spec.mode,
        "max_concurrent_trials": spec.resources["max_concurrent_trials"],
    }

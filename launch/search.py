"""The search of a study: `GridCrossedSearcher`, one Optuna study per grid cell (Ray's `OptunaSearch` cannot hold grid
keys, and one TPE model over all cells would spend samples unevenly), each configuration handed out once per
replicate seed, and `ReplicateASHA`, early stopping of replicate groups. docs/explanation/studies.md has the rules
(search, replicates) and docs/explanation/statistics.md the early stopping.
"""
from __future__ import annotations

import copy
import logging
import math
import pickle
import warnings
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import Searcher

from a2core.selection import finite
from dashboards.stats import pooled_sd, short_hash
from launch.layout import FUSED_SEEDS_KEY, configuration_of, fused_seeds, seed_result_key, seed_trial_id
from launch.spec import SEED_KEYS, Param, StudySpec, asha_rungs, group_key
from launch.verify import keep_out_of_tunes_uploads

logger = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)

STATE_VERSION = 2
TIME_ATTR = "epoch"
MAX_DUPLICATES = 20  # suggestions in a row that repeat a configuration before its grid cell counts as done


def _epoch(result: dict | None) -> int | None:
    value = (result or {}).get(TIME_ATTR)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def n_startup_trials(num_samples: int) -> int:
    """TPE's random start-up per cell (enqueued points count): a third of the samples, 1 to 10."""
    return max(1, min(10, num_samples // 3))


class GridCrossedSearcher(Searcher):
    """One Optuna study per grid cell, asked round-robin over the cells until each has its quota; each
    configuration goes out once per replicate seed, as consecutive trials. A group's Optuna trial gets the group
    mean at epoch e once every replicate reported e, and at the end FAIL if all failed, PRUNED if any stopped
    before the planned epochs, else COMPLETE with the finished replicates' mean. Its state is all its attributes."""

    # What a searcher pickled by an earlier release (a study started before adaptive replicates, resumed after an
    # upgrade: Tune unpickles the searcher object itself) lacks, read as a study without rounds.
    _rounds: tuple[int, ...] | None = None
    _round = 0
    _decider = None
    _fused: tuple[int, ...] | list[int] = ()  # ... and before fused trials: one seed a trial
    _scheduler = None  # the study's ReplicateASHA, whose state this searcher's saves carry (`carry_state_of`)

    def __init__(self, spec: StudySpec):
        super().__init__(metric=spec.metric, mode=spec.mode)
        self._spec = spec
        self._seeds: list[int] = spec.replicate_seeds + spec.confirm_seeds  # a later round's seeds follow on
        # fused replicates (`resources.fuse_replicates`): a configuration's seeds of a round are one trial holding
        # them all (`FUSED_SEEDS_KEY`); its first round's trial is a group of one for Optuna and the scheduler
        self._fused: list[int] = self._seeds if spec.resources.fuse_replicates else []
        if self._fused:
            self._seeds = []
        self._cells: list[dict] = spec.grid_cells()
        self._quota: list[int] = [spec.samples_per_cell(c) for c in self._cells]
        self._assigned: list[int] = [0] * len(self._cells)  # configurations (groups) per cell
        self._next_cell = 0
        self._studies: list[optuna.Study] = [self._new_study(i, c) for i, c in enumerate(self._cells)]
        self._trials: dict[str, tuple[int, optuna.trial.Trial]] = {}  # Tune trial id -> (cell, Optuna trial)
        self._configs: dict[str, dict] = {}  # Tune trial id -> suggestion
        # A replicate group is named by its first Tune trial id (two samples can be equal: they are still two groups).
        self._group_of: dict[str, str] = {}  # Tune trial id -> group
        self._members: dict[str, list[str]] = {}  # group -> its replicates' Tune trial ids, in seed order
        self._open: str | None = None  # the group still handing out replicates
        self._curves: dict[str, dict[int, float]] = {}  # Tune trial id -> {epoch: value}
        self._finals: dict[str, float | None] = {}  # Tune trial id -> its final value
        self._outcomes: dict[str, str] = {}  # Tune trial id -> COMPLETE | PRUNED | FAIL
        # group -> `_trials_key`: a suggestion whose resolved config (and grid seed) an earlier group has is not run
        # again (it would be the same trials with the same seeds, one group's numbers counted twice)
        self._hashes: dict[str, str] = {}
        # adaptive replicates (`search.replicates: {min, max}`) or confirmation seeds (`search.confirm`): the
        # cumulative seeds of each round, the round being handed out (0-based), the groups still to get its seeds,
        # and what decides them at a round's end (set by the driver: `launch.adaptive.RoundDecider`; None: every
        # group gets every round)
        self._rounds: tuple[int, ...] | None = spec.seed_rounds
        self._round = 0
        self._queue: list[str] = []
        self._decider = None

    @property
    def _group_size(self) -> int:
        """Trials of a group as Optuna counts it: one a seed, the first round's with rounds of seeds (the
        configurations are all asked in the first round; later rounds only add seeds); one, fused."""
        if self._fused:
            return 1
        return self._rounds[0] if self._rounds else max(1, len(self._seeds))

    def _seeds_of(self, group: str) -> int:
        """The seeds `group`'s trials hold (a fused trial holds several)."""
        return sum(len(fused_seeds(self._configs[t]) or [None]) for t in self._members[group])

    def _seed_keys(self, have: int, target: int) -> dict:
        """What a trial adds to its configuration to take its group from `have` seeds to `target`: the next
        replicate seed, or fused, the seeds in between as one trial (a single one as a trial of its own)."""
        if not self._fused:
            return {"seed": self._seeds[have]}
        seeds = list(self._fused[have:target])
        return {"seed": seeds[0]} if len(seeds) == 1 else {FUSED_SEEDS_KEY: seeds}

    def set_round_decider(self, decider) -> None:
        """What decides, at the end of each round of adaptive replicates, which groups get the next round's seeds:
        `decider.next_round(finished_round, {group: suggestion}, {trial id: suggestion})` -> groups."""
        self._decider = decider

    def carry_state_of(self, scheduler: "ReplicateASHA") -> None:
        """Save `scheduler`'s state with this searcher's and put it back on restore. Tune 2.60 saves the searcher
        with every experiment snapshot but never the scheduler, and `Tuner.restore` unpickles the one `tuner.pkl`
        holds, as it was before the first trial: without this, a resumed study's early stopping forgets every rung
        value reported before the resume. Both are pickled together in `tuner.pkl`, so the restored searcher still
        holds the scheduler Tune drives, and Tune restores the searcher before it adds the restored trials."""
        self._scheduler = scheduler

    def _new_study(self, index: int, cell: dict) -> optuna.Study:
        seed = self._spec.search.seed + index
        if self._spec.algorithm == "optuna":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(
                    seed=seed, n_startup_trials=n_startup_trials(self._spec.search.num_samples),
                    multivariate=True, group=True, constant_liar=True)
        else:
            sampler = optuna.samplers.RandomSampler(seed=seed)
        study = optuna.create_study(study_name=f"{self._spec.name}/{self._spec.cell_label(cell)}", sampler=sampler,
                                    direction="maximize" if self.mode == "max" else "minimize")
        for point in self._spec.points_for_cell(cell):
            study.enqueue_trial(point)
        return study

    @staticmethod
    def _suggest_one(trial: optuna.trial.Trial, p: Param) -> Any:
        if p.kind == "choice":
            return trial.suggest_categorical(p.key, list(p.values))
        low, high = p.values
        if p.kind == "randint":
            return trial.suggest_int(p.key, int(low), int(high))
        return trial.suggest_float(p.key, low, high, log=p.kind == "loguniform")

    # -- Searcher ----------------------------------------------------------------------------------------------------
    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        if (metric or self._metric, mode or self._mode) != (self._metric, self._mode):
            raise ValueError(f"the study optimises {self._metric!r} ({self._mode}), the TuneConfig says "
                             f"{metric!r} ({mode})")
        return True

    def suggest(self, trial_id: str) -> dict | str | None:
        if trial_id in self._configs:  # asked again for the same trial: same answer
            return dict(self._configs[trial_id])
        if self._rounds and self._round > 0:  # a later round of adaptive replicates: more seeds of open groups
            return self._next_seed(trial_id)
        if self._open is not None:  # the next replicate of a configuration already asked
            index, trial = self._trials[self._open]
            config = configuration_of(self._configs[self._open])
        else:
            n = len(self._cells)
            index = next((i % n for i in range(self._next_cell, self._next_cell + n)
                          if self._assigned[i % n] < self._quota[i % n]), None)  # the first open cell
            if index is None:
                return self._end_of_round(trial_id) if self._rounds else Searcher.FINISHED
            self._next_cell = (index + 1) % n
            found = self._new_configuration(index)
            if found is None:  # the cell has no configuration left that was not run: it is done
                self._quota[index] = self._assigned[index]
                return self.suggest(trial_id)
            trial, config, digest = found
            self._assigned[index] += 1
            self._open = trial_id
            self._members[trial_id] = []
            self._hashes[trial_id] = digest
        members = self._members[self._open]
        if self._seeds or self._fused:
            config.update(self._seed_keys(len(members), self._rounds[0] if self._rounds else len(self._fused)))
        members.append(trial_id)
        self._group_of[trial_id] = self._open
        if len(members) == self._group_size:  # with adaptive replicates: the first round's seeds
            self._open = None
        self._trials[trial_id] = (index, trial)
        self._configs[trial_id] = config
        return dict(config)

    def _end_of_round(self, trial_id: str) -> dict | str | None:
        """All of a round's trials handed out: None (Tune asks again) until every one has ended, then the next
        round's first trial, or FINISHED after the last round or once the decider leaves no group open."""
        if any(t not in self._outcomes for t in self._configs):
            return None
        if self._round + 1 >= len(self._rounds):
            return Searcher.FINISHED
        groups = list(self._members)
        if self._decider is not None:
            trials = {t: self._configs[t] for t in self._configs}
            failed = {t for t, outcome in self._outcomes.items() if outcome == TrialState.FAIL.name}
            groups = [g for g in self._decider.next_round(self._round, {g: self._configs[g] for g in groups}, trials,
                                                          failed=failed)
                      if g in self._members]
        self._round += 1
        self._queue = groups
        return self._next_seed(trial_id) if groups else Searcher.FINISHED

    def _next_seed(self, trial_id: str) -> dict | str | None:
        """The next trial of the first queued group that has fewer than this round's seeds: its next seed, or fused,
        the rest of the round's seeds (seeds in order); at the round's end, `_end_of_round`."""
        target = self._rounds[self._round]
        while self._queue and self._seeds_of(self._queue[0]) >= target:
            self._queue.pop(0)
        if not self._queue:
            return self._end_of_round(trial_id)
        group = self._queue[0]
        members = self._members[group]
        config = configuration_of(self._configs[group])
        config.update(self._seed_keys(self._seeds_of(group), target))
        members.append(trial_id)
        self._group_of[trial_id] = group
        self._trials[trial_id] = self._trials[group]
        self._configs[trial_id] = config
        return dict(config)

    def _trials_key(self, config: dict) -> str:
        """What makes a group's trials the same runs: its config hash and, when the seed is a grid key of the
        space rather than a replicate, that seed (the same configuration at another seed is another replicate)."""
        digest = group_key(config, self._spec.trial_config)
        seeds = [config[k] for k in SEED_KEYS if k in config]
        return f"{digest}/seed={seeds[0]}" if seeds else digest

    def _new_configuration(self, index: int) -> tuple[optuna.trial.Trial, dict, str] | None:
        """(Optuna trial, suggestion, `_trials_key`) of a configuration of cell `index` that no group has run; a
        duplicate is told to Optuna as FAIL (with the group it repeats) and another is asked, up to
        MAX_DUPLICATES times in a row."""
        cell, seen = self._cells[index], set(self._hashes.values())
        for _ in range(MAX_DUPLICATES):
            trial = self._studies[index].ask()
            config = {**cell, **self._spec.fill(cell, lambda p: self._suggest_one(trial, p))}
            digest = self._trials_key(config)
            if digest not in seen:
                return trial, config, digest
            trial.set_user_attr("duplicate_of", short_hash(digest))
            self._studies[index].tell(trial, state=TrialState.FAIL)
        return None

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id not in self._trials or trial_id in self._outcomes:
            return
        value, epoch = finite(result.get(self.metric)), _epoch(result)
        if value is None or epoch is None:
            return
        curve = self._curves.setdefault(trial_id, {})
        if curve and epoch <= max(curve):  # a restored worker group repeats epochs it had reported
            return
        curve[epoch] = value
        group = self.group_of(trial_id)[:self._group_size]  # a later round's seed is no part of Optuna's value
        values = [self._curves.get(t, {}).get(epoch) for t in group]
        # the last replicate to reach this epoch
        if trial_id in group and len(group) == self._group_size and None not in values:
            self._trials[trial_id][1].report(float(np.mean(values)), epoch)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self._trials or trial_id in self._outcomes:
            return
        if result:
            self.on_trial_result(trial_id, result)
        curve = self._curves.get(trial_id, {})
        value = finite(result.get(self.metric)) if result else None
        epoch = _epoch(result)
        if epoch is None and curve:
            epoch = max(curve)
        if error or (value is None and not curve):
            state = TrialState.FAIL
        elif value is None or (epoch is not None and epoch < self._spec.total_epochs):
            state = TrialState.PRUNED
        else:
            state = TrialState.COMPLETE
        self._outcomes[trial_id] = state.name
        self._finals[trial_id] = value
        self._tell(trial_id)

    def _tell(self, trial_id: str) -> None:
        """Tell Optuna the group's outcome when the last replicate of `trial_id`'s group ends (each ends once)."""
        key = self._group_of[trial_id]
        group = self._members[key][:self._group_size]  # with adaptive replicates: the first round's (told once)
        if trial_id not in group or len(group) < self._group_size or any(t not in self._outcomes for t in group):
            return
        states = [self._outcomes[t] for t in group]
        if all(s == "FAIL" for s in states):
            state, values = TrialState.FAIL, None
        elif "PRUNED" in states:
            state, values = TrialState.PRUNED, None
        else:
            state = TrialState.COMPLETE
            values = float(np.mean([self._finals[t] for t, s in zip(group, states) if s == "COMPLETE"]))
        index, trial = self._trials[trial_id]
        try:
            self._studies[index].tell(trial, values, state=state)
        except Exception as exc:  # never let bookkeeping fail the study
            logger.warning("could not record the group of trial %s in Optuna: %s", key, exc)

    # -- inspection ----------------------------------------------------------------------------------------------
    def study_of(self, trial_id: str) -> optuna.Study:
        """The Optuna study of `trial_id`'s grid cell."""
        return self._studies[self._trials[trial_id][0]]

    def optuna_trial(self, trial_id: str) -> optuna.trial.FrozenTrial:
        """`trial_id`'s group as its Optuna study records it (state, value, intermediate values)."""
        number = self._trials[trial_id][1].number
        return next(t for t in self.study_of(trial_id).trials if t.number == number)

    def outcome(self, trial_id: str) -> str | None:
        return self._outcomes.get(trial_id)

    def group_of(self, trial_id: str) -> list[str]:
        """The Tune trial ids of `trial_id`'s replicate group (itself included), in seed order."""
        return list(self._members[self._group_of[trial_id]])

    # -- state: every attribute (the spec, the Optuna studies with their trials, the maps, the round-robin position)
    def get_state(self) -> dict:
        state = {name.lstrip("_"): value for name, value in vars(self).items() if name != "_scheduler"}
        if self._scheduler is not None:
            state["scheduler_state"] = self._scheduler.get_state()
        return {"version": STATE_VERSION, **state}

    def set_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"searcher state version {state.get('version')!r}, expected {STATE_VERSION}")
        if self._scheduler is not None and "scheduler_state" in state:  # absent: saved before it was carried
            self._scheduler.set_state(state["scheduler_state"])
        for name in list(vars(self)):
            if name == "_scheduler":
                continue
            if name == "_hashes" and "hashes" not in state:  # saved before duplicates were skipped
                continue
            if name in ("_rounds", "_round", "_queue", "_decider") and name[1:] not in state:  # before rounds
                continue
            if name == "_fused" and "fused" not in state:  # saved before fused trials: its trials train one seed
                self._fused = []
                continue
            setattr(self, name, state[name.lstrip("_")])
        if "hashes" not in state:
            replicate = ("seed",) if self._seeds else ()  # a replicate's seed is not the configuration's
            self._hashes = {g: self._trials_key({k: v for k, v in self._configs[g].items() if k not in replicate})
                            for g in self._members}

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.get_state(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.set_state(pickle.load(f))

    def restore_from_dir(self, checkpoint_dir: str) -> None:
        """Tune's restore of a study hands its local staging folder here, after copying the study's root files into
        it and before its first upload: a2's own are taken out of it first (`keep_out_of_tunes_uploads`), so that
        Tune never copies them back over the study's."""
        super().restore_from_dir(checkpoint_dir)
        keep_out_of_tunes_uploads(checkpoint_dir)


class ReplicateASHA(FIFOScheduler):
    """ASHA over replicate groups (docs/explanation/statistics.md, early stopping): rungs at grace_period * reduction_factor**i < max_t;
    a trial's value at a rung is its metric at its first result with `epoch` >= the rung (epochs, unlike
    `training_iteration`, stay monotonic across restores).

    `hold_at_rungs`: a replicate that reaches a rung before its group can be judged gets Tune's PAUSE there, and is
    resumed once the group is judged; a resumed one-worker trial reports its last result again (`launch.trainable`),
    so one of a stopped group gets its STOP there. (Not `stop_trial` on the paused trial: Tune would keep it PAUSED
    in the saved experiment state, and a resume would train it again.)"""

    def __init__(self, *, max_t: int, grace_period: int = 1, reduction_factor: float = 2, replicates: int = 1,
                 min_gap_se: float = 2.0, metric: str | None = None, mode: str | None = None,
                 hold_at_rungs: bool = False, resolve=None):
        super().__init__()
        self._resolve = resolve  # suggestion -> resolved config: groups are `config_hash` of it (`group_key`)
        if grace_period < 1 or reduction_factor <= 1 or replicates < 1 or min_gap_se < 0:
            raise ValueError("need grace_period >= 1, reduction_factor > 1, replicates >= 1, min_gap_se >= 0")
        self.rungs: list[int] = asha_rungs(max_t, grace_period, reduction_factor)
        self.rf, self.replicates, self.k, self.hold_at_rungs = reduction_factor, replicates, min_gap_se, hold_at_rungs
        self._metric, self._mode = metric, mode
        self._groups: dict[str, str] = {}  # trial id -> group
        self._values: dict[int, dict[str, dict[str, float]]] = {r: {} for r in self.rungs}  # rung -> group -> trial
        self._gone: dict[str, dict[int, int]] = {}  # group -> rung -> its replicates that ended before the rung
        self._ended: set[str] = set()
        self._means: dict[int, dict[str, float]] = {r: {} for r in self.rungs}  # rung -> group -> mean (decided)
        self._stopped_groups: dict[str, dict] = {}  # group -> the decision that stopped it
        self._stopped: dict[str, dict] = {}  # trial id -> that decision, for trials this scheduler stopped
        self._held: dict[str, tuple[str, int]] = {}  # trial id -> (group, rung): paused there until it is judged

    def set_search_properties(self, metric: str | None, mode: str | None, **spec) -> bool:
        if (self._metric and metric and metric != self._metric) or (self._mode and mode and mode != self._mode):
            return False
        self._metric, self._mode = self._metric or metric, self._mode or mode
        return True

    # -- Tune hooks ----------------------------------------------------------------------------------------------
    def on_trial_add(self, tune_controller, trial) -> None:
        tid = trial.trial_id
        group = self._groups[tid] = group_key(trial.config or {}, self._resolve)
        if tid in self._ended and trial.status != Trial.TERMINATED:
            # an errored trial that `a2 study resume` trains again (Tune's resume_errored), its end restored with
            # the scheduler's state (`set_state`): its group's again, no longer counted gone below its rungs
            self._ended.discard(tid)
            gone = self._gone.setdefault(group, {})
            for member in self._replicate_values(trial, {}):
                for rung in self.rungs:
                    if member not in self._values[rung].get(group, {}) and gone.get(rung, 0) > 0:
                        gone[rung] -= 1

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        tid = trial.trial_id
        group = self._groups.setdefault(tid, group_key(trial.config or {}, self._resolve))
        t = finite(result.get(TIME_ATTR))
        for member, value in self._replicate_values(trial, result).items():
            if t is None or value is None:
                continue
            for rung in self.rungs:
                if t >= rung and member not in self._values[rung].setdefault(group, {}):
                    self._values[rung][group][member] = value
                    self._decide(group, rung)
        if group in self._stopped_groups:
            self._stopped[tid] = dict(self._stopped_groups[group])
            return TrialScheduler.STOP
        rung = self._rung_to_wait_at(tune_controller, trial, group)
        if rung is not None:
            self._held[tid] = (group, rung)
            return TrialScheduler.PAUSE
        return TrialScheduler.CONTINUE

    def on_trial_complete(self, tune_controller, trial, result: dict | None = None) -> None:
        """A trial that ended (completed, failed, removed) below a rung no longer counts there: its group may be
        complete without it."""
        tid = trial.trial_id
        group = self._groups.get(tid)
        self._held.pop(tid, None)
        if group is None or tid in self._ended:
            return
        self._ended.add(tid)
        gone = self._gone.setdefault(group, {})
        for member in self._replicate_values(trial, {}):
            for rung in self.rungs:
                if member not in self._values[rung].get(group, {}):
                    gone[rung] = gone.get(rung, 0) + 1
                    self._decide(group, rung)

    on_trial_remove = on_trial_complete

    def on_trial_error(self, tune_controller, trial) -> None:
        """A trial that errored for good ends like one that completed. One Tune retries (`resources.max_failures`:
        Tune marks it ERROR, tells the scheduler, then requeues it and adds it again) is still its group's: counted
        gone, its group would be judged without it at every rung it had not reached."""
        if getattr(trial, "status", None) == Trial.ERROR and getattr(trial, "should_recover", lambda: False)():
            self._held.pop(trial.trial_id, None)  # pending again: not held at a rung
            return
        self.on_trial_complete(tune_controller, trial)

    def _replicate_values(self, trial, result: dict) -> dict[str, float | None]:
        """The study metric of each replicate a result of `trial` reports: its own, or each seed's of a fused trial
        (`launch.layout.seed_result_key`), keyed by the replicate's trial id in the record."""
        seeds = fused_seeds(trial.config)
        if seeds is None:
            return {trial.trial_id: finite(result.get(self._metric))}
        return {seed_trial_id(trial.trial_id, s): finite(result.get(seed_result_key(s, self._metric))) for s in seeds}

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        """A paused trial not held at a rung (a released replicate catches up with its group), else a pending one;
        when nothing is running or pending, the held trials run on (their groups could not be judged)."""
        trials = tune_controller.get_trials()
        if self._held and not any(t.status in (Trial.RUNNING, Trial.PENDING) for t in trials):
            self._held.clear()
        for status in (Trial.PAUSED, Trial.PENDING):
            for trial in trials:
                if trial.status == status and trial.trial_id not in self._held:
                    return trial
        return None

    # -- the rule ------------------------------------------------------------------------------------------------
    def _rung_to_wait_at(self, tune_controller, trial, group: str) -> int | None:
        """The rung where `trial` waits for its group's judgement (hold_at_rungs), or None to train on: the lowest
        rung with its value and its group not judged yet, if every replicate still missing there is on its way
        (running or pending, not held), so that the group will be judged."""
        if not self.hold_at_rungs or tune_controller is None or fused_seeds(trial.config) is not None:
            return None  # a fused trial is its whole group: it never waits for it
        for rung in self.rungs:
            values = self._values[rung].get(group, {})
            if trial.trial_id not in values or group in self._means[rung]:
                continue
            missing = self.replicates - self._gone.get(group, {}).get(rung, 0) - len(values)
            on_the_way = [t for t in tune_controller.get_trials()
                          if self._groups.get(t.trial_id) == group and t.trial_id not in values
                          and t.trial_id not in self._held and t.status in (Trial.RUNNING, Trial.PENDING)]
            return rung if 0 < missing <= len(on_the_way) else None
        return None

    def _decide(self, group: str, rung: int) -> None:
        values = self._values[rung].get(group, {})
        expected = self.replicates - self._gone.get(group, {}).get(rung, 0)
        if group in self._means[rung] or not values or len(values) < expected:
            return
        self._judge(group, rung, values)
        # release the replicates held at this rung (all of them if the group stopped): choose_trial_to_run resumes
        # them, and a stopped group's get STOP at their first result
        stopped = group in self._stopped_groups
        for tid, (held_group, held_rung) in list(self._held.items()):
            if held_group == group and (held_rung == rung or stopped):
                del self._held[tid]

    def _judge(self, group: str, rung: int, values: dict[str, float]) -> None:
        """Record the group's mean at the rung and stop the group if it is clearly below the cutoff."""
        sign = -1.0 if self._mode == "min" else 1.0  # compare in "higher is better" units
        mean = float(np.mean(list(values.values())))
        others = [sign * m for m in self._means[rung].values()]
        self._means[rung][group] = mean
        if not others or group in self._stopped_groups:
            return
        spread = pooled_sd([list(v.values()) for g, v in self._values[rung].items() if g in self._means[rung]])
        if spread is None:  # no group with two replicates here: seed noise unknown, nothing is stopped
            return
        cutoff = float(np.percentile(others, (1 - 1 / self.rf) * 100))
        threshold = self.k * spread * math.sqrt(2.0 / len(values))
        if cutoff - sign * mean > threshold:
            self._stopped_groups[group] = {"rung": rung, "cutoff": sign * cutoff, "group_mean": mean,
                                           "threshold": threshold}

    # -- state, carried by the searcher's saves (`GridCrossedSearcher.carry_state_of`) --------------------------------
    _SAVED = ("_groups", "_values", "_gone", "_ended", "_means", "_stopped_groups", "_stopped")

    def get_state(self) -> dict:
        """What the scheduler knows of the study: every rung value, judgement and ended trial. Not the trials held
        at a rung: Tune restores a paused trial as pending, and its first result holds it again."""
        return {"rungs": list(self.rungs), **{name.lstrip("_"): copy.deepcopy(getattr(self, name))
                                              for name in self._SAVED}}

    def set_state(self, state: dict) -> None:
        if list(state.get("rungs", ())) != self.rungs:
            raise ValueError(f"ReplicateASHA state with rungs {state.get('rungs')}, expected {self.rungs}")
        for name in self._SAVED:
            setattr(self, name, copy.deepcopy(state[name.lstrip("_")]))
        self._held = {}

    # -- inspection ----------------------------------------------------------------------------------------------
    def stopped_early(self, trial_id: str) -> dict | None:
        """`{"rung", "cutoff", "group_mean", "threshold"}` when this scheduler stopped the trial, else None."""
        info = self._stopped.get(trial_id)
        return dict(info) if info else None

    def group_means(self, rung: int) -> dict[str, float]:
        return dict(self._means[rung])


def build_scheduler(spec: StudySpec) -> TrialScheduler:
    """The study's trial scheduler: `ReplicateASHA` for `scheduler: {asha: ...}`, else FIFO."""
    asha = spec.search.scheduler.asha
    if asha is None:
        return FIFOScheduler()
    return ReplicateASHA(max_t=spec.total_epochs, grace_period=asha.grace_period,
                         # a group is judged on its first round's seeds with adaptive replicates
                         reduction_factor=asha.reduction_factor,
                         replicates=(spec.replicate_rounds or [max(1, len(spec.replicate_seeds))])[0],
                         # fused trials are their whole groups (judged at once); a rehearsal without Ray
                         # (`launch.rehearse.simulate`) runs their seeds as trials held at a rung for their group
                         min_gap_se=asha.min_gap_se,
                         hold_at_rungs=asha.hold_at_rungs or spec.resources.fuse_replicates,
                         resolve=spec.trial_config)


def tune_config_kwargs(spec: StudySpec) -> dict:
    """Everything `ray.tune.TuneConfig(**kwargs)` needs for this study (Tune wraps the searcher in a
    `ConcurrencyLimiter` for `max_concurrent_trials`)."""
    searcher, scheduler = GridCrossedSearcher(spec), build_scheduler(spec)
    if isinstance(scheduler, ReplicateASHA):
        searcher.carry_state_of(scheduler)  # Tune saves no scheduler: a resumed study's early stopping remembers
    return {"search_alg": searcher, "scheduler": scheduler, "num_samples": spec.tune_samples,
            "metric": spec.metric, "mode": spec.mode, "max_concurrent_trials": spec.resources.max_concurrent_trials,
            # A one-worker trial trains in its Tune trial process: the next trial reuses that process and skips its
            # start-up and imports (benchmarks/bench_scale.py). Tune starts a fresh one when the previous trial's
            # thread does not stop in time. Ray Train trials keep a process of their own.
            "reuse_actors": spec.resources.workers_per_trial == 1}

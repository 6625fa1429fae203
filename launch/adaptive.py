"""Adaptive replicates as the driver runs them (`search.replicates: {min, max, rounds}`; docs/explanation/statistics.md,
"Adaptive replicates"): after each round of seeds, which arms are settled and which get the next round's seeds.

The arms are the study's fusions against fusion none, as `a2 study compare` groups them (`dashboards.compare.
study_comparison`: each fusion's best configuration). Look r is the study restricted to seeds 0 .. rounds[r] - 1; an
arm takes it when it and the baseline were handed those seeds and each ended (`looks_of`: an errored or diverged
seed is missing, not waited for), and its p-value there is the verdict rule's
(`Difference.p`) with the seed variance pooled over every arm of the study at that look
(`dashboards.stats.pooled_differences`; the design's `pool_arms`, settled arms' seeds included). `decide` then
applies the design of `dashboards.sequential` (`launch.plan.study_design`): the sequential p-value over the looks
taken (`sequential_p`), Holm over the arms (`dashboards.stats.holm`), and futility against the plan's gap. The
decision is a function of the record alone, so a resumed driver, `a2 study status` and the end of the study read the
same one; `ROUNDS_FILE` keeps the round the study is in and each arm's state.
`RoundDecider` is what the study's searcher (`launch.search.GridCrossedSearcher`) asks at the end of each round; with
confirmation seeds (`search.confirm`) it names each fusion's chosen configuration instead (`next_round_groups`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from a2core.errors import DataError, StorageError
from a2core.selection import finite
from dashboards.compare import BASELINE, chosen_configuration, study_comparison
from dashboards.runs import Study, Trial, group_value, seed_number, sort_key
from dashboards.sequential import Design, sequential_p
from dashboards.stats import CONFIDENCE, Difference, holm, pooled_differences
from launch.layout import configuration_of, fused_seeds, seed_trial_id, seed_trials
from launch.location import StudyLocation
from launch.plan import study_design
from launch.record import StudyRecord

ROUNDS_FILE = "rounds.json"  # beside study.yaml: the round the study is in and each arm's state
BY = "fusion"  # what an arm is: `compare`'s default grouping


@dataclass(frozen=True)
class ArmState:
    """One arm after the looks taken: `state` open, resolved or futile; `look` (0-based) that settled it; `seeds`
    at its last look; `p` its verdict rule's p there; `q` its sequential p-value and `q_adjusted` Holm's over the
    arms; `reason`: one line saying why."""
    arm: str
    state: str
    look: int | None
    seeds: int
    p: float | None
    q: float | None
    q_adjusted: float | None
    reason: str


def decide(looks: list[dict[str, Difference]], design: Design, alpha: float = 1 - CONFIDENCE) -> dict[str, ArmState]:
    """Each arm's state after `looks` (look r: arm -> its `Difference` with the baseline at design.rounds[r] seeds,
    the arms that took it), by `dashboards.sequential`'s rule as `simulate` applies it: after each look the
    sequential p-values over the looks each arm took, Holm over the arms; an arm Holm resolves is settled, as is one
    whose 95% interval's upper end (in the better direction) is below `design.futility_gap` before the last look."""
    arms = list(dict.fromkeys(arm for look in looks for arm in look))
    if not arms:  # no arm has taken a look: nothing to decide (Holm over no arms has no family)
        return {}
    k, n_looks = len(arms), len(design.rounds)
    p = np.full((k, n_looks), np.nan)
    state = {arm: "open" for arm in arms}
    settled_at: dict[str, int] = {}
    last: dict[str, tuple[int, Difference]] = {}
    upper: dict[str, float] = {}
    q = adjusted = np.full(k, np.nan)
    for r, look in enumerate(looks[:n_looks]):
        for i, arm in enumerate(arms):
            d = look.get(arm)
            if state[arm] != "open" or d is None:
                continue
            last[arm] = (r, d)
            if d.p is not None:
                p[i, r] = d.p
        taken = ~np.all(np.isnan(p[:, :r + 1]), axis=1)
        q = np.where(taken, sequential_p(p[:, :r + 1], design.weights[:r + 1]), np.nan)
        adjusted, _ = holm(q, alpha)
        for i, arm in enumerate(arms):
            if state[arm] != "open" or arm not in last or last[arm][0] != r:
                continue
            d = last[arm][1]
            if taken[i] and adjusted[i] < alpha:
                state[arm], settled_at[arm] = "resolved", r
            elif design.futility_gap is not None and r < n_looks - 1 and d.low is not None:
                half = (d.high - d.low) / 2
                upper[arm] = d.better * d.delta + half
                if upper[arm] < design.futility_gap:
                    state[arm], settled_at[arm] = "futile", r
    out = {}
    for i, arm in enumerate(arms):
        r, d = last.get(arm, (None, None))
        seeds = design.rounds[r] if r is not None else 0
        qi, ai = finite(q[i]), finite(adjusted[i])
        lost = _lost_text(d, seeds)
        # seeds that errored or ended without a value: the look was taken on the rest (`looks_of`)
        missing = ("" if d is None or lost or min(d.seeds_a, d.seeds_b) >= seeds else
                   f"; with a value: {d.seeds_a} of {d.a}'s and {d.seeds_b} of {d.b}'s {seeds} seeds, the rest "
                   f"errored or diverged")
        figures = (f"sequential p {_p(qi)}, Holm-adjusted {_p(ai)}" if qi is not None
                   else "no interval (" + (d.no_verdict_reason() or "no p") + ")" if d is not None else "no look")
        figures += missing
        if state[arm] == "resolved":
            side = "beats" if d.better * d.delta > 0 else "trails"
            reason = (f"{arm}: settled at round {r + 1} ({seeds} seeds): resolved, {side} {d.b} by "
                      f"{abs(d.delta):.1f} ({figures} < {alpha:g})")
        elif state[arm] == "futile":
            reason = (f"{arm}: settled at round {r + 1} ({seeds} seeds): futile, its 95% interval's upper end "
                      f"{upper[arm]:+.1f} is below the plan's gap {design.futility_gap:g} ({figures})")
        elif r is not None and r == n_looks - 1:
            reason = (f"{arm}: undecided at the maximum, {seeds} seeds: {lost}" if lost and qi is None else
                      f"{arm}: no difference resolved at the maximum, {seeds} seeds ({figures})")
        elif lost and qi is None:
            reason = f"{arm}: open after round {r + 1} ({seeds} seeds; {lost}): gets the next round's seeds"
        else:
            reason = f"{arm}: open after round {(r or 0) + 1} ({seeds} seeds; {figures}): gets the next round's seeds"
        out[arm] = ArmState(arm, state[arm], settled_at.get(arm), seeds, None if d is None else d.p, qi, ai, reason)
    return out


def _lost_text(d: Difference | None, seeds: int) -> str:
    """Why an arm's look has no comparison because its, or the baseline's, seeds all failed ("" otherwise)."""
    if d is None or min(d.seeds_a, d.seeds_b) > 0:
        return ""
    who = d.a if d.seeds_a == 0 else f"the baseline {d.b}"
    return f"all {seeds} seeds of {who} failed (errored or diverged): no comparison"


def _p(value: float | None) -> str:
    return "-" if value is None else "<0.001" if value < 0.001 else f"{value:.3f}"


ENDED = ("TERMINATED", "ERROR")  # Tune's states of a trial that will run no more: its seed is in or is missing


def looks_of(study: Study, rounds: tuple[int, ...], by: str = BY,
             pool_arms: bool = True) -> tuple[list[dict[str, Difference]], str | None]:
    """(the looks the record holds: look r is arm -> its `Difference` with the baseline on seeds 0 .. rounds[r] - 1,
    for the arms whose configurations, and the baseline's, were handed all of those seeds and have seen every one
    end, as `a2 study compare` computes it but, with `pool_arms` (the design's), with the seed variance pooled over
    every arm there (`pooled_differences`); the baseline's label). A seed that errored or ended without a value
    (diverged) is missing: the arm takes the look on its seeds with a value (its `Difference` says how many), as
    the rule does with unequal seeds, rather than waiting for a count it can never reach; an arm whose seeds, or the
    baseline's, all failed takes it with no comparison (`decide` names it and keeps it open). A seed still pending or
    running holds the look back. A look is taken once the baseline and some arm have it; the looks stop at the
    first one not taken."""
    looks, baseline = [], None
    for n in rounds:
        below = [t for t in study.runs if seed_number(t.seed) is not None and seed_number(t.seed) < n]
        runs = [t for t in below if t.state == "TERMINATED"]
        try:
            comparison, _, _ = study_comparison(replace(study, runs=runs), by)
        except DataError:  # arms scored on different images: no look (compare says why)
            break
        complete = _complete_arms(below, n, by)
        differences = pooled_differences(comparison) if pool_arms else comparison.differences
        # a baseline whose every seed failed has no row, so compare names none: the design's is fusion none
        base = comparison.baseline if comparison.baseline is not None else BASELINE
        if base not in complete:
            break
        # an arm ended with no comparison (its or the baseline's seeds all failed) takes the look without one, so
        # that it is named, stays open and gets the next round's seeds, as an arm left with one seed does
        look = {arm: differences.get(arm) or _no_comparison(comparison, arm, base)
                for arm in sorted(complete - {base}, key=sort_key)}
        if not look:
            break
        looks.append(look)
        baseline = base
    return looks, baseline


def _no_comparison(comparison, arm: str, base: str) -> Difference:
    """A look's entry for `arm` where the rule has no comparison with `base`: no difference, no p, and each arm's
    seeds with a value as `comparison`'s rows have them (0 for the one whose seeds all failed)."""
    counts = {row.label: len(row.seeds) for row, _ in comparison.rows}
    return Difference(arm, base, math.nan, None, None, counts.get(arm, 0), counts.get(base, 0), None)


def _complete_arms(runs: list[Trial], n: int, by: str) -> set[str]:
    """The arms (values of `by`) each of whose configurations among `runs` (the trials of seeds below n) has a trial
    of every seed 0 .. n - 1 and every one of them ended (`ENDED`)."""
    seeds: dict[tuple[str, object], set[int]] = {}
    unfinished: set[str] = set()
    for t in runs:
        arm = group_value(t, by)
        if arm is None:
            continue
        seeds.setdefault((str(arm), t.config_hash), set()).add(seed_number(t.seed))
        if t.state not in ENDED:
            unfinished.add(str(arm))
    arms = {arm for arm, _ in seeds}
    short = {arm for (arm, _), got in seeds.items() if not set(range(n)) <= got}
    return arms - short - unfinished


@dataclass(frozen=True)
class Rounds:
    """The study's place in its design: `round` (1-based) it is in or ended with, `rounds`, each arm's state, whether
    the design has ended (`done`), and the lines people read."""
    round: int
    rounds: tuple[int, ...]
    arms: dict[str, ArmState]
    baseline: str | None
    done: bool

    def lines(self) -> list[str]:
        if not self.arms:
            seeds = ", ".join(map(str, self.rounds))
            return [f"adaptive replicates: round {self.round} of {len(self.rounds)} (seeds {seeds}); no arm against "
                    f"fusion none has taken a look yet: every configuration gets every round"]
        settled = sum(a.state != "open" for a in self.arms.values())
        head = (f"adaptive replicates: {'ended after' if self.done else 'in'} round {self.round} of {len(self.rounds)} "
                f"(seeds {', '.join(map(str, self.rounds))}); {settled} of {len(self.arms)} arms settled against "
                f"{self.baseline} (sequential p over the looks, Holm over the arms)")
        return [head] + [f"  {a.reason}" for a in self.arms.values()]

    def to_dict(self) -> dict:
        return {"round": self.round, "rounds": list(self.rounds), "baseline": self.baseline, "done": self.done,
                "arms": {name: asdict(a) for name, a in self.arms.items()}}


def study_rounds(spec, study: Study) -> Rounds | None:
    """The design's state of an adaptive study's record (None for a fixed number of seeds)."""
    design = study_design(spec)
    if design is None:
        return None
    looks, baseline = looks_of(study, design.rounds, pool_arms=design.pool_arms)
    arms = decide(looks, design)
    taken = len(looks)
    done = taken == len(design.rounds) or (taken > 0 and bool(arms) and all(a.state != "open" for a in arms.values()))
    return Rounds(max(1, min(taken + (0 if done else 1), len(design.rounds))), design.rounds, arms, baseline, done)


def write_rounds(location: StudyLocation, rounds: Rounds) -> None:
    """`ROUNDS_FILE`, atomically (the storage layer's write: a temp file and rename, or one whole S3 object)."""
    location.write_text(json.dumps(rounds.to_dict(), indent=1, default=_plain) + "\n", ROUNDS_FILE)


def design_ended(location: StudyLocation) -> bool:
    """The adaptive design has ended (every arm settled, or its last round handed out), as the searcher last wrote it
    (`ROUNDS_FILE`): the driver's live table's word, read without the record (`status` derives it from the record,
    `study_rounds`). False without the file, or with one that is not the design's."""
    try:
        return json.loads(location.read_text(ROUNDS_FILE) or "null")["done"] is True
    except (ValueError, TypeError, KeyError, StorageError):  # unreadable now (an S3 outage): the table goes on
        return False


def _plain(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def amend_summary(spec, study: Study, summary: dict, rounds: Rounds | None = None) -> dict:
    """An adaptive study's summary (`StudyRecord.summary`) with the design's word: `adaptive` (round, each arm's
    state and reason), each verdict the design's (resolved only where Holm over the sequential p-values resolved
    it), and the study complete once the design has ended and every trial it handed out finished. Unchanged for a
    fixed number of seeds. `rounds`: `study_rounds(spec, study)` when the caller has it already."""
    rounds = rounds or study_rounds(spec, study)
    if rounds is None:
        return summary
    out = dict(summary)
    out["adaptive"] = {**rounds.to_dict(), "lines": rounds.lines()}
    family = dict(out.get("verdicts") or {})
    if family.get("comparisons"):
        comparisons = []
        for entry in family["comparisons"]:
            arm = rounds.arms.get(entry["arm"])
            if arm is not None:
                entry = {**entry, "resolved": arm.state == "resolved", "design": asdict(arm),
                         "verdict": f"adaptive design: {arm.reason}"}
            comparisons.append(entry)
        family["comparisons"] = comparisons
        out["verdicts"] = family
    handed = len(summary.get("trials") or [])
    finished = summary.get("trials_finished", 0)
    out["num_trials"] = handed if rounds.done else summary.get("num_trials")
    out["complete"] = rounds.done and handed == finished
    return out


@dataclass(frozen=True)
class RoundDecider:
    """What the study's searcher asks at the end of a round (pickled with it in Tune's state): the record of the
    trials it handed out, read from their run folders, decides which configurations get the next round's seeds."""
    spec: object
    location: StudyLocation

    def next_round(self, finished: int, configs: dict[str, dict], trials: dict[str, dict],
                   failed: set[str] | frozenset = frozenset()) -> list[str]:
        """The groups (of `configs`: group -> its suggestion) that get round `finished + 1`'s seeds (0-based
        `finished` the round that ended; `trials`: each trial handed out -> its suggestion; `failed`: those that
        errored, ERROR in the record as `a2 study status` reads them, so that an errored seed's partial curve is no
        seed of the decision). The baseline's while any arm is open; none once every arm is settled. Writes
        `ROUNDS_FILE`."""
        rows = [row for tid, config in trials.items()  # a fused trial's seeds: trials of the record apart
                for row in seed_trials(Trial(tid, state="ERROR" if tid in failed else "TERMINATED",
                                             sampled=dict(config)))]
        study = StudyRecord.load(self.location, self.spec, trials=rows).study()
        rounds = study_rounds(self.spec, study)
        chosen = next_round_groups(self.spec, rounds, configs, study)
        if self.spec.confirm_seeds:
            print(confirmation_line(self.spec, chosen, configs), flush=True)
        if rounds is not None:
            following = finished + 2 if chosen and finished + 1 < len(rounds.rounds) else finished + 1
            rounds = replace(rounds, round=following, done=not chosen or finished + 1 >= len(rounds.rounds))
            write_rounds(self.location, rounds)
            for line in rounds.lines():
                print(line, flush=True)
        return chosen


def next_round_groups(spec, rounds: Rounds | None, configs: dict[str, dict], study: Study | None = None) -> list[str]:
    """The groups (of `configs`: group -> its suggestion, a group named by its first trial) that get the next
    round's seeds. With confirmation seeds (`search.confirm`; `study` the search's record): each fusion's chosen
    configuration, as `a2 study compare` chooses it (`chosen_configuration`). With adaptive replicates, after
    `rounds` (the design's state, `study_rounds`): the open arms' configurations, and the baseline's while any arm is
    open; every configuration while no arm has taken a look (nothing to compare yet)."""
    if spec.confirm_seeds and study is not None:
        # a chosen configuration that early stopping stopped gets its seeds too, which the replicate ASHA stops at
        # their first result: the study runs its planned trials, and the row is on val as the fixed design's would be
        by_fusion: dict[str, list[Trial]] = {}
        for r in study.runs:
            if r.best_value is not None:
                by_fusion.setdefault(str(group_value(r, BY)), []).append(r)
        chosen = {r.trial_id for runs in by_fusion.values() for r in chosen_configuration(runs, study)[0]}
        return [g for g in configs  # a fused group: its trial's seeds are the record's trials
                if g in chosen or any(seed_trial_id(g, s) in chosen for s in fused_seeds(configs[g]) or ())]
    if rounds is None or not rounds.arms:
        return list(configs)
    open_arms = {a.arm for a in rounds.arms.values() if a.state == "open"}
    arm_of = {group: str(spec.trial_config(configuration_of(config))["model"].get(BY))
              for group, config in configs.items()}
    return [g for g, arm in arm_of.items() if arm in open_arms or (open_arms and arm == rounds.baseline)]


def confirmation_line(spec, chosen: list[str], configs: dict[str, dict]) -> str:
    """One line at the search's end: which configuration of each fusion gets the confirmation seeds."""
    seeds = spec.confirm_seeds
    names = []
    for group in chosen:
        config = configuration_of(configs[group])
        names.append(", ".join(f"{k}={v}" for k, v in sorted(config.items())) or "the one configuration")
    return (f"confirmation seeds {seeds[0]}..{seeds[-1]}: chosen on val over the search's seeds, one configuration "
            f"per fusion: {'; '.join(names) or 'none (no trial reported)'}")

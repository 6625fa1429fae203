"""How far along a study is and when it will end, from its trials as the record reads them: trial-epochs done of
planned, the wall time an epoch has taken so far, and the time left at the concurrency the study runs at. Under
early stopping (ASHA) the time left is an upper bound: a stopped trial's planned epochs never run; so it is under
adaptive replicates (`search.replicates` a range), whose trials are planned up to the maximum's seeds, an arm settled
after a round getting no more, and once the design has ended no trial not started yet will run.

Rounds of seeds (adaptive replicates, or the search then its confirmation seeds: `StudySpec.seed_rounds`) run one
after another: the searcher starts none of a round's trials until every trial of the round before has ended. The time
left is then the sum over the rounds still to end of each round's epochs left, at the trials side by side that round
can have (its own Tune trials, at most max_concurrent_trials), never the study's epochs left spread over every slot at
once. Within a round (and a study of one round) the epochs left are spread evenly over its slots: the last trials'
ragged end, and the time a trial past its last epoch spends testing its selected checkpoint, are not counted.

Within an epoch (a COCO epoch is about two hours): a running trial writes the steps of its epoch done, of planned, and
a step's wall time to its run folder every 30 s (`launch.trainable.EpochProgress`; the record's `Trial.under_way`).
The share of its steps done counts as done (never a whole epoch: only its result is); until a first epoch has ended,
an epoch's time is its steps' (training alone: its validation is not counted, the low side), and then the epochs'
measured wall time (`compute/wall_s`). A fused trial's cross-entropy epochs (`a2core.fused`) write none.

A trial past its last epoch that has not ended (it tests its selected checkpoint, `train.test_at_end`) is no trial
that has ended: the line says it is finishing, and `a2 study status --watch` goes on until it has ended. The live
table of `a2 study run` and `a2 study status [--watch]` print `progress_line`."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from dashboards.runs import seed_number
from launch.layout import tune_trial_id

FINISHED = ("TERMINATED", "ERROR")  # Tune's states of a trial that trains no more in this run


@dataclass(frozen=True)
class Progress:
    epochs_done: int            # trial-epochs reported, over every trial
    epochs_planned: int         # ... planned: every trial's epochs, those not started yet included; a finished trial's
    #                             those it ran (ASHA stopped it, it errored: its unrun epochs are planned no more, so
    #                             a study whose every trial has ended is 100% done): done + left
    epochs_left: int            # ... that may still run (a finished trial's unrun epochs never will)
    seconds_per_epoch: float | None  # a trial-epoch's wall time so far (None: no epoch has ended)
    driven: bool                # a live driver holds the study (`StudyRecord.running`)
    concurrency: int            # trials side by side now: the study's max_concurrent_trials, at most the trials left
    #                             (of the round of seeds the study is in)
    early_stopping: bool        # the scheduler may stop trials early: the time left is at most this
    adaptive: bool = False      # seeds in rounds, still open: settled arms' planned seeds may never run
    finishing: int = 0          # trials past their last epoch that have not ended (testing their selected checkpoint)
    rounds: tuple[tuple[float, int], ...] = ()  # (epochs left, less those under way, and trials side by side) of
    #                             each round of seeds still to run, in order (the module's docstring); () reads as
    #                             one: (epochs_left - epochs_under_way, concurrency)
    epochs_under_way: float = 0.0  # the running trials' epochs under way, each the share of its steps done
    #                             (`Trial.under_way`, written every 30 s: `launch.trainable.EpochProgress`)
    from_steps: bool = False    # seconds_per_epoch is the steps' of the epochs under way: no epoch has ended yet

    @property
    def ended(self) -> bool:
        """Every trial has ended: no epoch is left and no trial past its last epoch is still finishing."""
        return self.epochs_left == 0 and self.finishing == 0

    @property
    def seconds_left(self) -> float | None:
        """Wall seconds until the last trial ends: each round's epochs left at its trials side by side, one round
        after another (None: not measurable yet)."""
        if self.seconds_per_epoch is None:
            return None
        rounds = self.rounds or ((self.epochs_left - self.epochs_under_way, self.concurrency),)
        return sum(left * self.seconds_per_epoch / max(1, slots) for left, slots in rounds)


def _seed_of(t):
    """A trial row's seed: a record's `Trial` resolves it (its config, else its sampled), a plain row samples it."""
    seed = t.get("seed")
    return (t.get("sampled") or {}).get("seed") if seed is None else seed


def study_progress(spec, trials, driven: bool, design_ended: bool = False) -> Progress:
    """The progress of the study `spec` from its `trials` (the record's rows: `state`, `epochs_done`,
    `epochs_planned`, `compute` with the trial's cumulative `wall_s`, the seed as a `Trial` or its `sampled` has it);
    trials not started yet count as planned, unless `design_ended`: the adaptive design has settled every arm
    (`launch.adaptive.Rounds.done`), so none of them will run. `driven`: a live driver holds the study."""
    planned_each = spec.total_epochs
    adaptive = spec.replicate_rounds is not None
    closed = adaptive and design_ended  # no trial not started yet will run
    done = sum(int(t["epochs_done"] or 0) for t in trials)

    def unrun(t) -> int:  # a trial's epochs that may still run
        return max(0, int(t["epochs_planned"] or planned_each) - int(t["epochs_done"] or 0))

    def under(t) -> dict | None:  # a running trial's epoch under way (`Trial.under_way`), of an epoch it has left
        u = t.get("under_way")
        return u if u and t["state"] not in FINISHED and unrun(t) and u.get("total") else None

    def share(t) -> float:  # the share of that epoch's steps done, below a whole epoch (it is not reported yet)
        u = under(t)
        return min(u["done"] / u["total"], 0.99) if u else 0.0

    # the last trials run fewer at a time; counted in Tune's trials, which max_concurrent_trials bounds: a fused
    # trial trains its k seeds (k of these rows, each charged 1/k of its wall time) as one
    fused = spec.resources.fuse_replicates
    tune_id = tune_trial_id if fused else (lambda trial_id: trial_id)
    # the rounds of seeds: (configurations, seeds each adds) of each (one round without `seed_rounds`); a trial's
    # round is its seed's place among the study's seeds (a seed the study does not list: the first round's)
    sizes = spec.seed_rounds_trials
    bounds = list(accumulate(seeds for _, seeds in sizes))
    place = {seed: i for i, seed in enumerate(spec.replicate_seeds + spec.confirm_seeds)}
    by_round: list[list] = [[] for _ in sizes]
    for t in trials:
        i = place.get(seed_number(_seed_of(t)))
        by_round[0 if i is None else min(bisect_right(bounds, i), len(sizes) - 1)].append(t)
    rounds = []
    for (configs, seeds), rows in zip(sizes, by_round):
        # a round plans every configuration's seeds (at most, under adaptive replicates: an arm settled gets none)
        unstarted = 0 if closed else max(0, configs * seeds - len(rows))
        left = sum(unrun(t) for t in rows if t["state"] not in FINISHED) + unstarted * planned_each
        # a trial past its last epoch (testing its selected checkpoint before it ends) is no slot for the epochs left
        running = {tune_id(t["trial_id"]) for t in rows if t["state"] not in FINISHED and unrun(t)}
        not_started = 0 if closed else max(0, (configs if fused else configs * seeds)
                                           - len({tune_id(t["trial_id"]) for t in rows}))
        if left:
            slots = max(1, min(spec.resources.max_concurrent_trials, len(running) + not_started))
            rounds.append((left, slots, sum(share(t) for t in rows)))
    left = sum(epochs for epochs, _, _ in rounds)
    under_way = sum(part for _, _, part in rounds)
    rounds = [(epochs - part, slots) for epochs, slots, part in rounds]
    # what will have run when the study ends: a stopped or errored trial's unrun epochs counted as planned read an
    # ASHA study that has ended as 62% done (20/32), and a trial past the spec's epochs as over 100%
    planned = done + left
    timed = [(float((t["compute"] or {}).get("wall_s") or 0.0), int(t["epochs_done"] or 0)) for t in trials]
    wall, epochs = sum(w for w, e in timed if e), sum(e for w, e in timed if w)
    per_epoch = wall / epochs if epochs and wall else None
    # no epoch has ended (a COCO epoch is hours): the epochs under way time one from their steps, the training's
    # alone (its validation not counted: the lower side)
    stepped = [u["seconds_per_step"] * u["total"] for u in map(under, trials) if u and u.get("seconds_per_step")]
    from_steps = per_epoch is None and bool(stepped)
    if from_steps:
        per_epoch = sum(stepped) / len(stepped)
    finishing = sum(1 for t in trials if t["state"] not in FINISHED and not unrun(t))
    return Progress(done, planned, left, per_epoch, driven,
                    rounds[0][1] if rounds else 1, spec.search.scheduler.asha is not None,
                    adaptive and not design_ended, finishing, tuple(rounds), under_way, from_steps)


def duration_text(seconds: float) -> str:
    """3 d 4 h, 2 h 05 min, 7 min, 40 s: two units at most, as a person reads a time left, rounded to the nearest of
    the smallest unit shown (100 s is "2 min", not "1 min"; 7,190 s "2 h 00 min", not "1 h 59 min")."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days} d {hours} h"


def progress_line(progress: Progress) -> str:
    """`progress: 37/64 trial-epochs, 1.4 more under way (60%); 95 s a trial-epoch; about 11 min left at 2 trials at
    a time (at most: early stopping may end trials sooner)`; with rounds of seeds still to run, `about 2 h 10 min left in 3 rounds of
    seeds, one after another (this one at 2 trials at a time)`."""
    p = progress
    # 99.5% and over would round to "100%" next to a time left: 100% only once nothing is left
    done = p.epochs_done + p.epochs_under_way
    share = f" ({min(done / p.epochs_planned, 0.99 if p.epochs_left else 1):.0%})" if p.epochs_planned else ""
    under = f", {p.epochs_under_way:.1f} more under way" if p.epochs_under_way >= 0.05 else ""
    line = f"progress: {p.epochs_done}/{p.epochs_planned} trial-epochs{under}{share}"
    if p.ended:
        return line + "; every trial has ended"
    if p.epochs_left == 0:  # ended only once these have: `a2 study status --watch` waits for them
        line += (f"; {p.finishing} trial{'s' if p.finishing > 1 else ''} past {'their' if p.finishing > 1 else 'its'}"
                 f" last epoch, not ended yet (testing the selected checkpoint)")
        return line + ("" if p.driven else "; no driver runs the study now (`a2 study resume` continues it)")
    if p.seconds_left is None:
        return line + "; time left: known once a trial-epoch has ended"
    at = f"{p.concurrency} trial{'s' if p.concurrency > 1 else ''} at a time"
    timed = " (from its training steps so far, validation not counted: no epoch has ended)" if p.from_steps else ""
    line += (f"; {duration_text(p.seconds_per_epoch)} a trial-epoch{timed}; about {duration_text(p.seconds_left)} "
             "left ")
    line += (f"in {len(p.rounds)} rounds of seeds, one after another (this one at {at})" if len(p.rounds) > 1
             else f"at {at}")
    sooner = [why for why, applies in (("early stopping may end trials sooner", p.early_stopping),
                                       ("arms settled after a round get no more seeds", p.adaptive)) if applies]
    if sooner:
        line += f" (at most: {'; '.join(sooner)})"
    if not p.driven:
        line += "; no driver runs the study now (`a2 study resume` continues it)"
    return line

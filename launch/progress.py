"""How far along a study is and when it will end, from its trials as the record reads them: trial-epochs done of
planned, the wall time an epoch has taken so far, and the time left at the concurrency the study runs at. Under
early stopping (ASHA) the time left is an upper bound: a stopped trial's planned epochs never run; so it is under
adaptive replicates (`search.replicates` a range), whose trials are planned up to the maximum's seeds, an arm settled
after a round getting no more, and once the design has ended no trial not started yet will run. The live table of
`a2 study run` and `a2 study status [--watch]` print `progress_line`."""
from __future__ import annotations

from dataclasses import dataclass

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
    concurrency: int            # trials side by side: the study's max_concurrent_trials
    early_stopping: bool        # the scheduler may stop trials early: the time left is at most this
    adaptive: bool = False      # seeds in rounds, still open: settled arms' planned seeds may never run

    @property
    def seconds_left(self) -> float | None:
        """Wall seconds until the last trial ends, at `concurrency` trials side by side (None: not measurable yet)."""
        if self.seconds_per_epoch is None:
            return None
        return self.epochs_left * self.seconds_per_epoch / max(1, self.concurrency)


def study_progress(spec, trials, driven: bool, design_ended: bool = False) -> Progress:
    """The progress of the study `spec` from its `trials` (the record's rows: `state`, `epochs_done`,
    `epochs_planned`, `compute` with the trial's cumulative `wall_s`); trials not started yet count as planned,
    unless `design_ended`: the adaptive design has settled every arm (`launch.adaptive.Rounds.done`), so none of
    them will run. `driven`: a live driver holds the study."""
    planned_each = spec.total_epochs
    adaptive = spec.replicate_rounds is not None
    unstarted = 0 if adaptive and design_ended else max(0, spec.num_trials - len(trials))
    done = sum(int(t["epochs_done"] or 0) for t in trials)

    def unrun(t) -> int:  # a trial's epochs that may still run
        return max(0, int(t["epochs_planned"] or planned_each) - int(t["epochs_done"] or 0))

    left = sum(unrun(t) for t in trials if t["state"] not in FINISHED) + unstarted * planned_each
    # what will have run when the study ends: a stopped or errored trial's unrun epochs counted as planned read an
    # ASHA study that has ended as 62% done (20/32), and a trial past the spec's epochs as over 100%
    planned = done + left
    timed = [(float((t["compute"] or {}).get("wall_s") or 0.0), int(t["epochs_done"] or 0)) for t in trials]
    wall, epochs = sum(w for w, e in timed if e), sum(e for w, e in timed if w)
    # the last trials run fewer at a time; counted in Tune's trials, which max_concurrent_trials bounds: a fused
    # trial trains its k seeds (k of these rows, each charged 1/k of its wall time) as one
    tune_id = tune_trial_id if spec.resources.fuse_replicates else (lambda trial_id: trial_id)
    # a trial past its last epoch (testing its selected checkpoint before it ends) is no slot for the epochs left
    running = {tune_id(t["trial_id"]) for t in trials if t["state"] not in FINISHED and unrun(t)}
    not_started = 0 if adaptive and design_ended else max(0, spec.tune_samples - len({tune_id(t["trial_id"])
                                                                                      for t in trials}))
    return Progress(done, planned, left, wall / epochs if epochs and wall else None,
                    driven,
                    max(1, min(spec.resources.max_concurrent_trials, len(running) + not_started)),
                    spec.search.scheduler.asha is not None, adaptive and not design_ended)


def duration_text(seconds: float) -> str:
    """3 d 4 h, 2 h 05 min, 7 min, 40 s: two units at most, as a person reads a time left."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min" if minutes else f"{secs} s"


def progress_line(progress: Progress) -> str:
    """`progress: 37/64 trial-epochs (58%); 95 s a trial-epoch; about 11 min left at 2 trials at a time (at most:
    early stopping may end trials sooner)`."""
    p = progress
    # 99.5% and over would round to "100%" next to a time left: 100% only once nothing is left
    share = (f" ({min(p.epochs_done / p.epochs_planned, 0.99 if p.epochs_left else 1):.0%})" if p.epochs_planned
             else "")
    line = f"progress: {p.epochs_done}/{p.epochs_planned} trial-epochs{share}"
    if p.epochs_left == 0:
        return line + "; every trial has ended"
    if p.seconds_left is None:
        return line + "; time left: known once a trial-epoch has ended"
    line += (f"; {duration_text(p.seconds_per_epoch)} a trial-epoch; about {duration_text(p.seconds_left)} left at "
             f"{p.concurrency} trial{'s' if p.concurrency > 1 else ''} at a time")
    sooner = [why for why, applies in (("early stopping may end trials sooner", p.early_stopping),
                                       ("arms settled after a round get no more seeds", p.adaptive)) if applies]
    if sooner:
        line += f" (at most: {'; '.join(sooner)})"
    if not p.driven:
        line += "; no driver runs the study now (`a2 study resume` continues it)"
    return line

"""The Tune driver's part in tracking a study: it hands Tune's live trials to the export thread
(`launch.mlflow_export.StudyExporter`), writes the scheduler's decision to stop a trial into the trial's run folder
(the record), and at the experiment's end exports once more with the runs' final statuses. Its hooks never wait on
MLflow and hold no tracking state of their own: what MLflow lacks is found again in the study's storage.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from ray.tune import Callback

from dashboards.tracking import check_tracking_uri, ui_pointer
from launch import stop
from launch.killpoints import kill_point
from launch.lease import held_lease
from launch.mlflow_export import Export, StudyExporter, end_reason, refusal, refused_text
from launch.layout import STOPPED_FILE, TRIALS_DIR, fused_seeds, outage_line, seed_trial_id, train_run_name
from launch.tracking_writer import client_settings

logger = logging.getLogger(__name__)


class A2MLflowCallback(Callback):
    """Track the study `spec` (stored at `location`, a `launch.location.StudyLocation`) in MLflow; `stopped_early_of`:
    the scheduler's record of stopping a trial (`launch.search.ReplicateASHA.stopped_early`); `every`: seconds
    between exports."""

    def __init__(self, spec, location, *, stopped_early_of: Callable[[str], dict | None] | None = None,
                 every: float = 2.0):
        self.spec, self.location, self.stopped_early_of, self.every = spec, location, stopped_early_of, every
        self.trials: list = []  # Tune's trials, as its hooks last passed them
        self.exporter: StudyExporter | None = None
        self.outage: dict | None = None  # the study's outage totals, once the experiment ended
        self.live: set[str] = set()  # the trials not ended when Tune's last step ended (`on_step_end`)

    def __getstate__(self):  # the Tuner pickles its callbacks; a restored driver starts its own thread
        return {**self.__dict__, "trials": [], "exporter": None, "live": set()}

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info):
        # A bad tracking URI stops the study before any trial starts (the pre-flight); a refusal does not.
        check_tracking_uri(self.spec.tracking.mlflow_uri)
        client_settings()
        export = Export(self.spec, self.location)
        try:
            tracker = export.open()
        except Exception as err:
            if refusal(self.spec.tracking.mlflow_uri, err) is None:  # not a refusal: as before, the study stops
                raise
            # the server answered and refused (a name it will not take, a permission): as a refusal mid-study,
            # training goes on without the export, which is said and recorded (`tracking/outage.json`)
            self.exporter = StudyExporter(export, self.tune_trials, self.every)
            self.exporter.refuse(err)
            return
        print(f"MLflow: study {self.spec.name!r} -> parent run {tracker.parent_run_id}; trials: "
              + ui_pointer(tracker.tracking_uri, tracker.experiment_id), flush=True)
        self.exporter = StudyExporter(export, self.tune_trials, self.every)

    def tune_trials(self) -> list:
        """Tune's trials as the export reads them. Tune's cleanup at the experiment's end (a stop signal, a storage
        error) sets the trials still running TERMINATED, after saving them as PENDING: those are handed over as
        saved, so that their runs end KILLED (a resume continues them), not FINISHED as if stopped early."""
        live = self.live
        return [_Interrupted(t) if t.status == "TERMINATED" and str(t.trial_id) in live else t
                for t in list(self.trials)]

    def on_step_begin(self, iteration, trials, **info):
        self.trials = trials

    def on_step_end(self, iteration, trials, **info):
        self.live = {str(t.trial_id) for t in trials if t.status not in ("TERMINATED", "ERROR")}

    def _poke(self, iteration, trials, trial, *args, **info):
        """A trial started, reported or ended: the export thread exports now (the hook does not wait for it)."""
        self.trials = trials
        if self.exporter is not None:
            self.exporter.poke()

    on_trial_start = on_trial_restore = on_trial_error = _poke

    def on_trial_result(self, iteration, trials, trial, result, **info):
        kill_point("trial-result", result.get("epoch"))  # the kill-anywhere test's hook (`launch.killpoints`)
        self._poke(iteration, trials, trial)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.live.discard(str(trial.trial_id))
        record = self.stopped_early_of(str(trial.trial_id)) if self.stopped_early_of else None
        seeds = fused_seeds(trial.config)  # a fused trial's seeds: each its own folder
        ids = [str(trial.trial_id)] if seeds is None else [seed_trial_id(trial.trial_id, s) for s in seeds]
        for trial_id in ids if record else []:
            folder = self.location.at(TRIALS_DIR, train_run_name(self.spec.name, trial_id))
            try:
                folder.join(STOPPED_FILE).write_text(json.dumps(record, indent=1) + "\n")
            except Exception as err:  # noqa: BLE001 - storage trouble stops the study elsewhere, not in a hook
                logger.warning("could not record that trial %s was stopped early: %s", trial_id, err)
        self._poke(iteration, trials, trial)

    def on_experiment_end(self, trials, **info):
        # The runs' statuses follow the trials' as they are now: FINISHED only when every trial is, KILLED while
        # some can still resume, FAILED if one failed.
        if self.exporter is None:
            return
        lease = held_lease(self.location.uri())
        if lease is not None and lease.lost.is_set():  # superseded: the study's MLflow runs are its new writer's
            self.exporter.stop.set()
            self.exporter.wake.set()
            self.exporter = None
            return
        self.trials = trials
        signal_number = stop.received()
        ended = end_reason(self.spec.name, stop.signal_name(signal_number) if signal_number else None)
        self.outage = self.exporter.close(ended)  # shown by the live table's last report and in the summary
        self.exporter = None

    def outage_text(self) -> str | None:
        """The live table's tracking line while the server is (or was) down, or once MLflow refused the study's
        export (its last report, at the study's end, too), else None."""
        status = self.exporter.status() if self.exporter is not None else self.outage
        if status and status.get("refused"):
            return "tracking: refused by MLflow, nothing exported since: " + refused_text(self.spec.name,
                                                                                          status["refused"])
        return outage_line(status)


class _Interrupted:
    """A Tune trial that Tune's cleanup set TERMINATED while it ran, as Tune's experiment state saved it: PENDING."""

    status = "PENDING"

    def __init__(self, trial):
        self._trial = trial

    def __getattr__(self, name):
        return getattr(self._trial, name)

    def __str__(self):
        return str(self._trial)

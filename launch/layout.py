"""The storage layout of a study, the ground floor of launch/: where each thing of a trial lives in the study's
folder (`<study>/trials/<study>-<trial id>/`: its result log, checkpoint folders, stop record, MLflow artifacts,
Ray Train's snapshot) and how those files read back (`ResultLog`, `stop_record`, `end_record`). Every other module,
the trial's, the driver's, the record's, the MLflow export's, takes names and paths from here; this one imports
nothing of theirs.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys

from a2core.errors import StorageError, StudyError

TRIALS_DIR = "trials"  # below the study's folder: one run folder per trial
CHECKPOINT_FILE = "checkpoint.pt"  # a2core.checkpoint.CHECKPOINT_FILE (not imported: keeps this module light)
HISTORY_FILE = "history.json"  # a2core.checkpoint.HISTORY_FILE, likewise
CHECKPOINT_PREFIX = "checkpoint_epoch"  # + the epoch, 4 digits: one folder per checkpointed epoch
RESULTS_FILE = "results.json"  # in a trial's run folder: every epoch's result, across retries and restores
ARTIFACTS_DIR = "artifacts"  # in a trial's run folder: the files of its MLflow run, at their artifact paths
STOPPED_FILE = "stopped_early.json"  # in a trial's run folder: the scheduler's decision to stop it (launch.driver)
ENDED_FILE = "ended.json"  # in a trial's run folder: why the trial itself ended before its planned epochs (`end_record`)
PROGRESS_FILE = "progress.json"  # in a trial's run folder: where it is within its epoch (`progress_record`)
END_REASONS = ("diverged",)  # what an end record may say: `a2core.errors.TrainingDiverged` (launch.trainable)
# in a trial's run folder: the configuration Tune sampled for it (`{"trial_id", "config"}`), written when it starts:
# a later trial of the same configuration finds the folder by it when Tune lost the trial (`launch.trainable.adopt`)
TRIAL_FILE = "trial.json"
# in a trial's run folder: a later trial continued it (`{"by", "run", "epoch"}`); the folder is superseded, out of the
# record (Tune does not know its trial), and its MLflow run is ended KILLED, superseded (`launch.mlflow_export`)
SUPERSEDED_FILE = "superseded.json"
TUNE_POINTER_FILE = "train_checkpoint.json"
TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a trial's checkpoints


def train_run_name(study: str, trial_id: str) -> str:
    """The run folder of a trial: the same on every retry and restore of that trial."""
    return f"{study}-{trial_id}"


# Fused replicates (`resources.fuse_replicates`): one Tune trial trains a configuration's seeds together. Its sampled
# config lists them under FUSED_SEEDS_KEY instead of one `seed`; each seed has a run folder of its own, named by
# `seed_trial_id`, and is a trial of the record like any other (`seed_trials`). What the fused trial reports to Tune
# is the mean of its live seeds under the study metric (what the searcher asks for), each seed's own values under
# `seed_result_key` (what the scheduler judges and the live table shows).
FUSED_SEEDS_KEY = "seeds"


def seed_trial_id(trial_id: str, seed) -> str:
    """The record's id of seed `seed` of the fused Tune trial `trial_id`."""
    return f"{trial_id}-s{seed}"


def tune_trial_id(record_id: str) -> str:
    """The Tune trial a record's trial belongs to: the fused trial of a seed's id (`seed_trial_id`), else itself."""
    return re.sub(r"-s-?\d+$", "", record_id)


def seed_result_key(seed, key: str) -> str:
    return f"seed{seed}/{key}"


def fused_seeds(sampled: dict | None) -> list | None:
    """The seeds a Tune trial trains fused (its sampled config's FUSED_SEEDS_KEY), None for a trial of one seed."""
    seeds = (sampled or {}).get(FUSED_SEEDS_KEY)
    return list(seeds) if isinstance(seeds, list) else None


def configuration_of(sampled: dict) -> dict:
    """A trial's sampled config without its seeds (a replicate's `seed`, a fused trial's FUSED_SEEDS_KEY): its
    configuration, as its replicate group shares it."""
    return {k: v for k, v in sampled.items() if k not in ("seed", FUSED_SEEDS_KEY)}


def seed_sampled(sampled: dict, seed) -> dict:
    """The sampled config of one seed of a fused trial: what a trial of that seed alone would have sampled."""
    return {**configuration_of(sampled), "seed": seed}


def seed_result(result: dict | None, seed, trial_id: str) -> dict:
    """Seed `seed`'s part of a fused trial's result (`seed_result_key`), its keys as in a trial of its own."""
    prefix = seed_result_key(seed, "")
    own = {k[len(prefix):]: v for k, v in (result or {}).items() if k.startswith(prefix)}
    return {**own, "trial_id": trial_id} if own else {}


def seed_trials(trial):
    """The record's trials of a Tune trial (a `dashboards.runs.Trial` as `launch.conclusions.tune_trial` makes it):
    itself, or one per seed of a fused trial, each with its own id, sampled seed and part of the last result."""
    seeds = fused_seeds(trial.sampled)
    if seeds is None:
        return [trial]
    return [dataclasses.replace(trial, trial_id=(tid := seed_trial_id(trial.trial_id, s)), name=f"{trial.name}-s{s}",
                                sampled=seed_sampled(trial.sampled, s),
                                last_result=seed_result(trial.last_result, s, tid)) for s in seeds]


def checkpoint_name(epoch: int) -> str:
    """`checkpoint_epochNNNN`: the folder of an epoch's checkpoint in a trial's run folder."""
    return f"{CHECKPOINT_PREFIX}{int(epoch):04d}"


def checkpoint_epochs(run) -> list[int]:
    """The epochs that have a checkpoint folder in the run folder `run` (a Location), ascending."""
    digits = (n[len(CHECKPOINT_PREFIX):] for n in run.listdir(folders_only=True) if n.startswith(CHECKPOINT_PREFIX))
    return sorted(int(d) for d in digits if d.isdigit())


# Bookkeeping in a result, not metrics of the model (Tune's own keys, checkpoint paths, time stamps).
SKIP_KEYS = {"done", "trial_id", "experiment_id", "experiment_tag", "should_checkpoint", "timesteps_this_iter",
             "episodes_this_iter", "epoch", "samples", "checkpoint_path", "best_checkpoint", "best_checkpoint_path",
             "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "date", "pid", "hostname",
             "node_ip", "checkpoint_dir_name", "time_since_restore", "iterations_since_restore", "timesteps_total",
             "episodes_total", "timesteps_since_restore", "config"}


def run_status(state: str, epochs: int, stopped: dict | None, total_epochs: int, ended: bool,
               end: dict | None = None) -> str:
    """The MLflow status of a trial's run: FINISHED when Tune ended it after all its epochs or the scheduler stopped
    it, FAILED when it errored or ended itself for a reason (`end`, its end record: it diverged), else KILLED once
    the study `ended` (no writer goes on with it), else RUNNING."""
    if state == "TERMINATED" and end is not None:
        return "FAILED"
    if state == "TERMINATED" and (stopped is not None or epochs >= total_epochs):
        return "FINISHED"
    return "FAILED" if state == "ERROR" else "KILLED" if ended else "RUNNING"


def _record(folder, name: str, what: str, valid, needs: str, text: str | None) -> dict | None:
    """The JSON record `name` of run folder `folder` (`text`: the file's text, when already read), or None when there
    is none; a file that is not one (not JSON, or `valid(record)` false: it lacks `needs`) is a StudyError naming it."""
    target = folder.join(name)
    text = target.read_text() if text is None else text
    try:
        record = json.loads(text or "null")
    except ValueError as err:
        raise StudyError(f"{target.uri}: not {what} ({err}); delete it to let the study go on") from None
    if record is not None and not (isinstance(record, dict) and valid(record)):
        raise StudyError(f"{target.uri}: not {what} ({needs}); delete it to let the study go on")
    return record


def stop_record(folder, text: str | None = None) -> dict | None:
    """The scheduler's decision to stop the trial of run folder `folder` (`{"rung", "cutoff", ...}`), or None."""
    return _record(folder, STOPPED_FILE, "a stop record", lambda r: "rung" in r and "cutoff" in r,
                   "no rung and cutoff", text)


def end_record(folder, text: str | None = None) -> dict | None:
    """Why the trial of run folder `folder` ended itself before its planned epochs (`{"reason": "diverged", "epoch",
    "step", "key"}`), or None."""
    return _record(folder, ENDED_FILE, "an end record", lambda r: r.get("reason") in END_REASONS,
                   f"no reason among {', '.join(END_REASONS)}", text)


def progress_record(folder, epoch: int, since: float | None = None) -> dict | None:
    """Where the trial of run folder `folder` is within its epoch `epoch` (1-based), as it last wrote it
    (`launch.trainable.EpochProgress`): `{"stage", "epoch", "done", "total", "seconds_per_step"}`, the optimizer
    steps of the epoch done and planned and the wall seconds a step has taken in it (None before two steps); None
    when it wrote none of that epoch (an epoch reported already is the result log's). Advisory, so a file that is
    not one, or that cannot be read now, is None, never an error: it costs the estimate, not the record or the
    driver's live table (a step count of 1e9 or more is not one either: of hundreds of digits, a step's time by it
    overflowed a float and raised in the estimate). `since`: the start (epoch seconds) of the driver now running the
    study; a file written before it is the killed attempt's, not where the trial is now (a resumed study's trial
    waiting for its slot read as under way until its first step)."""
    try:
        record = json.loads(folder.join(PROGRESS_FILE).read_text() or "null")
        done, total, per_step = record["done"], record["total"], record.get("seconds_per_step")
        valid = (record["epoch"] == epoch and type(done) is int and type(total) is int and 0 <= done <= total
                 and 0 < total < 1e9
                 and (per_step is None or (type(per_step) in (int, float) and 0 <= per_step < 1e9))
                 and not (since is not None and type(record.get("time")) in (int, float) and record["time"] < since))
    except (ValueError, TypeError, KeyError, StorageError):  # StorageError: unreadable now (an S3 outage)
        return None
    return {key: record.get(key) for key in ("stage", "epoch", "done", "total", "seconds_per_step")} if valid else None


def end_text(record: dict | None) -> str | None:
    """`diverged at epoch 3 step 120 (train/loss nan)`: an end record for people; None without one."""
    if not record:
        return None
    where = " ".join(f"{k} {record[k]}" for k in ("epoch", "step") if record.get(k) is not None)
    what = f" ({record['key']} {record.get('value', 'not finite')})" if record.get("key") else ""
    return f"{record['reason']}{' at ' + where if where else ''}{what}"


def plain_values(result: dict) -> dict:
    """A result's JSON-plain values: what the result log and Tune keep. The per-image scores and caption samples a
    result also carries go to the trial's `artifacts/` (`launch.trainable.TrialRecorder.keep_artifacts`) and nowhere
    else: in Tune's results they would be saved again with every experiment-state snapshot and every trial's Tune
    result log (at 1,005 trials of 500 images, 93 MB of state per snapshot, `benchmarks/RESULTS.md`)."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool)) or v is None}


class ResultLog:
    """A trial's results by epoch (JSON-plain values), rewritten in its run folder after every epoch, before Tune
    and MLflow hear of them: Tune keeps only what it had synced when it restarts a trial. An epoch reported again
    replaces its entry."""

    def __init__(self, location):
        self.location = location
        text = location.read_text()
        self.by_epoch: dict[int, dict] = results_by_epoch(text) if text else {}

    def add(self, result: dict) -> None:
        self.add_missing([result], replace=True)

    def add_missing(self, results: list[dict], write: bool = True, replace: bool = False) -> list[int]:
        """Add the results of epochs the log does not have (what a checkpoint remembers); returns those epochs."""
        added = []
        for result in results:
            epoch = result.get("epoch")
            if isinstance(epoch, (int, float)) and (replace or int(epoch) not in self.by_epoch):
                self.by_epoch[int(epoch)] = plain_values(result)
                added.append(int(epoch))
        if added and write:
            self.location.write_text(json.dumps([self.by_epoch[e] for e in sorted(self.by_epoch)], indent=1))
        return sorted(added)


def latest_checkpoint_history(run) -> list[dict]:
    """The epoch history stored with the newest checkpoint of the run folder `run` that has one (empty if none):
    a driver killed between a checkpoint and Tune hearing of its result loses that result everywhere but here."""
    for epoch in reversed(checkpoint_epochs(run)):  # older checkpoints may lack the file
        try:  # a damaged one (cut short, or a flipped bit that is no UTF-8 any more) is passed over
            items = json.loads(run.join(checkpoint_name(epoch), HISTORY_FILE).read_text() or "null")
        except ValueError:
            continue
        if isinstance(items, list):
            return [item for item in items if isinstance(item, dict)]
    return []


def results_by_epoch(text: str) -> dict[int, dict]:
    """A result log's text as {epoch: its first entry}, in the file's order (`ResultLog` writes it sorted and JSON-
    plain: nothing is sorted or copied again, a status reads every trial's). ValueError when it is not a JSON list
    (an empty file included: `ResultLog` writes whole files)."""
    items = json.loads(text) if text else None
    if not isinstance(items, list):
        raise ValueError("empty file" if not text else "not a JSON list of results")
    by_epoch: dict[int, dict] = {}
    for item in items:
        epoch = item.get("epoch") if isinstance(item, dict) else None
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
            by_epoch.setdefault(int(epoch), item)
    return by_epoch


def read_results(trials, study: str, trial_id: str) -> list[dict]:
    """The result log of a trial below the `trials` Location, oldest epoch first; empty when it has none yet.
    ValueError when the file is there but unreadable (`results_by_epoch`)."""
    text = trials.join(train_run_name(study, trial_id), RESULTS_FILE).read_text()
    return [] if text is None else list(results_by_epoch(text).values())


# -- outage totals ----------------------------------------------------------------------------------------------
OUTAGE_KEYS = ("down_seconds", "exported_late")


def add_outage(location, **counts) -> dict:
    """Add a driver's figures to the study's saved ones (`tracking/outage.json`); returns the totals. `refused`: why
    MLflow refused the driver's export (`launch.mlflow_export.refusal`); the study's first is kept while anything is
    pending, and goes with `pending` (`a2 mlflow sync` exported everything)."""
    target = location.at("tracking", "outage.json")
    try:
        saved = json.loads(target.read_text() or "{}")
    except ValueError:
        saved = None
    if not (isinstance(saved, dict) and all(isinstance(saved.get(key, 0), (int, float)) for key in OUTAGE_KEYS)
            and isinstance(saved.get("refused", ""), str)):
        # figures for people, not state: a damaged file must not fail the driver writing the study's summary
        print(f"a2 study: warning: {target.uri} is damaged; the MLflow outage figures start again from this "
              f"driver's", file=sys.stderr)
        saved = {}  # no "pending" in it: the totals are written again below
    totals = {key: saved.get(key, 0) + counts.get(key, 0) for key in OUTAGE_KEYS}
    totals["down_seconds"] = round(float(totals["down_seconds"]), 3)
    totals["pending"] = bool(counts.get("pending", saved.get("pending", False)))
    refused = (saved.get("refused") or counts.get("refused")) if totals["pending"] else None
    if refused:
        totals["refused"] = refused
    if any(counts.values()) or saved.get("pending") != totals["pending"] or saved.get("refused") != refused:
        target.write_text(json.dumps(totals, indent=2) + "\n")
    return totals


def outage_line(outage: dict | None) -> str | None:
    """`tracking: server down 31 s, 14 epochs exported once it was back`, or what MLflow refused (what to fix);
    None when nothing happened."""
    if not outage or not (outage.get("down_seconds") or outage.get("pending")):
        return None
    refused = outage.get("refused") if outage.get("pending") else None
    if refused:
        down = f"server down {outage['down_seconds']:.0f} s, " if outage.get("down_seconds") else ""
        return (f"tracking: {down}refused by MLflow: {refused}; not all exported yet (once that is settled, "
                f"`a2 mlflow sync NAME` exports the rest)")
    text = f"tracking: server down {outage.get('down_seconds', 0):.0f} s, "
    if outage.get("pending"):
        return text + "not all exported yet (`a2 mlflow sync NAME` exports the rest)"
    return text + f"{outage.get('exported_late', 0)} epochs exported once it was back"

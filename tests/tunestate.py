"""Tune's experiment state written by Ray's own classes, without a Ray runtime: stub `ray.tune.experiment.Trial`s
whose results, failures and checkpoint go through Tune's own methods, saved in the layout
`TuneController.save_to_dir` writes (`experiment_state-<time>.json`: `{"trial_data": [Trial.get_json_state(), ...],
"runner_data", "stats"}`), with each trial's folder below the experiment (`Trial.relative_logdir`: Tune's
`result.json`, `params.json`, its error file). For tests and benchmarks of what reads the state back
(`launch.verify.experiment_trials`)."""
from __future__ import annotations

import json
from pathlib import Path

TRAINABLE = "a2_local_trial"  # launch.driver's trainable name for one-worker trials
STAMP = "2026-11-27_10-00-00"  # the time stamp of a saved state's name (ray.tune.utils.date_str's form)


def experiment_storage(folder: Path):
    """The StorageContext of an experiment in `folder` (its parent is the storage root, its name the experiment's)."""
    from ray.train._internal.storage import StorageContext

    return StorageContext(str(folder.parent), folder.name)


def tune_trial(storage, trial_id: str, config: dict, n: int, *, status: str = "TERMINATED",
               results: list[dict] = (), failures: int = 0, error: str | None = None, started: bool = True,
               result_log: bool = False):
    """A stub Tune trial, the `n`-th of its experiment: `results` fed to it as Tune feeds a trial's reports
    (`update_last_result`, its last one as its checkpoint's result), `failures` retries, `error` the text of its
    error file (`Trial.handle_error`'s form, written below the experiment), `started` False for a trial Tune never
    started (no folder). With `result_log`, its folder gets Tune's own `result.json` and `params.json`."""
    from ray.train import Checkpoint
    from ray.train._internal.session import _TrainingResult
    from ray.tune.experiment import Trial

    trial = Trial(TRAINABLE, config=dict(config), trial_id=trial_id, storage=storage, stub=True,
                  evaluated_params=dict(config), experiment_tag=f"{n}_" + ",".join(f"{k}={v}" for k, v in config.items()))
    trial.create_placement_group_factory()  # stub: Tune's default resources
    folder = None
    if started:
        trial.relative_logdir = trial.storage.trial_dir_name = trial._generate_dirname()
        folder = Path(storage.experiment_fs_path, trial.relative_logdir)
        folder.mkdir(parents=True, exist_ok=True)
    for index, result in enumerate(results, 1):
        trial.update_last_result({**result, "training_iteration": index, "trial_id": trial_id, "config": config})
    if results and folder is not None:
        checkpoint = folder / f"checkpoint_{len(results) - 1:06d}"
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "train_checkpoint.json").write_text(json.dumps({"train_checkpoint": None}))
        trial.on_checkpoint(_TrainingResult(checkpoint=Checkpoint(str(checkpoint)), metrics=dict(trial.last_result)))
    if result_log and folder is not None:
        (folder / "params.json").write_text(json.dumps(config))
        (folder / "result.json").write_text("".join(
            json.dumps({**r, "training_iteration": i, "trial_id": trial_id, "config": config}) + "\n"
            for i, r in enumerate(results, 1)))
    trial.run_metadata.num_failures = failures
    if error is not None:
        trial.run_metadata.error_filename = "error.txt"  # ray.tune.result.EXPR_ERROR_FILE
        if folder is not None:
            (folder / "error.txt").write_text(
                "".join(f"Failure # {k} (occurred at {STAMP})\n{error}\n" for k in range(1, max(failures, 1) + 1)))
    trial.set_status(status)
    return trial


def save_experiment_state(folder: Path, trials, stamp: str = STAMP, runner_data: dict | None = None) -> Path:
    """Save `trials` as `TuneController.save_to_dir` does into the experiment `folder`; the file's path."""
    from ray.tune.utils.serialization import TuneFunctionEncoder

    state = {"trial_data": [list(t.get_json_state()) for t in trials],
             "runner_data": runner_data if runner_data is not None else {"_session_str": stamp},
             "stats": {"start_time": 1795795195.0}}
    path = folder / f"experiment_state-{stamp}.json"
    with open(path, "w") as f:
        json.dump(state, f, cls=TuneFunctionEncoder)
    return path

"""A study's folder written as its trials and driver write it (`launch.trainable`: `results.json`, per-image scores
under `artifacts/`, the scheduler's `stopped_early.json`; `study.yaml`), for tests of what reads the record. Tune's
experiment state is not written: `FabricatedStudy.record()` hands the trials' states over, and `patch_tune` makes
`a2 study ...` commands find them."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from launch.location import STUDY_FILE, StudyLocation, saved_form
from launch.mlflow_export import Export, end_reason
from dashboards.runs import Trial
from launch.layout import RESULTS_FILE, STOPPED_FILE, TRIALS_DIR, train_run_name
from launch.record import PER_IMAGE, StudyRecord
from launch.spec import load_study

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


@dataclass
class FabricatedStudy:
    spec: object
    location: StudyLocation
    trials: list[Trial] = field(default_factory=list)

    def add(self, trial_id: str, sampled: dict, results: list[dict], *, name: str | None = None,
            status: str = "TERMINATED", per_image: dict[str, dict] | None = None, stopped: dict | None = None):
        """A trial: its sampled config, its results (each with its "epoch"), {split: {image id: CIDEr-D}} and the
        scheduler's record `{"rung", "cutoff"}` when it stopped the trial."""
        folder = self.location.at(TRIALS_DIR, train_run_name(self.spec.name, trial_id))
        folder.join(RESULTS_FILE).write_text(json.dumps(results, indent=1))
        for split, scores in (per_image or {}).items():
            folder.join("artifacts", PER_IMAGE[split]).write_text(json.dumps(scores, sort_keys=True))
        if stopped is not None:
            folder.join(STOPPED_FILE).write_text(json.dumps(stopped))
        self.trials.append(Trial(trial_id, name=name or trial_id, sampled=dict(sampled), state=status))

    def record(self, for_digest: bool = False) -> StudyRecord:
        return StudyRecord.load(self.location, self.spec, trials=list(self.trials), for_digest=for_digest)

    def export(self) -> None:
        """Export the record into the spec's MLflow store, as `a2 mlflow sync` does after the study."""
        Export(self.spec, self.location).run(list(self.trials), end_reason(self.spec.name))

    def patch_tune(self, monkeypatch) -> None:
        """`a2 study` commands that locate the study read these trials' states (no Tune experiment state here)."""
        import launch.record

        monkeypatch.setattr(launch.record, "tune_trials", lambda location: list(self.trials))
        if "launch.commands.study" in sys.modules:  # `a2 mlflow sync` took its own name at import (imported later: this one)
            monkeypatch.setattr(sys.modules["launch.commands.study"], "tune_trials", launch.record.tune_trials)


def fabricated_study(root: Path, name: str, epochs: int, overrides: tuple[str, ...] = ()) -> FabricatedStudy:
    """An empty study `name` (storage `root/st` unless `overrides` set one, MLflow `root/mlflow.db`): the smoke spec
    with `epochs` cross-entropy epochs, its `study.yaml` saved as `a2 study run` saves it."""
    spec = load_study(SMOKE, [f"name={name}", f"storage={root / 'st'}", f"tracking.mlflow_uri=sqlite:///{root / 'mlflow.db'}",
                              f"train.xe_epochs={epochs}", f"data.root={root / 'data'}", "search.scheduler={fifo: {}}",
                              *overrides], check_files=False)
    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    location.write_text(yaml.safe_dump(saved_form(spec), sort_keys=False), STUDY_FILE)
    return FabricatedStudy(spec, location)

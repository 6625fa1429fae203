"""The ensemble of a packaged study logged as an MLflow model of the study's parent run and registered as a version
of a named model (`register_ensemble`); the same checkpoints and settings reuse their version (tag `a2.content_hash`).
The model's code, what MLflow runs to serve it, is `dashboards/ensemble_model.py`
(`dashboards.leaderboard.A2EnsembleModel`)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types.schema import Array, ColSpec, ParamSchema, ParamSpec, Schema

from a2core import checkpoint as ckpt

TAG_CONTENT_HASH = "a2.content_hash"
QUIET_URLS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"  # mlflow.environment_variables: no "View run" lines
# MLflow's limits (mlflow.utils.validation) on a model version's tags and description (its database column)
MAX_TAG_KEY, MAX_TAG_VALUE, MAX_DESCRIPTION = 250, 100_000, 5000
# The model's code and the packages it imports, shipped with the model: the read side's ensemble model and a2core.
REPO = Path(__file__).resolve().parents[1]
MODEL_CODE = REPO / "dashboards" / "ensemble_model.py"


def _quoted(value: str) -> str:
    """`value` as a string of a model-version search filter: MLflow's takes no escapes, only either quote."""
    value = str(value)
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"model name {value!r}: MLflow cannot search a name with both ' and \"; rename it")


def content_hash(checkpoints: Sequence[str | os.PathLike], beam_size: int, max_len: int) -> str:
    """sha256 of what a model version serves: the checkpoints' bytes, in ensemble order (each holds its config),
    and the decoding settings. Equal hashes: the same model."""
    digest = hashlib.sha256(json.dumps({"beam_size": beam_size, "max_len": max_len}).encode())
    for path in checkpoints:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def drop_unfinished_versions(client, name: str, run_id: str) -> list[int]:
    """Delete the versions of model `name` from run `run_id` that have no `a2.content_hash` tag: a packaging job
    killed between registering a version and tagging it (the tag is set last) left them, and a rerun would register
    the same ensemble again beside them. Returns the versions deleted."""
    dropped = []
    for version in client.search_model_versions(f"name={_quoted(name)} and run_id={_quoted(run_id)}"):
        if TAG_CONTENT_HASH not in (version.tags or {}):
            client.delete_model_version(name, version.version)
            dropped.append(int(version.version))
    if dropped:
        print(f"model {name}: removed unfinished version(s) {', '.join(map(str, dropped))} of run {run_id} "
              f"(registered by a packaging job that did not finish)", flush=True)
    return dropped


def register_ensemble(tracking_uri: str, run_id: str, checkpoints: Sequence[str | os.PathLike], name: str, *,
                      beam_size: int = 5, max_len: int = 20, description: str | None = None,
                      tags: Mapping[str, str] | None = None) -> dict:
    """Log the ensemble as an MLflow pyfunc model of run `run_id` (its checkpoints as artifacts, without optimizer
    state) and register it as a new version of model `name`, unless a version of `name` already serves the same
    checkpoints and settings (tag `a2.content_hash`): that version is reused. Returns {"name", "version",
    "model_uri", "logged_model_uri", "run_id" (the run the version links to: a reused one's own), "reused"}."""
    client = MlflowClient(tracking_uri=tracking_uri)
    digest = content_hash(checkpoints, beam_size, max_len)
    same = client.search_model_versions(
        f"name={_quoted(name)} and tags.`{TAG_CONTENT_HASH}` = {_quoted(digest)}")
    if same:
        first = min(same, key=lambda v: int(v.version))
        # the version's own run: the run that logged it, not this call's (a study's parent run made again since)
        return {"name": name, "version": int(first.version), "model_uri": f"models:/{name}/{first.version}",
                "logged_model_uri": first.source, "run_id": first.run_id or run_id, "reused": True}
    drop_unfinished_versions(client, name, run_id)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no progress bars in the job's log
    status = client.get_run(run_id).info.status
    previous_uri, previous_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    previous_quiet = os.environ.get(QUIET_URLS)
    with tempfile.TemporaryDirectory(prefix="a2-model-") as tmp:
        artifacts = {}
        for i, path in enumerate(checkpoints):  # inference needs no optimizer state
            state = ckpt.load(path)
            artifacts[f"checkpoint_{i:02d}"] = str(ckpt.save(
                {k: state[k] for k in ("model", "config", "vocab", "epoch", "step", "best") if k in state},
                Path(tmp) / f"checkpoint_{i:02d}.pt"))
        feature_dim = state["config"]["model"]["feature_dim"]  # the same for every member of an ensemble
        # input `image_id` and, optionally, `features`: an image's (n_regions, feature_dim) region features
        signature = ModelSignature(
            inputs=Schema([ColSpec("long", "image_id"), ColSpec(Array(Array("double")), "features", required=False)]),
            outputs=Schema([ColSpec("long", "image_id"), ColSpec("string", "caption")]),
            params=ParamSchema([ParamSpec("beam_size", "long", beam_size)]))
        example = pd.DataFrame({"image_id": [1], "features": [[[0.0] * feature_dim] * 2]})  # two zero regions
        mlflow.set_tracking_uri(tracking_uri)
        # MLflow prints "View run ... at: <url>" and "View experiment at: <url>" when the run ends (read per run): not
        # in the packaging job's log, which names the model version itself; its warnings and errors stay
        os.environ[QUIET_URLS] = "true"
        try:
            with mlflow.start_run(run_id=run_id):
                info = mlflow.pyfunc.log_model(
                    name="ensemble", python_model=str(MODEL_CODE),
                    model_config={"beam_size": beam_size, "max_len": max_len}, artifacts=artifacts,
                    code_paths=[str(REPO / "a2core"), str(REPO / "dashboards")], registered_model_name=name,
                    signature=signature, input_example=example,
                    pip_requirements=["torch", "numpy", "h5py", "pyyaml", "pandas"],
                    metadata={"a2.checkpoints": [str(p) for p in checkpoints], "a2.beam_size": beam_size})
        finally:  # the run keeps its status; the caller's global MLflow settings are left as they were
            client.update_run(run_id, status=status)
            mlflow.set_tracking_uri(previous_uri)
            for var, previous in (("MLFLOW_TRACKING_URI", previous_env), (QUIET_URLS, previous_quiet)):
                if previous is not None:
                    os.environ[var] = previous
                else:  # set here (set_tracking_uri sets the tracking URI's)
                    os.environ.pop(var, None)
    version = str(info.registered_model_version)
    if description:
        client.update_model_version(name, version, description=description[:MAX_DESCRIPTION])
    for k, v in {**(tags or {}), TAG_CONTENT_HASH: digest}.items():  # cut to MLflow's limits: one refused tag
        # would leave the version without its content hash (set last), so every rerun registered it again
        client.set_model_version_tag(name, version, str(k)[:MAX_TAG_KEY], str(v)[:MAX_TAG_VALUE])
    return {"name": name, "version": int(version), "model_uri": f"models:/{name}/{version}",
            "logged_model_uri": info.model_uri, "run_id": run_id, "reused": False}

"""A killed `a2 package` leaves nothing a rerun duplicates: a model version registered but never tagged (the job
died between the two) is removed before the rerun registers its own, and the rerun writes into the killed run's
folder (no manifest yet) rather than a new NAME-2."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from a2core.atomic import fresh_folder
from launch.model_registry import TAG_CONTENT_HASH, drop_unfinished_versions


@pytest.mark.slow
def test_untagged_versions_of_the_run_are_removed_and_tagged_ones_kept(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("pkg", artifact_location=str(tmp_path / "artifacts"))
    run, other = (client.create_run(exp).info.run_id for _ in range(2))
    client.create_registered_model("m")
    done = client.create_model_version("m", f"runs:/{run}/ensemble", run_id=run, tags={TAG_CONTENT_HASH: "abc"})
    killed = client.create_model_version("m", f"runs:/{run}/ensemble", run_id=run)  # tag never set
    foreign = client.create_model_version("m", f"runs:/{other}/ensemble", run_id=other)
    assert drop_unfinished_versions(client, "m", run) == [int(killed.version)]
    left = sorted(int(v.version) for v in client.search_model_versions("name='m'"))
    assert left == sorted([int(done.version), int(foreign.version)])


def test_a_package_folder_without_its_manifest_is_reused(tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "results.zip").write_bytes(b"half")  # a killed run: its zip, no package.json yet
    assert fresh_folder(out, ("package.json",), "package") == out
    (out / "package.json").write_text("{}")
    assert fresh_folder(out, ("package.json",), "package") == tmp_path / "pkg-2"

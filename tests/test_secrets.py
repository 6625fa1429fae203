"""Secrets by reference, never by value; S3 problems found before Ray starts.

- AWS keys of the environment move into a private credentials file that boto3 and pyarrow read; Ray gets nothing
  to forward, and a study on S3 leaves neither key in Ray's session folder, the study's objects, MLflow's store
  or the output.
- A password inside `tracking.mlflow_uri` is refused (with the URI shown redacted).
- A missing bucket or an unreachable endpoint is a StorageError naming them, before any Ray resource is used.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from a2core.errors import ConfigError, StorageError
from launch.storage import check_storage, make_client, open_location
from dashboards.tracking import redact_uri
from launch.raycluster import AWS_PROFILE, driver_only_secrets, stash_credentials
from launch.trainable import propagated_env
from tests.raycluster import (  # noqa: F401 - fixtures
    a2, arrow_s3_compatible_moto, free_port, kill_group, start_a2, tiny_data, tiny_study, wait_for)
from tests.s3server import s3_client, start_moto, unique_bucket

KEY_ID = "AKIAA2TUNEFAKEKEY0001"
SECRET = "a2tuneFakeSecret/Value+0123456789abcdXYZ"
TOKEN = "a2tuneFakeSessionToken0123456789"


@pytest.fixture
def fake_keys(monkeypatch, tmp_path):
    """Fake AWS keys in the environment (and no other AWS setting); the environment is restored afterwards."""
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("HOME", str(tmp_path))  # never a developer's ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_stash_moves_aws_keys_into_a_private_credentials_file(fake_keys):
    path = Path(stash_credentials())
    try:
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            assert var not in os.environ
        assert os.environ["AWS_SHARED_CREDENTIALS_FILE"] == str(path) and os.environ["AWS_PROFILE"] == AWS_PROFILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.read_text().splitlines() == [
            f"[{AWS_PROFILE}]", f"aws_access_key_id = {KEY_ID}", f"aws_secret_access_key = {SECRET}",
            f"aws_session_token = {TOKEN}"]
        assert stash_credentials() is None  # nothing left to move: the file stays what it is
        assert os.environ["AWS_SHARED_CREDENTIALS_FILE"] == str(path)
        env = propagated_env()  # what a Ray job's runtime env gets: the reference, not the value
        assert env["AWS_SHARED_CREDENTIALS_FILE"] == str(path) and env["AWS_PROFILE"] == AWS_PROFILE
        assert not {KEY_ID, SECRET, TOKEN} & set(env.values())
    finally:
        shutil.rmtree(path.parent)


def test_a_killed_drivers_credentials_are_removed_by_the_next_driver(fake_keys, tmp_path, monkeypatch):
    """A driver killed with SIGKILL runs no exit handler and leaves its credentials file: the next driver to stash
    its keys removes every such folder whose process is gone, and none of a process still running."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = tmp_path / f"a2-credentials-{ended.pid}-x1y2"
    living = tmp_path / f"a2-credentials-{os.getppid()}-z3"
    other = tmp_path / "a2-credentials-notapid"
    for folder in (dead, living, other):
        folder.mkdir()
        (folder / "credentials").write_text("[a2tune]\naws_access_key_id = K\n")
    path = Path(stash_credentials())
    try:
        assert not dead.exists() and living.exists() and other.exists()
        assert path.parent.parent == tmp_path and path.parent.name.startswith(f"a2-credentials-{os.getpid()}-")
    finally:
        shutil.rmtree(path.parent)


def test_mlflow_secrets_stay_out_of_the_environment_while_ray_starts(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw-1")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-1")
    with driver_only_secrets():
        assert "MLFLOW_TRACKING_PASSWORD" not in os.environ and "MLFLOW_TRACKING_TOKEN" not in os.environ
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw-1" and os.environ["MLFLOW_TRACKING_TOKEN"] == "tok-1"
    assert "MLFLOW_TRACKING_PASSWORD" not in propagated_env()


class _SigningRecorder(http.server.BaseHTTPRequestHandler):
    """Answers every request `status` and keeps its Authorization header: which key signed it."""

    seen: list[str] = []
    status = 404

    def do_GET(self):
        self.seen.append(self.headers.get("Authorization", ""))
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def _recorder(status: int = 404) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("Recorder", (_SigningRecorder,), {"status": status, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_pyarrow_and_boto3_sign_with_the_key_from_the_file(fake_keys):
    path = Path(stash_credentials())
    server, endpoint = _recorder()
    seen = server.RequestHandlerClass.seen
    try:
        assert not open_location("s3://some-bucket/studies", endpoint).join("x").exists()  # pyarrow (Ray's storage)
        assert seen and all(f"Credential={KEY_ID}/" in h for h in seen)
        seen.clear()
        with pytest.raises(ClientError):  # the recorder's 404
            make_client(endpoint, max_attempts=1).head_object(Bucket="some-bucket", Key="x")  # boto3 (uploads)
        assert seen and all(f"Credential={KEY_ID}/" in h for h in seen)
    finally:
        server.shutdown()
        shutil.rmtree(path.parent)


def test_redact_uri():
    assert redact_uri("postgresql://a2:s3cret@db.example:5432/mlflow") == "postgresql://a2:***@db.example:5432/mlflow"
    assert redact_uri("https://user:p%40ss@mlflow.example/") == "https://user:***@mlflow.example/"
    for uri in ("http://127.0.0.1:5000", "sqlite:////tmp/mlflow.db", "postgresql://a2@db/mlflow"):
        assert redact_uri(uri) == uri


@pytest.mark.slow
def test_password_in_the_tracking_uri_is_refused_redacted(tmp_path, tiny_data):
    from launch.spec import load_study

    study = tiny_study(tmp_path, "pw-in-uri", tiny_data, mlflow_uri="postgresql://a2:hunter2@127.0.0.1:5432/mlflow")
    with pytest.raises(ConfigError) as err:
        load_study(study)
    message = str(err.value)
    assert "tracking.mlflow_uri" in message and "postgresql://a2:***@127.0.0.1:5432/mlflow" in message
    assert "hunter2" not in message and "~/.pgpass" in message


# -- S3 at start -------------------------------------------------------------------------------------------------
def test_check_storage_names_a_missing_bucket_an_unreachable_endpoint_and_refused_credentials(s3_endpoint):
    check_storage(f"s3://{unique_bucket(s3_endpoint)}/studies", s3_endpoint)  # there: no error
    check_storage("/some/local/folder")  # local folders are made as needed
    with pytest.raises(StorageError, match=rf"s3://no-such-bucket-a2 at {s3_endpoint}: no such bucket"):
        check_storage("s3://no-such-bucket-a2/studies", s3_endpoint)
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StorageError, match=rf"s3://some-bucket at {closed}: cannot reach the bucket"):
        check_storage("s3://some-bucket/studies", closed)
    server, denying = _recorder(403)  # what S3 answers to wrong credentials
    try:
        with pytest.raises(StorageError, match=rf"s3://some-bucket at {denying}: .*ACCESS_DENIED.*credentials"):
            check_storage("s3://some-bucket/studies", denying)
    finally:
        server.shutdown()


@pytest.mark.parametrize("case", ["missing-bucket", "closed-port"])
def test_study_run_refuses_bad_s3_storage_before_ray(case, tmp_path, tiny_data, s3_endpoint):
    endpoint = s3_endpoint if case == "missing-bucket" else f"http://127.0.0.1:{free_port()}"
    study = tiny_study(tmp_path, "bad-s3", tiny_data,
                       extra={"storage": "s3://no-such-bucket-a2/studies", "storage_endpoint_url": endpoint})
    run = a2("study", "run", str(study), "--quiet", cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stdout
    last = run.stdout.strip().splitlines()[-1]
    assert "s3://no-such-bucket-a2" in last and endpoint in last, run.stdout
    assert ("no such bucket" if case == "missing-bucket" else "cannot reach the bucket") in last
    assert "Traceback" not in run.stdout and "Started a local Ray" not in run.stdout


# -- a whole study with keys in the environment --------------------------------------------------------------------
def _files_holding(root: Path, needles: list[bytes]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and not path.is_socket():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {n.decode()[:8]}..." for n in needles if n in data]
    return found


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_study_on_s3_leaves_no_key_anywhere(tmp_path, tiny_data, s3_endpoint, arrow_s3_compatible_moto):
    bucket = unique_bucket(s3_endpoint, "secrets")
    name = "no-leak"
    study = tiny_study(tmp_path, name, tiny_data, epochs=1, workers=1, cpus_per_worker=0.5,
                       extra={"storage": f"s3://{bucket}/studies", "storage_endpoint_url": s3_endpoint})
    # A short private TMPDIR: Ray's session folder and the credentials file both land below it, so one scan sees
    # every log, runtime env and spilled object of this study's Ray.
    tmp = Path(tempfile.mkdtemp(prefix="a2s-", dir="/tmp"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET, AWS_SESSION_TOKEN=TOKEN,
                   AWS_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp_path / "no-config"), TMPDIR=str(tmp),
                   AWS_EC2_METADATA_DISABLED="true")
        run = a2("study", "run", str(study), cwd=tmp_path, env=env, timeout=800)
        assert run.returncode == 0, run.stdout[-6000:]
        needles = [KEY_ID.encode(), SECRET.encode(), TOKEN.encode()]
        assert not [n for n in needles if n in run.stdout.encode()], "a key in the output"
        sessions = list(tmp.glob("ray/session_*/logs"))
        assert sessions, f"no Ray session under {tmp}"
        # Ray logs the runtime env of every trial (where Tune would have copied the keys): it is scanned.
        agent_logs = list(tmp.glob("ray/session_*/logs/runtime_env_agent.log"))
        assert agent_logs and "PL_DISABLE_FORK" in agent_logs[0].read_text()
        assert _files_holding(tmp, needles) == []  # Ray's session, and the credentials file is gone
        assert not list(tmp.glob("a2-credentials-*"))
        assert _files_holding(tmp_path, needles) == []  # the study file, MLflow's sqlite store and artifacts
        assert (tmp_path / "mlflow.db").stat().st_size > 0
        s3 = s3_client(s3_endpoint)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
        assert f"studies/{name}/summary.json" in keys and any(k.endswith("checkpoint.pt") for k in keys)
        for key in keys:
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            assert not [n for n in needles if n in body], key
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- S3 gone mid-study -----------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_s3_outage_mid_study_stops_cleanly_and_resume_continues(tmp_path, tiny_data, s3_endpoint,
                                                                arrow_s3_compatible_moto):
    server = start_moto()  # our own endpoint, to stop and start again on the same port (moto keeps the data)
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = unique_bucket(endpoint, "outage")
    name = "outage"
    study = tiny_study(tmp_path, name, tiny_data, epochs=3, workers=1, cpus_per_worker=0.5, max_failures=1,
                       extra={"storage": f"s3://{bucket}/studies", "storage_endpoint_url": endpoint})
    env = dict(os.environ)
    s3 = s3_client(endpoint)
    log = tmp_path / "run.log"
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=env)
    try:
        def first_checkpoint():
            listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"studies/{name}/trials/").get("Contents", [])
            return any("checkpoint_epoch0001/" in o["Key"] for o in listed)

        wait_for(first_checkpoint, 400, "the first epoch's checkpoint on S3", proc=proc, log=log)
        server.stop()  # S3 is gone for good, as far as this run can tell
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    out = log.read_text()
    server = start_moto(port)  # storage is back, with everything it had
    try:
        assert proc.returncode == 1, out[-6000:]
        assert "Traceback" not in out.split("stopped")[-1], out[-6000:]
        assert f"a2 study resume {name}" in out, out[-4000:]
        resumed = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=600)
        assert resumed.returncode == 0, resumed.stdout[-6000:]
        summary = json.loads(s3.get_object(Bucket=bucket, Key=f"studies/{name}/summary.json")["Body"].read())
        assert summary["complete"] and summary["trials"][0]["epochs_reported"] == [1, 2, 3]
    finally:
        server.stop()

"""The team tracking server: `a2 mlflow serve` on a PostgreSQL backend store (a real PostgreSQL started by the
test), loaded the way a team loads it: 4 studies, each driver logging 8 concurrent trials. Every metric point must
arrive exactly once."""
from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from tests.mlflowserver import free_port
from tests.pgserver import postgres_uri  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STUDIES, TRIALS, EPOCHS = 4, 8, 5
METRICS = ("train/loss", "val/CIDEr", "val/BLEU-4", "val/METEOR", "val/ROUGE-L", "diag/grounding/lift")


def value(study: int, trial: int, epoch: int, k: int) -> float:
    return round(study * 1000 + trial * 100 + epoch + k / 10, 3)


def drive_study(url: str, study: int) -> int:
    """One study driver: its parent run, then 8 trials logging every epoch concurrently."""
    from launch.tracking_writer import StudyTracker

    tracker = StudyTracker(url, f"load-{study}")
    tracker.start_study(params={"study": study})

    def trial(t: int) -> None:
        run = tracker.trial_run(f"t{t}", config={"model": {"fusion": "gate"}, "train": {"seed": t}})
        for epoch in range(1, EPOCHS + 1):
            tracker.log_metrics(run, {m: value(study, t, epoch, k) for k, m in enumerate(METRICS)}, step=epoch)
        tracker.end_trial(run)

    with ThreadPoolExecutor(TRIALS) as pool:
        list(pool.map(trial, range(TRIALS)))
    tracker.end_study()
    return study


@pytest.fixture
def team_server(postgres_uri, tmp_path):
    from tests.mlflowserver import wait_healthy

    port = free_port()
    # The server's output goes to a file: a pipe nobody reads fills up (64 KiB of access log lines) and then
    # blocks the server's workers on write, which looks like a server hanging under load.
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "mlflow", "serve", "--backend-store-uri",
                                 postgres_uri, "--artifacts-destination", str(tmp_path / "artifacts"),
                                 "--port", str(port), "--workers", "2"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, timeout=90, proc=proc)
        except Exception:
            proc.kill()
            pytest.fail(f"a2 mlflow serve did not come up:\n{log_path.read_text(errors='replace')[-4000:]}")
        yield url, proc, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_postgres_server_keeps_every_metric_of_concurrent_studies_once(team_server, postgres_uri):
    url, proc, log_path = team_server
    # each of the 2 workers may hold 40 connections (a request never waits 30 s for one on a busy host, which gave
    # "QueuePool limit of size 5 overflow 10 reached" with SQLAlchemy's default pool), 80 within PostgreSQL's 100
    assert "'pool_size': 10, 'max_overflow': 30" in log_path.read_text(errors="replace")
    with ProcessPoolExecutor(STUDIES, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert sorted(pool.map(drive_study, [url] * STUDIES, range(STUDIES))) == list(range(STUDIES))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    for study in range(STUDIES):
        experiment = client.get_experiment_by_name(f"load-{study}")
        runs = client.search_runs([experiment.experiment_id], max_results=100)
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
        assert len(runs) == TRIALS + 1 and len(children) == TRIALS
        assert {r.info.status for r in runs} == {"FINISHED"}
        for run in children:
            t = int(run.data.params["train.seed"])
            for k, metric in enumerate(METRICS):
                history = client.get_metric_history(run.info.run_id, metric)
                assert sorted((m.step, m.value) for m in history) == [
                    (e, value(study, t, e, k)) for e in range(1, EPOCHS + 1)], (study, t, metric)
    import psycopg  # the backend really is the PostgreSQL database

    with psycopg.connect(postgres_uri) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == STUDIES * (TRIALS + 1)

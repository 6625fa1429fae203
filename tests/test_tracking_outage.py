"""The MLflow server dies after epoch 1 of a study and comes back 15 s later: training never waits on it, the
export thread brings it what the study's storage recorded meanwhile, and every epoch's metrics arrive exactly once.

The study runs through the real driver, trial storage, record and MLflow export with its trainer replaced by the
rehearsal's stand-in (`a2 study rehearse`, `launch.trainable.swapped_trainer`): epochs of a fixed 0.25 s whatever
the CPU, so that the study outlasts the outage and the server's restart by a known margin. (Trained for real, its
epochs took 0.5-1 s and 160 of them were needed to outlast both on a busy machine: 4 minutes of the suite.)

Run under `flock /tmp/a2-ray.lock` (it starts a local Ray)."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.mlflowserver import RestartableServer
from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    kill_group, mlflow_history, mlflow_trials, start_a2, tail, tiny_data, tiny_study, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.ray_beside]

# 240 epochs of 0.25 s and a little bookkeeping each: about 70 s after the first, past the 15 s outage and a
# restart of the server (5-30 s, the longest on a busy machine) by half a minute or more.
EPOCHS = 240
EPOCH_S = 0.25
OUTAGE_S = 15


def test_study_goes_on_while_the_tracking_server_is_down(tmp_path, tiny_data):  # noqa: F811
    server = RestartableServer(tmp_path / "mlflow")
    server.root.mkdir()
    uri = server.start()
    study = tiny_study(tmp_path, "outage", tiny_data, epochs=EPOCHS, workers=1, cpus_per_worker=1, mlflow_uri=uri)
    name = "outage-rehearsal"  # `a2 study rehearse` names its study so
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "run.log"
    proc = start_a2("study", "rehearse", str(study), "--storage", str(tmp_path / "studies"), "--tracking-uri", uri,
                    "--epoch-seconds", str(EPOCH_S), "--time-scale", "1", cwd=tmp_path, log=log, env=env)

    def epoch_one_logged():
        try:
            runs = mlflow_trials(uri, name)
        except Exception:  # noqa: BLE001 - the experiment may not exist yet
            return None
        return next((r for r in runs.values() if mlflow_history(uri, r.info.run_id)), None)

    try:
        run = wait_for(epoch_one_logged, 600, "epoch 1 in MLflow", proc=proc, log=log)
        server.stop()
        down_ms = int(time.time() * 1000)
        time.sleep(OUTAGE_S)
        server.start()
        up_ms = int(time.time() * 1000)  # answering again
        proc.wait(timeout=600)
    finally:
        kill_group(proc)
        if proc.returncode is None:
            server.stop()
    try:
        output = log.read_text()
        assert proc.returncode == 0, tail(log, 80)
        summary = json.loads((tmp_path / "studies" / name / "summary.json").read_text())
        tracking = summary["tracking"]  # exported while the study ran: the server came back before its end
        assert tracking["exported_late"] >= 1 and not tracking["pending"] and tracking["down_seconds"] >= OUTAGE_S - 5
        assert "epochs exported once it was back" in output
        assert not (tmp_path / "studies" / name / "lease.json").exists()  # released at the end

        # Every epoch exactly once, and the run ended FINISHED.
        run = mlflow_trials(uri, name)[run.data.tags["a2.trial_id"]]
        assert run.info.status == "FINISHED"
        for metric in ("val/CIDEr", "train/loss"):
            history = mlflow_history(uri, run.info.run_id, metric)
            assert sorted(step for step, _, _ in history) == list(range(1, EPOCHS + 1)), (metric, history)
        # Training did not wait on the server: epochs were reported while it was down (a metric's timestamp is
        # its result's own time), and no gap between two epochs is as long as the outage.
        stamps = sorted(ts for _, _, ts in mlflow_history(uri, run.info.run_id))
        assert max(stamps) > up_ms  # it outlasted the outage (else the rest would wait for `a2 mlflow sync`)
        during = [ts for ts in stamps if down_ms <= ts <= up_ms]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert len(during) >= 2 and max(gaps) < OUTAGE_S * 1000, (stamps, down_ms, up_ms)
    finally:
        server.stop()

"""The MLflow UI of the live test server, in headless Chromium, shows a study's trial runs and val/CIDEr.

The screenshot is kept at tests/artifacts/mlflow_ui.png (git-ignored) for a look by eye.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dashboards.tracking import StudyTracker
from tests.mlflowserver import mlflow_server  # noqa: F401

ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_chromium(binary: str, profile: Path, url: str, *args: str,
                  budget_ms: int = 15000) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1400,900",
           f"--virtual-time-budget={budget_ms}", *args, url]
    return subprocess.run(cmd, capture_output=True, timeout=120)


def _visible_text(dom: str) -> str:
    text = re.sub(r"<(style|script|svg)\b.*?</\1>", " ", dom, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"\s+", " ", text)


@pytest.fixture(scope="module")
def chromium():
    binary = _chromium()
    if binary is None:
        pytest.skip("no Chromium binary on PATH (apt-get install -y chromium) - cannot open the MLflow UI")
    return binary


@pytest.fixture(scope="module")
def ui_study(mlflow_server):  # noqa: F811
    name = f"ui-study-{time.time_ns() % 10**8}"
    tracker = StudyTracker(str(mlflow_server), name)
    tracker.start_study({"search": {"metric": "val/CIDEr"}}, {})
    finals = {}
    for i, fusion in enumerate(["max", "gate"]):
        run_name = f"trial-{fusion}-s0"
        run = tracker.trial_run(f"t{i}", {"model": {"fusion": fusion, "lambda": 0.05}, "train": {"seed": 0}},
                                run_name=run_name)
        for epoch in (1, 2, 3):
            tracker.log_metrics(run, {"val/CIDEr": 0.25 * epoch + 0.5 * i, "train/loss": 3.0 / epoch}, step=epoch)
        tracker.end_trial(run, "FINISHED")
        finals[run_name] = 0.75 + 0.5 * i
    tracker.end_study("FINISHED")
    return {"tracker": tracker, "finals": finals, "url": tracker.view_url()}


def test_mlflow_ui_shows_runs_and_cider(chromium, ui_study, tmp_path):
    url = ui_study["url"]
    assert url and "viewStateShareKey=" in url
    names = list(ui_study["finals"])

    text = ""
    for budget in (15000, 30000, 60000):  # a loaded machine can need more virtual time for the API calls
        out = _run_chromium(chromium, tmp_path / f"profile-dom-{budget}", url, "--dump-dom", budget_ms=budget)
        text = _visible_text(out.stdout.decode("utf-8", "replace"))
        if all(n in text for n in names) and "val/CIDEr" in text:
            break
    assert all(n in text for n in names), f"run names not rendered; page text: {text[:1500]}"
    assert "val/CIDEr" in text  # the metric column of the runs table
    assert "model.fusion" in text  # a param column
    # the runs table shows the metric's latest value (epoch 3) of each run, best first
    assert "1.25" in text and "0.75" in text
    assert text.index("trial-gate-s0") < text.index("trial-max-s0")

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "mlflow_ui.png"
    shot.unlink(missing_ok=True)
    _run_chromium(chromium, tmp_path / "profile-shot", url, f"--screenshot={shot}", budget_ms=15000)
    assert shot.exists() and shot.stat().st_size > 20_000
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[0] == 900 and pixels.shape[1] == 1400
    assert pixels[..., :3].std() > 0.05  # not a blank page
    assert len({tuple(p) for p in (pixels[::10, ::10, :3] * 255).astype(int).reshape(-1, 3)}) > 50


def test_ui_api_serves_the_runs(ui_study, mlflow_server):  # noqa: F811
    """The same data through the endpoint the UI's runs table calls (ajax-api runs/search)."""
    tracker = ui_study["tracker"]
    body = json.dumps({"experiment_ids": [tracker.experiment_id], "max_results": 100,
                       "order_by": ["metrics.`val/CIDEr` DESC"]}).encode()
    req = urllib.request.Request(f"{mlflow_server}/ajax-api/2.0/mlflow/runs/search", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        runs = json.load(resp)["runs"]
    got = {r["info"]["run_name"]: {m["key"]: m["value"] for m in r["data"].get("metrics", [])} for r in runs}
    for name, final in ui_study["finals"].items():
        assert got[name]["val/CIDEr"] == pytest.approx(final)
    assert [r["info"]["run_name"] for r in runs][:2] == ["trial-gate-s0", "trial-max-s0"]

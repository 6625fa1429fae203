"""The MLflow UI, in headless Chromium, shows a study where a researcher compares trials: the experiment opens on
its training runs, the trials are listed, the configurations view groups them by replicate group (one row per
configuration) and the val/CIDEr chart renders; the views' state and the URLs a2tune prints.

Screenshots go to tests/artifacts/ (git-ignored); those of the finished smoke study are the ones in
docs/how-to/compare-trials-in-mlflow.md (docs/images/mlflow-*.png are copies).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dashboards.mlflow_views import (MODEL_TRAINING, TAG_CONFIG_LABEL, TAG_EXPERIMENT_KIND, VIEW_CONFIGS, VIEW_TAG_PREFIX,
                                     VIEW_TRIALS, saved_sections, section_order, ui_url, view_states, view_tags)
from dashboards.tracking import TAG_CONFIG_HASH
from dashboards.tracking import study_pointer, ui_pointer
from launch.tracking_writer import StudyTracker
from tests.mlflowserver import free_port, mlflow_server, start_server, stop_server  # noqa: F401
from tests.raycluster import a2, tiny_data, tiny_study  # noqa: F401

ARTIFACTS = Path(__file__).parent / "artifacts"
SHOT_SIZE = "1600,1000"  # wide enough for MLflow's assistant panel, which opens on a first visit from localhost
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_chromium(binary: str, profile: Path, url: str, *args: str, budget_ms: int = 15000,
                  size: str = "1400,900") -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size}",
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
    tracker.set_views("val/CIDEr", "max", ["model.fusion", "model.lambda"])  # as A2MLflowCallback does
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


def _page_text(chromium: str, url: str, profile: Path, done) -> tuple[str, str]:
    """(visible text, DOM) of `url` once `done(text, dom)` holds, with more virtual time on each try (a loaded
    machine needs more for the UI's API calls and its charts)."""
    text = dom = ""
    for budget in (15000, 30000, 60000):
        out = _run_chromium(chromium, profile.with_name(f"{profile.name}-{budget}"), url, "--dump-dom",
                            budget_ms=budget, size=SHOT_SIZE)
        dom = out.stdout.decode("utf-8", "replace")
        text = _visible_text(dom)
        if done(text, dom):
            break
    return text, dom


def _screenshot(chromium: str, url: str, profile: Path, name: str, budget_ms: int = 30000) -> Path:
    """A PNG of `url` in tests/artifacts/`name` (checked not to be blank)."""
    from matplotlib.image import imread

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / name
    shot.unlink(missing_ok=True)
    _run_chromium(chromium, profile, url, f"--screenshot={shot}", budget_ms=budget_ms, size=SHOT_SIZE)
    assert shot.exists() and shot.stat().st_size > 20_000, name
    pixels = imread(shot)
    assert pixels[..., :3].std() > 0.05  # not a blank page
    return shot


@pytest.mark.slow
def test_mlflow_ui_shows_runs_and_cider(chromium, ui_study, tmp_path):
    url = ui_study["url"]
    assert url and "viewStateShareKey=a2" in url and "workflowType=machine_learning" in url
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


@pytest.mark.slow
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


# -- the views and the experiment's kind (no browser) ---------------------------------------------------------------
def test_sections_put_what_a_researcher_reads_first():
    names = ["time/epoch_s", "compute/wall_s", "train/loss", "best/val/CIDEr", "diag/kendall/layer10/mask",
             "diag/kendall/layer2/mask", "diag/mask_mean", "val/BLEU-4", "val/CIDEr", "step", "diag/jsd/layer0"]
    order = section_order(names, first="val/CIDEr")
    assert order[:3] == ["val", "diag", "diag/jsd"]
    assert order.index("diag/kendall/layer2") < order.index("diag/kendall/layer10") < order.index("train")
    assert order.index("train") < order.index("best/val") < order.index("compute")
    assert set(order[-3:]) == {"Model metrics", "compute", "time"}  # bookkeeping last (`step` has no prefix)
    assert section_order(["val/CIDEr", "train/loss"], first="train/loss")[0] == "train"  # the study metric leads


def test_view_states_sort_group_and_chart_the_study_metric():
    views = view_states("val/BLEU-4", "min", ["model.fusion", "model.lambda", "train.seed"],
                        ["val/CIDEr", "compute/wall_s", "diag/mask_mean"])
    (trials_name, trials), (configs_name, configs) = views[VIEW_TRIALS], views[VIEW_CONFIGS]
    assert "val/BLEU-4" in trials_name and "configurations" in configs_name
    for state in (trials, configs):
        assert state["orderByKey"] == "metrics.`val/BLEU-4`" and state["orderByAsc"] is True
        assert state["searchFilter"] == "tags.`a2.role` = 'trial'"  # the trials, not the study's parent run
        assert state["selectedColumns"][:2] == ["attributes.`Run Name`", "metrics.`val/BLEU-4`"]
        assert [s["name"] for s in state["compareRunSections"]] == ["val", "diag", "compute"]
        assert not state["compareRunSections"][-1]["display"]  # bookkeeping collapsed
        line = state["compareRunCharts"][0]
        assert (line["type"], line["metricKey"], line["xAxisKey"]) == ("LINE", "val/BLEU-4", "step")  # per epoch
    parallel = trials["compareRunCharts"][1]
    assert parallel["type"] == "PARALLEL" and parallel["selectedParams"] == ["model.fusion", "model.lambda"]
    assert parallel["selectedMetrics"] == ["val/BLEU-4"]
    assert "groupBy" not in trials
    assert configs["groupBy"] == {"aggregateFunction": "average",
                                  "groupByKeys": [{"mode": "tag", "groupByData": TAG_CONFIG_LABEL}]}
    # the configuration label (with its hash) is a column of both views
    assert trials["selectedColumns"][-1] == configs["selectedColumns"][-1] == "tags.`a2.config`"
    assert [c["type"] for c in configs["compareRunCharts"]] == ["LINE"]  # MLflow cannot aggregate string params

    tags = view_tags(views, now_ms=1000)
    envelope = json.loads(tags[VIEW_TAG_PREFIX + VIEW_TRIALS])  # what the UI's Views menu lists
    assert envelope["name"] == trials_name and json.loads(envelope["state"]) == trials
    assert json.loads(view_tags(views, existing=tags, now_ms=5000)[VIEW_TAG_PREFIX + VIEW_TRIALS])["createdAt"] \
        == envelope["createdAt"]
    assert saved_sections(tags) == {"val", "diag", "compute"}


def test_urls_open_the_runs_of_a_model_training_experiment():
    assert ui_url("http://h:5000/", "7") == \
        "http://h:5000/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=a2"
    assert ui_url("http://h:5000", "7", VIEW_CONFIGS, charts=True).endswith(
        "runs?workflowType=machine_learning&viewStateShareKey=a2-configs&compareRunsMode=CHART")
    assert ui_pointer("http://h:5000", "7") == ui_url("http://h:5000", "7")
    pointer = ui_pointer("sqlite:////tmp/x/mlflow.db", "3")
    assert pointer.startswith("`a2 mlflow serve --backend-store-uri sqlite:////tmp/x/mlflow.db`, then ")
    assert pointer.endswith(ui_url("http://127.0.0.1:5000", "3"))
    assert "secret" not in ui_pointer("postgresql://a2:secret@db/mlflow", "3")


@pytest.mark.slow
def test_experiment_is_model_training_and_views_follow_new_sections(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, "kind-study")
    tracker.start_study()
    exp = tracker.client.get_experiment(tracker.experiment_id)
    assert exp.tags[TAG_EXPERIMENT_KIND] == MODEL_TRAINING
    assert {VIEW_TAG_PREFIX + VIEW_TRIALS, VIEW_TAG_PREFIX + VIEW_CONFIGS} <= set(exp.tags)
    assert study_pointer(uri, "kind-study") == ui_pointer(uri, tracker.experiment_id)  # `a2 pipeline`'s
    assert study_pointer(uri, "no-such-study").startswith("(no experiment yet")

    tracker.set_views("val/CIDEr", "max", ["model.fusion"])
    run = tracker.trial_run("t0", {"model": {"fusion": "max"}, "train": {"seed": 0}})
    tracker.log_metrics(run, {"val/CIDEr": 50.0, "compute/wall_s": 3.0, "diag/jsd/layer0": 0.1}, step=1)
    tags = tracker.client.get_experiment(tracker.experiment_id).tags
    state = json.loads(json.loads(tags[VIEW_TAG_PREFIX + VIEW_TRIALS])["state"])
    assert [s["name"] for s in state["compareRunSections"]] == ["val", "diag/jsd", "compute"]

    # A resumed study (a new tracker) marks an experiment whose kind was changed as model training again, and
    # keeps the sections the views already list.
    tracker.client.set_experiment_tag(tracker.experiment_id, TAG_EXPERIMENT_KIND, "genai_development")
    again = StudyTracker(uri, "kind-study")
    again.start_study()
    again.set_views("val/CIDEr", "max", ["model.fusion"])
    tags = again.client.get_experiment(again.experiment_id).tags
    assert tags[TAG_EXPERIMENT_KIND] == MODEL_TRAINING
    assert saved_sections(tags) == {"val", "diag/jsd", "compute"}


# -- a finished smoke study in the UI that `a2 mlflow serve` serves --------------------------------------------------
SMOKE_FUSIONS, SMOKE_SEEDS = ("none", "max"), (0, 1)
DOC_SHOTS = {"trials": "mlflow-trials.png", "configs": "mlflow-configurations.png",
             "configs_chart": "mlflow-cider-by-epoch.png", "trials_chart": "mlflow-parallel-coordinates.png"}


@pytest.fixture(scope="module")
def served_study(tmp_path_factory, tiny_data):  # noqa: F811
    """A finished study (2 fusions x 2 seeds, 4 epochs, one-worker trials) and `a2 mlflow serve` on its database:
    {"name", "uri", "server" (its URL), "experiment", "runs" (the trials), "study_line" (what `a2 study run`
    printed about MLflow), "served" (what `a2 mlflow serve` printed)}."""
    import mlflow

    root = tmp_path_factory.mktemp("ui-smoke")
    name = "ui-smoke"
    # batches of 10, a short warmup and greedy validation: val CIDEr climbs to ~35 in 4 epochs of ~1 s
    study = tiny_study(root, name, tiny_data, fusions=SMOKE_FUSIONS, seeds=SMOKE_SEEDS, epochs=4, workers=1,
                       cpus_per_worker=1, extra={"search.scheduler": {"fifo": {}}, "train.batch_size": 50,
                                                 "train.warmup": 30, "train.lr_factor": 0.5,
                                                 "train.val_decode": "greedy"})
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    run = a2("study", "run", str(study), cwd=root, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]
    uri = f"sqlite:///{root / 'mlflow.db'}"
    study_line = next(line for line in run.stdout.splitlines() if line.startswith("MLflow: study"))

    proc, server = start_server(uri, str(root / "mlartifacts"), free_port(), log_path=str(root / "server.log"),
                                timeout=120)
    try:
        served = Path(root / "server.log").read_text()
        exp = mlflow.MlflowClient(uri).get_experiment_by_name(name)
        runs = mlflow.MlflowClient(uri).search_runs([exp.experiment_id], "tags.`a2.role` = 'trial'")
        yield {"name": name, "uri": uri, "server": server, "experiment": exp, "runs": runs,
               "study_line": study_line, "served": served}
    finally:
        stop_server(proc)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_study_opens_where_trials_are_compared(chromium, served_study, tmp_path):
    exp, runs = served_study["experiment"], served_study["runs"]
    assert exp.tags[TAG_EXPERIMENT_KIND] == MODEL_TRAINING
    names = sorted(r.info.run_name for r in runs)
    groups = {r.data.tags[TAG_CONFIG_LABEL] for r in runs}
    # what a person reads: the searched keys and the seed; each configuration by its keys, its hash beside them
    assert names == sorted(f"{f} seed={s}" for f in SMOKE_FUSIONS for s in SMOKE_SEEDS)
    assert groups == {f"{r.data.tags['a2.fusion']} ({r.data.tags[TAG_CONFIG_HASH][:12]})" for r in runs}
    assert len(groups) == len(SMOKE_FUSIONS)

    # The pointers: `a2 study run` (the database: how to serve it, then the URL) and `a2 mlflow serve` (the URL).
    url = ui_url(served_study["server"], exp.experiment_id)
    assert served_study["study_line"].endswith(ui_url("http://127.0.0.1:5000", exp.experiment_id))
    assert f"study {served_study['name']}: {url}" in served_study["served"]

    # The printed URL opens the experiment on its training runs (not MLflow's GenAI overview), every trial listed.
    text, _ = _page_text(chromium, url, tmp_path / "trials", lambda t, d: all(n in t for n in names))
    assert all(n in text for n in names), f"trials not listed; page text: {text[:1500]}"
    assert "Runs" in text and "a2 trials by val/CIDEr" in text  # the saved view, named in the Views menu
    assert "Detect Issues" not in text and "Judges" not in text  # MLflow's GenAI overview and its navigation
    assert "val/CIDEr" in text and "model.fusion" in text  # metric and searched-param columns

    # Grouped by the replicate-group tag: one row per configuration, its seeds under it.
    configs = ui_url(served_study["server"], exp.experiment_id, VIEW_CONFIGS)
    text, _ = _page_text(chromium, configs, tmp_path / "configs", lambda t, d: all(g in t for g in groups))
    assert sorted(re.findall(r"Group: (\w+ \(\w{12}\))", text)) == sorted(groups), text[:1500]
    assert f"Group by: {TAG_CONFIG_LABEL}" in text
    assert "a2_local_trial" not in text and "Group: " + next(iter(groups)) in text

    # The chart view: val/CIDEr per epoch renders (plotly lines with a legend per configuration), first section val.
    def rendered(text: str, dom: str) -> bool:
        return "(val/CIDEr)" in text and "scatterlayer" in dom

    charts = ui_url(served_study["server"], exp.experiment_id, VIEW_CONFIGS, charts=True)
    text, dom = _page_text(chromium, charts, tmp_path / "configs-chart", rendered)
    assert rendered(text, dom), text[:1500]
    assert sum(f"{g} (val/CIDEr)" in text for g in groups) >= 1  # the legend names the groups
    if "compute (" in text:  # bookkeeping after what a researcher reads
        assert text.index("val (") < text.index("compute (")

    trials_chart = ui_url(served_study["server"], exp.experiment_id, charts=True)
    text, dom = _page_text(chromium, trials_chart, tmp_path / "trials-chart",
                           lambda t, d: "parcoords" in d and "(val/CIDEr)" in t)
    assert "Parallel Coordinates" in text and 'class="parcoords"' in dom

    # Screenshots for the docs (docs/images/ holds copies).
    for key, shot_url in (("trials", url), ("configs", configs), ("configs_chart", charts),
                          ("trials_chart", trials_chart)):
        _screenshot(chromium, shot_url, tmp_path / f"shot-{key}", DOC_SHOTS[key],
                    budget_ms=60000 if key.endswith("chart") else 30000)  # charts draw after the table

"""`a2 report` and `a2 study compare` on a study fabricated in a SQLite MLflow store."""
from __future__ import annotations

import argparse
import re

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from dashboards.compare import compare_table
from dashboards.compare import main as compare_main
from dashboards.report import build_report
from dashboards.report import main as report_main
from dashboards.tracking import StudyTracker
from tests.mlflowserver import mlflow_server  # noqa: F401
from tests.s3server import s3_client


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """SQLite stores without a server keep artifacts under ./mlruns: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


STUDY = "fab-study"
CIDER = {"none": 1.00, "max": 1.05, "moving_average": 1.08, "exp_decay": 1.10, "gate": 1.14}
BLEU1 = {"none": 0.70, "max": 0.72, "moving_average": 0.73, "exp_decay": 0.78, "gate": 0.75}
LAMBDAS = {"none": [0.0], "max": [0.01, 0.1], "moving_average": [0.01, 0.1], "exp_decay": [0.01, 0.1],
           "gate": [0.01, 0.1]}
GROUNDING = {"none": 0.5, "max": 0.55, "moving_average": 0.56, "exp_decay": 0.6, "gate": 0.62}
EPOCHS = 3
LAYERS = 3


def _cider(fusion, lam, seed):
    return CIDER[fusion] + (0.02 if lam == 0.1 else 0.0) + 0.01 * seed


def fabricate(uri: str, name: str = STUDY, artifact_location: str | None = None,
              fusions: tuple[str, ...] = tuple(LAMBDAS)) -> dict:
    """Runs like a real study: fusions x lambdas x 2 seeds, val metrics per epoch, JSD per layer."""
    tracker = StudyTracker(uri, name, artifact_location=artifact_location)
    tracker.start_study({"search": {"metric": "val/CIDEr", "num_samples": 18}}, {})
    client: MlflowClient = tracker.client
    names = {}
    for fusion, lams in LAMBDAS.items():
        if fusion not in fusions:
            continue
        for lam in lams:
            for seed in (0, 1):
                tid = f"{fusion}-{lam}-{seed}"
                config = {"model": {"fusion": fusion, "lambda": lam, "layers": LAYERS},
                          "train": {"seed": seed, "xe_epochs": EPOCHS}, "output_dir": f"/tmp/out/{tid}"}
                run_id = tracker.trial_run(tid, config, run_name=f"trial-{tid}")
                names[(fusion, lam, seed)] = f"trial-{tid}"
                best = _cider(fusion, lam, seed)
                metrics = []
                for e in range(1, EPOCHS + 1):
                    frac = [0.6, 1.0, 0.9][e - 1]  # the best epoch is 2, not the last one
                    values = {"val/CIDEr": best * frac, "val/BLEU-1": BLEU1[fusion] + 0.002 * seed + (e - 2) * 0.05,
                              "val/BLEU-4": 0.30 + (0.05 if fusion == "gate" else 0) + 0.001 * seed,
                              "val/METEOR": 0.25 + (0.02 if fusion == "gate" else 0),
                              "val/ROUGE-L": 0.52 + (0.03 if fusion == "gate" else 0) + 0.001 * seed,
                              "train/loss": 4.0 / e + seed * 0.1, "train/mask_mean": 1.0 - 2 * lam - 0.01 * e}
                    if fusion != "none":
                        values.update({f"diag/jsd/layer{i}": 0.01 * (i + 1) * (1 + list(CIDER).index(fusion))
                                       for i in range(LAYERS)})
                        values["diag/mask_mean"] = 0.8 + 0.02 * seed
                    values.update({"diag/grounding/accuracy": GROUNDING[fusion] + 0.02 * seed,
                                   "diag/grounding/control": 0.3, "diag/grounding/chance": 0.18,
                                   "diag/grounding/lift": GROUNDING[fusion] + 0.02 * seed - 0.3,
                                   "diag/grounding/subject_object": 0.8})
                    metrics += [Metric(k, v, 1000 * e, e) for k, v in values.items()]
                client.log_batch(run_id, metrics=metrics)
                tracker.end_trial(run_id, "FINISHED")
    tracker.end_study("FINISHED")
    return {"parent": tracker.parent_run_id, "names": names}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    info = fabricate(uri, artifact_location=str(root / "artifacts"))
    return {"uri": uri, "root": root, **info}


@pytest.fixture(scope="module")
def report(study):
    return build_report(study["uri"], STUDY, study["root"] / "out")


def test_report_writes_plots_and_html(report, study):
    for key in ("lambda", "jsd", "curves", "parallel", "grounding", "html"):
        assert key in report, key
    assert "kendall" not in report  # not logged by this study
    for key in ("lambda", "jsd", "curves", "parallel", "grounding"):
        data = open(report[key], "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, key
    page = open(report["html"], encoding="utf-8").read()
    assert page.count("data:image/png;base64,") == 5  # self-contained
    assert "not measured" not in page.lower()
    assert "No run logged diag/kendall/layer{i}/attention" in page  # this study logged no Kendall tau
    # The diagnostics table: a row per fusion, grounding mean ± std over its runs; no mask value for the baseline.
    rows = _table_rows(page, "diag")
    assert rows["head"][:2] == ["fusion", "runs"] and "Kendall τ attention" not in rows["head"]
    assert rows["gate"][:5] == ["4", f"{GROUNDING['gate'] + 0.01:.2f} ± 0.01", "0.30 ± 0.00",
                                 f"{GROUNDING['gate'] + 0.01 - 0.3:.2f} ± 0.01", "0.18 ± 0.00"]
    assert rows["none (baseline)"][-1] == "–" and rows["gate"][-1] == "0.81 ± 0.01"
    assert "Not logged: SPICE" in page
    for n in study["names"].values():
        assert n in page


def test_report_is_logged_on_the_parent_run(report, study):
    client = MlflowClient(study["uri"])
    paths = sorted(a.path for a in client.list_artifacts(study["parent"], "report"))
    assert paths == sorted(["report/report.html", "report/lambda_cider_mask.png", "report/jsd_per_layer.png",
                            "report/learning_curves.png", "report/parallel_coordinates.png", "report/grounding.png"])
    assert report["artifact_uri"].endswith("/report")


def _table_rows(page: str, cls: str = "t3") -> dict[str, list[str]]:
    table = re.search(rf"<table class='{cls}'>(.*?)</table>", page, re.S).group(1)
    head = re.findall(r"<th>(.*?)</th>", re.search(r"<thead>(.*?)</thead>", table, re.S).group(1))
    rows = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", re.search(r"<tbody>(.*?)</tbody>", table, re.S).group(1), re.S):
        label = re.search(r"<th>(.*?)</th>", tr).group(1)
        rows[label] = re.findall(r"<td[^>]*>(.*?)</td>", tr)
    return {"head": head, **rows}


def test_table3_marks_best_per_column_with_mean_std(report):
    page = open(report["html"], encoding="utf-8").read()
    rows = _table_rows(page)
    assert rows["head"] == ["fusion", "seeds", "B-1", "B-4", "METEOR", "ROUGE-L", "CIDEr", "config"]
    assert list(rows)[1:] == ["none (baseline)", "max", "moving average", "exp. decay", "gate"]
    col = {name: i + 1 for i, name in enumerate(["B-1", "B-4", "METEOR", "ROUGE-L", "CIDEr"])}
    # gate, lambda 0.1: CIDEr at the best epoch (2) 1.16 and 1.17 -> 116.5 ± 0.7 (x100), the best
    assert rows["gate"][col["CIDEr"]] == "<b>116.5 ± 0.7</b>"
    assert "model.lambda=0.1" in rows["gate"][-1] and rows["gate"][0] == "2"
    # B-1 at the best epoch (2): exp_decay 0.780 and 0.782 -> 78.1 ± 0.1, the best
    assert rows["exp. decay"][col["B-1"]] == "<b>78.1 ± 0.1</b>"
    assert rows["gate"][col["B-1"]] == "75.1 ± 0.1"
    assert rows["none (baseline)"][col["CIDEr"]] == "100.5 ± 0.7"
    assert rows["gate"][col["METEOR"]] == "<b>27.0 ± 0.0</b>"
    bold = [(r, c) for r, cells in rows.items() if r != "head" for c, v in enumerate(cells) if v.startswith("<b>")]
    assert len(bold) == 5  # exactly one per metric column


def test_main_entry_points(study, tmp_path, capsys):
    assert report_main(argparse.Namespace(name=STUDY, tracking_uri=study["uri"], out=str(tmp_path / "r"))) == 0
    assert (tmp_path / "r" / "report.html").exists()
    assert compare_main(argparse.Namespace(name=STUDY, by="fusion", tracking_uri=study["uri"])) == 0
    assert "1.2 (2 seeds: no interval)" in capsys.readouterr().out  # compare's own values: tests/test_compare.py


def test_report_with_missing_metrics_and_unknown_study(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = StudyTracker(uri, "bare")
    tracker.start_study({}, {})
    run = tracker.trial_run("t0", {"model": {"fusion": "gate"}})
    tracker.log_metrics(run, {"train/loss": 3.0}, step=1)
    paths = build_report(uri, "bare", tmp_path / "out")
    page = open(paths["html"], encoding="utf-8").read()
    assert "No run logged val/CIDEr" in page and "No run logged diag/jsd/layer{i}" in page
    assert set(paths) >= {"html", "curves"} and "lambda" not in paths
    assert "no run has logged val/CIDEr" in compare_table(uri, "bare")
    with pytest.raises(ValueError, match="nope"):
        build_report(uri, "nope", tmp_path / "out2")


def test_report_through_the_server_lands_in_s3(mlflow_server, tmp_path):  # noqa: F811
    """Against the tracking server: the report's artifacts are proxied to the S3 bucket."""
    name = "fab-study-server"
    info = fabricate(str(mlflow_server), name, fusions=("none", "gate"))
    paths = build_report(str(mlflow_server), name, tmp_path / "out")
    assert paths["artifact_uri"].startswith("mlflow-artifacts:")
    client = MlflowClient(str(mlflow_server))
    assert "report/report.html" in [a.path for a in client.list_artifacts(info["parent"], "report")]
    keys = [o["Key"] for o in s3_client(mlflow_server.s3_endpoint).list_objects_v2(
        Bucket=mlflow_server.bucket, Prefix="mlartifacts/").get("Contents", [])]
    assert any(k.endswith(f"{info['parent']}/artifacts/report/report.html") for k in keys)
    rows = _table_rows(open(paths["html"], encoding="utf-8").read())
    assert list(rows)[1:] == ["none (baseline)", "gate"]
    assert "gate" in compare_table(str(mlflow_server), name).splitlines()[-1]


def test_kendall_plot_when_measured(tmp_path):
    from dashboards.report import RunSummary, plot_kendall

    final = {f"diag/kendall/layer{i}/{kind}": v for i in range(3)
             for kind, v in (("attention", 0.1 * i), ("mask", 0.2 + 0.1 * i))}
    runs = [RunSummary("r", "trial", "FINISHED", {}, {}, final)]
    path = plot_kendall(runs, tmp_path / "k.png")
    assert path is not None and open(path, "rb").read(4) == b"\x89PNG"
    assert plot_kendall([RunSummary("r", "t", "FINISHED", {}, {}, {"val/CIDEr": 1.0})], tmp_path / "x.png") is None

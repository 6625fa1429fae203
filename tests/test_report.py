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
CIDER = {"none": 100.0, "max": 105.0, "moving_average": 108.0, "exp_decay": 110.0, "gate": 114.0}  # x100
BLEU1 = {"none": 70.0, "max": 72.0, "moving_average": 73.0, "exp_decay": 78.0, "gate": 75.0}
LAMBDAS = {"none": [None], "max": [0.01, 0.1], "moving_average": [0.01, 0.1], "exp_decay": [0.01, 0.1],
           "gate": [0.01, 0.1]}
GROUNDING = {"none": 0.5, "max": 0.55, "moving_average": 0.56, "exp_decay": 0.6, "gate": 0.62}
EPOCHS = 3
LAYERS = 3
SEEDS = (0, 1, 2)


def _cider(fusion, lam, seed):
    return CIDER[fusion] + (2.0 if lam == 0.1 else 0.0) + 1.0 * seed


def fabricate(uri: str, name: str = STUDY, artifact_location: str | None = None,
              fusions: tuple[str, ...] = tuple(LAMBDAS)) -> dict:
    """Runs like a real study: fusions x lambdas x 3 seeds, val metrics (x100) per epoch, JSD per layer."""
    tracker = StudyTracker(uri, name, artifact_location=artifact_location)
    tracker.start_study({"search": {"metric": "val/CIDEr", "num_samples": 18}}, {})
    client: MlflowClient = tracker.client
    names = {}
    for fusion, lams in LAMBDAS.items():
        if fusion not in fusions:
            continue
        for lam in lams:
            for seed in SEEDS:
                tid = f"{fusion}-{lam}-{seed}"
                model = {"fusion": fusion, "layers": LAYERS, **({} if lam is None else {"lambda": lam})}
                config = {"model": model,
                          "train": {"seed": seed, "xe_epochs": EPOCHS}, "output_dir": f"/tmp/out/{tid}"}
                run_id = tracker.trial_run(tid, config, run_name=f"trial-{tid}")
                names[(fusion, lam, seed)] = f"trial-{tid}"
                best = _cider(fusion, lam, seed)
                metrics = []
                for e in range(1, EPOCHS + 1):
                    frac = [0.6, 1.0, 0.9][e - 1]  # the best epoch is 2, not the last one
                    values = {"val/CIDEr": best * frac, "val/BLEU-1": BLEU1[fusion] + 0.2 * seed + (e - 2) * 5,
                              "val/BLEU-4": 30.0 + (5.0 if fusion == "gate" else 0) + 0.1 * seed,
                              "val/METEOR": 25.0 + (2.0 if fusion == "gate" else 0),
                              "val/ROUGE-L": 52.0 + (3.0 if fusion == "gate" else 0) + 0.1 * seed,
                              "train/loss": 4.0 / e + seed * 0.1}
                    if lam is not None:
                        values["train/mask_mean"] = 1.0 - 2 * lam - 0.01 * e
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
    assert rows["gate"][:5] == ["6", f"{GROUNDING['gate'] + 0.02:.2f} ± 0.02", "0.30 ± 0.00",
                                 f"{GROUNDING['gate'] + 0.02 - 0.3:.2f} ± 0.02", "0.18 ± 0.00"]
    assert rows["none (baseline)"][-1] == "–" and rows["gate"][-1] == "0.82 ± 0.02"
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


def test_table3_has_seed_intervals_and_the_difference_to_the_baseline(report):
    page = open(report["html"], encoding="utf-8").read()
    rows = _table_rows(page)
    assert rows["head"] == ["fusion", "seeds", "B-1", "B-4", "METEOR", "ROUGE-L", "CIDEr", "CIDEr vs baseline",
                            "verdict", "config"]
    assert list(rows)[1:] == ["none (baseline)", "max", "moving average", "exp. decay", "gate"]
    col = {name: i + 1 for i, name in enumerate(["B-1", "B-4", "METEOR", "ROUGE-L", "CIDEr"])}
    # gate, lambda 0.1: CIDEr at the best epoch (2) 116, 117, 118 -> mean 117 with the t-interval over 3 seeds
    # (t(0.975, 2) * 1 / sqrt(3) = 2.48), the best
    assert rows["gate"][col["CIDEr"]] == "<b>117.0 [114.5, 119.5]</b>"
    assert "model.lambda=0.1" in rows["gate"][-1] and rows["gate"][0] == "3"
    # B-1 at the best epoch (2): exp_decay 78.0, 78.2, 78.4 -> 78.2 [77.7, 78.7], the best
    assert rows["exp. decay"][col["B-1"]] == "<b>78.2 [77.7, 78.7]</b>"
    assert rows["gate"][col["B-1"]] == "75.2 [74.7, 75.7]"
    assert rows["none (baseline)"][col["CIDEr"]] == "101.0 [98.5, 103.5]"
    assert rows["gate"][col["METEOR"]] == "<b>27.0 (3 seeds, all equal: the seed changes nothing)</b>"  # every seed
    bold = [(r, c) for r, cells in rows.items() if r != "head" for c, v in enumerate(cells) if v.startswith("<b>")]
    assert len(bold) == 5  # exactly one per metric column
    # the difference to the baseline (Welch over seed means: no per-image scores logged) and its verdict
    assert rows["none (baseline)"][col["CIDEr"] + 1] == "baseline"
    assert rows["gate"][col["CIDEr"] + 1].startswith("+16.0 CIDEr [")
    assert rows["gate"][col["CIDEr"] + 2].startswith("gate beats none by 16.0 CIDEr [")
    assert "3 seeds, seed means only" in rows["gate"][col["CIDEr"] + 2]
    # the baseline has no lambda: not in its config cell
    assert "lambda" not in rows["none (baseline)"][-1]


def test_main_entry_points(study, tmp_path, capsys):
    assert report_main(argparse.Namespace(name=STUDY, tracking_uri=study["uri"], out=str(tmp_path / "r"))) == 0
    assert (tmp_path / "r" / "report.html").exists()
    assert compare_main(argparse.Namespace(name=STUDY, by="fusion", baseline=None, tracking_uri=study["uri"])) == 0
    assert "117.0 [114.5, 119.5]" in capsys.readouterr().out  # the numbers of the report's table


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
    from dashboards.report import PLOTS, RunSummary

    plot_kendall = PLOTS["kendall"][1]
    final = {f"diag/kendall/layer{i}/{kind}": v for i in range(3)
             for kind, v in (("attention", 0.1 * i), ("mask", 0.2 + 0.1 * i))}
    fig = plot_kendall([RunSummary("r", "trial", "FINISHED", {}, {}, final)])
    fig.savefig(tmp_path / "k.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "3"]  # decoder layers
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["attention weights", "mask (1 - m)"]
    assert open(tmp_path / "k.png", "rb").read(4) == b"\x89PNG"
    assert plot_kendall([RunSummary("r", "t", "FINISHED", {}, {}, {"val/CIDEr": 1.0})]) is None


def test_lambda_series_leaves_the_baseline_out_and_draws_it_as_a_band():
    from dashboards.report import RunSummary, lambda_series

    def run(fusion, lam, cider):
        params = {"model.fusion": fusion, **({} if lam is None else {"model.lambda": str(lam)})}
        return RunSummary(f"{fusion}-{lam}-{cider}", "t", "FINISHED", params, {}, {}, best_cider=cider)

    runs = [run("gate", 0.035, c) for c in (110.0, 111.0, 112.0)] + [run("gate", 0.1, c) for c in (105.0, 107.0)]
    # a baseline logged before inapplicable keys were left out still carries lambda 0.035: it is no lambda point
    runs += [run("none", 0.035, c) for c in (100.0, 101.0, 102.0)]
    by_lam, points, baseline = lambda_series(runs)
    assert sorted(by_lam) == [0.035, 0.1] and len(by_lam[0.035]) == 3
    assert points[0.035].mean == 111.0 and points[0.035].low == pytest.approx(111.0 - 2.484, abs=1e-3)
    assert points[0.1].n == 2 and points[0.1].low == pytest.approx(106 - 12.706 * 2 ** 0.5 / 2 ** 0.5, abs=1e-2)
    assert baseline.mean == 101.0 and baseline.n == 3 and baseline.high == pytest.approx(103.484, abs=1e-3)

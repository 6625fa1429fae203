"""`a2 report` and `a2 study compare` on a study fabricated in a study folder (exported to MLflow where a test
looks there)."""
from __future__ import annotations

import argparse
import re
import shutil

import pytest
from mlflow.tracking import MlflowClient

from dashboards.compare import compare_table
from dashboards.report import build_report
from launch.commands.show import cmd_compare, cmd_report
from launch.tracking_writer import log_report
from tests.mlflowserver import mlflow_server  # noqa: F401
from tests.s3server import s3_client
from tests.studyfolder import fabricated_study


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """SQLite stores without a server keep artifacts under ./mlruns: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


STUDY = "fab-study"
CIDER = {"none": 100.0, "max": 105.0, "moving_average": 108.0, "exp_decay": 110.0, "gate": 114.0}  # x100
BLEU1 = {"none": 70.0, "max": 72.0, "moving_average": 73.0, "exp_decay": 78.0, "gate": 75.0}
LAMBDAS = {"none": [None], "max": [0.01, 0.1], "moving_average": [0.01, 0.1], "exp_decay": [0.01, 0.1],
           "gate": [0.01, 0.1]}
# the held-out split, scored once when a run ends: its order differs from val's (exp_decay leads on test, gate on val)
TEST_CIDER = {"none": 95.0, "max": 99.0, "moving_average": 101.0, "exp_decay": 104.0, "gate": 103.0}
GROUNDING = {"none": 0.5, "max": 0.55, "moving_average": 0.56, "exp_decay": 0.6, "gate": 0.62}
EPOCHS = 3
LAYERS = 3
SEEDS = (0, 1, 2)


def _cider(fusion, lam, seed):
    return CIDER[fusion] + (2.0 if lam == 0.1 else 0.0) + 1.0 * seed


def _test_scores(fusion, lam, seed) -> dict[str, float]:
    """What the selected checkpoint scores on the test split when the run ends (x100)."""
    gate = fusion == "gate"
    return {"test/CIDEr": TEST_CIDER[fusion] + (1.0 if lam == 0.1 else 0.0) + 2.0 * seed,
            "test/BLEU-1": BLEU1[fusion] - 1.0 + 0.3 * seed, "test/BLEU-4": 29.0 + 4.0 * gate + 0.1 * seed,
            "test/METEOR": 24.0 + 1.0 * gate + 0.1 * seed, "test/ROUGE-L": 51.0 + 2.0 * gate + 0.1 * seed,
            "test/epoch": 2}


def fabricate(root, name: str = STUDY, fusions: tuple[str, ...] = tuple(LAMBDAS), test_split: bool = True,
              overrides: tuple[str, ...] = ()):
    """A study folder like a real study's: fusions x lambdas x 3 seeds, val metrics (x100) per epoch, JSD per layer,
    and (with `test_split`) the test scores of each run's selected checkpoint, reported at the last epoch."""
    fab = fabricated_study(root, name, epochs=EPOCHS, overrides=(f"model.layers={LAYERS}", *overrides))
    fab.names = {}
    for fusion, lams in LAMBDAS.items():
        if fusion not in fusions:
            continue
        for lam in lams:
            for seed in SEEDS:
                tid = f"{fusion}-{lam}-{seed}"
                fab.names[(fusion, lam, seed)] = f"trial-{tid}"
                best = _cider(fusion, lam, seed)
                results = []
                for e in range(1, EPOCHS + 1):
                    frac = [0.6, 1.0, 0.9][e - 1]  # the best epoch is 2, not the last one
                    values = {"epoch": e, "val/CIDEr": best * frac,
                              "val/BLEU-1": BLEU1[fusion] + 0.2 * seed + (e - 2) * 5,
                              "val/BLEU-4": 30.0 + (5.0 if fusion == "gate" else 0) + 0.1 * seed,
                              "val/METEOR": 25.0 + (2.0 if fusion == "gate" else 0),
                              "val/ROUGE-L": 52.0 + (3.0 if fusion == "gate" else 0) + 0.1 * seed,
                              "train/loss": 4.0 / e + seed * 0.1, "timestamp": 1000.0 * e}
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
                    if test_split and e == EPOCHS:
                        values.update(_test_scores(fusion, lam, seed))
                    results.append(values)
                sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam}),
                           **({"temperature": 5000.0} if fusion == "exp_decay" else {})}
                fab.add(tid, sampled, results, name=f"trial-{tid}")
    return fab


@pytest.fixture(scope="module")
def fab(tmp_path_factory):
    return fabricate(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def study(fab):
    return fab.record().study()


@pytest.fixture(scope="module")
def report(study, fab):
    return build_report(study, fab.location.uri() + "-out")


def test_report_writes_plots_and_html(report, fab):
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
    assert "Not logged" not in page  # every test column of Table 3 was logged (SPICE is no test column)
    for n in fab.names.values():
        assert n in page


@pytest.mark.slow
def test_report_is_logged_on_the_parent_run(report, fab):
    """Into the study's parent run, once the study was exported to MLflow; not at all before (no run is made)."""
    uri = fab.spec.tracking.mlflow_uri
    assert log_report(uri, STUDY, report) is None
    fab.export()
    artifact_uri = log_report(uri, STUDY, report)
    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name(STUDY).experiment_id],
                                "tags.`a2.role` = 'study'")[0].info.run_id
    paths = sorted(a.path for a in client.list_artifacts(parent, "report"))
    assert paths == sorted(["report/report.html", "report/lambda_cider_mask.png", "report/jsd_per_layer.png",
                            "report/learning_curves.png", "report/parallel_coordinates.png", "report/grounding.png",
                            "report/verdicts.json"])
    assert artifact_uri.endswith("/report")


def _table_rows(page: str, cls: str = "t3") -> dict[str, list[str]]:
    table = re.search(rf"<table class='{cls}'>(.*?)</table>", page, re.S).group(1)
    head = re.findall(r"<th>(.*?)</th>", re.search(r"<thead>(.*?)</thead>", table, re.S).group(1))
    rows = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", re.search(r"<tbody>(.*?)</tbody>", table, re.S).group(1), re.S):
        label = re.search(r"<th>(.*?)</th>", tr).group(1)
        rows[label] = re.findall(r"<td[^>]*>(.*?)</td>", tr)
    return {"head": head, **rows}


def test_table3_rows_are_on_the_test_split_with_the_selection_column_on_val(report):
    page = open(report["html"], encoding="utf-8").read()
    rows = _table_rows(page)
    assert rows["head"] == ["fusion", "seeds", "test B-1", "test B-4", "test METEOR", "test ROUGE-L", "test CIDEr",
                            "val CIDEr (selection)", "test CIDEr vs baseline", "p", "Holm over 4 [CI], p", "verdict",
                            "config"]
    assert list(rows)[1:] == ["none (baseline)", "max", "moving average", "exp. decay", "gate"]
    col = {name: i + 1 for i, name in enumerate(rows["head"][2:8])}
    # rows are selected on val: gate's lambda 0.1 (val CIDEr at the best epoch, 2: 116, 117, 118 -> 117 with the
    # t-interval over 3 seeds, t(0.975, 2) * 1 / sqrt(3) = 2.48), the best val mean, in the labelled selection column
    assert rows["gate"][col["val CIDEr (selection)"]] == "<b>117.0 [114.5, 119.5]</b>"
    assert "model.lambda=0.1" in rows["gate"][-1] and rows["gate"][0] == "3"
    # every other number is that configuration's test score: 103 + 1 + 2 * seed -> 106 [101.0, 111.0]
    # (t(0.975, 2) * 2 / sqrt(3) = 4.97); exp. decay leads on test, 104 + 1 + 2 * seed -> 107
    assert rows["gate"][col["test CIDEr"]] == "106.0 [101.0, 111.0]"
    assert rows["exp. decay"][col["test CIDEr"]] == "<b>107.0 [102.0, 112.0]</b>"
    assert rows["none (baseline)"][col["test CIDEr"]] == "97.0 [92.0, 102.0]"
    # test B-1: BLEU1 - 1 + 0.3 * seed: exp_decay 77.3 [76.6, 78.0], the best; gate 74.3
    assert rows["exp. decay"][col["test B-1"]] == "<b>77.3 [76.6, 78.0]</b>"
    assert rows["gate"][col["test B-1"]] == "74.3 [73.6, 75.0]"
    assert rows["gate"][col["test B-4"]] == "<b>33.1 [32.9, 33.3]</b>"
    assert rows["gate"][col["test METEOR"]] == "<b>25.1 [24.9, 25.3]</b>"
    assert rows["gate"][col["test ROUGE-L"]] == "<b>53.1 [52.9, 53.3]</b>"
    for cells in (cells for label, cells in rows.items() if label != "head"):  # no val number but the selection
        assert not any(v in " ".join(cells) for v in ("78.2 [77.7, 78.7]", "75.2 [74.7, 75.7]"))
    bold = [(r, c) for r, cells in rows.items() if r != "head" for c, v in enumerate(cells) if v.startswith("<b>")]
    assert len(bold) == 6  # exactly one per interval column
    # the difference to the baseline in test CIDEr (Welch over seed means: no per-image scores logged):
    # 106 - 97 = 9, se sqrt(4/3 + 4/3), 4 df -> [4.5, 13.5]
    versus, verdict = col["val CIDEr (selection)"] + 1, col["val CIDEr (selection)"] + 4
    assert rows["none (baseline)"][versus] == "baseline"
    assert rows["gate"][versus] == "+9.0 test CIDEr [+4.5, +13.5]"
    # four fusions against one baseline: one family, Holm's verdict beside the raw interval and p
    assert rows["gate"][versus + 1] == "0.005"
    assert rows["gate"][verdict].startswith("gate beats none by 9.0 test CIDEr [4.5, 13.5], 3 seeds, seed means only "
                                            "(raw p 0.005, Holm over 4 comparisons: [")
    assert "lambda" not in rows["none (baseline)"][-1]  # the baseline has no lambda: not in its config cell
    assert "Every number but the selection column is on the held-out test split" in page
    # the run list: each run's selection number (val) and its test CIDEr, labelled
    runs = _table_rows(page, "runs")
    assert runs["head"][-3:] == ["best val CIDEr (selection)", "best epoch", "test CIDEr"]
    assert runs["trial-gate-0.1-2"][-3:] == ["118.0", "2", "108.0"]


def test_a_study_without_test_scores_is_on_val_throughout_and_says_so(tmp_path):
    study = fabricate(tmp_path, "valonly", fusions=("none", "gate"), test_split=False).record().study()
    text = compare_table(study)
    assert "every number is on the val images the rows were selected on" in text
    head = text.splitlines()[1]
    assert "val B-1 [95% CI]" in head and "val CIDEr [95% CI]" in head and "vs baseline (val CIDEr)" in head
    assert "test" not in head and "selection" not in head
    assert text.splitlines()[-1].startswith("gate beats none by 16.0 val CIDEr [")
    paths = build_report(study, tmp_path / "out")
    rows = _table_rows(open(paths["html"], encoding="utf-8").read())
    assert rows["head"][2:8] == ["val B-1", "val B-4", "val METEOR", "val ROUGE-L", "val CIDEr",
                                 "val CIDEr vs baseline"]
    assert rows["gate"][5] == "<b>117.0 [114.5, 119.5]</b>" and rows["gate"][6].startswith("+16.0 val CIDEr [")


def test_main_entry_points(fab, tmp_path, capsys, monkeypatch):
    fab.patch_tune(monkeypatch)
    args = argparse.Namespace(name=STUDY, storage=fab.spec.storage, tracking_uri=None, out=str(tmp_path / "r"))
    assert cmd_report(args) == 0
    assert (tmp_path / "r" / "report.html").exists()
    assert cmd_compare(argparse.Namespace(name=STUDY, storage=fab.spec.storage, by="fusion", baseline=None,
                                          tracking_uri=None)) == 0
    out = capsys.readouterr().out
    assert "106.0 [101.0, 111.0]" in out and "117.0 [114.5, 119.5]" in out  # the numbers of the report's table


@pytest.mark.slow
def test_compare_and_report_are_the_same_with_the_mlflow_store_deleted(tmp_path, capsys, monkeypatch):
    """The record is the study's storage: with its MLflow store gone, `compare` prints the same table and `report`
    draws the same tables (only the note that it was not logged to MLflow is new), and no store is made."""
    fab = fabricate(tmp_path, "gone", fusions=("none", "gate"))
    fab.patch_tune(monkeypatch)
    fab.export()
    store = tmp_path / "mlflow.db"
    assert store.is_file()

    def outputs(out: str):
        compare = argparse.Namespace(name="gone", storage=fab.spec.storage, by="fusion", baseline=None,
                                     tracking_uri=None)
        assert cmd_compare(compare) == 0
        table = capsys.readouterr().out
        assert cmd_report(argparse.Namespace(name="gone", storage=fab.spec.storage, tracking_uri=None,
                                             out=str(tmp_path / out))) == 0
        page = (tmp_path / out / "report.html").read_text(encoding="utf-8")
        return table, {cls: _table_rows(page, cls) for cls in ("t3", "diag", "runs")}, capsys.readouterr().out

    table, rows, printed = outputs("with")
    assert "artifact_uri:" in printed and "gate beats none by" in table
    store.unlink()
    shutil.rmtree(tmp_path / "mlruns", ignore_errors=True)
    again, rows_again, printed = outputs("without")
    assert again == table and rows_again == rows
    assert "note: not logged to MLflow" in printed and not store.exists()


def test_report_with_missing_metrics_and_unknown_study(tmp_path, monkeypatch):
    fab = fabricated_study(tmp_path, "bare", epochs=1)
    fab.add("t0", {"fusion": "gate"}, [{"epoch": 1, "train/loss": 3.0}])
    paths = build_report(fab.record().study(), tmp_path / "out")
    page = open(paths["html"], encoding="utf-8").read()
    assert "No run logged val/CIDEr" in page and "No run logged diag/jsd/layer{i}" in page
    assert set(paths) >= {"html", "curves"} and "lambda" not in paths
    assert "no run has logged val/CIDEr" in compare_table(fab.record().study())
    from a2core.errors import StudyError

    with pytest.raises(StudyError, match="no study 'nope'"):
        cmd_report(argparse.Namespace(name="nope", storage=fab.spec.storage, tracking_uri=None,
                                      out=str(tmp_path / "out2")))


@pytest.mark.slow
def test_report_through_the_server_lands_in_s3(mlflow_server, tmp_path):  # noqa: F811
    """Against the tracking server: the report's artifacts are proxied to the S3 bucket."""
    name = "fab-study-server"
    fab = fabricate(tmp_path, name, fusions=("none", "gate"), overrides=(f"tracking.mlflow_uri={mlflow_server}",))
    fab.export()
    study = fab.record().study()
    paths = build_report(study, tmp_path / "out")
    artifact_uri = log_report(str(mlflow_server), name, paths)
    assert artifact_uri.startswith("mlflow-artifacts:")
    client = MlflowClient(str(mlflow_server))
    parent = client.search_runs([client.get_experiment_by_name(name).experiment_id],
                                "tags.`a2.role` = 'study'")[0].info.run_id
    assert "report/report.html" in [a.path for a in client.list_artifacts(parent, "report")]
    keys = [o["Key"] for o in s3_client(mlflow_server.s3_endpoint).list_objects_v2(
        Bucket=mlflow_server.bucket, Prefix="mlartifacts/").get("Contents", [])]
    assert any(k.endswith(f"{parent}/artifacts/report/report.html") for k in keys)
    rows = _table_rows(open(paths["html"], encoding="utf-8").read())
    assert list(rows)[1:] == ["none (baseline)", "gate"]
    assert "gate" in compare_table(study).splitlines()[-1]


def test_kendall_plot_when_measured(tmp_path):
    from dashboards.runs import Trial
    from dashboards.report import PLOTS

    plot_kendall = PLOTS["kendall"][1]
    final = {f"diag/kendall/layer{i}/{kind}": v for i in range(3)
             for kind, v in (("attention", 0.1 * i), ("mask", 0.2 + 0.1 * i))}
    fig = plot_kendall([Trial("r", name="trial", status="FINISHED", final=final)])
    fig.savefig(tmp_path / "k.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "3"]  # decoder layers
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["attention weights", "mask (1 - m)"]
    assert open(tmp_path / "k.png", "rb").read(4) == b"\x89PNG"
    assert plot_kendall([Trial("r", name="t", status="FINISHED", final={"val/CIDEr": 1.0})]) is None


def test_lambda_series_leaves_the_baseline_out_and_draws_it_as_a_band():
    from dashboards.runs import Trial
    from dashboards.report import lambda_series

    def run(fusion, lam, cider):
        model = {"fusion": fusion, **({} if lam is None else {"lambda": lam})}
        return Trial(f"{fusion}-{lam}-{cider}", name="t", status="FINISHED", config={"model": model}, best_value=cider,
                     best_step=1, history={"val/CIDEr": [(1, cider)]})

    runs = [run("gate", 0.035, c) for c in (110.0, 111.0, 112.0)] + [run("gate", 0.1, c) for c in (105.0, 107.0)]
    # a baseline logged before inapplicable keys were left out still carries lambda 0.035: it is no lambda point
    runs += [run("none", 0.035, c) for c in (100.0, 101.0, 102.0)]
    by_lam, points, baseline = lambda_series(runs)
    assert sorted(by_lam) == [0.035, 0.1] and len(by_lam[0.035]) == 3
    assert points[0.035].mean == 111.0 and points[0.035].low == pytest.approx(111.0 - 2.484, abs=1e-3)
    assert points[0.1].n == 2 and points[0.1].low == pytest.approx(106 - 12.706 * 2 ** 0.5 / 2 ** 0.5, abs=1e-2)
    assert baseline.mean == 101.0 and baseline.n == 3 and baseline.high == pytest.approx(103.484, abs=1e-3)


def test_the_runs_table_lists_best_val_cider_first_and_runs_without_it_last():
    """A run still in its first epoch (no val CIDEr yet) goes below every scored run, not above the best."""
    from dashboards.report import runs_table_html
    from dashboards.runs import CIDER, Trial

    runs = [Trial("t1", name="run-worse", state="TERMINATED", final={CIDER: 90.0}),
            Trial("t2", name="run-running", state="RUNNING"),
            Trial("t3", name="run-best", state="TERMINATED", final={CIDER: 110.0})]
    rows = re.findall(r"run-(best|worse|running)", runs_table_html(runs, []))
    assert rows == ["best", "worse", "running"]


def test_a_study_selecting_by_another_metric_labels_its_selection_column_by_it(tmp_path):
    """search.metric val/BLEU-4: each run's checkpoint and each row's configuration are chosen by BLEU-4, so the
    selection column (compare, Table 3, the run list) is val BLEU-4, not val CIDEr, and the run list is in its order."""
    fab = fabricate(tmp_path, "by-bleu4", fusions=("none", "gate"), overrides=("search.metric=val/BLEU-4",))
    study = fab.record().study()
    assert study.metric == "val/BLEU-4"
    text = compare_table(study)
    assert "val BLEU-4 (selection) [95% CI]" in text and "val CIDEr (selection)" not in text
    page = open(build_report(study, tmp_path / "out")["html"], encoding="utf-8").read()
    rows = _table_rows(page)
    assert rows["head"][7] == "val BLEU-4 (selection)"
    assert rows["gate"][6] == "<b>35.1 [34.9, 35.3]</b>"  # 35 + 0.1 x seed over seeds 0-2, t(0.975, 2) x 0.1 / sqrt(3)
    assert "its best val BLEU-4 epoch" in page and "best configuration by mean val BLEU-4" in page
    runs = _table_rows(page, "runs")
    assert runs["head"][-3:] == ["best val BLEU-4 (selection)", "best epoch", "test CIDEr"]
    order = [label for label in runs if label != "head"]
    assert [runs[label][-3] for label in order[:2]] == ["35.2", "35.2"]  # gate's seed-2 runs (both lambdas) first
    assert runs[order[-1]][-3] == "30.0"  # none's seed 0 last


def test_a_comparison_by_a_key_no_run_has_is_refused(study):
    """`--by lamda` (a typo) printed the baseline's row alone, and `results export` kept it as a record of one arm."""
    from a2core.errors import StudyError

    with pytest.raises(StudyError) as err:
        compare_table(study, by="lamda")
    assert str(err.value).startswith("--by lamda: no run of study fab-study has lamda (its searched keys: ")
    assert "fusion, lambda, " in str(err.value)
    assert "0.1 " in compare_table(study, by="lambda")  # the key spelled right: its rows


def test_a_report_whose_write_fails_leaves_the_last_one_whole_and_a_non_utf8_record_path_is_shown(tmp_path,
                                                                                                  monkeypatch):
    """The report is written by temp file and rename: a write that fails part-way (a full disk) leaves the previous
    report.html as it was. A record path that is not UTF-8 (POSIX names are bytes) is shown with U+FFFD; it used to
    raise UnicodeEncodeError after report.html had been truncated to 0 bytes."""
    import os

    from a2core import atomic
    from dashboards.runs import Study

    out = tmp_path / "out"
    first = open(build_report(Study("s", [], source="/data/one"), out)["html"], encoding="utf-8").read()
    assert "Record: /data/one" in first
    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        f.write = lambda data: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f

    monkeypatch.setattr(atomic.os, "fdopen", full_disk)
    with pytest.raises(OSError, match="No space left"):
        build_report(Study("s", [], source="/data/two"), out)
    monkeypatch.undo()
    assert (out / "report.html").read_text(encoding="utf-8") == first
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]

    page = open(build_report(Study("s", [], source=os.fsdecode(b"/data/caf\xe9/record")), out)["html"],
                encoding="utf-8").read()
    assert "Record: /data/caf\ufffd/record" in page


def test_a_fusion_with_another_value_in_every_run_is_a_searched_key_not_a_path(tmp_path):
    """A one-seed ablation (fusions none, max, gate, one run each) varies model.fusion in every run: it is the
    searched key of the runs table and of `compare --by` (it was taken for a per-run path and dropped), while a
    per-run output folder still is not one."""
    from dashboards.runs import searched_keys

    fab = fabricated_study(tmp_path, "three-fusions", epochs=2)
    for i, fusion in enumerate(("none", "max", "gate")):
        sampled = {"fusion": fusion, "seed": 0, **({} if fusion == "none" else {"lambda": 0.1})}
        fab.add(f"{fusion}-0", sampled, [{"epoch": e, "val/CIDEr": 100.0 + 3 * i + e, "train/loss": 1.0,
                                          "timestamp": 1000.0 * e} for e in (1, 2)])
    study = fab.record().study()
    keys = searched_keys(study.runs)
    assert "model.fusion" in keys and not any(k.endswith("output_dir") for k in keys)
    from a2core.errors import StudyError

    with pytest.raises(StudyError, match=r"its searched keys: .*fusion"):  # the hint for a typo'd --by
        compare_table(study, by="lamda")


def test_the_selection_column_of_a_study_metric_without_curves_is_its_best_epochs_value(tmp_path):
    """A study selecting on val/BLEU-3 (no per-epoch curve is kept of it for the plots): each run's selection score
    is its value at the best epoch, the one the record selected on, not the last epoch's (half of it here)."""
    fab = fabricated_study(tmp_path, "by-bleu3", epochs=3, overrides=("search.metric=val/BLEU-3",))
    for fusion, peak in (("none", 40.0), ("gate", 44.0)):
        for seed in range(3):
            sampled = {"fusion": fusion, "seed": seed, **({} if fusion == "none" else {"lambda": 0.1})}
            fab.add(f"{fusion}-{seed}", sampled, [{"epoch": e, "val/CIDEr": 100.0, "train/loss": 1.0,
                                                   "val/BLEU-3": (peak + seed) * frac, "timestamp": 1000.0 * e}
                                                  for e, frac in ((1, 0.6), (2, 1.0), (3, 0.5))])
    study = fab.record().study()
    for run in study.runs:
        assert run.best_step == 2 and run.score("val/BLEU-3") == pytest.approx(run.best_value)
    text = compare_table(study)
    assert "41.0 [" in text and "45.0 [" in text  # the means of 40-42 and 44-46, not of the last epochs' 20-23

"""`a2 report`'s plots and Table 3 on inputs a study produces (`dashboards.report`, no Ray): a searched value or a
run name with `$` in it, many trials of one epoch, a lambda of one seed, confirmation seeds not all run yet."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dashboards import report as rp
from dashboards.compare import compare_table, study_verdicts
from dashboards.runs import CIDER, Study, Trial

pytestmark = pytest.mark.outside_ray_group


def trial(tid: str, fusion: str, seed: int, cider: float, *, lam: float = 0.1, data: dict | None = None,
          name: str | None = None, epochs: int = 1) -> Trial:
    model = {"fusion": fusion, **({"lambda": lam} if fusion != "none" else {})}
    config = {"model": model, "train": {"seed": seed}, **({"data": data} if data else {})}
    history = {CIDER: [(e, cider - epochs + e) for e in range(1, epochs + 1)], "train/loss": [(1, 2.0)]}
    return Trial(tid, name=name or tid, state="TERMINATED", config=config,
                 config_hash=f"{fusion}-{lam}-{json.dumps(data)}", best_value=cider, best_step=epochs,
                 final={CIDER: cider}, history=history, status="FINISHED", per_image=lambda split: None)


def test_a_searched_value_or_run_name_with_dollar_signs_is_drawn_as_text_and_the_page_escapes_it(tmp_path):
    """matplotlib reads text between two `$` as mathtext: a searched data.features `${ROOT}_${V}.h5` (parallel
    coordinates) or a run name `r$\\x{$` (the curves' legend) stopped the whole report at savefig (ValueError)."""
    runs = [trial("a", "gate", 0, 100.0, data={"features": "${ROOT}_${V}.h5"}, name="r$\\x{$ <img src=x onerror=1>"),
            trial("b", "gate", 1, 101.0, data={"features": "a & b.h5"}),
            trial("c", "none", 0, 99.0, data={"features": "a & b.h5"})]
    paths = rp.build_report(Study("<b>x</b> & y", runs), tmp_path / "out")
    assert Path(paths["parallel"]).is_file() and Path(paths["curves"]).is_file()
    page = Path(paths["html"]).read_text()
    assert "<h1>Study &lt;b&gt;x&lt;/b&gt; &amp; y</h1>" in page and "<img src=x" not in page
    assert "<th>r$\\x{$ &lt;img src=x onerror=1&gt;</th>" in page and "<td>a &amp; b.h5</td>" in page
    fig = rp.plot_parallel(runs)
    fig.savefig(io.BytesIO(), format="png")
    ticks = {t.get_text() for t in fig.axes[0].texts}
    assert "\\${ROOT}_\\${V}.h5" in ticks  # escaped for mathtext: drawn as "${ROOT}_${V}.h5"


def test_many_trials_of_one_epoch_draw_their_points_and_the_cider_axis_says_x100():
    """Over 12 trials the curves are drawn without markers: a trial of one epoch (a curve of one point) drew
    nothing, so a study of 13 one-epoch trials had an empty learning-curves plot."""
    runs = [trial(f"t{i}", "gate", i, 100.0 + i) for i in range(13)]
    fig = rp.plot_curves(runs)
    cider_ax = fig.axes[0]
    assert len(cider_ax.lines) == 13 and all(line.get_marker() == "." for line in cider_ax.lines)
    assert cider_ax.get_ylabel() == "val CIDEr (x100)" and cider_ax.get_title() == "val CIDEr per trial"
    many = rp.plot_curves([trial(f"t{i}", "gate", i, 100.0 + i, epochs=3) for i in range(13)])
    assert all(line.get_marker() == "" for line in many.axes[0].lines)  # longer curves stay lines


def test_a_lambda_of_one_seed_gets_no_zero_width_interval():
    """λ 0.1 ran one seed: its error bar was drawn from 100.0 to 100.0 with caps, an interval of zero width, read as
    an exact value; it has none (its point stays), and the legend says which have none."""
    runs = [trial("a", "gate", 0, 100.0, lam=0.1), trial("b", "gate", 0, 102.0, lam=0.2),
            trial("c", "gate", 1, 103.0, lam=0.2)]
    fig = rp.plot_lambda(runs)
    bars = fig.axes[0].containers[0]
    segments = [s.tolist() for s in bars.lines[2][0].get_segments()]
    assert segments[0] == []  # λ 0.1: no bar
    assert segments[1][0][0] == 0.2 and segments[1][0][1] < 102.5 < segments[1][1][1]  # λ 0.2: its 95% interval
    assert bars.lines[0].get_ydata().tolist() == [100.0, 102.5]  # both means drawn
    assert "none at 1 λ: under 2 seeds or all equal" in fig.legends[0].get_texts()[0].get_text()


def _confirm_study(confirmed_gate: bool) -> Study:
    runs = [trial(f"{f}{s}", f, s, 100.0 + s + (3 if f == "gate" else 0)) for f in ("none", "gate") for s in (0, 1)]
    runs += [trial(f"none{s}", "none", s, 99.0 + s) for s in (2, 3)]
    if confirmed_gate:
        runs += [trial(f"gate{s}", "gate", s, 104.0 + s) for s in (2, 3)]
    return Study("conf", runs, confirm_from=2)


def test_a_report_with_confirmation_seeds_says_which_seeds_its_rows_are_as_compare_does(tmp_path):
    """Gate's confirmation seeds have not run: `a2 study compare` and summary.json say its row shows the seeds it
    was chosen on (no verdict); the report's Table 3 printed that row beside confirmed ones without a word, and its
    verdicts.json left the note out. With every row confirmed, compare says the numbers are the confirmation seeds;
    the report said they were each configuration's best by mean over its seeds."""
    study = _confirm_study(confirmed_gate=False)
    paths = rp.build_report(study, tmp_path / "pending")
    page = Path(paths["html"]).read_text()
    note = study_verdicts(study)["note"]
    assert note.startswith("no verdict for gate") and note in compare_table(study)
    assert f"<p class='missing'>N{note[1:]}.</p>" in page and "Confirmation seeds:" not in page
    assert json.loads(Path(paths["verdicts"]).read_text()) == study_verdicts(study)

    study = _confirm_study(confirmed_gate=True)
    paths = rp.build_report(study, tmp_path / "confirmed")
    page = Path(paths["html"]).read_text()
    assert ("<p class='note'>Confirmation seeds: each row&#x27;s configuration was chosen on its seeds below 2; its "
            "numbers and its verdict are its seeds from 2 on, which the choice never saw.</p>") in page
    assert "confirmation seeds: each row's configuration was chosen on its seeds below 2" in compare_table(study)
    assert json.loads(Path(paths["verdicts"]).read_text()) == study_verdicts(study)

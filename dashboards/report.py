"""`a2 report NAME`: plots and one HTML page from a study's record (`launch.record` hands it over as a `Study`),
logged to the study's MLflow parent run under `report/` when it has one by `launch.tracking_writer.log_report`
(`build_report` lists its sections). Table scores are taken at a run's best epoch (the epoch of its highest val
CIDEr), other metrics are final values; all x100, as reported.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections import Counter
from functools import partial
from pathlib import Path
from statistics import fmean, stdev
from typing import Any

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from a2core.atomic import atomic_write
from a2core.errors import DataError, StudyError
from a2core.selection import finite
from dashboards.compare import (cell_text, family_note, family_text, p_text, shown_metrics, split_columns,
                                study_comparison, verdict_family)
from dashboards.runs import (CIDER, FUSION_LABEL, TEST_CIDER, Study, Trial, metric_label, searched_keys,
                             selection_column, sort_key)
from dashboards.stats import MIN_SEEDS, seed_interval, stopped_early_text

DIAG_COLUMNS = [("grounding acc.", "diag/grounding/accuracy"), ("word-agnostic control", "diag/grounding/control"),
                ("lift", "diag/grounding/lift"), ("chance", "diag/grounding/chance"),
                ("subject vs object", "diag/grounding/subject_object"),
                ("Kendall τ attention", "diag/kendall/attention"), ("Kendall τ mask", "diag/kendall/mask"),
                ("mask mean", "diag/mask_mean")]
_DIAG = re.compile("|".join(re.escape(key) for _, key in DIAG_COLUMNS))
_JSD = re.compile(r"diag/jsd/layer(\d+)")
_KENDALL = re.compile(r"diag/kendall/layer(\d+)/(attention|mask)")
_GROUNDING = re.compile(r"diag/grounding/(accuracy|control|chance)")


# -- tables ----------------------------------------------------------------------------------------------------
def _td(text, cls: str | None = None) -> str:
    return f"<td{f' class={cls!r}' if cls else ''}>{html.escape(str(text))}</td>"


def _html_table(head: list[str], rows: list[tuple[str, list[str]]], cls: str | None = None) -> str:
    """rows: (the row's label, its cells as <td> HTML)."""
    head_html = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>" for label, cells in rows)
    return (f"<table{f' class={cls!r}' if cls else ''}><thead><tr>{head_html}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _missing(text: str) -> str:
    return f"<p class='missing'>{html.escape(text)}</p>"


def fusion_table_html(comparison, configs: dict[str, str], mode: str = "max",
                      confirm_from: int | None = None) -> str:
    """Table 3: `dashboards.compare.study_comparison` by fusion, best mean per column in bold: the highest, but in
    the selection column (`comparison.selected_by`) of a study searching in `mode` "min" (train/loss) the lowest.
    `confirm_from`: the study's first confirmation seed, said under the table as `a2 study compare` says it."""

    if not comparison.rows:
        return _missing(f"No run logged {comparison.selected_by}, so there is no fusion table.")
    on_test = comparison.metric == TEST_CIDER
    split = "test" if on_test else "val"
    columns = shown_metrics(comparison)
    best = {m: (min if mode == "min" and m == comparison.selected_by else max)(
        iv[m].mean for _, iv in comparison.rows if m in iv) for _, m in columns}
    family = max((d.family for d in comparison.differences.values()), default=1)
    rows = []
    for arm, intervals in comparison.rows:
        cells = [_td(len(arm.seeds))]
        for _, m in columns:
            iv = intervals.get(m)
            bold = iv is not None and math.isclose(iv.mean, best[m])
            # over fewer seeds than the seeds column when some did not log it, as `a2 study compare` says
            text = cell_text(iv, len(arm.seeds)) if iv else "–"
            cells.append(f"<td class='best'><b>{html.escape(text)}</b></td>" if bold else _td(text))
        diff = comparison.differences.get(arm.label)
        versus = "baseline" if arm.label == comparison.baseline else (diff.interval_text() if diff else "–")
        cells += [_td(versus), _td(p_text(diff.p) if diff else "–"),
                  *([_td(family_text(diff) if diff else "–")] if family > 1 else []),
                  _td(diff.verdict() if diff else "", "l"), _td(configs[arm.label] or "–", "cfg")]
        rows.append((FUSION_LABEL.get(arm.label, arm.label), cells))
    head = ["fusion", "seeds", *(label for label, _ in columns), f"{split} CIDEr vs baseline", "p",
            *([f"Holm over {family} [CI], p"] if family > 1 else []), "verdict", "config"]
    missing = [label for label, m in split_columns(on_test, comparison.selected_by) if (label, m) not in columns]
    chosen_by = metric_label(comparison.selected_by)
    images = max((diff.images or 0 for diff in comparison.differences.values()), default=0)
    where = (f"Every number but the selection column is on the held-out test split"
             f"{f' ({images} images)' if images else ''}: each run's "
             f"selected checkpoint (its best {chosen_by} epoch) decoded with beam search when the run ended; the "
             "differences and verdicts are on those images. Only the selection column is on val."
             if on_test else
             "Every number is on the val images the rows were selected on (not every chosen run logged test "
             "scores: a run stopped early, or train.test_at_end: false), so the verdicts are not held-out ones.")
    # which seeds a row's numbers are, as compare says it: the seeds its configuration was not chosen on, or (a row
    # still waiting for its confirmation seeds) the ones it was chosen on, whose verdict would lean its way
    confirm = (f"Confirmation seeds: each row's configuration was chosen on its seeds below {confirm_from}; its "
               f"numbers and its verdict are its seeds from {confirm_from} on, which the choice never saw."
               if confirm_from is not None and not comparison.note else "")
    pending = f"{comparison.note[:1].upper()}{comparison.note[1:]}." if comparison.note else ""
    return (_html_table(head, rows, "t3") +
            "<p class='note'>The numbers of `a2 study compare --by fusion`: per fusion its best configuration by "
            f"mean {chosen_by} over seeds (stopped-early ones only when nothing else ran); mean [95% CI] over seeds "
            f"(none below {MIN_SEEDS} seeds), x100; best mean per column in bold. {where}</p>" +
            (f"<p class='note'>{html.escape(confirm)}</p>" if confirm else "") +
            (f"<p class='missing'>{html.escape(pending)}</p>" if pending else "") +
            (f"<p class='note'>{html.escape(family_note(family))}.</p>" if family > 1 else "") +
            (f"<p class='note'>Not logged: {', '.join(missing)}.</p>" if missing else ""))


def _final_values(runs: list[Trial], pattern: re.Pattern, place) -> dict[str, dict[Any, list[float]]]:
    """{group: {key: [final values]}} of the metrics `pattern` matches; `place(run, match)` -> (group, key)."""
    out: dict[str, dict[Any, list[float]]] = {}
    for r in runs:
        for metric, value in r.final.items():
            match = pattern.fullmatch(metric)
            if match and finite(value) is not None:
                group, key = place(r, match)
                out.setdefault(group, {}).setdefault(key, []).append(value)
    return out


def diagnostics_table_html(runs: list[Trial]) -> str:
    """One row per fusion, a column per `DIAG_COLUMNS` metric some run logged (a dash where it does not apply)."""
    values = _final_values(runs, _DIAG, lambda r, m: (r.fusion, m[0]))
    if not values:
        return _missing("No run logged diag/... metrics (the diagnostics every trial reports since they exist).")
    columns = [(label, k) for label, k in DIAG_COLUMNS if any(k in row for row in values.values())]

    def mean_std(v: list[float]) -> str:
        return f"{fmean(v):.2f}" + (f" ± {stdev(v):.2f}" if len(v) > 1 else "")

    # a run whose config no longer resolves and whose fusion was not sampled has none (None): a row of its own
    rows = [(FUSION_LABEL.get(fusion, str(fusion)), [_td(max(map(len, row.values())))] +
             [_td(mean_std(row[k]) if k in row else "–") for _, k in columns])
            for fusion, row in sorted(values.items(), key=lambda item: sort_key(item[0]))]
    return (_html_table(["fusion", "runs", *(label for label, _ in columns)], rows, "diag") +
            "<p class='note'>Final epoch of every run, mean ± std over the runs of a fusion. Grounding (synthetic "
            "data): how often the top attended region is the one the word refers to; the control attends one "
            "region per caption, so lift = accuracy - control is what word-level grounding adds.</p>")


def runs_table_html(runs: list[Trial], keys: list[str], metric: str = CIDER, mode: str = "max") -> str:
    """Every run, best first by the study's `metric` (what each run's checkpoint was selected by) in its `mode`."""
    if not runs:
        return _missing("The study has no trial runs yet.")
    rows, sign = [], -1 if mode == "max" else 1

    def selection_text(value: float | None) -> str:  # scores are x100 (one decimal); other metrics as they are
        return "–" if value is None else f"{value:.1f}" if metric.startswith("val/") else f"{value:.4g}"
    for r in sorted(runs, key=lambda r: math.inf if r.score(metric) is None else sign * r.score(metric)):  # none last
        state = stopped_early_text(r.stopped_early) if r.stopped_early else r.status
        if r.ended:  # why a trial ended itself (its record's end reason: it diverged)
            state += f" ({r.ended['reason']})"
        test, params = r.score(TEST_CIDER), r.params  # params: flattened anew at each read (`Trial.params`)
        cells = [_td(state, "l"), _td("" if r.seed is None else r.seed), *(_td(params.get(k, "")) for k in keys),
                 _td(selection_text(r.score(metric))),
                 _td("" if r.best_step is None else r.best_step), _td("–" if test is None else f"{test:.1f}")]
        rows.append((r.name, cells))
    return (_html_table(["run", "status", "seed", *keys, f"best {selection_column(metric)[0]}", "best epoch",
                         "test CIDEr"], rows, "runs") +
            f"<p class='note'>Best {metric_label(metric)}: the epoch each run's checkpoint was selected by (val "
            "images). Test "
            "CIDEr: that checkpoint on the test split, beam search, when the run ended (– for a run that did not "
            "end: stopped early or still running).</p>")


# -- plots: each returns a matplotlib Figure, or None when the study logged nothing for it -------------------------
def _plain(text) -> str:
    """`text` drawn as written: matplotlib reads text between two `$` as mathtext, so a run name or a searched value
    like `${ROOT}_a.h5` was drawn as formula or stopped the report (ValueError at savefig)."""
    return str(text).replace("$", r"\$")


def _axes(width: float = 7.0, height: float = 4.2, ncols: int = 1):
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    return fig, fig.subplots(1, ncols)


def lambda_series(runs: list[Trial]):
    """The Fig. 4 numbers: {lambda: its runs} of runs with a mask network, {lambda: Interval} of their best val
    CIDEr, and the baseline's (fusion none) Interval or None."""
    by_lam: dict[float, list[Trial]] = {}
    for r in runs:
        if r.lam is not None and r.lam > 0 and r.score(CIDER) is not None:
            by_lam.setdefault(r.lam, []).append(r)
    by_lam = dict(sorted(by_lam.items()))
    base = [r.score(CIDER) for r in runs if r.fusion == "none" and r.score(CIDER) is not None]
    points = {lam: seed_interval([r.score(CIDER) for r in group]) for lam, group in by_lam.items()}
    return by_lam, points, seed_interval(base) if base else None


def plot_lambda(runs: list[Trial]):
    """Best val CIDEr against lambda: each lambda's mean with its 95% interval as error bars and its runs as
    dots, the mean mask value on a second axis, and the baseline's mean and 95% interval as a band."""
    by_lam, points, baseline = lambda_series(runs)
    if not by_lam:
        return None
    lams = list(by_lam)
    cider = [points[x] for x in lams]
    # a lambda without an interval (one seed, or all seeds equal) gets no bar: a zero-width one reads as exact
    err = [[math.nan if iv.low is None else iv.mean - iv.low for iv in cider],
           [math.nan if iv.high is None else iv.high - iv.mean for iv in cider]]
    bare = sum(iv.low is None for iv in cider)
    lam_runs = [r for x in lams for r in by_lam[x]]
    fig, ax = _axes()
    ax.scatter([r.lam for r in lam_runs], [r.score(CIDER) for r in lam_runs], s=12, color="tab:blue", alpha=0.35)
    ax.errorbar(lams, [iv.mean for iv in cider], yerr=err, fmt="o-", color="tab:blue", capsize=3,
                label="val CIDEr (best epoch), mean and 95% CI" + (
                    f" (none at {bare} λ: under {MIN_SEEDS} seeds or all equal)" if bare else ""))
    if baseline is not None:
        ax.axhline(baseline.mean, color="gray", lw=1, label=f"baseline (fusion none), {baseline.n} runs")
        if baseline.low is not None:
            ax.axhspan(baseline.low, baseline.high, color="gray", alpha=0.2, lw=0)
    ax.set(xscale="log", xlabel="λ (mask regulariser)", title="CIDEr and mask value against λ")
    ax.set_ylabel("val CIDEr (x100)", color="tab:blue")
    handles = ax.get_legend_handles_labels()[0]
    mask = _final_values(lam_runs, re.compile("train/mask_mean"), lambda r, m: ("mask", r.lam)).get("mask")
    if mask:
        ax2 = ax.twinx()
        ax2.plot(list(mask), [fmean(v) for v in mask.values()], "s--", color="tab:red", label="mean mask value")
        ax2.set_ylabel("mean mask m", color="tab:red")
        handles += ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=8, frameon=False)
    return fig


def plot_bars(pattern: re.Pattern, place, labels: dict[str, str], tick, settings: dict, runs: list[Trial]):
    """Grouped bars of the final values of the metrics `pattern` matches, `place(run, match)` -> (series, x): per
    x (its tick label `tick(x)`) one bar per series (legend `labels`, in their order), the mean over runs;
    `settings` go to `Axes.set`."""
    values = _final_values(runs, pattern, place)
    if not values:
        return None
    series = sorted(values, key=lambda s: list(labels).index(s) if s in labels else len(labels))
    xs = sorted({x for v in values.values() for x in v}, key=sort_key)
    fig, ax = _axes()
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        at = [j for j, x in enumerate(xs) if x in values[s]]
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in at], [fmean(values[s][xs[j]]) for j in at],
               width=width, label=_plain(labels.get(s, s)))
    ax.set_xticks(range(len(xs)), [_plain(tick(x)) for x in xs])
    ax.axhline(0, color="black", lw=0.6)
    ax.legend(fontsize=8)
    ax.set(xlim=(-0.75, len(xs) - 0.25), **settings)
    return fig


def plot_curves(runs: list[Trial]):
    keys = [(CIDER, "val CIDEr (x100)"), ("train/loss", "train loss")]
    if not any(r.history.get(k) for r in runs for k, _ in keys):
        return None
    fig, axes = _axes(11, 4.2, ncols=2)
    many = len(runs) > 12
    for ax, (key, label) in zip(axes, keys):
        for r in runs:
            if r.history.get(key):
                steps, values = zip(*r.history[key])
                # a curve of one epoch is a point: without a marker it is not drawn at all
                ax.plot(steps, values, marker="" if many and len(steps) > 1 else ".", lw=0.8 if many else 1.3,
                        alpha=0.6 if many else 0.9, label=_plain(f"{r.name} ({r.fusion})"))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="epoch (logged step)", ylabel=label, title=f"{label.removesuffix(' (x100)')} per trial")
        if not many and ax.lines:
            ax.legend(fontsize=6)
    return fig


def _parallel_axis(key: str, raw: list) -> tuple[str, list[float], list[tuple[float, str]]]:
    """(axis label, each run's position in [0, 1], ticks) of one param; numbers spanning over 20x on a log scale."""
    numbers = [finite(v) for v in raw]
    if None in numbers:
        categories = sorted({str(v) for v in raw}, key=sort_key)
        at = {c: i / max(len(categories) - 1, 1) for i, c in enumerate(categories)}
        return _plain(key), [at[str(v)] for v in raw], [(y, _plain(c)) for c, y in at.items()]
    log = min(numbers) > 0 and max(numbers) / min(numbers) > 20
    scaled = [math.log10(v) for v in numbers] if log else numbers
    low, span = min(scaled), (max(scaled) - min(scaled)) or 1.0
    ticks = [(0.0, f"{min(numbers):.3g}")] + ([(1.0, f"{max(numbers):.3g}")] if max(scaled) > low else [])
    return _plain(f"{key} (log)" if log else key), [(v - low) / span for v in scaled], ticks


def plot_parallel(runs: list[Trial]):
    """One vertical axis per searched param and best val CIDEr, one line per run coloured by its CIDEr."""
    runs = [r for r in runs if r.score(CIDER) is not None]
    keys = searched_keys(runs)
    if not runs or not keys:
        return None

    params = [r.params for r in runs]
    cider = [r.score(CIDER) for r in runs]
    axes = [*(_parallel_axis(k, [p.get(k) for p in params]) for k in keys), _parallel_axis(CIDER, cider)]
    fig, ax = _axes(max(6.0, 2.0 * len(axes)), 4.5)
    norm = mpl.colors.Normalize(min(cider), max(max(cider), min(cider) + 1e-9))
    cmap = mpl.colormaps["viridis"]
    xs = range(len(axes))
    for i in sorted(range(len(runs)), key=lambda i: cider[i]):
        ax.plot(xs, [positions[i] for _, positions, _ in axes], color=cmap(norm(cider[i])), alpha=0.8, lw=1.2)
    for x, (_, _, ticks) in zip(xs, axes):
        ax.axvline(x, color="black", lw=0.8)
        for y, text in ticks:
            ax.annotate(text, (x, y), xytext=(4, 0), textcoords="offset points", fontsize=7, va="center")
    ax.set_xticks(xs, [label for label, _, _ in axes], fontsize=8)
    ax.set(yticks=[], xlim=(-0.2, len(axes) - 0.6), ylim=(-0.05, 1.05),
           title="Search: searched params against best val CIDEr")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="best val CIDEr")
    return fig


# -- the page --------------------------------------------------------------------------------------------------
# key: (file, plot(runs) -> Figure or None, section title, what the page says when the study logged nothing for it)
# (the diag/.../layer{i} metrics count decoder layers from 0, the plots from 1)
PLOTS = {
    "lambda": ("lambda_cider_mask.png", plot_lambda, "CIDEr and mask value against λ (Fig. 4 style)",
               "No run logged both a lambda param (model.lambda) and val/CIDEr."),
    "jsd": ("jsd_per_layer.png",
            partial(plot_bars, _JSD, lambda r, m: (r.fusion, int(m[1]) + 1), FUSION_LABEL, str,
                    dict(xlabel="decoder layer", ylabel="JSD(original ‖ aligned attention)",
                         title="Per-layer attention divergence (final epoch, mean over runs)")),
            "Per-layer JSD between original and aligned attention (Fig. 6 style)", "No run logged diag/jsd/layer{i}."),
    "kendall": ("kendall_tau.png",
                partial(plot_bars, _KENDALL, lambda r, m: (m[2], int(m[1]) + 1),
                        {"attention": "attention weights", "mask": "mask (1 - m)"}, str,
                        dict(xlabel="decoder layer", ylabel="Kendall τ vs gradient importance",
                             title="Agreement with gradient-based importance")),
                "Kendall τ of attention and mask against gradient importance",
                "No run logged diag/kendall/layer{i}/attention or diag/kendall/layer{i}/mask."),
    "grounding": ("grounding.png",
                  partial(plot_bars, _GROUNDING, lambda r, m: (m[1], r.fusion),
                          {"accuracy": "attention (accuracy)", "control": "word-agnostic control",
                           "chance": "uniform chance"}, lambda fusion: FUSION_LABEL.get(fusion, fusion),
                          dict(ylim=(0, 1), ylabel="grounding accuracy",
                               title="Attention grounding on synthetic data (final epoch, mean over runs)")),
                  "Grounding accuracy (synthetic data)",
                  "No run logged diag/grounding/accuracy (grounding is scored on data with ground-truth regions, "
                  "the synthetic dataset)."),
    "curves": ("learning_curves.png", plot_curves, "Learning curves", "No run logged val/CIDEr or train/loss."),
    "parallel": ("parallel_coordinates.png", plot_parallel, "Search (parallel coordinates)",
                 "No searched params vary across runs with val/CIDEr."),
}

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
h1{margin-bottom:0} .sub{color:#666} img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse;margin:0.5em 0} th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
thead th{background:#f3f3f3} tbody th{text-align:left} td.cfg{text-align:left;font-size:85%;color:#555}
td.best{background:#eef7ee} .missing{color:#a60;font-style:italic} .note{color:#666;font-size:90%}
td.l{text-align:left}
"""


def _summary(study: Study) -> str:
    runs = study.runs
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.status for r in runs).items())) or "none"
    stopped = sum(bool(r.stopped_early) for r in runs)
    diverged = sum(bool(r.ended) for r in runs)
    text = (f"{len(runs)} trial runs ({statuses}{f', {stopped} stopped early' if stopped else ''}"
            f"{f', {diverged} diverged' if diverged else ''}); the study is "
            f"{'still running' if study.running else 'not running'}.")
    best = study.best_run()  # the record's best trial: the one every view names
    if best is not None:
        # its value of the study metric it is best by (`best_value`, the record's): val CIDEr unless the study
        # selects by another (train/loss, where the run may have no val CIDEr at that epoch: a None formatted)
        value = (f"{best.best_value:.1f} (x100)" if study.metric.startswith(("val/", "test/"))
                 else f"{best.best_value:.4g}")
        text += (f" Best single run: {best.name} ({best.fusion}) {metric_label(study.metric)} {value} at epoch "
                 f"{best.best_step}; configurations are compared over their seeds in the table below.")
    return text


def _printable(text: str) -> str:
    """`text` as UTF-8 can hold it: the bytes of a file name that are not UTF-8 (os.fsdecode's surrogates) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def build_report(study: Study, out_dir: str | os.PathLike) -> dict[str, str]:
    """Write the report's PNGs and `report.html` into `out_dir`. Returns {name: path}."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots, figures = {}, {}  # {key: PNG path}, {key: (section title, HTML)}
    for key, (file, plot, title, missing) in PLOTS.items():
        fig = plot(study.runs)
        if fig is None:
            figures[key] = (title, _missing(missing))
            continue
        plots[key] = out / file
        png = io.BytesIO()
        fig.savefig(png, format="png")
        atomic_write(plots[key], png.getvalue())  # a failed export leaves the last complete report, never half a file
        data = base64.b64encode(png.getvalue()).decode()
        figures[key] = (title, f"<img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")

    try:
        comparison, configs, _ = study_comparison(study, by="fusion")
        table = fusion_table_html(comparison, configs, study.mode, study.confirm_from)
        # with the note of rows still without verdicts, as `dashboards.compare.study_verdicts` (summary.json) has it
        verdicts = {**verdict_family(comparison, "fusion"), **({"note": comparison.note} if comparison.note else {})}
    except (DataError, StudyError) as e:
        # no comparison can be made (arms scored on different images, no run whose fusion resolves): the plots and
        # the runs still are a report; the table says why it is missing, and verdicts.json too, as `study_verdicts`
        table = _missing(f"No fusion table: {e}.")
        verdicts = {"by": "fusion", "error": str(e), "comparisons": []}
    sections = [("Fusion ablation (Table 3 layout)", table),
                figures["lambda"],
                ("A2 diagnostics per fusion", diagnostics_table_html(study.runs)),
                *(figures[key] for key in ("jsd", "kendall", "grounding", "curves", "parallel")),
                ("All runs", runs_table_html(study.runs, searched_keys(study.runs), study.metric, study.mode))]
    name = html.escape(study.name)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>a2 report: {name}</title>"
            f"<style>{_CSS}</style></head><body><h1>Study {name}</h1><p class='sub'>{html.escape(_summary(study))}"
            f"<br>Record: {html.escape(study.source)}</p>"
            + "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in sections) + "</body></html>")
    plots["verdicts"] = out / "verdicts.json"  # Table 3's verdicts, raw and Holm-adjusted, as data (MLflow too)
    atomic_write(plots["verdicts"], json.dumps(verdicts, indent=1))
    plots["html"] = out / "report.html"
    atomic_write(plots["html"], _printable(page))  # a record path need not be UTF-8 (POSIX names are bytes)
    return {key: str(path) for key, path in plots.items()}

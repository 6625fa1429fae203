"""`a2 report NAME`: plots and one HTML page from a study's MLflow runs, logged back to the study's parent run.

Sections (each says so when the study logged nothing for it, never fails):

- Table 3 layout: `a2 study compare NAME --by fusion`'s comparison (one function, `dashboards.stats.compare_arms`,
  computes both): per fusion its best configuration by mean val CIDEr over seeds (stopped-early ones only when
  nothing else ran), every score's mean with its 95% interval and the seeds, the difference to the baseline
  (fusion none) with its interval and a plain-words verdict; best mean per column in bold;
- Fig. 4 style: best val CIDEr against lambda (runs with a mask network only) with 95% error bars, the baseline as
  a horizontal band (mean and 95% interval), and the mean mask value (`train/mask_mean`) on a second y axis;
- Fig. 6 style: per-layer Jensen-Shannon divergence between original and aligned attention, bars per fusion;
- the A2 diagnostics every trial reports (`a2core.diagnostics`), as a table per fusion: grounding accuracy on
  synthetic data with its word-agnostic control, lift and chance, subject-vs-object score, Kendall tau of
  attention and mask against gradient importance, mask mean (`diag/...`, final values, mean ± std over runs);
- Kendall tau between attention / mask and gradient importance per layer (`diag/kendall/layer{i}/{attention,mask}`);
- grounding accuracy on synthetic data against its word-agnostic control and chance (`diag/grounding/...`);
- learning curves per trial (val CIDEr and train loss against the logged step, the epoch);
- a parallel-coordinates view of the search (searched params against best val CIDEr);
- every run with its status ("stopped early (rung r, cutoff c)" for a run the scheduler stopped).

A run's scores are taken at its best epoch (the step of its highest `val/CIDEr`); other metrics are final values.
Scores are on the x100 scale, as logged.
"""
from __future__ import annotations

import base64
import html
import math
import os
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a2core.config import inapplicable_model_keys
from dashboards.stats import best_candidates, is_stopped_early, stopped_early_text
from dashboards.tables import finite
from dashboards.tracking import TAG_FUSION, TAG_SEED, _client, default_tracking_uri, study_runs
from a2core.errors import TrackingError

CIDER = "val/CIDEr"
FUSION_ORDER = ["none", "max", "moving_average", "exp_decay", "gate"]
FUSION_LABEL = {"none": "none (baseline)", "max": "max", "moving_average": "moving average",
                "exp_decay": "exp. decay", "gate": "gate"}
TABLE_METRICS = [("B-1", "val/BLEU-1"), ("B-4", "val/BLEU-4"), ("METEOR", "val/METEOR"),
                 ("ROUGE-L", "val/ROUGE-L"), ("CIDEr", "val/CIDEr"), ("SPICE", "val/SPICE")]
LAMBDA_KEYS = ("model.lambda", "lambda", "model.mask_lambda")
FUSION_KEYS = ("model.fusion", "fusion")
SEED_KEYS = ("train.seed", "seed")
_JSD = re.compile(r"^diag/jsd/layer(\d+)$")
_KENDALL = re.compile(r"^diag/kendall/layer(\d+)/(attention|mask)$")
DIAG_COLUMNS = [("grounding acc.", "diag/grounding/accuracy"), ("word-agnostic control", "diag/grounding/control"),
                ("lift", "diag/grounding/lift"), ("chance", "diag/grounding/chance"),
                ("subject vs object", "diag/grounding/subject_object"), ("Kendall τ attention", "diag/kendall/attention"),
                ("Kendall τ mask", "diag/kendall/mask"), ("mask mean", "diag/mask_mean")]


# -- data ------------------------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    final: dict[str, float]                       # latest value of every metric
    at_best: dict[str, float] = field(default_factory=dict)   # table metrics at the best val/CIDEr step
    best_cider: float | None = None
    best_step: int | None = None
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def param(self, *keys: str) -> str | None:
        for k in keys:
            if k in self.params:
                return self.params[k]
        return None

    @property
    def fusion(self) -> str:
        return self.tags.get(TAG_FUSION) or self.param(*FUSION_KEYS) or "unknown"

    @property
    def seed(self) -> str | None:
        return self.tags.get(TAG_SEED) or self.param(*SEED_KEYS)

    @property
    def lam(self) -> float | None:
        """lambda, None for fusion none (no mask network: a run logged before keys became absent may carry one)."""
        return None if self.fusion == "none" else finite(self.param(*LAMBDA_KEYS))

    def score(self, metric: str) -> float | None:
        """A metric at the best epoch when known, else its final value."""
        value = self.at_best.get(metric, self.final.get(metric))
        return None if value is None or _isnan(value) else value


@dataclass
class Study:
    name: str
    tracking_uri: str
    parent: Any
    runs: list[RunSummary]

    @property
    def parent_run_id(self) -> str:
        return self.parent.info.run_id


def _isnan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def load_study(tracking_uri: str, study_name: str, histories: tuple[str, ...] = (CIDER, "train/loss"),
               experiment: str | None = None) -> Study:
    """Read the study's parent run and child runs; raises ValueError when the study has no runs."""
    parent, children = study_runs(tracking_uri, study_name, experiment=experiment)
    if parent is None:
        raise TrackingError(f"no MLflow runs of study {study_name!r} at {tracking_uri}")
    client = _client(tracking_uri)
    runs = []
    for run in children:
        rs = RunSummary(run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, status=run.info.status,
                        params=dict(run.data.params), tags=dict(run.data.tags), final=dict(run.data.metrics))
        for key in histories:
            if key in rs.final:
                hist = client.get_metric_history(rs.run_id, key)
                rs.history[key] = sorted((m.step, m.value) for m in hist)
        cider = [(s, v) for s, v in rs.history.get(CIDER, []) if not _isnan(v)]
        if cider:
            rs.best_step, rs.best_cider = max(cider, key=lambda sv: (sv[1], -sv[0]))
            for _, metric in TABLE_METRICS:
                if metric == CIDER:
                    rs.at_best[metric] = rs.best_cider
                elif metric in rs.final:
                    hist = {m.step: m.value for m in client.get_metric_history(rs.run_id, metric)}
                    if rs.best_step in hist:
                        rs.at_best[metric] = hist[rs.best_step]
        elif CIDER in rs.final and not _isnan(rs.final[CIDER]):
            rs.best_cider = rs.final[CIDER]
        runs.append(rs)
    return Study(study_name, tracking_uri, parent, runs)


# -- grouping shared with compare.py ---------------------------------------------------------------------------
def searched_keys(runs: list[RunSummary]) -> list[str]:
    """Params that vary across the runs (the searched ones), seed keys and per-run strings (paths) excluded."""
    keys: set[str] = set()
    for r in runs:
        keys.update(r.params)
    out = []
    for k in sorted(keys):
        if k in SEED_KEYS:
            continue
        values = [r.params.get(k) for r in runs]
        distinct = set(values)
        if len(distinct) <= 1:
            continue
        numeric = all(v is None or finite(v) is not None for v in values)
        if not numeric and len(runs) > 2 and len(distinct) == len(runs):
            continue  # a different string in every run: a path or a name, not a hyperparameter
        out.append(k)
    return out


@dataclass
class ConfigGroup:
    """Runs that differ only in their seed."""
    key: tuple
    runs: list[RunSummary]


def config_groups(runs: list[RunSummary], keys: list[str] | None = None) -> list[ConfigGroup]:
    keys = searched_keys(runs) if keys is None else keys
    groups: dict[tuple, list[RunSummary]] = {}
    for r in runs:
        groups.setdefault(tuple((k, r.params.get(k)) for k in keys), []).append(r)
    return [ConfigGroup(k, v) for k, v in groups.items()]


def group_value(run: RunSummary, by: str) -> str | None:
    """The value of `by` for a run: a param (exact or dotted suffix), an a2.<by> tag or a tag; None when `by` is a
    model key the run's fusion does not use (lambda of fusion none), whatever an older run logged."""
    if by.rsplit(".", 1)[-1] in inapplicable_model_keys(run.fusion):
        return None
    if by in run.params:
        return run.params[by]
    for k, v in sorted(run.params.items()):
        if k.endswith("." + by):
            return v
    return run.tags.get(f"a2.{by}") or run.tags.get(by)


def fusion_sort_key(value: str) -> tuple:
    return (FUSION_ORDER.index(value), "") if value in FUSION_ORDER else (len(FUSION_ORDER), str(value))


def fmt_mean_std(mean: float | None, std: float | None, digits: int = 1) -> str:
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


# -- table 3 ---------------------------------------------------------------------------------------------------
def fusion_table(study: Study):
    """`a2 study compare NAME --by fusion`'s comparison (`dashboards.compare.study_comparison`, which calls
    `dashboards.stats.compare_arms`): the same rows, intervals and differences as the command prints."""
    from dashboards.compare import study_comparison

    return study_comparison(study.tracking_uri, study.name, by="fusion", study=study)


def fusion_table_html(comparison, labelled: list) -> str:
    if not comparison.rows:
        return _missing("No run logged val/CIDEr, so there is no fusion table.")
    columns = [(label, m) for label, m in TABLE_METRICS if any(m in iv for _, iv in comparison.rows)]
    best = {m: max((iv[m].mean for _, iv in comparison.rows if m in iv), default=None) for _, m in columns}
    keys = searched_keys([r for _, g in labelled for r in g])
    body = []
    for (arm, intervals), (_, group) in zip(comparison.rows, labelled):
        cells = []
        for _, m in columns:
            iv = intervals.get(m)
            text = html.escape(iv.text() if iv else "–")
            is_best = iv is not None and math.isclose(iv.mean, best[m])
            cells.append(f"<td class='best'><b>{text}</b></td>" if is_best else f"<td>{text}</td>")
        diff = comparison.differences.get(arm.label)
        versus = "baseline" if arm.label == comparison.baseline else (diff.interval_text() if diff else "–")
        verdict = diff.verdict() if diff else ""
        config = ", ".join(f"{k}={group[0].params[k]}" for k in keys
                           if k in group[0].params and k not in FUSION_KEYS) or "–"
        body.append(f"<tr><th>{html.escape(FUSION_LABEL.get(arm.label, arm.label))}</th>"
                    f"<td class='n'>{len(arm.seeds)}</td>{''.join(cells)}<td>{html.escape(versus)}</td>"
                    f"<td class='l'>{html.escape(verdict)}</td><td class='cfg'>{html.escape(config)}</td></tr>")
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in columns)
    missing = [label for label, _ in TABLE_METRICS if label not in {c[0] for c in columns}]
    note = f"<p class='note'>Not logged: {', '.join(missing)}.</p>" if missing else ""
    return (f"<table class='t3'><thead><tr><th>fusion</th><th>seeds</th>{head}<th>CIDEr vs baseline</th>"
            f"<th>verdict</th><th>config</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p class='note'>Best configuration per fusion by mean val CIDEr over its seeds (configurations stopped "
            f"early only when nothing else ran); mean [95% CI] over seeds at each run's best epoch (no interval "
            f"below 3 seeds), scores x100; best mean per column in bold. The difference to the baseline is the "
            f"paired bootstrap over seeds and images when the runs logged per-image CIDEr-D, else Welch's t over "
            f"seed means (the numbers of `a2 study compare --by fusion`).</p>{note}")


# -- plots -----------------------------------------------------------------------------------------------------
def _figure(width=7.0, height=4.2):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig, path: Path) -> Path:
    fig.savefig(path)
    return path


def lambda_series(runs: list[RunSummary]):
    """The Fig. 4 numbers: {lambda: its runs} of runs with a mask network, {lambda: Interval} of their best val
    CIDEr, and the baseline's (fusion none) Interval or None; intervals from `dashboards.stats.compare_arms`."""
    from dashboards.stats import Arm, compare_arms

    by_lam: dict[float, list[RunSummary]] = {}
    for r in runs:
        if r.lam is not None and r.lam > 0 and r.best_cider is not None:
            by_lam.setdefault(r.lam, []).append(r)
    base = [r for r in runs if r.fusion == "none" and r.best_cider is not None]
    arms = [Arm(str(x), [{CIDER: r.best_cider} for r in by_lam[x]]) for x in sorted(by_lam)]
    arms += [Arm("none", [{CIDER: r.best_cider} for r in base])] if base else []
    intervals = {arm.label: iv[CIDER] for arm, iv in compare_arms(arms, metrics=[CIDER]).rows}
    return by_lam, {x: intervals[str(x)] for x in sorted(by_lam)}, intervals.get("none")


def plot_lambda(runs: list[RunSummary], path: Path) -> Path | None:
    """Best val CIDEr against lambda (runs with a mask network only): the mean over a lambda's runs with its 95%
    interval as error bars, the mean mask value on a second axis, and the baseline (fusion none: mean and 95%
    interval over its runs) as a horizontal band."""
    by_lam, points, baseline = lambda_series(runs)
    if not by_lam:
        return None
    lams = sorted(by_lam)
    cider = [points[x] for x in lams]
    err = [[0 if iv.low is None else iv.mean - iv.low for iv in cider],
           [0 if iv.high is None else iv.high - iv.mean for iv in cider]]
    fig = _figure()
    ax = fig.add_subplot()
    ax.scatter([r.lam for x in lams for r in by_lam[x]], [r.best_cider for x in lams for r in by_lam[x]], s=12,
               color="tab:blue", alpha=0.35)
    ax.errorbar(lams, [iv.mean for iv in cider], yerr=err, fmt="o-", color="tab:blue", capsize=3,
                label="val CIDEr (best epoch), mean and 95% CI")
    if baseline is not None:
        ax.axhline(baseline.mean, color="gray", lw=1, label=f"baseline (fusion none), {baseline.n} runs")
        if baseline.low is not None:
            ax.axhspan(baseline.low, baseline.high, color="gray", alpha=0.2, lw=0)
    ax.set_xscale("log")
    ax.set_xlabel("λ (mask regulariser)")
    ax.set_ylabel("val CIDEr (x100)", color="tab:blue")
    handles = ax.get_legend_handles_labels()[0]
    mask = {x: [m for r in by_lam[x] if (m := r.final.get("train/mask_mean")) is not None and not _isnan(m)]
            for x in lams}
    mask_l = [x for x in lams if mask[x]]
    if mask_l:
        ax2 = ax.twinx()
        ax2.plot(mask_l, [statistics.fmean(mask[x]) for x in mask_l], "s--", color="tab:red", label="mean mask value")
        ax2.set_ylabel("mean mask m", color="tab:red")
        handles += ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=8, frameon=False)
    ax.set_title("CIDEr and mask value against λ")
    return _save(fig, path)


def _layer_means(runs: list[RunSummary], pattern: re.Pattern, group_of) -> dict[str, dict[int, float]]:
    acc: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        for key, value in r.final.items():
            m = pattern.match(key)
            if m and not _isnan(value):
                group, layer = group_of(r, m)
                acc.setdefault(group, {}).setdefault(layer, []).append(value)
    return {g: {layer: statistics.fmean(v) for layer, v in d.items()} for g, d in acc.items()}


def _grouped_bars(ax, data: dict[str, dict[int, float]], order: list[str], labels: dict[str, str]):
    layers = sorted({layer for d in data.values() for layer in d})
    width = 0.8 / max(len(order), 1)
    for i, g in enumerate(order):
        xs = [layer + (i - (len(order) - 1) / 2) * width for layer in layers if layer in data[g]]
        ys = [data[g][layer] for layer in layers if layer in data[g]]
        ax.bar(xs, ys, width=width, label=labels.get(g, g))
    ax.set_xticks(layers, [str(layer + 1) for layer in layers])
    ax.set_xlabel("decoder layer")
    ax.legend(fontsize=8)


def plot_jsd(runs: list[RunSummary], path: Path) -> Path | None:
    data = _layer_means(runs, _JSD, lambda r, m: (r.fusion, int(m.group(1))))
    if not data:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    _grouped_bars(ax, data, sorted(data, key=fusion_sort_key), FUSION_LABEL)
    ax.set_ylabel("JSD(original ‖ aligned attention)")
    ax.set_title("Per-layer attention divergence (final epoch, mean over runs)")
    return _save(fig, path)


def plot_kendall(runs: list[RunSummary], path: Path) -> Path | None:
    data = _layer_means(runs, _KENDALL, lambda r, m: (m.group(2), int(m.group(1))))
    if not data:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    _grouped_bars(ax, data, [g for g in ("attention", "mask") if g in data],
                  {"attention": "attention weights", "mask": "mask (1 - m)"})
    ax.set_ylabel("Kendall τ vs gradient importance")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_title("Agreement with gradient-based importance")
    return _save(fig, path)


def plot_grounding(runs: list[RunSummary], path: Path) -> Path | None:
    """Bars per fusion: grounding accuracy, its word-agnostic control and uniform chance (mean over runs)."""
    keys = [("diag/grounding/accuracy", "attention (accuracy)"), ("diag/grounding/control", "word-agnostic control"),
            ("diag/grounding/chance", "uniform chance")]
    means = _diag_means(runs, [k for k, _ in keys])
    if not means:
        return None
    order = sorted(means, key=fusion_sort_key)
    fig = _figure()
    ax = fig.add_subplot()
    width = 0.8 / len(keys)
    for j, (key, label) in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i, g in enumerate(order) if key in means[g]]
        ys = [means[g][key][0] for g in order if key in means[g]]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks(range(len(order)), [FUSION_LABEL.get(g, g) for g in order])
    ax.set_xlim(-0.75, len(order) - 0.25)
    ax.set_ylabel("grounding accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Attention grounding on synthetic data (final epoch, mean over runs)")
    return _save(fig, path)


def _diag_means(runs: list[RunSummary], keys: list[str]) -> dict[str, dict[str, tuple[float, float | None, int]]]:
    """Per fusion, per key that some of its runs logged: (mean, std or None, runs) of the final values."""
    values: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for key in keys:
            v = r.final.get(key)
            if v is not None and not _isnan(v):
                values.setdefault(r.fusion, {}).setdefault(key, []).append(v)
    return {g: {k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else None, len(v)) for k, v in d.items()}
            for g, d in values.items()}


def diagnostics_table_html(runs: list[RunSummary]) -> str:
    """One row per fusion, a column per `DIAG_COLUMNS` metric some run logged (a metric that does not apply to
    a fusion, as the mask's to the baseline, is a dash)."""
    means = _diag_means(runs, [k for _, k in DIAG_COLUMNS])
    if not means:
        return _missing("No run logged diag/... metrics (the diagnostics every trial reports since they exist).")
    columns = [(label, k) for label, k in DIAG_COLUMNS if any(k in row for row in means.values())]
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in columns)
    body = []
    for fusion in sorted(means, key=fusion_sort_key):
        row = means[fusion]
        n = max(c[2] for c in row.values())
        cells = "".join(f"<td>{html.escape(fmt_mean_std(*row[k][:2], digits=2) if k in row else '–')}</td>"
                        for _, k in columns)
        body.append(f"<tr><th>{html.escape(FUSION_LABEL.get(fusion, fusion))}</th><td>{n}</td>{cells}</tr>")
    return (f"<table class='diag'><thead><tr><th>fusion</th><th>runs</th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table><p class='note'>Final epoch of every run, mean ± std over the "
            f"runs of a fusion. Grounding (synthetic data): how often the top attended region is the one the word "
            f"refers to; the control attends one region per caption, so lift = accuracy - control is what "
            f"word-level grounding adds.</p>")


def plot_curves(runs: list[RunSummary], path: Path) -> Path | None:
    from matplotlib.ticker import MaxNLocator

    keys = [(CIDER, "val CIDEr"), ("train/loss", "train loss")]
    if not any(r.history.get(k) for r in runs for k, _ in keys):
        return None
    fig = _figure(11, 4.2)
    axes = fig.subplots(1, 2)
    many = len(runs) > 12
    for ax, (key, label) in zip(axes, keys):
        for r in runs:
            hist = r.history.get(key)
            if hist:
                ax.plot([s for s, _ in hist], [v for _, v in hist], marker="" if many else ".",
                        lw=0.8 if many else 1.3, alpha=0.6 if many else 0.9, label=f"{r.name} ({r.fusion})")
        ax.set_xlabel("epoch (logged step)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.set_title(f"{label} per trial")
        if not many and ax.lines:
            ax.legend(fontsize=6)
    return _save(fig, path)


def plot_parallel(runs: list[RunSummary], path: Path) -> Path | None:
    runs = [r for r in runs if r.best_cider is not None]
    keys = searched_keys(runs)
    if not runs or not keys:
        return None
    import matplotlib as mpl

    axes_spec = []  # (label, positions in [0,1] per run, tick positions, tick labels)
    for k in keys + [CIDER]:
        raw = [r.best_cider if k == CIDER else r.params.get(k) for r in runs]
        nums = [finite(v) for v in raw]
        if all(n is not None for n in nums):
            vals = [float(n) for n in nums]  # type: ignore[arg-type]
            log = min(vals) > 0 and max(vals) / min(vals) > 20
            tv = [math.log10(v) for v in vals] if log else vals
            lo, hi = min(tv), max(tv)
            span = (hi - lo) or 1.0
            pos = [(v - lo) / span for v in tv]
            ticks = [(0.0, f"{min(vals):.3g}"), (1.0, f"{max(vals):.3g}")] if hi > lo else [(0.0, f"{vals[0]:.3g}")]
            label = f"{k} (log)" if log else k
        else:
            cats = sorted({str(v) for v in raw}, key=lambda c: fusion_sort_key(c))
            step = 1.0 / max(len(cats) - 1, 1)
            idx = {c: i * step for i, c in enumerate(cats)}
            pos = [idx[str(v)] for v in raw]
            ticks = [(idx[c], c) for c in cats]
            label = k
        axes_spec.append((label, pos, ticks))
    fig = _figure(max(6.0, 2.0 * len(axes_spec)), 4.5)
    ax = fig.add_subplot()
    cider = [r.best_cider for r in runs]
    norm = mpl.colors.Normalize(min(cider), max(cider) if max(cider) > min(cider) else min(cider) + 1e-9)
    cmap = mpl.colormaps["viridis"]
    xs = list(range(len(axes_spec)))
    for i, r in sorted(enumerate(runs), key=lambda ir: ir[1].best_cider):
        ax.plot(xs, [spec[1][i] for spec in axes_spec], color=cmap(norm(r.best_cider)), alpha=0.8, lw=1.2)
    for x, (label, _, ticks) in zip(xs, axes_spec):
        ax.axvline(x, color="black", lw=0.8)
        for y, text in ticks:
            ax.annotate(text, (x, y), xytext=(4, 0), textcoords="offset points", fontsize=7, va="center")
    ax.set_xticks(xs, [spec[0] for spec in axes_spec], fontsize=8)
    ax.set_yticks([])
    ax.set_xlim(-0.2, len(xs) - 0.6)
    ax.set_ylim(-0.05, 1.05)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="best val CIDEr")
    ax.set_title("Search: searched params against best val CIDEr")
    return _save(fig, path)


# -- the page --------------------------------------------------------------------------------------------------
def _missing(text: str) -> str:
    return f"<p class='missing'>{html.escape(text)}</p>"


def _img(path: Path | None, alt: str, missing: str) -> str:
    if path is None:
        return _missing(missing)
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
h1{margin-bottom:0} .sub{color:#666} img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse;margin:0.5em 0} th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
thead th{background:#f3f3f3} tbody th{text-align:left} td.cfg{text-align:left;font-size:85%;color:#555}
td.best{background:#eef7ee} .missing{color:#a60;font-style:italic} .note{color:#666;font-size:90%}
td.l{text-align:left}
"""


def run_state(run: RunSummary) -> str:
    """The run's MLflow status, or "stopped early (rung r, cutoff c)" for a run the scheduler stopped."""
    if is_stopped_early(run.tags):
        return stopped_early_text(run.tags)
    return run.status


def runs_table_html(runs: list[RunSummary], keys: list[str]) -> str:
    if not runs:
        return _missing("The study has no trial runs yet.")
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = []
    for r in sorted(runs, key=lambda r: -math.inf if r.best_cider is None else -r.best_cider):
        cells = "".join(f"<td>{html.escape(str(r.params.get(k, '')))}</td>" for k in keys)
        best = "–" if r.best_cider is None else f"{r.best_cider:.1f}"
        rows.append(f"<tr><td class='l'>{html.escape(r.name)}</td><td class='l'>{html.escape(run_state(r))}</td>"
                    f"<td>{html.escape(r.seed or '')}</td>{cells}<td>{best}</td>"
                    f"<td>{'' if r.best_step is None else r.best_step}</td></tr>")
    return (f"<table><thead><tr><th>run</th><th>status</th><th>seed</th>{head}<th>best val CIDEr</th>"
            f"<th>best epoch</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def build_report(tracking_uri: str | None, study_name: str, out_dir: str | os.PathLike | None = None,
                 log_to_mlflow: bool = True) -> dict[str, str]:
    """Write the report's PNGs and `report.html` into `out_dir` (a new temporary directory when None) and log
    them as artifacts of the study's parent run under `report/`. Returns {name: path} plus "artifact_uri"."""
    tracking_uri = tracking_uri or default_tracking_uri()
    study = load_study(tracking_uri, study_name)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix=f"a2-report-{study_name}-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = study.runs

    plots = {
        "lambda": plot_lambda(runs, out / "lambda_cider_mask.png"),
        "jsd": plot_jsd(runs, out / "jsd_per_layer.png"),
        "kendall": plot_kendall(runs, out / "kendall_tau.png"),
        "grounding": plot_grounding(runs, out / "grounding.png"),
        "curves": plot_curves(runs, out / "learning_curves.png"),
        "parallel": plot_parallel(runs, out / "parallel_coordinates.png"),
    }
    comparison, labelled, _ = fusion_table(study)
    keys = searched_keys(runs)
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    scored = best_candidates([r for r in runs if r.best_cider is not None])
    best = max(scored, key=lambda r: r.best_cider, default=None)
    summary = (f"{len(runs)} trial runs ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items())) or 'none'}"
               f"{f', {stopped} stopped early' if (stopped := sum(is_stopped_early(r.tags) for r in runs)) else ''}"
               f"); parent run {study.parent_run_id} is {study.parent.info.status}.")
    if best is not None:
        summary += (f" Best single run: {best.name} ({best.fusion}) val CIDEr {best.best_cider:.1f} (x100) at epoch "
                    f"{best.best_step}; configurations are compared over their seeds in the table below.")
    name = html.escape(study_name)
    sections = [
        ("Fusion ablation (Table 3 layout)", fusion_table_html(comparison, labelled)),
        ("CIDEr and mask value against λ (Fig. 4 style)",
         _img(plots["lambda"], "CIDEr and mask vs lambda",
              "No run logged both a lambda param (model.lambda) and val/CIDEr.")),
        ("A2 diagnostics per fusion", diagnostics_table_html(runs)),
        ("Per-layer JSD between original and aligned attention (Fig. 6 style)",
         _img(plots["jsd"], "JSD per layer", "No run logged diag/jsd/layer{i}.")),
        ("Kendall τ of attention and mask against gradient importance",
         _img(plots["kendall"], "Kendall tau", "No run logged diag/kendall/layer{i}/attention or "
              "diag/kendall/layer{i}/mask.")),
        ("Grounding accuracy (synthetic data)",
         _img(plots["grounding"], "grounding accuracy", "No run logged diag/grounding/accuracy (grounding is "
              "scored on data with ground-truth regions, the synthetic dataset).")),
        ("Learning curves", _img(plots["curves"], "learning curves", "No run logged val/CIDEr or train/loss.")),
        ("Search (parallel coordinates)",
         _img(plots["parallel"], "parallel coordinates", "No searched params vary across runs with val/CIDEr.")),
        ("All runs", runs_table_html(runs, keys)),
    ]
    body = "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in sections)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>a2 report: {name}</title>"
            f"<style>{_CSS}</style></head><body><h1>Study {name}</h1>"
            f"<p class='sub'>{html.escape(summary)}<br>Tracking: {html.escape(tracking_uri)}</p>{body}</body></html>")
    html_path = out / "report.html"
    html_path.write_text(page, encoding="utf-8")

    paths = {k: str(v) for k, v in plots.items() if v is not None}
    paths["html"] = str(html_path)
    if log_to_mlflow:
        client = _client(tracking_uri)
        for p in [html_path] + [Path(v) for v in plots.values() if v is not None]:
            client.log_artifact(study.parent_run_id, str(p), "report")
        paths["artifact_uri"] = f"{study.parent.info.artifact_uri.rstrip('/')}/report"
    return paths


DEFAULT_OUT = "a2-reports"


def main(args) -> int:
    """`a2 report NAME [--tracking-uri URI] [--out DIR]`: into DIR (default `./a2-reports/NAME`), or a new numbered
    folder next to it when it holds an earlier report."""
    from a2core.atomic import fresh_folder
    from dashboards.tracking import check_tracking_uri

    uri = getattr(args, "tracking_uri", None) or default_tracking_uri()
    check_tracking_uri(uri)
    out = fresh_folder(Path(getattr(args, "out", None) or Path(DEFAULT_OUT) / args.name), ("report.html",), "report")
    paths = build_report(uri, args.name, out)
    print(f"report of study {args.name}:")
    for key, value in paths.items():
        print(f"  {key}: {value}")
    return 0

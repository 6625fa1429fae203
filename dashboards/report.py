"""`a2 report NAME`: plots and one HTML page from a study's MLflow runs, logged back to the study's parent run.

Sections (each says so when the study logged nothing for it, never fails):

- Table 3 layout: captioning scores per fusion (best config per fusion, mean ± std over seeds, best per column
  in bold);
- Fig. 4 style: best val CIDEr and the mean mask value (`train/mask_mean`) against lambda, log x axis, two y axes;
- Fig. 6 style: per-layer Jensen-Shannon divergence between original and aligned attention, bars per fusion;
- the A2 diagnostics every trial reports (`a2core.diagnostics`), as a table per fusion: grounding accuracy on
  synthetic data with its word-agnostic control, lift and chance, subject-vs-object score, Kendall tau of
  attention and mask against gradient importance, mask mean (`diag/...`, final values, mean ± std over runs);
- Kendall tau between attention / mask and gradient importance per layer (`diag/kendall/layer{i}/{attention,mask}`);
- grounding accuracy on synthetic data against its word-agnostic control and chance (`diag/grounding/...`);
- learning curves per trial (val CIDEr and train loss against the logged step, the epoch);
- a parallel-coordinates view of the search (searched params against best val CIDEr);
- every run with its status.

A run's scores are taken at its best epoch (the step of its highest `val/CIDEr`); other metrics are final values.
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
        return finite(self.param(*LAMBDA_KEYS))

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

    def values(self, metric: str) -> list[float]:
        out = []
        for r in self.runs:
            v = r.best_cider if metric == CIDER else r.score(metric)
            if v is not None:
                out.append(v)
        return out

    def mean(self, metric: str) -> float | None:
        vals = self.values(metric)
        return statistics.fmean(vals) if vals else None

    def std(self, metric: str) -> float | None:
        vals = self.values(metric)
        return statistics.stdev(vals) if len(vals) > 1 else None

    @property
    def seeds(self) -> list[str]:
        return sorted({r.seed for r in self.runs if r.seed is not None}, key=lambda s: (len(s), s))

    @property
    def best_run(self) -> RunSummary:
        return max(self.runs, key=lambda r: -math.inf if r.best_cider is None else r.best_cider)


def config_groups(runs: list[RunSummary], keys: list[str] | None = None) -> list[ConfigGroup]:
    keys = searched_keys(runs) if keys is None else keys
    groups: dict[tuple, list[RunSummary]] = {}
    for r in runs:
        groups.setdefault(tuple((k, r.params.get(k)) for k in keys), []).append(r)
    return [ConfigGroup(k, v) for k, v in groups.items()]


def best_group(groups: list[ConfigGroup]) -> ConfigGroup | None:
    scored = [g for g in groups if g.mean(CIDER) is not None]
    return max(scored, key=lambda g: g.mean(CIDER)) if scored else None


def group_value(run: RunSummary, by: str) -> str | None:
    """The value of `by` for a run: a param (exact or dotted suffix), an a2.<by> tag or a tag."""
    if by in run.params:
        return run.params[by]
    for k, v in sorted(run.params.items()):
        if k.endswith("." + by):
            return v
    return run.tags.get(f"a2.{by}") or run.tags.get(by)


def fusion_sort_key(value: str) -> tuple:
    return (FUSION_ORDER.index(value), "") if value in FUSION_ORDER else (len(FUSION_ORDER), str(value))


def score_scale(values: list[float]) -> float:
    """100 when scores look like fractions (pycocoevalcap's scale), so tables read like the paper's."""
    vals = [v for v in values if v is not None]
    return 100.0 if vals and max(abs(v) for v in vals) <= 5.0 else 1.0


def fmt_mean_std(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if mean is None:
        return "–"
    text = f"{mean * scale:.{digits}f}"
    if std is not None:
        text += f" ± {std * scale:.{digits}f}"
    return text


# -- table 3 ---------------------------------------------------------------------------------------------------
def fusion_table(runs: list[RunSummary]) -> dict:
    """Rows per fusion (best config of that fusion, mean/std over its seeds) and the columns present."""
    keys = searched_keys(runs)
    by_fusion: dict[str, list[RunSummary]] = {}
    for r in runs:
        by_fusion.setdefault(r.fusion, []).append(r)
    columns = [(label, m) for label, m in TABLE_METRICS if any(r.score(m) is not None for r in runs)]
    rows = []
    for fusion in sorted(by_fusion, key=fusion_sort_key):
        group = best_group(config_groups(by_fusion[fusion], [k for k in keys if k not in FUSION_KEYS]))
        if group is None:
            continue
        rows.append({"fusion": fusion, "group": group,
                     "cells": {m: (group.mean(m), group.std(m)) for _, m in columns}})
    best = {}
    for _, m in columns:
        means = [row["cells"][m][0] for row in rows if row["cells"][m][0] is not None]
        best[m] = max(means) if means else None
    scale = score_scale([row["cells"][m][0] for row in rows for _, m in columns])
    return {"columns": columns, "rows": rows, "best": best, "scale": scale}


def fusion_table_html(table: dict) -> str:
    if not table["rows"]:
        return _missing("No run logged val/CIDEr, so there is no fusion table.")
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in table["columns"])
    body = []
    for row in table["rows"]:
        g = row["group"]
        cells = []
        for _, m in table["columns"]:
            mean, std = row["cells"][m]
            text = html.escape(fmt_mean_std(mean, std, table["scale"]))
            is_best = mean is not None and table["best"][m] is not None and math.isclose(mean, table["best"][m])
            cells.append(f"<td class='best'><b>{text}</b></td>" if is_best else f"<td>{text}</td>")
        config = ", ".join(f"{k}={v}" for k, v in g.key if k not in FUSION_KEYS) or "–"
        body.append(f"<tr><th>{html.escape(FUSION_LABEL.get(row['fusion'], row['fusion']))}</th>"
                    f"<td class='n'>{len(g.runs)}</td>{''.join(cells)}<td class='cfg'>{html.escape(config)}</td></tr>")
    missing = [label for label, _ in TABLE_METRICS if label not in {c[0] for c in table["columns"]}]
    note = f"<p class='note'>Not logged: {', '.join(missing)}.</p>" if missing else ""
    scale = " Scores ×100." if table["scale"] == 100.0 else ""
    return (f"<table class='t3'><thead><tr><th>fusion</th><th>seeds</th>{head}<th>config</th></tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
            f"<p class='note'>Best config per fusion (by mean val CIDEr); mean ± std over seeds at each run's best "
            f"epoch; best per column in bold.{scale}</p>{note}")


# -- plots -----------------------------------------------------------------------------------------------------
def _figure(width=7.0, height=4.2):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig, path: Path) -> Path:
    fig.savefig(path)
    return path


def plot_lambda(runs: list[RunSummary], path: Path) -> Path | None:
    pts = [(r.lam, r.best_cider, r.final.get("train/mask_mean")) for r in runs
           if r.lam is not None and r.lam > 0 and r.best_cider is not None]
    if not pts:
        return None
    by_lam: dict[float, list] = {}
    for lam, cider, mask in pts:
        by_lam.setdefault(lam, []).append((cider, mask))
    lams = sorted(by_lam)
    cider = [statistics.fmean(c for c, _ in by_lam[x]) for x in lams]
    fig = _figure()
    ax = fig.add_subplot()
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color="tab:blue", alpha=0.35)
    ax.plot(lams, cider, "o-", color="tab:blue", label="val CIDEr (best epoch)")
    ax.set_xscale("log")
    ax.set_xlabel("λ (mask regulariser)")
    ax.set_ylabel("val CIDEr", color="tab:blue")
    handles = ax.get_legend_handles_labels()[0]
    mask_l = [x for x in lams if any(m is not None and not _isnan(m) for _, m in by_lam[x])]
    if mask_l:
        mask = [statistics.fmean(m for _, m in by_lam[x] if m is not None and not _isnan(m)) for x in mask_l]
        ax2 = ax.twinx()
        ax2.plot(mask_l, mask, "s--", color="tab:red", label="mean mask value")
        ax2.set_ylabel("mean mask m", color="tab:red")
        handles += ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
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


def runs_table_html(runs: list[RunSummary], keys: list[str]) -> str:
    if not runs:
        return _missing("The study has no trial runs yet.")
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = []
    for r in sorted(runs, key=lambda r: -math.inf if r.best_cider is None else -r.best_cider):
        cells = "".join(f"<td>{html.escape(str(r.params.get(k, '')))}</td>" for k in keys)
        best = "–" if r.best_cider is None else f"{r.best_cider:.4g}"
        rows.append(f"<tr><td class='l'>{html.escape(r.name)}</td><td class='l'>{html.escape(r.status)}</td>"
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
    table = fusion_table(runs)
    keys = searched_keys(runs)
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    best = max((r for r in runs if r.best_cider is not None), key=lambda r: r.best_cider, default=None)
    summary = (f"{len(runs)} trial runs ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items())) or 'none'}); "
               f"parent run {study.parent_run_id} is {study.parent.info.status}.")
    if best is not None:
        summary += f" Best: {best.name} ({best.fusion}) val CIDEr {best.best_cider:.4g} at epoch {best.best_step}."
    name = html.escape(study_name)
    sections = [
        ("Fusion ablation (Table 3 layout)", fusion_table_html(table)),
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

"""`a2 study compare NAME [--by fusion]`: a text table of a study's best runs from MLflow.

With `by` (a param such as `fusion` / `model.fusion`, or a tag): one row per value of it, the best config in that
group (by mean best val CIDEr over its seeds) with mean ± std over seeds. Without: the best configs overall.
"""
from __future__ import annotations

import math

from dashboards.report import (CIDER, TABLE_METRICS, ConfigGroup, config_groups, fmt_mean_std, fusion_sort_key,
                               group_value, load_study, score_scale, searched_keys)
from dashboards.tables import text_table
from dashboards.tracking import default_tracking_uri


def best_groups(tracking_uri: str, study_name: str, by: str | None = "fusion", top: int = 10):
    """[(group value or rank, ConfigGroup)] best first within the layout described in the module doc."""
    study = load_study(tracking_uri, study_name)
    runs = [r for r in study.runs if r.best_cider is not None]
    keys = searched_keys(runs)
    if by:
        buckets: dict[str, list] = {}
        for r in runs:
            buckets.setdefault(str(group_value(r, by)), []).append(r)
        out = []
        for value in sorted(buckets, key=fusion_sort_key):
            groups = config_groups(buckets[value], keys)
            best = max(groups, key=lambda g: g.mean(CIDER))
            out.append((value, best))
        return out, keys, runs
    groups = sorted(config_groups(runs, keys), key=lambda g: -g.mean(CIDER))
    return [(str(i + 1), g) for i, g in enumerate(groups[:top])], keys, runs


def compare_table(tracking_uri: str | None, study_name: str, by: str | None = "fusion", top: int = 10) -> str:
    """The comparison as a plain-text table (see the module doc)."""
    tracking_uri = tracking_uri or default_tracking_uri()
    rows_in, keys, runs = best_groups(tracking_uri, study_name, by, top)
    if not rows_in:
        return f"study {study_name}: no run has logged {CIDER} yet"
    metrics = [(label, m) for label, m in TABLE_METRICS if any(r.score(m) is not None for r in runs)]
    scale = score_scale([g.mean(m) for _, g in rows_in for _, m in metrics])
    best_mean = {m: max((g.mean(m) for _, g in rows_in if g.mean(m) is not None), default=None) for _, m in metrics}
    header = [by or "rank", "best run"] + [label for label, _ in metrics] + ["seeds", "config"]
    rows = []
    for value, g in rows_in:
        cells = [value, g.best_run.name]
        for _, m in metrics:
            mean = g.mean(m)
            text = fmt_mean_std(mean, g.std(m), scale)
            if mean is not None and best_mean[m] is not None and math.isclose(mean, best_mean[m]) and len(rows_in) > 1:
                text += " *"
            cells.append(text)
        cells.append(str(len(g.runs)))
        cells.append(", ".join(f"{k}={v}" for k, v in g.key if v is not None and (not by or not k.endswith(by))))
        rows.append(cells)
    note = "scores x100; " if scale == 100.0 else ""
    return (f"study {study_name}: {len(runs)} runs with {CIDER}; best config per "
            f"{by or 'rank'} by mean best val CIDEr over seeds ({note}* = best in column)\n" + text_table(header, rows, right=set(range(2, len(header) - 1))))


def main(args) -> int:
    """Entry for `a2 study compare NAME [--by KEY] [--tracking-uri URI]`: prints the table."""
    from dashboards.tracking import check_tracking_uri

    uri = getattr(args, "tracking_uri", None) or default_tracking_uri()
    check_tracking_uri(uri)
    print(compare_table(uri, args.name, getattr(args, "by", "fusion")))
    return 0


__all__ = ["compare_table", "main", "best_groups", "ConfigGroup"]

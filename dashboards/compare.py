"""`a2 study compare NAME [--by fusion]`: a study's configurations side by side, from MLflow, with intervals.

Runs are grouped into configurations by their `a2.config_hash` tag (the replicate group; runs logged without it are
grouped by the params that vary across the study, seed excluded). With `by` (a param such as `fusion`, `lambda`,
`model.lambda`, or a tag) there is one row per value of it: the best configuration with that value, by mean best
val CIDEr over its seeds, among configurations not stopped early (`dashboards.stats.best_candidates`). Runs without
`by` are left out (`--by lambda` ignores fusion `none`, which has no mask network). Each row shows every metric's
seed mean with its 95% interval, the number of seeds, and the difference in val CIDEr to the baseline (the best
`fusion none` configuration) with its interval and verdict. The numbers come from `dashboards.stats.compare_arms`.

A difference is the paired bootstrap over seeds and test images when both runs logged their per-image CIDEr-D as
the artifact `PER_IMAGE_ARTIFACT` (`{image_id: score}`, x100), else Welch's t over seed means. Scores are shown as
logged (x100).
"""
from __future__ import annotations

import json

import numpy as np

from dashboards.report import (CIDER, TABLE_METRICS, RunSummary, config_groups, fusion_sort_key, group_value,
                               load_study, searched_keys)
from dashboards.tables import text_table
from dashboards.stats import TAG_CONFIG_HASH, Arm, Comparison, best_candidates, compare_arms, is_stopped_early
from dashboards.tracking import _client, default_tracking_uri

BASELINE = "none"
PER_IMAGE_ARTIFACT = "eval/per_image_cider.json"


def configurations(runs: list[RunSummary]) -> list[list[RunSummary]]:
    """Runs grouped by replicate group (config hash tag, else the searched params without the seed)."""
    tagged = [r for r in runs if TAG_CONFIG_HASH in r.tags]
    by_hash: dict[str, list[RunSummary]] = {}
    for r in tagged:
        by_hash.setdefault(r.tags[TAG_CONFIG_HASH], []).append(r)
    untagged = [r for r in runs if TAG_CONFIG_HASH not in r.tags]
    return list(by_hash.values()) + ([g.runs for g in config_groups(untagged)] if untagged else [])


def _mean_cider(group: list[RunSummary]) -> float:
    return float(np.mean([r.best_cider for r in group]))


def _group_tags(group: list[RunSummary]) -> dict:
    """A group counts as stopped early when any of its replicates was (the scheduler stops whole groups)."""
    return next((r.tags for r in group if is_stopped_early(r.tags)), {})


def _best(groups: list[list[RunSummary]]) -> list[RunSummary]:
    return max(best_candidates(groups, tags_of=_group_tags), key=_mean_cider)


def _per_image(tracking_uri: str, group: list[RunSummary]) -> np.ndarray | None:
    """(seeds, images) per-image CIDEr-D of a group, when every run logged it for the same images."""
    client = _client(tracking_uri)
    rows, ids = [], None
    for r in group:
        try:
            path = client.download_artifacts(r.run_id, PER_IMAGE_ARTIFACT)
        except Exception:  # noqa: BLE001 - not logged by this run: the comparison falls back to seed means
            return None
        with open(path) as f:
            scores = json.load(f)
        if ids is None:
            ids = sorted(scores)
        if sorted(scores) != ids:
            return None
        rows.append([float(scores[i]) for i in ids])
    return np.asarray(rows) if rows else None


def _arm(tracking_uri: str, label: str, group: list[RunSummary], metrics: list[str]) -> Arm:
    seeds = []
    for r in group:
        values = {m: (r.best_cider if m == CIDER else r.score(m)) for m in metrics}
        seeds.append({m: v for m, v in values.items() if v is not None})
    return Arm(label, seeds, _per_image(tracking_uri, group))


def study_comparison(tracking_uri: str, study_name: str, by: str = "fusion",
                     study=None) -> tuple[Comparison, list, int]:
    """(the comparison, the table's (label, group) rows, number of runs with val CIDEr); `study`: the study
    already loaded (`dashboards.report.load_study`), else it is read from MLflow."""
    study = study or load_study(tracking_uri, study_name)
    runs = [r for r in study.runs if r.best_cider is not None]
    metrics = [m for _, m in TABLE_METRICS if any(r.score(m) is not None for r in runs)]
    buckets: dict[str, list[RunSummary]] = {}
    for r in runs:
        value = group_value(r, by)
        if value is not None:
            buckets.setdefault(str(value), []).append(r)
    rows = [(value, _best(configurations(buckets[value]))) for value in sorted(buckets, key=_sort_key)]
    base_runs = [r for r in runs if r.fusion == BASELINE]
    base = _best(configurations(base_runs)) if base_runs else None
    labelled = list(rows)
    base_label = None
    if base is not None:
        ids = {r.run_id for r in base}
        base_label = next((value for value, group in rows if {r.run_id for r in group} == ids), None)
        if base_label is None:  # rows of another key (--by lambda): the baseline is a reference row
            base_label = f"fusion={BASELINE}"
            labelled.append((base_label, base))
    arms = [_arm(tracking_uri, label, group, metrics) for label, group in labelled]
    return compare_arms(arms, baseline=base_label, metric=CIDER, metrics=metrics), labelled, len(runs)


def _sort_key(value: str):
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, *fusion_sort_key(value))


def compare_table(tracking_uri: str | None, study_name: str, by: str = "fusion") -> str:
    """The comparison as plain text: the table, then one verdict per row against the baseline."""
    tracking_uri = tracking_uri or default_tracking_uri()
    comparison, labelled, n_runs = study_comparison(tracking_uri, study_name, by)
    if not comparison.rows:
        return f"study {study_name}: no run has logged {CIDER} and {by} yet"
    metrics = [m for _, m in TABLE_METRICS if any(m in iv for _, iv in comparison.rows)]
    labels = {m: label for label, m in TABLE_METRICS}
    header = [by] + [labels[m] + " [95% CI]" for m in metrics] + ["seeds", "vs baseline (CIDEr)", "config"]
    table = []
    for (arm, intervals), (_, group) in zip(comparison.rows, labelled):
        diff = comparison.differences.get(arm.label)
        name = arm.label + (" (baseline)" if arm.label == comparison.baseline else "")
        cells = [name] + [intervals[m].text() if m in intervals else "-" for m in metrics]
        cells.append(str(len(arm.seeds)))
        cells.append(diff.interval_text() if diff else "-")
        keys = searched_keys([r for _, g in labelled for r in g])
        cells.append(", ".join(f"{k}={group[0].params[k]}" for k in keys
                               if k in group[0].params and not k.endswith(by)))
        table.append(cells)
    out = [f"study {study_name}: {n_runs} runs with {CIDER}; per {by} the best configuration by mean best val CIDEr "
           f"over its seeds (early-stopped ones only when nothing else ran); mean [95% CI] over seeds",
           text_table(header, table, right=set(range(1, len(header) - 1)))]
    out += comparison.verdicts()
    return "\n".join(out)


def compare(name: str, by: str = "fusion", tracking_uri: str | None = None) -> str:
    return compare_table(tracking_uri, name, by)


def main(args) -> int:
    """Entry for `a2 study compare NAME [--by KEY] [--tracking-uri URI]`: prints the table."""
    from dashboards.tracking import check_tracking_uri

    uri = getattr(args, "tracking_uri", None) or default_tracking_uri()
    check_tracking_uri(uri)
    print(compare_table(uri, args.name, getattr(args, "by", "fusion") or "fusion"))
    return 0


__all__ = ["compare_table", "compare", "main", "study_comparison", "configurations", "PER_IMAGE_ARTIFACT"]

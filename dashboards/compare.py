"""`a2 study compare NAME [--by KEY] [--baseline VALUE]`: a study's configurations side by side, from MLflow.

One row per value of `by` (a param such as `fusion` or `model.lambda`, or a tag; runs without it are left out): its
best configuration by mean best val CIDEr over seeds, each metric's seed mean with its 95% interval, and the
difference in val CIDEr to the baseline row (paired bootstrap over `PER_IMAGE_ARTIFACT` when both logged it, else
Welch's t).
"""
from __future__ import annotations

import json
import numpy as np
from mlflow.tracking import MlflowClient

from a2core.errors import DataError, StudyError
from dashboards.report import CIDER, TABLE_METRICS, RunSummary, group_value, load_study, searched_keys, sort_key
from dashboards.stats import TAG_CONFIG_HASH, Arm, Comparison, best_group, compare_arms, is_stopped_early
from dashboards.tables import text_table
from dashboards.tracking import check_tracking_uri, default_tracking_uri

BASELINE = "none"
PER_IMAGE_ARTIFACT = "eval/per_image_cider.json"  # the best val epoch's per-image CIDEr-D
TEST_PER_IMAGE_ARTIFACT = "eval/test_per_image_cider.json"  # the selected checkpoint's, on the test split
TEST_CIDER = "test/CIDEr"


def configurations(runs: list[RunSummary]) -> list[list[RunSummary]]:
    """Runs grouped by replicate group (config hash tag, else the searched params without the seed)."""
    keys = searched_keys([r for r in runs if TAG_CONFIG_HASH not in r.tags])
    groups: dict = {}
    for r in runs:
        groups.setdefault(r.tags.get(TAG_CONFIG_HASH) or tuple(r.params.get(k) for k in keys), []).append(r)
    return list(groups.values())


def _best(groups: list[list[RunSummary]]) -> list[RunSummary]:
    """The group with the best mean (`dashboards.stats.best_group`); a group counts as stopped early when any of
    its replicates was."""
    return best_group(groups, lambda group: [r.best_cider for r in group], "max",
                      lambda group: any(is_stopped_early(r.tags) for r in group))


def _per_image(client: MlflowClient, group: list[RunSummary],
               artifact: str = PER_IMAGE_ARTIFACT) -> tuple[np.ndarray, list[str]] | tuple[None, None]:
    """((seeds, images) per-image CIDEr-D of a group, the image ids of its columns) when every run logged it; the
    runs of one group scored on different images are an error naming them."""
    rows, ids, first = [], None, None
    for r in group:
        try:
            path = client.download_artifacts(r.run_id, artifact)
        except Exception:  # noqa: BLE001 - not logged by this run: the comparison falls back to seed means
            return None, None
        with open(path) as f:
            scores = json.load(f)
        if ids is None:
            ids, first = sorted(scores), r
        if sorted(scores) != ids:
            only = sorted(set(scores) ^ set(ids))[:5]
            raise DataError(f"runs {first.run_id} and {r.run_id} of one configuration logged {artifact} "
                            f"for different images ({len(ids)} and {len(scores)} images; in one only: {only})")
        rows.append([float(scores[i]) for i in ids])
    return (np.asarray(rows), ids) if rows else (None, None)


def study_comparison(tracking_uri: str, study_name: str, by: str = "fusion", study=None,
                     baseline: str | None = None) -> tuple[Comparison, dict[str, str], int]:
    """(the comparison, each row's config text, number of runs with val CIDEr). `study`: the study already loaded
    (`dashboards.report.load_study`), else it is read from MLflow; `baseline`: the value of `by` whose row the
    others are compared with, else the best fusion none configuration."""
    study = study or load_study(tracking_uri, study_name)
    runs = [r for r in study.runs if r.best_cider is not None]
    metrics = [m for _, m in TABLE_METRICS if any(r.score(m) is not None for r in runs)]
    buckets: dict[str, list[RunSummary]] = {}
    for r in runs:
        value = group_value(r, by)
        if value is not None:
            buckets.setdefault(str(value), []).append(r)
    labelled = {value: _best(configurations(buckets[value])) for value in sorted(buckets, key=sort_key)}
    if baseline is not None and baseline not in labelled:
        raise StudyError(f"--baseline {baseline}: no run of study {study_name} with val/CIDEr has {by}={baseline} "
                         f"(it has {', '.join(labelled) or 'none'})")
    base_runs = [r for r in runs if r.fusion == BASELINE]
    if baseline is None and base_runs:
        base = _best(configurations(base_runs))
        ids = {r.run_id for r in base}
        baseline = next((value for value, group in labelled.items() if {r.run_id for r in group} == ids), None)
        if baseline is None:  # rows of another key (--by lambda): the baseline is a reference row
            baseline = f"fusion={BASELINE}"
            labelled[baseline] = base
    # Rows are selected on the val images; their differences rest on the test split (each run's selected
    # checkpoint decoded with beam search when it ended) when every chosen run has it, else on val.
    on_test = bool(labelled) and all(r.score(TEST_CIDER) is not None for g in labelled.values() for r in g)
    if on_test:
        metrics = [*metrics, TEST_CIDER]
    client = MlflowClient(tracking_uri=tracking_uri)
    artifact = TEST_PER_IMAGE_ARTIFACT if on_test else PER_IMAGE_ARTIFACT
    arms = [Arm(label, [r.scores(metrics) for r in group], *_per_image(client, group, artifact),
                seed_ids=[r.seed for r in group])
            for label, group in labelled.items()]
    # per row, the searched params of its configuration other than `by` ("model.lambda=0.1, ...")
    keys = [k for k in searched_keys([r for group in labelled.values() for r in group]) if not k.endswith(by)]
    configs = {label: ", ".join(f"{k}={group[0].params[k]}" for k in keys if k in group[0].params)
               for label, group in labelled.items()}
    comparison = compare_arms(arms, baseline=baseline, metric=TEST_CIDER if on_test else CIDER, metrics=metrics,
                              label="test CIDEr" if on_test else None)
    return comparison, configs, len(runs)


def shown_metrics(comparison: Comparison) -> list[tuple[str, str]]:
    """(label, metric) of the table metrics that some row logged."""
    return [(label, m) for label, m in [*TABLE_METRICS, ("test CIDEr", TEST_CIDER)]
            if any(m in intervals for _, intervals in comparison.rows)]


def compare_table(tracking_uri: str, study_name: str, by: str = "fusion", baseline: str | None = None) -> str:
    """The comparison as plain text: the table, then one verdict per row against the baseline."""
    comparison, configs, n_runs = study_comparison(tracking_uri, study_name, by, baseline=baseline)
    if not comparison.rows:
        return f"study {study_name}: no run has logged {CIDER} and {by} yet"
    columns = shown_metrics(comparison)
    split = "test" if comparison.metric == TEST_CIDER else "val"
    header = [by, *(f"{label} [95% CI]" for label, _ in columns), "seeds", f"vs baseline ({split} CIDEr)", "config"]
    table = []
    for arm, intervals in comparison.rows:
        diff = comparison.differences.get(arm.label)
        table.append([arm.label + (" (baseline)" if arm.label == comparison.baseline else ""),
                      *(intervals[m].text() if m in intervals else "-" for _, m in columns),
                      str(len(arm.seeds)), diff.interval_text() if diff else "-", configs[arm.label]])
    return "\n".join([
        f"study {study_name}: {n_runs} runs with {CIDER}; per {by} the best configuration by mean best val CIDEr "
        f"over its seeds (early-stopped ones only when nothing else ran); mean [95% CI] over seeds; differences "
        f"and verdicts on the {split} images"
        + (" (each run's selected checkpoint, beam search)" if split == "test" else
           " (the images the rows were selected on: no run logged test scores)"),
        text_table(header, table, right=set(range(1, len(header) - 1))), *comparison.verdicts()])


def main(args) -> int:
    """Entry for `a2 study compare NAME [--by KEY] [--baseline VALUE] [--tracking-uri URI]`: prints the table."""
    from dashboards.tracking import still_running_note

    uri = check_tracking_uri(args.tracking_uri or default_tracking_uri())
    print(compare_table(uri, args.name, args.by, args.baseline))
    note = still_running_note(uri, args.name, "comparison")
    if note:
        print(note)
    return 0

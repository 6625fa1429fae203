"""`a2 study compare NAME [--by KEY] [--baseline VALUE]`: a study's configurations side by side, from its record
(`launch.record` hands it over as a `dashboards.runs.Study`).

One row per value of `by` (a param such as `fusion` or `model.lambda`, or a tag; runs without it are left out): its
best configuration by mean best val CIDEr over seeds (the selection, on the val images), then the numbers of the
held-out test split (each run's selected checkpoint decoded with beam search when it ended): each metric's seed mean
with its 95% interval and the difference in test CIDEr to the baseline row (from the runs' per-image test CIDEr-D
paired by image id when both have it: the interval from the difference's variance components over seeds and
images, `dashboards.stats.difference_intervals`; else Welch's t, Student's for unequal seeds), its own p, and,
with two or more rows against the baseline, its Holm-adjusted interval and p: the verdicts are one family
(`dashboards.stats.adjust_family`). Only the selection column is on val. A comparison
some of whose runs have no test scores (stopped early, or `train.test_at_end: false`) is on val throughout, and its
header says so.
"""
from __future__ import annotations

import math

import numpy as np

from a2core.errors import DataError, StudyError
from a2core.selection import finite
from dashboards.runs import (CIDER, TABLE_METRICS, TEST_CIDER, TEST_TABLE_METRICS, Study, Trial,
                             group_value, selection_column, searched_keys, seed_number, sort_key)
from dashboards.stats import Arm, Comparison, adjust_family, best_group, compare_arms, p_text, pooled_differences
from dashboards.tables import text_table

BASELINE = "none"


def configurations(runs: list[Trial]) -> list[list[Trial]]:
    """Runs grouped by replicate group (their config hash), each group in seed order, so that the same study
    lists its runs (and the records it exports) in the same order whichever of its trials finished first."""
    groups: dict = {}
    for r in runs:
        groups.setdefault(r.config_hash, []).append(r)

    def seed_order(r: Trial) -> tuple:  # by number; no seed last
        n = seed_number(r.seed)
        return (1, str(r.seed), r.trial_id) if n is None else (0, n, r.trial_id)

    return [sorted(g, key=seed_order) for g in groups.values()]


def best_configuration(groups: list[list[Trial]], mode: str) -> list[Trial]:
    """The group with the best mean of its runs' best values in the study's mode (`dashboards.stats.best_group`, the
    rule the record's best group follows; a group counts as stopped early when any of its replicates was)."""
    return best_group(groups, lambda group: [r.best_value for r in group], mode,
                      lambda group: any(r.stopped_early for r in group))


def per_image_scores(group: list[Trial], split: str = "val") -> tuple[np.ndarray, list[str]] | tuple[None, None]:
    """((seeds, images) per-image CIDEr-D of a group on `split`, the image ids of its columns) when every run has
    them for 2 or more images (the paired rule measures the images' variance: one image has none, and the comparison
    is on seed means); the runs of one group scored on different images, and a per-image file that is no
    {image id: number}, are errors naming them."""
    rows, ids, first = [], None, None
    for r in group:
        scores = r.per_image(split)
        if scores is None:  # not written by this run: the comparison falls back to seed means
            return None, None
        if not isinstance(scores, dict):
            raise DataError(f"trial {r.trial_id}: its per-image {split} CIDEr is a JSON {type(scores).__name__}, not "
                            f"{{image id: score}}")
        # NaN and Infinity parse as JSON numbers: an infinite mean, never a verdict (as a record's are refused)
        bad = next((i for i, v in scores.items()
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)), None)
        if bad is not None:
            raise DataError(f"trial {r.trial_id}: its per-image {split} CIDEr of image {bad} is {scores[bad]!r:.40}, "
                            f"not a finite number")
        if len(scores) < 2:
            return None, None
        if ids is None:
            ids, first = sorted(scores), r
        if sorted(scores) != ids:
            only = sorted(set(scores) ^ set(ids))[:5]
            raise DataError(f"trials {first.trial_id} and {r.trial_id} of one configuration have per-image {split} "
                            f"CIDEr of different images ({len(ids)} and {len(scores)} images; in one only: {only})")
        rows.append([float(scores[i]) for i in ids])
    return (np.asarray(rows), ids) if rows else (None, None)


def chosen_configuration(runs: list[Trial], study: Study) -> tuple[list[Trial], bool]:
    """(the runs a row shows of `runs`' best configuration, whether they are its confirmation seeds). Without
    confirmation seeds (`study.confirm_from` None) the best group (`best_configuration`) whole. With them, the
    group is chosen on its seeds below `confirm_from`, and the row is its seeds from `confirm_from` on, which the
    choice never saw: a seed that lifted a configuration on val lifts it on test too, so a verdict on the seeds it
    was chosen by leans its way (docs/explanation/statistics.md, "Confirmation seeds"). Before those seeds have run,
    the row is the seeds it was chosen on (False)."""
    first, groups = study.confirm_from, configurations(runs)
    if first is None:
        return best_configuration(groups, study.mode), False
    fresh = {r.trial_id for r in runs if (n := seed_number(r.seed)) is not None and n >= first}
    best = best_configuration([kept for g in groups if (kept := [r for r in g if r.trial_id not in fresh])],
                              study.mode)
    if not best:
        return best, False
    confirmed = [r for r in next(g for g in groups if g[0].config_hash == best[0].config_hash) if r.trial_id in fresh]
    return (confirmed, True) if confirmed else (best, False)


def cell_text(interval, seeds: int) -> str:
    """A table cell: the interval's text ("-" without one), saying over how many of the row's `seeds` it is when
    some did not report the metric (the seeds column counts them all)."""
    if interval is None:
        return "-"
    return interval.text() + (f" ({interval.n} of {seeds} seeds)" if interval.n < seeds else "")


def baseline_rows(value: str, labels: list[str]) -> list[str]:
    """The row labels `value` names: the label itself, else the labels equal to it as a number when both are numbers
    (`--baseline 0.10` names the row 0.1, `1e-2` the row 0.01: rows are labelled by the value's text as logged)."""
    value = str(value)
    if value in labels:
        return [value]
    number = finite(value)
    return [] if number is None else [label for label in labels if finite(label) == number]


def study_comparison(study: Study, by: str = "fusion",
                     baseline: str | None = None) -> tuple[Comparison, dict[str, str], int]:
    """(the comparison, each row's config text, number of runs with val CIDEr). `baseline`: the value of `by`
    whose row the others are compared with, else the best fusion none configuration. With confirmation seeds
    (`study.confirm_from`) each row is its chosen configuration's confirmation seeds (`chosen_configuration`), and
    there are no verdicts until every row has them (`Comparison.note` says so)."""
    runs = [r for r in study.runs if r.best_value is not None]
    keys = {k for r in runs for k in r.params}
    if by not in keys and len(ends := sorted(k for k in keys if k.endswith("." + by))) > 1:
        # `group_value` takes the first of them: `--by seed` would group by data.seed, not the trials' train.seed
        raise StudyError(f"--by {by}: ambiguous in study {study.name}: the end of {', '.join(ends)}; name one of them")
    buckets: dict[str, list[Trial]] = {}
    for r in runs:
        value = group_value(r, by)
        if value is not None:
            buckets.setdefault(str(value), []).append(r)
    if runs and not buckets:  # a mistyped key: its table would be the baseline alone
        known = ", ".join(k.rsplit(".", 1)[-1] for k in searched_keys(runs)) or "none"
        raise StudyError(f"--by {by}: no run of study {study.name} has {by} (its searched keys: {known})")
    picks = {value: chosen_configuration(buckets[value], study) for value in sorted(buckets, key=sort_key)}
    labelled = {value: group for value, (group, _) in picks.items()}
    if baseline is not None:
        named = baseline_rows(baseline, list(labelled))
        if len(named) != 1:  # none, or one number logged as two texts (0.1 and 0.10): name the rows there are
            raise StudyError(f"--baseline {baseline}: " + (
                f"no run of study {study.name} with {study.metric} has {by}={baseline}" if not named else
                f"{by}={baseline} is several rows of study {study.name} as a number ({', '.join(named)}): name one")
                + f" (it has {', '.join(labelled) or 'none'})")
        baseline = named[0]
    base_runs = [r for r in runs if r.fusion == BASELINE]
    if baseline is None and base_runs:
        base, confirmed = chosen_configuration(base_runs, study)
        ids = {r.trial_id for r in base}
        baseline = next((value for value, group in labelled.items() if {r.trial_id for r in group} == ids), None)
        if baseline is None:  # rows of another key (--by lambda): the baseline is a reference row
            baseline = f"fusion={BASELINE}"
            labelled[baseline], picks[baseline] = base, (base, confirmed)
    # Rows are selected on the val images; their differences rest on the test split (each run's selected
    # checkpoint decoded with beam search when it ended) when every chosen run has it, else on val.
    chosen = [r for g in labelled.values() for r in g]
    on_test = bool(chosen) and all(r.score(TEST_CIDER) is not None for r in chosen)
    metrics = [m for _, m in split_columns(on_test, study.metric) if any(r.score(m) is not None for r in chosen)]
    arms = [Arm(label, [r.scores(metrics) for r in group], *per_image_scores(group, "test" if on_test else "val"),
                seed_ids=[r.seed for r in group], trial_ids=[r.trial_id for r in group])
            for label, group in labelled.items()]
    # per row, the searched params of its configuration other than `by` ("model.lambda=0.1, ...")
    # (`by` itself, or the key it is the dotted end of: `--by images` is data.images, never data.val_images)
    keys = [k for k in searched_keys(chosen) if k != by and not k.endswith("." + by)]
    configs = {label: ", ".join(f"{k}={group[0].params[k]}" for k in keys if k in group[0].params)
               for label, group in labelled.items()}
    options = dict(metric=TEST_CIDER if on_test else CIDER, metrics=metrics,
                   label="test CIDEr" if on_test else "val CIDEr")
    pending = [label for label in labelled if not picks[label][1]] if study.confirm_from is not None else []
    if not pending:
        comparison = compare_arms(arms, baseline=baseline, **options)
        comparison.selected_by = study.metric
        if study.confirm_from is not None:  # every row the same fresh seeds: one seed variance, pooled over them
            comparison.differences = adjust_family(pooled_differences(comparison))
        return comparison, configs, len(runs)
    # a row without its confirmation seeds (still to run) has no verdict; the family is the rows that have them
    comparison = compare_arms(arms, **options)
    comparison.baseline, comparison.selected_by = baseline, study.metric
    if baseline not in pending:
        confirmed = compare_arms([a for a in arms if a.label not in pending], baseline=baseline, **options)
        comparison.differences = adjust_family(pooled_differences(confirmed))
    one, comparison.pending = len(pending) == 1, tuple(pending)
    comparison.note = (f"no verdict for {', '.join(pending)}: no confirmation seeds (from seed {study.confirm_from}) "
                       f"have run for {'its chosen configuration' if one else 'their chosen configurations'} yet, so "
                       f"{'its row shows the seeds it was' if one else 'their rows show the seeds they were'} chosen on"
                       + ("; the baseline's among them: no verdicts yet" if baseline in pending else ""))
    return comparison, configs, len(runs)


def split_columns(on_test: bool, selected_by: str = CIDER) -> list[tuple[str, str]]:
    """(heading, metric) of a comparison's interval columns, each heading naming its split: on the test split, the
    test metrics and then the study metric the rows were selected by (`selection_column`, on val); else the val
    metrics, and the study metric as the selection column when it is not one of them."""
    if on_test:
        return [*((f"test {label}", m) for label, m in TEST_TABLE_METRICS), selection_column(selected_by)]
    columns = [(f"val {label}", m) for label, m in TABLE_METRICS]
    return columns if any(m == selected_by for _, m in columns) else [*columns, selection_column(selected_by)]


def shown_metrics(comparison: Comparison) -> list[tuple[str, str]]:
    """(heading, metric) of the columns of `split_columns` for the comparison's split that some row logged."""
    return [(label, m) for label, m in split_columns(comparison.metric == TEST_CIDER, comparison.selected_by)
            if any(m in intervals for _, intervals in comparison.rows)]


def compare_table(study: Study, by: str = "fusion", baseline: str | None = None) -> str:
    """The comparison as plain text: the table, then one verdict per row against the baseline."""
    comparison, configs, n_runs = study_comparison(study, by, baseline=baseline)
    if not comparison.rows:
        return f"study {study.name}: no run has logged {CIDER} and {by} yet"
    columns = shown_metrics(comparison)
    split = "test" if comparison.metric == TEST_CIDER else "val"
    family = max((d.family for d in comparison.differences.values()), default=1)
    header = [by, *(f"{label} [95% CI]" for label, _ in columns), "seeds", f"vs baseline ({split} CIDEr)", "p",
              *([f"Holm over {family} [CI], p"] if family > 1 else []), "config"]
    table = []
    for arm, intervals in comparison.rows:
        diff = comparison.differences.get(arm.label)
        table.append([arm.label + (" (baseline)" if arm.label == comparison.baseline else ""),
                      *(cell_text(intervals.get(m), len(arm.seeds)) for _, m in columns),
                      str(len(arm.seeds)), diff.interval_text() if diff else "-", p_text(diff.p if diff else None),
                      *([family_text(diff)] if family > 1 else []), configs[arm.label]])
    return "\n".join([
        f"study {study.name}: {n_runs} runs with {study.metric}; per {by} the best configuration by mean best "
        f"{'val CIDEr' if study.metric == CIDER else study.metric} "
        f"over its seeds (early-stopped ones only when nothing else ran); mean [95% CI] over seeds; "
        + ("every column but the selection column (val) is on the test split, differences and verdicts too (each "
           "run's selected checkpoint decoded with beam search when it ended)" if split == "test" else
           "every number is on the val images the rows were selected on (not every chosen run logged test "
           "scores), so the verdicts are not held-out ones"),
        *([f"confirmation seeds: each row's configuration was chosen on its seeds below {study.confirm_from}; "
           f"its numbers and its verdict are its seeds from {study.confirm_from} on, which the choice never saw"]
          if study.confirm_from is not None and not comparison.note else []),
        text_table(header, table, right=set(range(1, len(header) - 1))),
        *([family_note(family)] if family > 1 else []), *comparison.verdicts(),
        *([comparison.note] if comparison.note else [])])


def family_text(diff) -> str:
    """A comparison's Holm-adjusted interval and p ("[+0.8, +5.4], 0.004"), "-" where it has none."""
    if diff is None or not diff.adjusted:
        return "-"
    return f"[{diff.low_adjusted:+.1f}, {diff.high_adjusted:+.1f}], {p_text(diff.p_adjusted)}"


def family_note(family: int) -> str:
    """What the Holm column means, one line."""
    return (f"the {family} comparisons with the baseline are one family: a verdict is Holm's (step-down, family-wise "
            f"error <= 5% however they correlate); `p` is a comparison's own, the Holm column its adjusted p and "
            f"its interval at the confidence Holm tested it at (docs/explanation/statistics.md)")


def verdict_family(comparison: Comparison, by: str) -> dict:
    """The comparison's family of verdicts as plain data (summary.json, the report's `verdicts.json`): per comparison
    with the baseline the difference, its own 95% interval and p, the family's size, its Holm-adjusted p and
    interval, the verdict."""
    return {"by": by, "baseline": comparison.baseline, "metric": comparison.metric, "comparisons": [
        {"arm": label, "baseline": d.b, "metric": comparison.metric, "delta": d.delta, "low": d.low, "high": d.high,
         "p": d.p, "se": d.se, "df": d.df, "seeds": [d.seeds_a, d.seeds_b], "images": d.images, "family": d.family,
         "p_adjusted": d.p_adjusted, "low_adjusted": d.low_adjusted, "high_adjusted": d.high_adjusted,
         "resolved": d.resolved if d.low is not None else None, "verdict": d.verdict()}
        for label, d in comparison.differences.items()]}


def study_verdicts(study: Study, by: str = "fusion") -> dict:
    """The study's family of verdicts, `compare --by fusion`'s (each fusion's best configuration against the best
    fusion none one, Holm over them): what `a2 study status` prints of a group against the baseline, so that the two
    commands read one rule. {"error": ...} where the comparison cannot be made (arms on different images)."""
    try:
        comparison, _, _ = study_comparison(study, by)
    except (DataError, StudyError) as e:
        return {"by": by, "error": str(e), "comparisons": []}
    return {**verdict_family(comparison, by), **({"note": comparison.note} if comparison.note else {})}

"""Study records: the results a table in the README or the docs is printed from, kept in the repository
(`results/*.json`), so that every published table regenerates from stored scores with today's code.

The record format (version 1), one small JSON file per table:

    {"record": "a2tune-study-record", "version": 1,
     "study": "a2-mask-nets",                      # the study the scores come from
     "spec": "studies/mask_nets.yaml",             # its study file (and overrides, if any, in "note")
     "split": "test",                              # the images the verdicts are on: "test" (held out) or "val"
     "by": "mask_net",                             # what the rows differ in
     "metric": "test/CIDEr", "mode": "max",        # the metric the differences and verdicts are of
     "baseline": "content",                        # the row every other row is compared with (or null)
     "columns": [["test CIDEr", "test/CIDEr"],     # [heading, metric] of the interval columns, in order; a heading
                 ["val CIDEr (selection)", "val/CIDEr"], ...],  # names its split, and a val column of a record
                                                   # on the test split is the selection criterion, labelled so
     "pooled": true,                               # optional: every row the same fresh seeds (confirmation seeds),
                                                   # the differences on the seed variance pooled over the rows
     "measured": "2026-11-24, 2 cores, 24 GiB, no GPU",
     "note": "...",                                # free text: overrides, data set version
     "arms": [{"label": "content", "config": "fusion=gate, lambda=0.035",
               "seeds": [0, 1, 2],                 # the replicate seeds, one per entry of each list below
               "scores": {"val/CIDEr": [91.1, ...], "diag/grounding/lift": [...]},   # per seed
               "per_image": {"image_ids": ["101", ...], "scores": [[...], ...]}}]}   # (seeds, images) of `metric`,
                                                                                       # optional
`render_table` prints a record as a markdown table through `dashboards.stats.compare_arms` (the rule every
comparison uses); `check_markdown` finds each table in a markdown file after its marker line
`<!-- results: results/NAME.json -->` and says which ones differ from what today's code prints (tests/test_records.py
runs it over the README and docs/). `export_record` writes a record from a study's comparison
(`a2 results export NAME --by KEY --out results/NAME.json [--storage ROOT]` reads the study's storage; `a2 results
show results/NAME.json` prints one).
"""
from __future__ import annotations

import json
import math
import numbers
import re
from collections import Counter
from itertools import dropwhile, takewhile
from pathlib import Path
from typing import Mapping

from a2core.atomic import atomic_write
from a2core.errors import DataError
from a2core.selection import finite
from dashboards.compare import cell_text, p_text, shown_metrics, study_comparison
from dashboards.runs import CIDER, TEST_CIDER
from dashboards.stats import Arm, adjust_family, compare_arms, pooled_differences
from dashboards.tables import markdown_cell

FORMAT = "a2tune-study-record"
VERSION = 1
MARKER = re.compile(r"^<!-- results: (\S+) -->\s*$")


def load_record(path: str | Path) -> dict:
    """A record file, checked: its format and version, and one score per seed in every list, each a finite number
    within `SCORE_BOUND`."""
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no such record file (`a2 results export NAME --out FILE` writes one)") from None
    except IsADirectoryError:
        raise DataError(f"{path}: a folder, not a record file (`a2 results export NAME --out FILE` writes "
                        f"one)") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not a JSON record file ({err})") from None
    except RecursionError:
        raise DataError(f"{path}: not a JSON record file (nested too deep to read)") from None
    if not isinstance(record, dict) or record.get("record") != FORMAT or record.get("version") != VERSION:
        raise DataError(f"{path}: not an {FORMAT} version {VERSION} file")
    _check_shape(path, record)
    if not record["arms"]:
        raise DataError(f"{path}: 'arms' is empty: a record has one arm per row of its table")
    if record.get("split") not in ("test", "val"):
        raise DataError(f"{path}: 'split' must be \"test\" or \"val\" (the images the verdicts are on), got "
                        f"{record.get('split')!r:.40}")
    labels = [arm["label"] for arm in record["arms"]]
    if duplicated := sorted({label for label in labels if labels.count(label) > 1}):  # rows keyed by label
        raise DataError(f"{path}: arms labelled {', '.join(map(repr, duplicated))} more than once: each arm's label "
                        f"must be its own")
    if record.get("mode", "max") not in ("max", "min"):
        raise DataError(f"{path}: 'mode' must be \"max\" or \"min\", got {record['mode']!r:.40}")
    if not isinstance(record.get("pooled", False), bool):
        raise DataError(f"{path}: 'pooled' must be true or false, got {record['pooled']!r:.40}")
    if not any(record["metric"] in arm["scores"] for arm in record["arms"]):
        known = sorted({m for arm in record["arms"] for m in arm["scores"]})
        raise DataError(f"{path}: 'metric' {record['metric']!r} is a score of no arm (their scores: "
                        f"{', '.join(known) or 'none'})")
    baseline = record.get("baseline")
    if baseline is not None and baseline not in labels:  # else every row's difference is a dash
        raise DataError(f"{path}: 'baseline' {baseline!r} is not the label of an arm: null or one of "
                        f"{', '.join(map(repr, labels))}")
    base_ids = next((set(map(str, arm["per_image"]["image_ids"])) for arm in record["arms"]
                     if arm["label"] == baseline and arm.get("per_image")), None)
    for arm in record["arms"]:
        n = len(arm["seeds"])
        if n == 0:
            raise DataError(f"{path}: arm {arm['label']}: no seeds (an arm is one or more seeds' scores)")
        if len(set(arm["seeds"])) != n:
            twice = sorted({s for s in arm["seeds"] if arm["seeds"].count(s) > 1})
            raise DataError(f"{path}: arm {arm['label']}: seed {', '.join(map(str, twice))} listed twice: one entry "
                            f"per seed")
        if arm.get("per_image"):
            ids = [str(i) for i in arm["per_image"]["image_ids"]]
            if len(set(ids)) != len(ids):  # counted once (a COCO record lists 5,000 ids an arm)
                twice = sorted(i for i, count in Counter(ids).items() if count > 1)[:5]
                raise DataError(f"{path}: arm {arm['label']}: per-image image id {', '.join(twice)} appears twice")
            if base_ids is not None and set(ids) != base_ids:  # paired with the baseline's images by id
                only = sorted(set(ids) ^ base_ids)[:5]
                raise DataError(f"{path}: arm {arm['label']}: per-image scores of other images than the baseline "
                                f"{baseline}'s ({len(ids)} and {len(base_ids)} images; in one only: {only})")
        for metric, values in arm["scores"].items():
            if len(values) != n:
                raise DataError(f"{path}: arm {arm['label']}: {len(values)} values of {metric} for {n} seeds")
        if arm.get("per_image") and len(arm["per_image"]["scores"]) != n:
            raise DataError(f"{path}: arm {arm['label']}: per-image scores of {len(arm['per_image']['scores'])} "
                            f"seeds for {n} seeds")
    split = record.get("split")
    if _split(record["metric"]) not in (None, split):
        raise DataError(f"{path}: the verdicts are of {record['metric']}, not on the record's split {split!r}")
    for heading, metric in record["columns"]:
        on = _split(metric)
        if on is not None and not heading.startswith(f"{on} "):
            raise DataError(f"{path}: column {heading!r} ({metric}) does not say its split: start it with {on!r}")
        if on == "val" and split == "test" and "(selection)" not in heading:
            raise DataError(f"{path}: column {heading!r} ({metric}) is on val in a record on the test split: only "
                            f"the selection criterion may be, labelled '(selection)'")
    return record


# The keys every record has, with their JSON types: a file edited by hand or cut short is named with the key it lacks
# before anything indexes it (a KeyError would be a traceback from `a2 results show`).
RECORD_KEYS = {"by": str, "metric": str, "columns": list, "arms": list}
ARM_KEYS = {"label": str, "seeds": list, "scores": dict}


def _check_shape(path: str | Path, record: dict) -> None:
    def need(obj: dict, keys: dict, where: str) -> None:
        for key, kind in keys.items():
            if key not in obj:
                raise DataError(f"{path}: {where}missing key {key!r}")
            if not isinstance(obj[key], kind):
                raise DataError(f"{path}: {where}{key!r} must be a JSON {_JSON_NAME[kind]}, "
                                f"got {type(obj[key]).__name__}")

    need(record, RECORD_KEYS, "")
    for i, column in enumerate(record["columns"]):
        if not (isinstance(column, list) and len(column) == 2 and all(isinstance(c, str) for c in column)):
            raise DataError(f"{path}: columns[{i}] must be [heading, metric], got {column!r}")
    for i, arm in enumerate(record["arms"]):
        if not isinstance(arm, dict):
            raise DataError(f"{path}: arms[{i}] must be a JSON object, got {type(arm).__name__}")
        need(arm, ARM_KEYS, f"arms[{i}]: ")
        for j, seed in enumerate(arm["seeds"]):
            if not (isinstance(seed, int) and not isinstance(seed, bool)):
                raise DataError(f"{path}: arms[{i}].seeds[{j}]: must be an integer seed, got {seed!r:.40}")
        for metric, values in arm["scores"].items():
            if not isinstance(values, list) or not all(v is None or _is_number(v) for v in values):
                raise DataError(f"{path}: arm {arm['label']}: scores of {metric} must be a list of numbers (null: "
                                f"not measured), one per seed")
            for j, value in enumerate(values):  # NaN parses as a number: a '+nan' mean would reach the table
                if value is not None and not math.isfinite(value):
                    raise DataError(f"{path}: arms[{i}].scores.{metric}[{j}]: must be a finite number (null: not "
                                    f"measured), got {value!r}")
                if value is not None and abs(value) > SCORE_BOUND:
                    raise DataError(f"{path}: arm {arm['label']}, seed {_seed_at(arm, j)}: {metric} {value!r} is "
                                    f"beyond {SCORE_BOUND:,.0f} in magnitude: no x100 score (a corrupt value?)")
        per_image = arm.get("per_image")
        if per_image:
            ids, rows = (per_image.get(k) if isinstance(per_image, dict) else None for k in ("image_ids", "scores"))
            if not (isinstance(ids, list) and isinstance(rows, list)
                    and all(isinstance(r, list) and len(r) == len(ids) and all(map(_is_number, r)) for r in rows)):
                raise DataError(f"{path}: arms[{i}].per_image: must be {{image_ids: [...], scores: [[...] per "
                                f"seed]}}, a number for every image id in every seed's list")
            for j, row in enumerate(rows):  # NaN and Infinity parse as JSON numbers: a score, never a verdict
                for k, value in enumerate(row):
                    if not math.isfinite(value):
                        raise DataError(f"{path}: arms[{i}].per_image.scores[{j}][{k}]: must be a finite number, "
                                        f"got {value!r}")
                    if abs(value) > SCORE_BOUND:
                        raise DataError(f"{path}: arm {arm['label']}, seed {_seed_at(arm, j)}: per-image score of "
                                        f"image {ids[k]} {value!r} is beyond {SCORE_BOUND:,.0f} in magnitude: no "
                                        f"x100 score (a corrupt value?)")
            if len(ids) < 2:  # the paired rule estimates the images' variance: one image has none (ValueError)
                raise DataError(f"{path}: arms[{i}].per_image: scores of {len(ids)} image{'s' if len(ids) != 1 else ''}"
                                f": a paired comparison needs 2 or more images (leave per_image out: seed means "
                                f"only)")


_JSON_NAME = {str: "string", list: "list", dict: "object"}

# The largest magnitude a record's number may have. Scores are on the x100 scale (a run's CIDEr-D is a few hundred at
# most, an image's up to 1,000; BLEU, ROUGE, METEOR, grounding and diagnostics far less), so anything beyond is a
# corrupt value, never a score; and squared in a variance, a value near 1e154 or above overflows to an infinite
# interval ("[-inf, inf]") that would be printed as a verdict.
SCORE_BOUND = 1e6


def _seed_at(arm: dict, j: int):
    """The seed of an arm's j-th score ("#j" where the arm lists fewer seeds: refused later, by count)."""
    return arm["seeds"][j] if j < len(arm["seeds"]) else f"#{j}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _split(metric: str) -> str | None:
    """The split a metric is on ("val/CIDEr" -> "val", "test/BLEU-4" -> "test"), None for other metrics."""
    prefix = metric.split("/", 1)[0]
    return prefix if prefix in ("val", "test") else None


def arms_of(record: Mapping) -> list[Arm]:
    """The record's rows as `dashboards.stats.Arm`s (one dict of metrics per seed, per-image scores by image id)."""
    out = []
    for arm in record["arms"]:
        seeds = [{metric: values[i] for metric, values in arm["scores"].items() if values[i] is not None}
                 for i in range(len(arm["seeds"]))]
        per_image = arm.get("per_image") or {}
        out.append(Arm(arm["label"], seeds, per_image.get("scores"), per_image.get("image_ids")))
    return out


def _seeds_text(seeds: list) -> str:
    ints = sorted(int(s) for s in seeds)
    if len(ints) > 2 and ints == list(range(ints[0], ints[-1] + 1)):
        # "0-3"; a negative first seed as "-1 to 1", since "-1-1" reads as one seed or a subtraction
        return f"{ints[0]}{' to ' if ints[0] < 0 else '-'}{ints[-1]}"
    return ", ".join(map(str, ints))


def render_table(record: Mapping) -> str:
    """The record as a markdown table: per row its seeds, each column's mean [95% CI] over seeds, and the
    difference in `metric` to the baseline with its own p, and its Holm-adjusted interval and p where several rows
    are compared with the baseline (one family, `dashboards.stats.adjust_family`), and the verdict, as `compare_arms`
    prints it today."""
    metric = record["metric"]
    columns = [tuple(c) for c in record["columns"]]
    comparison = compare_arms(arms_of(record), baseline=record.get("baseline"), metric=metric,
                              mode=record.get("mode", "max"), metrics=[m for _, m in columns])
    if record.get("pooled"):  # as `a2 study compare` judges a study's confirmation seeds
        comparison.differences = adjust_family(pooled_differences(comparison))
    short = metric.rsplit("/", 1)[-1]
    head = [record["by"], "seeds", *(heading for heading, _ in columns)]
    if record.get("baseline") is not None:  # "test CIDEr vs none [95% CI], p; Holm: verdict": the verdict's split too
        holm = "; Holm-adjusted [CI], p" if any(d.adjusted for d in comparison.differences.values()) else ""
        head.append(f"{metric.replace('/', ' ')} vs {record['baseline']} [95% CI], p{holm}: verdict")
    lines = [_markdown_row(head), "|" + "---|" * len(head)]
    stored = {arm["label"]: arm for arm in record["arms"]}
    for arm, intervals in comparison.rows:
        cells = [arm.label, _seeds_text(stored[arm.label]["seeds"]),
                 *(cell_text(intervals.get(m), len(arm.seeds)) for _, m in columns)]
        if record.get("baseline") is not None:
            diff = comparison.differences.get(arm.label)
            if arm.label == record["baseline"]:
                cells.append("(baseline)")
            elif diff is None:
                cells.append("-")
            elif diff.low is None:
                cells.append(f"{diff.delta:+.1f}: no verdict ({diff.no_verdict_reason()})")
            else:
                word = "resolved" if diff.resolved else "not resolved"
                raw = f"{diff.interval_text().replace(f' {short}', '')}, p {p_text(diff.p)}"
                family = (f"; Holm over {diff.family} [{diff.low_adjusted:+.1f}, {diff.high_adjusted:+.1f}], "
                          f"p {p_text(diff.p_adjusted)}" if diff.adjusted else "")
                cells.append(f"{raw}{family}: {word}")
        lines.append(_markdown_row(cells))
    return "\n".join(lines)


def _markdown_row(cells: list) -> str:
    """One row of a markdown table, each cell escaped (`dashboards.tables.markdown_cell`: a label with a `|`)."""
    return "| " + " | ".join(map(markdown_cell, cells)) + " |"


def tables_in(markdown: str) -> list[tuple[str, str]]:
    """(record path, the table that follows its marker line) for each `<!-- results: PATH -->` in a markdown text."""
    lines = [line.strip() for line in markdown.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if match := MARKER.match(line):  # the table: the first run of "|" lines after the marker
            rest = dropwhile(lambda row: not row.startswith("|"), lines[i + 1:])
            found.append((match.group(1), "\n".join(takewhile(lambda row: row.startswith("|"), rest))))
    return found


def check_markdown(path: str | Path, root: str | Path) -> list[str]:
    """The differences between each marked table of a markdown file and what `render_table` prints from its record
    (paths relative to `root`); [] when every table is what today's code prints."""
    problems = []
    for record_path, table in tables_in(Path(path).read_text()):
        expected = render_table(load_record(Path(root) / record_path))
        if table != expected:
            problems.append(f"{path}: the table after <!-- results: {record_path} --> differs from what the code "
                            f"prints from the record:\n{expected}")
    return problems


def _record_seed(study: str, arm: Arm, i: int, seed) -> int:
    """The i-th seed of a row as the record keeps it, an integer: a seed from a study spec or an MLflow param may be
    text ("3"), or a float of an integer (3.0). A seed that is none of these (None: the trial's config has no
    `train.seed`; "abc"; 2.5) is refused, naming the trial and the value: a record that renumbered it would publish
    a seed that never ran (and position i could be another trial's seed, a record `load_record` refuses)."""
    number = seed
    if isinstance(seed, str):
        try:
            number = int(seed.strip())
        except ValueError:
            number = finite(seed)
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, numbers.Integral) and not isinstance(number, bool):
        return int(number)
    trial = f"trial {arm.trial_ids[i]}" if arm.trial_ids is not None else f"seed #{i}"
    raise DataError(f"study {study}: row {arm.label}, {trial}: seed {seed!r:.40} is not an integer seed (a record "
                    f"lists each row's seeds as integers): set its train.seed")


def export_record(study, by: str, out: str | Path, *, spec: str = "",
                  baseline: str | None = None, measured: str = "", note: str = "") -> dict:
    """Write the record of `a2 study compare NAME --by KEY`: each row's best configuration (chosen on val), its
    columns and verdict on the split `compare` judges on (the test split, and the val CIDEr the row was chosen by,
    labelled as the selection; val throughout when not every chosen run reported test scores). `study`: a
    `dashboards.runs.Study`. A study whose confirmation seeds have not all run has no verdicts to publish yet:
    refused (DataError), nothing written."""
    comparison, configs, _ = study_comparison(study, by, baseline=baseline)
    if comparison.pending:
        raise DataError(f"study {study.name}: no verdict for {', '.join(comparison.pending)}: the confirmation seeds "
                        f"(from seed {study.confirm_from}) of its chosen configurations have not all run; export it "
                        f"once they have")
    arms = []
    for arm, _ in comparison.rows:
        seeds = (list(range(len(arm.seeds))) if arm.seed_ids is None  # no seed known: the seeds' positions
                 else [_record_seed(study.name, arm, i, s) for i, s in enumerate(arm.seed_ids)])
        if twice := sorted({s for s in seeds if seeds.count(s) > 1}):  # a record `load_record` would refuse
            trials = [str(arm.trial_ids[i]) for i, s in enumerate(seeds) if s in twice] if arm.trial_ids else []
            raise DataError(f"study {study.name}: row {arm.label}: seed {', '.join(map(str, twice))} is several "
                            f"trials' ({', '.join(trials) or 'unnamed'}): a record lists each seed once")
        entry = {"label": arm.label, "config": configs.get(arm.label, ""), "seeds": seeds,
                 "scores": {k: [s.get(k) for s in arm.seeds] for k in sorted({k for s in arm.seeds for k in s})}}
        if arm.per_image is not None:
            entry["per_image"] = {"image_ids": list(arm.image_ids),
                                  "scores": [[round(float(v), 4) for v in row] for row in arm.per_image]}
        arms.append(entry)
    record = {"record": FORMAT, "version": VERSION, "study": study.name, "spec": spec,
              # the verdict's split: the test split when every row's runs scored it when they ended (compare's
              # rule), else val
              "split": "test" if comparison.metric == TEST_CIDER else "val", "by": by,
              "metric": comparison.metric or CIDER, "mode": "max", "baseline": comparison.baseline,
              **({"pooled": True} if study.confirm_from is not None else {}),
              "columns": [list(c) for c in shown_metrics(comparison)], "measured": measured, "note": note,
              "arms": arms}
    atomic_write(out, json.dumps(record, indent=1) + "\n")
    return record

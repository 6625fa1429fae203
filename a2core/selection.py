"""The one rule for "the best epoch" of a run, so that every view of a study names the same one: training (which
checkpoint becomes best.pt and is scored on the test split), checkpoint retention, the study record, the MLflow
export, reports and comparisons.

The best epoch is the epoch of the best finite value of the metric in the study's mode ("max" or "min"); among
equal values, the latest: as M2's `train.py` keeps its best (`if val_cider >= best_cider`), and the one that survives
retention, which keeps the newest checkpoint of equals.
"""
from __future__ import annotations

import math
from typing import Mapping


def finite(value) -> float | None:
    """`value` as a float, or None when it is not a finite number (the project's one test of "is this a number")."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def rank(value, epoch: int, mode: str = "max") -> tuple:
    """Sort key of an epoch's result, larger is better: the value in the study's direction, then the later epoch.
    A value that is not a finite number ranks below every other."""
    value = finite(value)
    if value is None:
        return (0, 0.0, epoch)
    return (1, value if mode == "max" else -value, epoch)


def improves(value, best, mode: str = "max") -> bool:
    """Whether a new epoch's `value` replaces the best so far (`best`, None or non-finite when there is none):
    a better value, or an equal one (the latest of equals)."""
    value, best = finite(value), finite(best)
    if value is None:
        return False
    return best is None or (value >= best if mode == "max" else value <= best)


def best_epoch(values: Mapping[int, float], mode: str = "max") -> int | None:
    """The best epoch of {epoch: value}; None when no value is a finite number."""
    scored = [(rank(v, int(e), mode), int(e)) for e, v in values.items() if finite(v) is not None]
    return max(scored)[1] if scored else None

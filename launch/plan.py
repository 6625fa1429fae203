"""`a2 study plan FILE [--sd SD] [--delta D ...]`: the seeds per arm a study needs before it spends a cluster.

For each CIDEr difference (default: the paper's Table 3 gaps) the seeds per arm with which the verdict rule of
`compare_arms` (95% Welch interval, no verdict below 2 seeds) resolves it with 80% power (`dashboards.stats.seeds_needed`) and the study's cost in trial-epochs (README, "Power"). The seed
spread is `--sd`, else the pooled sd of best val CIDEr within the study's replicate groups in MLflow.
"""
from __future__ import annotations

import itertools

from a2core.errors import StudyError
from dashboards.paper_results import TABLE3, TABLE3_ROW
from dashboards.stats import POWER, pooled_sd, seeds_needed


def table3_gaps() -> list[tuple[str, float]]:
    """Each fusion's CIDEr gain over the baseline in the paper's Table 3, and the smallest gap between fusions."""
    cider = {fusion: TABLE3["rows"][row]["CIDEr"] for fusion, row in TABLE3_ROW.items()}
    gaps = [(f"{f} vs none", round(c - cider["none"], 1)) for f, c in cider.items() if f != "none"]
    pairs = [(abs(cider[a] - cider[b]), a, b) for a, b in itertools.combinations([f for f in cider if f != "none"], 2)]
    d, a, b = min(pairs)
    return gaps + [(f"{a} vs {b}", round(d, 1))]


def measured_sd(tracking_uri: str, study_name: str) -> tuple[float, int]:
    """(pooled seed sd of best val CIDEr, replicate groups with >= 2 seeds) of a finished study in MLflow."""
    from dashboards.compare import configurations
    from dashboards.report import load_study

    runs = [r for r in load_study(tracking_uri, study_name).runs if r.best_cider is not None]
    groups = [[r.best_cider for r in g] for g in configurations(runs)]
    sd = pooled_sd(groups)
    if sd is None:
        raise StudyError(f"study {study_name!r} has no configuration with two seeds in {tracking_uri}: no seed spread "
                         f"to measure; give one with --sd")
    return sd, sum(len(g) > 1 for g in groups)


def plan_text(configs: int, epochs: int, sd: float, deltas: list[tuple[str, float]], source: str) -> str:
    lines = [f"seed spread: sd {sd:.2f} CIDEr ({source}); 95% confidence, {POWER:.0%} power of the verdict rule",
             f"{'difference':<26}{'delta':>7}{'seeds/arm':>11}{'trial-epochs':>14}"]
    for label, delta in deltas:
        n = seeds_needed(delta, sd)
        lines.append(f"{label:<26}{delta:>7.1f}{n:>11d}{configs * n * epochs:>14d}")
    lines.append(f"trial-epochs = {configs} configurations x seeds x {epochs} epochs (before early stopping)")
    return "\n".join(lines)


def main(args) -> int:
    from launch.spec import load_study

    spec = load_study(args.file, args.overrides)
    if args.sd is not None:
        if args.sd <= 0:
            raise StudyError(f"--sd must be > 0, got {args.sd}")
        sd, source = args.sd, "given"
    else:
        uri = args.tracking_uri or spec.tracking["mlflow_uri"]
        sd, groups = measured_sd(uri, spec.name)
        source = f"measured in study {spec.name}, {groups} replicate groups"
    if args.delta is not None and any(d <= 0 for d in args.delta):
        raise StudyError(f"--delta must be > 0, got {args.delta}")
    deltas = [(f"{d:g} CIDEr", d) for d in args.delta] if args.delta else table3_gaps()
    print(plan_text(spec.num_configs, spec.total_epochs, sd, deltas, source))
    return 0

"""Fixed against adaptive replicates on studies/fusion_ablation.yaml's plan (`dashboards.sequential`): five arms
(none and four fusions; configurations per arm as the spec grids them), the plan's default noise (COCO seed spread
1.0, arm x image sd 10 over 5,000 test images) with normal and with Student's t(3) seeds, the paper's Table 3 gaps
for power and all arms equal for the family-wise false rate. Prints each design's family-wise false rate, power per
arm, expected seed-trials and GPU-hours (the plan's GPU-hours per trial), and the adaptive design's seed-trials over
the fixed design's at equal power (the fixed seed-trials interpolated at the adaptive design's power on the hardest
gap, moving_average's 2.3). Each adaptive design twice: its looks' seed variance pooled over every arm run so far (the
design's rule, `Design.pool_arms`) and each pair's own (`compare`'s rule); and, for reference, the fixed design with the
pooled variance too (`compare` keeps each pair's own). Run: python benchmarks/bench_sequential.py (seconds on
2 cores)."""
from __future__ import annotations

import numpy as np

from dashboards.sequential import Design, simulate, spending_weights
from dashboards.stats import Noise
from launch import plan
from launch.spec import load_study

STUDIES = 4_000
FIXED = (4, 5, 6, 7, 8, 9)
ADAPTIVE = ((3, 6, 9), (3, 5, 7, 9), (3, 4, 6, 8))


def main() -> None:
    spec = load_study("studies/fusion_ablation.yaml", [], check_files=False)
    per_fusion: dict[str, int] = {}
    for cell in spec.grid_cells():
        per_fusion[cell["fusion"]] = per_fusion.get(cell["fusion"], 0) + spec.samples_per_cell(cell)
    gaps = dict(plan.table3_gaps()[:4])  # "max vs none": 2.8, ...
    arms = [label.split(" vs ")[0] for label in gaps]
    configs = [per_fusion["none"], *(per_fusion[a] for a in arms)]
    deltas = list(gaps.values())
    est = plan.estimate(spec, plan.IMAGES_PER_SECOND, plan.cluster_workers())
    per_trial = est.gpu_hours / spec.num_trials
    noise = Noise(plan.COCO_SEED_SD, 0.0, plan.ARM_IMAGE_SD, plan.verdict_images(spec))
    print(f"fusion_ablation: arms none + {', '.join(arms)}; configurations {configs}; gaps {deltas}; "
          f"{per_trial:.2f} GPU-hours a trial (the plan's estimate); {STUDIES} studies a cell")
    hardest = int(np.argmin(deltas))
    for tails in (False, True):
        print(f"\nseeds {'Student t(3)' if tails else 'normal'}, {noise.text()}")
        print("design | family-wise false (all equal) | power per arm | mean seeds (none first) | seed-trials | "
              "GPU-hours | vs fixed at equal power")
        fixed = {}
        for n in FIXED:
            d = Design.fixed(n)
            alt, null = (simulate(d, noise, x, configs, STUDIES, seed, tails) for x, seed in ((deltas, 1),
                                                                                             ([0.0] * 4, 2)))
            fixed[n] = alt
            print(f"fixed {n} | {null['family_wise']:.1%} | {' '.join(f'{p:.1%}' for p in alt['power'])} | "
                  f"{' '.join(f'{s:.2f}' for s in alt['seeds'])} | {alt['seed_trials']:.1f} | "
                  f"{alt['seed_trials'] * per_trial:,.0f} | -")
        power_curve = [fixed[n]["power"][hardest] for n in FIXED]
        trials_curve = [fixed[n]["seed_trials"] for n in FIXED]
        pooled_curve = []
        for n in FIXED:
            d = Design.fixed(n, pool_arms=True)
            alt, null = (simulate(d, noise, x, configs, STUDIES, seed, tails) for x, seed in ((deltas, 1),
                                                                                             ([0.0] * 4, 2)))
            pooled_curve.append(alt["power"][hardest])
            print(f"fixed {n}, pooled (reference) | {null['family_wise']:.1%} | "
                  f"{' '.join(f'{p:.1%}' for p in alt['power'])} | - | {alt['seed_trials']:.1f} | "
                  f"{alt['seed_trials'] * per_trial:,.0f} | -")
        for rounds in ADAPTIVE:
            for pool in (True, False):
                d = Design(rounds, spending_weights(rounds, 1.0), futility_gap=min(deltas), pool_arms=pool)
                alt = simulate(d, noise, deltas, configs, STUDIES, 1, tails)
                null = simulate(d, noise, [0.0] * 4, configs, STUDIES, 2, tails)
                equal = float(np.interp(alt["power"][hardest], power_curve, trials_curve))
                reference = float(np.interp(alt["power"][hardest], np.maximum.accumulate(pooled_curve), trials_curve))
                print(f"adaptive {rounds}, {'pooled over the arms' if pool else 'pair only'} | "
                      f"{null['family_wise']:.1%} | {' '.join(f'{p:.1%}' for p in alt['power'])} | "
                      f"{' '.join(f'{s:.2f}' for s in alt['seeds'])} | {alt['seed_trials']:.1f} (all equal: "
                      f"{null['seed_trials']:.1f}) | {alt['seed_trials'] * per_trial:,.0f} | "
                      f"{alt['seed_trials'] / equal:.0%} of {equal:.1f} (of the pooled fixed design's: "
                      f"{alt['seed_trials'] / reference:.0%})")


if __name__ == "__main__":
    main()

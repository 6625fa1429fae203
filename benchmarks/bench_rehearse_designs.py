"""The fixed and the adaptive design of studies/fusion_ablation.yaml through the Ray-free rehearsal
(`launch.rehearse.repeated`: the study's own searcher, scheduler, round decisions and verdicts), the score model's
default noise (the plan's), at the paper's gaps (power) and with every arm equal (family-wise false rate).

    python benchmarks/bench_rehearse_designs.py 400 fixed5
    python benchmarks/bench_rehearse_designs.py 400 adaptive 3       # t(3) seed shifts
    python benchmarks/bench_rehearse_designs.py 800 fixed5 0 400     # repeats 400-1,199, every arm equal only
    python benchmarks/bench_rehearse_designs.py 1200 confirm5 0 0     # confirmation seeds, every arm equal only

One JSON line a case: the family-wise false rate, each arm's power (resolved on its true side), its mean seeds at its
last look, the seed-trials run. About 0.5 s a rehearsal of fixed 5 seeds on a 2-core box, 1.5 s of the adaptive."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import rehearse  # noqa: E402
from launch.spec import load_study  # noqa: E402

DESIGNS = {"fixed5": ["search.replicates=5", "search.confirm=null"], "fixed7": ["search.replicates=7", "search.confirm=null"],
           "adaptive": ["search.replicates={min: 3, max: 9}", "search.confirm=null"],
           # 2 seeds of every configuration to choose each fusion's one, then 3 or 5 confirmation seeds of it
           "confirm3": ["search.replicates=2", "search.confirm=3"],
           "confirm5": ["search.replicates=2", "search.confirm=5"]}
FUSIONS = ("none", "max", "moving_average", "exp_decay", "gate")


def main() -> None:
    n, which = int(sys.argv[1]), sys.argv[2]
    seed_df = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    start = int(sys.argv[4]) if len(sys.argv) > 4 else None  # given: every arm equal only, from this repeat on
    spec = load_study(Path(__file__).resolve().parents[1] / "studies" / "fusion_ablation.yaml", DESIGNS[which],
                      check_files=False)
    for kind in (("equal",) if start is not None else ("gaps", "equal")):
        means = None if kind == "gaps" else [f"{f}=120" for f in FUSIONS]
        model = dataclasses.replace(rehearse.score_model(spec, means=means, storage="/nonexistent-a2-storage"),
                                    seed_df=seed_df)
        began = time.time()
        agg = rehearse.aggregate(rehearse.repeated(spec, model, n, start or 0), spec, model)
        print(json.dumps({"design": which, "seed_df": seed_df, "kind": kind, "n": n, "start": start or 0,
                          "s": round(time.time() - began, 1), "family_wrong": agg["family_wrong"],
                          "seed_trials": agg["seed_trials_mean"], "fixed": agg["seed_trials_fixed"],
                          "power": {k: round(v["right"], 3) for k, v in agg["rows"].items()},
                          "wrong": {k: round(v["wrong"], 4) for k, v in agg["rows"].items()},
                          "seeds": {k: round(v["seeds_mean"], 2) for k, v in agg["rows"].items()}}), flush=True)


if __name__ == "__main__":
    main()

"""benchmarks/bench_asha.py without Ray: its two studies differ only in the scheduler and get the same
configurations, and its comparison of two finished searches (compute ratio, gap, target) is right."""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pytest
import yaml

from tests.repo_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_asha.py")


def _load(study: dict, tmp_path: Path):
    from launch.spec import load_study

    path = tmp_path / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study))
    return load_study(str(path))


@pytest.mark.parametrize("size", ["FULL", "SMOKE", "QUICK"])
def test_arms_differ_only_in_the_scheduler_and_get_the_same_configurations(bench, tmp_path, size):
    from launch.search import GridCrossedSearcher, ReplicateASHA, build_scheduler

    studies = {arm: bench.search_study(arm, tmp_path / arm, tmp_path / "data", getattr(bench, size))
               for arm in bench.ARMS}
    rest = {arm: copy.deepcopy({k: v for k, v in s.items() if k not in ("name", "tracking", "storage")})
            for arm, s in studies.items()}
    schedulers = {arm: r["search"].pop("scheduler") for arm, r in rest.items()}
    assert rest["fifo"] == rest["asha"]
    assert schedulers == {"fifo": {"fifo": {}}, "asha": {"asha": getattr(bench, size)["asha"]}}

    specs = {arm: _load(s, tmp_path) for arm, s in studies.items()}
    assert isinstance(build_scheduler(specs["asha"]), ReplicateASHA)
    assert specs["fifo"].num_trials == specs["asha"].num_trials
    suggestions = {}
    for arm, spec in specs.items():
        searcher = GridCrossedSearcher(spec)
        suggestions[arm] = [searcher.suggest(f"t{i}") for i in range(spec.num_trials)]
    assert suggestions["fifo"] == suggestions["asha"]
    assert [s["seed"] for s in suggestions["fifo"][:3]] == [0, 1, 2]  # a group's replicates in a row


def _summary(groups: dict[str, dict], planned: int, best: str) -> dict:
    """A summary.json of the fields the benchmark reads: groups of trials with their best values, epochs, CPU."""
    trials, out_groups, cpu = [], [], 0.0
    for label, g in groups.items():
        ids = [f"{label}-{seed}" for seed in range(len(g["values"]))]
        for tid, seed, value in zip(ids, range(len(ids)), g["values"]):
            trials.append({"trial_id": tid, "sampled": {"train.lr_factor": g["lr"], "seed": seed}, "best": value,
                           "epochs_done": g["epochs"], "epochs_planned": planned,
                           "compute": {"cpu_s": g["cpu"], "wall_s": 2 * g["cpu"]}})
            cpu += g["cpu"]
        out_groups.append({"config_hash": label, "trials": ids, "values": list(g["values"]),
                           "stopped_early": g.get("stopped")})
    by_label = {g["config_hash"]: g for g in out_groups}
    return {"trials": trials, "groups": out_groups, "best_group": by_label[best], "per_image": {},
            "compute": {"total_cpu_s": cpu, "total_wall_s": 2 * cpu, "saved_cpu_s": 0.0}}


GOOD = {"lr": 0.25, "values": [100.0, 104.0, 102.0], "epochs": 8, "cpu": 80.0}
BAD = {"lr": 0.02, "values": [30.0, 32.0, 31.0], "epochs": 8, "cpu": 80.0}
STOPPED = {"rung": 2, "cutoff": 60.0, "group_mean": 11.0, "threshold": 4.0}


def test_stopping_the_bad_groups_keeps_the_best_and_weighs_the_compute_against_the_target(bench, capsys):
    fifo = _summary({"a": GOOD, "b": BAD, "c": BAD | {"lr": 0.03}}, 8, best="a")
    cut = {"values": [10.0, 11.0, 12.0], "epochs": 2, "cpu": 26.0, "stopped": STOPPED}
    asha = _summary({"a": GOOD, "b": BAD | cut, "c": BAD | {"lr": 0.03} | cut}, 8, best="a")
    result = bench.compare_searches(fifo, asha)

    assert result["same_samples"]
    assert result["cpu_ratio"] == result["raw_cpu_ratio"] == pytest.approx((3 * 80 + 6 * 26) / (9 * 80))  # 0.55
    assert result["drift"] == (1.0, 3)  # group a ran in full in both arms at the same CPU cost
    assert result["epoch_ratio"] == pytest.approx((3 * 8 + 6 * 2) / (9 * 8))
    gap = result["gap"]
    assert gap.delta == 0.0 and gap.low < 0 < gap.high  # same group, Welch's interval over its 3 seeds
    assert result["within_noise"]
    assert result["half_width"] == pytest.approx(gap.high - gap.delta) and result["half_width"] < 5
    assert not result["target_met"]  # 55% of the compute is over the 50% target
    assert result["seed_sd"] == pytest.approx(2 ** 0.5)  # pooled over the full search's groups: (8 + 2 + 2) / 6

    bench.report(result, 8)
    out = capsys.readouterr().out
    assert "same configurations and seeds in both arms: yes (3 groups)" in out
    assert "stopped early (rung 2, cutoff 60.0), epochs 2/2/2" in out
    assert "ASHA used 55% of the full search's CPU seconds at equal load (55% as measured" in out
    assert (f"within the seed noise (half-width {result['half_width']:.1f}); target (within noise, half-width <= 5, "
            "at <= 50% compute) NOT met") in out


def test_a_cheap_search_that_lost_the_best_group_misses_the_target(bench):
    fifo = _summary({"a": GOOD, "b": BAD}, 8, best="a")
    asha = _summary({"a": GOOD | {"values": [40.0, 41.0, 42.0], "epochs": 2, "cpu": 20.0, "stopped": STOPPED},
                     "b": BAD}, 8, best="b")
    result = bench.compare_searches(fifo, asha)
    assert result["cpu_ratio"] == pytest.approx((3 * 20 + 3 * 80) / 480)
    assert result["gap"].delta == pytest.approx(31.0 - 102.0)
    assert result["gap"].high < 0  # resolved: the early-stopping search's best is worse
    assert not result["within_noise"] and not result["target_met"]


def test_the_cpu_ratio_is_taken_at_equal_load(bench):
    """The arms run one after the other: trials that did the same work in both measure the load's drift."""
    fifo = _summary({"a": GOOD, "b": BAD}, 8, best="a")
    asha = _summary({"a": GOOD | {"cpu": 40.0},  # the same work at half the CPU seconds: a lighter load
                     "b": BAD | {"values": [10.0, 11.0, 12.0], "epochs": 2, "cpu": 10.0, "stopped": STOPPED}},
                    8, best="a")
    result = bench.compare_searches(fifo, asha)
    assert result["drift"] == (0.5, 3)
    assert result["raw_cpu_ratio"] == pytest.approx(150 / 480)
    assert result["cpu_ratio"] == pytest.approx(300 / 480)  # the ASHA arm's 150 CPU-s at the full search's load


def test_several_min_gap_se_values_give_one_early_stopping_arm_each(bench, tmp_path):
    assert bench.early_arms(None) == {"asha": (None, False)}
    assert bench.early_arms([1.5]) == {"asha": (1.5, False)}
    arms = bench.early_arms([2, 0, 1.5, bench._gap("0-hold")])
    assert arms == {"asha-k2": (2, False), "asha-k0": (0, False), "asha-k1p5": (1.5, False),
                    "asha-k0-hold": (0.0, True)}
    studies = {arm: bench.search_study(arm, tmp_path / arm, tmp_path / "data", bench.FULL, 0, k, hold)
               for arm, (k, hold) in {"fifo": (None, False), **arms}.items()}
    assert studies["fifo"]["search"]["scheduler"] == {"fifo": {}}
    for arm, (k, hold) in arms.items():
        assert studies[arm]["search"]["scheduler"] == {
            "asha": bench.FULL["asha"] | {"min_gap_se": k} | ({"hold_at_rungs": True} if hold else {})}
        _load(studies[arm], tmp_path)  # a valid study name and spec
    with pytest.raises(argparse.ArgumentTypeError, match="not K or K-hold: '0-held'"):
        bench._gap("0-held")
    assert bench.FULL["asha"]["min_gap_se"] == 2  # the size's own value is left as it was
    held = bench.search_study("asha-k0", tmp_path / "held", tmp_path / "data", bench.FULL, 0, 0, hold=True)
    assert held["search"]["scheduler"] == {"asha": bench.FULL["asha"] | {"min_gap_se": 0, "hold_at_rungs": True}}
    assert _load(held, tmp_path).search.scheduler.asha.hold_at_rungs is True

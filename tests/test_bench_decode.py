"""benchmarks/bench_decode.py, the measurement behind `launch.plan.BEAM5_OVER_GREEDY`, runs on a CPU at tiny sizes:
every arm decodes, a wider beam does more matrix-multiply work, and the table names the plan's figures."""
from __future__ import annotations

import pytest

from launch import plan
from tests.repo_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_decode.py")


def test_the_tiny_run_prints_each_arm_against_greedy_and_the_plans_factor(bench, capsys):
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    # each row: the arm, then words, GFLOP, / greedy, ATen ops, / greedy, median s, / greedy, per repeat..., fastest
    rows = {line[:8].strip(): line[8:].split() for line in out.splitlines() if line.startswith(("greedy ", "beam "))}
    assert list(rows) == ["greedy", "beam 3", "beam 5"]
    assert rows["greedy"][0] == "20"  # untrained: every caption runs all 20 words
    assert [rows["greedy"][i] for i in (2, 4, 6)] == ["1.00", "1.00", "1.00"]  # greedy against itself
    flops = {arm: float(r[1]) for arm, r in rows.items()}
    assert flops["greedy"] < flops["beam 3"] < flops["beam 5"]  # a wider beam multiplies more rows
    assert float(rows["beam 5"][2]) > float(rows["beam 3"][2]) > 1  # the FLOP bound, against greedy
    assert all(float(rows[arm][6]) > 0 for arm in rows)
    assert f"BEAM5_OVER_GREEDY {plan.BEAM5_OVER_GREEDY:g}" in out
    assert f"beam 5 {plan.decode_image_cost(5) / plan.VAL_IMAGE_COST:.2f} (linear in the width)" in out


def test_counts_are_per_arm_words_flops_and_operator_calls(bench):
    import torch

    from a2core.config import Config
    from a2core.model.a2 import build_model

    cfg = Config.from_dict({"model": bench.TINY_MODEL, "train": {"batch_size": 10, "warmup": 10}})
    torch.manual_seed(0)
    model = build_model(cfg.model, 50, 24).eval()
    feats, mask, _, _ = bench.make_batch(2)
    with torch.no_grad():
        counts = bench.counts(bench.arms(model, feats, mask, [2]))
    assert list(counts) == ["greedy", "beam 2"]
    (g_words, g_flops, g_ops), (b_words, b_flops, b_ops) = counts["greedy"], counts["beam 2"]
    assert 1 <= g_words <= bench.MAX_LEN and 1 <= b_words <= bench.MAX_LEN + 1
    assert 0 < g_flops < b_flops and 0 < g_ops <= b_ops  # the same operators on more rows, and the pruning's

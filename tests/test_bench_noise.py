"""benchmarks/bench_noise.py without training: the perfectly grounded caption it scores as the ceiling, and the
paired comparison of a setting against the shipped one."""
from __future__ import annotations


import pytest

from tests.repo_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_noise.py")


def test_the_grounded_caption_is_what_the_references_say_in_their_most_common_wording(bench):
    refs = ["There is the red dog and a blue car at the park.", "a red dog next to the blue car",
            "a red dog with a blue car in a park"]
    assert bench.grounded_caption(refs) == "a red dog and a blue car in a park"
    assert bench.grounded_caption(["the white cup and a black chair at the kitchen"]) == \
        "a white cup and a black chair in the kitchen"
    assert bench.grounded_caption(["a green bus with the yellow cow"] * 5) == "a green bus and a yellow cow"


def _record(fusion, seed, best, lift):
    return {"fusion": fusion, "seed": seed, "best_val_cider": best, "grounding": {"lift": lift}}


def test_paired_differences_are_seed_by_seed(bench, capsys):
    shipped = [_record("gate", s, 740.0 + s, 0.49) for s in range(3)]
    cheap = [_record("gate", s, 741.0 + s + 0.5 * (s == 1), 0.48 + 0.001 * s) for s in range(3)]
    bench.paired(cheap, shipped + [_record("none", 0, 700.0, 0.4)], [0, 1, 2])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    # differences 1.0, 1.5, 1.0: mean +1.2 (one decimal), a t-interval around it; lift -0.010, -0.009, -0.008
    assert row.startswith("| gate | 0, 1, 2 | +1.2 [") and "| -0.009 [" in row

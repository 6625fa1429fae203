"""Leaderboard JSON, the paper's tables, shared-JVM scoring and the minimum-length decoding of packaging."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dashboards import leaderboard as lb
from dashboards import paper_results as paper


# -- the paper's tables ----------------------------------------------------------------------------------------------
def test_paper_rows_follow_the_fusion_mapping():
    expected = {"none": ("Baseline", 120.0), "max": ("Max Pooling", 122.8), "moving_average": ("Moving Average", 122.3),
                "exp_decay": ("Exponential Decay", 124.2), "gate": ("Gate Mechanism", 125.0)}
    for fusion, (row, cider) in expected.items():
        rows = paper.paper_rows(fusion, "xe")
        assert rows["table3"]["row"] == row and rows["table3"]["metrics"]["CIDEr"] == cider
        assert (rows["table1"] is not None) == (fusion == "gate")
    gate = paper.paper_rows("gate", "scst")
    assert gate["table1"]["metrics"] == {"BLEU-1": 81.5, "BLEU-4": 39.8, "METEOR": 29.6, "ROUGE-L": 59.1,
                                         "CIDEr": 133.9, "SPICE": 23.0}
    assert gate["table2"]["c5"]["CIDEr"] == 132.4 and gate["table2"]["c40"]["CIDEr"] == 134.7
    assert gate["table2"]["ensemble"] == 4
    assert paper.TABLE1["rows"]["A2 Transformer"]["xe"]["CIDEr"] == 125.0
    assert paper.TABLE1["rows"]["DPA"]["scst"]["BLEU-1"] is None  # "-" in the paper
    with pytest.raises(ValueError):
        paper.paper_rows("gate", "rl")


# -- the leaderboard dict and file -----------------------------------------------------------------------------------
def _metrics(cider: float) -> dict:
    return {"BLEU-1": 70.0, "BLEU-4": 30.0, "METEOR": 25.0, "ROUGE-L": 50.0, "CIDEr": cider}


def _board(tmp_path, per_image=None, data=None):
    config = {"data": data or {"kind": "synthetic"}, "model": {"fusion": "max", "lambda": 0.035},
              "train": {"seed": 0, "xe_epochs": 2, "scst_epochs": 0}, "output_dir": "runs/a2"}
    members = [{"seed": s, "trial_id": f"t{s}", "study": "st", "checkpoint": str(tmp_path / f"c{s}.pt"),
                "value": 0.5 + (s == 2), "metrics": _metrics(100.0 + s), "mlflow_run_id": f"r{s}"}
               for s in (2, 0, 1, 3)]  # seed 2 is the best on validation, seed 3 on the test images
    return lb.build_leaderboard(study="st", config=config, members=members, ensemble_metrics=_metrics(110.0),
                                images=20, selected_by={"metric": "val/CIDEr", "trial_id": "t0"},
                                per_image=per_image)


def test_leaderboard_has_one_value_per_row_with_seed_interval_and_ensemble_gain(tmp_path):
    import numpy as np
    from scipy import stats as sps

    rng = np.random.default_rng(0)
    centred = lambda x, mean: x - x.mean() + mean  # noqa: E731 - CIDEr is the mean of the per-image scores
    seed3 = centred(rng.normal(0.0, 20.0, 60), 103.0)  # the best member's per-image CIDEr-D
    per_image = {f"seed-{s}": dict(enumerate(centred(rng.normal(0, 20.0, 60), 100.0 + s))) for s in range(3)}
    per_image["seed-3"] = dict(enumerate(seed3))
    per_image["ensemble"] = dict(enumerate(centred(seed3 + rng.normal(0, 2.0, 60), 110.0)))  # ~+7 on every image
    board = _board(tmp_path, per_image)
    names = [e["name"] for e in board["entries"]]
    assert names == ["seed-0", "seed-1", "seed-2", "seed-3", "ensemble"]
    for e in board["entries"][:4]:
        assert "ensemble_CIDEr" not in e and "ensemble_gain_CIDEr" not in e  # no repeated ensemble column
        assert e["config_hash"] == board["configuration"]["hash"]
    ens = board["entries"][-1]
    assert ens["seeds"] == [0, 1, 2, 3] and ens["mlflow_run_ids"] == ["r0", "r1", "r2", "r3"]
    assert board["evaluation"]["scale"] == "x100"
    # the seed mean of CIDEr (100, 101, 102, 103) with its t-interval over the 4 seeds
    half = sps.t.ppf(0.975, 3) * np.std([100, 101, 102, 103], ddof=1) / 2
    cider = board["seed_mean"]["CIDEr"]
    assert cider["mean"] == 101.5 and cider["n"] == 4
    assert cider["low"] == pytest.approx(101.5 - half, abs=1e-3) and cider["high"] == pytest.approx(101.5 + half,
                                                                                                     abs=1e-3)
    gain = board["ensemble"]["gain_over_members"]  # against the members' mean, their seed spread in the interval
    assert gain["delta"] == pytest.approx(8.5) and gain["images"] == 60 and gain["seeds"] == 4
    assert gain["low"] < 8.5 - half and gain["high"] > 8.5 + half  # at least the one-sample t over the 4 seeds
    assert gain["verdict"] == (f"ensemble beats its members' mean by 8.5 CIDEr [{gain['low']:.1f}, "
                               f"{gain['high']:.1f}], 4 member seeds x 60 images")
    chosen = board["ensemble"]["gain_over_chosen"]  # the member chosen on validation, not the best on test
    assert chosen["member"] == "seed-2" and chosen["member_CIDEr"] == 102.0 and chosen["delta"] == pytest.approx(8.0)
    one_seed = sps.t.ppf(0.975, 3) * np.std([100, 101, 102, 103], ddof=1)  # one run's seed spread
    assert chosen["low"] <= 8.0 - one_seed and chosen["high"] >= 8.0 + one_seed
    assert "seed" not in board["configuration"]["config"]["train"]
    assert "output_dir" not in board["configuration"]["config"]
    assert board["paper"]["table3"]["row"] == "Max Pooling" and board["paper"]["table1"] is None
    assert board["evaluation"]["metrics"] == ["BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"]
    assert board["evaluation"]["spice"] is False
    # every score is on the held-out split (the synthetic set's test split here); val only chose the checkpoints
    assert board["evaluation"]["split"] == "synthetic-test"
    assert board["evaluation"]["selection"] == {"split": "val", "metric": "val/CIDEr"}

    table = lb.format_table(board)
    lines = table.splitlines()
    assert "ens C" not in lines[1] and "x100" in lines[0]
    assert lines[0].startswith("leaderboard of st (max, config ") and lines[0].endswith(
        ": every score on the synthetic-test split, 20 images, beam 5, scores x100; configuration and checkpoints "
        "selected by val/CIDEr on the val split")
    assert lines[1].split() == ["trial", "test", "B-1", "test", "B-4", "test", "M", "test", "R", "test", "C"]
    seed0 = next(line for line in lines if line.startswith("seed-0"))
    assert seed0.split()[-1] == "100.0"  # its own CIDEr, nothing else
    mean_line = next(line for line in lines if line.startswith("seed mean"))
    assert f"101.5 [{101.5 - half:.1f}, {101.5 + half:.1f}]" in mean_line
    assert lines[-2].startswith("ensemble gain over its members' mean: ensemble beats its members' mean by 8.5")
    assert lines[-1].startswith("ensemble gain over the member chosen on validation: ensemble ")
    assert any(line.startswith("paper T3 Max Pooling (COCO Karpathy val)") for line in lines)  # Table 3: val set
    coco = _board(tmp_path, per_image, data={"kind": "coco"})
    assert coco["evaluation"]["split"] == "karpathy-test"
    assert "every score on the karpathy-test split" in lb.format_table(coco).splitlines()[0]


def test_a_board_whose_seeds_all_scored_the_same_says_so(tmp_path):
    """Every seed's test CIDEr equal (a seed that changes nothing): the file keeps `identical` and the table says
    "all equal: the seed changes nothing", as `seed_interval` does; it used to read "(4 seeds: no interval)"."""
    board = _board(tmp_path)
    config = board["configuration"]["config"]
    members = [{"seed": e["seed"], "trial_id": e["trial_id"], "study": "st", "checkpoint": str(tmp_path / "c.pt"),
                "value": 0.5, "metrics": _metrics(100.0), "mlflow_run_id": f"r{e['seed']}"}
               for e in board["entries"][:-1]]
    same = lb.build_leaderboard(study="st", config=config, members=members, ensemble_metrics=_metrics(110.0),
                                images=20, selected_by={"metric": "val/CIDEr", "trial_id": "t0"})
    assert same["seed_mean"]["CIDEr"] == {"mean": 100.0, "low": None, "high": None, "n": 4, "identical": True}
    assert board["seed_mean"]["CIDEr"]["identical"] is False
    path = lb.write_leaderboard(tmp_path / "board.json", same)
    mean_line = next(line for line in lb.format_table(json.loads(path.read_text())).splitlines()
                     if line.startswith("seed mean"))
    assert "100.0 (4 seeds, all equal: the seed changes nothing)" in mean_line


def test_leaderboard_without_per_image_scores_has_the_seed_spread_interval(tmp_path):
    from scipy import stats as sps

    gain = _board(tmp_path)["ensemble"]["gain_over_members"]
    half = sps.t.ppf(0.975, 3) * float(torch.tensor([100.0, 101, 102, 103]).std()) / 2
    assert (gain["low"], gain["high"]) == pytest.approx((8.5 - half, 8.5 + half), abs=1e-3)
    assert gain["verdict"].endswith("4 member seeds, seed means only") and gain["images"] is None


def test_write_leaderboard_is_atomic_and_round_trips(tmp_path, monkeypatch):
    board = _board(tmp_path)
    path = lb.write_leaderboard(tmp_path / "out" / "leaderboard.json", board)
    assert json.loads(path.read_text()) == json.loads(json.dumps(board))
    assert sorted(p.name for p in path.parent.iterdir()) == ["leaderboard.json"]  # no temp file left

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("a2core.atomic.os.fsync", broken)  # fails after the new text is in the temp file
    with pytest.raises(OSError):
        lb.write_leaderboard(path, {"other": 1})
    assert json.loads(path.read_text())["study"] == "st"  # the old file is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["leaderboard.json"]


def test_ordered_keeps_the_x100_scores_in_table_order():
    assert lb.ordered({"CIDEr": 125.0, "BLEU-4": 38.2, "per_image": {}}) == {"BLEU-4": 38.2, "CIDEr": 125.0}


# -- scoring: one tokenizer and one METEOR for every system, coco_scores' numbers ----------------------------------------
@pytest.mark.slow
def test_score_systems_equals_coco_scores():
    from a2core.metrics import coco_scores

    refs = {1: ["a red ball on the table", "a ball that is red"], 2: ["two dogs run in a park", "dogs running"],
            3: ["a man rides a bike", "a person on a bicycle"], 4: ["a cat sleeps", "the cat is asleep on a bed"]}
    good = {1: "a red ball on a table", 2: "two dogs in the park", 3: "a man riding a bike", 4: "a cat asleep"}
    bad = {1: "a dog", 2: "a cat", 3: "a bike", 4: "a table."}
    scores, per_image = lb.score_systems(refs, {"good": good, "bad": bad}, spice=False)
    full = coco_scores(refs, good, spice=False, per_image=True, progress=False)
    expected = lb.ordered(full)
    assert per_image["good"] == pytest.approx({k: v["CIDEr"] for k, v in full["per_image"].items()})
    assert scores["good"].keys() == expected.keys() == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L",
                                                        "CIDEr"}
    for k, v in expected.items():
        assert scores["good"][k] == pytest.approx(v, abs=1e-3), k
    assert scores["good"]["CIDEr"] > scores["bad"]["CIDEr"]
    with pytest.raises(ValueError, match="missing"):
        lb.score_systems(refs, {"short": {1: "a ball"}}, spice=False)


# -- decoding: never an empty caption --------------------------------------------------------------------------------
class EosLovingStepper:
    """A stand-in model whose favourite word is always <eos> (id 2), then word 5."""

    vocab = 8

    def init_state(self, feats, region_mask):
        return {"n": feats.shape[0]}

    def expand_state(self, state, k):
        return {"n": state["n"] * k}

    def step(self, last, state):
        logits = torch.full((last.shape[0], self.vocab), -5.0)
        logits[:, 2] = 3.0
        logits[:, 5] = 1.0
        return logits.log_softmax(-1)

    def reorder_state(self, state, index):
        return state


def test_min_length_stepper_never_ends_before_the_first_word():
    from a2core.decode import MinLengthStepper, beam_search

    feats, mask = torch.zeros(3, 4, 8), torch.ones(3, 4, dtype=torch.bool)
    plain, _ = beam_search(EosLovingStepper(), feats, mask, beam_size=5, max_len=20)
    assert plain[:, 0].tolist() == [2, 2, 2]  # an empty caption: what the server would reject
    seqs, scores = beam_search(MinLengthStepper(EosLovingStepper(), eos=2, min_len=1), feats, mask,
                               beam_size=5, max_len=20)
    assert seqs[:, :2].tolist() == [[5, 2]] * 3  # the best one-word caption, then <eos>
    assert all(math.isfinite(s) for s in scores.tolist())


def test_the_member_chosen_on_validation_is_packagings_of_equals(tmp_path):
    """Seeds 0 and 3 tie on validation; packaging selected trial t00000 (seed 3, the lower trial id): the gain over
    the chosen member is over seed 3. It was over seed 0, the first by seed, while `selected_by` named seed 3."""
    config = {"data": {"kind": "synthetic"}, "model": {"fusion": "max", "lambda": 0.035},
              "train": {"seed": 0, "xe_epochs": 2, "scst_epochs": 0}}
    ids = {0: "t00005", 1: "t00001", 2: "t00002", 3: "t00000"}
    members = [{"seed": s, "trial_id": ids[s], "study": "st", "checkpoint": str(tmp_path / f"c{s}.pt"),
                "value": 0.7 if s in (0, 3) else 0.5, "metrics": _metrics(100.0 + s)} for s in range(4)]

    def chosen(selected):
        board = lb.build_leaderboard(study="st", config=config, members=members, ensemble_metrics=_metrics(110.0),
                                     images=20, selected_by={"metric": "val/CIDEr", "mode": "max", **selected})
        return board["ensemble"]["gain_over_chosen"]["member"]

    assert chosen({"trial_id": "t00000", "tie_break": "lower trial id"}) == "seed-3"
    assert chosen({"trial_id": "t00005"}) == "seed-0"  # the selected one of equals
    assert chosen({}) == "seed-3"  # no selection named: the lower trial id

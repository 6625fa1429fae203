"""Attention diagnostics: value ranges on a tiny model, and expected values on constructed cases (identical and
disjoint distributions, scipy's Kendall tau-b, fusion `none`, attention forced onto the ground-truth region or
onto one region per caption, gradient importance known in closed form); a short training run reports them all."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.spatial.distance import jensenshannon
from scipy.stats import kendalltau

from a2core.config import Config
from a2core.data import synthetic
from a2core.data.dataset import CaptionData
from a2core.diagnostics import (attention_jsd, grounding_accuracy, js_divergence, kendall_importance, kendall_tau,
                                mask_mean)
from a2core.model.a2 import build_model
from a2core.train import train
from tests.stubmodels import RecordingStub

LN2 = math.log(2.0)
SEED = 11


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag") / "synth"
    synthetic.generate(root, seed=SEED, images=40)
    return root


def _cfg(root, fusion="gate", max_regions=10):
    return Config.from_dict({
        "data": {"root": str(root), "images": 40, "seed": SEED},
        "model": {"d_model": 32, "layers": 2, "heads": 4, "d_ff": 64, "max_regions": max_regions, "dropout": 0.1,
                  "fusion": fusion, "temperature": 50.0 if fusion == "exp_decay" else None},
    })


def _data(root, max_regions=10):
    cfg = _cfg(root, max_regions=max_regions)
    return CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)


def _model(root, fusion, seed=0):
    cfg = _cfg(root, fusion)
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    torch.manual_seed(seed)
    model = build_model(cfg.model, len(data.vocab), cfg.data.max_caption_len + 2)
    if model.has_mask_network:
        # Spread the mask away from its initial near-constant value so the alignment visibly moves attention.
        with torch.no_grad():
            for layer in model.decoder:
                layer.cross.mask_bias.copy_(torch.linspace(-1.0, 1.5, model.cfg.heads))
                layer.cross.mask_q.weight.mul_(4.0)
    model.train()  # the diagnostics must switch to eval and back
    return model, data


# -- constructed cases of the pure functions ----------------------------------------------------------------------
def test_js_divergence_of_identical_disjoint_and_random_distributions():
    p = torch.softmax(torch.randn(6, 9, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(js_divergence(p, p), torch.zeros(6))
    eye = torch.eye(5)
    disjoint = js_divergence(eye, eye.roll(1, dims=1))
    assert torch.allclose(disjoint, torch.full((5,), LN2), atol=1e-9)
    q = torch.softmax(3 * torch.randn(6, 9, generator=torch.Generator().manual_seed(1)), -1)
    jsd = js_divergence(p, q)
    assert torch.allclose(jsd, js_divergence(q, p))  # symmetric
    # scipy's jensenshannon is the square root of the divergence (natural log by default).
    expected = [jensenshannon(a, b) ** 2 for a, b in zip(p.double().numpy(), q.double().numpy())]
    assert np.allclose(jsd.numpy(), expected, atol=1e-6)
    assert bool(((jsd > 0) & (jsd <= LN2)).all())
    # Half the mass shared: JSD = 0.5 ln 2 (the disjoint halves each contribute 0.25 ln 2).
    a, b = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    assert math.isclose(float(js_divergence(a, b)), 0.5 * LN2, rel_tol=1e-6)


def test_kendall_tau_equals_scipy_tau_b_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 3, 7, 25, 60):
        for _ in range(20):
            x = rng.integers(0, 4, n).astype(float)  # many ties
            y = rng.integers(0, 5, n) + rng.normal(0, 1, n) * (rng.random() < 0.5)
            expected = kendalltau(x, y).statistic
            ours = kendall_tau(x, y)
            if np.isnan(expected):
                assert np.isnan(ours)
            else:
                assert ours == pytest.approx(expected, abs=1e-12)
                assert -1.0 <= ours <= 1.0
    x = rng.normal(size=12)
    assert kendall_tau(x, 3 * x + 1) == pytest.approx(1.0)
    assert kendall_tau(x, -x) == pytest.approx(-1.0)
    assert np.isnan(kendall_tau(x, np.ones(12)))  # a constant ranking has no order


# -- a tiny model: ranges ---------------------------------------------------------------------------------------
def test_every_diagnostic_is_in_range_on_a_tiny_model(root):
    model, data = _model(root, "gate")
    jsd = attention_jsd(model, data, "val", limit=5, batch_size=3)
    assert len(jsd) == 2 and all(0.0 < v <= LN2 for v in jsd)
    m = mask_mean(model, data, "val", limit=5, batch_size=3)
    assert 0.0 < m < 1.0
    taus = kendall_importance(model, data, "val", limit=3, batch_size=2)
    assert set(taus) == {"attention", "mask"}
    for kind in ("attention", "mask"):
        assert len(taus[kind]) == 2 and all(-1.0 <= v <= 1.0 for v in taus[kind])
    acc = grounding_accuracy(model, data, "val", limit=5, batch_size=3)
    assert acc["words"] > 0
    for kind in ("attention", "aligned"):
        assert len(acc[kind]) == 2 and all(0.0 <= v <= 1.0 for v in acc[kind])
        assert 0.0 <= acc[f"{kind}_mean"] <= 1.0
    assert model.training  # each diagnostic puts the model back in the mode it found
    assert all(not layer.cross.record for layer in model.decoder)


def test_batching_does_not_change_the_diagnostics(root):
    """Images are independent: one image per batch or several give the same numbers (padding rows are skipped)."""
    model, data = _model(root, "gate", seed=3)
    assert attention_jsd(model, data, "val", limit=5, batch_size=1) == pytest.approx(
        attention_jsd(model, data, "val", limit=5, batch_size=5), rel=1e-5)
    assert mask_mean(model, data, "val", limit=5, batch_size=1) == pytest.approx(
        mask_mean(model, data, "val", limit=5, batch_size=5), rel=1e-5)
    one = kendall_importance(model, data, "val", limit=3, batch_size=1)
    many = kendall_importance(model, data, "val", limit=3, batch_size=3)
    assert one["attention"] == pytest.approx(many["attention"], abs=1e-9)
    assert one["mask"] == pytest.approx(many["mask"], abs=1e-9)


def test_fusion_none_has_zero_jsd_in_every_layer_and_no_mask(root):
    model, data = _model(root, "none")
    assert attention_jsd(model, data, "val", limit=5, batch_size=5) == [0.0, 0.0]
    assert math.isnan(mask_mean(model, data, "val", limit=5))
    taus = kendall_importance(model, data, "val", limit=2, batch_size=2)
    assert all(-1.0 <= v <= 1.0 for v in taus["attention"])
    assert all(math.isnan(v) for v in taus["mask"])
    acc = grounding_accuracy(model, data, "val", limit=5)
    assert acc["attention"] == acc["aligned"]  # no alignment: the same weights


def test_jsd_is_zero_when_the_mask_keeps_everything(root):
    """m = 1 everywhere gives a_m = a, so every fusion returns the original attention."""
    for fusion in ("max", "gate", "exp_decay"):
        model, data = _model(root, fusion)
        with torch.no_grad():
            for layer in model.decoder:
                layer.cross.mask_bias.fill_(60.0)  # sigmoid(60) = 1 in float32
                layer.cross.mask_q.weight.zero_()
                layer.cross.mask_q.bias.zero_()
        jsd = attention_jsd(model, data, "val", limit=5)
        assert jsd == pytest.approx([0.0, 0.0], abs=1e-6)
        assert mask_mean(model, data, "val", limit=5) == pytest.approx(1.0)


# -- stubs with the recorded-attention interface --------------------------------------------------------------
class _ForcedAttention(nn.Module):
    """Records, for every word of the first caption, attention one-hot on a chosen region per layer:
    `right[layer]` True = the ground-truth region, False = another real region. `aligned` is always right, or
    with `word_agnostic` one-hot at every step on the caption's first grounded region; with `ungrounded_elsewhere`
    the words no region grounds attend one-hot to a region neither class word names (else uniformly)."""

    def __init__(self, data, split, right=(True, True), heads=2, word_agnostic=False, ungrounded_elsewhere=False):
        super().__init__()
        self.decoder = nn.ModuleList(nn.Identity() for _ in right)
        self.right, self.heads, self.word_agnostic = right, heads, word_agnostic
        self.ungrounded_elsewhere = ungrounded_elsewhere
        grounding = data.grounding()
        self.regions = {}
        for img in data.images(split):
            feats, _ = data.region_features(img.image_id)
            self.regions[feats.tobytes()] = grounding[img.image_id]["sentences"][0]
        self.record, self._last = False, []

    def record_attention(self, on=True):
        self.record, self._last = on, []

    def recorded_attention(self):
        return self._last

    def forward(self, feats, region_mask, tokens):
        b, t = tokens.shape
        r = feats.shape[1]
        truth = torch.full((b, t), -1)
        for i in range(b):
            words = self.regions[feats[i].numpy().tobytes()][:t]
            truth[i, : len(words)] = torch.tensor(words)
        n = region_mask.sum(-1)  # real regions per image
        uniform = region_mask[:, None, :].float() / n[:, None, None]  # (B, 1, R)

        def one_hot(index):  # (B, T) -> (B, H, T, R), uniform where index < 0
            idx = index.clamp(0, r - 1)
            hot = nn.functional.one_hot(idx, r).float()
            out = torch.where((index >= 0)[..., None], hot, uniform.expand(b, t, r))
            return out[:, None].expand(b, self.heads, t, r)

        wrong = torch.where(truth >= 0, (truth + 1) % n[:, None], truth)
        aligned = truth
        if self.ungrounded_elsewhere:  # the lowest region index no class word of the caption names
            other = torch.tensor([min(set(range(r)) - set(row[row >= 0].tolist())) for row in truth])  # (B,)
            aligned = torch.where(truth >= 0, truth, other[:, None])
        if self.word_agnostic:
            first = torch.stack([row[row >= 0][0] for row in truth])  # (B,) the first-mentioned object
            aligned = first[:, None].expand(b, t)
        self._last = [{"attention": one_hot(truth if ok else wrong), "aligned": one_hot(aligned)} for ok in self.right]
        return torch.zeros(b, t, 5), None


def _grounded_words(data, split, max_len=20):
    g = data.grounding()
    return sum(1 for img in data.images(split) for r in g[img.image_id]["sentences"][0][:max_len] if r >= 0)


def test_attention_on_the_ground_truth_region_scores_one(root):
    data = _data(root)
    model = _ForcedAttention(data, "val", right=(True, False))
    acc = grounding_accuracy(model, data, "val", batch_size=2)
    assert acc["words"] == _grounded_words(data, "val") > 0
    assert acc["aligned"] == [1.0, 1.0] and acc["aligned_mean"] == 1.0
    assert acc["attention"] == [1.0, 0.0]
    model = _ForcedAttention(data, "val", right=(False, False))
    acc = grounding_accuracy(model, data, "val", batch_size=5)
    assert acc["attention"] == [0.0, 0.0] and acc["attention_mean"] == 0.0


def test_word_agnostic_control_is_far_below_perfect_grounding(root):
    """On the synthetic set a perfectly grounded attention scores 1 and its word-agnostic control (one region per
    caption) 0.5, since every caption grounds two words in two different regions; an attention that is itself
    word-agnostic gains nothing over its control."""
    data = _data(root)
    g = data.grounding()
    chance = [1.0 / g[img.image_id]["regions"] for img in data.images("val")
              for r in g[img.image_id]["sentences"][0] if r >= 0]
    perfect = grounding_accuracy(_ForcedAttention(data, "val"), data, "val", batch_size=2)
    assert perfect["aligned_mean"] == 1.0 and perfect["subject_object"] == 1.0
    assert perfect["control"] == 0.5
    assert perfect["aligned_mean"] - perfect["control"] >= 0.3
    assert perfect["chance"] == pytest.approx(float(np.mean(chance)))
    agnostic = grounding_accuracy(_ForcedAttention(data, "val", word_agnostic=True), data, "val", batch_size=5)
    assert agnostic["aligned_mean"] == agnostic["control"] == 0.5
    assert agnostic["subject_object"] == 0.5  # right on the first object's word, wrong on the second's


def test_the_control_reads_the_grounded_words_only(root):
    """Where the words no region grounds ("a", "and", "in a park") attend does not move the control: a perfectly
    grounded attention that sends all of them to one other region keeps control 0.5 (averaged over every word,
    that other region would win and the control would be 0)."""
    data = _data(root)
    elsewhere = grounding_accuracy(_ForcedAttention(data, "val", ungrounded_elsewhere=True), data, "val", batch_size=2)
    assert elsewhere["aligned_mean"] == 1.0 and elsewhere["control"] == 0.5


@pytest.mark.slow
def test_a_short_training_run_reports_every_diagnostic(root, tmp_path):
    """One epoch of a tiny model: the final epoch's metrics carry each diag/ scalar, finite and in range; the
    baseline (no mask network) has no mask metrics rather than NaN ones."""
    common = {"diag/grounding/accuracy", "diag/grounding/control", "diag/grounding/lift", "diag/grounding/chance",
              "diag/grounding/subject_object", "diag/kendall/attention", "diag/jsd/layer0", "diag/jsd/layer1"}
    for fusion in ("gate", "none"):
        cfg = _cfg(root, fusion).replace({"train.xe_epochs": 1, "train.batch_size": 50, "train.warmup": 20,
                                          "train.diag_images": 5, "train.diag_kendall_images": 2})
        seen: list[dict] = []
        train(cfg, report=lambda m, d: seen.append(m), output_dir=tmp_path / fusion)
        diag = {k: v for k, v in seen[-1].items() if k.startswith("diag/")}
        masked = {"diag/mask_mean", "diag/kendall/mask"}
        assert common <= set(diag) and (masked <= set(diag)) == (fusion == "gate"), sorted(diag)
        assert all(isinstance(v, float) and math.isfinite(v) for v in diag.values())
        for key in ("accuracy", "control", "chance", "subject_object"):
            assert 0.0 <= diag[f"diag/grounding/{key}"] <= 1.0
        assert diag["diag/grounding/lift"] == pytest.approx(diag["diag/grounding/accuracy"]
                                                            - diag["diag/grounding/control"])
        assert 0.1 < diag["diag/grounding/chance"] < 0.3  # 1 / (4-7 regions)
        assert all(-1.0 <= v <= 1.0 for k, v in diag.items() if "/kendall/" in k)
        assert all(0.0 <= v <= LN2 for k, v in diag.items() if "/jsd/" in k)
        if fusion == "gate":
            assert 0.0 < diag["diag/mask_mean"] < 1.0
        else:
            assert diag["diag/jsd/layer0"] == 0.0
    # Diagnostics leave training alone: with them only after the last epoch, the first epoch's loss is the same.
    # A study's rungs (train.diag_epochs) add epochs: a trial stopped at a rung ends with its diagnostics.
    runs = {}
    for name, every, rungs in (("every", 1, []), ("last", 0, []), ("rung", 0, [1])):
        cfg = _cfg(root, "gate").replace({"train.xe_epochs": 2, "train.batch_size": 50, "train.diag_every": every,
                                          "train.diag_epochs": rungs, "train.diag_images": 5,
                                          "train.diag_kendall_images": 2})
        runs[name] = []
        train(cfg, report=lambda m, d: runs[name].append(m), output_dir=tmp_path / name)
    assert "diag/grounding/accuracy" in runs["every"][0] and "diag/grounding/accuracy" not in runs["last"][0]
    assert runs["rung"][0]["diag/grounding/accuracy"] == runs["every"][0]["diag/grounding/accuracy"]
    assert runs["every"][1]["train/loss"] == runs["last"][1]["train/loss"] == runs["rung"][1]["train/loss"]
    assert runs["every"][1]["diag/grounding/accuracy"] == runs["last"][1]["diag/grounding/accuracy"]


def test_grounding_skips_regions_cut_by_max_regions(root):
    """With max_regions 3, a word grounded in region 4 has no features: it is not counted (neither hit nor miss)."""
    data = _data(root, max_regions=3)
    g = data.grounding()
    expected = sum(1 for img in data.images("val") for r in g[img.image_id]["sentences"][0] if 0 <= r < 3)
    cut = sum(1 for img in data.images("val") for r in g[img.image_id]["sentences"][0] if r >= 3)
    assert cut > 0  # the case is exercised
    acc = grounding_accuracy(_ForcedAttention(data, "val"), data, "val", batch_size=5)
    assert acc["words"] == expected
    assert acc["aligned"] == [1.0, 1.0]


def test_grounding_counts_only_encoded_words(root):
    """Captions cut to max_caption_len: the attention at a cut word's position is never scored."""
    cfg = _cfg(root)
    raw = cfg.to_dict()
    raw["data"]["max_caption_len"] = 4
    cfg = Config.from_dict(raw)
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    acc = grounding_accuracy(_ForcedAttention(data, "val"), data, "val", batch_size=5)
    assert acc["words"] == _grounded_words(data, "val", max_len=4)
    assert acc["aligned"] == [1.0, 1.0]


def test_grounding_needs_ground_truth(root, tmp_path):
    data = _data(root)
    data.paths.grounding = tmp_path / "missing.json"
    data._grounding = None
    with pytest.raises(ValueError, match="ground-truth regions"):
        grounding_accuracy(_ForcedAttention(_data(root), "val"), data, "val")


class _KnownImportance(RecordingStub):
    """Every word's probability depends on the regions only through S = sum_i c_i h_i[0], so the gradient
    importance of region i is |d p(y_t) / d S| * c_i: its ranking over regions is the ranking of c.
    The recorded attention and mask are fixed vectors chosen by the test."""

    def __init__(self, vocab_size, c, attention, mask):
        super().__init__(attention, mask)  # per layer: (R,) vectors
        self.c = c  # (R,)
        self.word = torch.linspace(-2.0, 2.0, vocab_size)

    def encode(self, feats, region_mask):
        return feats[..., :3] * 0.01

    def decode(self, tokens, mem, region_mask, mode="aligned"):
        b, t = tokens.shape
        s = (mem[..., 0] * self.c).sum(-1)  # (B,)
        logits = s[:, None, None] * self.word + 0.1 * tokens[..., None].float()  # (B, T, V)
        self._record(lambda x: x.expand(b, 2, t, len(self.c)))
        return logits, None


def test_kendall_importance_on_a_case_with_known_importance(root):
    data = _data(root)
    r = 10
    c = torch.linspace(0.5, 3.0, r)  # importance rises with the region index
    rng = np.random.default_rng(4)
    shuffled = torch.tensor(rng.permutation(r), dtype=torch.float32)
    attention = [c / c.sum(), c.flip(0) / c.sum(), shuffled]
    mask = [1.0 - c / 4.0, c / 4.0, torch.full((r,), 0.5)]  # perturbation 1 - m: same order, reversed, constant
    model = _KnownImportance(len(data.vocab), c, attention, mask)
    taus = kendall_importance(model, data, "val", limit=4, batch_size=2)
    # The third layer's expected tau: rows are (image, word) over the image's real regions (the first n).
    expected = []
    for batch in data.loader("val", 4, limit=4):
        for b in range(len(batch["image_ids"])):
            n = int(batch["region_mask"][b].sum())
            words = int((batch["captions"][b, 0, 1:] != 0).sum())
            expected += [kendalltau(shuffled[:n].numpy(), c[:n].numpy()).statistic] * words
    assert taus["attention"] == pytest.approx([1.0, -1.0, float(np.mean(expected))], abs=1e-9)
    assert taus["mask"][:2] == pytest.approx([1.0, -1.0], abs=1e-9)
    assert math.isnan(taus["mask"][2])  # a constant mask ranks nothing

"""The attention diagnostics against independent references on toy inputs small enough to check by hand
(2-3 regions, 2 heads, 2 layers): JSD (paper Eq. 13) against a closed form and scipy's `jensenshannon` (which
is the square root of the divergence, natural log by default), the mask mean against a hand sum, Kendall's tau
against `scipy.stats.kendalltau` (tau-b) and the gradient importance tau_it = |d p(y_t|x) / d h_i| (Sec. 3) against
its closed form, and grounding accuracy against hand-counted hits. Every value to 1e-6 or better."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.stats import kendalltau

from a2core.diagnostics import attention_jsd, grounding_accuracy, js_divergence, kendall_importance, kendall_tau, \
    mask_mean
from tests.stubmodels import RecordingStub

TOL = 1e-6


def _model(layers=2, heads=2, mask=True):
    """What the pass-reading diagnostics need of a model."""
    return SimpleNamespace(decoder=[None] * layers, cfg=SimpleNamespace(heads=heads), has_mask_network=mask)


def _jsd_ref(p, q):
    return jensenshannon(np.asarray(p, float), np.asarray(q, float)) ** 2  # natural log; squared: the divergence


# -- Jensen-Shannon divergence (Eq. 13) ---------------------------------------------------------------------------
def test_js_divergence_two_regions_by_hand_and_scipy():
    # p = (1/2, 1/2), q = (1, 0): M = (3/4, 1/4); KL(p||M) = 1/2 ln(4/3), KL(q||M) = ln(4/3): D = 3/4 ln(4/3).
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])
    assert float(js_divergence(p, q)) == pytest.approx(0.75 * math.log(4 / 3), abs=TOL)
    assert float(js_divergence(p, q)) == pytest.approx(_jsd_ref(p, q), abs=TOL)
    assert float(js_divergence(q, p)) == pytest.approx(_jsd_ref(p, q), abs=TOL)  # symmetric
    assert float(js_divergence(q, torch.tensor([0.0, 1.0]))) == pytest.approx(math.log(2), abs=TOL)  # disjoint


def test_js_divergence_keeps_its_relative_precision_on_small_divergences():
    """A barely moved attention (a layer whose alignment changes little) has JSD ~ 1e-7: float32 logs cancelled to
    errors of the same size; the divergence is computed in float64."""
    for d in (1e-2, 1e-3, 3e-4, 1e-4):
        p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.5 + d, 0.5 - d])  # float32 inputs, as recorded
        ref = _jsd_ref(p.double(), q.double())
        assert float(js_divergence(p, q)) == pytest.approx(ref, rel=1e-4, abs=1e-15)


def _pass(attention, aligned, tgt, region_mask, mask=None):
    layers = []
    for i in range(len(attention)):
        rec = {"attention": torch.tensor(attention[i]), "aligned": torch.tensor(aligned[i])}
        if mask is not None:
            rec["mask"] = torch.tensor(mask[i])
        layers.append(rec)
    return {"image_ids": torch.tensor([7]), "tgt": torch.tensor(tgt), "region_mask": torch.tensor(region_mask),
            "layers": layers}


# One image, 2 heads, 3 decoder positions (the last a pad target), 3 region slots (the last padded).
# Per layer (1, H=2, T=3, R=3). Aligned weights are unnormalised, as Eq. 6-9 leave them.
TGT = [[5, 2, 0]]  # a word, <eos>, <pad>
RMASK = [[True, True, False]]
ATT = [
    [[[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.3, 0.7, 0.0]],
      [[0.9, 0.1, 0.0], [0.6, 0.4, 0.0], [0.1, 0.9, 0.0]]]],
    [[[[0.25, 0.75, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]],
      [[0.5, 0.5, 0.0], [0.7, 0.3, 0.0], [0.5, 0.5, 0.0]]]],
]
ALI = [
    [[[[2.0, 0.0, 0.0], [0.2, 0.8, 0.0], [9.0, 1.0, 0.0]],  # (1, 0); the same; pad row: never read
      [[0.45, 0.05, 0.0], [0.3, 0.9, 0.0], [0.1, 0.9, 0.0]]]],  # (0.9, 0.1) scaled; (1/4, 3/4)
    [[[[0.5, 0.5, 0.0], [1.5, 1.5, 0.0], [0.5, 0.5, 0.0]],
      [[0.5, 0.5, 0.0], [0.7, 0.3, 0.0], [0.5, 0.5, 0.0]]]],
]


def test_attention_jsd_two_heads_two_regions_against_scipy():
    """Mean over (image, head, real target word) of D(alpha, alpha_a / sum alpha_a), per layer; the pad position
    and the padded region do not count."""
    passes = [_pass(ATT, ALI, TGT, RMASK)]
    expected = []
    for att, ali in zip(ATT, ALI):
        rows = [_jsd_ref(np.array(att[0][h][t][:2]) / sum(att[0][h][t][:2]),
                         np.array(ali[0][h][t][:2]) / sum(ali[0][h][t][:2])) for h in range(2) for t in range(2)]
        expected.append(float(np.mean(rows)))
    # by hand, layer 0: head 0 word 0 = 3/4 ln(4/3), word 1 = 0; head 1 word 0 = 0, word 1 = D((.6,.4), (.25,.75))
    m = np.array([0.425, 0.575])
    d = 0.5 * sum(a * math.log(a / b) for a, b in zip([0.6, 0.4], m)) \
        + 0.5 * sum(a * math.log(a / b) for a, b in zip([0.25, 0.75], m))
    assert expected[0] == pytest.approx((0.75 * math.log(4 / 3) + d) / 4, abs=1e-12)
    # layer 1: only head 0 moves: word 0 (1/4, 3/4) -> (1/2, 1/2), word 1 (1, 0) -> (1/2, 1/2) = 3/4 ln(4/3)
    assert expected[1] == pytest.approx((_jsd_ref([0.25, 0.75], [0.5, 0.5]) + 0.75 * math.log(4 / 3)) / 4,
                                        abs=1e-12)
    got = attention_jsd(_model(), None, passes=passes)
    assert got == pytest.approx(expected, abs=TOL)


def test_attention_jsd_averages_over_every_row_of_every_pass():
    """Two passes (batches) weigh by their rows, not per batch."""
    one = _pass(ATT, ALI, TGT, RMASK)
    short = _pass(ATT, ALI, [[5, 0, 0]], RMASK)  # only word 0 real
    got = attention_jsd(_model(), None, passes=[one, short])
    for i, (att, ali) in enumerate(zip(ATT, ALI)):
        rows = [_jsd_ref(np.array(att[0][h][t][:2]) / sum(att[0][h][t][:2]),
                         np.array(ali[0][h][t][:2]) / sum(ali[0][h][t][:2])) for h in range(2) for t in range(2)]
        rows += [_jsd_ref(np.array(att[0][h][0][:2]) / sum(att[0][h][0][:2]),
                          np.array(ali[0][h][0][:2]) / sum(ali[0][h][0][:2])) for h in range(2)]
        assert got[i] == pytest.approx(float(np.mean(rows)), abs=TOL)


# -- mask mean (Fig. 4) -------------------------------------------------------------------------------------------
def test_mask_mean_over_layers_heads_real_words_and_real_regions():
    mask = [
        [[[[0.1, 0.3, 0.99], [0.5, 0.7, 0.99], [0.99, 0.99, 0.99]],
          [[0.2, 0.4, 0.99], [0.6, 0.8, 0.99], [0.99, 0.99, 0.99]]]],
        [[[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
          [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]]],
    ]
    passes = [_pass(ATT, ALI, TGT, RMASK, mask)]
    # real: words 0-1, regions 0-1; layer 0: (0.1+0.3+0.5+0.7 + 0.2+0.4+0.6+0.8) = 3.6; layer 1: 2 + 0 + 2 = 4.0
    assert mask_mean(_model(), None, passes=passes) == pytest.approx((3.6 + 4.0) / 16, abs=TOL)
    assert math.isnan(mask_mean(_model(mask=False), None, passes=passes))


# -- Kendall tau ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x, y, by_hand", [
    ([1.0, 2.0], [2.0, 1.0], -1.0),
    ([0.3, 0.7], [0.1, 0.9], 1.0),
    ([1.0, 2.0, 3.0], [1.0, 3.0, 2.0], 1 / 3),  # 2 concordant, 1 discordant of 3 pairs
    ([1.0, 1.0, 2.0], [1.0, 2.0, 3.0], 2 / math.sqrt(6)),  # tau-b: 2 / sqrt(2 * 3) (tau-a would be 2/3)
    ([1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 2.0, 3.0], 3 / math.sqrt(4 * 5)),  # ties in both
])
def test_kendall_tau_is_tau_b_by_hand_and_scipy(x, y, by_hand):
    x, y = np.array(x), np.array(y)
    assert kendall_tau(x, y) == pytest.approx(by_hand, abs=TOL)
    assert kendall_tau(x, y) == pytest.approx(kendalltau(x, y, variant="b").statistic, abs=TOL)


def test_kendall_tau_of_a_constant_ranking_is_nan():
    assert np.isnan(kendall_tau(np.array([0.5, 0.5]), np.array([1.0, 2.0])))


# Gradient importance with a closed form. Regions' encoder states h_i in R^2; every word's logits depend on them
# only through s = sum_i c_i . h_i, so d p(y_t) / d h_i = (d p(y_t) / d s) c_i and |grad| (L2) = |dp/ds| ||c_i||:
# the ranking over regions is that of ||c_i||_2, whatever the word. The c_i are chosen so that the L1 norm and
# the signed sum of the gradient rank the regions differently from the L2 norm (and both differently from each
# other), so the test tells |.|_2 from those readings.
C = torch.tensor([[1.0, 0.0], [0.6, 0.6], [-0.95, -0.5], [5.0, 5.0]])  # the last region is padding
L2 = C[:3].norm(dim=-1).numpy()  # 1.0, 0.849, 1.073: region 1 < 0 < 2
L1 = C[:3].abs().sum(-1).numpy()  # 1.0, 1.2, 1.45: region 0 < 1 < 2
SIGNED = C[:3].sum(-1).numpy()  # 1.0, 1.2, -1.45: region 2 < 0 < 1


class _Data:
    """One image, 3 real regions of 4 slots, first caption <bos> 4 5 <eos> <pad>."""

    def loader(self, split, batch_size, limit=None):
        yield {"image_ids": torch.tensor([7]), "feats": torch.zeros(1, 4, 2),
               "region_mask": torch.tensor([[True, True, True, False]]),
               "captions": torch.tensor([[[1, 4, 5, 2, 0]] * 5])}


class _ClosedForm(RecordingStub):
    def __init__(self, attention, mask, vocab=6):
        super().__init__(attention, mask)  # per layer (H, T, R)
        self.w = torch.linspace(-1.0, 1.5, vocab)

    def encode(self, feats, region_mask):
        return feats + 0.1  # h_i = 0.1 for every component

    def decode(self, tokens, mem, region_mask, mode="aligned"):
        s = (mem * C).sum((-1, -2))  # (B,)
        logits = s[:, None, None] * self.w + 0.3 * tokens[..., None].float()  # (B, T, V)
        self._record(lambda x: x[None])  # one image
        return logits, None


def test_gradient_importance_is_the_l2_norm_of_dp_dh():
    """Check the closed form itself with autograd: |d p(y_t)/d h_i| = |dp/ds| ||c_i||."""
    model = _ClosedForm([], [])
    h = (torch.zeros(1, 4, 2) + 0.1).requires_grad_(True)
    logits, _ = model.decode(torch.tensor([[1, 4, 5, 2]]), h, None)
    p = logits.softmax(-1)[0, 1, 5]
    (g,) = torch.autograd.grad(p, h)
    ratio = g[0].norm(dim=-1)[:3].numpy() / L2
    assert np.allclose(ratio, ratio[0], rtol=1e-5) and ratio[0] > 0


def test_kendall_importance_per_word_then_averaged_against_scipy():
    """Rows are (word, layer): the head-averaged, row-normalised attention (and 1 - m, head-averaged) over the real
    regions against the L2 gradient importance; tau-b per real target word (3 here, <eos> included; its uniform
    attention and constant mask rank nothing, NaN, and are left out), then the mean over words. Layer 0's attention follows the L2 ranking on word 0 and the L1 ranking on word 1; layer 1's the
    signed-gradient ranking on both."""
    def heads(*rows):  # rows per position -> (H=2, T=4, R=4); head 1 = 3 * head 0 (unnormalised, same rows)
        a = torch.tensor([list(r) + [0.0] for r in rows] + [[0.25] * 4] * (4 - len(rows)))
        a0 = a / a.sum(-1, keepdim=True)
        return torch.stack([a0, a0 * 3.0])

    att0 = heads(L2, L1)
    att1 = heads(SIGNED - SIGNED.min() + 0.1, SIGNED - SIGNED.min() + 0.1)
    # mask: perturbation 1 - m follows L2 on word 0; on word 1 the two heads disagree and only their mean ranks
    m0 = torch.ones(2, 4, 4)
    m0[:, 0, :3] = torch.tensor(1.0 - L2 / 2.0)
    m0[0, 1, :3] = torch.tensor([0.9, 0.1, 0.5])
    m0[1, 1, :3] = torch.tensor([0.1, 0.5, 0.2])  # mean (0.5, 0.3, 0.35): 1 - m = (0.5, 0.7, 0.65)
    m1 = torch.full((2, 4, 4), 0.5)  # constant: no ranking
    model = _ClosedForm([att0, att1], [m0, m1])
    taus = kendall_importance(model, _Data(), "val", limit=1, batch_size=1)

    def tau(x):
        return kendalltau(np.asarray(x), L2, variant="b").statistic

    assert tau(L1) == pytest.approx(1 / 3) and tau(SIGNED) == pytest.approx(-1.0)  # the readings differ
    expected_att = [np.mean([tau(L2), tau(L1)]), np.mean([tau(SIGNED), tau(SIGNED)])]
    assert expected_att == pytest.approx([2 / 3, -1.0], abs=1e-12)
    assert taus["attention"] == pytest.approx(expected_att, abs=TOL)
    expected_mask0 = np.mean([tau(L2 / 2.0), tau([0.5, 0.7, 0.65])])  # 1 and tau((.5,.7,.65), L2) = -1/3
    assert taus["mask"][0] == pytest.approx(expected_mask0, abs=TOL)
    assert taus["mask"][0] == pytest.approx(1 / 3, abs=TOL)
    assert math.isnan(taus["mask"][1])
    assert not model.record


# -- grounding accuracy (synthetic data; not in the paper: the module docstring's definition) ----------------------
class _Grounded:
    """Image 7: 3 regions in the grounding file, 2 kept by max_regions; caption "a dog and cat on x" whose words
    1, 3 and 5 are grounded in regions 0, 1 and 2 (region 2 cut)."""

    def grounding(self):
        return {7: {"regions": 3, "sentences": [[-1, 0, -1, 1, -1, 2]]}}


def _grounding_pass():
    t, r = 7, 3  # targets: 6 words then <eos>
    tgt = torch.tensor([[5, 6, 7, 8, 9, 10, 2]])
    rmask = torch.tensor([[True, True, False]])

    def rows(**at):  # per position: (head 0, head 1) rows over the 2 real regions; uniform elsewhere
        a = torch.full((1, 2, t, r), 0.5)
        a[..., 2] = 0.0
        for pos, (h0, h1) in at.items():
            a[0, 0, int(pos[1:]), :2] = torch.tensor(h0)
            a[0, 1, int(pos[1:]), :2] = torch.tensor(h1)
        return a

    # Layer 0: word 1 (region 0): raw head mean favours region 1, row-normalised mean region 0.
    #          word 3 (region 1): both heads favour region 1.
    att0 = rows(t1=([0.9, 0.1], [0.4, 0.6]), t3=([0.2, 0.8], [0.3, 0.7]))
    ali0 = rows(t1=([0.09, 0.01], [1.0, 1.5]), t3=([0.6, 0.4], [0.7, 0.3]))  # normalised: (.65, .35); (.65, .35)
    # Layer 1: word 1 -> region 1 (miss) in both kinds; word 3 -> region 1 (hit).
    att1 = rows(t1=([0.3, 0.7], [0.3, 0.7]), t3=([0.1, 0.9], [0.1, 0.9]))
    ali1 = rows(t1=([0.2, 0.8], [0.4, 0.6]), t3=([0.45, 0.55], [0.45, 0.55]))
    return {"image_ids": torch.tensor([7]), "tgt": tgt, "region_mask": rmask,
            "layers": [{"attention": att0, "aligned": ali0}, {"attention": att1, "aligned": ali1}]}


def test_grounding_accuracy_by_hand():
    g = grounding_accuracy(_model(), _Grounded(), passes=[_grounding_pass()])
    assert g["words"] == 2  # words 1 and 3; word 5's region was cut
    # attention: layer 0 word 1 mean (.65, .35) hit, word 3 hit; layer 1 word 1 miss, word 3 hit
    assert g["attention"] == pytest.approx([1.0, 0.5], abs=TOL)
    # aligned (rows normalised first): layer 0 word 1 (.9,.1)/(.4,.6) -> (.65,.35) hit; word 3 (.65,.35) miss;
    # layer 1 word 1 (.3,.7) miss, word 3 (.45,.55) hit
    assert g["aligned"] == pytest.approx([0.5, 0.5], abs=TOL)
    # layer means: attention word 1 ((.65,.35)+(.3,.7))/2 = (.475,.525) miss; word 3 ((.25,.75)+(.1,.9))/2 hit
    assert g["attention_mean"] == pytest.approx(0.5, abs=TOL)
    # aligned word 1 ((.65,.35)+(.3,.7))/2 miss; word 3 ((.65,.35)+(.45,.55))/2 = (.55,.45) miss
    assert g["aligned_mean"] == pytest.approx(0.0, abs=TOL)
    assert g["chance"] == pytest.approx(0.5, abs=TOL)  # 1 / 2 kept regions per word
    # control: the mean of the layer-mean aligned rows of words 1 and 3: ((.475,.525)+(.55,.45))/2 = (.5125, .4875)
    # -> region 0, right for word 1 only
    assert g["control"] == pytest.approx(0.5, abs=TOL)
    # subject_object: word 1 region 0 .475 > .525? no; word 3 region 1 .45 > .55? no
    assert g["subject_object"] == pytest.approx(0.0, abs=TOL)


def test_synthetic_first_caption_lines_up_with_its_grounding(tmp_path):
    """The diagnostics read the loader's first caption against grounding.json's first sentence: the grounded
    positions are the class words (after their colour), every other position is not one."""
    from a2core.config import Config
    from a2core.data import synthetic
    from a2core.data.dataset import CaptionData

    synthetic.generate(tmp_path / "synth", seed=3, images=40)
    cfg = Config.from_dict({"data": {"root": str(tmp_path / "synth"), "images": 40, "seed": 3},
                            "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 10}})
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    grounding = data.grounding()
    checked = 0
    for batch in data.loader("val", 5):
        for b, image_id in enumerate(batch["image_ids"].tolist()):
            words = [data.vocab.words[int(i)] for i in batch["captions"][b, 0, 1:] if int(i) > 2]
            regions = grounding[image_id]["sentences"][0][: len(words)]
            for t, r in enumerate(regions):
                assert (words[t] in synthetic.CLASSES) == (r >= 0), (words, regions)
                if r >= 0:
                    assert words[t - 1] in synthetic.COLOURS and r < grounding[image_id]["regions"]
                    checked += 1
    assert checked > 0

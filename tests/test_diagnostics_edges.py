"""The attention diagnostics on edge inputs, against scipy (`jensenshannon`, the square root of the divergence,
natural log by default; `kendalltau`, tau-b by default) or an exact reference: barely moved rows (JSD ~ 1e-16,
never negative), exact zeros (masked regions) in half precision, Kendall's tau of unsigned integers, and a batch
whose images have different numbers of real regions, one of them a single region (tau undefined, kept out)."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.stats import kendalltau

from a2core.diagnostics import attention_jsd, js_divergence, kendall_importance, kendall_tau
from tests.stubmodels import RecordingStub


def _jsd_exact(p, q) -> float:
    """Eq. 13 in exact rational arithmetic for rows that barely differ (|x| <= 1e-3 below): per region
    s / 4 * g(x), s = p + q, x = (p - q) / s, g(x) = sum_k x^(2k) / (k (2k - 1)); six terms leave < x^14."""
    total = Fraction(0)
    for a, b in zip(np.asarray(p, np.float64).tolist(), np.asarray(q, np.float64).tolist()):
        s = Fraction(a) + Fraction(b)
        if s == 0:
            continue
        x = (Fraction(a) - Fraction(b)) / s
        assert abs(x) <= Fraction(1, 1000)
        total += s / 4 * sum(x ** (2 * k) / (k * (2 * k - 1)) for k in range(1, 7))
    return float(total)


def _barely_moved(n=200, regions=7, seed=0, move=6e-8, dtype=torch.float32):
    """(n, R) attention rows (the last two regions masked: exact zeros) and the same rows with up to `move` of mass
    moved between two real regions (6e-8: a few float32 ulps, as a layer whose alignment hardly changes records)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, regions, generator=g, dtype=torch.float64), -1)
    p[:, -2:] = 0.0
    p = (p / p.sum(-1, keepdim=True)).to(dtype)
    q = p.clone()
    d = (torch.rand(n, generator=g, dtype=torch.float64) * move).to(dtype)
    q[:, 0] += d
    q[:, 1] -= d
    return p, q


def test_js_divergence_of_barely_moved_rows_is_non_negative_and_keeps_its_relative_precision():
    """Summing each distribution's logs cancelled to errors of ~1e-17 whatever the divergence: float32 rows moved by
    a few ulps (true JSD ~1e-16) came out off by up to tens of percent, float64 rows moved by 1e-11 negative."""
    p, q = _barely_moved()
    expected = np.array([_jsd_exact(a, b) for a, b in zip(p.double().numpy(), q.double().numpy())])
    got = js_divergence(p, q)  # (n,) float32 in, float32 out
    assert np.allclose(got.double().numpy(), expected, rtol=1e-6, atol=0)
    p, q = _barely_moved(move=1e-11, dtype=torch.float64)
    got = js_divergence(p, q)
    assert bool((got >= 0).all())
    expected = np.array([_jsd_exact(a, b) for a, b in zip(p.numpy(), q.numpy())])
    assert np.allclose(got.numpy(), expected, rtol=1e-9, atol=0)


def test_attention_jsd_of_a_barely_moved_layer_keeps_its_precision():
    """What a user reads as `diag/jsd/layer{i}` (the report's Fig. 6): for a layer whose alignment moved its float32
    rows by a few ulps the mean was off by percents, lost in the rounding noise of the logs."""
    p, q = _barely_moved(n=8, seed=3)
    # one image, 8 heads, one real word then a pad position; (1, H=8, T=2, R=7)
    att = torch.stack([p, p], 1)[None]
    ali = torch.stack([q, q * 2.0], 1)[None]  # the pad row is never read
    passes = [{"image_ids": torch.tensor([0]), "tgt": torch.tensor([[4, 0]]),
               "region_mask": torch.tensor([[True] * 5 + [False] * 2]),
               "layers": [{"attention": att, "aligned": ali}]}]
    model = type("M", (), {"decoder": [None], "cfg": type("C", (), {"heads": 8})()})()
    (got,) = attention_jsd(model, None, passes=passes)
    # the diagnostic divides each row by its float64 sum first (float32 rows do not sum to exactly 1)
    rows = [(a / a.sum(), b / b.sum()) for a, b in zip(p.double().numpy(), q.double().numpy())]
    expected = float(np.mean([_jsd_exact(a, b) for a, b in rows]))
    assert expected > 0 and got == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_js_divergence_with_masked_regions_in_half_precision_against_scipy(dtype):
    """Exact zeros (masked regions) in one or both rows: 0 ln 0 = 0, no NaN; identical rows exactly 0; the result
    in the inputs' dtype, equal to scipy's squared distance on the same (rounded) values."""
    p = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.5, 0.0]]).to(dtype)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.5, 0.0]]).to(dtype)
    got = js_divergence(p, q)
    assert got.dtype == dtype
    expected = [jensenshannon(a, b) ** 2 for a, b in zip(p.double().numpy(), q.double().numpy())]
    assert np.allclose(got.double().numpy(), expected, rtol=torch.finfo(dtype).eps, atol=0)
    assert float(got[1]) == pytest.approx(math.log(2), rel=torch.finfo(dtype).eps)  # disjoint: ln 2
    assert float(got[2]) == 0.0 and float(js_divergence(p, p).abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.bool_])
def test_kendall_tau_of_unsigned_and_boolean_rankings_against_scipy(dtype):
    """x_i - x_j of unsigned integers wrapped around (1 - 2 = 255), so every pair read as concordant (tau 1
    instead of -1); bool arrays have no subtraction at all (TypeError)."""
    x = np.array([1, 2, 3, 0, 0]).astype(dtype)  # bool: (T, T, T, F, F)
    y = np.array([3, 2, 1, 4, 4]) if dtype is not np.bool_ else np.array([0, 1, 0, 0, 1])
    y = y.astype(dtype)
    expected = kendalltau(x.astype(float), y.astype(float)).statistic
    assert kendall_tau(x, y) == pytest.approx(expected, abs=1e-12)


# Gradient importance with a closed form (as in test_diagnostics_reference, batched): every word's logits depend on
# an image's encoder states only through s_b = sum_i c_i . h_bi, so |d p(y_t) / d h_bi| = |dp/ds_b| ||c_i||.
C = torch.tensor([[1.0, 0.0], [0.6, 0.6], [-0.95, -0.5], [5.0, 5.0]])
L2 = C[:3].norm(dim=-1).numpy()  # 1.0, 0.849, 1.073


class _TwoImages:
    """Image 0: 3 real regions of 4; image 1: a single real region. First captions <bos> 4 5 <eos> / <bos> 4 <eos>."""

    def loader(self, split, batch_size, limit=None):
        caps = torch.tensor([[[1, 4, 5, 2]] * 5, [[1, 4, 2, 0]] * 5])
        yield {"image_ids": torch.tensor([0, 1]), "feats": torch.zeros(2, 4, 2),
               "region_mask": torch.tensor([[True, True, True, False], [True, False, False, False]]),
               "captions": caps}


class _ClosedForm(RecordingStub):
    def __init__(self, attention, mask):
        super().__init__(attention, mask)  # per layer (B, H, T, R)
        self.w = torch.linspace(-1.0, 1.5, 6)

    def encode(self, feats, region_mask):
        return feats + 0.1

    def decode(self, tokens, mem, region_mask, mode="aligned"):
        s = (mem * C).sum((-1, -2))  # (B,)
        logits = s[:, None, None] * self.w + 0.3 * tokens[..., None].float()  # (B, T, V)
        self._record(lambda x: x)
        return logits, None


def test_kendall_importance_keeps_a_single_region_image_and_ties_out_of_the_means():
    """A batch of two images with 3 and 1 real regions: the single region's tau is undefined (NaN, as scipy's) and
    must neither poison the mean nor count; image 0's rows carry ties in attention (tau-b) and a constant mask
    (NaN, left out), and its padded slot holds attention that must not be ranked."""
    att = torch.zeros(2, 2, 3, 4)  # (B, H, T, R)
    att[0, :, 0] = torch.tensor([0.2, 0.2, 0.6, 0.0])  # a tie between regions 0 and 1
    att[0, :, 1] = torch.tensor([0.5, 0.2, 0.3, 0.0])
    att[0, :, 2] = torch.tensor([0.3, 0.1, 0.2, 0.4])  # <eos>; the padded slot gets weight (not ranked)
    att[1, :, :, 0] = 1.0
    mask = torch.full((2, 2, 3, 4), 0.5)
    mask[0, 0, 0, :3] = torch.tensor([0.9, 0.2, 0.4])
    model = _ClosedForm([att], [mask])
    taus = kendall_importance(model, _TwoImages(), "val", limit=2, batch_size=2)

    def tau(x):
        return kendalltau(np.asarray(x), L2).statistic  # tau-b

    expected_att = np.mean([tau([0.2, 0.2, 0.6]), tau([0.5, 0.2, 0.3]), tau([0.3, 0.1, 0.2])])
    assert taus["attention"] == pytest.approx([expected_att], abs=1e-9)
    # 1 - head-averaged m on word 0 of image 0: 1 - (0.7, 0.35, 0.45); the rest constant (NaN, left out)
    assert taus["mask"] == pytest.approx([tau([0.3, 0.65, 0.55])], abs=1e-9)

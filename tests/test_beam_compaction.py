"""Beam search drops an image from the batch once all its hypotheses have ended, with the same captions and scores
as keeping it to the end (one model, the uncached reference, an ensemble, the min-length wrapper)."""
import pytest
import torch

from a2core.config import ModelConfig
from a2core.decode import EnsembleStepper, MinLengthStepper, ModelStepper, UncachedStepper, beam_search
from a2core.model.a2 import build_model


class Kept:
    """The stepper it wraps, without `select_rows`: every image stays in the batch to the last step. Counts the
    rows of each step."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def init_state(self, feats, region_mask):
        return self.inner.init_state(feats, region_mask)

    def expand_state(self, state, k):
        return self.inner.expand_state(state, k)

    def step(self, last, state):
        self.rows.append(last.shape[0])
        return self.inner.step(last, state)

    def reorder_state(self, state, index):
        return self.inner.reorder_state(state, index)


class Counted(Kept):
    def select_rows(self, state, index):
        return self.inner.select_rows(state, index)


def _models(n):
    torch.manual_seed(0)
    models = []
    for _ in range(n):
        cfg = ModelConfig(d_model=32, layers=2, heads=4, d_ff=64, dropout=0.0, feature_dim=16, max_regions=6,
                          fusion="gate")
        model = build_model(cfg, vocab_size=30).eval()
        with torch.no_grad():
            model.head.weight[2] += 1.0 * torch.randn(32)  # <eos> likely for some images early, late for others
        models.append(model)
    return models


@pytest.mark.parametrize("make", [
    lambda ms: ModelStepper(ms[0]),
    lambda ms: UncachedStepper(ms[0]),
    lambda ms: EnsembleStepper(ms),
    lambda ms: MinLengthStepper(EnsembleStepper(ms), eos=2, min_len=1),
], ids=["model", "uncached", "ensemble", "min-length"])
@pytest.mark.slow
def test_finished_images_leave_the_batch_with_the_same_results(make):
    models = _models(3)
    torch.manual_seed(0)
    feats = torch.randn(12, 6, 16)
    rmask = torch.ones(12, 6, dtype=torch.bool)
    rmask[3, 2:] = False
    kept, counted = Kept(make(models)), Counted(make(models))
    seq_k, score_k = beam_search(kept, feats, rmask, beam_size=5, max_len=15)
    seq_c, score_c = beam_search(counted, feats, rmask, beam_size=5, max_len=15)
    assert torch.equal(seq_c, seq_k)
    assert torch.equal(score_c, score_k)
    # the first step runs once per image (an image's beams start identical), then on 5 beams per image
    assert kept.rows == [12] + [60] * (len(kept.rows) - 1) and len(counted.rows) == len(kept.rows)
    assert counted.rows[0] == 12 and counted.rows[-1] < 60 and sum(counted.rows) < sum(kept.rows)  # images left
    assert counted.rows[1:] == sorted(counted.rows[1:], reverse=True)

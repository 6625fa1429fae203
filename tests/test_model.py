"""The A2 model's math: fusions (Eq. 5-10) against hand-computed values, the mask loss's gradient, `none` as a
plain Transformer, and cached beam search against the uncached reference. (Eq. 4's reduction, the two mask
networks, the training step against the reference math and precision: tests/test_a2_objective.py.)"""
import math

import pytest
import torch
import torch.nn as nn

from a2core.config import ModelConfig
from a2core.decode import EnsembleStepper, UncachedStepper, beam_search, greedy
from a2core.model.a2 import A2CrossAttention, build_model, next_word_logp


def small(fusion="gate", **kw):
    kw.setdefault("temperature", 100.0 if fusion == "exp_decay" else None)
    return ModelConfig(d_model=32, layers=2, heads=4, d_ff=64, dropout=0.0, feature_dim=16, max_regions=6,
                       fusion=fusion, **kw)


# a: one head, one step, three regions; m: keep, half, drop.
A = torch.tensor([[[[0.5, 0.3, 0.2]]]])
M = torch.tensor([[[[1.0, 0.5, 0.0]]]])
# a_m = a * exp(1 - m) = [0.5, 0.3 e^0.5, 0.2 e] = [0.5, 0.4946164, 0.5436564]
A_M = [0.5, 0.4946164, 0.5436564]


@pytest.mark.parametrize("fusion,expected", [
    ("max", A_M),                                            # Eq. 6: max(a, a_m) = a_m since exp(1-m) >= 1
    ("moving_average", [0.55, 0.3494616, 0.2543656]),        # Eq. 7: a + 0.1 a_m
    ("exp_decay", [0.5, 0.3765751, 0.3352186]),              # Eq. 8: s=50, T_P=100: e^-0.5 a + (1-e^-0.5) a_m
    ("gate", [0.5, 0.3973082, 0.3718282]),                   # Eq. 9-10: W_g = 0, b_g = 0 -> g = 0.5
])
def test_fusion_equations_against_hand_computed_values(fusion, expected):
    cfg = small(fusion, eta=0.1)
    assert cfg.renormalize is False  # the paper's equations as written are the default
    cfg.heads = 1
    layer = A2CrossAttention(cfg)
    q = torch.randn(1, 1, 1, 32)
    fused = layer.fuse(A, M, q, step=50.0)
    assert torch.allclose(fused.flatten(), torch.tensor(expected), atol=1e-6)
    # Renormalised (the variant `model.renormalize: true`): the same weights divided by their sum.
    layer.renormalize = True
    renorm = layer.fuse(A, M, q, step=50.0).flatten()
    assert torch.allclose(renorm, torch.tensor(expected) / sum(expected), atol=1e-6)
    assert math.isclose(float(renorm.sum().detach()), 1.0, rel_tol=1e-6)


def test_gate_uses_the_query():
    cfg = small("gate", renormalize=False)
    cfg.heads = 1
    layer = A2CrossAttention(cfg)
    with torch.no_grad():
        layer.gate_w.fill_(1.0)
        layer.gate_b.fill_(-1.0)
    q = torch.full((1, 1, 1, 32), 0.05)  # w.q + b = 1.6 - 1 = 0.6
    g = 1 / (1 + math.exp(-0.6))
    expected = [g * a + (1 - g) * am for a, am in zip([0.5, 0.3, 0.2], A_M)]
    assert torch.allclose(layer.fuse(A, M, q, 0.0).flatten(), torch.tensor(expected), atol=1e-6)


def test_perturbed_attention_and_penalty_follow_eq3_and_eq4():
    torch.manual_seed(0)
    cfg = small("gate")
    layer = A2CrossAttention(cfg).eval()
    x, enc = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    rmask = torch.ones(2, 5, dtype=torch.bool)
    rmask[1, 3:] = False
    mem = layer.memory(enc)
    words = torch.tensor([[True, True, False], [True, True, True]])
    layer.record = True
    _, penalty = layer(x, mem, rmask, mode="perturbed", word_mask=words)
    rec = layer.last
    a, m = rec["attention"], rec["mask"]
    expected = m * a + (1 - m) * a.mean(1, keepdim=True)
    assert torch.allclose(rec["aligned"], expected, atol=1e-6)
    # ||1 - m||^2 over real regions of each real word, averaged over the 4 heads (summed over words here).
    per_row = (((1 - m) ** 2) * rmask[:, None, None, :]).sum(-1)  # (B, H, T)
    assert torch.isclose(penalty, (per_row * words[:, None, :]).sum() / 4)
    assert float(a[1, :, :, 3:].abs().max()) == 0.0  # padded regions get no attention


def test_mask_loss_gradient_reaches_only_the_mask_network():
    torch.manual_seed(0)
    model = build_model(small("gate"), vocab_size=20)
    feats, rmask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    tok = torch.randint(4, 20, (2, 7))
    logits, penalty = model(feats, rmask, tok[:, :-1], mode="perturbed", word_mask=tok[:, 1:] != 0)
    loss = -nn.functional.cross_entropy(logits.reshape(-1, 20), tok[:, 1:].reshape(-1)) + 0.035 * penalty
    mask_params = model.mask_parameters()
    loss.backward(inputs=mask_params)
    assert mask_params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in mask_params)
    assert all(p.grad is None for p in model.captioner_parameters())
    # ... and the captioner's own loss does not move the mask network (m is detached in the aligned pass).
    model.zero_grad(set_to_none=True)
    logits, _ = model(feats, rmask, tok[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, 20), tok[:, 1:].reshape(-1)).backward()
    assert all(p.grad is None for p in mask_params)
    assert model.decoder[0].cross.gate_w.grad is not None  # the gate is the captioner's


def test_none_fusion_is_a_plain_transformer():
    """Weights copied into torch.nn's post-norm Transformer layers give the same logits."""
    torch.manual_seed(0)
    cfg = small("none")
    model = build_model(cfg, vocab_size=30).eval()
    assert model.mask_parameters() == []
    d = cfg.d_model
    enc_layers = [nn.TransformerEncoderLayer(d, cfg.heads, cfg.d_ff, 0.0, batch_first=True) for _ in range(cfg.layers)]
    dec_layers = [nn.TransformerDecoderLayer(d, cfg.heads, cfg.d_ff, 0.0, batch_first=True) for _ in range(cfg.layers)]
    with torch.no_grad():
        for ours, ref in zip(model.encoder, enc_layers):
            ref.self_attn.in_proj_weight.copy_(ours.attn.qkv.weight)
            ref.self_attn.in_proj_bias.copy_(ours.attn.qkv.bias)
            ref.self_attn.out_proj.load_state_dict(ours.attn.out.state_dict())
            ref.linear1.load_state_dict(ours.ff[0].state_dict())
            ref.linear2.load_state_dict(ours.ff[3].state_dict())
            ref.norm1.load_state_dict(ours.norm1.state_dict())
            ref.norm2.load_state_dict(ours.norm2.state_dict())
        for ours, ref in zip(model.decoder, dec_layers):
            ref.self_attn.in_proj_weight.copy_(ours.self_attn.qkv.weight)
            ref.self_attn.in_proj_bias.copy_(ours.self_attn.qkv.bias)
            ref.self_attn.out_proj.load_state_dict(ours.self_attn.out.state_dict())
            ref.multihead_attn.in_proj_weight.copy_(torch.cat([ours.cross.q.weight, ours.cross.kv.weight]))
            ref.multihead_attn.in_proj_bias.copy_(torch.cat([ours.cross.q.bias, ours.cross.kv.bias]))
            ref.multihead_attn.out_proj.load_state_dict(ours.cross.out.state_dict())
            ref.linear1.load_state_dict(ours.ff[0].state_dict())
            ref.linear2.load_state_dict(ours.ff[3].state_dict())
            for i in (1, 2, 3):
                getattr(ref, f"norm{i}").load_state_dict(getattr(ours, f"norm{i}").state_dict())
    feats = torch.randn(3, 6, 16)
    rmask = torch.ones(3, 6, dtype=torch.bool)
    rmask[2, 4:] = False
    tok = torch.randint(4, 30, (3, 8))
    with torch.no_grad():
        ours, _ = model(feats, rmask, tok)
        x = model.region_in(feats)
        for layer in enc_layers:
            x = layer(x, src_key_padding_mask=~rmask)
        y = model.embed(tok) * math.sqrt(d) + model.pos[:8]
        causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
        for layer in dec_layers:
            y = layer(y, x, tgt_mask=causal, memory_key_padding_mask=~rmask)
        ref = model.head(y)
    assert torch.allclose(ours, ref, atol=1e-4)


@pytest.mark.parametrize("fusion", ["none", "gate", "exp_decay"])
def test_cached_beam_search_equals_uncached(fusion):
    torch.manual_seed(1)
    model = build_model(small(fusion), vocab_size=25).double().eval()
    model.train_step.fill_(40)
    feats = torch.randn(4, 6, 16, dtype=torch.float64)
    rmask = torch.ones(4, 6, dtype=torch.bool)
    rmask[1, 2:] = False
    seq_c, score_c = beam_search(model, feats, rmask, beam_size=5, max_len=12)
    seq_u, score_u = beam_search(UncachedStepper(model), feats, rmask, beam_size=5, max_len=12)
    assert torch.equal(seq_c, seq_u)
    assert torch.allclose(score_c, score_u, atol=1e-9)
    assert torch.equal(greedy(model, feats, rmask, 12), greedy(UncachedStepper(model), feats, rmask, 12))


def test_long_cached_beam_search_equals_uncached_in_float32():
    """Past the key/value cache's first capacity (16 positions) and with every hypothesis running to max_len
    (<eos> made unlikely): the same captions as re-running the prefix, scores within float32 rounding."""
    torch.manual_seed(2)
    model = build_model(small("gate"), vocab_size=25).eval()
    with torch.no_grad():
        model.head.weight[2] -= 3.0 * model.head.weight[2].sign()  # <eos> unlikely: all steps run
    feats = torch.randn(3, 6, 16)
    rmask = torch.ones(3, 6, dtype=torch.bool)
    rmask[2, 4:] = False
    seq_c, score_c = beam_search(model, feats, rmask, beam_size=5, max_len=20)
    seq_u, score_u = beam_search(UncachedStepper(model), feats, rmask, beam_size=5, max_len=20)
    assert seq_c.shape[1] == 21 and torch.equal(seq_c, seq_u)
    torch.testing.assert_close(score_c, score_u, rtol=1e-5, atol=1e-4)


def test_kv_cache_rows_are_selected_and_grown_like_concatenated_tensors():
    from a2core.model.a2 import KVCache

    torch.manual_seed(0)
    steps = [torch.randn(4, 1, 6) for _ in range(20)]
    cache, reference = KVCache(), torch.zeros(4, 0, 6)
    for t, kv in enumerate(steps):
        assert torch.equal(cache.append(kv), torch.cat([reference, kv], 1))
        reference = torch.cat([reference, kv], 1)
        index = torch.randint(0, 4, (4,))
        cache, reference = cache.select(index, reuse=True), reference[index]  # the spare buffer is written
    assert cache.length == 20 and torch.equal(cache.buf[:, :20], reference)
    fewer = cache.select(torch.tensor([3, 0]))
    assert torch.equal(fewer.buf[:, :20], reference[[3, 0]]) and torch.equal(cache.buf[:, :20], reference)
    assert torch.equal(cache.repeat(2).buf[:, :20], reference.repeat_interleave(2, 0))
    # with autograd the keys are concatenated, never written in place (the backward pass needs them)
    grad = KVCache()
    x = torch.randn(2, 1, 6, requires_grad=True)
    (grad.append(x).sum() + grad.append(x * 2).sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


def test_decoding_past_the_models_positions_is_a_clear_error():
    model = build_model(small("gate"), vocab_size=25, max_len=6).eval()  # 8 positions
    feats, rmask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    assert beam_search(model, feats, rmask, beam_size=2, max_len=7)[0].shape[0] == 2  # 8 steps: fits
    with pytest.raises(ValueError, match="positions up to 9 requested; this model has 8"):
        beam_search(model, feats, rmask, beam_size=2, max_len=8)


def test_no_search_generates_pad_or_bos_however_much_the_model_favours_them():
    """<pad> and <bos> are no caption's word: nothing trains their logits down (the loss ignores <pad> targets), so
    a young model gives them mass. Here the head favours them by e^50; greedy, beam search (its k beams), an ensemble
    and SCST sampling still write only words, each caption ending in <eos>, with finite scores. Before, greedy
    wrote <pad> at every step, which the vocabulary decodes to an empty caption."""
    from a2core.decode import EnsembleStepper, sample

    torch.manual_seed(3)
    model = build_model(small("gate"), vocab_size=25).eval()
    favour = torch.zeros(25)
    favour[:2] = 50.0  # <pad>, <bos>
    model.head = nn.Sequential(model.head, Shift(favour))
    feats, rmask = torch.randn(3, 6, 16), torch.ones(3, 6, dtype=torch.bool)

    def words_then_eos(rows):
        for row in rows.tolist():
            end = row.index(2) if 2 in row else len(row)
            assert all(w >= 2 for w in row[:end]), row  # words (and <eos>) only up to the end
            assert all(w == 0 for w in row[end + 1:]), row  # pad after <eos> is the layout, not a word

    words_then_eos(greedy(model, feats, rmask, 8))
    beams, scores = beam_search(model, feats, rmask, beam_size=4, max_len=8, all_beams=True)
    words_then_eos(beams.flatten(0, 1))
    assert torch.isfinite(scores).all()
    words_then_eos(beam_search(EnsembleStepper([model, model]), feats, rmask, beam_size=3, max_len=8)[0])
    tokens, logps, valid = sample(model, feats, rmask, n=4, max_len=8)
    words_then_eos(tokens)
    assert torch.isfinite(logps[valid]).all()


class Shift(nn.Module):
    """Adds a fixed vector to the logits (a head that favours some ids)."""

    def __init__(self, shift):
        super().__init__()
        self.register_buffer("shift", shift)

    def forward(self, x):
        return x + self.shift


def test_beam_search_finds_at_least_the_greedy_score_and_one_model_ensemble_is_the_model():
    torch.manual_seed(2)
    model = build_model(small("gate"), vocab_size=25).double().eval()
    feats = torch.randn(3, 6, 16, dtype=torch.float64)
    rmask = torch.ones(3, 6, dtype=torch.bool)
    seq, score = beam_search(model, feats, rmask, beam_size=5, max_len=10)
    g = greedy(model, feats, rmask, 10)
    # Score of the greedy sequence under the model (teacher forcing).
    with torch.no_grad():
        for b in range(3):
            words = [w for w in g[b].tolist()]
            words = words[: words.index(2) + 1] if 2 in words else words + [2]
            inp = torch.tensor([[1] + words[:-1]])
            logits, _ = model(feats[b:b + 1], rmask[b:b + 1], inp)
            greedy_score = next_word_logp(logits[0])[torch.arange(len(words)), torch.tensor(words)].sum()
            assert float(score[b]) >= float(greedy_score) - 1e-9
    seq1, score1 = beam_search(EnsembleStepper([model]), feats, rmask, beam_size=5, max_len=10)
    assert torch.equal(seq, seq1) and torch.allclose(score, score1)

"""Eq. 4 as trained: its reduction (lambda keeps its weight under padding, batch size and depth), both mask
networks, the stage-1 step against the reference math (per-caption memory, explicit softmax self-attention,
a second encoder pass), the cheaper schedule, precision, and configs of older checkpoints."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from a2core import precision
from a2core.config import Config, ModelConfig
from a2core.errors import ConfigError
from a2core.model.a2 import build_model
from a2core.train import Updates, caption_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, R_MAX, FEAT = 20, 6, 16
NEG_INF = -1e9


def config(fusion="gate", layers=2, mask_net="content", train=None, **model):
    raw = {"model": {"d_model": 32, "layers": layers, "heads": 4, "d_ff": 64, "dropout": 0.0, "feature_dim": FEAT,
                     "max_regions": R_MAX, "fusion": fusion, "mask_net": mask_net, **model},
           "train": {"warmup": 10, "mask_lr": 1e-2, **(train or {})}}
    return Config.from_dict(raw)


def batch(images=2, captions=5, regions=(4, 6), length=7, seed=0):
    """feats (B, R_MAX, FEAT), region mask (B, R_MAX), captions (B, C, L): <bos> words <eos> <pad>.."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(images, R_MAX, FEAT, generator=g)
    mask = torch.arange(R_MAX)[None, :] < torch.tensor(regions[:images])[:, None]
    caps = torch.randint(4, V, (images, captions, length), generator=g)
    caps[..., 0] = 1
    for i in range(images):
        for c in range(captions):
            end = 3 + (i + c) % (length - 3)
            caps[i, c, end] = 2
            caps[i, c, end + 1:] = 0
    return feats * mask[..., None], mask, caps


def mask_objective(model, lam, feats, mask, tokens):
    """Eq. 4 as the mask step computes it: tokens (N, L), N = B * C."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    logits, penalty = model(feats, mask, inp, mode="perturbed", word_mask=tgt != 0)
    return -caption_loss(logits, tgt) + lam * penalty


# -- Eq. 4's reduction -----------------------------------------------------------------------------------------
def constant_model(layers, mask_net, bias=0.5):
    """A model whose per-word loss is known: zero word embeddings (tied to the output layer) give uniform word
    distributions, cross-entropy log V at every word; a mask network of zero weights and bias b gives
    m = sigmoid(b) at every head, word and region."""
    model = build_model(config(layers=layers, mask_net=mask_net).model, V)
    with torch.no_grad():
        model.embed.weight.zero_()
        for layer in model.decoder:
            for p in layer.cross.mask_parameters():
                p.zero_()
            (layer.cross.mask_bias if mask_net == "content" else layer.cross.mask_lin.bias).fill_(bias)
    return model


@pytest.mark.parametrize("mask_net", ["content", "linear"])
def test_mask_objective_is_a_fixed_per_word_value_under_padding_batch_and_depth(mask_net):
    lam, b, real_regions = 0.035, 0.5, 4
    per_word = -math.log(V) + lam * real_regions * (1 - 1 / (1 + math.exp(-b))) ** 2
    feats, mask, caps = batch(images=2, captions=1, regions=(real_regions, real_regions), length=7)
    tokens = caps.view(2, -1)
    cases = {
        "base": (feats, mask, tokens),
        "pad words": (feats, mask, F.pad(tokens, (0, 5))),
        "pad regions": (feats[:, :5], mask[:, :5], tokens),  # 5 slots instead of 6, same 4 real regions
        "batch x3": (feats.repeat(3, 1, 1), mask.repeat(3, 1), tokens.repeat(3, 1)),
    }
    for layers in (1, 3):
        model = constant_model(layers, mask_net, b)
        for name, args in cases.items():
            got = mask_objective(model, lam, *args).item()
            assert got == pytest.approx(per_word, rel=1e-5), (layers, name)


@pytest.mark.parametrize("mask_net", ["content", "linear"])
def test_mask_objective_of_a_trained_like_model_ignores_padding_and_batch_size(mask_net):
    torch.manual_seed(0)
    model = build_model(config(mask_net=mask_net).model, V)
    feats, mask, caps = batch(images=2, captions=3)
    tokens = caps.view(6, -1)
    base = mask_objective(model, 0.035, feats, mask, tokens).item()
    padded_words = mask_objective(model, 0.035, feats, mask, F.pad(tokens, (0, 4))).item()
    padded_regions = F.pad(feats, (0, 0, 0, 2)), F.pad(mask, (0, 2))  # two more (padded) region slots
    model_8 = build_model(config(mask_net=mask_net, max_regions=8).model, V)
    state = model.state_dict()
    if mask_net == "linear":  # slot logits of 8 slots per head, the first 6 as before
        for key in [k for k in state if "mask_lin" in k]:
            w = state[key].view(4, R_MAX, -1)
            state[key] = torch.cat([w, torch.zeros(4, 2, w.shape[-1])], 1).view(4 * 8, -1).squeeze(-1)
    model_8.load_state_dict(state)
    more_slots = mask_objective(model_8, 0.035, *padded_regions, tokens).item()
    doubled = mask_objective(model, 0.035, feats.repeat(2, 1, 1), mask.repeat(2, 1),
                             caps.repeat(2, 1, 1).view(12, -1)).item()
    assert padded_words == pytest.approx(base, abs=1e-5)
    assert more_slots == pytest.approx(base, abs=1e-5)
    assert doubled == pytest.approx(base, abs=1e-5)


def test_the_perturbed_pass_needs_the_word_mask():
    model = build_model(config().model, V)
    feats, mask, caps = batch(captions=1)
    with pytest.raises(ValueError, match="word_mask"):
        model(feats, mask, caps.view(2, -1)[:, :-1], mode="perturbed")


# -- the two mask networks -------------------------------------------------------------------------------------
def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mask_net", ["content", "linear"])
def test_both_mask_networks_train_a_step_and_the_mask_step_moves_only_their_parameters(mask_net):
    torch.manual_seed(0)
    cfg = config(mask_net=mask_net)
    model = build_model(cfg.model, V).train()
    updates = Updates(model, cfg, torch.device("cpu"))
    mask_names = {n for n, p in model.named_parameters() if any(p is q for q in model.mask_parameters())}
    feats, mask, caps = batch()
    before = params(model)
    with torch.no_grad():
        enc = model.encode(feats, mask)
    out = updates.mask_step(enc, mask, caps, step=0)
    after = params(model)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == mask_names and mask_names
    assert math.isfinite(out["train/mask_loss"]) and 0.0 < out["train/mask_mean"] < 1.0
    # A whole stage-1 step moves the captioner too (tied embeddings: one tensor).
    out = updates.xe(feats, mask, caps, step=1)
    moved = {n for n in after if not torch.equal(after[n], params(model)[n])}
    assert moved == set(after) and math.isfinite(out["train/loss"]) and "train/mask_loss" in out


def test_mask_network_sizes_follow_the_formulas():
    d, h, layers = 32, 4, 2
    content = build_model(config(mask_net="content").model, V)
    linear = build_model(config(mask_net="linear").model, V)
    count = lambda m: sum(p.numel() for p in m.mask_parameters())  # noqa: E731
    assert count(content) == layers * (2 * (d * d + d) + h)
    assert count(linear) == layers * h * R_MAX * (d + 1)
    # Paper sizes (d 512, 8 heads, 6 layers, 50 regions): README's figures.
    assert 6 * (2 * (512 * 512 + 512) + 8) == 3_151_920 and 6 * 8 * 50 * 513 == 1_231_200


def test_linear_mask_is_eq2_per_slot_on_the_first_slots():
    torch.manual_seed(0)
    cross = build_model(config(mask_net="linear").model, V).decoder[0].cross
    x = torch.randn(1, 3, 32)
    mem = {"k": torch.zeros(1, 4, 5, 8)}  # 5 region slots of an image
    m = cross.mask(x, mem)  # (1, H, 3, 5)
    w, b = cross.mask_lin.weight.view(4, R_MAX, 32), cross.mask_lin.bias.view(4, R_MAX)
    expected = torch.sigmoid(torch.einsum("hrd,td->htr", w, x[0]) + b[:, None, :])[..., :5]
    assert torch.allclose(m[0], expected, atol=1e-6)


# -- the step against the reference math -------------------------------------------------------------------------
def reference_attention(attn, x, key_mask=None, causal=False):
    """The explicit multi-head softmax attention the model used before SDPA."""
    b, n, d = x.shape
    q, k, v = (t.view(b, n, attn.h, d // attn.h).transpose(1, 2) for t in attn.qkv(x).chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // attn.h)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], NEG_INF)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), NEG_INF)
    return attn.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def reference_loss(model, feats, mask, tokens, mode, encode_grad=True):
    """Teacher-forced loss, the old way: its own encoder pass, the encoding and region mask repeated per caption
    (memory per caption), explicit self-attention. Eq. 4's loss for mode 'perturbed', else the caption loss."""
    with torch.set_grad_enabled(encode_grad and torch.is_grad_enabled()):
        x = model.region_in(feats)
        for layer in model.encoder:
            x = layer.norm1(x + reference_attention(layer.attn, x, key_mask=mask))
            x = layer.norm2(x + layer.ff(x))
    c = tokens.shape[0] // feats.shape[0]
    x, mask = x.repeat_interleave(c, 0), mask.repeat_interleave(c, 0)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    words = tgt != 0
    y = model.embed(inp) * math.sqrt(model.cfg.d_model) + model.pos[: inp.shape[1]]
    penalty = 0.0
    for layer in model.decoder:
        y = layer.norm1(y + reference_attention(layer.self_attn, y, causal=True))
        cr, pen = layer.cross(y, layer.cross.memory(x), mask, mode, 0.0, words)
        penalty = penalty + (pen if pen is not None else 0.0)
        y = layer.norm2(y + cr)
        y = layer.norm3(y + layer.ff(y))
    loss = caption_loss(model.head(y), tgt)
    if mode != "perturbed":
        return loss
    return -loss + model.cfg.mask_lambda * penalty / (len(model.decoder) * words.sum())


def grads(loss, params):
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("mask_net", ["content", "linear"])
def test_stage1_step_equals_the_reference_math(mask_net):
    """The mask step on the captioner pass's (detached) encoding and per-image memory, and the captioner step with
    SDPA self-attention, give the losses and gradients of the reference path (fresh encoder pass per step,
    memory per caption, explicit softmax)."""
    torch.manual_seed(0)
    cfg = config(mask_net=mask_net, train={"grad_clip": 0.0})
    model = build_model(cfg.model, V).double().train()  # dropout 0: train mode is deterministic
    ref_model = copy.deepcopy(model)
    feats, mask, caps = batch()
    feats, tokens = feats.double(), caps.view(10, -1)

    # Mask step: what Updates.mask_step computes, against the reference on the same weights.
    updates = Updates(model, cfg, torch.device("cpu"))
    enc = model.encode(feats, mask)
    logits, penalty = model.decode(tokens[:, :-1], model.memory(enc.detach()), mask, mode="perturbed",
                                   word_mask=tokens[:, 1:] != 0)
    ours = -caption_loss(logits, tokens[:, 1:]) + cfg.model.mask_lambda * penalty
    ref = reference_loss(ref_model, feats, mask, tokens, "perturbed", encode_grad=False)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-10)
    for g, r in zip(grads(ours, model.mask_parameters()), grads(ref, ref_model.mask_parameters())):
        assert torch.allclose(g, r, atol=1e-10)

    # Captioner step: aligned attention, gradients of every captioner parameter.
    logits, _ = model.decode(tokens[:, :-1], model.memory(enc), mask)
    ours = caption_loss(logits, tokens[:, 1:])
    ref = reference_loss(ref_model, feats, mask, tokens, "aligned")
    assert ours.item() == pytest.approx(ref.item(), abs=1e-10)
    for g, r in zip(grads(ours, updates.cap_params), grads(ref, ref_model.captioner_parameters())):
        assert torch.allclose(g, r, atol=1e-10)


def assert_step_equals_reference(updates, ref_model, feats, mask, caps, step, mask_captions):
    """One `Updates.xe` against the reference math: the mask loss and the mask network's gradients (left in .grad
    by the step) on the captions the mask step uses, before any update; then the caption loss and every captioner
    gradient with the mask network just updated."""
    model = updates.model
    tokens = caps.reshape(-1, caps.shape[-1])
    ref_mask = reference_loss(ref_model, feats, mask, mask_captions.reshape(-1, caps.shape[-1]), "perturbed")
    ref_mask_grads = grads(ref_mask, ref_model.mask_parameters())
    out = updates.xe(feats, mask, caps, step=step)
    assert out["train/mask_loss"] == pytest.approx(ref_mask.item(), abs=1e-10)
    for p, r in zip(model.mask_parameters(), ref_mask_grads, strict=True):
        assert torch.allclose(p.grad, r, atol=1e-10)
    with torch.no_grad():
        for r, p in zip(ref_model.mask_parameters(), model.mask_parameters()):
            assert not torch.equal(r, p)
            r.copy_(p)
    ref_caption = reference_loss(ref_model, feats, mask, tokens, "aligned")
    assert out["train/loss"] == pytest.approx(ref_caption.item(), abs=1e-10)
    for p, r in zip(updates.cap_params, grads(ref_caption, ref_model.captioner_parameters()), strict=True):
        assert torch.allclose(p.grad, r, atol=1e-10)


@pytest.mark.parametrize("mask_net", ["content", "linear"])
def test_stage1_update_equals_the_reference_math(mask_net):
    """`Updates.xe` as a whole (encoding, region keys/values and the decoder below the first cross-attention
    computed once, shared by both steps): losses and both steps' gradients as the reference path computes them."""
    torch.manual_seed(0)
    cfg = config(mask_net=mask_net, train={"grad_clip": 0.0})
    model = build_model(cfg.model, V).double().train()  # dropout 0: train mode is deterministic
    ref_model = copy.deepcopy(model)
    feats, mask, caps = batch()
    updates = Updates(model, cfg, torch.device("cpu"))
    assert_step_equals_reference(updates, ref_model, feats.double(), mask, caps, 0, caps)


def test_cheaper_schedule_step_equals_the_reference_math_on_its_captions():
    """With `mask_captions: 2` the step's mask loss and gradients are the reference's on the two captions per image
    it picks ((3 * 2 + [0, 1]) % 5 at step 3), its captioner step the reference's on all five."""
    torch.manual_seed(0)
    cfg = config(train={"grad_clip": 0.0, "mask_captions": 2})
    model = build_model(cfg.model, V).double().train()
    ref_model = copy.deepcopy(model)
    feats, mask, caps = batch()
    updates = Updates(model, cfg, torch.device("cpu"))
    assert_step_equals_reference(updates, ref_model, feats.double(), mask, caps, 3, caps[:, [1, 2]])


def test_cheaper_schedule_uses_k_captions_per_image_rotating_with_the_step():
    torch.manual_seed(0)
    feats, mask, caps = batch()
    model = build_model(config().model, V)
    with torch.no_grad():
        enc = model.encode(feats, mask)
    loss = {}
    for name, k, sub, step in (("one", 1, caps, 7), ("ref", None, caps[:, [7 % 5]], 0),
                               ("two", 2, caps, 3), ("ref2", None, caps[:, [1, 2]], 0)):  # (3*2 + [0,1]) % 5
        cfg = config(train={"mask_captions": k})
        updates = Updates(copy.deepcopy(model), cfg, torch.device("cpu"))
        loss[name] = updates.mask_step(enc, mask, sub, step)["train/mask_loss"]
    assert loss["one"] == pytest.approx(loss["ref"], abs=1e-6)
    assert loss["two"] == pytest.approx(loss["ref2"], abs=1e-6)
    assert loss["one"] != pytest.approx(loss["two"], abs=1e-4)


def test_mask_every_skips_mask_steps():
    cfg = config(train={"mask_every": 2})
    updates = Updates(build_model(cfg.model, V), cfg, torch.device("cpu"))
    feats, mask, caps = batch()
    assert ["train/mask_loss" in updates.xe(feats, mask, caps, s) for s in range(4)] == [False, True, False, True]


# -- precision ---------------------------------------------------------------------------------------------------
def test_bf16_and_fp16_steps_on_cpu_track_fp32():
    """Measured (benchmarks/bench_margins.py --cases precision, AMD EPYC, 2026-11-27, seeds 0-4 of the batch and
    the weights x ATEN_CPU_CAPABILITY default and avx2 x 1 and 2 threads): relative difference to fp32 at most
    0.0006 (bf16) and 0.00006 (fp16) in both losses, against the bar of 0.02."""
    feats, mask, caps = batch()
    out, scalers = {}, {}
    for prec in ("fp32", "bf16", "fp16"):
        torch.manual_seed(0)
        cfg = config(train={"precision": prec})
        updates = Updates(build_model(cfg.model, V), cfg, torch.device("cpu"))
        out[prec] = updates.xe(feats, mask, caps, step=0)
        scalers[prec] = updates.scaler
    for prec in ("bf16", "fp16"):
        assert out[prec]["train/loss"] == pytest.approx(out["fp32"]["train/loss"], rel=2e-2)
        assert out[prec]["train/mask_loss"] == pytest.approx(out["fp32"]["train/mask_loss"], rel=2e-2)
    # Loss scaling only for fp16 (its initial scale, 2^16, unless a step overflowed and halved it).
    assert not scalers["fp32"].is_enabled() and not scalers["bf16"].is_enabled()
    assert scalers["fp16"].is_enabled() and scalers["fp16"].get_scale() in (2.0 ** 16, 2.0 ** 15)


def test_decoding_under_autocast_gives_fp32_scores():
    from a2core.decode import beam_search

    torch.manual_seed(0)
    model = build_model(config().model, V).eval()
    feats, mask, _ = batch()
    with precision.autocast("bf16", torch.device("cpu")):
        seqs, scores = beam_search(model, feats, mask, beam_size=3, max_len=5)
    assert scores.dtype == torch.float32 and seqs.shape[0] == 2


def test_precision_is_checked_and_named(monkeypatch):
    with pytest.raises(ConfigError, match="train.precision"):
        Config.from_dict({"train": {"precision": "fp8"}})
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(ConfigError, match="train.precision.*fp16 autocast is not supported on cpu"):
        precision.check("fp16", torch.device("cpu"))
    precision.check("fp32", torch.device("cpu"))  # no autocast needed


# -- defaults and older checkpoints -------------------------------------------------------------------------------
def test_paper_literal_defaults_and_configs_of_older_checkpoints():
    cfg = ModelConfig()
    assert cfg.renormalize is False and cfg.mask_net == "content"
    old = Config.from_dict({"model": {"fusion": "gate", "renormalize": True}})  # stored before mask_net existed
    assert old.model.renormalize is True and old.model.mask_net == "content"
    assert Config().train.mask_captions is None and Config().train.precision == "fp32"
    with pytest.raises(ConfigError, match="model.mask_net"):
        Config.from_dict({"model": {"mask_net": "slots"}})
    with pytest.raises(ConfigError, match="train.mask_captions"):
        Config.from_dict({"train": {"mask_captions": 0}})

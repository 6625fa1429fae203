"""The A2 Transformer: a captioning Transformer over region features whose decoder cross-attention is aligned by
a learnable mask perturbation network (paper Eq. 2-10). One readable file; shapes in comments use::

  B images, C captions per image, N = B * C captions, T caption steps, R regions, H heads, Dh = d_model / H,
  V vocabulary, L decoder layers.

Cross-attention of every decoder layer computes the usual weights  a = softmax(q k^T / sqrt(Dh))  (N, H, T, R) and::

  mask network (Eq. 2)   m in (0, 1)^(N, H, T, R), one value per head, step and region, from the decoder state h_t;
      config `mask_net`:
      content (default)  m = sigmoid(q_m k_m^T / sqrt(Dh) + b_h): h_t is projected to a mask query q_m and scored
                         against mask keys k_m projected from each region's encoding (as the attention calibration
                         work the paper follows does), so the mask follows the region's content, whatever slot
                         it sits in. W_m = (W_qm, W_km) and b_h vary per layer and head: 2 d^2 + 2 d + H per layer.
      linear             m = sigmoid(W_m h_t + b_m), Eq. 2 literally: per layer and head a linear map of h_t to one
                         logit per region slot up to `max_regions` (the first R slots are used): H R_max (d + 1) per
                         layer. Region order carries no meaning in bottom-up features, which a per-slot mask cannot
                         know: slot i is whatever object the detector listed i-th.
      h_t (Eq. 2's "hidden state from the d-th layer", which the paper does not pin down further) is the input of
      layer d's cross-attention, the output of its masked self-attention sublayer: the state its attention query
      is projected from. The layer's own output cannot be used: it depends on the attention the mask aligns.
  perturbed (Eq. 3)      a_p = m * a + (1 - m) * mean_heads(a)     used only in the mask network's own step
                         The mean is over the H heads ("an average vector of attention heads"), per step and region,
                         not over regions; padded regions hold a = 0 in every head, so they stay 0 in a_p. a_p is
                         not renormalised (Eq. 3 as written; the paper says nothing of it): a row sums to 1 only
                         where m is constant over its regions.
  mask objective (Eq. 4) L(theta_m) = -L_IC(a_p) + lambda * P, with L_IC the cross-entropy averaged over real
                         target words and P = ||1 - m||^2 summed over real regions, averaged over heads, real
                         target words and decoder layers:
                             P = 1 / (L H W) * sum_{layer, head, real word, real region} (1 - m)^2,  W real words.
                         Both terms are per-word means, so their ratio (what lambda weighs) does not change with
                         caption length or padding, batch size, region padding or depth.
  Eq. 5                  a_m = a * exp(1 - m)
  fusion (Eq. 6-10)      none: a | max: max(a, a_m) | moving_average: a + eta a_m |
                         exp_decay: e^(-s/T_P) a + (1 - e^(-s/T_P)) a_m |
                         gate: g a + (1 - g) a_m, g = sigmoid(w_h.q + b_h)
      exp_decay          s: the model's `train_step` buffer, the global optimizer steps done before the pass (0 at
                         the first, so training starts from the plain a and moves to a_m, Eq. 8's curriculum), going
                         on through SCST and saved in checkpoints, so decoding uses the s training reached. The paper
                         says "training step", not epoch, and gives no T_P (its Sec. 5.3 calls it S): no default.
      gate               one g per layer, head and step (shared by a row's regions, as Eq. 9's g_t), from that head's
                         attention query q (Eq. 10's q_t, which the paper does not define further); w_h = 0 and
                         b_h = 0 at the start (the paper gives no initialisation): g = 0.5, a and a_m weighed
                         alike until the captioner's loss, which trains the gate, moves it.
  renormalisation        (config `renormalize`, default off, as Eq. 6-9 are written) divides the fused weights by
                         their sum over regions so each row is a distribution again; a searchable variant. The paper
                         does not say whether the fused weights are renormalised (moving_average's rows sum to more
                         than 1, max's too); the default keeps its equations literal.

Note a_m >= a elementwise (exp(1 - m) > 1), so `max` equals a_m, as Eq. 6 implies.
In the captioner's pass m is detached: the mask is supervision for the captioner, and the mask network is
trained only by its adversarial objective (Eq. 4, see `a2core.train`). `fusion: none` builds no mask network
and is exactly a plain Transformer.

The C captions of an image are adjacent rows; cross-attention views them as one sequence of C * T queries per
image against that image's region keys, so the region memory is computed and held once per image, not per caption.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig

# <pad> (0) and <bos> (1) of every vocabulary (a2core.data.captions.SPECIALS) are never a caption's next word: the
# cross-entropy ignores <pad> targets and no target is <bos>, so nothing trains their logits down, and an untrained
# or barely trained model gives them real mass (a sampled <pad> is a silent hole in an SCST caption)
NOT_A_NEXT_WORD = 2  # ids below it


def next_word_logp(logits: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) of the next word -> log-probabilities (..., V) over the words a caption can hold (<pad> and <bos>
    at -inf), in fp32 under autocast. Every generation (greedy, beam, sampling, ensembles) steps through it."""
    logits = logits.clone()  # a slice, with a graph when sampling for SCST: the fill must not write into it
    logits[..., :NOT_A_NEXT_WORD] = float("-inf")
    return logits.log_softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, N, d) -> (B, H, N, Dh)"""
    b, n, d = x.shape
    return x.view(b, n, h, d // h).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, Dh) -> (B, N, d)"""
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)


class KVCache:
    """Past keys and values of one self-attention layer for step-by-step decoding: N rows (captions or beams) of
    `length` positions, held as one (N, capacity, 2 d) tensor, keys in [..., :d] and values in [..., d:] (heads
    merged, as the qkv projection returns them).

    Without autograd a step writes its position into free capacity (no growing concatenation, which re-copies the
    whole cache every step), and beam search's reorder (`select(index, reuse=True)`) copies the rows with one
    index_select of the cache's 2-d (N, length * 2d) view, the fast kernel (a 4-d index_select is >10x slower on
    CPU), into the spare buffer of the previous reorder (no fresh allocation, whose page faults cost more than the
    copy). With autograd (SCST sampling) every step concatenates into a new tensor: writing into a buffer in
    place would overwrite keys the backward pass still needs."""

    def __init__(self):
        self.buf: torch.Tensor | None = None  # (N, capacity >= length, 2 d)
        self.length = 0
        self._spare: torch.Tensor | None = None  # a buffer of buf's shape that `select(reuse=True)` may write into

    def append(self, kv: torch.Tensor) -> torch.Tensor:
        """kv (N, n, 2 d) of the n new positions -> every position's keys and values, (N, length + n, 2 d)."""
        end = self.length + kv.shape[1]
        if kv.requires_grad or (self.buf is not None and self.buf.requires_grad):
            self.buf = kv if self.buf is None else torch.cat([self.buf[:, :self.length], kv], dim=1)
            self._spare = None
        else:
            if self.buf is None or self.buf.shape[1] < end:
                grown = kv.new_empty(kv.shape[0], max(end, 16, 2 * self.length), kv.shape[2])
                if self.length:
                    grown[:, :self.length] = self.buf[:, :self.length]
                self.buf, self._spare = grown, None
            self.buf[:, self.length:end] = kv
        self.length = end
        return self.buf[:, :end]

    def select(self, index: torch.Tensor, reuse: bool = False) -> "KVCache":
        """A cache of the rows `index` (N',), e.g. beams reordered or finished images dropped. With `reuse`
        this cache is spent: its buffer becomes the spare of the result, which writes into it at its next reorder
        (beam search keeps only the newest state)."""
        out = KVCache()
        out.length = self.length
        if self.buf is None:
            return out
        if self.buf.requires_grad:
            out.buf = self.buf[:, :self.length].index_select(0, index)
            return out
        n, cap, width = self.buf.shape
        spare = self._spare if reuse else None
        if spare is None or spare.shape[0] != index.numel():
            spare = self.buf.new_empty(index.numel(), cap, width)
        used = self.length * width  # the filled prefix of each row of the (N, capacity * 2 d) view
        torch.index_select(self.buf.view(n, -1)[:, :used], 0, index, out=spare.view(spare.shape[0], -1)[:, :used])
        out.buf = spare
        out._spare = self.buf if reuse and spare.shape[0] == n else None
        return out

    def repeat(self, k: int) -> "KVCache":
        """Every row repeated k times (adjacent)."""
        if self.buf is None:
            return KVCache()
        return self.select(torch.arange(self.buf.shape[0], device=self.buf.device).repeat_interleave(k))


class SelfAttention(nn.Module):
    """Multi-head self-attention (`F.scaled_dot_product_attention`: no weights are needed here, so the fused
    kernel may skip materialising them); `cache` (a `KVCache`) holds past keys/values for step-by-step decoding.

    `sdpa = False` computes the same attention written out (`_attend`: matmul, softmax, dropout, matmul), which
    `torch.func.vmap` batches: `a2core.fused` sets it on the model it maps over the seeds, as torch 2.13 has no
    vmap batching rule for the CPU SDPA kernel and would run it once per seed (with a warning)."""

    sdpa = True

    def __init__(self, d: int, h: int, dropout: float):
        super().__init__()
        self.h, self.dropout = h, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, key_mask=None, causal=False, cache: KVCache | None = None):
        # x: (B, N, d); key_mask: (B, N) True = attend
        d = x.shape[-1]
        qkv = self.qkv(x)  # (B, N, 3 d): queries, keys, values
        if cache is not None:
            kv = cache.append(qkv[..., d:])  # (B, past + N, 2 d): every position's keys and values
            q, k, v = _heads(qkv[..., :d], self.h), _heads(kv[..., :d], self.h), _heads(kv[..., d:], self.h)
        else:
            q, k, v = (_heads(t, self.h) for t in qkv.chunk(3, dim=-1))  # (B, H, N, Dh) each
        n, nk = q.shape[2], k.shape[2]
        allowed = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, N_k) True = attend
        is_causal = causal and n > 1 and n == nk
        if causal and 1 < n < nk:  # new positions after cached ones: position i sees keys up to nk - n + i
            allowed = torch.ones(n, nk, dtype=torch.bool, device=x.device).tril(nk - n)
        p = self.dropout if self.training else 0.0
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal, dropout_p=p)
        else:
            out = _attend(q, k, v, allowed, is_causal, p)
        return self.out(_merge(out))  # out: (B, H, N, Dh)


def _attend(q, k, v, allowed, causal: bool, p: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, allowed, p, causal)` written out: q (B, H, N, Dh), k and v
    (B, H, N_k, Dh), allowed broadcastable to (B, H, N, N_k) (True = attend) -> (B, H, N, Dh). A masked key
    gets the dtype's lowest score rather than -inf (a row with no key left is uniform, not NaN)."""
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)  # (B, H, N, N_k); q scaled: the smaller tensor
    if causal:
        n, nk = scores.shape[-2:]
        tril = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
        allowed = tril if allowed is None else allowed & tril
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return F.dropout(scores.softmax(-1), p, training=p > 0) @ v


class A2CrossAttention(nn.Module):
    """Decoder-to-region attention with the mask perturbation network and one of the fusions (module docstring).
    Keeps its weights explicit (not the fused SDPA kernel): A2 reads, perturbs and fuses them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.heads
        self.h, self.fusion, self.mask_net, self.max_regions = h, cfg.fusion, cfg.mask_net, cfg.max_regions
        self.eta, self.temperature, self.renormalize = cfg.eta, cfg.temperature, cfg.renormalize
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(cfg.dropout)
        if self.fusion != "none":
            # Mask perturbation network (theta_m): trained only by the adversarial mask loss.
            if self.mask_net == "content":
                self.mask_q = nn.Linear(d, d)
                self.mask_k = nn.Linear(d, d)
                self.mask_bias = nn.Parameter(torch.full((h,), float(cfg.mask_bias_init)))
            else:  # linear: W_m (H * R_max, d), b_m (H * R_max,)
                self.mask_lin = nn.Linear(d, h * cfg.max_regions)
                nn.init.constant_(self.mask_lin.bias, float(cfg.mask_bias_init))
        if self.fusion == "gate":
            # Eq. 10: g = sigmoid(W_g q + b_g), one gate per layer, head and step.
            self.gate_w = nn.Parameter(torch.zeros(h, d // h))
            self.gate_b = nn.Parameter(torch.zeros(h))
        self.record = False
        self.last: dict[str, torch.Tensor] = {}
        # Mean m over real regions and words in the latest perturbed pass: a 0-dim tensor, read once per step by
        # the trainer (a float() here would wait for the device in the middle of the pass, once per layer).
        self.last_mask_mean = torch.tensor(float("nan"))

    def mask_parameters(self) -> list[nn.Parameter]:
        if self.fusion == "none":
            return []
        if self.mask_net == "content":
            return [*self.mask_q.parameters(), *self.mask_k.parameters(), self.mask_bias]
        return list(self.mask_lin.parameters())

    def memory(self, enc: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-region keys/values of B images, computed once per image and reused by all its captions and steps,
        with the mask network's part (`mask_memory`)."""
        return {**self.kv_memory(enc), **self.mask_memory(enc)}

    def kv_memory(self, enc: torch.Tensor) -> dict[str, torch.Tensor]:
        """The captioner's part of the memory: region keys and values."""
        k, v = (_heads(t, self.h) for t in self.kv(enc).chunk(2, dim=-1))  # (B, H, R, Dh) each
        return {"k": k, "v": v}

    def mask_memory(self, enc: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mask network's own per-region part of the memory (content network: mask keys)."""
        if self.fusion != "none" and self.mask_net == "content":
            return {"mk": _heads(self.mask_k(enc), self.h)}  # (B, H, R, Dh)
        return {}

    def mask(self, x: torch.Tensor, mem: dict) -> torch.Tensor:
        """Eq. 2: m in (0, 1) of shape (B, H, S, R) from decoder states x (B, S, d) of S = C * T queries per image."""
        regions = mem["k"].shape[2]
        if self.mask_net == "content":
            qm = _heads(self.mask_q(x), self.h)  # (B, H, S, Dh)
            logits = qm @ mem["mk"].transpose(-1, -2) / math.sqrt(qm.shape[-1]) + self.mask_bias[None, :, None, None]
        else:
            if regions > self.max_regions:
                raise ValueError(f"{regions} region slots; the linear mask network has {self.max_regions}")
            b, s, _ = x.shape
            logits = self.mask_lin(x).view(b, s, self.h, self.max_regions)[..., :regions].transpose(1, 2)
        return torch.sigmoid(logits)

    def fuse(self, a: torch.Tensor, m: torch.Tensor, q: torch.Tensor, step: float) -> torch.Tensor:
        """Eq. 5-10. a, m: (B, H, S, R); q: (B, H, S, Dh) the attention queries (for the gate)."""
        a_m = a * torch.exp(1.0 - m)
        if self.fusion == "max":
            fused = torch.maximum(a, a_m)
        elif self.fusion == "moving_average":
            fused = a + self.eta * a_m
        elif self.fusion == "exp_decay":
            # step: the model's 0-dim step buffer (read on the device: the pass neither waits for the host nor bakes
            # the step into a captured graph) or a number
            keep = torch.exp(-step / self.temperature) if torch.is_tensor(step) else math.exp(-step / self.temperature)
            fused = keep * a + (1.0 - keep) * a_m
        elif self.fusion == "gate":
            g = torch.sigmoid((q * self.gate_w[None, :, None, :]).sum(-1, keepdim=True)
                              + self.gate_b[None, :, None, None])  # (B, H, S, 1)
            fused = g * a + (1.0 - g) * a_m
        else:
            raise ValueError(f"unknown fusion {self.fusion!r}")
        if self.renormalize:
            fused = fused / fused.sum(-1, keepdim=True).clamp_min(1e-12)
        return fused

    def forward(self, x, mem, region_mask, mode: str = "aligned", step: float = 0.0, word_mask=None):
        """x: (N, T, d) states of N = B * C captions (an image's C captions adjacent); mem and region_mask (B, R)
        (True = real region) of the B images. Returns (N, T, d) and, in mode 'perturbed', Eq. 4's penalty
        ||1 - m||^2 summed over real regions and the real words of word_mask (N, T), averaged over heads."""
        n, t, d = x.shape
        b = region_mask.shape[0]
        if (n % b) if b else n:
            raise ValueError(f"{n} caption rows for {b} images: each image needs the same number of captions")
        # (B, S, d), S = C * T: an image's captions share its region memory. S is spelled out, not -1: an empty batch
        # (B = N = 0) has no C to infer, and reshape(0, -1, d) is refused
        x = x.reshape(b, (n // b if b else 0) * t, d)
        q = _heads(self.q(x), self.h)  # (B, H, S, Dh)
        scores = q @ mem["k"].transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, R)
        valid = region_mask[:, None, None, :]
        a = scores.masked_fill(~valid, torch.finfo(scores.dtype).min).softmax(-1)  # padded regions get 0
        penalty = None
        if self.fusion == "none" or mode == "plain":
            weights, m = a, None
        elif mode == "perturbed":
            m = self.mask(x, mem)
            a_bar = a.mean(dim=1, keepdim=True)  # (B, 1, S, R): average over heads, not zero (Eq. 3)
            weights = m * a + (1.0 - m) * a_bar
            real = valid & word_mask.reshape(b, 1, x.shape[1], 1)  # (B, 1, S, R) real word x real region
            penalty = (((1.0 - m) ** 2) * real).sum() / m.shape[1]
            self.last_mask_mean = (m.detach().float() * real).sum() / (real.sum() * m.shape[1]).clamp_min(1)
        else:
            with torch.no_grad():
                m = self.mask(x, mem)
            weights = self.fuse(a, m, q, step)
        if self.record:
            self.last = {"attention": _per_caption(a.detach(), n, t), "aligned": _per_caption(weights.detach(), n, t)}
            if m is not None:
                self.last["mask"] = _per_caption(m.detach(), n, t)
        out = self.out(_merge(self.drop(weights) @ mem["v"]))  # (B, S, d)
        return out.reshape(n, t, d), penalty


def _per_caption(z: torch.Tensor, n: int, t: int) -> torch.Tensor:
    """(B, H, C * T, R) -> (N, H, T, R): one row per caption, as the recorded attention is read. T is given: an
    empty batch (B = N = 0) has no C to divide S by."""
    b, h, _, r = z.shape
    c = n // b if b else 0
    return z.view(b, h, c, t, r).transpose(1, 2).reshape(n, h, t, r)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = SelfAttention(cfg.d_model, cfg.heads, cfg.dropout)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.ReLU(), nn.Dropout(cfg.dropout),
                                nn.Linear(cfg.d_ff, cfg.d_model))
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, region_mask):
        # Post-norm residual blocks, as in the paper ("layer normalization applied after MHA and FFN").
        x = self.norm1(x + self.drop(self.attn(x, key_mask=region_mask)))
        return self.norm2(x + self.drop(self.ff(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.dropout)
        self.cross = A2CrossAttention(cfg)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.ReLU(), nn.Dropout(cfg.dropout),
                                nn.Linear(cfg.d_ff, cfg.d_model))
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, y, mem, region_mask, mode, step, cache=None, word_mask=None):
        return self.regions_block(self.self_block(y, cache), mem, region_mask, mode, step, word_mask)

    def self_block(self, y, cache=None):
        """The self-attention sublayer, (N, T, d) -> (N, T, d): it sees neither the regions nor the mask network."""
        return self.norm1(y + self.drop(self.self_attn(y, causal=True, cache=cache)))

    def regions_block(self, y, mem, region_mask, mode, step, word_mask=None):
        """Cross-attention and feed-forward sublayers on the self-attention sublayer's output y (N, T, d)."""
        c, penalty = self.cross(y, mem, region_mask, mode, step, word_mask)
        y = self.norm2(y + self.drop(c))
        return self.norm3(y + self.drop(self.ff(y))), penalty


def sinusoid(length: int, d: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    i = torch.arange(0, d, 2, dtype=torch.float32)
    angle = pos / torch.pow(10000.0, i / d)
    pe = torch.zeros(length, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(angle), torch.cos(angle[:, : d // 2])
    return pe


class A2Transformer(nn.Module):
    """Region encoder and caption decoder whose cross-attention is aligned by the mask network (module docstring).

    The mask network's parameters (`mask_parameters`) are trained by their own objective, the rest
    (`captioner_parameters`) by the captioning loss.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_len: int = 64):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        d = cfg.d_model
        self.region_in = nn.Sequential(nn.Linear(cfg.feature_dim, d), nn.ReLU(), nn.Dropout(cfg.dropout),
                                       nn.LayerNorm(d))
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.embed = nn.Embedding(vocab_size, d, padding_idx=0)
        self.register_buffer("pos", sinusoid(max_len + 2, d), persistent=False)
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(d, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied input/output word embeddings
        # Global training step s (Eq. 8), saved with the model so decoding uses the step training reached.
        self.register_buffer("train_step", torch.zeros((), dtype=torch.float64))
        self._init()

    def _init(self):
        for name, p in self.named_parameters():
            if p.dim() > 1 and "gate_w" not in name:
                nn.init.xavier_uniform_(p)

    # -- parameter groups ---------------------------------------------------------------------------------------
    def mask_parameters(self) -> list[nn.Parameter]:
        """The mask networks' parameters, every decoder layer's (empty for fusion `none`)."""
        return [p for layer in self.decoder for p in layer.cross.mask_parameters()]

    def captioner_parameters(self) -> list[nn.Parameter]:
        """Every parameter but the mask networks'."""
        mask = {id(p) for p in self.mask_parameters()}
        return [p for p in self.parameters() if id(p) not in mask]

    @property
    def has_mask_network(self) -> bool:
        return self.cfg.fusion != "none"

    def record_attention(self, on: bool = True) -> None:
        for layer in self.decoder:
            layer.cross.record = on
            layer.cross.last = {}

    def recorded_attention(self) -> list[dict[str, torch.Tensor]]:
        return [layer.cross.last for layer in self.decoder]

    # -- encoder / decoder ----------------------------------------------------------------------------------------
    def encode(self, feats: torch.Tensor, region_mask: torch.Tensor) -> torch.Tensor:
        """feats (B, R, feature_dim), region_mask (B, R) -> (B, R, d)"""
        if feats.dtype == torch.float16:  # batches of a prepared store: widened here, on the device
            feats = feats.to(self.region_in[0].weight.dtype)
        x = self.region_in(feats)
        for layer in self.encoder:
            x = layer(x, region_mask)
        return x

    def memory(self, enc: torch.Tensor, kv: list[dict] | None = None,
               mask_keys: bool = True) -> list[dict[str, torch.Tensor]]:
        """Every decoder layer's region memory of enc (B, R, d): keys/values and, with `mask_keys`, the mask
        network's part. With `kv` (keys/values already computed from the same encoding and weights) only the mask
        network's part is computed."""
        if kv is None:
            kv = [layer.cross.kv_memory(enc) for layer in self.decoder]
        if not mask_keys:
            return kv
        return [{"k": m["k"], "v": m["v"], **layer.cross.mask_memory(enc)} for m, layer in zip(kv, self.decoder)]

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        t = tokens.shape[1]
        if start + t > self.pos.shape[0]:
            raise ValueError(f"caption positions up to {start + t} requested; this model has {self.pos.shape[0]} "
                             "(decode with a smaller max_len or build the model with a larger one)")
        return self.drop(self.embed(tokens) * math.sqrt(self.cfg.d_model) + self.pos[start:start + t])

    def decode_start(self, tokens: torch.Tensor, start: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """The decoder below its first cross-attention: word embeddings and the first layer's self-attention
        sublayer, tokens (N, T) -> (N, T, d). It depends on neither the regions nor the mask network, so the A2
        step computes it once for the mask step and the captioner step (`decode(..., first=)`)."""
        return self.decoder[0].self_block(self._embed(tokens, start), cache)

    def decode(self, tokens, mem, region_mask, mode: str = "aligned", caches=None, start: int = 0, word_mask=None,
               first=None):
        """tokens (N, T) of N = B * C captions (an image's C captions adjacent), mem and region_mask (B, R) of the
        B images -> logits (N, T, V) and, in mode 'perturbed', Eq. 4's penalty P averaged over decoder layers
        (module docstring). word_mask (N, T): True where the target word is real (not pad); perturbed mode only.
        first: `decode_start(tokens, start)` if already computed (it is then used instead)."""
        if mode == "perturbed" and word_mask is None:
            raise ValueError("the perturbed pass needs word_mask (which target words are real)")
        if first is None:
            first = self.decode_start(tokens, start, None if caches is None else caches[0])
        y = first
        step = self.train_step  # (), float64; a tensor, not float(): no host round trip inside a training step
        total = None
        for i, layer in enumerate(self.decoder):
            if i > 0:
                y = layer.self_block(y, None if caches is None else caches[i])
            y, penalty = layer.regions_block(y, mem[i], region_mask, mode, step, word_mask)
            if penalty is not None:
                total = penalty if total is None else total + penalty
        if total is not None:
            total = total / (len(self.decoder) * word_mask.sum().clamp_min(1))
        return self.head(y), total

    def forward(self, feats, region_mask, tokens, mode: str = "aligned", word_mask=None):
        """Teacher forcing. feats (B, R, D), region_mask (B, R); tokens (N, T), N = B * C with each image's C
        captions adjacent. Returns logits (N, T, V) and the mask penalty (None unless mode is 'perturbed')."""
        enc = self.encode(feats, region_mask)
        return self.decode(tokens, self.memory(enc), region_mask, mode, word_mask=word_mask)

    # -- step-by-step decoding -------------------------------------------------------------------------------
    def init_state(self, feats, region_mask) -> dict:
        enc = self.encode(feats, region_mask)
        # contiguous once per image: the keys/values are views into one projection's output, which every step's
        # batched matmul would otherwise copy (B, H, R, Dh) per layer and step
        mem = [{name: t.contiguous() for name, t in m.items()} for m in self.memory(enc)]
        return {"mem": mem, "region_mask": region_mask, "caches": [KVCache() for _ in self.decoder], "t": 0}

    def step(self, last_tokens: torch.Tensor, state: dict) -> torch.Tensor:
        """last_tokens (N,) -> log-probabilities (N, V) of the next word; advances the cached state."""
        logits, _ = self.decode(last_tokens[:, None], state["mem"], state["region_mask"], caches=state["caches"],
                                start=state["t"])
        state["t"] += 1
        return next_word_logp(logits[:, -1])

    @staticmethod
    def reorder_state(state: dict, index: torch.Tensor) -> dict:
        """Select rows (beams) of the per-beam caches: index (N,) into the batch dimension. The state given is
        spent (its cache buffers are reused by the result).

        Beam search only moves rows within the group of one image, and the region memory holds one row per
        image (`ModelStepper.expand_state`), so the memory is left as it is."""
        caches = [c.select(index, reuse=True) for c in state["caches"]]
        return {**state, "caches": caches}


def build_model(cfg: ModelConfig, vocab_size: int, max_len: int = 64) -> A2Transformer:
    """The A2 Transformer of a `model` config section (fusion `none`: a plain Transformer, no mask network).

    Args:
        cfg: The `model` section.
        vocab_size: Words of the vocabulary, the four special tokens included.
        max_len: Longest caption in tokens (positions are encoded up to max_len + 2).
    """
    return A2Transformer(cfg, vocab_size, max_len)

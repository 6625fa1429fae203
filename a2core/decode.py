"""Caption decoding: greedy, sampling and batched beam search over a *stepper* (one model, the same model without
its key/value cache, or an averaging ensemble of models), plus `decode_to_file` behind `a2 decode`.

A stepper has `init_state(feats, region_mask)`, `expand_state(state, k)`, `step(last_tokens, state) -> log-probs`
and `reorder_state(state, index)` (rows moved within each image's group of beams), and may have
`select_rows(state, index)` (whole images' rows kept, memory included), with which beam search drops finished
images.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from .atomic import atomic_write
from .checkpoint import load_ensemble
from .config import Config, DataConfig, apply_overrides
from .data.dataset import CaptionData, resolve_paths
from .data.features import FeatureStore
from .metrics import caption_scores
from .model.a2 import NOT_A_NEXT_WORD, A2Transformer, KVCache, next_word_logp
from .errors import A2Error, ConfigError, SubmissionError
from .precision import autocast, check as check_precision

log = logging.getLogger(__name__)

# Raised whenever a change here changes the captions decoded from the same checkpoint and settings (2: no <unk>, in
# the checkpoint's train.precision): captions kept by an earlier version (`a2 package`'s shards) are decoded again.
CAPTIONS_VERSION = 2


class ModelStepper:
    """One model, decoding with its cached decoder keys/values (each step costs one position)."""

    def __init__(self, model: A2Transformer):
        self.model = model

    def init_state(self, feats, region_mask):
        return self.model.init_state(feats, region_mask)

    def expand_state(self, state, k: int):
        """k rows per image (beams or samples, adjacent); the caches' rows are repeated. The region memory stays
        one row per image: cross-attention reads an image's k rows as one sequence of queries against it (as an
        image's captions in training), so it is neither copied k times nor read k times per step."""
        return {**state, "caches": [c.repeat(k) for c in state["caches"]], "rows_per_image": k}

    def restart(self, state):
        """`state` as `init_state` made it, before any step: the same region memory, empty caches."""
        return {**state, "caches": [KVCache() for _ in state["caches"]], "t": 0}

    def step(self, last, state):
        return self.model.step(last, state)

    def reorder_state(self, state, index):
        return self.model.reorder_state(state, index)

    def select_rows(self, state, index):
        """Only the rows `index` (N',) of everything per row: caches, and the region memory and mask of their
        images. `index` keeps whole images: all k rows of each image kept, in order."""
        k = state.get("rows_per_image", 1)
        images = index.view(-1, k)[:, 0] // k  # (N' / k,)
        if not torch.equal(index, (images[:, None] * k + torch.arange(k, device=index.device)).view(-1)):
            raise ValueError("select_rows keeps whole images: all rows of an image, in order")
        pick = lambda d: {n: v.index_select(0, images) for n, v in d.items()}  # noqa: E731
        return {**state, "mem": [pick(m) for m in state["mem"]],
                "region_mask": state["region_mask"].index_select(0, images),
                "caches": [c.select(index) for c in state["caches"]]}


class UncachedStepper(ModelStepper):
    """The same model re-running the whole prefix every step: the reference the cached path must equal. Its
    region memory is repeated per row, the straightforward layout, so the reference shares no shortcut with the
    cached path."""

    def init_state(self, feats, region_mask):
        state = super().init_state(feats, region_mask)
        state["prefix"] = torch.zeros(feats.shape[0], 0, dtype=torch.long, device=feats.device)
        return state

    def expand_state(self, state, k):
        rep = lambda d: {n: v.repeat_interleave(k, 0) for n, v in d.items()}  # noqa: E731
        return {**state, "mem": [rep(m) for m in state["mem"]],
                "region_mask": state["region_mask"].repeat_interleave(k, 0),
                "prefix": state["prefix"].repeat_interleave(k, 0)}

    def step(self, last, state):
        state["prefix"] = torch.cat([state["prefix"], last[:, None]], dim=1)
        logits, _ = self.model.decode(state["prefix"], state["mem"], state["region_mask"])
        return next_word_logp(logits[:, -1])

    def reorder_state(self, state, index):
        return {**state, "prefix": state["prefix"].index_select(0, index)}

    def select_rows(self, state, index):
        pick = lambda d: {n: v.index_select(0, index) for n, v in d.items()}  # noqa: E731
        return {**state, "mem": [pick(m) for m in state["mem"]],
                "region_mask": state["region_mask"].index_select(0, index),
                "prefix": state["prefix"].index_select(0, index)}


def mean_of_distributions(logps: torch.Tensor) -> torch.Tensor:
    """log(mean_i exp(logps[i])): the log of the members' averaged distribution, logps (M, ..., V) -> (..., V).

    Computed as  top + log(mean_i exp(logps[i] - top)),  top the largest member's value of each word: where the
    members agree, each term is exp(0) = 1 and their mean exactly 1, so an ensemble of copies of one model gives
    that model's log-probabilities bit for bit (logsumexp(logps) - log M rounds twice, a few ulps off in fp32: enough
    to reorder near-tied beams, so two copies of a checkpoint decoded otherwise than the checkpoint). A word at -inf
    in every member stays -inf; NaN stays NaN."""
    top = logps.amax(0)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return shift + (logps - shift).exp().mean(0).log()


class EnsembleStepper:
    """Averages the member models' per-step word distributions: log(mean_i p_i(w))."""

    def __init__(self, models: list):
        """models: A2Transformer models, or steppers of one model each (e.g. `EncodedStepper`)."""
        if not models:
            raise A2Error("an ensemble needs at least one model")
        self.members = [as_stepper(m) for m in models]

    def init_state(self, feats, region_mask):
        return [s.init_state(feats, region_mask) for s in self.members]

    def expand_state(self, state, k):
        return [s.expand_state(st, k) for s, st in zip(self.members, state)]

    def step(self, last, state):
        return mean_of_distributions(torch.stack([s.step(last, st) for s, st in zip(self.members, state)]))

    def reorder_state(self, state, index):
        return [s.reorder_state(st, index) for s, st in zip(self.members, state)]

    @property
    def can_select_rows(self) -> bool:
        # members may be any steppers (the module docstring: `select_rows` is optional); beam search keeps every
        # image to the end unless all of them can drop rows
        return all(_can_select_rows(s) for s in self.members)

    def select_rows(self, state, index):
        return [s.select_rows(st, index) for s, st in zip(self.members, state)]


class EncodedStepper:
    """A `ModelStepper` whose batch is encoded already: `init_state` starts from the state `inner.init_state` gave
    for it (its region memory; `restart`: fresh caches), so several searches over one batch (the ensemble, then
    each member alone) share one encoder pass per model."""

    def __init__(self, inner: ModelStepper, state):
        self.inner, self.state = inner, state

    def init_state(self, feats, region_mask):
        return self.inner.restart(self.state)

    def expand_state(self, state, k):
        return self.inner.expand_state(state, k)

    def step(self, last, state):
        return self.inner.step(last, state)

    def reorder_state(self, state, index):
        return self.inner.reorder_state(state, index)

    def select_rows(self, state, index):
        return self.inner.select_rows(state, index)


def as_stepper(model_or_stepper):
    return ModelStepper(model_or_stepper) if isinstance(model_or_stepper, A2Transformer) else model_or_stepper


@torch.no_grad()
def greedy(model_or_stepper, feats, region_mask, max_len: int = 20, bos: int = 1, eos: int = 2) -> torch.Tensor:
    """(B, <= max_len) word ids, each row ending with <eos> or cut at max_len (pad 0 after <eos>)."""
    stepper = as_stepper(model_or_stepper)
    b = feats.shape[0]
    if b == 0:  # no image, feats (0, R, D): no caption, no step and no encoder pass, (0, 0)
        return torch.zeros(0, 0, dtype=torch.long, device=feats.device)
    state = stepper.init_state(feats, region_mask)
    last = torch.full((b,), bos, dtype=torch.long, device=feats.device)
    done = torch.zeros(b, dtype=torch.bool, device=feats.device)
    out = []
    for _ in range(max_len):
        word = stepper.step(last, state).argmax(-1)
        word = word.masked_fill(done, 0)
        out.append(word)
        done |= word == eos
        last = word
        if bool(done.all()):
            break
    if not out:  # max_len 0: no word, the empty caption of every image (B, 0), as beam search's [<eos>] decodes
        return torch.zeros(b, 0, dtype=torch.long, device=feats.device)
    return torch.stack(out, dim=1)


def _can_select_rows(stepper) -> bool:
    return callable(getattr(stepper, "select_rows", None)) and getattr(stepper, "can_select_rows", True)


@torch.no_grad()
def beam_search(model_or_stepper, feats, region_mask, beam_size: int = 5, max_len: int = 20, bos: int = 1,
                eos: int = 2, all_beams: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched beam search. Returns the best sequence per image (B, <= max_len + 1) (pad 0 after <eos>) and its
    total log-probability (B,); with `all_beams`, all beam_size final hypotheses per image, best first:
    (B, beam_size, <= max_len + 1) and (B, beam_size) (M2's `out_size=beam_size`, SCST's beam candidates). A
    hypothesis ends at <eos>; after max_len words <eos> is forced.

    An image whose k hypotheses have all ended leaves the batch (with a stepper that can `select_rows`): its
    result is final (a finished hypothesis only continues with pad at no cost), and the images still decoding
    no longer pay for its rows. Results are those of keeping it.

    Raises ValueError where an image has no possible caption, or, with `all_beams`, fewer than beam_size (a wider
    beam than the captions of a small vocabulary and max_len): the slots left over would hold impossible ones."""
    stepper = as_stepper(model_or_stepper)
    b, k = feats.shape[0], beam_size
    device = feats.device
    if b == 0:  # no image: no hypothesis of any length, (0, K, 0) and (0, K) (no step; nothing to check either)
        beams, scores = torch.zeros(0, k, 0, dtype=torch.long, device=device), torch.zeros(0, k, device=device)
        return (beams, scores) if all_beams else (beams[:, 0], scores[:, 0])
    compact = _can_select_rows(stepper)
    state = stepper.init_state(feats, region_mask)
    # an image's k beams start identical (<bos>, the same state): the first step runs once per image, then its
    # state (caches of one position) is repeated for the k beams
    first = stepper.step(torch.full((b,), bos, dtype=torch.long, device=device), state)  # (B, V)
    state = stepper.expand_state(state, k)
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    last = torch.full((b * k,), bos, dtype=torch.long, device=device)
    done = torch.zeros(b * k, dtype=torch.bool, device=device)
    seqs = torch.zeros(b * k, 0, dtype=torch.long, device=device)
    alive = torch.arange(b, device=device)  # (G,) the image of each group of k rows still decoding
    best_seqs: list[torch.Tensor | None] = [None] * b
    best_scores: list[torch.Tensor | None] = [None] * b
    steps = 0
    for t in range(max_len + 1):
        g = alive.numel()
        logp = first.repeat_interleave(k, 0) if t == 0 else stepper.step(last, state)  # (G*K, V)
        v = logp.shape[-1]
        if t == max_len:  # out of length: only <eos> may follow
            forced = torch.full_like(logp, float("-inf"))
            forced[:, eos] = logp[:, eos]
            logp = forced
        # A finished hypothesis stays as it is: one continuation (pad, word 0) at no cost.
        if bool(done.any()):
            pad = torch.where(done, 0.0, logp[:, 0])  # (G*K,)
            logp = logp.masked_fill(done[:, None], float("-inf"))
            logp[:, 0] = pad
        cand = (scores.view(g * k, 1) + logp).view(g, k * v)
        scores, flat = cand.topk(k, dim=-1)  # (G, K)
        beam, word = flat // v, flat % v
        rows = ((torch.arange(g, device=device) * k)[:, None] + beam).view(-1)
        word = word.view(-1)
        seqs = torch.cat([seqs.index_select(0, rows), word[:, None]], dim=1)
        done = done.index_select(0, rows) | (word == eos)
        state = stepper.reorder_state(state, rows)
        last = word
        steps = t + 1
        ended = done.view(g, k).all(dim=1)  # (G,)
        if bool(ended.all()) or (compact and bool(ended.any())):
            for i in ended.nonzero().flatten().tolist():
                best_seqs[int(alive[i])], best_scores[int(alive[i])] = seqs[i * k:(i + 1) * k], scores[i]
            if bool(ended.all()):
                break
            keep = (~ended).nonzero().flatten()  # (G',) groups still decoding
            keep_rows = (keep[:, None] * k + torch.arange(k, device=device)).view(-1)
            state = stepper.select_rows(state, keep_rows)
            seqs, done, last = seqs.index_select(0, keep_rows), done.index_select(0, keep_rows), last[keep_rows]
            scores, alive = scores.index_select(0, keep), alive[keep]
    for i in range(alive.numel()):  # still decoding after max_len + 1 steps: cannot happen (<eos> is forced)
        if best_seqs[int(alive[i])] is None:
            best_seqs[int(alive[i])], best_scores[int(alive[i])] = seqs[i * k:(i + 1) * k], scores[i]
    # an image's k hypotheses, best first (topk sorts); pad 0 after <eos>, as when kept to the end
    beams = torch.zeros(b, k, steps, dtype=torch.long, device=device)
    for i, seq in enumerate(best_seqs):
        beams[i, :, :seq.shape[1]] = seq
    scores = torch.stack(best_scores)  # (B, K)
    # A slot that no possible hypothesis could fill (fewer possible captions than beam_size: a vocabulary of few
    # words, a short max_len, <eos> banned to the end) holds an impossible one at -inf, e.g. a finished caption
    # followed by <bos>: returned, it is a garbage caption, or a duplicate SCST candidate that trains as a real one.
    # topk sorts the possible ones first, so only the slots asked for are checked.
    # (NaN, a diverged model's, is not -inf: its run's divergence check reports it, not this)
    possible = int((~torch.isneginf(scores[:, :k if all_beams else 1])).sum(1).min())  # fewest of an image's slots
    if possible == 0:
        raise ValueError(f"beam search found no possible caption of at most {max_len} words for an image: every "
                         f"continuation is at -inf (is <eos> banned for longer than max_len?)")
    if all_beams and possible < k:
        raise ValueError(f"beam_size {k} is more than the {possible} captions of at most {max_len} words that an "
                         f"image can have over {v} word ids: all_beams needs beam_size <= {possible}")
    return (beams, scores) if all_beams else (beams[:, 0], scores[:, 0])


def sample(model: A2Transformer, feats, region_mask, n: int, max_len: int = 20, bos: int = 1, eos: int = 2,
           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n captions per image sampled from the model with its decoder cache, keeping the graph for SCST.

    Returns tokens (B*n, L) (pad 0 after <eos>), per-token log-probabilities (B*n, L) with grad, and a mask
    (B*n, L) of the positions that count (words up to and including <eos>)."""
    stepper = ModelStepper(model)
    rows = feats.shape[0] * n
    if rows == 0:  # no image: no sample, (0, 0) each (no step)
        empty = torch.zeros(0, 0, device=feats.device)
        return empty.long(), empty, empty.bool()
    state = stepper.expand_state(stepper.init_state(feats, region_mask), n)
    last = torch.full((rows,), bos, dtype=torch.long, device=feats.device)
    done = torch.zeros(rows, dtype=torch.bool, device=feats.device)
    words, logps, masks = [], [], []
    for _ in range(max_len):
        logp = stepper.step(last, state)
        word = torch.multinomial((logp.detach() / temperature).softmax(-1), 1).squeeze(1)
        word = word.masked_fill(done, 0)
        masks.append(~done)
        # a finished row's pad is no word (-inf under next_word_logp): 0, so that the loss's mask can zero it
        logps.append(logp.gather(1, word[:, None]).squeeze(1).masked_fill(done, 0.0))
        words.append(word)
        done = done | (word == eos)
        last = word
        if bool(done.all()):
            break
    return torch.stack(words, 1), torch.stack(logps, 1), torch.stack(masks, 1)


class MinLengthStepper:
    """A stepper that cannot end a caption (<eos>) before `min_len` words: beam search prefers short hypotheses,
    and an empty caption is not a valid COCO server entry."""

    def __init__(self, inner, eos: int, min_len: int = 1):
        self.inner, self.eos, self.min_len = inner, eos, min_len

    def init_state(self, feats, region_mask):
        return {"inner": self.inner.init_state(feats, region_mask), "t": 0}

    def expand_state(self, state, k: int):
        return {"inner": self.inner.expand_state(state["inner"], k), "t": state["t"]}

    def step(self, last, state):
        logp = self.inner.step(last, state["inner"])
        if state["t"] < self.min_len:
            logp = logp.clone()
            logp[:, self.eos] = float("-inf")
        state["t"] += 1
        return logp

    def reorder_state(self, state, index):
        return {"inner": self.inner.reorder_state(state["inner"], index), "t": state["t"]}

    @property
    def can_select_rows(self) -> bool:
        return _can_select_rows(self.inner)

    def select_rows(self, state, index):
        return {"inner": self.inner.select_rows(state["inner"], index), "t": state["t"]}


class CaptionWordsStepper:
    """A stepper whose next word is one a caption may hold: `banned` word ids (<pad>, <bos>, <unk>) at -inf.

    A caption holding "<unk>" is always wrong (no reference has it), yet a model trained on captions whose rare
    words became <unk> predicts it often. Its log-probability is set to -inf after the softmax, not renormalised
    away: a hypothesis' score stays the model's log-probability of its words, as teacher forcing scores them
    (SCST's beam candidates), and the best remaining word is chosen where <unk> was the best."""

    def __init__(self, inner, banned):
        self.inner = as_stepper(inner)
        self.banned = list(banned)
        self._index: torch.Tensor | None = None  # (len(banned),) on the decode's device: made once, not every step

    def init_state(self, feats, region_mask):
        return self.inner.init_state(feats, region_mask)

    def expand_state(self, state, k: int):
        return self.inner.expand_state(state, k)

    def step(self, last, state):
        logp = self.inner.step(last, state)  # (N, V)
        if self._index is None or self._index.device != logp.device:
            self._index = torch.tensor(self.banned, device=logp.device)
        return logp.index_fill(-1, self._index, float("-inf"))

    def reorder_state(self, state, index):
        return self.inner.reorder_state(state, index)

    @property
    def can_select_rows(self) -> bool:
        return _can_select_rows(self.inner)

    def select_rows(self, state, index):
        return self.inner.select_rows(state, index)


def caption_batches(stepper, vocab, batches, *, beam_size: int = 5, max_len: int = 20,
                    device: str | torch.device = "cpu", progress=None) -> dict[int, str]:
    """{image_id: caption} (beam_size 1 = greedy) of `(image_ids, feats (B, R, D), region_mask (B, R))` batches;
    `progress(n)` is called with each batch's image count. No caption holds <pad>, <bos> or <unk>
    (`CaptionWordsStepper`): every text caption (validation, test, `a2 decode`, packaging, the registered
    ensemble) is decoded here. SCST's candidates and greedy baseline call the searches directly, unmasked, as M2."""
    stepper = CaptionWordsStepper(stepper, (vocab.pad, vocab.bos, vocab.unk))
    out: dict[int, str] = {}
    for image_ids, feats, mask in batches:
        feats, mask = feats.to(device), mask.to(device)
        if beam_size > 1:
            seqs, _ = beam_search(stepper, feats, mask, beam_size, max_len, vocab.bos, vocab.eos)
        else:
            seqs = greedy(stepper, feats, mask, max_len, vocab.bos, vocab.eos)
        out.update((int(i), vocab.decode(seq)) for i, seq in zip(image_ids, seqs.tolist()))
        if progress is not None:
            progress(len(image_ids))
    return out


def fetched_batches(image_ids, fetch, batch_size: int):
    """`(image_ids, feats (B, R, D), region_mask (B, R))` batches of consecutive images: `fetch(image_id)` gives
    their padded numpy (features (R, D), mask (R,)), as `FeatureStore.padded` does."""
    ids = list(image_ids)
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        pairs = [fetch(i) for i in chunk]
        feats, masks = (torch.from_numpy(np.stack([p[k] for p in pairs])) for k in (0, 1))
        yield chunk, feats, masks


def caption_images(stepper, vocab, image_ids, fetch, *, batch_size: int = 50, **kwargs) -> dict[int, str]:
    """{image_id: caption} of any images, fetched by `fetch` (`fetched_batches`). Other arguments as
    `caption_batches`."""
    return caption_batches(stepper, vocab, fetched_batches(image_ids, fetch, batch_size), **kwargs)


def captions_for(data, stepper, split: str, *, beam_size: int = 5, max_len: int = 20, batch_size: int = 50,
                 limit: int | None = None, progress: bool = False, device: str | torch.device = "cpu",
                 rank: int = 0, world: int = 1) -> dict[int, str]:
    """{image_id: caption} for a split (beam_size 1 = greedy). With world > 1, this rank's shard only."""
    loader = data.loader(split, batch_size, with_captions=False, limit=limit, rank=rank, world=world)
    bar = None
    if progress:
        bar = tqdm(total=len(loader.batch_sampler), desc=f"decode {split}", unit="batch", file=sys.stderr)
    batches = ((b["image_ids"].tolist(), b["feats"], b["region_mask"]) for b in loader)
    out = caption_batches(stepper, data.vocab, batches,
                          beam_size=beam_size, max_len=max_len, device=device,
                          progress=(lambda n: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    return out


def score_split(data, stepper, split: str, *, gather: Callable[[dict], dict] = lambda shard: shard,
                meteor: bool = False, **decode) -> tuple[dict[str, float], dict[int, float]]:
    """Caption a split (`captions_for` with `decode`: beam_size, max_len, batch_size, limit, device, rank, world)
    and score it: (COCO metrics x100, {image_id: CIDEr-D x100}). `gather` joins the ranks' shards."""
    caps = gather(captions_for(data, stepper, split, **decode))
    refs = data.references(split)
    scores = caption_scores({i: refs[i] for i in caps}, caps, meteor=meteor, per_image=True)
    per_image = scores.pop("per_image")
    return scores, {i: per_image[i]["CIDEr"] for i in sorted(per_image)}


def decode_precision(config: dict, device: str | torch.device) -> str:
    """The `train.precision` a checkpoint's `config` trained in, in which its run decoded the captions its scores
    are of: decoding it again (`a2 decode`, packaging) in it gives those captions. fp32 where this torch cannot
    autocast to it on `device` (`a2core.precision.check`), with a warning that the captions may then differ."""
    precision = config.get("train", {}).get("precision", "fp32")  # a checkpoint from before the key: fp32
    try:
        check_precision(precision, torch.device(device))
    except ConfigError as err:
        log.warning("%s: decoding in fp32 instead, so the captions may differ from those the run was scored on",
                    err)
        return "fp32"
    return precision


def ensemble_captions(checkpoints: list[str], data_config: dict, shard: dict[str, list[int]],
                      single_split: str | None, *, beam_size: int, max_len: int, batch_size: int,
                      progress: bool = False, device: str | None = None) -> dict:
    """Captions by the averaging ensemble of local `checkpoints` on every split of `shard` ({split: image ids}),
    and by each checkpoint alone on `single_split`; regions from `data_config`'s feature store. Returns
    {"ensemble": {split: {id: caption}}, "single": [{id: caption} per checkpoint]}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    models, vocab, config = load_ensemble(checkpoints, device=device)
    model_cfg = config["model"]
    store = FeatureStore(resolve_paths(Config.from_dict({**config, "data": data_config}, saved=True).data).features,
                         model_cfg["feature_dim"])
    singles = len(models) if single_split and len(models) > 1 else 0  # one model alone is the ensemble
    total = len(set().union(*shard.values())) + len(shard.get(single_split, [])) * singles
    bar = tqdm(total=total, desc="decode", unit="img", file=sys.stderr, disable=not (progress and total))

    options = dict(beam_size=beam_size, max_len=max_len, device=device, progress=bar.update)
    fetch = lambda i: store.padded(i, model_cfg["max_regions"])  # noqa: E731
    out: dict = {"ensemble": {}, "single": [{} for _ in models] if singles else []}
    # Every image once, whatever splits it is in (Karpathy test images are also val2014 images): each member's
    # encoder runs once per image, for the ensemble's search and, on `single_split`, for the member's own. The
    # single split's images come first, in batches of their own, so that the members' solo searches run on
    # the batches they had when they were decoded in a pass of their own.
    unique = list(dict.fromkeys(i for ids in shard.values() for i in ids))
    solo = list(dict.fromkeys(shard[single_split])) if singles else []
    in_solo = set(solo)
    rest = [i for i in unique if i not in in_solo]
    ensemble: dict[int, str] = {}
    # in the first checkpoint's train.precision, as its run decoded the test split it was scored on
    with torch.no_grad(), autocast(decode_precision(config, device), torch.device(device)):
        for ids, alone in ((solo, True), (rest, False)):
            for chunk, feats, mask in fetched_batches(ids, fetch, batch_size):
                batch = [(chunk, feats.to(device), mask.to(device))]
                members = [ModelStepper(model) for model in models]
                encoded = [EncodedStepper(m, m.init_state(*batch[0][1:])) for m in members]  # (B, R, d) per member
                ensemble.update(caption_batches(MinLengthStepper(EnsembleStepper(encoded), vocab.eos), vocab, batch,
                                                **options))
                for single, member in zip(out["single"] if alone else [], encoded):
                    single.update(caption_batches(MinLengthStepper(member, vocab.eos), vocab, batch, **options))
    for split, ids in shard.items():
        out["ensemble"][split] = {i: ensemble[i] for i in ids}
    if single_split is not None and not singles:
        out["single"] = [out["ensemble"][single_split] for _ in models]  # one model alone is the ensemble
    elif singles:
        out["single"] = [{i: single[i] for i in shard[single_split]} for single in out["single"]]
    bar.close()
    store.close()
    return out


def write_results_json(path: str | Path, captions: dict[int, str]) -> None:
    """COCO results format [{"image_id": int, "caption": str}] sorted by image id, UTF-8, written atomically; ids
    must be ints and captions strings (SubmissionError naming the id); empty captions are written as they are."""
    for image_id, caption in captions.items():
        if isinstance(image_id, bool) or not isinstance(image_id, int):
            raise SubmissionError(f"{path}: image id {image_id!r} is not an int")
        if not isinstance(caption, str):
            raise SubmissionError(f"{path}: caption of image {image_id} is {type(caption).__name__}, not str")
    entries = [{"image_id": image_id, "caption": captions[image_id]} for image_id in sorted(captions)]
    atomic_write(path, json.dumps(entries, ensure_ascii=False) + "\n")


def _check_not_an_input(out, inputs, what: str) -> None:
    """Refuse (ConfigError naming --out) a results file that is one of the files the decoding reads: the results
    would replace a checkpoint or the dataset's captions, lost for good (`--out runs/a2/best.pt`, a slip of the
    shell's completion). The same file under another name (a link, best.pt linked to last.pt) counts."""
    if not Path(out).is_file():  # a new file is none of the inputs, which exist
        return
    for path in inputs:
        if Path(path).exists() and Path(out).samefile(path):
            raise ConfigError("--out", f"{out} is {what} ({path}); the results would write over it, so name "
                                       f"another file")


def checkpoint_data(config: dict, vocab, data_overrides: list[str] | None = None):
    """The CaptionData a checkpoint decodes: its config's data section with `data.*` overrides (the files on this
    machine), and its vocabulary. An override of any other key is refused (`check_data_overrides`)."""
    check_data_overrides(data_overrides)
    raw = apply_overrides({"data": config["data"]}, list(data_overrides or []))
    data_cfg = Config.from_dict({"data": raw["data"]}).data
    return CaptionData(data_cfg, config["model"]["max_regions"], config["model"]["feature_dim"], vocab=vocab)


def check_data_overrides(overrides: list[str] | None) -> None:
    """Refuse (ConfigError naming the key) every override of `a2 decode` / `a2 package` that is not `data.KEY=VALUE`:
    decoding reads only the data section from the command line (the model and its training are the checkpoint's),
    and an item it would ignore, `features=/x` or `model.d_model=8`, is a typo the user must hear about. The message
    says what to write instead; an unknown key under `data.` is refused by the config schema, naming the known ones."""
    for item in overrides or []:
        key, equals, value = item.partition("=")
        if key.startswith("data.") and equals:
            continue
        if not equals:
            raise ConfigError(item, "is not of the form data.KEY=VALUE; write e.g. data.features=/x.h5")
        if key in DataConfig.model_fields:
            raise ConfigError(key, f"is a data key; write data.{key}={value}")
        if key == "data":
            raise ConfigError(key, "one key at a time; write data.KEY=VALUE, e.g. data.features=/x.h5")
        keys = ", ".join(DataConfig.model_fields)
        what = (f"{key} is the checkpoint's own (decoding changes only where its data is)"
                if key.split(".")[0] in Config.model_fields else f"{key} is no key of a config")
        raise ConfigError(key, f"only data.* keys are read here and {what}; write data.KEY=VALUE, KEY one of {keys}")


def decode_to_file(checkpoints: list[str], split: str, out: str, beam_size: int = 5, max_len: int = 20,
                   batch_size: int = 50, data_overrides: list[str] | None = None, device: str | None = None) -> dict:
    """`a2 decode`: one checkpoint or an averaging ensemble -> COCO results JSON for a split."""
    check_data_overrides(data_overrides)  # before any checkpoint is read: a refused key costs nothing
    for name, value in (("--beam-size", beam_size), ("--max-len", max_len), ("--batch-size", batch_size)):
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    _check_not_an_input(out, checkpoints, "one of --checkpoints")  # before any is read
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    models, vocab, config = load_ensemble(checkpoints, device=device)
    longest = min(m.pos.shape[0] for m in models) - 1  # beam search feeds max_len + 1 positions
    if max_len > longest:
        raise ConfigError("--max-len", f"{max_len} is longer than these models can decode (at most {longest}: "
                                       f"the longer of data.max_caption_len and train.max_len, + 3)")
    # A beam wider than the words a caption can hold cannot be filled at its first step: refused here, before any
    # data is read, rather than left to mean something other than the width asked for
    words = len(vocab) - NOT_A_NEXT_WORD  # <pad> and <bos> are never generated
    if beam_size > words:
        raise ConfigError("--beam-size", f"{beam_size} is wider than the vocabulary of these checkpoints ({len(vocab)} "
                                         f"word ids, of which {words} can be generated: not <pad> or <bos>); "
                                         f"use at most {words}")
    data = checkpoint_data(config, vocab, data_overrides)
    _check_not_an_input(out, [p for p in vars(data.paths).values() if p is not None], "a file of the data it decodes")
    data.features.check_ids([img.image_id for img in data.images(split)])
    stepper = EnsembleStepper(models) if len(models) > 1 else ModelStepper(models[0])
    with autocast(decode_precision(config, device), torch.device(device)):  # the first checkpoint's
        caps = captions_for(data, stepper, split, beam_size=beam_size, max_len=max_len, batch_size=batch_size,
                            progress=True, device=device)
    write_results_json(out, caps)
    return {"out": str(out), "images": len(caps), "checkpoints": list(map(str, checkpoints)), "split": split}

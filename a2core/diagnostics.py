"""Attention diagnostics behind the paper's figures, each a function over a model and a data split.

All run teacher-forced on the split's first reference caption per image: decoder position t reads word t
(position 0 reads <bos>) and predicts caption word t, so the attention at position t is "the attention used to
generate word t". Rows are (image, head, position) over the image's real regions.

- `attention_jsd`: Jensen-Shannon divergence between original and aligned attention per decoder layer (Eq. 13, Fig. 6)
- `mask_mean`: mean mask value (Fig. 4)
- `kendall_importance`: Kendall tau between head-averaged attention, and between the perturbation strength 1 - m,
  and gradient importance tau_it = |d p(y_t) / d h_i| (L2 norm over the encoder state h_i of region i), per layer
  (Fig. 2 and Fig. 5). A low mask value marks a region the mask network found decisive, hence 1 - m.
- `grounding_accuracy`: synthetic data only: how often the top attended region (head-averaged) is the ground-truth
  region of the word being generated, for original and aligned attention, per layer. Only words of the encoded
  caption count (not words cut by `max_caption_len`), and only those whose region survived the cut to
  `max_regions` (a region the model never sees cannot be attended).
"""
from __future__ import annotations

import numpy as np
import torch

from .model.a2 import A2Transformer


def _teacher_batches(model: A2Transformer, data, split: str, limit: int | None, batch_size: int, device):
    """Yields (batch, inp (B, T), tgt (B, T)) with the first reference caption of every image."""
    for batch in data.loader(split, batch_size, limit=limit):
        caps = batch["captions"][:, 0].to(device)  # (B, L)
        yield batch, caps[:, :-1], caps[:, 1:]


def _recorded_pass(model, batch, inp, device):
    feats, mask = batch["feats"].to(device), batch["region_mask"].to(device)
    model.record_attention(True)
    try:
        model(feats, mask, inp)
        return model.recorded_attention(), mask
    finally:
        model.record_attention(False)


def _row_mask(mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """(B, 1, T) True where the target is a real word (not pad)."""
    return (tgt != 0)[:, None, :]


def js_divergence(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Eq. 13 over the last dimension (natural log; at most ln 2)."""
    m = 0.5 * (p + q)
    kl = lambda a, b: (a * (torch.log(a + eps) - torch.log(b + eps))).sum(-1)  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


@torch.no_grad()
def attention_jsd(model: A2Transformer, data, split: str = "val", limit: int | None = 100, batch_size: int = 50,
                  device="cpu") -> list[float]:
    """Mean JSD(original, aligned) per decoder layer; all zeros for fusion `none`."""
    was_training = model.training
    model.eval()
    sums = np.zeros(len(model.decoder))
    count = 0.0
    for batch, inp, tgt in _teacher_batches(model, data, split, limit, batch_size, device):
        layers, _ = _recorded_pass(model, batch, inp, device)
        rows = _row_mask(None, tgt).expand(-1, model.cfg.heads, -1)  # (B, H, T)
        for i, rec in enumerate(layers):
            jsd = js_divergence(rec["attention"], rec["aligned"])  # (B, H, T)
            sums[i] += float(jsd[rows].sum())
        count += float(rows.sum())
    model.train(was_training)
    return (sums / max(count, 1.0)).tolist()


@torch.no_grad()
def mask_mean(model: A2Transformer, data, split: str = "val", limit: int | None = 100, batch_size: int = 50,
              device="cpu") -> float:
    """Mean m over real regions and words, all layers; NaN for fusion `none` (no mask network)."""
    if not model.has_mask_network:
        return float("nan")
    was_training = model.training
    model.eval()
    total = count = 0.0
    for batch, inp, tgt in _teacher_batches(model, data, split, limit, batch_size, device):
        layers, mask = _recorded_pass(model, batch, inp, device)
        sel = mask[:, None, None, :] & _row_mask(None, tgt)[..., None]  # (B, 1, T, R)
        for rec in layers:
            m = rec["mask"]
            total += float((m * sel).sum())
            count += float(sel.sum()) * m.shape[1]
    model.train(was_training)
    return total / max(count, 1.0)


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of two 1-d arrays (NaN when either is constant)."""
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    iu = np.triu_indices(len(x), 1)
    dx, dy = dx[iu], dy[iu]
    denom = np.sqrt(float((dx != 0).sum()) * float((dy != 0).sum()))
    return float((dx * dy).sum() / denom) if denom > 0 else float("nan")


def kendall_importance(model: A2Transformer, data, split: str = "val", limit: int | None = 20, batch_size: int = 10,
                       device="cpu") -> dict[str, list[float]]:
    """{"attention": [tau per layer], "mask": [tau per layer] (NaN without a mask network)}."""
    was_training = model.training
    model.eval()
    n_layers = len(model.decoder)
    taus_a = [[] for _ in range(n_layers)]
    taus_m = [[] for _ in range(n_layers)]
    for batch, inp, tgt in _teacher_batches(model, data, split, limit, batch_size, device):
        feats, rmask = batch["feats"].to(device), batch["region_mask"].to(device)
        with torch.enable_grad():
            enc = model.encode(feats, rmask).detach().requires_grad_(True)  # h_i: (B, R, d)
            model.record_attention(True)
            logits, _ = model.decode(inp, model.memory(enc), rmask)
            layers = model.recorded_attention()
            model.record_attention(False)
            probs = logits.softmax(-1).gather(-1, tgt[..., None]).squeeze(-1)  # p(y_t): (B, T)
            importance = torch.zeros(*tgt.shape, enc.shape[1])  # (B, T, R)
            for t in range(tgt.shape[1]):
                # Images are independent, so one backward of the batch sum gives every image's gradient.
                (grad,) = torch.autograd.grad(probs[:, t].sum(), enc, retain_graph=t < tgt.shape[1] - 1)
                importance[:, t] = grad.norm(dim=-1).cpu()
        for b in range(tgt.shape[0]):
            regions = rmask[b].cpu().numpy()
            for t in range(tgt.shape[1]):
                if int(tgt[b, t]) == 0:
                    continue
                imp = importance[b, t].numpy()[regions]
                for i, rec in enumerate(layers):
                    att = rec["attention"][b, :, t].mean(0).cpu().numpy()[regions]
                    taus_a[i].append(kendall_tau(att, imp))
                    if "mask" in rec:
                        pert = 1.0 - rec["mask"][b, :, t].mean(0).cpu().numpy()[regions]
                        taus_m[i].append(kendall_tau(pert, imp))
    model.train(was_training)
    mean = lambda v: float(np.nanmean(v)) if v and not np.all(np.isnan(v)) else float("nan")  # noqa: E731
    return {"attention": [mean(v) for v in taus_a], "mask": [mean(v) for v in taus_m]}


@torch.no_grad()
def grounding_accuracy(model: A2Transformer, data, split: str = "val", limit: int | None = 100,
                       batch_size: int = 50, device="cpu") -> dict:
    """{"attention": [acc per layer], "aligned": [...], "attention_mean", "aligned_mean" (layer-averaged
    attention), "words": number of grounded words scored}. Needs the synthetic set's grounding.json."""
    grounding = data.grounding()
    if grounding is None:
        raise ValueError("grounding accuracy needs ground-truth regions (the synthetic dataset's grounding.json)")
    was_training = model.training
    model.eval()
    n_layers = len(model.decoder)
    hits = {"attention": np.zeros(n_layers), "aligned": np.zeros(n_layers)}
    hits_mean = {"attention": 0.0, "aligned": 0.0}
    words = 0
    for batch, inp, tgt in _teacher_batches(model, data, split, limit, batch_size, device):
        layers, rmask = _recorded_pass(model, batch, inp, device)
        for b, image_id in enumerate(batch["image_ids"].tolist()):
            regions = grounding[image_id]["sentences"][0]  # per caption word: region or -1
            n_words = int((tgt[b] != 0).sum()) - 1  # encoded words, without the final <eos>
            kept = int(rmask[b].sum())  # regions left after the cut to max_regions
            for t, region in enumerate(regions[:n_words]):
                if region < 0 or region >= kept:
                    continue
                words += 1
                for kind in ("attention", "aligned"):
                    per_layer = [rec[kind][b, :, t].mean(0) for rec in layers]  # (R,) each
                    for i, att in enumerate(per_layer):
                        hits[kind][i] += int(int(att.argmax()) == region)
                    hits_mean[kind] += int(int(torch.stack(per_layer).mean(0).argmax()) == region)
    model.train(was_training)
    w = max(words, 1)
    return {"attention": (hits["attention"] / w).tolist(), "aligned": (hits["aligned"] / w).tolist(),
            "attention_mean": hits_mean["attention"] / w, "aligned_mean": hits_mean["aligned"] / w, "words": words}

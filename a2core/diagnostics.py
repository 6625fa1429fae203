"""Attention diagnostics behind the paper's figures, each a function over a model and a data split.

All run teacher-forced on the split's first reference caption per image: decoder position t reads word t
(position 0 reads <bos>) and predicts caption word t, so the attention at position t is "the attention used to
generate word t". Rows are (image, head, position) over the image's real regions. Fused (aligned) weights need
not sum to one (Eq. 6-9 do not renormalise): every diagnostic divides its own copy of each row by its sum.

- `attention_jsd`: Jensen-Shannon divergence between original and aligned attention per decoder layer (Eq. 13, Fig. 6)
- `mask_mean`: mean mask value (Fig. 4)
- `kendall_importance`: Kendall tau between head-averaged attention, and between the perturbation strength 1 - m,
  and gradient importance `tau_it = |d p(y_t) / d h_i|` (L2 norm over the encoder state h_i of region i), per layer
  (Fig. 2 and Fig. 5). A low mask value marks a region the mask network found decisive, hence 1 - m.
- `grounding_accuracy`: synthetic data only: how often the top attended region (head-averaged) is the ground-truth
  region of the word being generated, for original and aligned attention, per layer. Only words of the encoded
  caption count (not words cut by `max_caption_len`), and only those whose region survived the cut to
  `max_regions` (a region the model never sees cannot be attended). With its controls, on the layer- and
  head-averaged aligned attention (the weights the captioner reads): uniform `chance` (1 / real regions), the
  word-agnostic `control` (one region per caption: the argmax of the caption's attention averaged over its
  grounded words, scored against each of them; averaged over all its words, the control moved with where each
  seed's model happened to send the words no region grounds, "a" and "and", by 0.1 between seeds with
  grounding at 0.99-1.0) and `subject_object` (how often a grounded word's region gets
  more attention than the caption's other grounded regions; a word-agnostic attention scores at most 0.5 on
  the synthetic set, whose captions ground two words in two different regions).
- `trial_diagnostics`: all of the above as flat `diag/...` scalars for a trial's metrics (what `Trainer` reports).
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


@torch.no_grad()
def recorded_passes(model: A2Transformer, data, split: str = "val", limit: int | None = 100, batch_size: int = 50,
                    device="cpu") -> list[dict]:
    """One teacher-forced pass over the split in eval mode, kept for the diagnostics that read recorded
    attention (pass it as `passes=` to share it): per batch {"image_ids" (B,), "tgt" (B, T), "region_mask"
    (B, R), "layers": per decoder layer {"attention", "aligned"[, "mask"]} (B, H, T, R)}."""
    was_training = model.training
    model.eval()
    out = []
    for batch, inp, tgt in _teacher_batches(model, data, split, limit, batch_size, device):
        mask = batch["region_mask"].to(device)
        model.record_attention(True)
        try:
            model(batch["feats"].to(device), mask, inp)
            layers = model.recorded_attention()
        finally:
            model.record_attention(False)
        out.append({"image_ids": batch["image_ids"], "tgt": tgt, "region_mask": mask, "layers": layers})
    model.train(was_training)
    return out


def _row_mask(mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """(B, 1, T) True where the target is a real word (not pad)."""
    return (tgt != 0)[:, None, :]


def _rows(weights: torch.Tensor) -> torch.Tensor:
    """A copy of attention weights (..., R) with every row divided by its sum (padded regions hold 0)."""
    return weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Eq. 13 over the last dimension (natural log; at most ln 2), with 0 log 0 = 0; what scipy's
    `jensenshannon(p, q) ** 2` gives. Computed in float64 and returned in the inputs' dtype, never negative.
    Per region, with s = p + q and x = (p - q) / s, p ln(p / m) + q ln(q / m) = s / 2 * g(x),
    g(x) = (1 + x) ln(1 + x) + (1 - x) ln(1 - x) = 2x atanh(x) + ln(1 - x^2) (~ x^2): summing the logs of each
    distribution as they stand cancelled to absolute errors of ~1e-17 per row whatever the divergence (tiny
    negatives for a barely moved row, whose JSD is ~1e-16 in float32 attention), while g's terms are of the size of
    the result, so every row keeps its relative precision."""
    dtype = torch.promote_types(p.dtype, q.dtype)
    p, q = p.double(), q.double()
    s = p + q  # (..., R); 0 only where both are 0, which adds nothing
    safe = s.clamp_min(torch.finfo(s.dtype).tiny)
    x = (p - q) / safe  # in [-1, 1]; 0 where s is 0
    small = x.abs() <= 0.5
    xs = torch.where(small, x, 0.0)
    near = 2.0 * xs * torch.atanh(xs) + torch.log1p(-xs * xs)  # |x| <= 0.5: two terms of the order of x^2
    a, b = 2.0 * p / safe, 2.0 * q / safe  # 1 + x and 1 - x without rounding 1 - x near |x| = 1
    far = torch.xlogy(a, a) + torch.xlogy(b, b)  # |x| > 0.5: g > 0.26, no cancellation to fear
    g = torch.where(small, near, far)
    return (0.25 * s * g).sum(-1).clamp_min(0.0).to(dtype)


def attention_jsd(model: A2Transformer, data, split: str = "val", limit: int | None = 100, batch_size: int = 50,
                  device="cpu", passes: list[dict] | None = None) -> list[float]:
    """Mean JSD(original, aligned) per decoder layer; all zeros for fusion `none`."""
    passes = passes if passes is not None else recorded_passes(model, data, split, limit, batch_size, device)
    sums = np.zeros(len(model.decoder))
    count = 0.0
    for p in passes:
        rows = _row_mask(None, p["tgt"]).expand(-1, model.cfg.heads, -1)  # (B, H, T)
        for i, rec in enumerate(p["layers"]):
            jsd = js_divergence(_rows(rec["attention"].double()), _rows(rec["aligned"].double()))  # (B, H, T)
            sums[i] += float(jsd[rows].sum())
        count += float(rows.sum())
    return (sums / max(count, 1.0)).tolist()


def mask_mean(model: A2Transformer, data, split: str = "val", limit: int | None = 100, batch_size: int = 50,
              device="cpu", passes: list[dict] | None = None) -> float:
    """Mean m over real regions and words, all layers; NaN for fusion `none` (no mask network)."""
    if not model.has_mask_network:
        return float("nan")
    passes = passes if passes is not None else recorded_passes(model, data, split, limit, batch_size, device)
    total = count = 0.0
    for p in passes:
        sel = p["region_mask"][:, None, None, :] & _row_mask(None, p["tgt"])[..., None]  # (B, 1, T, R)
        for rec in p["layers"]:
            m = rec["mask"]
            total += float((m * sel).sum())
            count += float(sel.sum()) * m.shape[1]
    return total / max(count, 1.0)


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of two 1-d arrays (NaN when either is constant or has fewer than 2 values)."""
    # float64: x_i - x_j of unsigned integers wraps around (1 - 2 = 255 for uint8) and bool has no subtraction
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
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
            try:
                logits, _ = model.decode(inp, model.memory(enc), rmask)
                layers = model.recorded_attention()
            finally:
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
                    att = _rows(rec["attention"][b, :, t]).mean(0).cpu().numpy()[regions]
                    taus_a[i].append(kendall_tau(att, imp))
                    if "mask" in rec:
                        pert = 1.0 - rec["mask"][b, :, t].mean(0).cpu().numpy()[regions]
                        taus_m[i].append(kendall_tau(pert, imp))
    model.train(was_training)
    mean = lambda v: float(np.nanmean(v)) if v and not np.all(np.isnan(v)) else float("nan")  # noqa: E731
    return {"attention": [mean(v) for v in taus_a], "mask": [mean(v) for v in taus_m]}


def grounding_accuracy(model: A2Transformer, data, split: str = "val", limit: int | None = 100,
                       batch_size: int = 50, device="cpu", passes: list[dict] | None = None) -> dict:
    """{"attention": [acc per layer], "aligned": [...], "attention_mean", "aligned_mean" (layer-averaged
    attention), "chance", "control", "subject_object" (module docstring; on the layer-averaged aligned attention),
    "words": number of grounded words scored}. Needs the synthetic set's grounding.json."""
    grounding = data.grounding()
    if grounding is None:
        raise ValueError("grounding accuracy needs ground-truth regions (the synthetic dataset's grounding.json)")
    passes = passes if passes is not None else recorded_passes(model, data, split, limit, batch_size, device)
    n_layers = len(model.decoder)
    hits = {"attention": np.zeros(n_layers), "aligned": np.zeros(n_layers)}
    hits_mean = {"attention": 0.0, "aligned": 0.0}
    chance = control = 0.0
    pair_hits = pairs = 0
    words = 0
    for p in passes:
        tgt, rmask = p["tgt"], p["region_mask"]
        # Each layer's rows normalised, then averaged over heads: (L, B, T, R) per kind.
        per_layer = {kind: torch.stack([_rows(rec[kind]).mean(1) for rec in p["layers"]]) for kind in hits}
        for b, image_id in enumerate(p["image_ids"].tolist()):
            n_words = int((tgt[b] != 0).sum()) - 1  # encoded words, without the final <eos>
            kept = int(rmask[b].sum())  # regions left after the cut to max_regions
            scored = [(t, r) for t, r in enumerate(grounding[image_id]["sentences"][0][:n_words]) if 0 <= r < kept]
            if not scored:
                continue
            words += len(scored)
            chance += len(scored) / kept
            for kind, att in per_layer.items():
                for t, region in scored:
                    hits[kind] += (att[:, b, t].argmax(-1) == region).cpu().numpy()
                    hits_mean[kind] += int(int(att[:, b, t].mean(0).argmax()) == region)
            aligned = per_layer["aligned"][:, b].mean(0)  # (T, R)
            # the word-agnostic control's one region: where the caption's grounded words attend on average
            fixed = int(aligned[[t for t, _ in scored]].mean(0).argmax())
            control += sum(fixed == region for _, region in scored)
            for t, region in scored:
                others = sorted({r for _, r in scored} - {region})
                if others:
                    pairs += 1
                    pair_hits += int(aligned[t, region] > aligned[t, others].max())
    w = max(words, 1)
    return {"attention": (hits["attention"] / w).tolist(), "aligned": (hits["aligned"] / w).tolist(),
            "attention_mean": hits_mean["attention"] / w, "aligned_mean": hits_mean["aligned"] / w,
            "chance": chance / w, "control": control / w, "subject_object": pair_hits / max(pairs, 1),
            "words": words}


def trial_diagnostics(model: A2Transformer, data, split: str = "val", images: int = 100, kendall_images: int = 10,
                      batch_size: int = 50, device="cpu") -> dict[str, float]:
    """The diagnostics as flat scalars on the first `images` images of `split` (Kendall tau on the first
    `kendall_images`): `diag/jsd/layer{i}`, `diag/kendall/attention` (mean over layers; per layer
    `diag/kendall/layer{i}/attention`), and with a mask network `diag/mask_mean`, `diag/kendall/mask`
    (`.../layer{i}/mask`); on data with ground-truth regions `diag/grounding/{accuracy, control, lift, chance,
    subject_object}` (lift = accuracy - control). A value that does not apply (no mask network, no grounding,
    a constant ranking) is absent, never NaN."""
    passes = recorded_passes(model, data, split, images, batch_size, device)
    out = {f"diag/jsd/layer{i}": v for i, v in enumerate(attention_jsd(model, data, passes=passes))}
    if model.has_mask_network:
        out["diag/mask_mean"] = mask_mean(model, data, passes=passes)
    taus = kendall_importance(model, data, split, kendall_images, batch_size, device)
    for kind, per_layer in taus.items():
        for i, v in enumerate(per_layer):
            out[f"diag/kendall/layer{i}/{kind}"] = v
        if not all(np.isnan(per_layer)):
            out[f"diag/kendall/{kind}"] = float(np.nanmean(per_layer))
    if data.grounding() is not None:
        g = grounding_accuracy(model, data, passes=passes)
        if g["words"]:
            out.update({"diag/grounding/accuracy": g["aligned_mean"], "diag/grounding/control": g["control"],
                        "diag/grounding/lift": g["aligned_mean"] - g["control"], "diag/grounding/chance": g["chance"],
                        "diag/grounding/subject_object": g["subject_object"]})
    return {k: float(v) for k, v in out.items() if not np.isnan(v)}

"""What a run reads: vocabulary, Karpathy splits, region features, and batches of images with 5 captions each."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from . import synthetic
from .captions import ImageCaptions, Vocab, read_image_info, read_karpathy, require_splits
from .features import FeatureStore, pad
from ..config import CAPTIONS_PER_IMAGE
from ..errors import DataError
_CACHE_LIMIT_BYTES = 2 << 30  # keep padded features in memory when a split's worth fits in this


@dataclass
class DataPaths:
    captions: Path
    features: Path
    test_images: Path | None = None
    val_images: Path | None = None
    grounding: Path | None = None


def resolve_paths(data_cfg) -> DataPaths:
    """Where the files of a `data` config section are (synthetic data is generated on first use)."""
    if data_cfg.kind == "synthetic":
        p = synthetic.ensure(data_cfg.root, data_cfg.seed, data_cfg.images)
        return DataPaths(p["captions"], p["features"], p["test_images"], p["val_images"], p["grounding"])
    return DataPaths(Path(data_cfg.captions), Path(data_cfg.features),
                     Path(data_cfg.test_images) if data_cfg.test_images else None)


class CaptionData:
    """Splits, vocabulary and features of one dataset. `vocab` given = reuse a trained model's vocabulary."""

    def __init__(self, data_cfg, max_regions: int, feature_dim: int = 2048, vocab: Vocab | None = None):
        self.cfg = data_cfg
        self.paths = resolve_paths(data_cfg)
        self.max_regions = max_regions
        self.splits = read_karpathy(self.paths.captions)
        self.vocab = vocab or Vocab.build([c for img in self.splits["train"] for c in img.captions],
                                          data_cfg.vocab_min_count)
        self.features = FeatureStore(self.paths.features, feature_dim)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        per_image = max_regions * feature_dim * 4
        self._cacheable = per_image * sum(len(v) for v in self.splits.values()) < _CACHE_LIMIT_BYTES
        self._grounding = None

    # -- lookups ----------------------------------------------------------------------------------------------
    def images(self, split: str) -> list[ImageCaptions]:
        if split in self.splits:
            return self.splits[split]
        if split == "test2014":
            if not self.paths.test_images:
                raise DataError("data.test_images is not set: no test-server image list")
            return [ImageCaptions(i, "test2014", "test2014") for i in read_image_info(self.paths.test_images)]
        if split == "val2014":
            if self.paths.val_images and self.paths.val_images.is_file():
                ids = read_image_info(self.paths.val_images)
            else:
                ids = [img.image_id for s in self.splits.values() for img in s if img.filepath == "val2014"]
            return [ImageCaptions(i, "val2014", "val2014") for i in ids]
        raise DataError(f"unknown split {split!r}: train, val, test, val2014 or test2014")

    def references(self, split: str) -> dict[int, list[str]]:
        """Tokenized reference captions as space-joined strings, per image id."""
        return {img.image_id: [" ".join(c) for c in img.captions] for img in self.images(split)}

    def grounding(self) -> dict[int, dict] | None:
        """Synthetic data only: per image, the region of every token of every sentence (-1: not grounded)."""
        if self._grounding is None and self.paths.grounding and self.paths.grounding.is_file():
            raw = json.loads(self.paths.grounding.read_text())
            self._grounding = {int(k): v for k, v in raw.items()}
        return self._grounding

    def region_features(self, image_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(max_regions, D) float32 features and their (max_regions,) region mask."""
        feats, mask = pad([self.region_rows(image_id)], self.max_regions, self.features.feature_dim)
        return feats[0].float().numpy(), mask[0].numpy()

    def region_rows(self, image_id: int) -> np.ndarray:
        """(n <= max_regions, D) rows of one image; padded per batch by `_collate`. Small sets stay in memory; a
        prepared store needs no cache of ours (its memory map is in the OS page cache, shared by processes)."""
        hit = self._cache.get(image_id)
        if hit is None:
            hit = self.features.rows(image_id, self.max_regions)
            if self._cacheable and self.features.prepared is None:
                self._cache[image_id] = hit
        return hit

    # -- batches ----------------------------------------------------------------------------------------------
    def loader(self, split: str, batch_size: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
               rank: int = 0, world: int = 1, num_workers: int = 0, with_captions: bool = True,
               limit: int | None = None) -> DataLoader:
        """Batches of whole images. With world > 1 each rank gets a disjoint, equally long shard."""
        images = self.images(split)[:limit] if limit else self.images(split)
        order = np.arange(len(images))
        if shuffle:
            order = np.random.default_rng((seed, epoch)).permutation(len(images))
        if world > 1:
            per_rank = -(-len(order) // world)
            order = np.resize(order, per_rank * world)  # wrap around so every rank has the same number of steps
            order = order[rank::world]
        batches = [order[i:i + batch_size].tolist() for i in range(0, len(order), batch_size)]
        ds = _ImageDataset(self, images, with_captions)
        collate = functools.partial(_collate, max_regions=self.max_regions, dim=self.features.feature_dim)
        return DataLoader(ds, batch_sampler=batches, num_workers=num_workers, collate_fn=collate,
                          persistent_workers=False)

    def train_loader(self, images_per_step: int, *, seed: int = 0, epoch: int = 0, rank: int = 0, world: int = 1,
                     num_workers: int = 0, split: str = "train") -> DataLoader:
        """The training batches of one epoch: a global batch of `images_per_step` images per optimizer step, of
        which rank r of `world` gets the r-th contiguous `images_per_step / world`, so the steps of an epoch and
        the images of each step are the same at any number of workers (`images_per_step` must split evenly:
        `a2core.config.images_per_worker`). The last step is filled up from the start of the epoch's order."""
        if images_per_step % world:
            raise ValueError(f"{images_per_step} images per step do not split over {world} workers")
        images = self.images(split)
        order = np.random.default_rng((seed, epoch)).permutation(len(images))
        steps = -(-len(order) // images_per_step)
        order = np.resize(order, steps * images_per_step).reshape(steps, world, -1)  # (steps, world, images/world)
        ds = _ImageDataset(self, images, True)
        collate = functools.partial(_collate, max_regions=self.max_regions, dim=self.features.feature_dim)
        return DataLoader(ds, batch_sampler=order[:, rank].tolist(), num_workers=num_workers, collate_fn=collate,
                          persistent_workers=False)

    def check(self, splits=("train", "val", "test")) -> None:
        """Fail before training if train or val (when asked for) is empty, or if any image of these splits has no
        features (names the ids)."""
        require_splits(self.splits, self.paths.captions, [s for s in ("train", "val") if s in splits])
        for split in splits:
            self.features.check_ids([img.image_id for img in self.images(split)])


class _ImageDataset(Dataset):
    def __init__(self, data: CaptionData, images: list[ImageCaptions], with_captions: bool):
        self.data, self.images, self.with_captions = data, images, with_captions
        self.max_len = data.cfg.max_caption_len

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        img = self.images[i]
        item = {"image_id": img.image_id, "rows": self.data.region_rows(img.image_id)}  # (n, D)
        if self.with_captions and img.captions:
            caps = [img.captions[j % len(img.captions)] for j in range(CAPTIONS_PER_IMAGE)]
            item["captions"] = [self.data.vocab.encode(c, self.max_len) for c in caps]
        return item


def _collate(items: list[dict], max_regions: int, dim: int) -> dict:
    feats, mask = pad([it["rows"] for it in items], max_regions, dim)
    batch = {
        "image_ids": torch.tensor([it["image_id"] for it in items], dtype=torch.long),
        "feats": feats,  # (B, R, D) zero-padded; float16 from a prepared store (the model widens it), else float32
        "region_mask": mask,  # (B, R) True = region
    }
    if all("captions" in it for it in items):
        length = max(len(c) for it in items for c in it["captions"])
        caps = torch.zeros(len(items), CAPTIONS_PER_IMAGE, length, dtype=torch.long)  # 0 = <pad>
        for b, it in enumerate(items):
            for j, c in enumerate(it["captions"]):
                caps[b, j, :len(c)] = torch.tensor(c)
        batch["captions"] = caps  # (B, 5, L): <bos> w1 .. wn <eos> <pad>..
    return batch

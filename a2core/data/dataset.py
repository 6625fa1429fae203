"""What a run reads: vocabulary, Karpathy splits, region features, and batches of images with 5 captions each."""
from __future__ import annotations

import ctypes
import ctypes.util
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
# glibc's malloc serves an allocation above its mmap threshold with a fresh mmap and unmaps it on free, so every
# padded batch (20 MB at 50 x 100 x 2048 float16, twice that in float32) was zero-filled by the kernel page by page
# before being written: 3,300 minor faults a batch measured, 5 ms of a prepared store's 6 ms batch (RESULTS.md).
# Raised thresholds keep such buffers in the heap, where the next batch reuses the pages of the one freed before it.
_MMAP_THRESHOLD_BYTES = 256 << 20  # batches up to 256 MB come from the heap
_TRIM_THRESHOLD_BYTES = 512 << 20  # at most this much freed heap is kept back from the OS
_batch_memory_kept = False


def keep_batch_memory() -> bool:
    """Let this process reuse freed batch buffers instead of having each one mapped and zero-filled afresh
    (glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD; the process keeps up to 512 MB of freed heap). Called once
    per process by the loaders that build batches; False (nothing changed) where the C library has no mallopt."""
    global _batch_memory_kept
    if not _batch_memory_kept:
        name = ctypes.util.find_library("c")
        try:
            mallopt = ctypes.CDLL(name).mallopt if name else None
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            mallopt = None
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        _batch_memory_kept = bool(mallopt and mallopt(m_mmap_threshold, _MMAP_THRESHOLD_BYTES)
                                  and mallopt(m_trim_threshold, _TRIM_THRESHOLD_BYTES))
    return _batch_memory_kept


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
        p = synthetic.ensure(data_cfg.root, data_cfg.seed, data_cfg.images, data_cfg.test_split_images)
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
        self._encoded: dict[int, list[list[int]]] = {}  # image id -> its captions as token ids (`encoded_captions`)
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
        """(n <= max_regions, D) rows of one image; padded per batch by `pad`. Small sets stay in memory; a
        prepared store needs no cache of ours (its memory map is in the OS page cache, shared by processes)."""
        hit = self._cache.get(image_id)
        if hit is None:
            hit = self.features.rows(image_id, self.max_regions)
            if self._cacheable and self.features.prepared is None:
                self._cache[image_id] = hit
        return hit

    def encoded_captions(self, image: ImageCaptions) -> list[list[int]]:
        """The image's CAPTIONS_PER_IMAGE captions as token ids (<bos> .. <eos>; fewer references are repeated in
        turn). Encoded on first use and kept: the same image comes back every epoch, and encoding was 1.4 ms of a
        3 ms batch of a prepared store (benchmarks/RESULTS.md)."""
        hit = self._encoded.get(image.image_id)
        if hit is None:
            caps, max_len = image.captions, self.cfg.max_caption_len
            hit = self._encoded[image.image_id] = [self.vocab.encode(caps[j % len(caps)], max_len)
                                                   for j in range(CAPTIONS_PER_IMAGE)]
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
        return _BatchLoader(self, _ImageDataset(self, images, with_captions), batch_sampler=batches,
                            num_workers=num_workers, collate_fn=_whole_batch, persistent_workers=False)

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
        return _BatchLoader(self, _ImageDataset(self, images, True), batch_sampler=order[:, rank].tolist(),
                            num_workers=num_workers, collate_fn=_whole_batch, persistent_workers=False)

    def pair_loader(self, pairs_per_step: int, *, seed: int = 0, epoch: int = 0, rank: int = 0, world: int = 1,
                    num_workers: int = 0, split: str = "train") -> DataLoader:
        """The training batches of one epoch in batch_layout `pairs`, as M2 draws them (a DataLoader with
        shuffle=True over the dataset of (image, caption) pairs): a global batch of `pairs_per_step` pairs drawn
        from one permutation, seeded by (seed, epoch), of all the split's pairs, each image's 5 captions of
        `encoded_captions` (pair p = image p // 5, caption p % 5). Rank r of `world` gets the r-th contiguous
        `pairs_per_step / world` pairs of each step, so the steps of an epoch and the pairs of each step are the same
        at any number of workers (`pairs_per_step` must split evenly: `a2core.config.pairs_per_worker`). The last
        step is filled up from the start of the epoch's order. Batches: `_PairDataset`."""
        if pairs_per_step % world:
            raise ValueError(f"{pairs_per_step} pairs per step do not split over {world} workers")
        images = self.images(split)
        order = np.random.default_rng((seed, epoch)).permutation(len(images) * CAPTIONS_PER_IMAGE)
        steps = -(-len(order) // pairs_per_step)
        order = np.resize(order, steps * pairs_per_step).reshape(steps, world, -1)  # (steps, world, pairs/world)
        return _BatchLoader(self, _PairDataset(self, images), batch_sampler=order[:, rank].tolist(),
                            num_workers=num_workers, collate_fn=_whole_batch, persistent_workers=False)

    def check(self, splits=("train", "val", "test"), scored=()) -> None:
        """Fail before training if train or val (when asked for) is empty, if any image of these splits or of a
        `scored` split has no features, or if an image of a `scored` split has no reference captions (names the
        ids). A scored split is decoded, so its features are needed too (`train.test_at_end` scores test)."""
        require_splits(self.splits, self.paths.captions, [s for s in ("train", "val") if s in splits])
        for split in dict.fromkeys([*splits, *scored]):
            self.features.check_ids([img.image_id for img in self.images(split)])
        for split in scored:  # only test may hold images without sentences (read_karpathy); CIDEr-D needs them
            bare = [img.image_id for img in self.images(split) if not img.captions]
            if bare:
                raise DataError(f"{self.paths.captions}: {len(bare)} {split} image(s) have no sentences to score "
                                f"captions against, e.g. image id {', '.join(map(str, bare[:5]))}")


class _ImageDataset(Dataset):
    """Images of a split; a batch is built whole by `__getitems__` (torch's fetcher calls it with a batch's
    indices, then `collate_fn` on its result, in a worker or the main process)."""

    def __init__(self, data: CaptionData, images: list[ImageCaptions], with_captions: bool):
        self.data, self.images, self.with_captions = data, images, with_captions

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return _finish(self.data, self.__getitems__([i]))

    def __getitems__(self, indices: list[int]) -> dict:
        images = [self.images[i] for i in indices]
        ids = [img.image_id for img in images]
        batch = {"image_ids": torch.tensor(ids, dtype=torch.long)}
        prepared = self.data.features.prepared
        if prepared is not None:
            # only where the rows are, (B, 2): the padded batch (20 MB at 50 x 100 x 2048 float16) is gathered from
            # the shared memory map by the process that consumes it (`_finish`), since handing it over from a
            # worker costs more than gathering it (a fresh shared-memory segment per batch: benchmarks/RESULTS.md)
            where = prepared.locate(ids, self.data.max_regions)
            prepared.prefetch(where)  # reads queued now, in a worker ahead of the batches being consumed
            batch["regions"] = torch.from_numpy(where)
        else:
            batch["feats"], batch["region_mask"] = pad([self.data.region_rows(i) for i in ids],
                                                       self.data.max_regions, self.data.features.feature_dim)
        if self.with_captions and all(img.captions for img in images):
            encoded = [self.data.encoded_captions(img) for img in images]
            length = max(len(c) for caps in encoded for c in caps)
            caps = np.zeros((len(images), CAPTIONS_PER_IMAGE, length), dtype=np.int64)  # 0 = <pad>
            for b, captions in enumerate(encoded):
                for j, c in enumerate(captions):
                    caps[b, j, :len(c)] = c
            batch["captions"] = torch.from_numpy(caps)  # (B, 5, L): <bos> w1 .. wn <eos> <pad>..
        return batch


class _PairDataset(_ImageDataset):
    """(image, caption) pairs of a split: index p is image p // 5 with its caption p % 5. A batch holds each
    distinct image once: image_ids (U,), feats (U, R, D), region_mask (U, R), in the order of first appearance,
    with captions (P, L) of the P pairs and caption_image (P,), the row of each pair's image among the U, so pairs
    of one image share one encoder pass (`a2core.train.Updates.xe`)."""

    def __init__(self, data: CaptionData, images: list[ImageCaptions]):
        super().__init__(data, images, False)  # the pairs' captions are added below, one per pair

    def __len__(self) -> int:
        return len(self.images) * CAPTIONS_PER_IMAGE

    def __getitems__(self, indices: list[int]) -> dict:
        image_of = [i // CAPTIONS_PER_IMAGE for i in indices]
        distinct = list(dict.fromkeys(image_of))  # first appearance order
        row = {img: r for r, img in enumerate(distinct)}
        batch = super().__getitems__(distinct)
        encoded = [self.data.encoded_captions(self.images[i // CAPTIONS_PER_IMAGE])[i % CAPTIONS_PER_IMAGE]
                   for i in indices]
        caps = np.zeros((len(indices), max(len(c) for c in encoded)), dtype=np.int64)  # 0 = <pad>
        for p, c in enumerate(encoded):
            caps[p, :len(c)] = c
        batch["captions"] = torch.from_numpy(caps)  # (P, L): <bos> w1 .. wn <eos> <pad>..
        batch["caption_image"] = torch.tensor([row[i] for i in image_of], dtype=torch.long)  # (P,) into the U
        return batch


def _whole_batch(batch: dict) -> dict:
    """collate_fn: `_ImageDataset.__getitems__` has built the batch already."""
    return batch


def _finish(data: CaptionData, batch: dict) -> dict:
    """The batch as the model takes it: image_ids (B,), feats (B, R, D) zero-padded (float16 from a prepared store,
    which the model widens; else float32), region_mask (B, R) True = region, and captions (B, 5, L) when asked."""
    where = batch.pop("regions", None)
    if where is not None:
        batch["feats"], batch["region_mask"] = data.features.prepared.gather(where.numpy(), data.max_regions)
    return batch


class _BatchLoader(DataLoader):
    """A DataLoader whose batches are finished (`_finish`) in the process that iterates it."""

    def __init__(self, data: CaptionData, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.data = data

    def __iter__(self):
        keep_batch_memory()  # every batch below is a fresh batch-sized buffer (in this process or a worker)
        for batch in super().__iter__():
            yield _finish(self.data, batch)

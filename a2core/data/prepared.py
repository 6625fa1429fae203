"""The prepared feature layout: every image's region features as float16 rows of one memory-mappable file.

A prepared store is a folder (by convention `NAME.a2feat`) of three files:

- `rows.f16`      all regions of all images, little-endian float16, shape (total_rows, D), row-major;
- `index.npy`     int64 (images, 3): image id, first row, number of rows; sorted by image id;
- `manifest.json` format, version, D, counts, and the size and SHA-256 of the two files above. `checksum` (the
                  SHA-256 of those file entries) names the store's content: two copies with the same checksum
                  hold the same bytes. The manifest is written last, so a folder with one is complete.

Why: the HDF5 layout pays a dataset lookup and an open per image (tens of thousands of tiny reads an epoch); here
an image is one slice of a memory map, half the bytes of float32, read without a per-image parser. float16 keeps
11 significant bits (relative rounding <= 2^-11 ~ 4.9e-4; below 6.1e-5, absolute <= 2^-25), far below what changes
a model's outputs beyond float tolerance (tests/test_prepared.py); values outside float16's range are refused at
`prepare` time, naming the image id.

`prepare(source, out)` converts an HDF5 file of `{image_id}_features` datasets or a directory of `{image_id}.npz`
files (the layouts `FeatureStore` reads) and checks every image as it goes (shape, finite values), naming the file
and image id of the first bad one. The folder appears whole or not at all (written beside `out`, then renamed).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # torch is imported where batches are gathered (`PreparedFeatures.gather`)
    import torch

from ..errors import DataError

FORMAT = "a2tune-features"
VERSION = 1
MANIFEST = "manifest.json"
ROWS = "rows.f16"
INDEX = "index.npy"
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504
_HASH_BLOCK = 16 << 20


def is_prepared(path: str | os.PathLike) -> bool:
    """True for a folder holding a prepared store's manifest."""
    return (Path(path) / MANIFEST).is_file()


def file_sha256(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


def files_checksum(files: dict) -> str:
    """The store's content id: SHA-256 over its data files' names, sizes and SHA-256s."""
    text = json.dumps({name: [files[name]["size"], files[name]["sha256"]] for name in sorted(files)})
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the store at `path`, checked for format and version (DataError naming the file)."""
    file = Path(path) / MANIFEST
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise DataError(f"{file}: no such file (not a prepared feature store, or an incomplete copy)") from None
    except OSError as err:
        raise DataError(f"{file}: unreadable manifest ({err})") from None
    return parse_manifest(text, file)


def parse_manifest(text: str, file: str | os.PathLike) -> dict:
    """A manifest's text (of a local store, or of a copy in storage), checked for format, version and checksum;
    DataError naming `file`."""
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise DataError(f"{file}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{file}: not a manifest of a prepared feature store (format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"{file}: store version {manifest.get('version')!r}, this a2tune reads version {VERSION}")
    files = manifest.get("files") or {}
    if set(files) != {ROWS, INDEX} or manifest.get("checksum") != files_checksum(files):
        raise DataError(f"{file}: manifest is damaged (its file entries do not match its checksum)")
    return manifest


def check_copy(path: str | os.PathLike, *, full: bool = False, expected: str | None = None) -> dict:
    """The manifest of the store at `path` after checking that its files are there with their recorded sizes
    (and, with `full`, their SHA-256s; with `expected`, that its checksum is that one). DataError names the file."""
    path = Path(path)
    manifest = read_manifest(path)
    if expected is not None and manifest["checksum"] != expected:
        raise DataError(f"{path / MANIFEST}: store checksum {manifest['checksum'][:16]}... differs from the "
                        f"expected {expected[:16]}... (another version of the features)")
    for name, entry in manifest["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{file}: missing (the store's manifest lists it)") from None
        if size != entry["size"]:
            raise DataError(f"{file}: {size} bytes, the manifest says {entry['size']} (truncated or replaced)")
        if full and file_sha256(file) != entry["sha256"]:
            raise DataError(f"{file}: SHA-256 differs from the manifest's (corrupted copy)")
    return manifest


class PreparedFeatures:
    """Read side of a prepared store. The memory map is opened lazily, once per process (DataLoader workers map
    the file themselves rather than receive a pickled copy of it)."""

    def __init__(self, path: str | os.PathLike, feature_dim: int = 2048):
        self.path = Path(path)
        self.manifest = check_copy(self.path)
        if self.manifest["feature_dim"] != feature_dim:
            raise DataError(f"{self.path / MANIFEST}: features are {self.manifest['feature_dim']}-d, the model "
                            f"expects {feature_dim}")
        self.feature_dim = feature_dim
        try:  # a same-size but damaged index (zero-filled after a crash) passes check_copy's size check
            index = np.load(self.path / INDEX)  # (images, 3) int64: id, first row, rows
        except (OSError, ValueError, EOFError) as err:
            raise DataError(f"{self.path / INDEX}: unreadable or damaged index ({err}); fetch or prepare the "
                            f"store again") from None
        if not isinstance(index, np.ndarray) or index.dtype.kind not in "iu":
            raise DataError(f"{self.path / INDEX}: not an integer array (a damaged index)")
        if index.ndim != 2 or index.shape != (self.manifest["images"], 3):
            raise DataError(f"{self.path / INDEX}: shape {index.shape}, expected ({self.manifest['images']}, 3)")
        index = index.astype(np.int64, copy=False)
        bad = np.flatnonzero((index[:, 2] < 1) | (index[:, 1] < 0) | (index[:, 1] + index[:, 2] > self.manifest["rows"])
                             | np.r_[False, index[1:, 0] <= index[:-1, 0]])
        if len(bad):
            raise DataError(f"{self.path / INDEX}: row {int(bad[0])} (image id {int(index[bad[0], 0])}) is out of "
                            f"order, repeated or outside the store's {self.manifest['rows']} rows (a damaged index)")
        self.ids, self.starts, self.counts = index[:, 0], index[:, 1], index[:, 2]
        self._rows = self._rows_tensor = None
        self._fd: int | None = None  # the rows file, for `prefetch`

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_rows"] = state["_rows_tensor"] = state["_fd"] = None
        return state

    @property
    def rows(self) -> np.memmap:
        if self._rows is None:
            # copy-on-write: the file is opened read-only, and slices are writable arrays that torch takes without
            # its warning about read-only memory (nothing ever writes to them)
            self._rows = np.memmap(self.path / ROWS, dtype="<f2", mode="c",
                                   shape=(self.manifest["rows"], self.feature_dim))
        return self._rows

    def __len__(self) -> int:
        return len(self.ids)

    def _slot(self, image_id: int) -> int:
        i = int(np.searchsorted(self.ids, image_id))
        return i if i < len(self.ids) and self.ids[i] == image_id else -1

    def has(self, image_id: int) -> bool:
        return self._slot(image_id) >= 0

    def missing(self, image_ids) -> list[int]:
        ids = np.asarray(list(image_ids), dtype=np.int64)
        found = np.isin(ids, self.ids)
        return ids[~found].tolist()

    def get16(self, image_id: int) -> np.ndarray:
        """(n, D) float16 view into the memory map (no copy)."""
        i = self._slot(image_id)
        if i < 0:
            raise DataError(f"{self.path}: no region features for image id {image_id}")
        start, n = int(self.starts[i]), int(self.counts[i])
        return self.rows[start:start + n]

    def locate(self, image_ids, max_regions: int) -> np.ndarray:
        """(B, 2) int64: each image's first row and its number of rows (cut to `max_regions`); a few bytes per
        image to hand from a DataLoader worker to the process that `gather`s them. DataError names a missing id."""
        ids = np.asarray(image_ids, dtype=np.int64)
        slots = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        missing = ids[self.ids[slots] != ids]
        if len(missing):
            raise DataError(f"{self.path}: no region features for image id {int(missing[0])}")
        return np.stack([self.starts[slots], np.minimum(self.counts[slots], max_regions)], axis=1)

    def prefetch(self, where: np.ndarray) -> None:
        """Ask the OS to read the rows located by `where` (B, 2) into its page cache, without waiting: all of a
        batch's reads are queued at once (a memory map alone faults them in one image at a time), and in a
        DataLoader worker they proceed while the batches before it are consumed. A no-op where the OS has no
        posix_fadvise; cached rows cost a lookup."""
        if not hasattr(os, "posix_fadvise"):
            return
        if self._fd is None:
            self._fd = os.open(self.path / ROWS, os.O_RDONLY)
        row_bytes = 2 * self.feature_dim
        for start, n in where.tolist():
            os.posix_fadvise(self._fd, start * row_bytes, n * row_bytes, os.POSIX_FADV_WILLNEED)

    def gather(self, where: np.ndarray, max_regions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch located by `where` (B, 2) as zero-padded (B, max_regions, D) float16 features and their
        (B, max_regions) bool mask, True where a real region is; the same values as `features.pad` of the images'
        rows. Each image is one copy from the memory map into the batch, in file order (sequential reads when
        the store comes from disk); only the padding is zeroed, not the whole batch first."""
        import torch  # torch: only where batches are gathered, not for the checks `a2 study validate` runs

        rows = self.rows_tensor  # (total_rows, D) float16 over the memory map
        counts = torch.from_numpy(np.ascontiguousarray(where[:, 1]))
        feats = torch.empty((len(where), max_regions, self.feature_dim), dtype=torch.float16)
        for b in np.argsort(where[:, 0], kind="stable").tolist():
            start, n = int(where[b, 0]), int(where[b, 1])
            feats[b, :n] = rows[start:start + n]
            feats[b, n:] = 0
        mask = torch.arange(max_regions) < counts[:, None]  # (B, max_regions)
        return feats, mask

    @property
    def rows_tensor(self) -> torch.Tensor:
        if self._rows_tensor is None:
            import torch  # torch: as in `gather`

            self._rows_tensor = torch.from_numpy(self.rows)  # shares the memory map, no copy
        return self._rows_tensor

    def close(self) -> None:
        self._rows = self._rows_tensor = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

"""Bottom-up region features, from one HDF5 file, a directory of .npz files, or a prepared store.

HDF5: one dataset `"{image_id}_features"` of shape (n, D) per image. Directory: `{image_id}.npz` with key `feat`.
Prepared store: a folder with `manifest.json` (float16 rows in one memory map; `prepared.py`), which `prepare` (`a2 data
prepare`) writes from either of the others.
Every error names the file and the image id. Features are padded or cut to `max_regions` with a region mask.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..atomic import atomic_write, building_folder
from ..errors import DataError
from .captions import INT64_MAX
from .prepared import (FLOAT16_MAX, FORMAT, INDEX, MANIFEST, ROWS, VERSION, PreparedFeatures, file_sha256,
                       files_checksum, is_prepared)


class FeatureStore:
    """Opened lazily (per process: HDF5 handles and memory maps must not cross a fork)."""

    prepared: PreparedFeatures | None = None  # set for a prepared store (subclasses without a file keep None)

    def __init__(self, path: str | Path, feature_dim: int = 2048):
        self.path = Path(path)
        self.feature_dim = feature_dim
        if not self.path.exists():
            raise DataError(f"{self.path}: region features not found")
        self.is_dir = self.path.is_dir()
        self.prepared = PreparedFeatures(self.path, feature_dim) if self.is_dir and is_prepared(self.path) else None
        self._h5 = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_h5"] = None
        return state

    def _file(self):
        if self._h5 is None:
            import h5py  # h5py: only for an HDF5 source (a prepared store or .npz folder needs none)

            try:
                self._h5 = h5py.File(self.path, "r")
            except OSError as err:
                raise DataError(f"{self.path}: cannot open as HDF5 ({err})") from None
        return self._h5

    def has(self, image_id: int) -> bool:
        if self.prepared is not None:
            return self.prepared.has(image_id)
        if self.is_dir:
            return (self.path / f"{image_id}.npz").is_file()
        return f"{image_id}_features" in self._file()

    def check_ids(self, image_ids) -> None:
        """Fail early, naming the first image ids without features."""
        if self.prepared is not None:
            missing = self.prepared.missing(image_ids)
        else:
            missing = [i for i in image_ids if not self.has(i)]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise DataError(f"{self.path}: no region features for {len(missing)} image id(s): {shown}")

    def get(self, image_id: int) -> np.ndarray:
        """(n, D) float32."""
        if self.prepared is not None:  # checked when prepared (shape, finite values) and by size on opening
            return np.asarray(self.prepared.get16(image_id), dtype=np.float32)
        if self.is_dir:
            file = self.path / f"{image_id}.npz"
            if not file.is_file():
                raise DataError(f"{file}: no region features for image id {image_id}")
            if not zipfile.is_zipfile(file):  # np.load would read a .npy (an array, no 'feat') or guess pickle
                raise DataError(f"{file}: image id {image_id}: not an .npz archive (unreadable or truncated)")
            try:
                with np.load(file) as npz:
                    if "feat" not in npz:
                        raise DataError(f"{file}: image id {image_id}: no array 'feat' (has {list(npz.keys())})")
                    feat = npz["feat"]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
                if isinstance(err, DataError):
                    raise
                raise DataError(f"{file}: image id {image_id}: unreadable or truncated ({err})") from None
            where = file
        else:
            key = f"{image_id}_features"
            h5 = self._file()
            if key not in h5:
                raise DataError(f"{self.path}: no dataset {key!r} for image id {image_id}")
            try:
                node = h5[key]
            except (OSError, KeyError) as err:  # a dangling link
                raise DataError(f"{self.path}: image id {image_id}: unreadable ({err})") from None
            if not hasattr(node, "dtype"):  # an h5py Group: `[()]` would raise TypeError
                raise DataError(f"{self.path}: image id {image_id}: {key!r} is an HDF5 group, not a dataset")
            try:
                feat = node[()]
            except (OSError, KeyError, TypeError, ValueError) as err:
                raise DataError(f"{self.path}: image id {image_id}: unreadable ({err})") from None
            where = self.path
        feat = np.asarray(feat)
        if feat.dtype.kind not in "fiu":  # complex would lose its imaginary part, strings or records make no sense
            raise DataError(f"{where}: image id {image_id}: features are of type {feat.dtype}, not real numbers")
        if feat.ndim != 2 or feat.shape[1] != self.feature_dim or feat.shape[0] < 1:
            raise DataError(f"{where}: image id {image_id}: features have shape {feat.shape}, "
                               f"expected (n >= 1, {self.feature_dim})")
        feat = feat.astype(np.float32, copy=False)
        if not np.isfinite(feat).all():
            raise DataError(f"{where}: image id {image_id}: features contain NaN or inf")
        return feat

    def rows(self, image_id: int, max_regions: int) -> np.ndarray:
        """The image's first `max_regions` regions, (n <= max_regions, D): float32, or float16 straight from the
        memory map of a prepared store (no copy; `pad` converts while it copies)."""
        feat = self.prepared.get16(image_id) if self.prepared is not None else self.get(image_id)
        return feat[:max_regions]

    def padded(self, image_id: int, max_regions: int) -> tuple[np.ndarray, np.ndarray]:
        """(max_regions, D) features and a (max_regions,) bool mask, True where a real region is."""
        feats, mask = pad([self.rows(image_id, max_regions)], max_regions, self.feature_dim)
        return feats[0].float().numpy(), mask[0].numpy()

    def close(self) -> None:
        if self.prepared is not None:
            self.prepared.close()
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


def pad(rows: list[np.ndarray], max_regions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images' region rows, each (n_b <= max_regions, D), as a zero-padded (B, max_regions, D) tensor and a
    (B, max_regions) bool mask, True where a real region is. float16 rows (a prepared store) stay float16: half the
    bytes to allocate here and to move to the device, where the model widens them (`A2Transformer.encode`);
    float16 -> float32 is exact, so results are those of converting here."""
    dtype = torch.float16 if rows and all(r.dtype == np.float16 for r in rows) else torch.float32
    shape = (len(rows), max_regions, dim)
    if torch.utils.data.get_worker_info() is not None:
        # in a DataLoader worker: straight into shared memory, as torch's default_collate does, rather than into
        # private memory that the worker would then copy there to hand the batch over (1.6-1.8x more images/s)
        storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
        feats = torch.empty(0, dtype=dtype).set_(storage).view(shape).zero_()
    else:
        feats = torch.zeros(shape, dtype=dtype)
    mask = torch.zeros(len(rows), max_regions, dtype=torch.bool)
    for b, r in enumerate(rows):
        feats[b, :len(r)] = torch.from_numpy(r)  # torch converts float16 ~20x faster than numpy's astype
        mask[b, :len(r)] = True
    return feats, mask


# -- conversion -------------------------------------------------------------------------------------------------
def source_ids(source: str | os.PathLike) -> list[int]:
    """Image ids of an HDF5 file of `{id}_features` datasets or a directory of `{id}.npz`, sorted; a name that
    is not an image id is an error naming it. Other HDF5 datasets (`{id}_boxes`, `{id}_cls_prob`) are left out."""
    source = Path(source)
    if not source.exists():
        raise DataError(f"{source}: region features not found")
    ids = []
    if source.is_dir():
        names = sorted(p.name for p in source.iterdir() if p.suffix == ".npz")
        for name in names:
            stem = name[:-len(".npz")]
            if _image_id(stem) is None:
                raise DataError(f"{source / name}: file name is not an image id ({{image_id}}.npz, the id in "
                                f"plain decimal digits without leading zeros, at most {INT64_MAX})")
            ids.append(int(stem))
    else:
        import h5py  # h5py: as in `FeatureStore._file`

        try:
            with h5py.File(source, "r") as h5:
                keys = list(h5.keys())
        except OSError as err:
            raise DataError(f"{source}: cannot open as HDF5 ({err})") from None
        for key in keys:
            if not key.endswith("_features"):  # M2's coco_detections.hdf5 also holds {id}_boxes and {id}_cls_prob
                continue
            stem = key[:-len("_features")]
            if not stem or _image_id(stem) is None:
                raise DataError(f"{source}: dataset {key!r} is not named {{image_id}}_features (the id in plain "
                                f"decimal digits without leading zeros, at most {INT64_MAX})")
            ids.append(int(stem))
    if not ids:
        raise DataError(f"{source}: no region features in it")
    return sorted(ids)


_DECIMAL = re.compile(r"0|[1-9][0-9]*")  # ASCII only: str.isdigit() takes "²" and "١", and int() "01" as 1


def _image_id(stem: str) -> int | None:
    """The image id a file or dataset name spells, None unless it is the id's canonical decimal form (the form
    `FeatureStore` looks it up by: "01.npz" would never be found as image id 1) within int64."""
    if not _DECIMAL.fullmatch(stem):
        return None
    value = int(stem)
    return value if value <= INT64_MAX else None


def prepare(source: str | os.PathLike, out: str | os.PathLike, *, feature_dim: int = 2048,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Convert `source` (HDF5 or .npz directory) into a prepared store at `out`; returns its manifest.
    `progress(done, total)` is called every few hundred images."""
    out = Path(out)
    if out.exists():
        raise DataError(f"{out}: exists already; remove it or choose another output folder")
    ids = source_ids(source)
    store = FeatureStore(source, feature_dim)
    tmp = building_folder(out, ".prepare")
    try:
        index = np.zeros((len(ids), 3), np.int64)
        digest, row, size = hashlib.sha256(), 0, 0
        with open(tmp / ROWS, "wb") as f:
            for i, image_id in enumerate(ids):
                feat = store.get(image_id)  # (n, D) float32, checked: shape and finite values, errors name file+id
                if np.abs(feat).max() > FLOAT16_MAX:
                    raise DataError(f"{source}: image id {image_id}: feature values beyond float16's range "
                                    f"(|x| > {FLOAT16_MAX:g})")
                block = feat.astype("<f2").tobytes()
                f.write(block)
                digest.update(block)
                index[i] = (image_id, row, len(feat))
                row += len(feat)
                size += len(block)
                if progress and (i + 1) % 500 == 0:
                    progress(i + 1, len(ids))
            f.flush()
            os.fsync(f.fileno())
        store.close()
        np.save(tmp / INDEX, index)
        files = {ROWS: {"size": size, "sha256": digest.hexdigest()},
                 INDEX: {"size": (tmp / INDEX).stat().st_size, "sha256": file_sha256(tmp / INDEX)}}
        manifest = {"format": FORMAT, "version": VERSION, "dtype": "float16", "feature_dim": feature_dim,
                    "images": len(ids), "rows": row, "source": Path(source).name, "files": files,
                    "checksum": files_checksum(files)}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the store from the rest of a team
        os.rename(tmp, out)  # the whole folder appears at once
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress(len(ids), len(ids))
    return manifest


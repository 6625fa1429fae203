"""Synthetic COCO: a captioning dataset with known region-word grounding, written in the real COCO formats.

Each image holds 3-8 objects (class, colour, size, box) and 1-2 background regions. Two objects are the
*subject* and *object* of the scene, and every caption talks about those two and their spatial relation:
"a small red dog to the left of a blue car in a park". Which two they are is marked in the region features
only by a weak, noisy "salience" component that distractor objects carry too, so the decoder must find the
right region for each grounded word (attention matters). Classes come in confusable pairs (dog/cat, car/bus)
and every latent attribute is noisy, so the task does not saturate and model settings change the score.

Region features are a random linear embedding (latent 48-d -> 2048-d, float16 on disk) of
[class one-hot | colour one-hot | size | box | scene | salience markers] plus latent noise.
Written files (the layouts real COCO uses, so the same code path reads both):
  dataset_coco.json          Karpathy format; train2014 images in train/restval, val2014 in val/test/restval
  image_info_test2014.json   test-server images (no captions)
  image_info_val2014.json    every val2014 image id (what the server's val submission must cover)
  features.h5                "{image_id}_features" (n, 2048)
  features/                  {image_id}.npz with key "feat"
  grounding.json             {image_id: {"regions": n, "sentences": [[region index or -1 per token]]}}
Everything is a pure function of (seed, images, test_images).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from ..errors import DataError

CLASSES = ["dog", "cat", "car", "bus", "bird", "plane", "horse", "cow", "man", "woman", "boat", "train",
           "cup", "bottle", "chair", "table"]  # neighbours are confusable pairs
COLOURS = ["red", "blue", "green", "yellow", "black", "white"]
SIZES = ["small", "large"]
SCENES = ["park", "street", "kitchen", "field"]
FEATURE_DIM = 2048
LATENT = len(CLASSES) + len(COLOURS) + 1 + 4 + len(SCENES) + 2 + 6  # + 6 dims of nuisance
FORMAT_VERSION = 1


def _relation(box_a, box_b) -> tuple[str, str]:
    """Words for where a is relative to b, and the inverse. Boxes are (cx, cy, w, h) in [0, 1]."""
    dx, dy = box_a[0] - box_b[0], box_a[1] - box_b[1]
    if abs(dx) >= abs(dy):
        return ("to the left of", "to the right of") if dx < 0 else ("to the right of", "to the left of")
    return ("above", "below") if dy < 0 else ("below", "above")


def _caption(rng, a, b, scene) -> tuple[list[str], list[int]]:
    """Tokens and, per token, the region it is grounded in (-1: none). a, b: dicts of the two objects."""
    rel, inv = _relation(a["box"], b["box"])
    style = rng.integers(5)
    toks: list[tuple[str, int]] = []

    def obj(o, colour=True, size=False):
        out = [("a", -1)]
        if size:
            out.append((SIZES[o["size"]], o["region"]))
        if colour:
            out.append((COLOURS[o["colour"]], o["region"]))
        out.append((CLASSES[o["cls"]], o["region"]))
        return out

    rel_toks = [(w, -1) for w in rel.split()]
    inv_toks = [(w, -1) for w in inv.split()]
    if style == 0:
        toks = obj(a) + rel_toks + obj(b)
    elif style == 1:
        toks = obj(a, size=True) + rel_toks + obj(b, colour=False)
    elif style == 2:
        toks = [("there", -1), ("is", -1)] + obj(a) + rel_toks + obj(b)
    elif style == 3:
        toks = obj(a, colour=False) + rel_toks + obj(b, size=True)
    else:
        toks = obj(b) + inv_toks + obj(a)
    if rng.random() < 0.6:
        toks += [("in", -1), ("a" if scene != 2 else "the", -1), (SCENES[scene], -1)]
    return [t for t, _ in toks], [r for _, r in toks]


def _image(rng, embed) -> tuple[np.ndarray, list[list[str]], list[list[int]]]:
    """One image: (n, 2048) float16 features, 5 captions and their grounding."""
    n_obj = int(rng.integers(3, 9))
    n_bg = int(rng.integers(1, 3))
    scene = int(rng.integers(len(SCENES)))
    objects = []
    for _ in range(n_obj):
        objects.append({"cls": int(rng.integers(len(CLASSES))), "colour": int(rng.integers(len(COLOURS))),
                        "size": int(rng.integers(2)), "box": rng.uniform(0.1, 0.9, 2).tolist() + rng.uniform(0.05, 0.4, 2).tolist()})
    subj, obj_ = rng.choice(n_obj, 2, replace=False)
    latents = []
    for i, o in enumerate(objects):
        z = np.zeros(LATENT, np.float32)
        z[o["cls"]] = 1.0
        z[o["cls"] ^ 1] = 0.3  # confusable partner class leaks in
        k = len(CLASSES)
        z[k + o["colour"]] = 1.0
        k += len(COLOURS)
        z[k] = 1.0 if o["size"] else -1.0
        k += 1
        z[k:k + 4] = o["box"]
        k += 4
        z[k + scene] = 0.5
        k += len(SCENES)
        # Salience markers: strong on the two described objects, weaker but present on distractors.
        z[k] = rng.uniform(0.8, 1.2) if i == subj else rng.uniform(0.0, 0.45)
        z[k + 1] = rng.uniform(0.8, 1.2) if i == obj_ else rng.uniform(0.0, 0.45)
        latents.append(z)
    for _ in range(n_bg):
        z = np.zeros(LATENT, np.float32)
        z[len(CLASSES) + len(COLOURS) + 1 + 4 + scene] = 1.0
        z[-6:] = rng.normal(0, 1.0, 6)
        latents.append(z)
    order = rng.permutation(len(latents))  # regions come in no particular order
    latents = np.stack(latents)[order]
    region_of = {int(old): new for new, old in enumerate(order)}
    for i, o in enumerate(objects):
        o["region"] = region_of[i]
    latents = latents + rng.normal(0, 0.25, latents.shape).astype(np.float32)
    feats = latents @ embed + rng.normal(0, 0.05, (len(latents), FEATURE_DIM)).astype(np.float32)
    feats = np.maximum(feats, 0.0)  # ReLU-like, non-negative as bottom-up features are
    caps, grounds = [], []
    for _ in range(5):
        toks, ground = _caption(rng, objects[subj], objects[obj_], scene)
        caps.append(toks)
        grounds.append(ground)
    return feats.astype(np.float16), caps, grounds


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def generate(out: str | Path, seed: int = 0, images: int = 1500, test_images: int | None = None) -> dict[str, Path]:
    """Write the dataset into `out` (created; replaced atomically if it exists) and return the file paths."""
    out = Path(out).resolve()
    if images < 20:
        raise DataError(f"images must be >= 20, got {images}")
    test_images = max(10, images // 10) if test_images is None else test_images
    rng = np.random.default_rng(seed)
    embed = rng.normal(0, 1.0 / np.sqrt(LATENT), (LATENT, FEATURE_DIM)).astype(np.float32) * 4.0
    embed += rng.normal(0, 0.02, embed.shape).astype(np.float32)

    n_val = n_test = max(5, images // 10)
    n_train = images - n_val - n_test
    n_restval = n_train // 5  # restval images live in val2014 but train with train (as in Karpathy's split)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (work / "features").mkdir()
        import h5py

        entries, grounding, val2014, test2014 = [], {}, [], []
        with h5py.File(work / "features.h5", "w") as h5:
            def put(image_id: int, feats: np.ndarray) -> None:
                h5.create_dataset(f"{image_id}_features", data=feats)
                np.savez(work / "features" / f"{image_id}.npz", feat=feats)

            for i in range(images):
                image_id = 100000 + i
                if i < n_train - n_restval:
                    split, folder = "train", "train2014"
                elif i < n_train:
                    split, folder = "restval", "val2014"
                elif i < n_train + n_val:
                    split, folder = "val", "val2014"
                else:
                    split, folder = "test", "val2014"
                feats, caps, grounds = _image(rng, embed)
                put(image_id, feats)
                entries.append({"cocoid": image_id, "imgid": i, "split": split, "filepath": folder,
                                "filename": f"COCO_{folder}_{image_id:012d}.jpg",
                                "sentences": [{"tokens": c, "raw": " ".join(c).capitalize() + ".", "imgid": i,
                                               "sentid": 5 * i + j} for j, c in enumerate(caps)]})
                grounding[str(image_id)] = {"regions": int(feats.shape[0]), "sentences": grounds}
                if folder == "val2014":
                    val2014.append(image_id)
            for i in range(test_images):
                image_id = 900000 + i
                feats, _, _ = _image(rng, embed)
                put(image_id, feats)
                test2014.append(image_id)

        def info(ids, folder):
            return {"info": {"description": f"a2tune synthetic COCO ({folder}), seed {seed}"},
                    "images": [{"id": i, "file_name": f"COCO_{folder}_{i:012d}.jpg", "width": 640, "height": 480}
                               for i in ids]}

        (work / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": entries}))
        (work / "image_info_test2014.json").write_text(json.dumps(info(test2014, "test2014")))
        (work / "image_info_val2014.json").write_text(json.dumps(info(val2014, "val2014")))
        (work / "grounding.json").write_text(json.dumps(grounding))
        meta = {"format": FORMAT_VERSION, "seed": seed, "images": images, "test_images": test_images,
                "classes": CLASSES, "colours": COLOURS, "sizes": SIZES, "scenes": SCENES}
        (work / "synthetic.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(work, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return paths(out)


def paths(root: str | Path) -> dict[str, Path]:
    root = Path(root)
    return {"root": root, "captions": root / "dataset_coco.json", "features": root / "features.h5",
            "features_dir": root / "features", "test_images": root / "image_info_test2014.json",
            "val_images": root / "image_info_val2014.json", "grounding": root / "grounding.json"}


def default_root(seed: int, images: int) -> Path:
    base = Path(os.environ.get("A2_DATA_CACHE", Path.home() / ".cache" / "a2tune"))
    return base / f"synthetic-v{FORMAT_VERSION}-seed{seed}-n{images}"


def ensure(root: str | Path | None, seed: int, images: int) -> dict[str, Path]:
    """The dataset at `root` (default: a per-user cache), generated first if it is not complete there.

    Several processes may call this at once (data-parallel workers): generation goes to a temp dir and is
    renamed into place, and a lock file keeps the others waiting instead of generating it again.
    """
    root = Path(root) if root else default_root(seed, images)
    meta = root / "synthetic.json"

    def complete() -> bool:
        if not meta.is_file():
            return False
        try:
            m = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return m.get("format") == FORMAT_VERSION and m.get("seed") == seed and m.get("images") == images

    if complete():
        return paths(root)
    import fcntl

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not complete():
            if meta.is_file():
                raise DataError(f"{root}: holds a synthetic dataset of other settings; "
                                 f"choose another data.root or remove it")
            generate(root, seed=seed, images=images)
    return paths(root)

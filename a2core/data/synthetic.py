"""Synthetic COCO: a captioning dataset where word-level grounding is necessary, written in the real COCO formats.

Each image holds 3-5 objects and 1-2 background regions, in random region order. Every object has its own class,
and the objects have two salience values, one per caption slot. All 5 captions of an image name its two most
salient objects (the largest value of salience 1, then of salience 2) and its scene, e.g. "a red dog and a blue
car in a park". The references agree on what a caption should say, as COCO's five do on an image's main content
(with 5 references that each named a different random pair, format version 2, which pair a greedy caption named was
close to arbitrary and val CIDEr swung with it); only the wording varies, each choice per caption (TEMPLATES,
ARTICLES, SCENE_PHRASES: "there is the red dog and a blue car", "a red dog next to a blue car at the park"), its
most common form the same on every image. Captions say no spatial relation (version 3's "to the left of" came from
comparing two boxes, which the smoke study's model had not learned by its last epoch: it guessed the relation of
two images in three, and each guess moved an image's CIDEr-D by hundreds).

A caption names an object by its colour first, and the class word after it is grounded in that object's region
(`grounding.json` maps each class word to its region, -1 for every other token). Format version 5 makes that
region hard to pick out (version 4, where every object had its own colour, was saturated: every converged smoke
run attended the one region of the named colour for every class word and captioned every val image as the
references' most common wording does, so alignment had nothing left to improve): each named object has a
same-colour distractor of another class (if the image has an object to spare, DISTRACTOR), so the colour word alone
leaves two regions, and the distractor's salience is close to the named object's (COMPETE: 40-85% of it; every
other object's at most OTHERS of it). The right region is the one of that colour with the larger salience: a
comparison that softmax attention makes natively (a sharper attention resolves a smaller gap), readable from the
features (the smallest gap, 0.075, is 5.3 standard deviations of the salience noise between the two; the rest of
the latent keeps its noise, LATENT_NOISE), so what a trained model gets wrong is where its attention was not sharp
enough, mostly on the images whose gap is small (measured: benchmarks/RESULTS.md, "Seed noise of the smoke study").

Region features are a fixed random linear embedding (latent -> FEATURE_DIM, then ReLU, float16 on disk) of a
latent vector plus noise (std LATENT_NOISE on the latent, SALIENCE_NOISE on the salience dimensions, 0.05 on the
features). The latent dimensions::

  [0, 16)   class one-hot (confusable pairs dog/cat, car/bus, ...: the partner class leaks in at 0.3)
  [16, 22)  colour one-hot
  [22, 26)  box (cx, cy, w, h) in [0, 1] (no word says it)
  [26, 30)  scene one-hot (1.0 on background regions, 0.3 on objects): the "in a park" words
  30        object flag (1 on objects, 0 on background)
  [31, 33)  salience 1 and 2: on objects, the named object's value the largest (SALIENCE, COMPETE, OTHERS)
  [33, 39)  nuisance: N(0, 1) on background regions, 0 on objects

Controls, with the ground truth itself as the attention (one-hot on a class word's region, uniform elsewhere): a
perfectly grounded attention scores 1.0; the best word-agnostic attention, one region per caption, scores at most
0.5 (a caption's two class words lie in two different regions); uniform chance is 1 / regions, about 0.18;
"always the first-mentioned object" scores 0.5. Learned: benchmarks/RESULTS.md, "Seed noise of the smoke study".

Written files (the layouts real COCO uses, so the same code path reads both)::

  dataset_coco.json          Karpathy format; train2014 images in train/restval, val2014 in val/test/restval
                             (val and test a quarter of the images each, or a larger test split of
                             `test_split_images`: `split_sizes`)
  image_info_test2014.json   test-server images (no captions)
  image_info_val2014.json    every val2014 image id (what the server's val submission must cover)
  features.h5                "{image_id}_features" (n, FEATURE_DIM)
  features/                  {image_id}.npz with key "feat"
  grounding.json             {image_id: {"regions": n, "sentences": [[region index or -1 per token]]}}

Everything is a pure function of (seed, images, test_images, test_split_images). A test split larger than a quarter
of the images is made of the quarter plus images generated after all the others (the test-server ones included), so
every other image is the same as without it: a study that wants verdicts on more held-out images trains and selects
on exactly the same data.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import numpy as np
from ..atomic import building_folder, check_replaceable, clear_dead_building_folders, replace_folder
from ..errors import DataError

CLASSES = ["dog", "cat", "car", "bus", "bird", "plane", "horse", "cow", "sheep", "goat", "boat", "train",
           "cup", "bottle", "chair", "table"]  # neighbours are confusable pairs
COLOURS = ["red", "blue", "green", "yellow", "black", "white"]
SCENES = ["park", "street", "kitchen", "field"]
OBJECTS = (3, 5)  # objects per image, inclusive
# Salience (latent dimensions _SALIENCE + j, j = 0, 1): the j-th named object's value is drawn from SALIENCE, its
# same-colour distractor's from COMPETE times that (close: the hard comparisons), every other object's from
# [0, OTHERS) times that. DISTRACTOR: how often a named object gets a same-colour distractor (if the image has an
# object to spare). The latent noise is LATENT_NOISE, SALIENCE_NOISE on the salience dimensions: the smallest gap
# between a named object and its distractor (0.5 x 0.15 = 0.075) is 5.3 standard deviations of their difference, so
# the salience order is readable from the features (no floor that a perfectly grounded model would share).
SALIENCE = (0.5, 1.0)
COMPETE = (0.4, 0.85)
OTHERS = 0.5
DISTRACTOR = 1.0
LATENT_NOISE = 0.1
SALIENCE_NOISE = 0.01
BACKGROUND = (1, 2)  # background regions per image, inclusive
FEATURE_DIM = 2048
_CLASS, _COLOUR, _BOX, _SCENE = 0, len(CLASSES), len(CLASSES) + len(COLOURS), len(CLASSES) + len(COLOURS) + 4
_FLAG = _SCENE + len(SCENES)
_SALIENCE = _FLAG + 1
_NUISANCE = _SALIENCE + 2
LATENT = _NUISANCE + 6
# Bumped whenever the same (seed, images, test_images, test_split_images) would give other files. Stored in
# synthetic.json; a set of another version is never reused (`ensure`). 3: a salience order, every caption names the
# two most salient objects. 4: no spatial relation, varied wording, val and test a fifth of the images each. 5: a
# same-colour distractor of close salience for each named object (the region of a class word needs colour and
# salience), graded salience, val and test a quarter of the images each.
FORMAT_VERSION = 5
# The wording of a caption, each choice made per caption with these weights (the first is the most common form, the
# same on every image): what COCO's five annotators do with the same content, and what keeps CIDEr-D off the
# 800-900 a verbatim reference set scores (each image's rare colour-class n-grams weigh far more than COCO's).
TEMPLATES = (("{a} and {b}", 0.5), ("there is {a} and {b}", 0.2), ("{a} next to {b}", 0.2), ("{a} with {b}", 0.1))
ARTICLES = (("a", 0.8), ("the", 0.2))
SCENE_PHRASES = (("in {the} {scene}", 0.6), ("at the {scene}", 0.25), ("", 0.15))


def _pick(rng, choices) -> str:
    return choices[rng.choice(len(choices), p=[w for _, w in choices])][0]


def _caption(rng, a, b, scene) -> tuple[list[str], list[int]]:
    """Tokens and, per token, the region it is grounded in (-1: none). a, b: dicts of the two objects."""
    def obj(o):  # the colour picks the object; the class word is grounded in its region
        return [(_pick(rng, ARTICLES), -1), (COLOURS[o["colour"]], -1), (CLASSES[o["cls"]], o["region"])]

    slots = {"{a}": obj(a), "{b}": obj(b)}
    toks = [t for word in _pick(rng, TEMPLATES).split() for t in slots.get(word, [(word, -1)])]
    place = SCENES[scene]
    toks += [(w, -1) for w in _pick(rng, SCENE_PHRASES).format(the="the" if place == "kitchen" else "a",
                                                                  scene=place).split()]
    return [t for t, _ in toks], [r for _, r in toks]


def _image(rng, embed) -> tuple[np.ndarray, list[list[str]], list[list[int]]]:
    """One image: (n, FEATURE_DIM) float16 features, 5 captions and their grounding."""
    n_obj = int(rng.integers(OBJECTS[0], OBJECTS[1] + 1))
    n_bg = int(rng.integers(BACKGROUND[0], BACKGROUND[1] + 1))
    scene = int(rng.integers(len(SCENES)))
    classes = rng.choice(len(CLASSES), n_obj, replace=False)
    # objects[0] and objects[1] are what every caption names, in that order (the largest salience 1 and 2), in two
    # different colours. Each other object may take the colour of one named object (its same-colour distractor:
    # the first other object that of objects[0], the second that of objects[1]), else a colour no named one has.
    named = rng.choice(len(COLOURS), 2, replace=False)
    free = [k for k in range(len(COLOURS)) if k not in named]
    colours = [int(named[0]), int(named[1])]
    for j in range(n_obj - 2):
        colours.append(int(named[j]) if j < 2 and rng.random() < DISTRACTOR else int(rng.choice(free)))
    objects = [{"cls": int(c), "colour": k, "box": rng.uniform(0.1, 0.9, 2).tolist()
                + rng.uniform(0.05, 0.4, 2).tolist()} for c, k in zip(classes, colours)]
    latents = np.zeros((n_obj + n_bg, LATENT), np.float32)
    for z, o in zip(latents, objects):
        z[_CLASS + o["cls"]] = 1.0
        z[_CLASS + (o["cls"] ^ 1)] = 0.3  # the confusable partner class leaks in
        z[_COLOUR + o["colour"]] = 1.0
        z[_BOX:_BOX + 4] = o["box"]
        z[_SCENE + scene] = 0.3
        z[_FLAG] = 1.0
    for j in range(2):  # salience j: the j-th named object has the largest value, its distractor a close one
        top = rng.uniform(*SALIENCE)
        values = rng.uniform(0, OTHERS, n_obj) * top
        if n_obj > 2 + j and colours[2 + j] == colours[j]:
            values[2 + j] = rng.uniform(*COMPETE) * top
        values[j] = top
        latents[:n_obj, _SALIENCE + j] = values
    for z in latents[n_obj:]:
        z[_SCENE + scene] = 1.0
        z[_NUISANCE:] = rng.normal(0, 1.0, LATENT - _NUISANCE)
    order = rng.permutation(len(latents))  # regions come in no particular order
    latents = latents[order]
    region_of = {int(old): new for new, old in enumerate(order)}
    for i, o in enumerate(objects):
        o["region"] = region_of[i]
    noise = rng.normal(0, LATENT_NOISE, latents.shape).astype(np.float32)
    noise[:, _SALIENCE:_SALIENCE + 2] *= SALIENCE_NOISE / LATENT_NOISE
    latents = latents + noise
    feats = latents @ embed + rng.normal(0, 0.05, (len(latents), FEATURE_DIM)).astype(np.float32)
    feats = np.maximum(feats, 0.0)  # ReLU-like, non-negative as bottom-up features are
    caps, grounds = [], []
    for _ in range(5):  # the references agree on what to say; only the wording varies
        toks, ground = _caption(rng, objects[0], objects[1], scene)
        caps.append(toks)
        grounds.append(ground)
    return feats.astype(np.float16), caps, grounds


def split_sizes(images: int, test_split_images: int | None = None) -> dict[str, int]:
    """Images per Karpathy split of the dataset `generate` writes with `images` images (restval in train) and a
    test split of `test_split_images` (None: as many as val)."""
    val = max(5, images // 4)
    return {"train": images - 2 * val, "val": val, "test": val if test_split_images is None else test_split_images}


def check_test_split(images: int, test_split_images: int | None) -> None:
    """A DataError unless `test_split_images` is None or at least the quarter of `images` the split always has."""
    quarter = split_sizes(images)["test"]
    if test_split_images is not None and test_split_images < quarter:
        raise DataError(f"test_split_images must be at least {quarter} (the quarter of {images} images the test "
                        f"split always has), got {test_split_images}; train.test_images scores fewer of them")


def generate(out: str | Path, seed: int = 0, images: int = 1500, test_images: int | None = None,
             test_split_images: int | None = None) -> dict[str, Path]:
    """Write the dataset into `out` (created; replaced atomically if it exists) and return the file paths.

    images: the Karpathy-split images; test_images: test-server images (default a tenth of `images`);
    test_split_images: the Karpathy test split's size (default a quarter of `images`, as val)."""
    out = Path(out).resolve()
    check_replaceable(out, ("synthetic.json",), "synthetic data set")  # replaced whole below
    if images < 20:
        raise DataError(f"images must be >= 20, got {images}")
    check_test_split(images, test_split_images)
    test_images = max(10, images // 10) if test_images is None else test_images
    rng = np.random.default_rng(seed)
    embed = rng.normal(0, 1.0 / np.sqrt(LATENT), (LATENT, FEATURE_DIM)).astype(np.float32) * 4.0
    embed += rng.normal(0, 0.02, embed.shape).astype(np.float32)

    sizes = split_sizes(images)
    n_train, n_val = sizes["train"], sizes["val"]
    extra_test = 0 if test_split_images is None else test_split_images - sizes["test"]
    n_restval = n_train // 5  # restval images live in val2014 but train with train (as in Karpathy's split)
    # a set a killed run of this host moved aside where the swap takes two renames (the `.synth` ones, swapped out
    # or half-made, `building_folder` clears)
    clear_dead_building_folders(out, ".old")
    work = building_folder(out, ".synth")
    try:
        (work / "features").mkdir()
        import h5py  # h5py: only when data is written (a2core.config, so `a2 study validate`, imports this module)

        entries, grounding, val2014, test2014 = [], {}, [], []
        with h5py.File(work / "features.h5", "w") as h5:
            def put(image_id: int, feats: np.ndarray) -> None:
                h5.create_dataset(f"{image_id}_features", data=feats)
                np.savez(work / "features" / f"{image_id}.npz", feat=feats)

            def karpathy(i: int, split: str, folder: str) -> None:
                image_id = 100000 + i
                feats, caps, grounds = _image(rng, embed)
                put(image_id, feats)
                entries.append({"cocoid": image_id, "imgid": i, "split": split, "filepath": folder,
                                "filename": f"COCO_{folder}_{image_id:012d}.jpg",
                                "sentences": [{"tokens": c, "raw": " ".join(c).capitalize() + ".", "imgid": i,
                                               "sentid": 5 * i + j} for j, c in enumerate(caps)]})
                grounding[str(image_id)] = {"regions": int(feats.shape[0]), "sentences": grounds}
                if folder == "val2014":
                    val2014.append(image_id)

            for i in range(images):
                if i < n_train - n_restval:
                    karpathy(i, "train", "train2014")
                elif i < n_train:
                    karpathy(i, "restval", "val2014")
                else:
                    karpathy(i, "val" if i < n_train + n_val else "test", "val2014")
            for i in range(test_images):
                image_id = 900000 + i
                feats, _, _ = _image(rng, embed)
                put(image_id, feats)
                test2014.append(image_id)
            for i in range(images, images + extra_test):  # drawn last: every image above is as without them
                karpathy(i, "test", "val2014")

        def info(ids, folder):
            return {"info": {"description": f"a2tune synthetic COCO ({folder}), seed {seed}"},
                    "images": [{"id": i, "file_name": f"COCO_{folder}_{i:012d}.jpg", "width": 640, "height": 480}
                               for i in ids]}

        (work / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": entries}))
        (work / "image_info_test2014.json").write_text(json.dumps(info(test2014, "test2014")))
        (work / "image_info_val2014.json").write_text(json.dumps(info(val2014, "val2014")))
        (work / "grounding.json").write_text(json.dumps(grounding))
        meta = {"format": FORMAT_VERSION, "seed": seed, "images": images, "test_images": test_images,
                **({} if test_split_images is None else {"test_split_images": test_split_images}),
                "classes": CLASSES, "colours": COLOURS, "scenes": SCENES}
        (work / "synthetic.json").write_text(json.dumps(meta, indent=1))
        os.chmod(work, 0o755)  # mkdtemp's 0700 would keep the set from the other accounts of a shared machine
        replace_folder(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return paths(out)


def paths(root: str | Path) -> dict[str, Path]:
    root = Path(root)
    return {"root": root, "captions": root / "dataset_coco.json", "features": root / "features.h5",
            "features_dir": root / "features", "test_images": root / "image_info_test2014.json",
            "val_images": root / "image_info_val2014.json", "grounding": root / "grounding.json"}


def default_root(seed: int, images: int, test_split_images: int | None = None) -> Path:
    base = Path(os.environ.get("A2_DATA_CACHE", Path.home() / ".cache" / "a2tune"))
    test = "" if test_split_images is None else f"-test{test_split_images}"
    return base / f"synthetic-v{FORMAT_VERSION}-seed{seed}-n{images}{test}"


def ensure(root: str | Path | None, seed: int, images: int, test_split_images: int | None = None) -> dict[str, Path]:
    """The dataset at `root` (default: a per-user cache), generated first if it is not complete there.

    Several processes may call this at once (data-parallel workers): generation goes to a temp dir and is
    renamed into place, and a lock file keeps the others waiting instead of generating it again.
    """
    root = Path(root) if root else default_root(seed, images, test_split_images)
    meta = root / "synthetic.json"

    def complete() -> bool:
        if not meta.is_file():
            return False
        try:
            m = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return (m.get("format") == FORMAT_VERSION and m.get("seed") == seed and m.get("images") == images
                and m.get("test_split_images") == test_split_images)

    if complete():
        return paths(root)

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not complete():
            if meta.is_file():
                raise DataError(_mismatch(root, meta, seed, images, test_split_images))
            generate(root, seed=seed, images=images, test_split_images=test_split_images)
    return paths(root)


def _mismatch(root: Path, meta: Path, seed: int, images: int, test_split_images: int | None = None) -> str:
    """Why the set at `root` is not the one asked for; an older format version is never reused (its captions and
    features differ), and regenerating over a folder the user named could destroy their files, so refuse."""
    try:
        m = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError):
        m = {}
    if m.get("format") != FORMAT_VERSION:
        return (f"{root}: holds a synthetic dataset of format version {m.get('format')}, but this code generates "
                f"version {FORMAT_VERSION} (other captions and features); remove it to regenerate it, or choose "
                f"another data.root")

    def test_split(n):
        return "" if n is None else f" (a test split of {n})"

    return (f"{root}: holds a synthetic dataset of seed {m.get('seed')} and {m.get('images')} images"
            f"{test_split(m.get('test_split_images'))}, not seed {seed} and {images}{test_split(test_split_images)}; "
            f"choose another data.root or remove it")

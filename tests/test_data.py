"""Data: Karpathy reader, vocabulary rules, both feature layouts with their errors, synthetic COCO."""
import hashlib
import json

import h5py
import numpy as np
import pytest

from a2core.config import Config
from a2core.data import synthetic
from a2core.data.captions import Vocab, read_image_info, read_karpathy
from a2core.data.dataset import CaptionData
from a2core.data.features import FeatureError, FeatureStore


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_synthetic_is_deterministic_and_in_coco_formats(tmp_path):
    a = synthetic.generate(tmp_path / "a", seed=3, images=40, test_images=10)
    b = synthetic.generate(tmp_path / "b", seed=3, images=40, test_images=10)
    c = synthetic.generate(tmp_path / "c", seed=4, images=40, test_images=10)
    for key in ("captions", "test_images", "grounding"):
        assert _digest(a[key]) == _digest(b[key])
    assert _digest(a["captions"]) != _digest(c["captions"])
    splits = read_karpathy(a["captions"])
    assert {k: len(v) for k, v in splits.items()} == {"train": 30, "val": 5, "test": 5}
    doc = json.loads(a["captions"].read_text())
    assert {img["split"] for img in doc["images"]} == {"train", "restval", "val", "test"}
    assert all(len(img["sentences"]) == 5 for img in doc["images"])
    test_ids = read_image_info(a["test_images"])
    assert len(test_ids) == 10
    # Both feature layouts hold the same arrays.
    h5, npz = FeatureStore(a["features"]), FeatureStore(a["features_dir"])
    for image_id in [splits["train"][0].image_id, test_ids[0]]:
        assert np.array_equal(h5.get(image_id), npz.get(image_id))
        assert h5.get(image_id).shape[1] == 2048
    # Grounding: every grounded word points at a real region, and the object words are grounded.
    grounding = json.loads(a["grounding"].read_text())
    img = splits["val"][0]
    g = grounding[str(img.image_id)]
    for tokens, regions in zip(img.captions, g["sentences"]):
        assert len(tokens) == len(regions)
        assert all(-1 <= r < g["regions"] for r in regions)
        for tok, r in zip(tokens, regions):
            if tok in synthetic.CLASSES or tok in synthetic.COLOURS:
                assert r >= 0
            if tok in ("a", "the", "in", "of", "above", "below"):
                assert r == -1


def test_synthetic_grounded_regions_carry_their_word(tmp_path):
    """The region a class word is grounded in is the one whose features match that class best."""
    paths = synthetic.generate(tmp_path / "d", seed=0, images=200, test_images=10)
    splits = read_karpathy(paths["captions"])
    grounding = json.loads(paths["grounding"].read_text())
    store = FeatureStore(paths["features"])
    # Mean feature of regions grounded by each class word, then nearest-centroid accuracy on other images.
    by_class: dict[str, list] = {}
    samples = []
    for img in splits["train"]:
        feats = store.get(img.image_id).astype(np.float32)
        for tok, r in zip(img.captions[0], grounding[str(img.image_id)]["sentences"][0]):
            if tok in synthetic.CLASSES:
                samples.append((tok, feats[r]))
    train, held = samples[: len(samples) // 2], samples[len(samples) // 2:]
    for tok, f in train:
        by_class.setdefault(tok, []).append(f)
    names = sorted(by_class)
    cents = np.stack([np.mean(by_class[n], 0) for n in names])
    hits = sum(names[int(np.argmin(((cents - f) ** 2).sum(1)))] == tok for tok, f in held)
    assert hits / len(held) > 0.5  # learnable ...
    assert hits / len(held) < 0.999  # ... but noisy


def test_vocabulary_rules(tmp_path):
    caps = [["A", "dog"]] * 5 + [["a", "cat"]] * 4
    vocab = Vocab.build([[w.lower() for w in c] for c in caps], min_count=5)
    assert vocab.words[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert "a" in vocab.index and "dog" in vocab.index and "cat" not in vocab.index
    assert vocab.encode(["a", "cat"], 20) == [vocab.bos, vocab.index["a"], vocab.unk, vocab.eos]
    assert vocab.decode([vocab.index["a"], vocab.index["dog"], vocab.eos, vocab.index["a"]]) == "a dog"


def test_karpathy_restval_is_train_and_errors_name_the_image(tmp_path):
    doc = {"images": [
        {"cocoid": 1, "split": "restval", "filepath": "val2014", "sentences": [{"tokens": ["A", "b"], "raw": "A b."}]},
        {"cocoid": 2, "split": "test", "filepath": "val2014", "sentences": [{"tokens": ["x"]}]},
    ]}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    splits = read_karpathy(path)
    assert [i.image_id for i in splits["train"]] == [1] and splits["train"][0].captions == [["a", "b"]]
    doc["images"].append({"cocoid": 1, "split": "train", "sentences": [{"tokens": ["y"]}]})
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"d\.json.*image id 1 appears twice"):
        read_karpathy(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"d\.json: not valid JSON"):
        read_karpathy(path)


def test_feature_errors_name_file_and_image_id(tmp_path):
    h5path = tmp_path / "f.h5"
    with h5py.File(h5path, "w") as f:
        f["7_features"] = np.ones((3, 2048), np.float32)
        f["8_features"] = np.ones((3, 100), np.float32)
    store = FeatureStore(h5path)
    feats, mask = store.padded(7, 5)
    assert feats.shape == (5, 2048) and mask.tolist() == [True, True, True, False, False]
    assert store.padded(7, 2)[1].tolist() == [True, True]  # cut to max_regions
    with pytest.raises(FeatureError, match=r"f\.h5.*image id 9"):
        store.get(9)
    with pytest.raises(FeatureError, match=r"f\.h5.*image id 8.*shape \(3, 100\)"):
        store.get(8)
    with pytest.raises(FeatureError, match=r"2 image id\(s\): 9, 10"):
        store.check_ids([7, 9, 10])
    d = tmp_path / "npz"
    d.mkdir()
    np.savez(d / "5.npz", feat=np.ones((2, 2048), np.float32))
    np.savez(d / "6.npz", other=np.ones((2, 2048), np.float32))
    (d / "11.npz").write_bytes((d / "5.npz").read_bytes()[:100])  # truncated
    store = FeatureStore(d)
    assert store.get(5).shape == (2, 2048)
    with pytest.raises(FeatureError, match=r"6\.npz.*image id 6.*no array 'feat'"):
        store.get(6)
    with pytest.raises(FeatureError, match=r"11\.npz.*image id 11.*unreadable or truncated"):
        store.get(11)
    (tmp_path / "bad.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(FeatureError, match=r"bad\.h5: cannot open as HDF5"):
        FeatureStore(tmp_path / "bad.h5").get(1)


def test_batches_hold_five_captions_and_shard_across_ranks(tmp_path):
    paths = synthetic.generate(tmp_path / "s", seed=1, images=40, test_images=10)
    cfg = Config.from_dict({"data": {"root": str(paths["root"]), "images": 40, "seed": 1}})
    data = CaptionData(cfg.data, max_regions=12, vocab=None)
    batch = next(iter(data.loader("train", 4)))
    assert batch["feats"].shape == (4, 12, 2048) and batch["captions"].shape[:2] == (4, 5)
    assert (batch["captions"][:, :, 0] == data.vocab.bos).all()
    shards = [[int(i) for b in data.loader("train", 5, shuffle=True, rank=r, world=3) for i in b["image_ids"]]
              for r in range(3)]
    assert len({len(s) for s in shards}) == 1  # equal steps per rank
    assert set().union(*shards) == {img.image_id for img in data.images("train")}
    assert len(data.images("test2014")) == 10
    assert {i.image_id for i in data.images("val2014")} >= {i.image_id for i in data.images("test")}

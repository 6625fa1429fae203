"""Audit of the data path on the real COCO formats: M2's features file, test-split features, empty and non-ASCII
captions. Each test failed before its fix."""
import json

import h5py
import numpy as np
import pytest

from a2core.config import Config
from a2core.data.captions import read_karpathy, tokenize
from a2core.data.dataset import CaptionData
from a2core.data.features import FeatureStore, prepare, source_ids
from a2core.errors import DataError

pytestmark = pytest.mark.outside_ray_group

DIM = 8


def _feat(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).random((n, DIM)).astype(np.float32)


def test_m2_features_file_with_boxes_and_class_probabilities_prepares(tmp_path):
    # M2's coco_detections.hdf5 holds {id}_features, {id}_boxes and {id}_cls_prob per image; old: `a2 data prepare`
    # refused it at the first "{id}_boxes" ("is not named {image_id}_features")
    src = tmp_path / "coco_detections.hdf5"
    with h5py.File(src, "w") as f:
        for i in (9, 42):
            f[f"{i}_features"] = _feat(i)
            f[f"{i}_boxes"] = np.ones((3, 4), np.float32)
            f[f"{i}_cls_prob"] = np.full((3, 5), 0.2, np.float32)
    assert source_ids(src) == [9, 42]
    manifest = prepare(src, tmp_path / "f.a2feat", feature_dim=DIM)
    assert manifest["images"] == 2 and manifest["rows"] == 6
    store = FeatureStore(tmp_path / "f.a2feat", DIM)
    assert np.allclose(store.get(42), _feat(42), atol=1e-3)
    with h5py.File(src, "a") as f:  # a _features name that is no image id is still refused
        f["cat_features"] = _feat(1)
    with pytest.raises(DataError, match=r"dataset 'cat_features' is not named"):
        source_ids(src)


def test_features_of_a_scored_split_are_checked_before_training(tmp_path):
    # train.test_at_end runs check((), scored=("test",)); old: only the test references were checked, so a test
    # image without features failed the run after its last epoch instead of before the first
    feats = tmp_path / "feats"
    feats.mkdir()
    images = []
    for image_id, split in [(1, "train"), (2, "restval"), (3, "val"), (4, "test")]:
        images.append({"cocoid": image_id, "split": split, "filepath": "val2014",
                       "sentences": [{"tokens": ["a", "dog"], "raw": "A dog."}]})
        if image_id != 4:
            np.savez(feats / f"{image_id}.npz", feat=_feat(image_id))
    captions = tmp_path / "dataset_coco.json"
    captions.write_text(json.dumps({"images": images, "dataset": "coco"}))
    cfg = Config.from_dict({"data": {"kind": "coco", "captions": str(captions), "features": str(feats)}})
    data = CaptionData(cfg.data, max_regions=5, feature_dim=DIM)
    assert [i.image_id for i in data.images("train")] == [1, 2]  # restval trains
    data.check(("train", "val"))
    with pytest.raises(DataError) as err:
        data.check((), scored=("test",))
    assert str(err.value) == f"{feats}: no region features for 1 image id(s): 4"


@pytest.mark.parametrize("sentence", [{"tokens": [], "raw": ""}, {"raw": "..."}, {"tokens": []}])
def test_an_empty_caption_is_named_with_its_image_id(tmp_path, sentence):
    # old: read as a caption of no words: trained as <bos> <eos> and scored as an empty reference
    doc = {"images": [{"cocoid": 7, "split": "train", "filepath": "train2014",
                       "sentences": [{"tokens": ["a", "cat"], "raw": "A cat."}, sentence]}]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as err:
        read_karpathy(path)
    assert str(err.value) == f"{path}: image id 7: sentences[1] is an empty caption (no words in its tokens or raw)"


def test_non_ascii_raw_captions_keep_their_words(tmp_path):
    # old: the ASCII-only pattern cut "café" to "caf" and dropped a caption in another script entirely
    assert tokenize("Un café près de la rivière.") == ["un", "café", "près", "de", "la", "rivière"]
    assert tokenize("一只猫") == ["一只猫"]
    assert tokenize("A man's dog, 2 cats_x!") == ["a", "man's", "dog", "2", "cats", "x"]  # ASCII as before
    doc = {"images": [{"cocoid": 5, "split": "val", "filepath": "val2014",
                       "sentences": [{"raw": "Ein Hund im Café"}, {"raw": "Ü-Bahn"}]}]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(doc))
    img = read_karpathy(path)["val"][0]
    assert img.captions == [["ein", "hund", "im", "café"], ["ü", "bahn"]]

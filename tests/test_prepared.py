"""The prepared feature layout (`a2 data prepare`): same images and values as its source (within float16's
rounding), the same model outputs and loss through the same loader, and errors that name the file and image id."""
import json

import h5py
import numpy as np
import pytest
import torch

from a2core.config import Config
from a2core.data import features, prepared, synthetic
from a2core.data.dataset import CaptionData
from a2core.data.features import FeatureStore
from a2core.errors import ConfigError, DataError
from a2core.model.a2 import A2Transformer
from launch.cli import main


@pytest.fixture(scope="module")
def float32_set(tmp_path_factory):
    """A small synthetic COCO set (40 Karpathy + 10 test-server images) whose features are float32 values that float16 cannot hold exactly (bottom-up
    features are non-negative, mostly below 10), in both source layouts."""
    root = tmp_path_factory.mktemp("prep")
    paths = synthetic.generate(root / "s", seed=3, images=40, test_images=10)
    rng = np.random.default_rng(0)
    with h5py.File(paths["features"], "r") as src, h5py.File(root / "f32.h5", "w") as dst:
        (root / "npz").mkdir()
        for key in src:
            feat = src[key][()].astype(np.float32)
            feat = np.abs(feat + rng.normal(0, 0.3, feat.shape).astype(np.float32)) * 3
            dst[key] = feat
            np.savez(root / "npz" / f"{key[:-len('_features')]}.npz", feat=feat)
    return {"root": root, "captions": paths["captions"], "h5": root / "f32.h5", "npz": root / "npz"}


def _coco(data, features):
    return Config.from_dict({"data": {"kind": "coco", "captions": str(data["captions"]), "features": str(features)},
                             "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 12,
                                       "dropout": 0.0}})


def test_prepare_from_either_layout_gives_the_same_store_within_float16_rounding(float32_set, tmp_path):
    a = features.prepare(float32_set["h5"], tmp_path / "a.a2feat")
    b = features.prepare(float32_set["npz"], tmp_path / "b.a2feat")
    assert a["checksum"] == b["checksum"] and a["images"] == 50  # same bytes from either source layout
    assert a["files"] == json.loads((tmp_path / "a.a2feat" / "manifest.json").read_text())["files"]
    assert prepared.check_copy(tmp_path / "a.a2feat", full=True, expected=a["checksum"]) == a
    source, store = FeatureStore(float32_set["h5"]), FeatureStore(tmp_path / "a.a2feat")
    assert store.prepared is not None
    for image_id in (100000, 100017, 100039):
        exact, half = source.get(image_id), store.get(image_id)
        assert half.dtype == np.float32 and half.shape == exact.shape
        np.testing.assert_allclose(half, exact, rtol=2 ** -11, atol=2 ** -25)  # float16: 11 bits; subnormals
        f, m = store.padded(image_id, 12)
        np.testing.assert_array_equal(m, source.padded(image_id, 12)[1])
    with pytest.raises(DataError, match=r"2 image id\(s\): 7, 8"):
        store.check_ids([100000, 7, 8])
    with pytest.raises(DataError, match=r"a\.a2feat: no region features for image id 7"):
        store.get(7)


def test_float16_store_gives_the_same_model_outputs_and_loss(float32_set, tmp_path):
    features.prepare(float32_set["h5"], tmp_path / "c.a2feat")
    batches = {}
    for layout, source in (("hdf5", float32_set["h5"]), ("prepared", tmp_path / "c.a2feat")):
        cfg = _coco(float32_set, source)
        data = CaptionData(cfg.data, cfg.model.max_regions)
        data.check(("train", "val"))
        batches[layout] = next(iter(data.loader("train", 8, shuffle=True, seed=1, num_workers=1)))
    h, p = batches["hdf5"], batches["prepared"]
    assert p["feats"].dtype == torch.float16 and h["feats"].dtype == torch.float32  # the model widens float16
    assert torch.equal(h["image_ids"], p["image_ids"]) and torch.equal(h["captions"], p["captions"])
    assert torch.equal(h["region_mask"], p["region_mask"])
    torch.manual_seed(0)
    model = A2Transformer(cfg.model, vocab_size=len(data.vocab)).eval()
    tokens = h["captions"].reshape(-1, h["captions"].shape[-1])
    with torch.no_grad():
        outs = [model(b["feats"], b["region_mask"], tokens[:, :-1])[0] for b in (h, p)]
    losses = [torch.nn.functional.cross_entropy(o.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=0)
              for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)
    assert abs(losses[1].item() - losses[0].item()) < 1e-4 * losses[0].item()


@pytest.mark.parametrize("workers", [0, 1])
def test_whole_batch_gather_equals_the_per_image_path(float32_set, tmp_path, workers):
    """The loader builds a prepared store's batch with one gather from the memory map (in the iterating process);
    every tensor equals the per-image path's: each image's rows padded by `features.pad`, captions encoded one by
    one. max_regions 6 cuts some images (up to 10 regions), so the cut is covered too. Two epochs: the second's
    captions come from the encoded-caption cache."""
    from a2core.data.features import pad

    features.prepare(float32_set["h5"], tmp_path / "w.a2feat")
    cfg = _coco(float32_set, tmp_path / "w.a2feat")
    data = CaptionData(cfg.data, 6)
    batches = [b for epoch in (0, 1) for b in data.loader("train", 7, shuffle=True, seed=2, epoch=epoch,
                                                          num_workers=workers)]
    assert sum(len(b["image_ids"]) for b in batches) == 2 * len(data.images("train")) and len(batches) > 4
    by_id = {img.image_id: img for img in data.images("train")}
    padded = 0
    for batch in batches:
        ids = batch["image_ids"].tolist()
        feats, mask = pad([data.features.rows(i, 6) for i in ids], 6, 2048)
        assert feats.dtype == batch["feats"].dtype == torch.float16 and batch["feats"].shape == (len(ids), 6, 2048)
        assert torch.equal(batch["feats"], feats) and torch.equal(batch["region_mask"], mask)
        padded += int((~mask).sum())
        encoded = [[data.vocab.encode(c, cfg.data.max_caption_len) for c in by_id[i].captions[:5]] for i in ids]
        length = max(len(c) for caps in encoded for c in caps)
        assert batch["captions"].dtype == torch.long and batch["captions"].shape == (len(ids), 5, length)
        for b, caps in enumerate(encoded):
            for j, c in enumerate(caps):
                assert batch["captions"][b, j, :len(c)].tolist() == c and not batch["captions"][b, j, len(c):].any()
    assert padded > 0  # some images have fewer than 6 regions
    with pytest.raises(DataError, match=r"w\.a2feat: no region features for image id 7"):
        data.features.prepared.locate([100000, 7], 6)


def test_batches_reuse_freed_memory_instead_of_fresh_pages(float32_set, tmp_path):
    """With the loader's malloc settings (`keep_batch_memory`, glibc), gathering a batch while the one before is
    still held (as a training loop does) takes its buffer from freed heap: no kernel page faults per batch. Before,
    each 20 MB batch was a fresh mapping zero-filled page by page (about 5,000 faults, most of its time)."""
    import resource

    from a2core.data.dataset import keep_batch_memory

    if not keep_batch_memory():
        pytest.skip("not glibc: no mallopt")
    features.prepare(float32_set["h5"], tmp_path / "m.a2feat")
    store = prepared.PreparedFeatures(tmp_path / "m.a2feat")
    where = store.locate(store.ids[:40], 100)  # (40, 100, 2048) float16: 16 MB, 4,000 pages
    held = [store.gather(where, 100)]
    for _ in range(6):  # the store's pages mapped, the heap grown to the batches alive at once
        held = [held[-1], store.gather(where, 100)]
    faults = []  # per batch
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [held[-1], store.gather(where, 100)]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # Per batch, not summed: once in a while the kernel reclaims the store's mapped pages or the heap's (another
    # process wanting memory) and one batch faults them back, 4,000 at once. That is not a fresh page per batch.
    fresh = [f for f in faults if f > 400]  # a tenth of a batch's pages
    assert len(fresh) <= 2, f"page faults per batch of 4,000 pages: {faults}"


def test_bad_input_names_the_file_and_image_id_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f["3_features"] = np.ones((2, 8), np.float32)
        f["4_features"] = np.full((2, 8), np.nan, np.float32)
    with pytest.raises(DataError, match=r"bad\.h5: image id 4: features contain NaN"):
        features.prepare(bad, tmp_path / "out", feature_dim=8)
    with h5py.File(bad, "w") as f:
        f["5_features"] = np.full((2, 8), 1e6, np.float32)
    with pytest.raises(DataError, match=r"bad\.h5: image id 5: feature values beyond float16's range"):
        features.prepare(bad, tmp_path / "out", feature_dim=8)
    with h5py.File(bad, "w") as f:
        f["cat_features"] = np.ones((2, 8), np.float32)
    with pytest.raises(DataError, match=r"bad\.h5: dataset 'cat_features' is not named"):
        features.prepare(bad, tmp_path / "out", feature_dim=8)
    (tmp_path / "npz").mkdir()
    np.savez(tmp_path / "npz" / "9.npz", feat=np.ones((2, 4), np.float32))
    with pytest.raises(DataError, match=r"9\.npz: image id 9: features have shape \(2, 4\)"):
        features.prepare(tmp_path / "npz", tmp_path / "out", feature_dim=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.h5", "npz"]  # no output, no temp folder
    with h5py.File(bad, "w") as f:
        f["3_features"] = np.ones((2, 8), np.float32)
    features.prepare(bad, tmp_path / "out", feature_dim=8)
    with pytest.raises(DataError, match=r"out: exists already"):
        features.prepare(bad, tmp_path / "out", feature_dim=8)


def test_a_damaged_copy_is_refused_naming_the_file(float32_set, tmp_path):
    store = tmp_path / "d.a2feat"
    manifest = features.prepare(float32_set["h5"], store)
    rows = store / prepared.ROWS
    data = bytearray(rows.read_bytes())
    data[1000] ^= 0xFF
    rows.write_bytes(bytes(data))  # same size: only the full check sees it
    prepared.check_copy(store)
    with pytest.raises(DataError, match=r"d\.a2feat/rows\.f16: SHA-256 differs"):
        prepared.check_copy(store, full=True)
    rows.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"d\.a2feat/rows\.f16: \d+ bytes, the manifest says"):
        FeatureStore(store)
    with pytest.raises(DataError, match=r"differs from the expected"):
        prepared.check_copy(store, expected="0" * 64)
    rows.write_bytes(bytes(data))
    (store / prepared.INDEX).unlink()
    with pytest.raises(DataError, match=r"d\.a2feat/index\.npy: missing"):
        prepared.check_copy(store, expected=manifest["checksum"])


def test_cli_prepare(float32_set, tmp_path, capsys):
    assert main(["data", "prepare", str(float32_set["npz"]), "--out", str(tmp_path / "e.a2feat")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["images"] == 50 and out["checksum"] == prepared.read_manifest(tmp_path / "e.a2feat")["checksum"]
    assert main(["data", "prepare", str(tmp_path / "none.h5"), "--out", str(tmp_path / "f")]) == 2
    assert "none.h5: region features not found" in capsys.readouterr().err


def test_a_study_on_an_incomplete_store_is_refused_before_ray(float32_set, tmp_path):
    from launch.spec import StudySpec

    store = tmp_path / "g.a2feat"
    features.prepare(float32_set["h5"], store)
    raw = {"name": "s", "data": {"kind": "coco", "captions": str(float32_set["captions"]), "features": str(store)},
           "search": {"metric": "val/CIDEr", "mode": "max", "algorithm": "grid", "space": {}},
           "storage": str(tmp_path / "studies")}
    StudySpec.from_dict(raw)
    (store / prepared.ROWS).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.features: .*g\.a2feat/rows\.f16: 0 bytes"):
        StudySpec.from_dict(raw)

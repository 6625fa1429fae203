"""The paper's training recipe as M2's train.py runs it (issue 37): `train.batch_layout: pairs` draws each
cross-entropy step's batch_size (image, caption) pairs at random over all pairs of the split (M2's
DataLoader(shuffle=True) over pairs), the same pairs at any number of workers; `train.scst_candidates: beam` takes
the beams of a beam search as SCST's candidates with their mean reward as the baseline (M2's train_scst). Configs
without the keys train as before (images layout, sampled candidates)."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import a2core.train as train_mod
from a2core.config import (CAPTIONS_PER_IMAGE, Config, ConfigError, check_batch_split, load_yaml, pairs_per_worker,
                           steps_per_epoch)
from a2core.data import synthetic
from a2core.data.dataset import CaptionData
from a2core.decode import ModelStepper, beam_search
from a2core.train import Trainer
from launch.spec import load_study

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 3
STEPS = 4  # optimizer steps compared between one and two workers


def _raw(root, **train) -> dict:
    # dropout 0: one and two workers draw different dropout masks, nothing else may differ
    return {"data": {"root": str(root), "images": 80, "seed": SEED, "val_images": 8},
            "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 10, "fusion": "gate",
                      "dropout": 0.0},
            "train": {"xe_epochs": 1, "batch_size": 20, "warmup": 4, "lr_factor": 0.5, "log_every": 1000, **train}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "synth"
    synthetic.ensure(str(path), SEED, 80)  # 40 train images, 200 pairs
    return path


def _pairs(batch) -> list[tuple[int, int]]:
    """(image id, caption tokens without the padding) of each pair of a pairs batch, from its tensors."""
    ids = batch["image_ids"][batch["caption_image"]].tolist()
    return list(zip(ids, [tuple(w for w in c if w) for c in batch["captions"].tolist()]))


# -- a pairs batch -------------------------------------------------------------------------------------------------
def test_a_pairs_epoch_draws_batch_size_pairs_a_step_over_every_pair_of_the_split(root):
    data = CaptionData(Config.from_dict(_raw(root)).data, 10)
    train = data.images("train")
    loader = data.pair_loader(20, seed=1, epoch=0)
    batches = list(loader)
    assert len(batches) == steps_per_epoch(len(train), 20, "pairs") == 10  # 40 images x 5 captions / 20
    drawn = [i for step in loader.batch_sampler for i in step]  # pair p: image p // 5, caption p % 5
    assert sorted(drawn) == list(range(len(train) * CAPTIONS_PER_IMAGE))  # each of the 200 pairs once (200 / 20)
    for batch, step in zip(batches, loader.batch_sampler):
        u, p = batch["feats"].shape[0], batch["captions"].shape[0]
        assert p == 20 and batch["caption_image"].shape == (20,) and batch["region_mask"].shape[0] == u
        assert u == len(set(batch["image_ids"].tolist()))  # each distinct image once: one encoder pass
        for (image_id, caption), i in zip(_pairs(batch), step):
            image = train[i // CAPTIONS_PER_IMAGE]
            assert image_id == image.image_id
            assert caption == tuple(data.encoded_captions(image)[i % 5])
    # drawn over the whole split, not 4 images x 5 captions: a step of 20 pairs from 40 images has ~14 distinct
    # images on average; the images layout would have 4
    assert sum(b["feats"].shape[0] for b in batches) / len(batches) > 10


def test_the_pair_order_is_fixed_by_the_seed_and_epoch(root):
    data = CaptionData(Config.from_dict(_raw(root)).data, 10)
    order = lambda **kw: [_pairs(b) for b in data.pair_loader(20, **kw)]  # noqa: E731
    assert order(seed=1, epoch=2) == order(seed=1, epoch=2)
    assert order(seed=1, epoch=2) != order(seed=2, epoch=2) != order(seed=1, epoch=3)


def test_the_pairs_of_each_step_are_the_same_at_any_worker_count(root):
    data = CaptionData(Config.from_dict(_raw(root)).data, 10)
    one = [_pairs(b) for b in data.pair_loader(20, seed=1, epoch=2)]
    halves = [[_pairs(b) for b in data.pair_loader(20, seed=1, epoch=2, rank=r, world=2)] for r in range(2)]
    assert len(halves[0]) == len(halves[1]) == len(one) == 10
    assert [a + b for a, b in zip(*halves)] == one  # rank r: the r-th contiguous half of the global batch


def test_pairs_of_one_image_share_its_encoder_pass_with_the_same_loss_and_gradients(root, monkeypatch):
    """The shared pass (U distinct images encoded once, gathered per pair) gives what encoding every pair's image
    separately gives, and runs the encoder on the U images only."""
    cfg = Config.from_dict(_raw(root, batch_layout="pairs"))
    trainer = Trainer(cfg, str(root.parent / "out-share"))
    batch = next(iter(trainer._batches()))
    feats, mask, caps, index = batch["feats"], batch["region_mask"], batch["captions"], batch["caption_image"]
    assert feats.shape[0] < caps.shape[0]  # some image has two pairs in this batch
    model, updates = trainer.model, trainer.updates
    state = {k: v.clone() for k, v in model.state_dict().items()}
    encoded = []
    real_encode = model.encode
    monkeypatch.setattr(model, "encode", lambda f, m: encoded.append(f.shape[0]) or real_encode(f, m))

    names = {id(p): n for n, p in model.named_parameters()}

    def loss_and_grads(*args):
        model.load_state_dict(state)
        grads = {}

        def backward_only(loss, params, opt, clip=0.0):  # each objective's gradients, no update
            grads.update(zip([names[id(p)] for p in params], torch.autograd.grad(loss, params, allow_unused=True)))

        monkeypatch.setattr(updates, "apply", backward_only)
        out = updates.xe(*args)
        return out["train/loss"], {n: g for n, g in grads.items() if g is not None}

    shared, g_shared = loss_and_grads(feats, mask, caps, 0, index)  # the mask step and the captioner's
    separate, g_separate = loss_and_grads(feats[index], mask[index], caps[:, None], 0)
    assert encoded == [feats.shape[0], caps.shape[0]]
    assert shared == pytest.approx(separate, rel=1e-5)
    assert g_shared.keys() == g_separate.keys() and len(g_shared) > 10
    for name in g_shared:
        assert torch.allclose(g_shared[name], g_separate[name], rtol=1e-4, atol=1e-7), name


def _run(rank: int, world: int, raw: dict, init: str, out: str) -> None:
    """STEPS pairs-layout steps on `world` gloo workers; rank 0 writes each step's pairs (all ranks') and loss."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    trainer = Trainer(Config.from_dict(raw), f"{out}.rank{rank}")
    loader = trainer._batches()
    record = {"steps_per_epoch": len(loader), "pairs": [], "loss": []}
    for _, batch in zip(range(STEPS), loader):
        feats, mask = trainer._batch(batch)
        losses = trainer.updates.xe(feats, mask, batch["captions"], trainer.step, batch["caption_image"])
        trainer._advance()
        record["loss"].append(float(trainer.dist.mean({"loss": losses["train/loss"]})["loss"]))
        parts = [_pairs(batch)]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, _pairs(batch))
        record["pairs"].append([pair for part in parts for pair in part])
    record["weights"] = float(sum(p.double().abs().sum() for p in trainer.model.parameters()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    if world > 1:
        dist.barrier()  # both ranks leave together (tests/test_global_batch.py)
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_and_two_gloo_workers_take_the_same_pairs_and_losses(root, tmp_path):
    """Tolerances measured as tests/test_global_batch.py's (benchmarks/bench_margins.py --cases workers, AMD EPYC,
    2026-11-27, train.seed 0-2 x ATEN_CPU_CAPABILITY default and avx2): largest relative loss difference
    0.0008-0.0049 (bar 0.02), weights 0.0002-0.0008 (bar 0.002)."""
    raw = _raw(root, batch_layout="pairs")
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}.json"
        mp.spawn(_run, args=(world, raw, f"file://{tmp_path / f'init{world}'}", str(out)), nprocs=world, join=True)
        runs[world] = json.loads(out.read_text())
    one, two = runs[1], runs[2]
    assert one["steps_per_epoch"] == two["steps_per_epoch"] == 10
    assert one["pairs"] == two["pairs"] and all(len(p) == 20 for p in one["pairs"])
    # two workers average two 10-pair token means instead of one 20-pair token mean (caption lengths vary by
    # wording), so the losses agree closely but not to the last bit (as tests/test_global_batch.py)
    assert one["loss"] == pytest.approx(two["loss"], rel=2e-2)
    assert one["weights"] == pytest.approx(two["weights"], rel=2e-3)


def test_a_pairs_batch_that_does_not_split_over_the_workers_is_refused_naming_the_key():
    assert pairs_per_worker(50, 2) == 25 and pairs_per_worker(21, 3) == 7
    with pytest.raises(ConfigError, match=r"train.batch_size: 50 image-caption pairs \(batch_layout pairs\) do not "
                                          r"split evenly over 3 workers; use a multiple of 3 pairs, or 1, 2, 5, 10, "
                                          r"25, 50 workers"):
        pairs_per_worker(50, 3)
    check_batch_split(50, 25, "pairs")  # 2 pairs each: no whole images needed without SCST
    with pytest.raises(ConfigError, match=r"train.batch_size: 50 image-caption pairs \(10 images x 5 captions\)"):
        check_batch_split(50, 25, "pairs", scst=True)  # SCST takes batch_size / 5 images


def test_pairs_need_no_whole_images_without_scst():
    assert Config.from_dict({"train": {"batch_layout": "pairs", "batch_size": 24}}).train.batch_size == 24
    assert steps_per_epoch(113_287, 50, "pairs") == steps_per_epoch(113_287, 50) == 11_329  # 566,435 pairs / 50
    assert steps_per_epoch(1000, 24, "pairs") == 209  # 5,000 pairs / 24, the last step filled up
    with pytest.raises(ConfigError, match="train.batch_size: 24 pairs: with SCST"):
        Config.from_dict({"train": {"batch_layout": "pairs", "batch_size": 24, "scst_epochs": 1}})
    with pytest.raises(ConfigError, match="train.batch_size: 24 image-caption pairs is not a whole number"):
        Config.from_dict({"train": {"batch_size": 24}})


def test_keys_that_do_not_apply_are_refused_naming_them():
    with pytest.raises(ConfigError, match="train.scst_baseline: beam candidates take the mean reward"):
        Config.from_dict({"train": {"scst_candidates": "beam", "scst_baseline": "greedy"}})
    with pytest.raises(ConfigError, match="train.mask_captions: batch_layout 'images' only"):
        Config.from_dict({"train": {"batch_layout": "pairs", "mask_captions": 2}})
    with pytest.raises(ConfigError, match="train.batch_layout: unknown batch_layout 'pair'"):
        Config.from_dict({"train": {"batch_layout": "pair"}})
    with pytest.raises(ConfigError, match="train.scst_candidates: unknown scst_candidates 'beams'"):
        Config.from_dict({"train": {"scst_candidates": "beams"}})


# -- beam candidates -------------------------------------------------------------------------------------------------
def test_beam_candidates_are_the_beams_of_a_beam_search_with_their_log_probabilities(root):
    cfg = Config.from_dict(_raw(root, xe_epochs=0, scst_epochs=1, scst_candidates="beam", scst_samples=3,
                                max_len=8))
    trainer = Trainer(cfg, str(root.parent / "out-beam"))
    batch = next(iter(trainer._batches("scst")))
    feats, mask = trainer._batch(batch)
    b = feats.shape[0]
    assert b == 4  # SCST takes whole images, batch_size / 5 of them, in either layout
    trainer.model.train()
    tokens, logps, valid = trainer.beam_candidates(feats, mask)
    trainer.model.eval()  # dropout 0: the same search
    beams, scores = beam_search(ModelStepper(trainer.model), feats, mask, 3, 8, trainer.vocab.bos, trainer.vocab.eos,
                                all_beams=True)
    assert beams.shape[:2] == (b, 3) and torch.equal(tokens, beams.flatten(0, 1))
    best, best_score = beam_search(trainer.model, feats, mask, 3, 8, trainer.vocab.bos, trainer.vocab.eos)
    assert torch.equal(beams[:, 0], best) and torch.equal(scores[:, 0], best_score)  # beam 0: the usual output
    assert (scores[:, :-1] >= scores[:, 1:]).all()  # best first
    # the teacher-forced pass gives each beam the log-probability the search gave it (with a graph)
    assert logps.requires_grad
    total = (logps * valid).sum(1).view(b, 3)
    assert torch.allclose(total.detach(), scores, atol=1e-4)
    ends = valid.sum(1) - 1  # the last counted word is <eos>
    assert (tokens.gather(1, ends[:, None]).squeeze(1) == trainer.vocab.eos).all()


def test_a_beam_scst_step_uses_the_mean_reward_of_the_beams_as_baseline(root, monkeypatch):
    """The advantage is reward minus the mean of the image's k beams, itself included (M2), so it sums to zero per
    image; with equal rewards there is nothing to learn and the loss is 0."""
    cfg = Config.from_dict(_raw(root, xe_epochs=0, scst_epochs=1, scst_candidates="beam", scst_samples=3,
                                max_len=8))
    trainer = Trainer(cfg, str(root.parent / "out-beam-step"))
    seen = {}

    class Reward:
        def scores(self, cands, refs):
            seen["n"] = len(cands)
            return [float(i % 3) for i in range(len(cands))]  # 0, 1, 2 per image: mean 1

    trainer._cider = Reward()
    advantages = []

    def capture(loss, params, opt, clip=0.0):
        advantages.append(loss.item())

    monkeypatch.setattr(trainer.updates, "apply", capture)
    batches = list(trainer._batches("scst"))
    monkeypatch.setattr(trainer, "_batches", lambda stage="xe": batches[:1])
    logps_total = {}
    real_candidates = trainer.beam_candidates

    def candidates(feats, mask):
        tokens, logps, valid = real_candidates(feats, mask)
        logps_total["v"] = (logps * valid).sum(1).detach().view(-1, 3)  # (B, 3)
        return tokens, logps, valid

    monkeypatch.setattr(trainer, "beam_candidates", candidates)
    trainer.scst_epoch()
    assert seen["n"] == 4 * 3  # 4 images x 3 beams
    adv = torch.tensor([-1.0, 0.0, 1.0])  # rewards 0, 1, 2 minus their mean 1
    expected = -(logps_total["v"] * adv).sum() / 12  # the loss: -(advantage x log p) summed, over B*k candidates
    assert advantages[0] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


# -- old configs ----------------------------------------------------------------------------------------------------
def test_configs_without_the_keys_train_as_before(root, monkeypatch):
    """The defaults are today's layout and candidates: the images layout's batches (the same train_loader as before
    these keys) and sampled SCST candidates."""
    cfg = Config.from_dict(_raw(root, scst_epochs=1))
    assert cfg.train.batch_layout == "images" and cfg.train.scst_candidates == "sample"
    trainer = Trainer(cfg, str(root.parent / "out-old"))
    got = [b["image_ids"].tolist() for b in trainer._batches()]
    want = [b["image_ids"].tolist() for b in trainer.data.train_loader(4, seed=0, epoch=0)]
    assert got == want and all(b["captions"].shape[:2] == (4, 5) for b in trainer._batches())
    assert "caption_image" not in next(iter(trainer._batches()))
    calls = []
    real_sample = train_mod.sample
    monkeypatch.setattr(train_mod, "sample", lambda *a, **k: calls.append(1) or real_sample(*a, **k))
    monkeypatch.setattr(trainer, "beam_candidates", lambda *a: pytest.fail("beam candidates in an old config"))
    batches = list(trainer._batches("scst"))[:1]
    monkeypatch.setattr(trainer, "_batches", lambda stage="xe": batches)
    trainer.scst_epoch()
    assert calls == [1]


def test_the_coco_studies_use_the_paper_recipe_and_the_synthetic_ones_name_theirs():
    for name in ("fusion_ablation", "lambda_sweep", "seeds"):
        spec = load_study(f"studies/{name}.yaml", check_files=False)
        t = spec.base["train"]
        assert spec.base["data"]["kind"] == "coco" and t["batch_layout"] == "pairs"
        written = load_yaml(f"studies/{name}.yaml")["train"]
        if t["scst_epochs"]:
            assert t["scst_candidates"] == "beam" and t["scst_baseline"] == "mean"
            assert t["scst_reward_df"] == "captions"  # M2's reward: each training caption a document
        else:  # no SCST stage: the keys do not apply and are absent
            assert "scst_candidates" not in written and "scst_reward_df" not in written
    for name in ("smoke", "synthetic_fusions", "mask_nets"):
        written = load_yaml(f"studies/{name}.yaml")["train"]
        assert written["batch_layout"] == "images" and written["scst_epochs"] == 0 and "scst_candidates" not in written


# -- the plan ---------------------------------------------------------------------------------------------------------
def test_the_plan_prices_the_layout_and_the_candidates():
    from launch import plan

    old = load_study("studies/seeds.yaml", ["train.batch_layout=images", "train.scst_candidates=sample"],
                     check_files=False)
    assert plan.encoder_passes(old) == 10  # 10 images x 5 captions: priced as before these keys
    assert plan.xe_image_cost(old) == 1.0 and plan.scst_image_cost(old) == plan.SCST_IMAGE_COST
    new = load_study("studies/seeds.yaml", check_files=False)
    # 50 pairs less the expected repeats: C(50, 2) pairs of pairs, each of one image with probability 4 / (5N - 1)
    assert plan.encoder_passes(new) == pytest.approx(50 - 1225 * 4 / 566_434, abs=1e-4)
    assert plan.xe_image_cost(new) == pytest.approx(1 + 4 * plan.ENCODER_SHARE, abs=1e-3)
    assert plan.scst_image_cost(new) == pytest.approx(plan.SCST_IMAGE_COST * plan.BEAM_SCST_COST)
    pairs_sampled = load_study("studies/seeds.yaml", ["train.scst_candidates=sample"], check_files=False)
    hours = {name: plan.estimate(spec, 100, None).gpu_hours for name, spec in
             (("old", old), ("pairs_sampled", pairs_sampled), ("new", new))}
    assert hours["pairs_sampled"] > hours["old"]  # the pairs layout's XE steps cost more
    assert hours["new"] < hours["pairs_sampled"]  # beam candidates cost less than sampled ones (BEAM_SCST_COST < 1)


def test_the_plans_encoder_passes_are_the_expected_distinct_images_of_a_pairs_step(tmp_path):
    """At the smoke study's sizes (1,000 train images, 5,000 pairs, 25 a step) repeats are common enough to count:
    the closed form against the mean over simulated steps."""
    import numpy as np
    import yaml

    from launch import plan

    raw = load_yaml("studies/smoke.yaml")
    raw["train"]["batch_layout"] = "pairs"
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_study(path, check_files=False)
    rng = np.random.default_rng(0)
    simulated = np.mean([len(np.unique(rng.choice(5000, 25, replace=False) // 5)) for _ in range(20_000)])
    assert plan.encoder_passes(spec) == pytest.approx(simulated, abs=0.02)
    assert 24.0 < plan.encoder_passes(spec) < 25.0


def test_a_configuration_saved_before_the_keys_keeps_its_group_hash():
    """A study that ran before the recipe keys stored configs without them; resolved today they hold the defaults,
    which must not make them another configuration (their replicate groups, leaderboard entries)."""
    from dashboards.stats import config_hash

    today = Config.from_dict({"train": {"xe_epochs": 3}}).to_dict()
    saved = {**today, "train": {k: v for k, v in today["train"].items()
                                if k not in ("batch_layout", "scst_candidates", "scst_reward_df")}}
    assert config_hash(saved) == config_hash(today)
    pairs = Config.from_dict({"train": {"xe_epochs": 3, "batch_layout": "pairs"}}).to_dict()
    beam = Config.from_dict({"train": {"xe_epochs": 3, "scst_candidates": "beam"}}).to_dict()
    captions = Config.from_dict({"train": {"xe_epochs": 3, "scst_reward_df": "captions"}}).to_dict()
    assert len({config_hash(today), config_hash(pairs), config_hash(beam), config_hash(captions)}) == 4

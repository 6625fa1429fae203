"""Self-critical sequence training (stage 2): it fine-tunes from the cross-entropy checkpoint it starts from; the
advantage uses the mean reward of the *other* samples (or the greedy caption's reward); the switch point is a
configurable checkpoint whose vocabulary must match; sampling reuses the decoder cache."""
import math

import numpy as np
import pytest

from a2core.errors import CheckpointError
import torch

import a2core.train as train_mod
from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.decode import sample
from a2core.model.a2 import next_word_logp
from a2core.train import Trainer, train

SEED = 31
TINY_MODEL = {"d_model": 32, "layers": 2, "heads": 4, "d_ff": 64, "max_regions": 10, "fusion": "gate"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("scst") / "synth"
    synthetic.generate(root, seed=SEED, images=60)  # 30 train, 15 val, 15 test
    return root


def _tiny(root, **train):
    return Config.from_dict({"data": {"root": str(root), "images": 60, "seed": SEED}, "model": dict(TINY_MODEL),
                             "train": {"xe_epochs": 0, "scst_epochs": 1, "log_every": 1000, **train}})


# -- SCST fine-tunes from its XE checkpoint -----------------------------------------------------------------------
SCST_DATA_SEED = 3
SCST_IMAGES = 1000
SCST_REWARD_RISE = 0.01  # the bar of the sampled reward's rise; measured spread in the end-to-end test's docstring


def scst_config(root, seed: int = 0) -> Config:
    """The end-to-end run's configuration (benchmarks/bench_margins.py replays it over seeds and CPU kinds)."""
    return Config.from_dict({
        "data": {"root": str(root), "images": SCST_IMAGES, "seed": SCST_DATA_SEED},
        "model": {"d_model": 64, "layers": 2, "heads": 4, "d_ff": 128, "max_regions": 10, "fusion": "gate"},
        "train": {"seed": seed, "xe_epochs": 6, "scst_epochs": 2, "batch_size": 125, "lr_factor": 0.2,
                  "warmup": 150, "scst_lr": 3e-5, "scst_samples": 5, "scst_baseline": "mean",
                  "val_decode": "greedy", "log_every": 1000},
    })


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_scst_fine_tunes_from_the_xe_checkpoint_it_starts_from(tmp_path):
    """Stage 1 (XE) to a reasonable score, then stage 2 from the best XE checkpoint (this run's best.pt), end to end:
    the switch point is that checkpoint, SCST trains from it and raises what it optimises (the expected reward of
    the captions it samples for its training images), and the run's best is over both stages.

    Sizes: 1000 images (500 train, 250 val, 250 test), d_model 64, 2 layers; XE runs 6 epochs, SCST 2 (40 steps;
    scst_lr 3e-5, not the paper's 5e-6: at 5e-6 Adam moves no weight by more than ~3e-4 in so few steps). The same
    seeds train differently on different CPUs (other vector kernels, other rounding), so each assertion has a margin
    measured over training seeds x kernel sets (`python benchmarks/bench_margins.py --cases scst`, records in
    benchmarks/records/margins/; AMD EPYC, 2026-11-27, seeds 0-3 x ATEN_CPU_CAPABILITY default and avx2, one
    thread as here; an earlier measurement, seeds 0-2 and a second EPYC, agreed):
    - XE best val CIDEr: 90.8-122.7 (the best constant caption scores about 61): asserted > 70.
    - The sampled reward on the training images (5 captions an image, seeded, dropout off; CIDEr-D x1, as
      `train/reward`), SCST's last epoch minus the XE checkpoint: +0.036 to +0.070, from 0.93-1.04. Asserted
      > +0.01 (SCST_REWARD_RISE): the lowest rise is 3.6x the bar.
    - Not asserted to rise, being below the noise of one run at these sizes: val CIDEr (the best SCST epoch minus
      the XE best: +0.5 to +9.2 here, -2.8 to +8.9 in the earlier measurement; an older form asserted a rise and
      failed on one CPU: SCST [96.36, 97.82] against XE 100.655), greedy CIDEr on the training images (-3.5 to
      +12.4, x100) and `train/reward` from the first SCST epoch to the second (-0.003 to +0.032: each epoch's mean
      over its own samples, with dropout). Asserted instead: SCST keeps the XE model (val > XE best - 10, over 3x
      the largest drop seen). What SCST's loss is, given rewards, is asserted exactly by the constructed-reward
      tests below."""
    root = tmp_path / "synth"
    synthetic.generate(root, seed=SCST_DATA_SEED, images=SCST_IMAGES)
    cfg = scst_config(root)
    saved = {}

    def report(metrics, checkpoint_dir):
        if metrics["epoch"] == cfg.train.xe_epochs:  # the switch point: keep the XE best before SCST replaces it
            saved["xe_best"] = ckpt.save(ckpt.load(tmp_path / "run" / "best.pt"), tmp_path / "xe_best.pt")

    result = train(cfg, report, output_dir=tmp_path / "run")
    history = result["history"]
    assert [h["stage"] for h in history] == ["xe"] * 6 + ["scst"] * 2
    xe = [h["val/CIDEr"] for h in history if h["stage"] == "xe"]
    scst = [h["val/CIDEr"] for h in history if h["stage"] == "scst"]
    xe_best = max(xe)
    assert xe_best > 70, f"XE did not reach a reasonable score: {xe}"  # x100; the best constant caption scores about 61
    # The XE checkpoint that stage 2 started from, validated again the same way, has that score.
    trainer = Trainer(cfg.replace({"train.scst_from": str(saved["xe_best"])}), tmp_path / "check")
    trainer._enter_scst()
    assert trainer.validate()["val/CIDEr"] == pytest.approx(xe_best, abs=1e-9)
    assert all(h["train/reward"] > 0 for h in history if h["stage"] == "scst")  # SCST's own epochs, rewards scored
    assert max(scst) > xe_best - 10, f"SCST {scst} lost the XE checkpoint's {xe_best:.3f} (XE epochs: {xe})"
    assert result["best/val/CIDEr"] == max(xe + scst)  # the run's best is over both stages
    # What SCST optimises went up: the expected reward of the captions it samples for its training images, measured
    # the same way (seeded, dropout off) on the XE checkpoint it started from and on its last epoch's weights.
    before = sampled_reward(trainer)
    after = Trainer(cfg.replace({"train.scst_from": str(tmp_path / "run" / "last.pt")}), tmp_path / "after")
    after._enter_scst()
    after = sampled_reward(after)
    assert after > before + SCST_REWARD_RISE, f"SCST's sampled reward {after:.4f}, from {before:.4f} before it"


def sampled_reward(trainer, samples: int = 5, seed: int = 0, greedy_too: bool = False):
    """What SCST maximises, measured without training: the mean CIDEr-D reward (x1, as `train/reward`) of `samples`
    captions sampled for each training image from the trainer's model (dropout off, sampling seeded, the global
    RNG state left as it was); with `greedy_too`, (that, the greedy captions' mean CIDEr-D on the same images)."""
    from a2core.decode import greedy

    t, model, vocab = trainer.cfg.train, trainer.model.eval(), trainer.vocab
    cider, refs = trainer.cider(), trainer.data.references("train")
    drawn, best = [], []
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for batch in trainer.data.loader("train", 50):
            feats, mask = trainer._batch(batch)
            ids = batch["image_ids"].tolist()
            tokens, _, _ = sample(model, feats, mask, samples, t.max_len, vocab.bos, vocab.eos)
            drawn += list(cider.scores([vocab.decode(s) for s in tokens.tolist()],
                                       [refs[i] for i in ids for _ in range(samples)]))
            if greedy_too:
                g = greedy(model, feats, mask, t.max_len, vocab.bos, vocab.eos)
                best += list(cider.scores([vocab.decode(s) for s in g.tolist()], [refs[i] for i in ids]))
    mean = float(np.mean(drawn))
    return (mean, float(np.mean(best))) if greedy_too else mean


# -- the advantage, on constructed rewards --------------------------------------------------------------------------
class _TableCider:
    """A reward that is a table lookup on the caption's first word; records the references it was given."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def scores(self, cands, refs):
        assert len(cands) == len(refs)
        self.calls.append((list(cands), [list(r) for r in refs]))
        return np.array([self.table[c.split()[0]] for c in cands], dtype=np.float64)


def _constructed(trainer, monkeypatch, rewards, greedy_reward=None):
    """Replace sampling (k captions per image, a known word each, a known log-prob per token), the greedy decode
    and the CIDEr-D scorer, so that scst_epoch's loss is a known function of the rewards."""
    vocab = trainer.vocab
    k = trainer.cfg.train.scst_samples
    words = vocab.words[4:4 + k]
    table = dict(zip(words, rewards))
    gword = vocab.words[4 + k]
    table[gword] = greedy_reward if greedy_reward is not None else float("nan")
    logp_values = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -0.75, 0.0], [-1.5, 0.0, 0.0]])  # (k, L)
    valid_values = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    seen = {}

    def fake_sample(model, feats, mask, n, max_len, bos, eos):
        assert n == k
        b = feats.shape[0]
        tokens = torch.zeros(b * n, 3, dtype=torch.long)
        for j in range(n):
            tokens[j::n, 0] = vocab.index[words[j]]
        tokens[:, 1] = eos
        anchor = sum(p.sum() for p in model.captioner_parameters()) * 0.0  # joins the graph; adds nothing
        logps = logp_values.repeat(b, 1) + anchor
        seen["rows"] = b * n
        return tokens, logps, valid_values.repeat(b, 1)

    def fake_greedy(model, feats, mask, max_len, bos, eos):
        assert not model.training  # the greedy baseline decodes without dropout
        return torch.tensor([[vocab.index[gword], eos]] * feats.shape[0])

    monkeypatch.setattr(train_mod, "sample", fake_sample)
    monkeypatch.setattr(train_mod, "greedy", fake_greedy)
    trainer._cider = _TableCider(table)
    return logp_values, valid_values, seen


def test_mean_of_others_baseline(tiny_root, tmp_path, monkeypatch):
    cfg = _tiny(tiny_root, scst_samples=3, batch_size=150, scst_baseline="mean")
    trainer = Trainer(cfg, tmp_path)
    rewards = torch.tensor([0.9, 0.3, 0.0])
    logp, valid, seen = _constructed(trainer, monkeypatch, rewards.tolist())
    out = trainer.scst_epoch()
    # Baseline of sample i: the mean reward of the other k - 1 samples of its image.
    baseline = torch.tensor([(0.3 + 0.0) / 2, (0.9 + 0.0) / 2, (0.9 + 0.3) / 2])
    advantage = rewards - baseline  # [0.75, -0.15, -0.6]: sums to zero over an image's samples
    assert float(advantage.sum()) == pytest.approx(0.0, abs=1e-7)
    per_image = -(advantage[:, None] * logp * valid).sum()
    assert seen["rows"] == 90
    assert out["train/loss"] == pytest.approx(float(per_image) / 3, rel=1e-5)  # 30 images x k rows, / rows
    assert out["train/reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    # Not the mean of all samples (self included): that advantage is smaller by (k - 1) / k.
    with_self = -((rewards - rewards.mean())[:, None] * logp * valid).sum() / 3
    assert out["train/loss"] != pytest.approx(float(with_self), rel=1e-3)
    # Every sample is scored against the references of its own image: k identical groups in a row.
    cands, refs = trainer._cider.calls[0]
    train_refs = trainer.data.references("train")
    groups = [refs[i:i + 3] for i in range(0, len(refs), 3)]
    assert all(g[0] == g[1] == g[2] for g in groups)
    assert sorted(map(tuple, (g[0] for g in groups))) == sorted(tuple(r) for r in train_refs.values())


def test_greedy_baseline_uses_the_greedy_reward(tiny_root, tmp_path, monkeypatch):
    cfg = _tiny(tiny_root, scst_samples=3, batch_size=150, scst_baseline="greedy")
    trainer = Trainer(cfg, tmp_path)
    rewards = torch.tensor([0.9, 0.3, 0.0])
    logp, valid, _ = _constructed(trainer, monkeypatch, rewards.tolist(), greedy_reward=0.5)
    out = trainer.scst_epoch()
    advantage = rewards - 0.5
    assert out["train/loss"] == pytest.approx(float(-(advantage[:, None] * logp * valid).sum()) / 3, rel=1e-5)
    assert trainer.model.training  # back in training mode after the greedy decode


@pytest.mark.slow
def test_greedy_baseline_runs_for_real(tiny_root, tmp_path):
    result = train(_tiny(tiny_root, scst_samples=2, batch_size=50, scst_baseline="greedy", scst_lr=1e-4,
                         scst_from=str(_xe_checkpoint(tiny_root, tmp_path))), output_dir=tmp_path / "run")
    (epoch,) = result["history"]
    assert epoch["stage"] == "scst"
    assert math.isfinite(epoch["train/loss"]) and 0.0 <= epoch["train/reward"] <= 10.0
    assert 0.0 <= epoch["val/CIDEr"] <= 1000.0 and math.isfinite(epoch["train/mask_loss"])


# -- the switch point --------------------------------------------------------------------------------------------
def _xe_checkpoint(root, tmp_path, seed=0, name="xe.pt", **over):
    """A checkpoint as stage 1 writes it (an initialised Trainer's state: the format, not the training, matters)."""
    cfg = _tiny(root, seed=seed, xe_epochs=1, scst_epochs=0, **over)
    trainer = Trainer(cfg, tmp_path / f"make-{name}")
    return ckpt.save(trainer.state_dict(), tmp_path / name)


def _same_weights(model, state):
    ours = model.state_dict()
    return all(torch.equal(ours[k], v) for k, v in state.items() if k != "train_step")


def test_scst_starts_from_the_configured_checkpoint(tiny_root, tmp_path):
    a = _xe_checkpoint(tiny_root, tmp_path, seed=1, name="a.pt")
    b = _xe_checkpoint(tiny_root, tmp_path, seed=2, name="b.pt")
    trainer = Trainer(_tiny(tiny_root, seed=3, scst_from=str(a)), tmp_path / "out")
    trainer._enter_scst()
    assert _same_weights(trainer.model, ckpt.load(a)["model"])
    assert not _same_weights(trainer.model, ckpt.load(b)["model"])
    # A directory holding checkpoint.pt works too (what Ray Train checkpoints look like).
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / ckpt.CHECKPOINT_FILE).write_bytes(b.read_bytes())
    trainer = Trainer(_tiny(tiny_root, seed=3, scst_from=str(tmp_path / "dir")), tmp_path / "out2")
    trainer._enter_scst()
    assert _same_weights(trainer.model, ckpt.load(b)["model"])
    # Default: this run's best.pt.
    (tmp_path / "out3").mkdir()
    (tmp_path / "out3" / "best.pt").write_bytes(a.read_bytes())
    trainer = Trainer(_tiny(tiny_root, seed=3), tmp_path / "out3")
    trainer._enter_scst()
    assert _same_weights(trainer.model, ckpt.load(a)["model"])


def test_a_checkpoint_of_another_vocabulary_is_refused(tiny_root, tmp_path):
    state = ckpt.load(_xe_checkpoint(tiny_root, tmp_path))
    vocab = list(state["vocab"])
    vocab[4], vocab[5] = vocab[5], vocab[4]
    other = ckpt.save({**state, "vocab": vocab}, tmp_path / "other-vocab.pt")
    with pytest.raises(CheckpointError, match="vocabulary differs") as err:
        train(_tiny(tiny_root, scst_from=str(other)), output_dir=tmp_path / "run")
    assert str(other) in str(err.value)
    missing = tmp_path / "missing.pt"
    with pytest.raises(CheckpointError, match="missing.pt"):
        train(_tiny(tiny_root, scst_from=str(missing)), output_dir=tmp_path / "run2")


# -- sampling with the decoder cache ------------------------------------------------------------------------------
def test_sampling_reuses_the_decoder_cache_and_matches_teacher_forcing(tiny_root, tmp_path):
    trainer = Trainer(_tiny(tiny_root), tmp_path)
    model = trainer.model.eval()  # no dropout: the two passes must agree
    eos = trainer.vocab.eos
    with torch.no_grad():
        # Make <eos> likely enough that sampled lengths vary: its logit is the last hidden state's sum times 0.5,
        # and the last layer's norm adds 0.15 to every dimension of that state (its own mean is zero).
        model.decoder[-1].norm3.bias.fill_(0.15)
        model.embed.weight[eos] = 0.5
    batch = next(iter(trainer.data.loader("train", 4)))
    feats, mask = batch["feats"], batch["region_mask"]
    calls = []
    decode = model.decode

    def recording_decode(tokens, mem, region_mask, mode="aligned", caches=None, start=0):
        out = decode(tokens, mem, region_mask, mode, caches, start)
        calls.append((tokens.shape[1], start, [c.length for c in caches] if caches else None))
        return out

    model.decode = recording_decode
    torch.manual_seed(0)
    n = 3
    tokens, logps, valid = sample(model, feats, mask, n, max_len=15, bos=trainer.vocab.bos, eos=trainer.vocab.eos)
    del model.decode
    steps = tokens.shape[1]
    # One new position per step; the cache holds exactly the positions seen so far.
    assert [c[0] for c in calls] == [1] * steps
    assert [c[1] for c in calls] == list(range(steps))
    assert all(lens == [t + 1] * len(model.decoder) for t, (_, _, lens) in enumerate(calls))
    assert logps.requires_grad and logps.shape == tokens.shape == valid.shape == (4 * n, steps)
    # Valid positions: the words up to and including <eos>; pad after.
    for row, ok in zip(tokens.tolist(), valid.tolist()):
        length = row.index(eos) + 1 if eos in row else len(row)
        assert ok == [True] * length + [False] * (len(row) - length)
        assert all(w == 0 for w in row[length:])
    assert len({int(v.sum()) for v in valid}) > 1  # lengths vary, so the mask matters
    # The sampled log-probs are the model's log-probs of those words under teacher forcing.
    inp = torch.cat([torch.full((4 * n, 1), trainer.vocab.bos), tokens[:, :-1]], 1)
    with torch.no_grad():
        logits, _ = model(feats, mask, inp)  # n captions per image, grouped by image
    teacher = next_word_logp(logits).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(logps.detach()[valid], teacher[valid], atol=1e-5)

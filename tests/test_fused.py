"""Replicate seeds trained as one fused model (`a2core.fused`): the same training as separate runs, a step that reads
nothing back from the device, and each seed's reports, checkpoints and test scores as a run of its own has them."""
import json
import statistics

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.errors import ConfigError
from a2core.fused import FusedReplicates, check_replicates, train_replicates
from a2core.model.a2 import build_model
from a2core.train import Trainer, train

TINY = {"model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 10, "fusion": "gate",
                  "dropout": 0.0},
        "train": {"xe_epochs": 2, "batch_size": 50, "warmup": 50, "lr_factor": 0.5, "grad_clip": 0.1,
                  "diag_every": 0, "test_meteor": False}}
STEPS = 50  # 6 epochs of the tiny set's 8 steps, 2 seeds


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "tiny"
    synthetic.generate(root, seed=5, images=100, test_images=10)
    return {"root": str(root), "images": 100, "seed": 5, "val_images": 10}


def _cfgs(data, seeds, model=None, **train):
    raw = json.loads(json.dumps(TINY))
    raw["model"].update(model or {})
    raw["train"].update(train)
    return [Config.from_dict({"data": data, **raw, "train": {**raw["train"], "seed": s}}) for s in seeds]


def _separate(cfg, out, steps):
    """A seed trained alone (a2core.train.Updates.xe), its first `steps` step losses and its weights after."""
    tr = Trainer(cfg, out)
    tr.model.train()
    losses = []
    while len(losses) < steps:
        for b in tr._batches():
            out = tr.updates.xe(b["feats"], b["region_mask"], b["captions"], tr.step, b.get("caption_image"))
            losses.append(float(out["train/loss"]))  # a 0-dim tensor on the device
            tr._advance()
            if len(losses) == steps:
                break
        tr.epoch += 1
    return losses, {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def _fused_steps(fused, steps):
    """The fused seeds' first `steps` step losses, (steps, k)."""
    for tr in fused.trainers:
        tr.model.train()
    fused.template.train()
    losses = []
    while len(losses) < steps:
        for batches in zip(*fused._loaders()):
            before = fused.sums["train/loss"].clone()
            fused.xe_step(*fused.stack(list(batches)))
            losses.append((fused.sums["train/loss"] - before).tolist())
            if len(losses) == steps:
                break
        for tr in fused.trainers:
            tr.epoch += 1
    return losses


def _without_key_biases(name, w, d):
    """A parameter without its attention-key bias: a key bias adds the same q.b_k to a query's every score, which
    the softmax removes, so its gradient is 0 in exact arithmetic and rounding noise in practice, which Adam scales
    to lr-sized steps (any two kernel sets, fused or not, disagree there)."""
    if name.endswith("qkv.bias"):  # (3 d,): queries, keys, values
        return torch.cat([w[:d], w[2 * d:]])
    if name.endswith("cross.kv.bias"):  # (2 d,): keys, values
        return w[d:]
    return w


@pytest.mark.parametrize("layout,bucket", [("images", False),
                                           pytest.param("pairs", True, marks=pytest.mark.slow)])
def test_each_fused_seed_trains_as_it_does_alone_without_dropout(data, tmp_path, layout, bucket):
    """Dropout 0, each seed's own data order: every step's loss and the weights after 50 steps (the mask network's
    steps and per-seed gradient clipping at 0.1, active here, included) match the seed trained alone. Tolerance:
    float32 rounding of the batched kernels, which block their sums differently (and of the fused step's
    self-attention, written out, against the SDPA kernel alone); measured 2e-7 (losses) and 9e-6 (weights, relative
    norm per tensor), asserted 1e-5 and 1e-4."""
    seeds = [0, 1]
    cfgs = _cfgs(data, seeds, batch_layout=layout)
    alone = [_separate(c, tmp_path / f"alone{c.train.seed}", STEPS) for c in cfgs]
    fused = FusedReplicates(cfgs, [tmp_path / f"fused{s}" for s in seeds], bucket=bucket)
    losses = _fused_steps(fused, STEPS)
    d = cfgs[0].model.d_model
    for i in range(len(seeds)):
        for s in range(STEPS):
            assert losses[s][i] == pytest.approx(alone[i][0][s], rel=1e-5), (seeds[i], s)
        weights = dict(fused.trainers[i].model.named_parameters())
        for name, w in alone[i][1].items():
            a, b = _without_key_biases(name, w, d), _without_key_biases(name, weights[name].detach(), d)
            assert ((a - b).norm() / a.norm().clamp_min(1e-12)).item() < 1e-4, (seeds[i], name)
    assert losses[0][0] != losses[0][1]  # the seeds differ (initialisation, data order)


def test_a_fused_step_reads_nothing_back_from_the_device(data, tmp_path, monkeypatch):
    """No `.item()`, `.tolist()`, `float()`, `int()`, `bool()` or `.numpy()` of a tensor inside a fused step (mask
    step, clipping and both Adams included): on a GPU each would wait for the device."""
    fused = FusedReplicates(_cfgs(data, [0, 1, 2]), [tmp_path / str(s) for s in range(3)])
    batches = [fused.stack(list(b)) for b, _ in zip(zip(*fused._loaders()), range(3))]
    fused.xe_step(*batches[0])  # first step outside the count (optimizer state created)
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for b in batches[1:]:
        fused.xe_step(*b)
    monkeypatch.undo()
    assert reads == []
    assert fused.counts["train/loss"] == 3 and fused.counts["train/mask_loss"] == 3


def test_train_replicates_reports_checkpoints_and_test_scores_per_seed(data, tmp_path):
    """Each seed reports every epoch through its own callback, with a normal single-model checkpoint (the seed's
    weights, an Adam state of its own that a single run resumes from) and its own best epoch and test scores."""
    seeds = [3, 4]
    cfgs = _cfgs(data, seeds)
    seen = {s: [] for s in seeds}

    def reporter(seed):
        def report(metrics, checkpoint_dir):
            state = ckpt.load(f"{checkpoint_dir}/{ckpt.CHECKPOINT_FILE}", map_location="cpu")
            seen[seed].append((metrics, state))
        return report

    results = train_replicates(cfgs, [reporter(s) for s in seeds], output_dirs=[tmp_path / str(s) for s in seeds])
    for s, result in zip(seeds, results):
        assert [m["epoch"] for m, _ in seen[s]] == [1, 2]
        metrics, state = seen[s][-1]
        steps = result["steps"] // 2  # a seed's steps per epoch
        assert state["config"]["train"]["seed"] == s and state["step"] == metrics["step"] == 2 * steps
        assert "test/CIDEr" in metrics and result["test"]["test/CIDEr"] == metrics["test/CIDEr"]
        assert result["best_epoch"] == metrics["best/epoch"] and result["epochs"] == 2
        assert set(m["train/loss"] for m, _ in seen[s]) and all("train/mask_loss" in m for m, _ in seen[s])
        # the checkpoint rebuilds the model alone (as packaging does) ...
        model = build_model(Config.from_dict(state["config"]).model, len(state["vocab"]),
                            cfgs[0].data.max_caption_len + 2)
        model.load_state_dict(state["model"])
        # ... and its optimizer state is this seed's: one more epoch resumed from it as a single run (one seed)
        assert len(state["optimizer"]["state"]) == len(list(model.captioner_parameters()))
        if s != seeds[0]:
            continue
        more = cfgs[0].replace({"train": {"seed": s, "xe_epochs": 3}})
        again = train(more, output_dir=tmp_path / f"resumed{s}", resume_from=tmp_path / str(s) / "last.pt")
        assert again["epochs"] == 3 and again["steps"] == 3 * steps
    assert seen[3][0][0]["train/loss"] != seen[4][0][0]["train/loss"]


@pytest.mark.parametrize("dead", [[0], [1], [0, 1]], ids=["first", "second", "both"])
def test_a_diverged_seed_stops_alone_and_the_others_train_their_epochs(data, tmp_path, dead):
    """A seed whose loss goes NaN stops with its TrainingDiverged; the others run their xe_epochs and no more. The
    stage-1 loop used to count seed 0's epochs, which stop when seed 0 dies: the fused run never ended."""
    from a2core.errors import TrainingDiverged

    fused = FusedReplicates(_cfgs(data, [1, 2], test_at_end=False), [tmp_path / "1", tmp_path / "2"])
    with torch.no_grad():
        for i in dead:
            fused.params["embed.weight"][i].fill_(float("nan"))  # (k, vocab, d_model): seed i's slice
    epochs = []
    xe_epoch = fused.xe_epoch

    def counted():
        epochs.append(len(epochs) + 1)
        assert len(epochs) <= 2, "stage 1 ran past xe_epochs"
        return xe_epoch()

    fused.xe_epoch = counted
    results = fused.run([None, None])
    assert epochs == ([1] if len(dead) == 2 else [1, 2])  # everyone dead after epoch 1: nothing left to train
    for i, result in enumerate(results):
        if i in dead:
            assert isinstance(result, TrainingDiverged) and result.epoch == 1
        else:
            assert result["epochs"] == 2


def test_replicates_must_be_one_configuration_with_distinct_seeds(data):
    with pytest.raises(ConfigError, match="differ only in train.seed"):
        check_replicates(_cfgs(data, [0]) + _cfgs(data, [1], warmup=60))
    with pytest.raises(ConfigError, match="distinct seeds"):
        check_replicates(_cfgs(data, [0, 0]))
    with pytest.raises(ConfigError, match="fp16"):
        check_replicates(_cfgs(data, [0, 1], precision="fp16"))


@pytest.mark.slow
def test_seed_noise_of_fused_and_separate_runs_agrees_with_dropout(tmp_path):
    """Dropout 0.1: the fused seeds draw their dropout masks differently from separate runs (one generator for the
    k), so their values differ; their spread over 4 seeds is the same within its interval: the paired differences
    of best val CIDEr (same seed: same initialisation and data order) have a 95% t-interval that covers 0, and the
    variance ratio is inside the F(3, 3) 95% interval (1/15.4, 15.4). Sizes: 300 synthetic images, 4 epochs, 50 val
    images, where the seeds' CIDEr spreads (sd ~8) and the 8 runs take ~35 s (2 cores; the module's 100-image set
    scores CIDEr 0 for every seed). Measured: paired mean -7.0 against a bound of 19.4, variance ratio 1.2."""
    root = tmp_path / "syn"
    synthetic.generate(root, seed=5, images=300, test_images=10)
    data = {"root": str(root), "images": 300, "seed": 5, "val_images": 50}
    seeds = [0, 1, 2, 3]
    cfgs = _cfgs(data, seeds, model={"dropout": 0.1}, xe_epochs=4, test_at_end=False)
    alone = [train(c, output_dir=tmp_path / f"alone{c.train.seed}")["best/val/CIDEr"] for c in cfgs]
    fused = [r["best/val/CIDEr"] for r in train_replicates(cfgs, output_dirs=[tmp_path / f"f{s}" for s in seeds])]
    assert statistics.stdev(alone) > 1 and fused != alone  # a spread to compare; dropout draws of their own
    diffs = [a - b for a, b in zip(fused, alone)]
    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    assert abs(mean) <= 3.182 * se, (fused, alone)  # t(3) 97.5%
    ratio = statistics.variance(fused) / statistics.variance(alone)
    assert 1 / 15.44 < ratio < 15.44, (fused, alone)


def test_self_attention_written_out_is_the_sdpa_kernels():
    """The fused step's self-attention (`SelfAttention.sdpa = False`: matmul and softmax, which vmap batches) gives
    `F.scaled_dot_product_attention`'s values, with a key mask, causal, and causal after cached positions; measured
    1.2e-7, asserted 1e-6."""
    from a2core.model.a2 import KVCache, SelfAttention

    torch.manual_seed(0)
    att = SelfAttention(32, 4, 0.0)
    x = torch.randn(3, 7, 32)
    keys = torch.ones(3, 7, dtype=torch.bool)
    keys[0, 4:] = False

    def both(run):
        out = []
        for sdpa in (True, False):
            att.sdpa = sdpa
            out.append(run())
        return out

    for kwargs in ({"key_mask": keys}, {"causal": True}, {}):
        a, b = both(lambda: att(x, **kwargs))
        assert (a - b).abs().max().item() < 1e-6, kwargs

    def decoded():  # 3 positions, then 1, then 2 more against the cache
        cache = KVCache()
        return torch.cat([att(x[:, :3], causal=True, cache=cache), att(x[:, 3:4], causal=True, cache=cache),
                          att(x[:, 4:6], causal=True, cache=cache)], dim=1)
    a, b = both(decoded)
    assert (a - b).abs().max().item() < 1e-6


def test_a_captured_step_is_one_graph_a_pass_and_trains_as_the_eager_step(data, tmp_path):
    """`FusedReplicates.capture`: each of the step's three passes (the shared encoder, the mask network's perturbed
    pass, the captioner) compiles into one whole graph (`fullgraph`: a graph break would be an error), once for
    every step of one shape, and the captured seeds train as the eager ones. Compiled here with AOT autograd's
    eager backend, which traces forward and backward as inductor (what a GPU run compiles with, under CUDA graphs)
    does, without generating code on a CPU. Dropout 0, each seed its own data order, 12 steps of one shape (the
    tiny set's last batch is as full as the others), the mask network stepping on every second; tolerance as the
    unfused comparison above's (the traced graphs reorder no reduction: measured equal)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs = []

    def counted(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)  # may restart the trace once (a Python float made a tensor)
        graphs.append(gm)
        return compiled
    seeds, steps = [0, 1], 12
    cfgs = _cfgs(data, seeds, mask_every=2)
    eager = FusedReplicates(cfgs, [tmp_path / f"eager{s}" for s in seeds], bucket=True)
    captured = FusedReplicates(cfgs, [tmp_path / f"captured{s}" for s in seeds], bucket=True)
    captured.capture(mode=None, backend=counted)
    torch._dynamo.reset()
    try:
        expected, got = _fused_steps(eager, steps), _fused_steps(captured, steps)
    finally:
        torch._dynamo.reset()  # no compiled frame kept for later tests
    assert len(graphs) == 3  # one graph a pass, never recompiled
    assert captured.counts["train/mask_loss"] == steps // 2
    for s in range(steps):
        assert got[s] == pytest.approx(expected[s], rel=1e-5), s
    for mine, theirs in zip(captured.trainers, eager.trainers):
        weights = dict(theirs.model.named_parameters())
        for name, w in mine.model.named_parameters():
            assert ((w - weights[name]).norm() / weights[name].norm().clamp_min(1e-12)).item() < 1e-4, name
    assert eager.metrics()[0]["train/mask_mean"] == pytest.approx(captured.metrics()[0]["train/mask_mean"], rel=1e-5)


def test_capture_needs_steps_of_one_shape(data, tmp_path):
    fused = FusedReplicates(_cfgs(data, [0, 1]), [tmp_path / "0", tmp_path / "1"], bucket=False)
    with pytest.raises(ValueError, match="bucket=True"):
        fused.capture()


@pytest.mark.slow
def test_a_captured_run_reports_what_the_eager_run_reports(data, tmp_path):
    """A fused run whose passes are captured (`capture`, AOT eager here, as above) goes through its epochs as the
    eager run does: every seed's reports (losses, val scores, best epoch) and test scores are the eager run's.
    Dropout 0; the tiny set's 10 steps an epoch, 2 epochs, all of one shape."""
    seeds = [0, 1]
    cfgs = _cfgs(data, seeds)
    runs = {}
    for captured in (False, True):
        reports = {s: [] for s in seeds}
        fused = FusedReplicates(cfgs, [tmp_path / f"{captured}{s}" for s in seeds], bucket=True)
        if captured:
            torch._dynamo.reset()
            fused.capture(mode=None, backend="aot_eager")
        try:
            results = fused.run([lambda m, _, s=s: reports[s].append(m) for s in seeds])
        finally:
            torch._dynamo.reset()
        runs[captured] = (reports, results)
    (eager, eager_results), (captured, captured_results) = runs[False], runs[True]
    for s in seeds:
        assert [m["epoch"] for m in captured[s]] == [1, 2]
        for mine, theirs in zip(captured[s], eager[s]):
            for key in ("train/loss", "train/mask_loss", "val/CIDEr", "best/epoch"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (s, key)
    for mine, theirs in zip(captured_results, eager_results):
        assert mine["test"]["test/CIDEr"] == pytest.approx(theirs["test"]["test/CIDEr"], rel=1e-5)

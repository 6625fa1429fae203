"""Decoding an empty batch (B = 0 images: an empty result of the usual type and rank, for one model, ensembles and
every beam width, instead of a ZeroDivisionError in the cross-attention), `noam_to_zero` as the config says it is
(0 only after the last step), and `train/lr` as the rate of the last optimizer step taken (not the next one's)."""
import pytest
import torch

from a2core.config import Config, ModelConfig, TrainConfig
from a2core.data import synthetic
from a2core.data.captions import Vocab
from a2core.decode import (EnsembleStepper, MinLengthStepper, ModelStepper, UncachedStepper, beam_search,
                           caption_batches, greedy, sample)
from a2core.fused import train_replicates
from a2core.model.a2 import build_model
from a2core.train import learning_rate, lr_taken, noam, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, R, D = 12, 4, 8  # vocabulary, region slots, feature size


def _model(seed=0, fusion="gate"):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, layers=2, heads=2, d_ff=32, dropout=0.0, feature_dim=D, max_regions=R,
                      fusion=fusion)
    return build_model(cfg, vocab_size=V).eval()


def _empty():
    return torch.zeros(0, R, D), torch.ones(0, R, dtype=torch.bool)  # feats (0, R, D), region_mask (0, R)


STEPPERS = {
    "model": lambda: _model(),
    "uncached": lambda: UncachedStepper(_model()),
    "ensemble of 1": lambda: EnsembleStepper([_model()]),
    "ensemble of 2": lambda: EnsembleStepper([_model(0), _model(1, "none")]),
    "min length": lambda: MinLengthStepper(ModelStepper(_model()), eos=2, min_len=2),
}


@pytest.mark.parametrize("which", list(STEPPERS))
def test_an_empty_batch_decodes_to_empty_results(which):
    """Raised ZeroDivisionError (`n % b` in A2CrossAttention.forward) for every stepper and width."""
    stepper = STEPPERS[which]()
    feats, mask = _empty()
    g = greedy(stepper, feats, mask, max_len=5)
    assert g.dtype == torch.long and g.shape == (0, 0)
    for k in (1, 3, 20):  # 20: wider than the vocabulary
        seqs, scores = beam_search(stepper, feats, mask, beam_size=k, max_len=5)
        assert seqs.dtype == torch.long and seqs.shape == (0, 0)
        assert scores.dtype == torch.float32 and scores.shape == (0,)
        beams, all_scores = beam_search(stepper, feats, mask, beam_size=k, max_len=5, all_beams=True)
        assert beams.shape == (0, k, 0) and all_scores.shape == (0, k)
        assert beams.flatten(0, 1).shape == (0, 0)  # as `Trainer.beam_candidates` reads them: (B*k, L)


def test_an_empty_batch_among_others_adds_no_caption():
    """`caption_batches` over a real batch and an empty one: the real one's captions, and nothing for the empty."""
    vocab = Vocab(["<pad>", "<bos>", "<eos>", "<unk>", *[f"w{i}" for i in range(V - 4)]])
    torch.manual_seed(3)
    real = ([7, 8], torch.randn(2, R, D), torch.ones(2, R, dtype=torch.bool))
    for k in (1, 3):
        alone = caption_batches(_model(), vocab, [real], beam_size=k, max_len=4)
        both = caption_batches(_model(), vocab, [real, ([], *_empty())], beam_size=k, max_len=4)
        assert both == alone and list(both) == [7, 8]


def test_sample_of_an_empty_batch_is_empty():
    tokens, logps, valid = sample(_model(), *_empty(), n=3, max_len=4)
    assert tokens.shape == logps.shape == valid.shape == (0, 0)
    assert (tokens.dtype, logps.dtype, valid.dtype) == (torch.long, torch.float32, torch.bool)


@pytest.mark.parametrize("fusion", ["gate", "none"])
def test_the_model_runs_an_empty_batch(fusion):
    """Teacher forcing (every mode, attention recorded) and one cached step of B = 0 images: empty outputs of the
    usual shapes, no ZeroDivisionError."""
    model = _model(fusion=fusion)
    feats, mask = _empty()
    tokens = torch.zeros(0, 6, dtype=torch.long)
    model.record_attention(True)
    logits, penalty = model(feats, mask, tokens)
    assert logits.shape == (0, 6, V) and penalty is None
    rec = model.recorded_attention()[0]
    assert rec["attention"].shape == rec["aligned"].shape == (0, 2, 6, R)
    if fusion != "none":
        assert rec["mask"].shape == (0, 2, 6, R)
        _, penalty = model(feats, mask, tokens, mode="perturbed", word_mask=tokens != 0)
        assert float(penalty.detach()) == 0.0
    model.record_attention(False)
    state = model.init_state(feats, mask)
    assert model.step(torch.zeros(0, dtype=torch.long), state).shape == (0, V)
    # a batch of images with rows that do not divide among them is still refused
    with pytest.raises(ValueError, match="3 caption rows for 0 images"):
        model(feats, mask, torch.zeros(3, 6, dtype=torch.long))


def test_noam_to_zero_takes_one_nth_of_noam_at_the_last_step_and_zero_after():
    """The formula (unchanged: trained studies' numbers depend on it), and the config text that says what it does."""
    n, d, w, f = 40, 64, 10, 0.25
    assert learning_rate(0, d, w, f, "noam_to_zero", n) == noam(0, d, w, f)
    last = learning_rate(n - 1, d, w, f, "noam_to_zero", n)
    assert last == pytest.approx(noam(n - 1, d, w, f) / n, rel=1e-12) and last > 0
    assert learning_rate(n, d, w, f, "noam_to_zero", n) == 0.0
    assert learning_rate(n + 7, d, w, f, "noam_to_zero", n) == 0.0  # never negative
    text = TrainConfig.model_fields["lr_schedule"].description
    assert "to 0 just after the last" in text and "the last step takes 1/N of the Noam rate" in text
    assert "to 0 at the last step" not in text


def test_lr_taken_is_the_rate_of_the_step_just_taken():
    """LambdaLR steps after the optimizer: `get_last_lr()` is the next step's rate; `lr_taken` the rate that
    `optimizer.step()` last used."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s, 64, 3, 1.0, "noam_to_zero", 5))
    assert lr_taken(sched) == learning_rate(0, 64, 3, 1.0, "noam_to_zero", 5)  # before any step: the first's
    for s in range(5):
        used = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        assert lr_taken(sched) == used == learning_rate(s, 64, 3, 1.0, "noam_to_zero", 5)
    assert sched.get_last_lr()[0] == 0.0 < lr_taken(sched)  # the last step took 1/5 of Noam, not 0


def tiny_config(tmp_path_factory, **train) -> Config:
    """A run of 2 epochs x 4 steps of 5 images on a fresh 40-image synthetic dataset; `train` adds train keys."""
    root = tmp_path_factory.mktemp("syn") / "tiny"
    synthetic.generate(root, seed=5, images=40, test_images=10)
    return Config.from_dict({
        "data": {"root": str(root), "images": 40, "seed": 5, "val_images": 2},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 2, "batch_size": 25, "warmup": 3, "lr_factor": 0.5, "log_every": 3,
                  "diag_every": 0, "diag_images": 1, "test_at_end": False, "max_len": 4, **train}})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_config(tmp_path_factory, lr_schedule="noam_to_zero")


def test_train_lr_is_the_rate_of_the_epochs_last_step(tiny_run, tmp_path):
    """A tiny noam_to_zero run of 2 epochs x 4 steps: each epoch's `train/lr` and each progress read's is
    learning_rate(step - 1), the step just taken; it reported learning_rate(step), the next step's (0 at the end)."""
    seen, reads = [], []
    train(tiny_run, report=lambda m, d: seen.append(m), output_dir=tmp_path / "run",
          progress=lambda p: reads.append(p) if p.metrics else None)
    total = seen[-1]["step"]
    assert [m["step"] for m in seen] == [total // 2, total] and total == 8  # 20 train images, 5 a step
    rate = lambda s: learning_rate(s, 16, 3, 0.5, "noam_to_zero", total)  # noqa: E731
    assert [m["train/lr"] for m in seen] == [rate(total // 2 - 1), rate(total - 1)]
    assert seen[-1]["train/lr"] == pytest.approx(noam(total - 1, 16, 3, 0.5) / total, rel=1e-12)
    assert seen[-1]["train/lr"] > 0
    assert [p.step for p in reads] == [3, 4, 6, 8]  # log_every 3 and each epoch's last step
    assert [p.metrics["train/lr"] for p in reads] == [rate(p.step - 1) for p in reads]


def test_fused_replicates_report_the_same_train_lr(tiny_run, tmp_path):
    """Seeds trained as one fused model (`a2core.fused`) report each epoch's `train/lr` as a run alone does."""
    seen = {s: [] for s in (0, 1)}
    cfgs = [tiny_run.replace({"train.seed": s}) for s in seen]
    train_replicates(cfgs, [lambda m, d, s=s: seen[s].append(m) for s in seen],
                     output_dirs=[tmp_path / str(s) for s in seen])
    rate = lambda s: learning_rate(s, 16, 3, 0.5, "noam_to_zero", 8)  # noqa: E731
    for s in seen:
        assert [(m["step"], m["train/lr"]) for m in seen[s]] == [(4, rate(3)), (8, rate(7))]

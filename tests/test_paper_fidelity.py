"""The code against the paper's text (AAAI-22, `paper/a2_transformer_aaai22.txt`), on tiny tensors whose expected
values are worked out by hand from the paper's equations: Eq. 3 (mean over heads, padding), Eq. 4 (sign, lambda,
the penalty over real regions), Eq. 5-10 (each fusion, no renormalisation), Eq. 8's step, the paper's defaults,
and every number of dashboards/paper_results.py against the table lines as the paper prints them."""
import math
import re
from pathlib import Path

import pytest
import torch

from a2core.config import Config, ModelConfig, TrainConfig
from a2core.model.a2 import A2CrossAttention, build_model
from a2core.train import Updates, caption_loss
from dashboards import paper_results

pytestmark = [pytest.mark.outside_ray_group, pytest.mark.usefixtures("one_torch_thread")]

# -- the paper's tables, lines copied as printed ---------------------------------------------------------------------
TABLE1_LINES = """\
LSTM-A (Yao et al. 2017) 75.4 35.2 26.9 55.8 108.8 20.0 78.6 35.5 27.3 56.8 118.3 20.8
Up-Down (Anderson et al. 2018) 77.2 36.2 27.0 56.4 113.5 20.3 79.8 36.3 27.7 56.9 120.1 21.4
GCN-LSTM (Yao et al. 2018) 77.3 36.8 27.9 57.0 116.3 20.9 80.5 38.2 28.5 58.3 127.6 22.0
AoANet (Huang et al. 2019) 77.4 37.2 28.4 57.5 119.8 21.3 80.2 38.9 29.2 58.8 129.8 22.4
M2-T (Cornia et al. 2020) - - - - - - 80.8 39.1 29.2 58.6 131.2 22.6
DPA (Liu et al. 2020) - - - - - - - 40.5 29.6 59.2 133.4 23.3
GET (Ji et al. 2021) - - - - - - 81.5 39.5 29.3 58.9 131.6 22.8
A2 Transformer 78.6 38.2 29.2 58.3 125.0 22.1 81.5 39.8 29.6 59.1 133.9 23.0"""
TABLE2_LINES = """\
Up-Down 80.2 95.2 64.1 88.8 49.1 79.4 36.9 68.5 27.6 36.7 57.1 72.4 117.9 120.5
AoANet 81.0 95.0 65.8 89.6 51.4 81.3 39.4 71.2 29.1 38.5 58.9 74.5 126.9 129.6
M2-T 81.6 96.0 66.4 90.8 51.8 82.7 39.7 72.8 29.4 39.0 59.2 74.8 129.3 132.1
GET 81.6 96.1 66.5 90.9 51.9 82.8 39.7 72.9 29.4 38.8 59.1 74.4 130.3 132.5
A2 Transformer 82.2 96.4 67.0 91.5 52.4 83.6 40.2 73.8 29.7 39.3 59.5 75.0 132.4 134.7"""
TABLE3_LINES = """\
Baseline 77.4 37.2 28.7 57.7 120.0 21.8
Max Pooling 77.9 37.7 29.0 58.0 122.8 21.9
Moving Average 77.9 37.6 29.0 57.9 122.3 21.9
Exponential Decay 78.4 37.9 29.0 58.2 124.2 22.0
Gate Mechanism 78.6 38.2 29.2 58.3 125.0 22.1"""
PAPER_TEXT = [Path(__file__).resolve().parents[1] / "paper" / "a2_transformer_aaai22.txt",
              Path("/work/shared/paper/a2_transformer_aaai22.txt")]


def parse(lines: str) -> dict[str, list]:
    """{row name (up to the citation): numbers, None for '-'}"""
    out = {}
    for line in lines.splitlines():
        name = re.split(r" \(| (?=[\d-])", line, maxsplit=1)[0]
        cells = re.findall(r"(?<![\w.(])(-|\d+\.\d)(?![\w.])", line[len(name):].split(")")[-1])
        out[name] = [None if c == "-" else float(c) for c in cells]
    return out


def test_the_copied_table_lines_are_the_papers_when_its_text_is_here():
    text = next((p.read_text() for p in PAPER_TEXT if p.is_file()), None)
    if text is None:
        pytest.skip("the paper's text is not on this machine")
    for lines in (TABLE1_LINES, TABLE2_LINES, TABLE3_LINES):
        for line in lines.splitlines():
            assert line in text.splitlines(), line


def test_every_number_of_paper_results_is_the_papers():
    t1, t2, t3 = parse(TABLE1_LINES), parse(TABLE2_LINES), parse(TABLE3_LINES)
    assert set(t1) == set(paper_results.TABLE1["rows"]) and set(t2) == set(paper_results.TABLE2["rows"])
    for name, cells in t1.items():
        row = paper_results.TABLE1["rows"][name]
        assert [row["xe"][c] for c in paper_results.T1_COLUMNS] == cells[:6], name
        assert [row["scst"][c] for c in paper_results.T1_COLUMNS] == cells[6:], name
    for name, cells in t2.items():  # each metric's c5 then its c40
        row = paper_results.TABLE2["rows"][name]
        assert [v for c in paper_results.T2_COLUMNS for v in (row["c5"][c], row["c40"][c])] == cells, name
    assert list(t3) == list(paper_results.TABLE3["rows"])
    for name, cells in t3.items():
        assert [paper_results.TABLE3["rows"][name][c] for c in paper_results.T1_COLUMNS] == cells, name
    assert paper_results.TABLE3_ROW == {"none": "Baseline", "max": "Max Pooling", "moving_average": "Moving Average",
                                        "exp_decay": "Exponential Decay", "gate": "Gate Mechanism"}
    # metrics (Table 1: B-1 B-4 M R C S; Table 2 has no SPICE), splits, the x100 scale, the A2 rows' variant
    assert paper_results.T1_COLUMNS == ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "SPICE")
    assert paper_results.T2_COLUMNS == ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")
    assert (paper_results.TABLE1["split"], paper_results.TABLE2["split"], paper_results.TABLE3["split"]) == (
        "karpathy-test", "test2014", "karpathy-val")
    assert paper_results.TABLE1["rows"]["A2 Transformer"]["scst"]["CIDEr"] == 133.9  # 1.339 x100
    rows = paper_results.paper_rows("gate", "scst")
    assert rows["table1"]["metrics"]["CIDEr"] == 133.9 and rows["table2"]["ensemble"] == 4
    assert rows["table2"]["c40"]["CIDEr"] == 134.7 and rows["table3"]["metrics"]["CIDEr"] == 125.0
    assert paper_results.paper_rows("max", "xe")["table1"] is None  # Table 1 has the gate's A2 row only


# -- defaults the paper states ---------------------------------------------------------------------------------------
def test_the_papers_stated_numbers_are_the_defaults():
    m, t = ModelConfig(), TrainConfig()
    assert m.mask_lambda == 0.035  # Sec. 5.3, Fig. 4
    assert m.eta == 0.1  # "eta = 0.1 in Equation 7 in all experiments"
    assert (m.d_model, m.heads, m.layers, m.dropout, m.feature_dim) == (512, 8, 6, 0.1, 2048)
    assert m.fusion == "gate" and m.renormalize is False and m.temperature is None  # no T_P in the paper
    assert (t.batch_size, t.beam_size, t.scst_lr, t.label_smoothing) == (50, 5, 5e-6, 0.0)
    assert t.warmup == 10000  # the paper prints "10,00"; M2's 10,000 (config.py says so)


# -- Eq. 3 and Eq. 4's penalty, by hand ------------------------------------------------------------------------------
def two_head_layer(fusion="gate", **kw) -> A2CrossAttention:
    """d = 4, two heads of Dh = 2, query projection the identity: the query of a state x is x itself."""
    cfg = ModelConfig(d_model=4, layers=1, heads=2, d_ff=8, dropout=0.0, feature_dim=4, max_regions=3,
                      fusion=fusion, **kw)
    layer = A2CrossAttention(cfg).eval()
    with torch.no_grad():
        layer.q.weight.copy_(torch.eye(4))
        layer.q.bias.zero_()
    return layer


# Three region slots, the last padded. Head 0 scores [ln 2, 0, .]: a = [2/3, 1/3, 0]; head 1 [0, ln 3, .]:
# a = [1/4, 3/4, 0]. Mean over heads: [11/24, 13/24, 0].
S2 = math.sqrt(2.0)
X = torch.tensor([[[math.log(2) * S2, 0.0, 0.0, math.log(3) * S2]]])  # (N=1, T=1, d=4)
KEYS = torch.tensor([[[[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]], [[0.0, 0.0], [0.0, 1.0], [5.0, 5.0]]]])  # (1, H, R, Dh)
REGIONS = torch.tensor([[True, True, False]])
A_BY_HAND = [[2 / 3, 1 / 3, 0.0], [1 / 4, 3 / 4, 0.0]]
M_FIXED = torch.tensor([[[[0.5, 1.0, 0.2]], [[0.0, 0.5, 0.9]]]])  # (1, H, T=1, R)


def run_layer(layer, mode, **kw):
    mem = {"k": KEYS, "v": torch.randn(1, 2, 3, 2)}
    layer.mask = lambda x, mem: M_FIXED  # Eq. 2's output fixed: what follows is checked by hand
    layer.record = True
    _, penalty = layer(X, mem, REGIONS, mode=mode, **kw)
    return layer.last, penalty


def test_eq3_mean_over_heads_and_the_penalty_over_real_regions_by_hand():
    rec, penalty = run_layer(two_head_layer(), "perturbed", word_mask=torch.tensor([[True]]))
    assert torch.allclose(rec["attention"][0, :, 0], torch.tensor(A_BY_HAND), atol=1e-6)
    # a_p = m a + (1 - m) mean_heads(a): head 0 [.5*2/3 + .5*11/24, 1/3, 0], head 1 [11/24, .5*3/4 + .5*13/24, 0]
    expected = [[27 / 48, 16 / 48, 0.0], [22 / 48, 31 / 48, 0.0]]
    assert torch.allclose(rec["aligned"][0, :, 0], torch.tensor(expected), atol=1e-6)
    assert rec["aligned"][0, :, 0].sum(-1).tolist() == pytest.approx([43 / 48, 53 / 48])  # not renormalised
    # ||1 - m||^2 over the two real regions (the padded one's (1 - 0.2)^2 and (1 - 0.9)^2 left out), over 2 heads:
    # ((0.5^2 + 0) + (1 + 0.5^2)) / 2
    assert float(penalty) == pytest.approx(0.75)


# -- Eq. 5-10, by hand, through the layer -----------------------------------------------------------------------------
def by_hand(fusion: str, step: float = 0.0) -> list[list[float]]:
    out = []
    for a_row, m_row in zip(A_BY_HAND, M_FIXED[0, :, 0].tolist()):
        a_m = [a * math.exp(1 - m) for a, m in zip(a_row, m_row)]  # Eq. 5
        if fusion == "max":  # Eq. 6
            out.append([max(a, b) for a, b in zip(a_row, a_m)])
        elif fusion == "moving_average":  # Eq. 7, eta = 0.1 on the mask-based weights
            out.append([a + 0.1 * b for a, b in zip(a_row, a_m)])
        elif fusion == "exp_decay":  # Eq. 8, T_P = 100
            keep = math.exp(-step / 100.0)
            out.append([keep * a + (1 - keep) * b for a, b in zip(a_row, a_m)])
        else:  # Eq. 9-10, W_g = 0 and b_g = 0 at the start: g = 0.5
            out.append([0.5 * a + 0.5 * b for a, b in zip(a_row, a_m)])
    return out


@pytest.mark.parametrize("fusion", ["max", "moving_average", "exp_decay", "gate"])
def test_each_fusion_by_hand_unrenormalised_with_padding_left_at_zero(fusion):
    kw = {"temperature": 100.0} if fusion == "exp_decay" else {}
    rec, penalty = run_layer(two_head_layer(fusion, **kw), "aligned", step=50.0)
    assert penalty is None
    expected = torch.tensor(by_hand(fusion, step=50.0))
    assert torch.allclose(rec["aligned"][0, :, 0], expected, atol=1e-6)
    assert torch.allclose(rec["aligned"][0, :, 0].sum(-1), expected.sum(-1), atol=1e-6)  # sums as Eq. 6-9 give
    assert float(rec["aligned"][0, :, 0, 2].abs().max()) == 0.0


def test_gate_is_per_head_and_step_from_the_query():
    layer = two_head_layer("gate")
    with torch.no_grad():
        layer.gate_w.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
        layer.gate_b.copy_(torch.tensor([0.0, 0.5]))
    rec, _ = run_layer(layer, "aligned")
    g = [1 / (1 + math.exp(-math.log(2) * S2)), 1 / (1 + math.exp(-(-math.log(3) * S2 + 0.5)))]  # sigmoid(w.q + b)
    a_m = [[a * math.exp(1 - m) for a, m in zip(ar, mr)] for ar, mr in zip(A_BY_HAND, M_FIXED[0, :, 0].tolist())]
    expected = [[gh * a + (1 - gh) * b for a, b in zip(ar, br)] for gh, ar, br in zip(g, A_BY_HAND, a_m)]
    assert torch.allclose(rec["aligned"][0, :, 0], torch.tensor(expected), atol=1e-6)


def test_exp_decay_reads_the_models_global_step_from_plain_to_mask_based():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, layers=2, heads=2, d_ff=32, dropout=0.0, feature_dim=8, max_regions=4,
                      fusion="exp_decay", temperature=100.0)
    model = build_model(cfg, vocab_size=12).eval()
    model.record_attention()
    feats, regions, tokens = torch.randn(1, 4, 8), torch.ones(1, 4, dtype=torch.bool), torch.tensor([[1, 5, 6]])
    for s in (0, 100, 1e6):
        model.train_step.fill_(s)
        with torch.no_grad():
            model(feats, regions, tokens)
        keep = math.exp(-s / 100.0)
        for rec in model.recorded_attention():
            a, m = rec["attention"], rec["mask"]
            assert torch.allclose(rec["aligned"], keep * a + (1 - keep) * a * torch.exp(1 - m), atol=1e-6)
        if s == 0:  # the start of training: the plain attention exactly
            assert all(torch.equal(r["aligned"], r["attention"]) for r in model.recorded_attention())


# -- Eq. 4 as trained: its value and which way the mask step goes ----------------------------------------------------
V = 12


def config(lam=0.035, mask_lr=1e-2):
    return Config.from_dict({
        "model": {"d_model": 16, "layers": 2, "heads": 2, "d_ff": 32, "dropout": 0.0, "feature_dim": 8,
                  "max_regions": 4, "fusion": "gate", "lambda": lam},
        "train": {"warmup": 10, "mask_lr": mask_lr, "grad_clip": 0.0}})


def batch():
    g = torch.Generator().manual_seed(0)
    feats, regions = torch.randn(2, 4, 8, generator=g), torch.tensor([[True] * 4, [True, True, False, False]])
    caps = torch.randint(4, V, (2, 5, 6), generator=g)
    caps[..., 0], caps[..., -1] = 1, 2
    caps[1, :, 4:] = 0  # the second image's captions are shorter: padding
    return feats * regions[..., None], regions, caps


def test_eq4_value_by_hand_on_a_model_of_known_loss_and_mask():
    """Zero word embeddings (tied to the output layer): uniform words, L_IC = ln V at every word. Zero mask weights
    and bias b: m = sigmoid(b) everywhere, so P (per real word, summed over its image's real regions, mean over heads
    and layers) is (1 - sigmoid(b))^2 times the mean real-region count per real word."""
    cfg = config()
    model = build_model(cfg.model, V).double()
    with torch.no_grad():
        model.embed.weight.zero_()
        for layer in model.decoder:
            for p in layer.cross.mask_parameters():
                p.zero_()
            layer.cross.mask_bias.fill_(0.5)
    feats, regions, caps = batch()
    updates = Updates(model, cfg, torch.device("cpu"))
    out = updates.mask_step(model.encode(feats.double(), regions).detach(), regions, caps, step=0)
    words = (caps[..., 1:] != 0).sum(dim=(1, 2)).double()  # real target words per image: 25, 15
    per_word_regions = float((words * regions.sum(1)).sum() / words.sum())  # (25 * 4 + 15 * 2) / 40
    expected = -math.log(V) + 0.035 * (1 - 1 / (1 + math.exp(-0.5))) ** 2 * per_word_regions
    assert float(out["train/mask_loss"]) == pytest.approx(expected, abs=1e-9)
    # the penalty only: the mask step pushes m towards 1 (the regulariser keeps perturbation small)
    assert all(float(layer.cross.mask_bias.detach().min()) > 0.5 for layer in model.decoder)


def test_the_mask_step_raises_the_perturbed_caption_loss_it_is_trained_against():
    """lambda tiny: Eq. 4 is -L_IC(a_p); one small Adam step of the mask network (a sign step, a descent direction
    of its loss) raises the captioner's loss under the perturbed attention, and leaves the captioner's weights."""
    torch.manual_seed(0)
    cfg = config(lam=1e-9, mask_lr=1e-4)
    model = build_model(cfg.model, V).double()
    feats, regions, caps = batch()
    feats = feats.double()
    tokens = caps.reshape(-1, caps.shape[-1])

    def perturbed_loss():
        with torch.no_grad():
            logits, _ = model(feats, regions, tokens[:, :-1], mode="perturbed", word_mask=tokens[:, 1:] != 0)
        return float(caption_loss(logits, tokens[:, 1:]))

    before, captioner = perturbed_loss(), [p.detach().clone() for p in model.captioner_parameters()]
    updates = Updates(model, cfg, torch.device("cpu"))
    updates.mask_step(model.encode(feats, regions).detach(), regions, caps, step=0)
    assert perturbed_loss() > before
    assert all(torch.equal(p, q) for p, q in zip(model.captioner_parameters(), captioner))

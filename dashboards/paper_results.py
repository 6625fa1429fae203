"""The A2 Transformer paper's result tables (AAAI-22, `paper/a2_transformer_aaai22.txt`) as data: x100 as printed
(CIDEr 125.0 = pycocoevalcap's 1.250), `None` for a "-" in the paper, `a2core.metrics.coco_scores`' metric names.

- Table 1: offline Karpathy test split, cross-entropy training (`xe`) and CIDEr optimisation (`scst`). The
  "A2 Transformer" row is the gate-mechanism variant (the paper's best, also the one it submits).
- Table 2: the online COCO test server (c5 / c40 references); the A2 row is an average ensemble of four
  independently trained checkpoints of the gate variant.
- Table 3: the fusion ablation, cross-entropy training, on the validation set.
"""
from __future__ import annotations

PAPER = "Attention-Aligned Transformer for Image Captioning (AAAI-22)"
_T1_COLUMNS = ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "SPICE")


def _row(values, columns=_T1_COLUMNS) -> dict:
    return dict(zip(columns, values))


# Table 1: "Performance of A2 Transformer and other state-of-the-art image captioning models with different
# evaluation metrics on the MS COCO Karpathy test set." (B-1 B-4 M R C S; cross-entropy | CIDEr optimisation)
TABLE1 = {
    "title": "Table 1: MS COCO Karpathy test split (offline)",
    "split": "karpathy-test",
    "columns": list(_T1_COLUMNS),
    "rows": {
        "LSTM-A": {"xe": _row((75.4, 35.2, 26.9, 55.8, 108.8, 20.0)),
                   "scst": _row((78.6, 35.5, 27.3, 56.8, 118.3, 20.8))},
        "Up-Down": {"xe": _row((77.2, 36.2, 27.0, 56.4, 113.5, 20.3)),
                    "scst": _row((79.8, 36.3, 27.7, 56.9, 120.1, 21.4))},
        "GCN-LSTM": {"xe": _row((77.3, 36.8, 27.9, 57.0, 116.3, 20.9)),
                     "scst": _row((80.5, 38.2, 28.5, 58.3, 127.6, 22.0))},
        "AoANet": {"xe": _row((77.4, 37.2, 28.4, 57.5, 119.8, 21.3)),
                   "scst": _row((80.2, 38.9, 29.2, 58.8, 129.8, 22.4))},
        "M2-T": {"xe": _row((None,) * 6), "scst": _row((80.8, 39.1, 29.2, 58.6, 131.2, 22.6))},
        "DPA": {"xe": _row((None,) * 6), "scst": _row((None, 40.5, 29.6, 59.2, 133.4, 23.3))},
        "GET": {"xe": _row((None,) * 6), "scst": _row((81.5, 39.5, 29.3, 58.9, 131.6, 22.8))},
        "A2 Transformer": {"xe": _row((78.6, 38.2, 29.2, 58.3, 125.0, 22.1)),
                           "scst": _row((81.5, 39.8, 29.6, 59.1, 133.9, 23.0)), "fusion": "gate"},
    },
}

_T2_COLUMNS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")


def _c5_c40(values) -> dict:
    return {"c5": dict(zip(_T2_COLUMNS, values[0::2])), "c40": dict(zip(_T2_COLUMNS, values[1::2]))}


# Table 2: "Leaderboard of different image captioning models on the online MS COCO test server."
TABLE2 = {
    "title": "Table 2: online MS COCO test server (c5 / c40)",
    "split": "test2014",
    "columns": list(_T2_COLUMNS),
    "rows": {
        "Up-Down": _c5_c40((80.2, 95.2, 64.1, 88.8, 49.1, 79.4, 36.9, 68.5, 27.6, 36.7, 57.1, 72.4, 117.9, 120.5)),
        "AoANet": _c5_c40((81.0, 95.0, 65.8, 89.6, 51.4, 81.3, 39.4, 71.2, 29.1, 38.5, 58.9, 74.5, 126.9, 129.6)),
        "M2-T": _c5_c40((81.6, 96.0, 66.4, 90.8, 51.8, 82.7, 39.7, 72.8, 29.4, 39.0, 59.2, 74.8, 129.3, 132.1)),
        "GET": _c5_c40((81.6, 96.1, 66.5, 90.9, 51.9, 82.8, 39.7, 72.9, 29.4, 38.8, 59.1, 74.4, 130.3, 132.5)),
        "A2 Transformer": {**_c5_c40((82.2, 96.4, 67.0, 91.5, 52.4, 83.6, 40.2, 73.8, 29.7, 39.3, 59.5, 75.0,
                                      132.4, 134.7)), "fusion": "gate", "ensemble": 4},
    },
}

# Table 3: "Effect of fusion methods for combined attention weights optimized with cross-entropy loss on
# validation set." (B-1 B-4 M R C S)
TABLE3 = {
    "title": "Table 3: fusion ablation (cross-entropy, validation set)",
    "split": "karpathy-val",
    "columns": list(_T1_COLUMNS),
    "rows": {
        "Baseline": _row((77.4, 37.2, 28.7, 57.7, 120.0, 21.8)),
        "Max Pooling": _row((77.9, 37.7, 29.0, 58.0, 122.8, 21.9)),
        "Moving Average": _row((77.9, 37.6, 29.0, 57.9, 122.3, 21.9)),
        "Exponential Decay": _row((78.4, 37.9, 29.0, 58.2, 124.2, 22.0)),
        "Gate Mechanism": _row((78.6, 38.2, 29.2, 58.3, 125.0, 22.1)),
    },
}

# model.fusion -> the row of Table 3; Tables 1 and 2 mark their A2 row with its fusion.
TABLE3_ROW = {"none": "Baseline", "max": "Max Pooling", "moving_average": "Moving Average",
              "exp_decay": "Exponential Decay", "gate": "Gate Mechanism"}


def _a2_row(table: dict, fusion: str) -> str | None:
    return next((name for name, row in table["rows"].items() if row.get("fusion") == fusion), None)


def table1_row(fusion: str, stage: str | None = None) -> dict | None:
    """Table 1's row of the A2 variant with this fusion (only gate has one), both stages or one (xe|scst)."""
    name = _a2_row(TABLE1, fusion)
    if name is None:
        return None
    row = TABLE1["rows"][name]
    out = {"table": "1", "row": name, "split": TABLE1["split"], "fusion": fusion}
    if stage is None:
        return {**out, "xe": dict(row["xe"]), "scst": dict(row["scst"])}
    if stage not in ("xe", "scst"):
        raise ValueError(f"stage must be 'xe' or 'scst', got {stage!r}")
    return {**out, "stage": stage, "metrics": dict(row[stage])}


def paper_rows(fusion: str, stage: str | None = None) -> dict:
    """Everything the paper reports for a fusion: {"paper", "table1", "table2", "table3"} (None where absent);
    `stage` (xe|scst) picks Table 1's column group that matches how the checkpoints were trained."""
    table2 = table3 = None
    if name := _a2_row(TABLE2, fusion):
        row = TABLE2["rows"][name]
        table2 = {"table": "2", "row": name, "split": TABLE2["split"], "fusion": fusion, "ensemble": row["ensemble"],
                  "c5": dict(row["c5"]), "c40": dict(row["c40"])}
    if name := TABLE3_ROW.get(fusion):
        table3 = {"table": "3", "row": name, "split": TABLE3["split"], "fusion": fusion, "stage": "xe",
                  "metrics": dict(TABLE3["rows"][name])}
    return {"paper": PAPER, "fusion": fusion, "table1": table1_row(fusion, stage), "table2": table2,
            "table3": table3}

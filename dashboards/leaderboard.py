"""`leaderboard.json` of a packaged study (`build_leaderboard` shows its keys; docs/how-to/package.md says what it holds), and
the ensemble as an MLflow model's code (`A2EnsembleModel`, which `launch.model_registry` logs and registers)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch

from a2core.atomic import atomic_write
from a2core.checkpoint import load_ensemble
from a2core.config import Config
from a2core.data.dataset import resolve_paths
from a2core.data.features import FeatureStore
from a2core.decode import EnsembleStepper, MinLengthStepper, caption_images, decode_precision
from a2core.errors import DataError
from a2core.metrics import METRIC_NAMES as METRICS, SCALE, SCALE_NAME
from a2core.precision import autocast
from a2core.metrics import Meteor, caption_scores, coco_scores, ptb_tokenize, spice_available
from a2core.selection import finite
from dashboards import paper_results
from dashboards.stats import Arm, Interval, canonical_config, compare_arms, config_hash  # noqa: F401 - used here, and re-exported
from dashboards.stats import gain_over_members, gain_over_one
from dashboards.tables import text_table
from dashboards.tracking import TAG_TRIAL_ID, git_commit, study_runs

SCHEMA = 1
SHORT = {"BLEU-1": "B-1", "BLEU-2": "B-2", "BLEU-3": "B-3", "BLEU-4": "B-4", "METEOR": "M", "ROUGE-L": "R",
         "CIDEr": "C", "SPICE": "S"}


def ordered(scores: Mapping[str, Any]) -> dict[str, float]:
    """coco_scores' metrics (already x100) in METRICS order, rounded."""
    return {k: round(float(scores[k]), 4) for k in METRICS if scores.get(k) is not None}


def score_systems(references: Mapping[int, Sequence[str]], systems: Mapping[str, Mapping[int, str]],
                  spice: bool | None = None) -> tuple[dict[str, dict[str, float]], dict[str, dict[int, float]]]:
    """COCO metrics (x100) of several systems' captions of the same images, and each system's per-image CIDEr-D
    ({name: {image_id: CIDEr}}): `a2core.metrics.coco_scores`' numbers with one PTB tokenizer run and one METEOR
    process for all systems (two Java processes per system would dominate the time); with SPICE, `coco_scores`."""
    ids = list(references)
    for name, caps in systems.items():
        lost, extra = [k for k in ids if k not in caps], [k for k in caps if k not in references]
        if lost or extra:
            raise DataError(f"{name}: captions of {len(caps)} images for {len(ids)} references "
                            f"(missing {lost[:5]}, not in the references {extra[:5]})")
    if spice is None and not (spice := spice_available()):
        print("leaderboard: SPICE not available (Stanford CoreNLP models missing); reported without it",
              file=sys.stderr, flush=True)
    if spice:
        results = {name: coco_scores(references, caps, spice=True, per_image=True, progress=False)
                   for name, caps in systems.items()}
    else:  # coco_scores' steps: PTB tokenization, then BLEU, ROUGE-L, CIDEr-D and METEOR on the tokens
        # references and systems in separate key spaces: a system named "gts" must not overwrite the references
        raw = {("references", k): list(references[k]) for k in ids}
        raw.update({("system", name, k): [caps[k]] for name, caps in systems.items() for k in ids})
        tokens = ptb_tokenize(raw)
        gts = {k: tokens[("references", k)] for k in ids}
        results = {}
        with Meteor() as meteor:
            for name in systems:
                res = {k: tokens[("system", name, k)] for k in ids}
                results[name] = caption_scores(gts, {k: res[k][0] for k in ids}, per_image=True)
                results[name]["METEOR"] = meteor.compute_score(gts, res)[0] * SCALE
    per_image = {name: {k: float(v["CIDEr"]) for k, v in r["per_image"].items()} for name, r in results.items()}
    return {name: ordered(r) for name, r in results.items()}, per_image


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _gain_record(diff) -> dict:
    return {"delta": _round(diff.delta), "low": _round(diff.low), "high": _round(diff.high), "images": diff.images,
            "seeds": diff.seeds_b, "verdict": diff.verdict()}


def ensemble_gain(ensemble: Mapping[str, float], members: Mapping[str, Mapping[str, float]],
                  per_image: Mapping[str, Mapping[int, float]] | None = None,
                  chosen: str | None = None) -> dict[str, dict | None]:
    """The ensemble's test CIDEr gain over the mean of its members (`over_members`) and over the member chosen on
    validation (`over_chosen`, `chosen`: its name; None when no member has a validation score), each with a 95%
    interval that holds the members' seed spread (`dashboards.stats.gain_over_members` / `gain_over_one`: with
    per-image CIDEr-D of every system on the same test images also the images' term). Never against the
    member that scored best on the test images themselves: that choice would be made on the numbers it is judged
    by. A member whose CIDEr is not a finite number is left out, as the seed mean leaves it out."""
    names = [name for name in members if finite(members[name].get("CIDEr")) is not None]  # NaN: as the seed mean
    if not names:  # no member scored: no gain to measure (it was a "+nan CIDEr" verdict over "0 member seeds")
        return {"over_members": None, "over_chosen": None}
    per_image = per_image or {}
    ids = sorted(per_image.get("ensemble") or {})
    paired = bool(ids) and all(sorted(per_image.get(n) or {}) == ids for n in names)
    if paired:
        system = np.asarray([per_image["ensemble"][i] for i in ids])
        rows = np.asarray([[per_image[n][i] for i in ids] for n in names])  # (members, images)
    else:
        system, rows = float(ensemble["CIDEr"]), np.asarray([members[n]["CIDEr"] for n in names])
    over = gain_over_members(system, rows, ("ensemble", "its members' mean"))
    out: dict[str, dict | None] = {"over_members": _gain_record(over), "over_chosen": None}
    if chosen in names:
        one = gain_over_one(system, rows, names.index(chosen), ("ensemble", f"{chosen} (chosen on validation)"))
        out["over_chosen"] = {"member": chosen, "member_CIDEr": members[chosen].get("CIDEr"), **_gain_record(one)}
    return out


def _member_name(member: Mapping) -> str:
    """"seed-3"; a member whose seed is unknown (None: its config has no `train.seed`) "seed-? (trial t7)", shown as
    unknown, as the board shows any missing value, and still its own row."""
    seed = member["seed"]
    return f"seed-? (trial {member['trial_id']})" if seed is None else f"seed-{seed}"


def _member_order(member: Mapping) -> tuple:
    """Members by seed, numbers in numeric order, then seeds of other kinds as text, then unknown seeds; of equal
    seeds by trial id (a sort on the raw seeds raised TypeError for None, or a text seed beside a number)."""
    seed = member["seed"]
    number = seed if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None
    kind = 0 if number is not None else 1 if seed is not None else 2
    return kind, number if number is not None else 0, "" if seed is None else str(seed), str(member["trial_id"])


def build_leaderboard(*, study: str, config: Mapping, members: list[dict], ensemble_metrics: Mapping[str, float],
                      images: int, beam_size: int = 5, max_len: int = 20, selected_by: Mapping | None = None,
                      extra: Mapping | None = None, per_image: Mapping[str, Mapping[int, float]] | None = None) -> dict:
    """The leaderboard dict. `members`: one dict per seed checkpoint with `seed`, `trial_id`, `study`, `checkpoint`,
    `metrics` and optionally `mlflow_run_id`, `value` (its study metric); a seed may be None (unknown: shown as
    "seed-? (trial ID)", null in the JSON); `metrics`, `ensemble_metrics` and `per_image` (CIDEr-D of each entry's
    name, "seed-<s>", and "ensemble") as `score_systems` gives them, on the held-out test split
    (Karpathy test on COCO, the synthetic set's test split on synthetic data: `evaluation.split`). The study
    metric chose the configuration and each checkpoint on val (`evaluation.selection`), never on these images."""
    cfg, digest, selected_by = canonical_config(config), config_hash(config), dict(selected_by or {})
    fusion = cfg.get("model", {}).get("fusion")
    stage = "scst" if int(cfg.get("train", {}).get("scst_epochs") or 0) > 0 else "xe"
    seeds = [{"name": _member_name(m), "kind": "checkpoint", "seed": m["seed"], "study": m.get("study", study),
              "trial_id": m["trial_id"], "mlflow_run_id": m.get("mlflow_run_id"), "checkpoint": m["checkpoint"],
              "config_hash": digest, "study_metric": m.get("value"), "metrics": dict(m["metrics"])}
             for m in sorted(members, key=_member_order)]
    # entries are keyed by name (the gains' members, `per_image`): two members of one name would count as one
    if twice := sorted({e["name"] for e in seeds if [x["name"] for x in seeds].count(e["name"]) > 1}):
        raise DataError(f"leaderboard of {study}: members named {', '.join(twice)} more than once (trials "
                        f"{', '.join(str(e['trial_id']) for e in seeds if e['name'] in twice)}): one member per seed")
    metrics = [k for k in METRICS if k in ensemble_metrics]
    ((_, intervals),) = compare_arms([Arm("seeds", [e["metrics"] for e in seeds])], metrics=metrics).rows
    ensemble = {"name": "ensemble", "kind": "ensemble", "seeds": [e["seed"] for e in seeds],
                "studies": sorted({e["study"] for e in seeds}), "trial_ids": [e["trial_id"] for e in seeds],
                "mlflow_run_ids": [e["mlflow_run_id"] for e in seeds],
                "checkpoints": [e["checkpoint"] for e in seeds], "config_hash": digest,
                "metrics": dict(ensemble_metrics)}
    cider = ensemble_metrics.get("CIDEr")
    valued = [e for e in seeds if finite(e["study_metric"]) is not None]
    sign = -1 if selected_by.get("mode") == "min" else 1
    # the member chosen on validation: the best study metric; of equals, the trial packaging selected
    # (`selected_by.trial_id`, and `selected_by.study` when named), else the lower (study, trial id), the one rule's
    # order (`dashboards.stats.trial_rank`) and the tie rule packaging names (`selected_by.tie_break`)
    top = max((sign * finite(e["study_metric"]) for e in valued), default=None)

    def unselected(e) -> bool:
        return (str(e["trial_id"]) != str(selected_by.get("trial_id"))
                or ("study" in selected_by and str(e["study"]) != str(selected_by["study"])))

    tied = sorted((e for e in valued if sign * finite(e["study_metric"]) == top),
                  key=lambda e: (unselected(e), str(e["study"]), str(e["trial_id"])))
    chosen = tied[0]["name"] if tied else None
    gain = (ensemble_gain(ensemble_metrics, {e["name"]: e["metrics"] for e in seeds}, per_image, chosen)
            if seeds and finite(cider) is not None else {"over_members": None, "over_chosen": None})
    split = "synthetic-test" if cfg.get("data", {}).get("kind") == "synthetic" else "karpathy-test"
    board = {
        "schema": SCHEMA,
        "study": study,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "evaluation": {"split": split, "images": int(images), "beam_size": int(beam_size),
                       "max_len": int(max_len), "scale": SCALE_NAME, "metrics": metrics,
                       "spice": "SPICE" in ensemble_metrics, "interval": "95%",
                       # what chose the configuration and the checkpoints: the val split, not these images
                       "selection": {"split": "val", "metric": selected_by.get("metric")}},
        "configuration": {"hash": digest, "fusion": fusion, "lambda": cfg.get("model", {}).get("lambda"),
                          "stage": stage, "config": cfg, "selected_by": selected_by},
        "seeds": ensemble["seeds"],
        "entries": [*seeds, ensemble],
        # identical: every seed scored the same, so no interval (the table says so rather than "no interval")
        "seed_mean": {k: {"mean": _round(iv.mean), "low": _round(iv.low), "high": _round(iv.high), "n": iv.n,
                          "identical": iv.identical} for k, iv in intervals.items()},
        "ensemble": {"CIDEr": cider, "gain_over_members": gain["over_members"],
                     "gain_over_chosen": gain["over_chosen"]},
        "paper": paper_results.paper_rows(fusion, stage) if fusion else None,
    }
    return {**board, **(extra or {})}


def _json_safe(value: Any) -> Any:
    """`value` as strict JSON takes it: a float that is not finite (NaN, inf) becomes None (null; Python's `NaN`
    token is not JSON, and browsers, jq and most parsers refuse the whole file), numpy scalars plain numbers."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_leaderboard(path: str | os.PathLike, board: Mapping) -> Path:
    """`board` as strict JSON (a score that is not a finite number is null), written atomically."""
    return atomic_write(path, json.dumps(_json_safe(board), indent=2, default=str, allow_nan=False) + "\n")


def _fmt_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def format_table(board: Mapping) -> str:
    """A text table: each seed, the seed mean with its 95% interval, the ensemble (all on the board's test split),
    the paper's rows for the same fusion (each labelled with its split: Table 1 on Karpathy test, Table 3 on the
    validation set); then the ensemble's gains over its members' mean and over the member chosen on validation."""
    metrics = board["evaluation"]["metrics"]

    def numbers(values: Mapping) -> list[str]:
        return [_fmt_number(finite(values.get(k))) for k in metrics]

    def paper_split(table: Mapping) -> str:  # "karpathy-test" -> "COCO Karpathy test"
        return "COCO " + str(table["split"]).replace("karpathy-", "Karpathy ")

    *seeds, ensemble = board["entries"]
    mean = board.get("seed_mean") or {}
    n = f"{len(ensemble['seeds'])} seeds"
    rows = [[e["name"], str(e["trial_id"]), *numbers(e["metrics"])] for e in seeds]
    # a mean over fewer seeds than the row's count says so, as `a2 study compare`'s cells do (`cell_text`)
    rows.append(["seed mean [95% CI]", n, *(Interval(**mean[k]).text() + (
        f" ({mean[k]['n']} of {len(ensemble['seeds'])} seeds)" if mean[k]["n"] < len(ensemble["seeds"]) else "")
        if k in mean else "-" for k in metrics)])
    rows.append([ensemble["name"], n, *numbers(ensemble["metrics"])])
    paper = board.get("paper") or {}
    if t1 := paper.get("table1"):
        rows.append([f"paper T1 {t1['row']} ({t1['stage']}, {paper_split(t1)})", "", *numbers(t1["metrics"])])
    if t3 := paper.get("table3"):
        rows.append([f"paper T3 {t3['row']} ({paper_split(t3)})", "", *numbers(t3["metrics"])])
    ev, configuration = board["evaluation"], board["configuration"]
    selection = (ev.get("selection") or {}).get("metric") or (configuration.get("selected_by") or {}).get("metric")
    lines = [f"leaderboard of {board['study']} ({configuration['fusion']}, config {configuration['hash'][:12]}): "
             f"every score on the {ev['split']} split, {ev['images']} images, beam {ev['beam_size']}, scores "
             f"{ev['scale']}" + (f"; configuration and checkpoints selected by {selection} on the val split"
                                 if selection else ""),
             text_table(["", "trial", *(f"test {SHORT[k]}" for k in metrics)], rows), *gain_lines(board)]
    return "\n".join(lines)


def gain_lines(board: Mapping) -> list[str]:
    """The ensemble's gains in words: over its members' mean, and over the member chosen on validation."""
    ensemble = board.get("ensemble") or {}
    over = {"gain_over_members": "its members' mean", "gain_over_chosen": "the member chosen on validation"}
    return [f"ensemble gain over {what}: {verdict}" for key, what in over.items()
            if (verdict := (ensemble.get(key) or {}).get("verdict"))]


# -- MLflow --------------------------------------------------------------------------------------------------------
def trial_run_ids(tracking_uri: str, study: str) -> dict[str, str]:
    """{trial_id: MLflow run id} of a study's trial runs ({} when the study has no runs or MLflow is not there)."""
    try:
        _, children = study_runs(tracking_uri, study)
    except Exception as err:  # noqa: BLE001 - provenance is best effort
        print(f"leaderboard: note: no MLflow runs of {study} ({err})", file=sys.stderr)
        return {}
    return {run.data.tags[TAG_TRIAL_ID]: run.info.run_id for run in children if TAG_TRIAL_ID in run.data.tags}


# -- the ensemble as an MLflow model (its code; `launch.model_registry` logs and registers it) ------------------------
class GivenFeatures(FeatureStore):
    """Region features handed to `predict` ({image_id: (n_regions, D) array}), padded as the store pads its own."""

    def __init__(self, given: Mapping[int, Any], feature_dim: int):  # nothing to open: no FeatureStore.__init__
        self.given, self.feature_dim = given, feature_dim

    def get(self, image_id: int):
        """(n, D) float32; a flat list of n*D values is n regions. Any other shape is refused, as the stores refuse
        it: reshaping (D, n) or (n, D/2) into rows gave captions of scrambled regions without a word of warning."""
        try:
            feat = np.asarray(self.given[image_id], dtype=np.float32)
        except (TypeError, ValueError) as err:
            raise DataError(f"features of image id {image_id}: not an array of numbers ({err})") from None
        if feat.ndim == 1 and feat.size % self.feature_dim == 0:
            feat = feat.reshape(-1, self.feature_dim)
        if feat.ndim != 2 or feat.shape[1] != self.feature_dim or feat.shape[0] < 1:
            raise DataError(f"features of image id {image_id}: shape {feat.shape}, expected (n_regions >= 1, "
                            f"{self.feature_dim})")
        if not np.isfinite(feat).all():
            raise DataError(f"features of image id {image_id}: contain NaN or inf")
        return feat


class A2EnsembleModel(mlflow.pyfunc.PythonModel):
    """Averaging ensemble of A2 checkpoints (the model's artifacts): `predict` captions a DataFrame's `image_id`s,
    in input order, from its optional `features` column of (n_regions, feature_dim) arrays, else from the model
    config's `features_path`, else the checkpoints' feature store. Decoding settings: the model config, else these."""
    beam_size, max_len, batch_size = 5, 20, 50

    def load_context(self, context):
        keys = sorted(k for k in context.artifacts if k.startswith("checkpoint_"))  # none: load_ensemble says so
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.models, self.vocab, self.config = load_ensemble([context.artifacts[k] for k in keys], self.device)
        model_config = getattr(context, "model_config", None) or {}
        self.beam_size = int(model_config.get("beam_size", self.beam_size))
        self.max_len = int(model_config.get("max_len", self.max_len))
        self.features_path = model_config.get("features_path")
        self._store = None

    def _feature_store(self) -> FeatureStore:
        if self._store is None:
            path = self.features_path or resolve_paths(Config.from_dict(self.config, saved=True).data).features
            self._store = FeatureStore(path, self.config["model"]["feature_dim"])
        return self._store

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        ids = [int(i) for i in model_input["image_id"]]
        store = (GivenFeatures(dict(zip(ids, model_input["features"])), self.config["model"]["feature_dim"])
                 if "features" in model_input.columns else self._feature_store())
        stepper = MinLengthStepper(EnsembleStepper(self.models), self.vocab.eos)
        # in the first checkpoint's train.precision, as `a2 package` and the run's own test decode
        with autocast(decode_precision(self.config, self.device), torch.device(self.device)):
            caps = caption_images(stepper, self.vocab, list(dict.fromkeys(ids)),
                                  lambda i: store.padded(i, self.config["model"]["max_regions"]),
                                  beam_size=int((params or {}).get("beam_size", self.beam_size)),
                                  max_len=self.max_len, batch_size=self.batch_size, device=self.device)
        return pd.DataFrame({"image_id": ids, "caption": [caps[i] for i in ids]})

"""Where a study opens in the MLflow UI (MLflow 3.17): the experiment's kind, the views listed under its "Views"
menu, and the URL that a2tune prints.

MLflow 3 shows an experiment either as GenAI (overview, traces) or as model training (runs, charts). The experiment
records the kind in the tag `mlflow.experimentKind`; the 3.17 UI itself follows its GenAI / Model training switch,
which the URL sets with `workflowType=machine_learning`. A saved view is an experiment tag
`mlflow.sharedViewState.<id>` holding {"name", "createdAt", "updatedAt", "state": <JSON of the runs page state>};
`.../runs?viewStateShareKey=<id>` opens it and the "Views" menu lists it. A study gets two:

    a2          the trials, best first by the study metric; charts: the metric per epoch, and the parallel
                coordinates of the searched keys against it
    a2-configs  the same trials grouped by the configuration label (tag `a2.config`, e.g. "gate lambda=0.035
                (cca42317e0f5)": the replicate group's searched keys, its `a2.config_hash` beside them): one row
                per configuration, charts of the mean over seeds with its min-max range

Trial runs are named from the keys the study searches and the seed ("gate lambda=0.035 seed=2"), not Tune's trial
names (kept in the tag `a2.ray_trial_name`).

MLflow sorts chart sections by name (`compute` and `time` before `val`); the views list them researcher-first
instead (`section_order`), so no metric is renamed.
"""
from __future__ import annotations

import json
import re
import time
import urllib.parse
from typing import Iterable

TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"  # MLflow's kind for model training (others: genai_development, ...)
WORKFLOW_PARAM = ("workflowType", "machine_learning")  # the UI's Model training switch, as a URL parameter
# MLflow's private UI state (the MLflow adapter: this module alone writes it): the experiment tags the runs page keeps
# its shared views in, as MLflow 3.17's UI reads them. tests/test_adapters.py finds the key in the installed UI
# bundle, and pyproject.toml allows only the MLflow release this was written for.
TESTED_MLFLOW = "3.17"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_TRIALS = "a2"
VIEW_CONFIGS = "a2-configs"
# The replicate group as a person reads it, its hash beside it: "gate lambda=0.035 (cca42317e0f5)"; one label per
# hash (`launch.mlflow_export.trial_names`), so grouping by it groups the replicate groups.
TAG_CONFIG_LABEL = "a2.config"
TRIAL_FILTER = "tags.`a2.role` = 'trial'"  # the study's parent run (no per-epoch metrics) is not a trial

# Chart sections, researcher first: MLflow names a metric's section after all but its last `/` part (`val/CIDEr`
# -> `val`, `diag/kendall/layer0/mask` -> `diag/kendall/layer0`), metrics without `/` go to "Model metrics".
SECTION_TIERS = ("val", "diag", "train", "best")
NO_PREFIX, SYSTEM = "Model metrics", "System metrics"  # MLflow's sections of `name` and of `system/name`
BOOKKEEPING = ("compute", "time", NO_PREFIX, SYSTEM)  # collapsed, last
# Columns of the runs table (those a run lacks stay empty), after the study metric.
KEY_METRICS = ("val/CIDEr", "val/BLEU-4", "val/METEOR", "val/ROUGE-L", "diag/mask_mean", "train/loss")


def chart_section(metric: str) -> str:
    """The chart section MLflow puts `metric` in."""
    prefix = metric.rpartition("/")[0]
    return SYSTEM if prefix == "system" else prefix or NO_PREFIX


def section_order(metric_names: Iterable[str], first: str = "val/CIDEr") -> list[str]:
    """The chart sections of `metric_names`, what a researcher reads first at the top: the section of `first` (the
    study metric), then val, diag, train, best, anything else, and the bookkeeping (compute, time) last."""
    lead = chart_section(first)

    def rank(section: str) -> tuple:
        top = section.split("/")[0]
        if section == lead:
            tier = -1
        elif top in BOOKKEEPING:
            tier = len(SECTION_TIERS) + 1
        else:
            tier = SECTION_TIERS.index(top) if top in SECTION_TIERS else len(SECTION_TIERS)
        natural = tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", section))
        return tier, section.count("/"), natural  # natural: `layer2` before `layer10`

    return sorted({chart_section(m) for m in metric_names} | {lead}, key=rank)


def _section_id(section: str) -> str:
    return "a2-section-" + section.replace("/", "-").replace(" ", "-").lower()


def view_states(metric: str = "val/CIDEr", mode: str = "max", searched_params: Iterable[str] = (),
                metric_names: Iterable[str] = ()) -> dict[str, tuple[str, dict]]:
    """{view id: (name shown in the Views menu, runs page state)} of a study whose trials log `metric_names`,
    searched over the params `searched_params` (flattened config keys such as `model.lambda`; the seed is left out,
    it is what a replicate group averages over)."""
    searched = [p for p in dict.fromkeys(searched_params) if p not in ("train.seed", "seed")]
    names = list(dict.fromkeys([metric, *metric_names]))
    lead = _section_id(chart_section(metric))
    sections = [{"uuid": _section_id(s), "name": s, "display": s.split("/")[0] not in BOOKKEEPING,
                 "isReordered": s == chart_section(metric),  # new charts go after ours
                 "columns": 2 if s == chart_section(metric) else 3}
                for s in section_order(names, first=metric)]
    by_epoch = {"uuid": "a2-metric-by-epoch", "type": "LINE", "metricSectionId": lead, "isGenerated": True,
                "deleted": False, "metricKey": metric, "selectedMetricKeys": [metric], "runsCountToCompare": 10,
                "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear", "range": {},
                "xAxisKey": "step", "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
                "ignoreOutliers": False, "useGlobalXaxisKey": False, "useGlobalLineSmoothing": True}
    charts = [by_epoch]
    if searched:
        charts.append({"uuid": "a2-search-space", "type": "PARALLEL", "metricSectionId": lead, "isGenerated": False,
                       "deleted": False, "runsCountToCompare": 10, "selectedParams": searched,
                       "selectedMetrics": [metric], "showAllRuns": True})
    columns = (["attributes.`Run Name`"] + [f"metrics.`{m}`" for m in dict.fromkeys([metric, *KEY_METRICS])]
               + [f"params.`{p}`" for p in [*searched, "train.seed"]] + [f"tags.`{TAG_CONFIG_LABEL}`"])
    trials = {"orderByKey": f"metrics.`{metric}`", "orderByAsc": mode == "min", "searchFilter": TRIAL_FILTER,
              "selectedColumns": columns, "columnOrder": columns, "compareRunSections": sections, "compareRunCharts": charts,
              "isAccordionReordered": True, "hideEmptyCharts": True, "useGroupedValuesInCharts": True}
    # Grouped runs: MLflow's parallel coordinates cannot aggregate string params (fusion), so that chart stays in
    # the trials view.
    configs = {**trials, "compareRunCharts": [by_epoch], "groupBy": {
        "aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": TAG_CONFIG_LABEL}]}}
    return {VIEW_TRIALS: (f"a2 trials by {metric}", trials),
            VIEW_CONFIGS: ("a2 configurations: mean over seeds", configs)}


def view_tags(states: dict[str, tuple[str, dict]], existing: dict[str, str] | None = None,
              now_ms: int | None = None) -> dict[str, str]:
    """The experiment tags that save `states` as MLflow views (a view keeps its creation time from `existing`)."""
    now = int(time.time() * 1000) if now_ms is None else int(now_ms)
    tags = {}
    for order, (view, (name, state)) in enumerate(states.items()):
        key = VIEW_TAG_PREFIX + view
        created = _envelope(existing or {}, key).get("createdAt")
        created = created if isinstance(created, (int, float)) else now - order  # the menu lists the newest first
        tags[key] = json.dumps({"name": name, "createdAt": created, "updatedAt": now,
                                "state": json.dumps(state, separators=(",", ":"))}, separators=(",", ":"))
    return tags


def _envelope(tags: dict[str, str], key: str) -> dict:
    try:
        value = json.loads(tags.get(key) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) and isinstance(value.get("state"), str) else {}


def saved_sections(tags: dict[str, str]) -> set[str]:
    """The chart sections the saved trials view lists (empty when there is none)."""
    try:
        state = json.loads(_envelope(tags, VIEW_TAG_PREFIX + VIEW_TRIALS).get("state") or "{}")
    except ValueError:
        return set()
    return {s.get("name") for s in state.get("compareRunSections") or [] if isinstance(s, dict) and s.get("name")}


def ui_url(server: str, experiment_id: str, view: str = VIEW_TRIALS, charts: bool = False) -> str:
    """The URL of a study's runs in the MLflow UI at `server` (http://host:port), opened on `view`, as the runs
    table or (`charts`) as the chart view."""
    query = [WORKFLOW_PARAM, ("viewStateShareKey", view)] + ([("compareRunsMode", "CHART")] if charts else [])
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{urllib.parse.urlencode(query)}"

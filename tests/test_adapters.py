"""The two places that lean on private formats, each behind one module (docs/explanation/design.md, "Design notes"):
`launch/verify.py` knows the names of the files Tune writes at an experiment's root (it checks them, keeps whole
copies and puts them back), `dashboards/mlflow_views.py` writes the MLflow UI's saved views. These tests hold each
assumption against the installed release, and the release against what pyproject.toml allows, so that a Ray or
MLflow upgrade fails here, by name, instead of in a study."""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def allowed(distribution: str) -> SpecifierSet:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(rf"{distribution}(\[|[<>=!~ ]|$)", d)]
    return SpecifierSet(re.sub(r"^[A-Za-z0-9_.-]+(\[[^]]*\])?", "", spec))


@pytest.mark.parametrize("distribution, module", [("ray", "launch.verify"), ("mlflow", "dashboards.mlflow_views")])
def test_pyproject_allows_only_the_release_each_adapter_was_written_for(distribution, module):
    import importlib

    tested = getattr(importlib.import_module(module), f"TESTED_{distribution.upper()}")
    spec = allowed(distribution)
    assert Version(version(distribution)) in spec, (distribution, version(distribution), str(spec))
    # every release the range allows is the tested minor release, and the tested one is allowed
    assert Version(f"{tested}.0") in spec and Version(f"{tested}.99") in spec
    major, minor = map(int, tested.split("."))
    assert Version(f"{major}.{minor + 1}.0") not in spec and Version(f"{major}.{minor - 1}.99") not in spec


def test_tunes_state_file_names_are_those_verify_reads():
    from ray.tune.callback import CallbackList
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.impl.tuner_internal import _TUNER_PKL
    from ray.tune.search.search_generator import SearchGenerator
    from ray.tune.search.searcher import Searcher

    from launch.verify import _root_kind

    stamp = "2026-11-27_10-00-00"
    written = {TuneController.CKPT_FILE_TMPL.format(stamp): "json",
               SearchGenerator.CKPT_FILE_TMPL.format(stamp): "pickle",  # a pickle, despite its .json name
               Searcher.CKPT_FILE_TMPL.format(stamp): "pickle",
               CallbackList.CKPT_FILE_TMPL.format(stamp): "pickle",
               _TUNER_PKL: "pickle"}
    assert {name: _root_kind(name) for name in written} == written
    assert _root_kind("study.yaml") is None and _root_kind("summary.json") is None


def test_the_mlflow_ui_reads_the_view_state_tags_mlflow_views_writes():
    import mlflow

    from dashboards.mlflow_views import TAG_EXPERIMENT_KIND, VIEW_TAG_PREFIX

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(errors="replace") for p in bundle.glob("*.js"))
    assert VIEW_TAG_PREFIX in text and TAG_EXPERIMENT_KIND in text

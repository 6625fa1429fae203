"""Sizes and resources are checked before anything starts: `a2 study validate` refuses sizes past their caps
(`launch.spec.SIZE_CAPS`, listed in the study-file reference) and, for a study that runs on this machine, trials
asking more CPUs or GPUs than it has; `run` refuses those before Ray starts and before the study's folder exists;
`a2 train data.images=1000000000` is refused in one line instead of generating for ever."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from a2core.config import ConfigError
from launch.cli import main
from launch.spec import MAX_TRIALS, SIZE_CAPS, load_study, machine_resources

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
# a value twice the cap, with what else it needs to be a valid config (heads divide d_model)
PAST = {"model.heads": ["model.d_model=4096"], "model.d_model": ["model.heads=4"]}


@pytest.mark.parametrize("path", sorted(SIZE_CAPS))
def test_each_size_past_its_cap_is_refused_naming_the_key_and_the_cap(path, tmp_path):
    cap = SIZE_CAPS[path][0]
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, [f"{path}={2 * cap}", f"storage={tmp_path}", *PAST.get(path, [])])
    assert err.value.path == path
    assert f"{2 * cap} is past the cap of {cap:,}" in str(err.value) and str(SMOKE) in str(err.value)


def test_sizes_at_their_caps_are_not_refused_for_being_large(tmp_path):
    spec = load_study(SMOKE, ["train.xe_epochs=1000", "model.layers=48", f"storage={tmp_path}"])
    assert spec.total_epochs == 1000 and spec.base["model"]["layers"] == 48


def test_a_searched_size_past_its_cap_names_the_search_key(tmp_path):
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["space"]["model.d_model"] = {"grid": [64, 8192]}
    del raw["model"]["d_model"]  # the space controls it now
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_study(tmp_path / "study.yaml", [f"storage={tmp_path}"])
    assert err.value.path == "search.space.model.d_model.grid"
    assert "8192 gives an invalid model.d_model: 8192 is past the cap of 4,096" in str(err.value)


def test_a_study_of_too_many_trials_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["search.num_samples=100000000", f"storage={tmp_path}"])
    assert err.value.path == "search" and f"400,000,004 trials" in str(err.value)
    assert f"cap of {MAX_TRIALS:,}" in str(err.value)


def test_the_study_file_reference_lists_every_cap():
    page = (ROOT / "docs" / "reference" / "study-file.md").read_text()
    section = page.split("## Sizes it refuses", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^\| `([a-z_.]+)` \| ([\d,]+) \|", section, flags=re.M))
    assert listed == {**{path: f"{cap:,}" for path, (cap, _) in SIZE_CAPS.items()}, "search": f"{MAX_TRIALS:,}"}


def test_a2_train_refuses_a_billion_images_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "data.images=1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["a2: error: data.images: 1000000000 is past the cap of 200,000 (COCO's Karpathy split has "
                   "123,287 images; the synthetic set stands in for it); the caps: docs/reference/study-file.md, "
                   "\"Sizes it refuses\""]
    assert not (tmp_path / "runs").exists()  # nothing generated, nothing written


# -- resources of a study run on this machine ---------------------------------------------------------------------
def test_machine_resources_count_cpus_and_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_resources() == {"CPU": float(os.cpu_count()), "GPU": 0.0}


def test_validate_refuses_a_local_trial_this_machine_cannot_hold(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cpus = os.cpu_count()
    too_many = f"resources.cpus_per_worker={cpus + 1}"
    assert main(["study", "validate", str(SMOKE), too_many, f"storage={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"a2: error: {SMOKE}: resources.cpus_per_worker: a trial needs 1 workers x {cpus + 1} CPU = "
        f"{cpus + 1} CPUs but this machine has {cpus}"]
    assert main(["study", "validate", str(SMOKE), "resources.gpus_per_worker=1", f"storage={tmp_path}"]) == 2
    assert "= 1 GPUs but this machine has 0" in capsys.readouterr().err
    # a study for a cluster (an address to join) is checked against that cluster when it runs, not this machine
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert main(["study", "validate", str(SMOKE), too_many, f"storage={tmp_path}"]) == 0


def test_run_refuses_it_before_ray_starts_and_before_the_study_folder_exists(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    storage = tmp_path / "st"
    code = main(["study", "run", str(SMOKE), f"resources.cpus_per_worker={os.cpu_count() + 1}", f"storage={storage}",
                 f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}", "name=too-big"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("a2: error: ") and "this machine has" in lines[0]
    assert not ray.is_initialized() and not storage.exists() and not (tmp_path / "mlflow.db").exists()

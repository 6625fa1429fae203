"""A study's relative data paths mean the same wherever it is loaded from (launch.spec.study_root).

The paper's studies name their data relative to the repository (`data/coco/dataset_coco.json`); the cluster file's
setup commands fetch it into each node's copy of the repository (~/a2tune), and Ray 2.60's `ray submit` runs
`python ~/submit.py ...` from the head's home, `ray job submit --working-dir .` from a copy of the working directory
without data/. Each test below loads the shipped fusion_ablation.yaml from one of those working directories, with
the synthetic COCO in the real file formats at the study's own relative paths. No Ray starts.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from a2core.data import synthetic
from launch.spec import is_checkout, load_study, study_root

REPO = Path(__file__).resolve().parents[1]
# fusion_ablation.yaml shrunk by overrides only (its data paths stay as written)
SHRINK = ["storage=s3://a2-team-bucket/a2-studies"]


def checkout_with_coco(root: Path) -> Path:
    """A copy of this repository's files that matter to a study (pyproject.toml, studies/) with the synthetic COCO
    at the paper studies' paths: data/coco/dataset_coco.json, features.h5 and image_info_test2014.json."""
    root.mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "studies", root / "studies")
    files = synthetic.generate(root / "synth", seed=0, images=60, test_images=6)
    coco = root / "data" / "coco"
    coco.mkdir(parents=True)
    for key in ("captions", "features", "test_images"):
        shutil.copy(files[key], coco / Path(files[key]).name)
    return root


def coco_overrides(features: str = "data/coco/features.h5") -> list[str]:
    return [*SHRINK, f"data.features={features}"]  # the HDF5 layout here; the prepared store is read the same way


def test_the_repository_is_a_checkout_and_its_studies_resolve_into_it():
    assert is_checkout(REPO)
    assert study_root(REPO / "studies" / "fusion_ablation.yaml") == str(REPO)
    assert not is_checkout(REPO / "studies")


def test_a_study_outside_any_checkout_resolves_against_its_own_folder(tmp_path):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    assert study_root(folder / "x.yaml") == str(folder)


def test_relative_data_paths_resolve_against_the_checkout_from_another_directory(tmp_path, monkeypatch):
    repo = checkout_with_coco(tmp_path / "repo")
    monkeypatch.chdir(tmp_path)  # not the checkout: where the head's `python ~/submit.py` runs
    spec = load_study(repo / "studies" / "fusion_ablation.yaml", coco_overrides())
    data = spec.base["data"]
    assert data["captions"] == str(repo / "data" / "coco" / "dataset_coco.json")
    assert data["features"] == str(repo / "data" / "coco" / "features.h5")
    assert data["test_images"] == str(repo / "data" / "coco" / "image_info_test2014.json")


def test_an_explicit_root_wins(tmp_path, monkeypatch):
    repo = checkout_with_coco(tmp_path / "repo")
    other = checkout_with_coco(tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    spec = load_study(repo / "studies" / "fusion_ablation.yaml", coco_overrides(), root=other)
    assert spec.base["data"]["captions"] == str(other / "data" / "coco" / "dataset_coco.json")


def _submit_check(cwd: Path, home: Path, study: str) -> subprocess.CompletedProcess:
    """launch/commands/submit.py's loading of `study` as the cluster runs it, from `cwd` with $HOME `home` (no Ray)."""
    code = ("import sys; sys.path.insert(0, %r); from launch.commands.submit import load_submitted; "
            "spec = load_submitted(sys.argv[1], sys.argv[2:], '~/a2tune'); print('DATA=' + spec.base['data']['captions'])"
            % str(REPO))
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "-c", code, study, *coco_overrides()], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_ray_submit_from_the_heads_home_finds_the_study_and_its_data(tmp_path):
    """`ray submit ray-cluster.yaml launch/commands/submit.py -- studies/fusion_ablation.yaml ...`: run from the head's
    home, the study and its data in ~/a2tune."""
    home = tmp_path / "home"
    repo = checkout_with_coco(home / "a2tune")
    run = _submit_check(home, home, "studies/fusion_ablation.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"DATA={repo / 'data' / 'coco' / 'dataset_coco.json'}" in run.stdout


def test_an_override_ray_submit_cut_at_a_space_is_refused_saying_why(tmp_path):
    """`ray submit` joins its arguments with spaces into one shell line on the head: `search.scheduler={fifo: {}}`
    arrives as two arguments; the second is refused in one line that says how to write it."""
    from a2core.errors import ConfigError
    from launch.commands.submit import load_submitted

    with pytest.raises(ConfigError, match=r"^\{\}\}: is not key=value: `ray submit` hands the arguments to the head's "
                                          r"shell joined by spaces.*write it without spaces, e.g. "
                                          r"search.scheduler=\{fifo:\{\}\}$"):
        load_submitted(str(REPO / "studies" / "smoke.yaml"), ["search.scheduler={fifo:", "{}}"], str(tmp_path))


def test_ray_job_submit_from_a_copy_of_the_working_directory_finds_the_data_in_the_clusters_copy(tmp_path):
    """`ray job submit --working-dir . -- python launch/commands/submit.py studies/...`: the job's folder is a copy of the
    laptop's tree without data/ (.gitignore); the data is in the head's ~/a2tune."""
    home = tmp_path / "home"
    repo = checkout_with_coco(home / "a2tune")
    job = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0"
    job.mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", job / "pyproject.toml")
    shutil.copytree(REPO / "studies", job / "studies")
    run = _submit_check(job, home, "studies/fusion_ablation.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"DATA={repo / 'data' / 'coco' / 'dataset_coco.json'}" in run.stdout


@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_validate_from_another_directory(tmp_path, spelling):
    """`a2 study validate studies/x.yaml` means the same from the checkout and from anywhere else."""
    repo = checkout_with_coco(tmp_path / "repo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    study = repo / "studies" / "fusion_ablation.yaml"
    arg = os.path.relpath(study, elsewhere) if spelling == "relative" else str(study)
    overrides = [*coco_overrides(), f"storage={tmp_path / 'a2-studies'}",  # local: runs on this machine
                 "resources.cpus_per_worker=1", "resources.gpus_per_worker=0"]
    run = subprocess.run([sys.executable, "-m", "launch.cli", "study", "validate", arg, *overrides],
                         cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]

"""The `a2` command as a process in a pipeline and as a reader of paths: output into a reader that has gone away
(`a2 ... | head -1`) ends quietly, not in a BrokenPipeError traceback; a path given for a file that is a folder
(or a folder given as a file) is called a folder, never "not found"."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from a2core.data.captions import read_image_info, read_karpathy
from a2core.errors import DataError
from a2core.metrics import load_split_references
from launch.cli import main

# no test here starts Ray (conftest's WITHOUT_RAY does not list this module: marked instead, watched the same way)
pytestmark = pytest.mark.outside_ray_group

REPO = Path(__file__).resolve().parents[1]
A2 = [shutil.which("a2") or sys.executable, *([] if shutil.which("a2") else ["-m", "launch.cli"])]

def _into_head_that_has_exited(command: list[str]) -> subprocess.Popen:
    """`a2 COMMAND | head -1` where head has read its line and gone before a2 writes (in a real pipeline the pipe's
    size and the timing decide whether it gets there; here it always does): a2, finished, its stderr read."""
    read, write = os.pipe()
    head = subprocess.Popen(["head", "-1"], stdin=read, stdout=subprocess.PIPE)
    os.close(read)
    os.write(write, b"the line head takes\n")
    assert head.communicate(timeout=10)[0] == b"the line head takes\n"
    assert head.returncode == 0
    # head is gone: no reader holds the pipe, so a2's first write meets EPIPE
    a2 = subprocess.Popen([*A2, *command], cwd=REPO, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    a2.stderr_text = a2.communicate(timeout=60)[1].decode()
    return a2


def test_output_into_head_that_has_exited_ends_quietly():
    """A plan of many lines, printed by a command's handler: exit 1 as Python itself on EPIPE, no traceback."""
    a2 = _into_head_that_has_exited(["study", "plan", "studies/fusion_ablation.yaml"])
    assert "Traceback" not in a2.stderr_text and "BrokenPipeError" not in a2.stderr_text, a2.stderr_text
    assert a2.stderr_text == ""
    assert a2.returncode == 1


@pytest.mark.parametrize("command", [["--help"], ["study", "plan", "--help"]], ids=lambda c: " ".join(c))
def test_help_into_head_that_has_exited_ends_quietly(command):
    """Help leaves the parser through SystemExit, its text written by argparse (which drops a write that fails,
    and exits 0) or still buffered (flushed by `main`, exit 1): either way no traceback."""
    a2 = _into_head_that_has_exited(command)
    assert a2.stderr_text == ""
    assert a2.returncode in (0, 1)


def test_output_into_a_live_head_ends_quietly():
    """The pipeline as a shell makes it, `a2 study plan FILE | head -1`: head prints the plan's first line, and a2
    ends without a traceback whether or not its writes outlived head."""
    a2 = subprocess.Popen([*A2, "study", "plan", "studies/fusion_ablation.yaml"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=a2.stdout, stdout=subprocess.PIPE)
    a2.stdout.close()  # head alone holds the read end: its exit closes the pipe
    first = head.communicate(timeout=60)[0].decode()
    err = a2.communicate(timeout=60)[1].decode()
    assert first == "a2-fusion-ablation: plan (nothing runs)\n"
    assert err == ""
    assert a2.returncode in (0, 1)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "afolder").mkdir()
    (tmp_path / "results.json").write_text("[]")
    return tmp_path / "afolder"


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err.strip()


def test_evaluate_calls_a_captions_folder_a_folder(folder, capsys):
    results = folder.parent / "results.json"
    assert _error(capsys, ["evaluate", "--results", str(results), "--captions", str(folder)]) == (
        f"a2: error: {folder}: is a folder, not a captions file")


def test_evaluate_calls_a_results_folder_a_folder(folder, capsys):
    assert _error(capsys, ["evaluate", "--results", str(folder), "--captions", str(folder)]) == (
        f"a2: error: {folder}: is a folder, not a results file")


def test_evaluate_still_says_not_found_for_a_missing_captions_file(folder, capsys):
    results, missing = folder.parent / "results.json", folder.parent / "nope.json"
    assert _error(capsys, ["evaluate", "--results", str(results), "--captions", str(missing)]) == (
        f"a2: error: captions file not found: {missing}")


def test_caption_loaders_call_a_folder_a_folder(folder):
    """Every reader of captions and image lists (`a2 train`, `a2 decode`, `a2 package`, `a2 submission validate`,
    a study's checks) says so through these loaders."""
    for read, what in ((read_karpathy, "Karpathy captions file"), (read_image_info, "COCO image-info file"),
                       (load_split_references, "captions file")):
        with pytest.raises(DataError) as err:
            read(folder)
        assert str(err.value) == f"{folder}: is a folder, not a {what}"


@pytest.mark.parametrize("argv", [["study", "validate"], ["study", "plan"], ["train", "--config"]],
                         ids=lambda a: " ".join(a))
def test_a_study_or_config_folder_is_called_a_folder(folder, capsys, argv):
    assert _error(capsys, [*argv, str(folder)]) == f"a2: error: {folder}: is a folder, not a YAML file"


def test_train_resume_from_a_folder_is_called_a_folder(folder, capsys):
    assert _error(capsys, ["train", "--resume", str(folder)]) == (
        f"a2: error: --resume {folder}: is a folder, not a checkpoint file (name its last.pt or best.pt)")


def test_train_resume_from_a_missing_file_still_says_no_such_file(folder, capsys):
    missing = folder / "last.pt"
    assert _error(capsys, ["train", "--resume", str(missing)]) == (
        f"a2: error: --resume {missing}: no such checkpoint file")


def test_submission_validate_calls_a_zip_folder_a_folder(folder, capsys):
    assert _error(capsys, ["submission", "validate", str(folder), "--val-images", str(folder),
                           "--test-images", str(folder)]) == (
        f"a2: error: {folder}: is a folder, not a zip (give the results.zip to check)")


def test_submission_validate_calls_an_image_list_folder_a_folder(folder, capsys):
    results = folder.parent / "results.json"  # a file: the image lists are read before it is opened as a zip
    assert _error(capsys, ["submission", "validate", str(results), "--val-images", str(folder),
                           "--test-images", str(folder)]) == (
        f"a2: error: {folder}: is a folder, not a COCO image-info file")


def test_plan_calls_a_cluster_folder_a_folder(folder, capsys):
    assert _error(capsys, ["study", "plan", str(REPO / "studies/smoke.yaml"), "--cluster", str(folder)]) == (
        f"a2: error: --cluster {folder}: is a folder, not a cluster-launcher file")


@pytest.mark.parametrize("key", ["captions", "test_images"])
def test_study_data_folder_is_called_a_folder(folder, capsys, key):
    study = REPO / "studies/fusion_ablation.yaml"
    # the other data paths there (a folder is a features store: .npz files), so that `key` is the one refused
    data = {"captions": folder.parent / "results.json", "features": folder,
            "test_images": folder.parent / "results.json"}
    data[key] = folder
    err = _error(capsys, ["study", "validate", str(study), *(f"data.{k}={v}" for k, v in data.items()),
                          f"storage={folder.parent / 'storage'}"])
    assert err == f"a2: error: {study}: data.{key}: {folder}: is a folder, not a file"

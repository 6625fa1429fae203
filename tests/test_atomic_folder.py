"""`a2core.atomic.replace_folder`: a finished folder takes the place of an old one whole, and the place is never
empty on a system with renameat2's RENAME_EXCHANGE (the kill-window tests kill it between its writes; these tests
check the two paths it takes and what it leaves)."""
from __future__ import annotations

import errno
import os
import socket
import sys
from pathlib import Path

import pytest

from a2core import atomic

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is a Linux call")


def _folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)  # a building_folder is made already
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


@linux_only
def test_exchange_swaps_two_folders_in_one_call(tmp_path):
    a, b = _folder(tmp_path / "a", one="1"), _folder(tmp_path / "b", two="2")
    assert atomic._exchange(a, b) is True
    assert _contents(a) == {"two": "2"} and _contents(b) == {"one": "1"}


@linux_only
def test_exchange_with_a_missing_side_raises_naming_both_paths(tmp_path):
    a = _folder(tmp_path / "a", one="1")
    with pytest.raises(FileNotFoundError) as err:
        atomic._exchange(a, tmp_path / "gone")
    assert err.value.errno == errno.ENOENT
    assert err.value.filename == str(a) and err.value.filename2 == str(tmp_path / "gone")
    assert _contents(a) == {"one": "1"}


@linux_only
def test_a_folder_is_replaced_by_one_swap_without_moving_the_old_one_aside(tmp_path, monkeypatch):
    target = _folder(tmp_path / "set", old="old")
    built = _folder(atomic.building_folder(target, ".synth"), new="new")
    renames = []
    monkeypatch.setattr(atomic.os, "rename", lambda *a: renames.append(a))  # the two-step path would call it
    atomic.replace_folder(built, target)
    assert renames == []
    assert _contents(target) == {"new": "new"}
    assert sorted(os.listdir(tmp_path)) == ["set"]  # the old folder, swapped onto the building name, removed


@pytest.mark.parametrize("exchange", [True, False], ids=["one-swap", "two-renames"])
def test_both_paths_replace_the_folder_whole_and_leave_nothing_beside(tmp_path, monkeypatch, exchange):
    if exchange and sys.platform != "linux":
        pytest.skip("renameat2 is a Linux call")
    if not exchange:  # as on NFS or macOS
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = _folder(tmp_path / "set", old="old", shared="old")
    (tmp_path / "set.old").mkdir()  # a user's own folder of that name is never touched
    built = _folder(atomic.building_folder(target, ".synth"), new="new", shared="new")
    atomic.replace_folder(built, target)
    assert _contents(target) == {"new": "new", "shared": "new"}
    assert sorted(os.listdir(tmp_path)) == ["set", "set.old"]


def test_onto_an_absent_target_the_built_folder_is_renamed(tmp_path):
    target = tmp_path / "set"
    built = _folder(atomic.building_folder(target, ".fetch"), new="new")
    atomic.replace_folder(built, target)
    assert _contents(target) == {"new": "new"} and sorted(os.listdir(tmp_path)) == ["set"]


def test_the_two_step_path_puts_the_old_folder_back_when_the_new_one_cannot_take_its_place(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = _folder(tmp_path / "set", old="old")
    built = _folder(atomic.building_folder(target, ".synth"), new="new")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == built:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError):
        atomic.replace_folder(built, target)
    assert _contents(target) == {"old": "old"}
    assert not any(name.endswith(".old") for name in os.listdir(tmp_path))  # the aside folder removed


def test_a_swapped_out_folder_left_by_a_killed_run_is_cleared_by_the_next_building_folder(tmp_path):
    """A kill right after the swap leaves the old folder under the killed run's building name; the next run's
    `building_folder` of that suffix removes it (its process is dead), and only its own folder is made."""
    target = _folder(tmp_path / "set", new="new")
    dead = tmp_path / f".set.{socket.gethostname()}.p{2**22 + 12345}.abcdefgh.synth"  # above any pid_max
    _folder(dead, old="old")
    made = atomic.building_folder(target, ".synth")
    assert not dead.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["set", made.name])

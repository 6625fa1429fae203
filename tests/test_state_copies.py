"""Whole copies of Tune's own state files (`launch.verify.WholeCopies`): Tune copies its experiment state into the
storage with a plain copy, so a disk that fills during that copy leaves the file cut short. The copies keep the last
whole version of each root file; `resume` refuses the cut file naming its copy, and `resume --restore-state` puts the
copy back, naming it. Without Ray: a study folder of Tune's file names."""
from __future__ import annotations

import errno
import json
import pickle
import time

import pytest

from a2core.errors import StudyError
from launch.storage import Location, open_location
from launch.verify import COPIES_DIR, WholeCopies, refuse_corrupt, restore_whole_copies

STATE = "experiment_state-2026-11-26_07-00-00.json"
SEARCHER = "searcher-state-2026-11-26_07-00-00.pkl"


@pytest.fixture
def study(tmp_path):
    folder = tmp_path / "studies" / "cut"
    folder.mkdir(parents=True)
    (folder / STATE).write_text(json.dumps({"trial_data": [["t1", "RUNNING"]], "runner_data": {"epoch": 1}}))
    (folder / SEARCHER).write_bytes(pickle.dumps({"suggested": 3}))
    (folder / "study.yaml").write_text("name: cut\n")
    (folder / "lease.json").write_text("{}")
    return folder


def test_only_tunes_whole_root_files_are_copied_and_only_when_they_change(study):
    copies = WholeCopies(open_location(study))
    assert copies.save() == [STATE, SEARCHER]  # not study.yaml (a2's own, written atomically) nor lease.json
    assert sorted(p.name for p in (study / COPIES_DIR).iterdir()) == sorted([STATE, SEARCHER])
    assert (study / COPIES_DIR / STATE).read_bytes() == (study / STATE).read_bytes()
    assert copies.save() == []  # nothing changed

    whole = json.dumps({"trial_data": [["t1", "TERMINATED"]], "runner_data": {"epoch": 2}})
    (study / STATE).write_text(whole)
    assert copies.save() == [STATE]
    (study / STATE).write_text(whole[:40])  # cut short mid-copy: the last whole copy stays
    assert copies.save() == []
    assert (study / COPIES_DIR / STATE).read_text() == whole


def test_resume_refuses_a_cut_file_naming_its_copy_and_restore_state_puts_it_back(study):
    WholeCopies(open_location(study)).save()
    whole = (study / STATE).read_bytes()
    (study / STATE).write_bytes(whole[:25])
    location = open_location(study)

    with pytest.raises(StudyError) as refused:
        refuse_corrupt(location, "resume")
    message = str(refused.value)
    assert str(study / STATE) in message and "resume refused, nothing was run or changed" in message
    assert f"a whole copy of it is at {study / COPIES_DIR / STATE}" in message
    assert "`a2 study resume cut --restore-state` puts it back" in message
    assert (study / STATE).read_bytes() == whole[:25]  # refusing changes nothing

    assert restore_whole_copies(location) == [f"restored {study / STATE} from its whole copy {study / COPIES_DIR / STATE}"]
    assert (study / STATE).read_bytes() == whole
    refuse_corrupt(location, "resume")  # readable again: no error
    assert restore_whole_copies(location) == []  # nothing left to put back


def test_a_cut_file_without_a_whole_copy_is_refused_as_before(study):
    (study / SEARCHER).write_bytes(pickle.dumps({"suggested": 3})[:-1])  # no STOP opcode: cut short
    with pytest.raises(StudyError, match="restore the file from a copy, or run the study again"):
        refuse_corrupt(open_location(study), "resume")
    assert restore_whole_copies(open_location(study)) == []


def test_the_copies_follow_a_running_study_and_a_failed_write_keeps_the_last_copy(study, monkeypatch, capsys):
    with WholeCopies(open_location(study), period=0.02):
        (study / STATE).write_text(json.dumps({"runner_data": {"epoch": 2}}))
        deadline = time.monotonic() + 10
        while json.loads((study / COPIES_DIR / STATE).read_text() if (study / COPIES_DIR / STATE).exists()
                         else "{}").get("runner_data", {}).get("epoch") != 2:
            assert time.monotonic() < deadline, "the running copier never copied the new state"
            time.sleep(0.02)

        def full(self, text):
            raise OSError(errno.ENOSPC, "No space left on device", self.uri)

        monkeypatch.setattr(Location, "write_text", full)
        (study / STATE).write_text(json.dumps({"runner_data": {"epoch": 3}}))
        time.sleep(0.2)  # several failed rounds
    # the exit's last round failed too: the copy of epoch 2 stays, and the failure was said once
    assert json.loads((study / COPIES_DIR / STATE).read_text())["runner_data"]["epoch"] == 2
    err = capsys.readouterr().err
    assert err.count("whole copies of Tune's state not updated (the last ones stay)") == 1
    assert "No space left on device" in err


class _Searcher:  # a searcher state's shapes: an object with arrays, sets, ordered and plain dicts
    def __init__(self):
        import collections

        import numpy as np

        self.points = np.arange(50.0)
        self.seen = {("max", 1), ("gate", 2)}
        self.order = collections.OrderedDict(a=1, b=[1.5, None, "x"])


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_pickle_is_checked_whole_without_running_anything_in_it(study, protocol, tmp_path):
    from launch.verify import problem

    whole = pickle.dumps({"searcher": _Searcher(), "trials": [{"id": f"t{i}", "score": i / 3} for i in range(40)]},
                         protocol=protocol)
    target = open_location(study).join(SEARCHER)
    for cut in range(len(whole)):  # every cut short of the whole is refused
        (study / SEARCHER).write_bytes(whole[:cut])
        assert "unreadable" in (problem(target, "pickle") or ""), cut
    (study / SEARCHER).write_bytes(whole)
    assert problem(target, "pickle") is None
    # a class of a module that is not installed is not imported; a call the pickle asks for is not made
    ran = tmp_path / "ran"
    (study / SEARCHER).write_bytes(b"cno_such_module\nThing\n)\x81cos\nsystem\n(S'touch " + str(ran).encode() +
                                   b"'\ntR\x86.")
    assert problem(target, "pickle") is None and not ran.exists()
    # what a call gives is called in turn, or built as a class (Tune's Tuner pickle does both)
    for then in (b"(S'touch " + str(ran).encode() + b"'\ntR.", b")\x81."):
        (study / SEARCHER).write_bytes(b"cbuiltins\ngetattr\n(cos\nsystem\nS'x'\ntR" + then)
        assert problem(target, "pickle") is None and not ran.exists()

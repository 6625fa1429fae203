"""`a2 study check NAME`: every state file and every checkpoint of a study read, and each unreadable, damaged or
mismatched one named (`launch.verify`)."""
from __future__ import annotations

import time

from launch import verify
from launch.lease import describe, live_writer
from launch.location import locate

FOUND = 1  # the exit status when a file was found unreadable, damaged or mismatched; 2 is a refusal (no study)


def cmd_check(args) -> int:
    """`a2 study check NAME`: every state file and every checkpoint of the study. Exit 0 when all are readable, 1
    when one is unreadable, damaged or mismatched (what was checked found a fault, as `a2 submission validate`
    exits 1 on a faulty zip), 2 when there is nothing to check: no study of that name in the storage, a wrong name
    or storage (an A2Error, as every command refuses a bad argument)."""
    location = locate(args.name, args.storage)
    study = location.at()
    writer = live_writer(study)
    if writer is not None:
        print(f"note: study {args.name} is running: its driver ({describe(writer)}) holds its lease and writes its "
              f"files while they are checked; a file found unreadable is read again {verify.RECHECK_S:g} s later")
    files = verify.state_files(study)
    checkpoints = verify.checkpoint_files(study)
    model, searched = verify.study_model(location)
    # (how a problem is printed, what reads the file again): state files first, then the checkpoints
    checks = [("unreadable", lambda loc=loc, kind=kind: verify.problem(loc, kind)) for loc, kind in files]
    checks.append(("unreadable", lambda: verify.experiment_state_problem(study)))  # what `status` would refuse
    checks += [(None, lambda c=c: _checkpoint_problem(c, model, searched)) for c in checkpoints]
    found = [(label, again, line) for label, again in checks if (line := again())]
    if writer is not None and found:
        time.sleep(verify.RECHECK_S)
        found = [(label, again, line) for label, again, _ in found if (line := again())]
    for label, _, line in found:
        print(f"{label or _checkpoint_label(line)}: {line}")
    checked = sum(not verify.gone(c) for c in checkpoints)  # one deleted since it was listed was not checked
    advice = ("its driver is running: check again once the study has ended before restoring any" if writer is not None
              else "restore them from a copy; a trial resumes from its newest readable checkpoint")
    print(f"study {args.name} at {study.uri}: {len(files)} state files and {checked} checkpoints checked, "
          + (f"{len(found)} unreadable ({advice})" if found else "all readable"))
    return FOUND if found else 0


def _checkpoint_problem(location, model, searched) -> str | None:
    """`verify.checkpoint_problem`, None for a checkpoint deleted since it was listed: a running trial keeps only its
    newest ones, and one it deleted is no unreadable file in the study."""
    found = verify.checkpoint_problem(location, model, searched)
    return None if found is None or verify.gone(location) else found


def _checkpoint_label(found: str) -> str:
    """A file that loads but is another model is "mismatched", one whose bytes are not the ones written (its
    sha256) "damaged", one that does not load "unreadable"."""
    if "a model of another config" in found or "do not fit" in found:
        return "mismatched"
    return "damaged" if "damaged since it was written" in found else "unreadable"

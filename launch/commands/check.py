"""`a2 study check NAME`: every state file and every checkpoint of a study read, and each unreadable, damaged or
mismatched one named (`launch.verify`)."""
from __future__ import annotations

from launch import verify
from launch.location import locate


def cmd_check(args) -> int:
    """`a2 study check NAME`: every state file and every checkpoint of the study; exit 2 when one is unreadable."""
    location = locate(args.name, args.storage)
    study = location.at()
    files = verify.state_files(study)
    checkpoints = verify.checkpoint_files(study)
    problems = [p for p in (verify.problem(loc, kind) for loc, kind in files) if p]
    for line in problems:
        print(f"unreadable: {line}")
    model, searched = verify.study_model(location)
    for found in (verify.checkpoint_problem(c, model, searched) for c in checkpoints):
        if found:  # a file that loads but is another model is "mismatched", one that does not "unreadable"
            mismatched = "a model of another config" in found or "do not fit" in found
            damaged = "damaged since it was written" in found  # its bytes are not the ones written (its sha256)
            print(f"{'mismatched' if mismatched else 'damaged' if damaged else 'unreadable'}: {found}")
            problems.append(found)
    print(f"study {args.name} at {study.uri}: {len(files)} state files and {len(checkpoints)} checkpoints checked, "
          + (f"{len(problems)} unreadable (restore them from a copy; a trial resumes from its newest readable "
             f"checkpoint)" if problems else "all readable"))
    return 2 if problems else 0

"""A checkpoint's SHA-256, written beside it when it is stored and checked whenever it is read back.

`checkpoint.pt.sha256` next to `checkpoint.pt` holds one line in `sha256sum`'s format (`<64 hex>  checkpoint.pt`, so
`sha256sum -c checkpoint.pt.sha256` checks it by hand too). A byte flipped in storage (a bad disk, a bad copy) keeps
a checkpoint's size and often its zip directory whole, and torch may even load it: only the checksum tells. A
checkpoint without one (written before checksums were) is read as before. Plain hashlib: no torch here, so that
`a2 study check` and the study's readers can use it without loading weights.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .atomic import atomic_write

SUFFIX = ".sha256"  # the checksum file of `x` is `x.sha256`
_LINE = re.compile(r"^([0-9a-f]{64})\b")


def file_sha256(path: str | Path, block: int = 8 << 20) -> str:
    """The file's SHA-256 (hex), read in blocks of `block` bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_path(path: str | Path) -> Path:
    return Path(f"{path}{SUFFIX}")


def write_checksum(path: str | Path) -> str:
    """Write `path`'s SHA-256 beside it (`checksum_path`, atomically); returns the hex digest."""
    digest = file_sha256(path)
    atomic_write(checksum_path(path), f"{digest}  {Path(path).name}\n")
    return digest


def recorded_sha256(text: str | None) -> str | None:
    """The digest a checksum file's text records (None: no such file, or not one)."""
    found = _LINE.match((text or "").strip().lower())
    return found[1] if found else None


def checksum_problem(local: str | Path, recorded: str | None, shown: str) -> str | None:
    """Why the file at `local` (a copy of the stored checkpoint `shown`, or the file itself) is not the checkpoint
    that was written: its SHA-256 differs from `recorded`, the text of the checksum file stored beside it. None when
    they agree, or when there is no checksum (`recorded` None: a checkpoint from before checksums). A checksum file
    that records no SHA-256 (a flipped bit turned a hex digit into another character) is damaged too: read as none,
    it let the checkpoint beside it through unchecked."""
    if recorded is None:
        return None
    want = recorded_sha256(recorded)
    if want is None:
        return (f"{shown}: its checksum file ({Path(shown).name}{SUFFIX}) records no SHA-256: damaged since it was "
                f"written, so the checkpoint cannot be checked; restore both from a copy")
    have = file_sha256(local)
    if have == want:
        return None
    return (f"{shown}: damaged since it was written: its SHA-256 is {have[:12]}..., the one recorded beside it "
            f"({Path(shown).name}{SUFFIX}) {want[:12]}...; restore it from a copy")

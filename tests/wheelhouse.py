"""A wheelhouse of this machine's installed packages, for nodes that must build their own environment offline.

The cluster rehearsal's head is another Linux account that cannot read this checkout or this Python. Its virtual
environment is built by the cluster file's own setup commands (`pip install -e ~/a2tune`), with pip pointed at a
shared read-only folder of wheels (`PIP_FIND_LINKS`, `PIP_NO_INDEX` in the account's pip.conf) instead of PyPI: the
same versions as here (torch stays the CPU build), no network, and nothing of this machine's install on its path.

The wheels are repacked from the installed distributions (each one's RECORD lists its files; its WHEEL file its
tags), once per set of installed versions, into WHEELHOUSE/<key>/; a later run finds them there. ZIP_STORED: the
wheels are read once by pip on this machine, so compressing them would only cost time.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

WHEELHOUSE = Path(os.environ.get("A2_WHEELHOUSE", "/var/cache/a2tune-wheelhouse"))
SKIP = {"a2tune"}
FORMAT = 2  # of the repacked wheels: a new one makes the wheels again  # the project itself: the node installs its own copy


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _installed() -> list[md.Distribution]:
    seen, out = set(), []
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if not name or _norm(name) in {_norm(s) for s in SKIP} or _norm(name) in seen:
            continue
        if dist.read_text("RECORD") is None or dist.read_text("WHEEL") is None:
            continue  # not installed from a wheel (nothing to repack faithfully)
        seen.add(_norm(name))
        out.append(dist)
    return out


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _repack(dist: md.Distribution, out: Path) -> Path:
    """One installed distribution as a wheel in `out`: the files of its RECORD that live in site-packages (scripts
    and data files outside it are left out: pip writes console scripts again from entry_points.txt)."""
    wheel_meta = dist.read_text("WHEEL")
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    name, version = _norm(dist.metadata["Name"]), dist.version
    # the compressed tag set of the wheel's file name (py2.py3-none-any), in the order the WHEEL file lists them
    parts = [list(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)] if tags else [["py3"], ["none"], ["any"]]
    path = out / f"{name}-{version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    site = Path(dist.locate_file(""))
    info = next(str(f).split("/")[0] for f in dist.files or [] if str(f).split("/")[0].endswith(".dist-info"))
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        for rel in dist.files or []:
            rel = str(rel)
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith(".pyc") or rel == f"{info}/RECORD":
                continue
            if rel in (f"{info}/INSTALLER", f"{info}/REQUESTED", f"{info}/direct_url.json"):
                continue  # what pip wrote at install time, not part of the wheel
            file = site / rel
            if not file.is_file():
                continue
            data = file.read_bytes()
            entry = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = (file.stat().st_mode & 0xFFFF) << 16  # pip keeps the executable bit (gcs_server)
            whl.writestr(entry, data)
            rows.append((rel, _hash(data), str(len(data))))
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows([*rows, (f"{info}/RECORD", "", "")])
        whl.writestr(f"{info}/RECORD", record.getvalue())
    return path


def wheelhouse() -> Path:
    """The folder of wheels for this machine's installed versions, made on first use (readable by every account)."""
    dists = _installed()
    versions = sorted(f"{_norm(d.metadata['Name'])}=={d.version}" for d in dists)
    key = hashlib.sha256("\n".join([f"format {FORMAT}", *versions]).encode())
    folder = WHEELHOUSE / key.hexdigest()[:16]
    if (folder / "COMPLETE").is_file():
        return folder
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    os.chmod(WHEELHOUSE, 0o755)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=WHEELHOUSE))
    for dist in dists:
        _repack(dist, tmp)
    (tmp / "COMPLETE").write_text(f"{len(dists)} wheels\n")
    for f in [tmp, *tmp.iterdir()]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    try:
        tmp.rename(folder)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    for old in WHEELHOUSE.iterdir():  # wheels of versions no longer installed: gigabytes nobody reads again
        if old != folder and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return folder


if __name__ == "__main__":
    print(wheelhouse())

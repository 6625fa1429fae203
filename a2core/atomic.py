"""The one atomic file writer of a2core, and the one swap of a whole folder: nothing already written is ever seen
half-written."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from a2core.errors import ConfigError, DataError


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Write `data` (bytes, UTF-8 text, or a function writing to a binary file) to a temp file in the target's
    folder, fsync it, then rename it over `path`: readers see the old file or the complete new one."""
    path = Path(path)
    if path.is_dir():  # os.replace would name the temp file, not the path the user gave
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file to write", str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:  # a file where a folder of the path should be
        raise NotADirectoryError(errno.ENOTDIR, "a file stands where a folder of this path should be",
                                 str(path)) from err
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:  # a full, read-only or over-quota folder: the error names the file, not a temp name
        raise type(err)(err.errno, err.strerror, str(path)) from err
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide results from the rest of a team
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_replaceable(path: str | os.PathLike, marks: tuple[str, ...], what: str) -> None:
    """Refuse to replace `path` unless it is absent, an empty folder, or a folder holding one of `marks` (an earlier
    `what`, which the caller may replace whole): a typo'd output path must never delete someone's folder or file."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise DataError(f"{path}: is a file, not a folder to write a {what} into; name another path")
    with os.scandir(path) as entries:
        if next(entries, None) is None or any((path / mark).is_file() for mark in marks):
            return
    raise DataError(f"{path}: a folder that is not a {what} (it holds no {' or '.join(marks)}) and would be "
                    f"replaced whole; name an empty or new folder")


def building_folder(path: str | os.PathLike, suffix: str) -> Path:
    """A new hidden folder beside `path` in which a whole data folder is built before one rename onto `path`.

    Its name holds this host and process (`.NAME.HOST.pPID.XXXXXXXX<suffix>`), and such folders that a killed
    process of this host left are removed first: a SIGKILLed `a2 data prepare` would otherwise leave gigabytes of
    half-written features hidden beside the store, once more on every try. Another host's (a shared file system)
    are left alone, since their process cannot be checked from here; so is a live or unreadable process's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_building_folders(path, suffix)
    prefix = f".{path.name}.{socket.gethostname()}.p"
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", suffix=suffix, dir=path.parent))


def clear_dead_building_folders(path: str | os.PathLike, suffix: str) -> None:
    """Remove the `building_folder`s of `path` with `suffix` that a killed process of this host left (another
    host's, and a live or unreadable process's, are left alone)."""
    path = Path(path)
    prefix = f".{path.name}.{socket.gethostname()}.p"
    if not path.parent.is_dir():
        return
    with os.scandir(path.parent) as entries:
        names = [e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(suffix)
                 and e.is_dir(follow_symlinks=False)]
    for name in names:
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path.parent / name, ignore_errors=True)


def replace_folder(built: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the finished folder `built` (a `building_folder` of `target`) onto `target`, replacing whatever is
    there whole, so that `target` is never missing: where the kernel and file system can (Linux 3.15+, local file
    systems), the two are swapped in one step (renameat2's RENAME_EXCHANGE) and the old folder, now under `built`'s
    hidden name, is removed; a kill before that removal leaves it to the next `building_folder` of that suffix.
    Elsewhere (NFS, macOS) the old one is moved aside onto a hidden `building_folder(target, ".old")` (never a visible
    name that may be a user's; files open in it stay readable), put back if `built` did not take its place, then
    removed: there a kill between the two renames leaves no `target` until the next run, which clears `.old`."""
    built, target = Path(built), Path(target)
    if target.is_dir() and not target.is_symlink() and _exchange(built, target):  # a link would be swapped, not replaced
        shutil.rmtree(built, ignore_errors=True)  # the old folder, under the building name since the swap
        return
    old = None
    try:
        if target.exists():
            old = building_folder(target, ".old")
            os.rename(target, old)  # onto the empty folder
        os.rename(built, target)
    except BaseException:
        if old is not None and not os.path.lexists(target):  # the new folder did not take its place: the old back
            with contextlib.suppress(OSError):
                os.rename(old, target)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one step (renameat2(2) with RENAME_EXCHANGE); False where this C library,
    kernel or file system has no such call (the caller then renames in two steps). Called through the C library
    (not a raw syscall), so that a preloaded fault library sees it like any other rename."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.5+
    except AttributeError:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # no such call here, or not on this file system
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fresh_folder(path: str | os.PathLike, holds: tuple[str, ...], what: str, say=None, *,
                 claim: bool = False) -> Path:
    """`path` if it holds none of the files `holds` (an earlier `what`), else the first of `path-2`, `path-3`, ...
    that holds none, saying so (printed, or handed to `say`: a caller that may still refuse the work says it only
    once the work starts): a new output never overwrites an earlier one. `claim`: the folder is made and its
    `holds[0]` created empty and exclusively (the output replaces it whole), so that two runs started at once never
    pick one folder: the second finds the first's claim and takes the next number."""
    path = Path(path)
    if path.name in ("", "..") and path.resolve().name:  # `.`, `..`: no name of their own to number
        path = path.resolve()
    candidate, n = path, 1
    while True:
        if not any((candidate / name).exists() for name in holds):
            if not claim:
                break
            try:  # a file named like the folder (path-2) is passed over too
                candidate.mkdir(parents=True, exist_ok=True)
                os.close(os.open(candidate / holds[0], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                break
            except FileExistsError:  # claimed by a run started at the same time
                pass
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    if candidate != path:
        message = f"{path} holds an earlier {what}; this run writes to {candidate}"
        if say is None:
            print(message, flush=True)
        else:
            say(message)
    return candidate


def check_output_path(path, option: str, *, folder: bool, source: str | None = None) -> None:
    """Refuse (ConfigError naming `option`) an output path that cannot be written, before any work: empty, a folder
    where a file goes (`folder` False) or a file where a folder goes, under a file, or in a folder this user cannot
    write. The one check of every command's output path (`a2 data prepare --out`, `a2 train --output-dir`,
    `a2 decode --out`, `a2 report --out`); `~` is expanded by the option's type (`launch.cli`) or the config."""
    if not str(path).strip():
        raise ConfigError(option, "is empty; name the " + ("folder" if folder else "file") + " to write", source)
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise ConfigError(option, f"{path} is a file, not a folder to write into", source)
    if not folder and path.is_dir():
        raise ConfigError(option, f"{path} is a folder, not a file to write", source)
    for parent in (path, *path.parents) if folder else path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(option, f"{path}: {parent} is a file, not a folder", source)
            if not os.access(parent, os.W_OK | os.X_OK):  # it read as "[Errno 13] Permission denied" after the work
                raise ConfigError(option, f"{path}: {parent} is not writable by this user", source)
            break

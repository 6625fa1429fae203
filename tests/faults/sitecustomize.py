"""Over-quota storage for tests/test_storage_full.py, in every Python process of a study (the driver, Ray's
workers: they inherit PYTHONPATH). With this folder first on PYTHONPATH, A2_FAULT_QUOTA_ROOT (a folder) and
A2_FAULT_QUOTA_SWITCH (a file) set: while the switch file exists, every file that Python opens for writing below the
root (`open`, `os.open`: checkpoints, result logs, summaries, temp files) fails as a file system over its quota does,
OSError EDQUOT "Disk quota exceeded". Writes by pyarrow's C++ code (Tune's experiment state) still succeed.

A real quota needs a file system mounted with quotas and a process without CAP_SYS_RESOURCE, which a test cannot
count on (tmpfs quotas and loop mounts are often unavailable in containers)."""
import builtins
import errno
import io
import os

_ROOT = os.environ.get("A2_FAULT_QUOTA_ROOT")
_SWITCH = os.environ.get("A2_FAULT_QUOTA_SWITCH")

if _ROOT and _SWITCH:
    _root = os.path.realpath(_ROOT) + os.sep
    _real_open, _real_os_open = builtins.open, os.open

    def _refuse(path) -> None:
        try:
            target = os.path.realpath(os.fspath(path))
        except TypeError:  # a file descriptor
            return
        if target.startswith(_root) and os.path.exists(_SWITCH):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), os.fspath(path))

    def _open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            _refuse(file)
        return _real_open(file, mode, *args, **kwargs)

    def _os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            _refuse(path)
        return _real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = _open
    os.open = _os_open

"""Load one of the repository's scripts (benchmarks/, scripts/) as a module, so tests call its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at `ROOT / relative` (e.g. "benchmarks/bench_noise.py"), executed as a fresh module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Sphinx configuration of the a2tune docs (MyST Markdown pages, Furo theme).

Built offline and strictly by `tests/test_docs.py`: `python3 -m sphinx -W --keep-going -b html docs OUT`.
Nothing is fetched at build time: no intersphinx, Furo ships its own assets and loads no web fonts.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent / "_ext")]  # the code documented, and a2ref

project = "a2tune"
author = "the a2tune developers"
copyright = "the a2tune developers, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings (Args:, Returns:, Raises:)
    "a2ref",  # the generated reference pages (study file, config, `a2` command)
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked like any other
suppress_warnings = ["myst.header"]  # included files (benchmarks/RESULTS.md) start below the page's level

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # types of the arguments a docstring's Args: names
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "a2tune"
html_static_path: list[str] = []
default_role = "code"  # `name` in a docstring renders as code, as in the Markdown pages
smartquotes = False  # keys, commands and quotes in the text stay as typed

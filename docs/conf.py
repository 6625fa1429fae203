"""Sphinx configuration of the a2tune docs (MyST Markdown pages, Furo theme).

Built offline and strictly by `tests/test_docs.py`: `python3 -m sphinx -W --keep-going -b html docs OUT`.
Nothing is fetched at build time: no intersphinx, Furo ships its own assets and loads no web fonts, and the
equations are rendered by a MathJax copied into the site (sphinx-mathjax-offline), not one from a CDN.
"""
import re
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
    # MathJax 3 copied into the built site's _static/mathjax and loaded from there: no CDN at build or view time.
    "sphinx-mathjax-offline",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]  # $...$ and $$...$$ are math
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
html_static_path = ["_static"]
html_css_files = ["a2.css"]  # 95% intervals never broken across lines; clickable images
default_role = "code"  # `name` in a docstring renders as code, as in the Markdown pages
smartquotes = False  # keys, commands and quotes in the text stay as typed


# A 95% interval as the docs print it, with the value it belongs to where there is one: "105.3 [103.1, 107.5]",
# "+0.4 CIDEr [-1.2, +2.0]" keeps only "[-1.2, +2.0]" whole, "[0.62, 0.89]".
_NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?%?"  # 2,000 or -1.2 or 5.2%
INTERVAL = re.compile(rf"(?:{_NUMBER} )?\[{_NUMBER}, {_NUMBER}\]")


def _keep_intervals_whole(doctree) -> None:
    """Wrap every interval of the prose and tables in `<span class="a2-interval">` (a2.css: never broken across lines)."""
    from docutils import nodes

    for text in list(doctree.findall(nodes.Text)):
        parent = text.parent
        if isinstance(parent, (nodes.literal, nodes.literal_block, nodes.raw, nodes.math, nodes.math_block)):
            continue
        value = str(text)
        if not INTERVAL.search(value):
            continue
        pieces, last = [], 0
        for match in INTERVAL.finditer(value):
            pieces += [nodes.Text(value[last:match.start()]), nodes.inline(match.group(), match.group(), classes=["a2-interval"])]
            last = match.end()
        pieces.append(nodes.Text(value[last:]))
        parent.replace(text, [piece for piece in pieces if piece.astext()])


def _link_images_to_full_size(app, doctree, docname) -> None:
    """Make every image a link to its full-size file, as Sphinx does only for images given a size."""
    from docutils import nodes
    from sphinx.util.osutil import relative_uri

    if app.builder.format != "html":
        return
    images = relative_uri(app.builder.get_target_uri(docname), "_images")
    for image in list(doctree.findall(nodes.image)):
        if isinstance(image.parent, nodes.reference) or image["uri"] not in app.env.images:
            continue
        link = nodes.reference("", "", internal=True, refuri=f"{images}/{app.env.images[image['uri']][1]}",
                               classes=["image-reference"])
        image.replace_self(link)
        link.append(image)


def setup(app):
    app.connect("doctree-resolved", lambda app, doctree, docname: _keep_intervals_whole(doctree))
    app.connect("doctree-resolved", _link_images_to_full_size)

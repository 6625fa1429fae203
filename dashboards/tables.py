"""Plain-text tables, and the cells of markdown ones (no MLflow or plotting imports: the `a2` command starts fast)."""
from __future__ import annotations


def text_table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """The one plain-text table of the project: padded columns (those in `right` right-aligned), a rule under
    the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def markdown_cell(text) -> str:
    """`text` as one cell of a markdown table row: a `|` in it (a label, a config value) escaped as `\\|`, which would
    end the cell; a line break, which would end the row, as a space. Plain-text tables (`text_table`) keep text as
    it is."""
    return " ".join(str(text).replace("|", "\\|").splitlines())

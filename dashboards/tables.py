"""Plain-text tables, and the cells of markdown ones (no MLflow or plotting imports: the `a2` command starts fast)."""
from __future__ import annotations

import unicodedata


def display_width(text: str) -> int:
    """Columns `text` takes in a terminal: a wide character (CJK, most emoji) 2, a combining mark 0, others 1; so
    that a study or trial name in Chinese does not shift the columns after it (str.ljust pads by characters)."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def text_table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """The one plain-text table of the project: padded columns (those in `right` right-aligned), a rule under
    the header; widths in terminal columns (`display_width`)."""
    widths = [max(display_width(h), *(display_width(r[i]) for r in rows)) if rows else display_width(h)
              for i, h in enumerate(header)]

    def pad(i: int, cell: str, width: int) -> str:
        fill = " " * (width - display_width(cell))
        return fill + cell if i in right else cell + fill

    line = lambda cells: "  ".join(pad(i, c, w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def markdown_cell(text) -> str:
    """`text` as one cell of a markdown table row: a `|` in it (a label, a config value) escaped as `\\|`, which would
    end the cell; a line break, which would end the row, as a space. Plain-text tables (`text_table`) keep text as
    it is."""
    return " ".join(str(text).replace("|", "\\|").splitlines())

"""Reference pages generated from the code that holds the facts, kept in the repository so that they read on GitHub.

A page holds a generated region: a line `<!-- a2ref: NAME -->`, the Markdown that `GENERATORS[NAME]()` returns, and a
line `<!-- /a2ref -->`. `python3 docs/_ext/a2ref.py` writes every region anew (run it after changing a schema field
or a CLI option); `tests/test_docs.py` fails while a page's region differs from what the code generates, and the
Sphinx build regenerates the regions as it reads the pages, so the site is never stale either. The generators:
- `config`: the `data` / `model` / `train` sections of `a2core.config.Config` (what `a2 train` takes);
- `study-file`: the other top-level keys of `launch.spec.StudySpec`, walked into every nested section;
- `cli`: every subcommand and option of the `a2` parser (`launch.cli.build_parser`);
- `paper-table1`, `paper-table3`: the paper's Table 1 and Table 3 from `dashboards.paper_results`, the one copy of its
  numbers (the leaderboard, the rehearsal and the plan read them there);
- `benchmarks`: `benchmarks/RESULTS.md` below its title, so that docs/results/benchmarks.md holds the figures on
  GitHub too (a Sphinx `{include}` shows there as the bare directive).

The walks are generic (every pydantic field, every argparse action), so a key or a command added to the code
appears here without touching the docs. `undocumented_fields()` lists the fields that have no description; the
build warns about each (and a strict build fails), and `tests/test_docs.py` asserts the list is empty;
`undocumented_options()` does the same for the options, positionals and subcommands of `a2`.
"""
from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

_REPO = Path(__file__).resolve().parents[2]  # the checkout this generator documents
# a generated region: its opening marker, the generated Markdown, the closing marker
REGION = re.compile(r"^<!--\s*a2ref:\s*(?P<name>[a-z0-9-]+)\s*-->\n(?P<body>.*?)^<!--\s*/a2ref\s*-->$", re.M | re.S)
END = "<!-- /a2ref -->"


# -- pydantic models -------------------------------------------------------------------------------------------
def _sections() -> tuple[type[BaseModel], type[BaseModel]]:
    from a2core.config import Config
    from launch.spec import StudySpec

    return Config, StudySpec


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp: Any) -> Any:
    """The type without `Annotated[...]` and without `None` in a union: (type, may be null)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _nullable(tp: Any) -> tuple[Any, bool]:
    tp = _strip(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (_strip(args[0]) if len(args) == 1 else typing.Union[tuple(args)]), True
    return tp, False


def type_name(tp: Any) -> str:
    """A reader's name for a field's type: `integer`, `one of: a, b`, `list of integer`, `[number, number]`."""
    tp, nullable = _nullable(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and set(args) == {int, float}:
        text = "number"
    elif origin is typing.Literal:
        text = "one of: " + ", ".join(f"`{a}`" for a in args)
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(type_name(a) for a in args)
    elif origin in (list, tuple) and args:
        if origin is tuple and Ellipsis not in args:
            text = "[" + ", ".join(type_name(a) for a in args) + "]"
        else:
            text = f"list of {type_name(args[0])}"
    elif origin is dict or tp is dict:
        text = "mapping"
    elif tp is tuple or origin is tuple:
        text = "list"
    elif _is_model(tp):
        text = "mapping"
    else:
        text = {int: "integer", float: "number", bool: "true / false", str: "string", Any: "any"}.get(tp)
        if text is None:
            text = "number" if tp == int | float else getattr(tp, "__name__", str(tp))
    return f"{text} or null" if nullable else text


_BOUND = {annotated_types.Ge: (">=", "ge"), annotated_types.Gt: (">", "gt"), annotated_types.Le: ("<=", "le"),
          annotated_types.Lt: ("<", "lt")}


def _constraints(field) -> list[str]:
    """`>= 1`, `< 1`, `length >= 1`, `matches ^https?://` from the field's metadata (its own and its type's)."""
    out, metadata = [], list(field.metadata)
    tp = field.annotation
    for _ in range(4):  # the element type of a list, then its Annotated metadata
        tp, _null = _nullable(tp)
        if typing.get_origin(tp) is list and typing.get_args(tp):
            tp = typing.get_args(tp)[0]
            metadata += [m for a in typing.get_args(tp)[1:] for m in getattr(a, "metadata", [a])]
    for item in metadata:
        for kind, (sign, attr) in _BOUND.items():
            if isinstance(item, kind):
                out.append(f"{sign} {_value(getattr(item, attr))}")
        if isinstance(item, annotated_types.MinLen):
            out.append(f"length >= {item.min_length}")
        if getattr(item, "pattern", None):
            out.append(f"matches `{item.pattern}`")
    return out


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default(field) -> str:
    if field.default_factory is not None:
        return "(its keys' defaults)" if _is_model(field.default_factory) or callable(field.default_factory) else ""
    if field.default is PydanticUndefined or field.default is None and not _nullable(field.annotation)[1]:
        return "required"  # (a default of None that the type does not allow: the validator asks for a value)
    value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return f"`{_value(value)}`"


def _field_model(field) -> type[BaseModel] | None:
    """The section a field holds, if it holds one (directly, or as the values of a mapping)."""
    tp, _null = _nullable(field.annotation)
    if _is_model(tp):
        return tp
    if typing.get_origin(tp) is dict and _is_model(_strip(typing.get_args(tp)[1])):
        return _strip(typing.get_args(tp)[1])
    return None


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, type[BaseModel]]]:
    """(dotted key, field, owning model) for every field of `model` and of the sections under it, depth first.
    A mapping of sections (`search.space`) is walked under `prefix.<key>`."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        yield key, field, model
        sub = _field_model(field)
        if sub is not None and sub.model_fields:
            is_map = typing.get_origin(_nullable(field.annotation)[0]) is dict
            yield from walk(sub, f"{key}.<key>." if is_map else f"{key}.")


def undocumented_fields() -> list[str]:
    """`Model.field` for every field of the config and study-file schemas that has no description."""
    seen, out = set(), []
    for root in _sections():
        for _key, field, model in walk(root):
            name = next(n for n, f in model.model_fields.items() if f is field)
            if (model, name) not in seen and not (field.description or "").strip():
                out.append(f"{model.__module__}.{model.__name__}.{name}")
            seen.add((model, name))
    return out


def _one_line(text: str) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    lines = ["| key | type | default | range | description |", "|---|---|---|---|---|"]
    for key, field in rows:
        sub = _field_model(field)
        # a field whose validator widens what it takes (an integer for a list, ...) or whose model asks for one of
        # its keys says so itself: `json_schema_extra={"a2_type": ..., "a2_default": ...}`
        said = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        kind = type_name(field.annotation) if sub is None or _is_model(_nullable(field.annotation)[0]) else \
            "mapping of sections"
        kind, default = said.get("a2_type", kind), said.get("a2_default", _default(field))
        lines.append(f"| `{key}` | {kind} | {default} | {', '.join(_constraints(field)) or ''} | "
                     f"{_one_line(field.description)} |")
    return lines


def _model_doc(model: type[BaseModel]) -> str:
    """The model's own docstring (not pydantic's BaseModel one), on one line."""
    return _one_line(model.__dict__.get("__doc__") or "")


def _sections_md(root: type[BaseModel], prefix: str, only: list[str] | None = None, level: int = 2) -> list[str]:
    """One heading and one table per section: the fields of `root` (those in `only`), then each nested section."""
    lines: list[str] = []
    fields = [(n, f) for n, f in root.model_fields.items() if only is None or n in only]
    plain = [(f"{prefix}{f.alias or n}", f) for n, f in fields]
    if plain:
        lines += _table(plain) + [""]
    for name, field in fields:
        sub = _field_model(field)
        if sub is None or not sub.model_fields:
            continue
        is_map = typing.get_origin(_nullable(field.annotation)[0]) is dict
        key = f"{prefix}{field.alias or name}" + (".<key>" if is_map else "")
        lines += [f"{'#' * level} `{key}`", ""]
        if _model_doc(sub):
            lines += [_model_doc(sub), ""]
        lines += _sections_md(sub, key + ".", level=level + 1)
    return lines


def config_md() -> str:
    config, _study = _sections()
    lines = []
    for name, field in config.model_fields.items():
        sub = _field_model(field)
        if sub is None:
            continue
        lines += [f"## `{field.alias or name}`", "", _one_line(field.description), ""]
        if _model_doc(sub):
            lines += [_model_doc(sub), ""]
        lines += _sections_md(sub, f"{field.alias or name}.", level=3)
    rest = [(n, f) for n, f in config.model_fields.items() if _field_model(f) is None]
    if rest:
        lines += ["## Other keys of a plain `a2 train` config", ""] + _table([(f.alias or n, f) for n, f in rest])
    return "\n".join(lines) + "\n"


def study_file_md() -> str:
    config, study = _sections()
    shared = [n for n in study.model_fields if n in config.model_fields]
    own = [n for n in study.model_fields if n not in shared]
    lines = ["## Top-level keys", ""]
    lines += _table([(study.model_fields[n].alias or n, study.model_fields[n]) for n in study.model_fields]) + [""]
    lines += [f"The {', '.join(f'`{n}`' for n in shared)} sections are those of the [config reference](config.md)."]
    lines += [""]
    for name in own:
        field = study.model_fields[name]
        sub = _field_model(field)
        if sub is None or not sub.model_fields:
            continue
        key = field.alias or name
        lines += [f"## `{key}`", ""] + ([_model_doc(sub), ""] if _model_doc(sub) else [])
        lines += _sections_md(sub, f"{key}.", level=3)
    return "\n".join(lines) + "\n"


# -- the `a2` command ---------------------------------------------------------------------------------------------
def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of `parser`, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            out += [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]
    return out


def undocumented_options(parser: argparse.ArgumentParser | None = None, words: tuple[str, ...] = ("a2",)) -> list[str]:
    """`a2 study run --quiet`-style names of every option or positional of the `a2` parser (all subcommands) that
    has no help text, and of every subcommand without one: the CLI reference would show an empty description."""
    if parser is None:
        from launch.cli import build_parser

        parser = build_parser()
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub_help, sub in _subcommands(parser):
                if not sub_help.strip():
                    missing.append(" ".join((*words, name)))
                missing += undocumented_options(sub, (*words, name))
            continue
        # argparse.SUPPRESS hides an option on purpose (kept for old scripts, not read): not a gap
        if action.help is argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            missing.append(" ".join((*words, "/".join(action.option_strings) or action.dest)))
    return missing


def _option_row(action: argparse.Action) -> str | None:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help is argparse.SUPPRESS:
        return None  # argparse.SUPPRESS: hidden on purpose, as `--help` hides it
    if action.option_strings:
        name = ", ".join(action.option_strings)
        if action.nargs != 0:
            name += " " + (action.metavar or action.dest.upper())
    else:
        name = action.metavar or action.dest
    if action.nargs in ("*", "+"):
        name += " ..."
    if action.nargs == 0:
        default = ""
    elif action.required and action.nargs not in ("*", "?"):
        default = "required"
    elif action.default is None or action.default == [] or action.default is argparse.SUPPRESS:
        default = ""
    else:
        # a path inside this checkout reads as the repository's own file, whatever folder it was cloned into
        default = f"`{str(action.default).replace(str(_REPO) + '/', '')}`"
    choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
    help_text = _one_line(action.help if action.help is not argparse.SUPPRESS else "")
    if choices:
        help_text = f"{help_text} (one of {choices})".strip()
    return f"| `{name}` | {default} | {help_text} |"


def _command_md(words: list[str], parser: argparse.ArgumentParser, help_text: str, level: int) -> list[str]:
    lines = [f"{'#' * min(level, 6)} `{' '.join(words)}`", ""]
    if help_text or parser.description:
        lines += [_one_line(parser.description or help_text), ""]
    usage = " ".join(parser.format_usage().split())
    lines += ["```text", usage.removeprefix("usage: "), "```", ""]
    rows = [row for row in map(_option_row, parser._actions) if row]
    if rows:
        lines += ["| argument | default | description |", "|---|---|---|", *rows, ""]
    for name, sub_help, sub in _subcommands(parser):
        lines += _command_md(words + [name], sub, sub_help, level + 1)
    return lines


def cli_md() -> str:
    from launch.cli import build_parser

    parser = build_parser()
    lines = ["| command | what it does |", "|---|---|"]

    def summary(words, p, level):
        for name, sub_help, sub in _subcommands(p):
            if not _subcommands(sub):
                lines.append(f"| `{' '.join(words + [name])}` | {_one_line(sub_help)} |")
            summary(words + [name], sub, level + 1)

    summary(["a2"], parser, 0)
    lines.append("")
    for name, sub_help, sub in _subcommands(parser):
        lines += _command_md(["a2", name], sub, sub_help, level=2)
    return "\n".join(lines) + "\n"


def _paper_cells(values) -> list[str]:
    return ["-" if value is None else f"{value:.1f}" for value in values]  # "-": a dash in the paper


def paper_table1_md() -> str:
    """Table 1 of the paper (offline Karpathy test split): each model's scores after cross-entropy (XE) and after
    CIDEr optimisation (SCST), x100."""
    from dashboards import paper_results as paper

    columns = paper.T1_COLUMNS
    head = ["model", *(f"XE {c}" for c in columns), *(f"SCST {c}" for c in columns)]
    rows = [[name, *_paper_cells(stages["xe"][c] for c in columns), *_paper_cells(stages["scst"][c] for c in columns)]
            for name, stages in paper.TABLE1["rows"].items()]
    return _markdown_table(head, rows)


def paper_table3_md() -> str:
    """Table 3 of the paper (the fusion ablation, cross-entropy, Karpathy val split), one row per `model.fusion`."""
    from dashboards import paper_results as paper

    head = ["`model.fusion`", "the paper's row", *paper.T1_COLUMNS]
    rows = [[f"`{fusion}`", row, *_paper_cells(paper.TABLE3["rows"][row][c] for c in paper.T1_COLUMNS)]
            for fusion, row in paper.TABLE3_ROW.items()]
    return _markdown_table(head, rows)


def _markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def benchmarks_md() -> str:
    """benchmarks/RESULTS.md without its title line (the page has its own): its sections as they are."""
    text = (_REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    first, _, rest = text.partition("\n")
    return (rest if first.startswith("# ") else text).lstrip("\n")


GENERATORS = {"config": config_md, "study-file": study_file_md, "cli": cli_md, "paper-table1": paper_table1_md,
              "paper-table3": paper_table3_md, "benchmarks": benchmarks_md}


# -- Sphinx -------------------------------------------------------------------------------------------------------
def regenerate(text: str, where: str = "page") -> str:
    """`text` with every generated region holding what its generator returns now."""
    def generate(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return f"<!-- a2ref: {name} -->\n{GENERATORS[name]().rstrip()}\n{END}"

    return REGION.sub(generate, text)


def pages(docs: Path) -> list[Path]:
    """The pages of `docs` that hold a generated region."""
    return [p for p in sorted(docs.rglob("*.md")) if REGION.search(p.read_text(encoding="utf-8"))]


def stale_pages(docs: Path) -> list[Path]:
    """The pages whose generated regions differ from what the code generates now."""
    return [p for p in pages(docs) if regenerate(p.read_text(encoding="utf-8"), str(p)) != p.read_text(encoding="utf-8")]


def _source_read(app, docname: str, source: list[str]) -> None:
    source[0] = regenerate(source[0], docname)


def _check_descriptions(app) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    for name in undocumented_fields():
        logger.warning(f"config field without a description: {name} (add Field(description=...))")
    for name in undocumented_options():
        logger.warning(f"CLI option without help text: {name} (add help=... to its add_argument)")


def setup(app) -> dict:
    app.connect("builder-inited", _check_descriptions)
    app.connect("source-read", _source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":  # python3 docs/_ext/a2ref.py [--check]: write (or only check) the generated regions
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    docs_dir = Path(__file__).resolve().parents[1]
    stale = stale_pages(docs_dir)
    if "--check" in sys.argv[1:]:
        print("\n".join(f"stale: {p}" for p in stale) or "every generated region is current")
        sys.exit(1 if stale else 0)
    for page in stale:
        page.write_text(regenerate(page.read_text(encoding="utf-8"), str(page)), encoding="utf-8")
        print(f"wrote {page}")

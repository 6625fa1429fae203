"""The house's shape, checked on every import statement of a2core/, launch/ and dashboards/, function-level ones
included, and on every handler the `a2` command names as "module:function" (imported when its subcommand runs): no
module reaches itself again through imports (an import inside a function, or by name, is still an arrow), the
layers import downwards only (DESIGN.md), and the storage layout and the study record sit under the trial, the
driver and the MLflow export instead of on top of them."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("a2core", "launch", "dashboards")


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


HANDLER = re.compile(r"^(a2core|launch|dashboards)(\.\w+)+:\w+$")  # "launch.study:cmd_run"


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file, or names as "module:function" (the `a2`
    command's handlers, launch/cli.py) (packages' __init__ left out)."""
    modules = module_files()

    def owner(name: str) -> str | None:  # the project module a dotted name refers to, if any
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:  # `from pkg import module` names a module; `from module import x` does not
                    targets.add(owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else owner(base))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and HANDLER.match(node.value):
                targets.add(owner(node.value.partition(":")[0]))
        graph[name] = {t for t in targets if t and t != name and t not in PACKAGES}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_function_level_imports_and_named_handlers(graph):
    # launch.cli names "launch.study:cmd_run", imported only when `a2 study run` runs: an arrow all the same
    assert {"launch.study", "launch.spec", "launch.show", "dashboards.tracking"} <= graph["launch.cli"]
    # launch.plan imports launch.record inside `_noise` only (a plan reads no record unless asked): an arrow too
    assert "launch.record" in graph["launch.plan"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_layers_import_downwards(graph):
    """a2core imports nothing of ours; dashboards (the read side) is handed records and imports no launch/ module."""
    for module, targets in graph.items():
        if module.startswith("a2core"):
            assert all(t.startswith("a2core") for t in targets), (module, targets)
        if module.startswith("dashboards"):
            assert not any(t.startswith("launch") for t in targets), (module, targets)


WRITE_SIDE = {"launch.trainable", "launch.driver", "launch.mlflow_export", "launch.mlflow_callback", "launch.study",
              "launch.cli", "launch.pipeline", "launch.package", "launch.search", "launch.submit"}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_storage_layout_is_the_ground_floor(graph):
    assert not {t for t in graph["launch.layout"] if t.startswith(("launch", "dashboards"))}


def test_the_record_sits_under_the_trial_the_driver_and_the_export(graph):
    """What the record reads it takes from the layout, never from the modules that write it."""
    assert not reachable(graph, "launch.record") & (WRITE_SIDE - {"launch.search"}), \
        sorted(reachable(graph, "launch.record") & WRITE_SIDE)


def test_the_design_page_names_every_module():
    page = (ROOT / "docs" / "explanation" / "design.md").read_text()
    missing = [f"{name}" for name, path in module_files().items()
               if path.name != "__init__.py" and f"`{path.name}`" not in page]
    assert not missing, f"docs/explanation/design.md does not name {missing}"


# import name -> the distribution the design page names for it
DISTRIBUTIONS = {"yaml": "pyyaml", "botocore": "boto3"}


def third_party_imports(package: str) -> set[str]:
    import sys

    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    ours = {*PACKAGES, "__future__"}
    return {DISTRIBUTIONS.get(n, n) for n in names if n not in sys.stdlib_module_names and n not in ours}


def test_the_design_pages_third_party_column_is_what_each_package_imports():
    page = (ROOT / "docs" / "explanation" / "design.md").read_text()
    for package in PACKAGES:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{package}/` |"))  # "Who imports whom"
        named = {name.strip() for name in row.strip("|").split("|")[2].split(",")}
        assert named == third_party_imports(package), (package, sorted(named), sorted(third_party_imports(package)))

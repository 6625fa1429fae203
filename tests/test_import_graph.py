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


HANDLER = re.compile(r"^(a2core|launch|dashboards)(\.\w+)+:\w+$")  # "launch.commands.study:cmd_run"


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
    # launch.cli names "launch.commands.study:cmd_run", imported only when `a2 study run` runs: an arrow all the same
    assert {"launch.commands.study", "launch.commands.validate", "launch.commands.show"} <= graph["launch.cli"]
    # launch.plan imports launch.record inside `study_noise` only (a plan reads no record unless asked): an arrow too
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


DISPATCHER = "launch.cli"  # the `a2` command's parser: names every handler, imported by nothing of ours


def commands(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if m.startswith("launch.commands.")}


WRITE_SIDE = {"launch.trainable", "launch.driver", "launch.mlflow_export", "launch.mlflow_callback", "launch.package",
              "launch.search", DISPATCHER} | commands(import_graph())


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_commands_only_compose_parts(graph):
    """A command (launch/commands/) imports no other command; a part (every other module of ours) imports no command
    and not the parser; the parser names handlers in launch/commands/ only."""
    names = commands(graph)
    assert {"launch.commands.study", "launch.commands.show", "launch.commands.package"} <= names
    for command in names:
        assert not graph[command] & (names | {DISPATCHER}), (command, sorted(graph[command] & names))
    for part in set(graph) - names - {DISPATCHER}:
        assert not graph[part] & (names | {DISPATCHER}), (part, sorted(graph[part] & (names | {DISPATCHER})))
    assert {t for t in graph[DISPATCHER] if t.startswith(("launch", "dashboards"))} - names == {"launch.defaults"}


def test_handlers_live_in_commands():
    """No part defines a function that takes the parsed arguments (`def f(args)`): reading the command line is a
    command's, so a part's functions take values a caller from Python can give."""
    found = []
    for name, path in module_files().items():
        if name.startswith("launch.commands") or name == DISPATCHER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and [a.arg for a in node.args.args][:1] == ["args"]:
                found.append(f"{name}.{node.name}")
    assert not found, found


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


# MLflow's methods that create, change or delete what a tracking store holds (runs, experiments, registered models),
# on `MlflowClient` and the fluent `mlflow` module alike; the read side only searches and reads what `launch/` writes
# (`launch/tracking_writer.py`, `launch/model_registry.py`, `launch/mlflow_server.py`).
MLFLOW_WRITES = frozenset({
    "create_experiment", "set_experiment", "set_experiment_tag", "set_experiment_tags", "delete_experiment_tag",
    "delete_experiment", "restore_experiment", "rename_experiment",
    "start_run", "end_run", "create_run", "update_run", "set_terminated", "delete_run", "restore_run",
    "log_batch", "log_metric", "log_metrics", "log_param", "log_params", "set_tag", "set_tags", "delete_tag",
    "log_artifact", "log_artifacts", "log_dict", "log_text", "log_figure", "log_image", "log_table", "log_input",
    "log_inputs", "log_model",
    "create_registered_model", "create_model_version", "update_model_version", "delete_model_version",
    "set_model_version_tag", "set_registered_model_tag", "set_registered_model_alias",
    "transition_model_version_stage"})


def mlflow_writes(path: Path) -> list[str]:
    """"line: name" of each MLflow writing method that `path` calls, imports or defines (an attribute, an imported
    name or a function of that name), and each "mlflow server" it starts (["-m", "mlflow", "server", ...])."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            names = ["mlflow server"] if any(words[i:i + 2] == ["mlflow", "server"] for i in range(len(words))) else []
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name in MLFLOW_WRITES or name == "mlflow server"]
    return found


def test_the_read_side_writes_nothing_to_mlflow():
    """dashboards/ reads MLflow; the writer, the model registration and `a2 mlflow serve` live in launch/."""
    writes = {name: found for name, path in module_files().items()
              if name.startswith("dashboards") and (found := mlflow_writes(path))}
    assert writes == {}
    sample = ROOT / "launch" / "tracking_writer.py"  # the check sees the writer where it is
    assert {"create_run", "set_terminated", "log_batch", "set_tag", "log_artifact"} <= \
        {hit.partition(": ")[2] for hit in mlflow_writes(sample)}


# -- borders: storage clients, private names, the record's imports ----------------------------------------------
def third_party_names(path: Path) -> set[str]:
    """The top-level names of the absolute imports of a file that are not ours (function-level ones included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - set(PACKAGES)


STORAGE_CLIENTS = {"pyarrow", "botocore", "boto3"}


def test_only_the_storage_layer_imports_pyarrow_and_boto3():
    """Every storage access goes through `launch/storage.py`: no other module imports pyarrow, boto3 or botocore.
    Where Ray reads storage itself (`storage_filesystem`, a `Checkpoint`'s filesystem) it is handed the storage
    layer's `Location.filesystem`."""
    importers = {name for name, path in module_files().items() if third_party_names(path) & STORAGE_CLIENTS}
    assert importers == {"launch.storage"}


def private_uses(module: str, source: str, modules: set[str]) -> list[str]:
    """The private names (`_x`, not `__x__`) of other project modules that `source`, the text of `module`, uses:
    imported by name (`from m import _x`) or read off an imported module (`m._x`, `launch.m._x`)."""
    package = module.rpartition(".")[0]
    bound: dict[str, str] = {}  # a name in `source` -> the project module it is bound to
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if alias.name.startswith("_") and not alias.name.startswith("__") and base != module:
                    found.append(f"{module}: from {base} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            parts, value = [], node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *parts])
                if owner in modules | set(PACKAGES) and owner != module:
                    found.append(f"{module}: {owner}.{node.attr}")
    return found


def test_the_private_name_check_sees_both_ways_in():
    source = ("import launch.plan as plan\nimport launch.layout\nfrom launch import spec\n"
              "from launch.conclusions import _fmt, table_row\n"
              "def f(location):\n    return plan._noise, launch.layout._x, spec._study_name, location._errors\n")
    modules = {"launch.plan", "launch.layout", "launch.spec", "launch.conclusions", "launch.rehearse"}
    assert sorted(private_uses("launch.rehearse", source, modules)) == [
        "launch.rehearse: from launch.conclusions import _fmt", "launch.rehearse: launch.layout._x",
        "launch.rehearse: launch.plan._noise", "launch.rehearse: launch.spec._study_name"]


def test_no_private_name_crosses_modules():
    """A name another module uses is public in the module that owns it (`launch.spec.validate_study_name`, not
    `_study_name`)."""
    modules = module_files()
    found = [use for name, path in modules.items() for use in private_uses(name, path.read_text(), set(modules))]
    assert found == []


def test_the_record_loads_no_optuna_or_ray(graph):
    """The record is read by `a2 study status|compare` and `a2 report`: no module it reaches (function-level imports
    counted) imports Optuna or Ray."""
    modules = module_files()
    loaders = {m for m in reachable(graph, "launch.record") | {"launch.record"}
               if third_party_names(modules[m]) & {"optuna", "ray"}}
    assert loaders == set()


# -- one reader of a study's state ------------------------------------------------------------------------------------
STATE_CACHE_NAMES = ("SUMMARY_FILE", "DIGEST_FILE", "read_summary")
# who may name summary.json, the record's digest or the summary's reader (launch/record.py's docstring: the caches
# and their rules): the record (the digest), where the files are named and summary.json is written (location), the
# summary's reader (conclusions), the driver that writes it at the end of a run and reads its `tracking` state
# (driver), and `a2 mlflow sync`, which writes its `tracking` state back (commands.study)
STATE_CACHE_MODULES = {"launch.record", "launch.location", "launch.conclusions", "launch.driver", "launch.commands.study"}


def state_cache_users(source: str) -> set[str]:
    """The names of STATE_CACHE_NAMES a module's code uses (imported, called or read off a module)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in STATE_CACHE_NAMES:
            used.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in STATE_CACHE_NAMES:
            used.add(node.attr)
        elif isinstance(node, ast.alias) and node.name in STATE_CACHE_NAMES:
            used.add(node.name)
    return used


def test_the_state_cache_check_sees_names_and_attributes():
    assert state_cache_users("from launch.location import SUMMARY_FILE as S\nx = location.DIGEST_FILE\n"
                             "read_summary(loc)") == {"SUMMARY_FILE", "DIGEST_FILE", "read_summary"}
    assert state_cache_users("summary = record.summary()  # summary.json") == set()


def test_only_the_record_and_the_summarys_writers_name_the_state_caches():
    """Every module that needs a study's trials loads the record (`launch.record.StudyRecord.load`); summary.json and
    the digest are caches of it, named only where they are written or their rule says they are read."""
    users = {name for name, path in module_files().items() if state_cache_users(path.read_text())}
    assert users == STATE_CACHE_MODULES

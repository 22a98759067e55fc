"""The optimizer's own vote path and the planner stand on the vote code, not on the compatibility layer.

``ds_lioncub/comm/backend.py`` (the public ``CompressedBackend``) and ``ds_lioncub/comm/legacy.py`` (1-bit
Adam's ``compressed_allreduce``) are the compatibility layer: they are built on the vote code
(``comm.votes``, ``comm.quantize``, ``comm.schedule``), never the other way round, so that the layer can
change or go without touching the aggregations or the planner (issue #23, item 3). The names that moved
stay importable from their old module, as the same objects.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPATIBILITY_MODULES = {"ds_lioncub.comm.backend", "ds_lioncub.comm.legacy"}
# What `from ds_lioncub.comm import NAME` would take from the compatibility layer.
COMPATIBILITY_NAMES_IN_COMM = {"backend", "legacy", "CompressedBackend", "legacy_padded_numel"}
VOTE_PATH_FILES = sorted(
    [*(REPO / "ds_lioncub" / "aggregation").glob("*.py"), *(REPO / "ds_lioncub" / "planner").glob("*.py")], key=str
)


def _imports(path: Path) -> list[str]:
    """Every module (and ``module.name`` for ``from ds_lioncub.comm import name``) that ``path`` imports,
    at the top or inside a function."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.append(node.module)
            if node.module == "ds_lioncub.comm":
                found += [f"ds_lioncub.comm.{alias.name}" for alias in node.names]
    return found


def test_the_import_scan_sees_the_layer_where_it_is_imported() -> None:
    """A control: the scan finds the compatibility layer in a module known to import it."""
    assert "ds_lioncub.comm.legacy" in _imports(REPO / "ds_lioncub" / "comm" / "backend.py")
    assert "ds_lioncub.comm.backend" in _imports(REPO / "ds_lioncub" / "comm" / "__init__.py")


@pytest.mark.parametrize("path", VOTE_PATH_FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_aggregation_and_planner_import_nothing_from_the_compatibility_layer(path: Path) -> None:
    imported = set(_imports(path))
    assert not imported & COMPATIBILITY_MODULES, f"{path.name} imports {sorted(imported & COMPATIBILITY_MODULES)}"
    taken = {f"ds_lioncub.comm.{name}" for name in COMPATIBILITY_NAMES_IN_COMM} & imported
    assert not taken, f"{path.name} takes {sorted(taken)} from ds_lioncub.comm"


def test_the_aggregation_and_planner_files_are_all_scanned() -> None:
    names = {str(path.relative_to(REPO / "ds_lioncub")) for path in VOTE_PATH_FILES}
    aggregations = {"aggregation/exact_mean.py", "aggregation/one_bit_vote.py", "aggregation/kbit_vote.py"}
    planner = {"planner/model.py", "planner/auto.py", "planner/calibrate.py", "planner/cli.py"}
    assert aggregations | {"aggregation/error_feedback.py"} | planner <= names


def test_the_moved_names_are_still_importable_from_their_old_module_as_the_same_objects() -> None:
    from ds_lioncub.comm import backend, quantize, schedule

    assert backend.l1_segment_scales is quantize.l1_segment_scales
    assert backend.DEFAULT_PIPELINE_CHUNK_NUMEL == schedule.DEFAULT_PIPELINE_CHUNK_NUMEL == 8 * 1024 * 1024
    assert {"l1_segment_scales", "DEFAULT_PIPELINE_CHUNK_NUMEL"} <= set(backend.__all__)


# ---------------------------------------------------------------------------------------------- one maker of transports

TRANSPORT_CLASSES = {"TorchTransport", "MpiTransport"}
TRANSPORT_MAKER = REPO / "ds_lioncub" / "comm" / "transport" / "__init__.py"


def _constructed_transports(path: Path) -> list[tuple[int, str]]:
    """(line, class) of every call of a transport class by name in ``path`` (``TorchTransport(...)``,
    ``transport.TorchTransport(...)``)."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
            if name in TRANSPORT_CLASSES:
                calls.append((node.lineno, name))
    return calls


def test_the_construction_scan_finds_the_transport_maker() -> None:
    """A control: make_transport's own module does build both transports."""
    assert {name for _, name in _constructed_transports(TRANSPORT_MAKER)} == TRANSPORT_CLASSES


def test_transports_are_built_only_by_make_transport() -> None:
    built = {
        str(path.relative_to(REPO)): calls
        for path in sorted((REPO / "ds_lioncub").rglob("*.py"))
        if path != TRANSPORT_MAKER and (calls := _constructed_transports(path))
    }
    assert built == {}


# ---------------------------------------------------------------------------------------------- no import cycles

PACKAGE = REPO / "ds_lioncub"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the ds_lioncub modules it names in an import: at the top, inside a function or under
    ``TYPE_CHECKING`` alike (``from package import name`` counts as importing ``package.name`` where that is a
    module). The parent packages Python imports on the way are not edges: they are not what a module asks for."""
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    named.add(child if child in modules else node.module)
        graph[name] = {module for module in named if module in modules and module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_the_cycle_scan_finds_a_cycle_in_a_package_that_has_one(tmp_path: Path) -> None:
    """A control: two modules that import each other (one of them only inside a function), beside one that
    imports a package's re-export, which is no cycle."""
    package = tmp_path / "ds_lioncub"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from ds_lioncub.sub.leaf import x\n")
    (package / "sub" / "leaf.py").write_text("x = 1\n")
    (package / "first.py").write_text("from ds_lioncub.second import y\n")
    (package / "second.py").write_text("def y():\n    from ds_lioncub import first\n")
    (package / "third.py").write_text("from ds_lioncub.sub import x\nfrom ds_lioncub.sub.leaf import x as z\n")
    assert _cycles(_import_graph(package)) == [["ds_lioncub.first", "ds_lioncub.second"]]


def test_ds_lioncub_has_no_import_cycles() -> None:
    assert _cycles(_import_graph(PACKAGE)) == []


# ---------------------------------------------------------------------------------------------- moved module paths

MOVED = {
    "ds_lioncub.aggregation_state": "ds_lioncub.aggregation.state",
    "ds_lioncub.error_feedback": "ds_lioncub.aggregation.error_feedback",
    "ds_lioncub.config_reference": "ds_lioncub.config.reference",
    "ds_lioncub.config_rules": "ds_lioncub.config.rules",
    "ds_lioncub.config_sections": "ds_lioncub.config.sections",
    "ds_lioncub.config_types": "ds_lioncub.config.strict_types",
    "ds_lioncub.step_paths": "ds_lioncub.step.paths",
    "ds_lioncub.bucket_work": "ds_lioncub.step.bucket_work",
    "ds_lioncub.buckets": "ds_lioncub.step.bucket_plan",
    "ds_lioncub.overlap": "ds_lioncub.step.overlap",
    "ds_lioncub.post_step": "ds_lioncub.step.post_step",
    "ds_lioncub.local_state": "ds_lioncub.step.local_state",
    "ds_lioncub.optimizer_setup": "ds_lioncub.step.setup",
    "ds_lioncub.param_selection": "ds_lioncub.step.param_selection",
    "ds_lioncub.fingerprint": "ds_lioncub.consistency.fingerprint",
    "ds_lioncub.replica_check": "ds_lioncub.consistency.replica_check",
}


def test_every_moved_path_is_gone_from_the_package_root() -> None:
    for old in MOVED:
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), old


def test_the_moved_modules_import_from_their_old_paths_as_themselves_with_a_deprecation_warning() -> None:
    """In a fresh interpreter, so no earlier import has filled ``sys.modules``: ``import OLD`` warns once,
    naming the new path and pointing at the import statement, and gives the module at the new path."""
    script = """
import importlib, json, sys, warnings
problems = []
for old, new in json.loads(sys.argv[1]).items():
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        exec(f"import {old} as moved")
    module = importlib.import_module(new)
    if not (moved is module and sys.modules[old] is module and module.__spec__.name == new):
        problems.append(f"{old}: {moved!r} is not {module!r} or its spec is {module.__spec__!r}")
    mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    if len(mine) != 1 or new not in str(mine[0].message) or mine[0].filename != "<string>":
        problems.append(f"{old}: warnings {[(str(w.message), w.filename) for w in caught]}")
print("\\n".join(problems))
"""
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(MOVED)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ""

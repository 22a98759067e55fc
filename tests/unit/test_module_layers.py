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


def _imported_from(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute name of what ``from X import ...`` in ``module`` (at ``path``) imports from: ``X`` itself, or,
    for a relative import (``from . import a``, ``from ..b import c``), ``X`` resolved against the package
    ``module`` is in (``module`` itself for an ``__init__.py``), one package up for each dot after the first."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the ds_lioncub modules it names in an import, absolute or relative: at the top, inside a function
    or under ``TYPE_CHECKING`` alike (``from package import name`` counts as importing ``package.name`` where that
    is a module). The parent packages Python imports on the way are not edges: they are not what a module asks
    for."""
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                source = _imported_from(node, name, path)
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    named.add(child if child in modules else source)
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


def test_the_cycle_scan_follows_relative_imports(tmp_path: Path) -> None:
    """A control: a cycle made of relative imports only (``from ..second import y`` one way, ``from .sub import
    first`` inside a function the other), beside relative imports that make none (a package re-exporting its
    leaf, a sibling importing that leaf with ``from . import leaf``)."""
    package = tmp_path / "ds_lioncub"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (package / "sub" / "leaf.py").write_text("x = 1\n")
    (package / "sub" / "first.py").write_text("from ..second import y\n")
    (package / "sub" / "sibling.py").write_text("from . import leaf\nfrom .. import second as s\n")
    (package / "second.py").write_text("def y():\n    from .sub import first\n")
    graph = _import_graph(package)
    assert graph["ds_lioncub.sub"] == {"ds_lioncub.sub.leaf"}
    assert graph["ds_lioncub.sub.first"] == {"ds_lioncub.second"}
    assert graph["ds_lioncub.second"] == {"ds_lioncub.sub.first"}
    assert graph["ds_lioncub.sub.sibling"] == {"ds_lioncub.sub.leaf", "ds_lioncub.second"}
    assert _cycles(graph) == [["ds_lioncub.second", "ds_lioncub.sub.first"]]


def test_ds_lioncub_has_no_import_cycles() -> None:
    assert _cycles(_import_graph(PACKAGE)) == []


def test_the_virtual_world_takes_no_rule_from_the_deepspeed_wiring() -> None:
    """simulate/ applies the job's rules (which clipping runs, what the ZeRO hybrid refuses) from config/, where
    the wiring takes them too, not from integration/ (which imports DeepSpeed)."""
    graph = _import_graph(PACKAGE)
    taken = {
        (module, imported)
        for module, names in graph.items()
        if module.startswith("ds_lioncub.simulate")
        for imported in names
        if imported.startswith("ds_lioncub.integration")
    }
    assert taken == set()
    assert "ds_lioncub.config.rules" in graph["ds_lioncub.simulate.ds_config"]  # a control: the rule's source


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
    "ds_lioncub.op_builder": "ds_lioncub.kernels.builders",
    "ds_lioncub.deepspeed_integration": "ds_lioncub.integration",
    "ds_lioncub.comm.packing.builders": "ds_lioncub.kernels.builders",
    "ds_lioncub.comm.packing.jit_cache": "ds_lioncub.kernels.jit_cache",
    "ds_lioncub.comm.packing.cuda_build_check": "ds_lioncub.kernels.cuda_build_check",
    "ds_lioncub.comm.packing.compiled": "ds_lioncub.kernels.compiled",
    "ds_lioncub.comm.packing.self_check": "ds_lioncub.kernels.self_check",
    "ds_lioncub.comm.packing.self_check_cases": "ds_lioncub.kernels.self_check_cases",
    "ds_lioncub.units": "ds_lioncub.quantities.units",
    "ds_lioncub.student_t": "ds_lioncub.quantities.student_t",
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


def test_the_finder_knows_every_moved_path() -> None:
    from ds_lioncub._moved import MOVED_MODULES

    assert MOVED_MODULES == MOVED


def test_python_dash_m_on_a_moved_path_runs_the_new_module() -> None:
    """``python -m OLD`` runs the module at its new path as ``__main__`` and says where it moved, on stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "ds_lioncub.comm.packing.cuda_build_check", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: python -m ds_lioncub.kernels.cuda_build_check" in done.stdout
    assert "ds_lioncub.comm.packing.cuda_build_check moved to ds_lioncub.kernels.cuda_build_check" in done.stderr


# ---------------------------------------------------------------------------------------------- the kernels' package


def test_comm_packing_holds_only_the_packing_for_communication() -> None:
    """The builds, the JIT cache, the build check, the self-check and the compiled kernels live in kernels/;
    comm/packing/ keeps the entry point, the layouts, the dispatch and the implementations
    that are not compiled here (torch, cupy), and the sketch's device order."""
    packing = {path.name for path in (PACKAGE / "comm" / "packing").glob("*.py")}
    assert packing == {
        "__init__.py",
        "layout.py",
        "dispatch.py",
        "torch_impl.py",
        "cupy_impl.py",
        "device_sketch.py",
    }
    kernels = {path.name for path in (PACKAGE / "kernels").glob("*.py")}
    assert {"builders.py", "jit_cache.py", "cuda_build_check.py", "compiled.py", "self_check.py"} <= kernels


def test_the_kernels_build_on_the_packing_contract_not_on_its_entry_point() -> None:
    """kernels/ implements comm/packing's contract (layout.py), is held to its reference (torch_impl.py) and takes
    the L1 quantizer's scale from comm/quantize.py, and comm/packing/dispatch.py hands its kernels out: kernels/
    never imports the packing entry point or the dispatch, so the two packages make no cycle."""
    graph = _import_graph(PACKAGE)
    taken = {
        (module, imported)
        for module, names in graph.items()
        if module.startswith("ds_lioncub.kernels")
        for imported in names
        if imported.startswith("ds_lioncub.comm")
    }
    allowed = {"ds_lioncub.comm.packing.layout", "ds_lioncub.comm.packing.torch_impl", "ds_lioncub.comm.quantize"}
    assert {imported for _, imported in taken} <= allowed, sorted(taken)
    assert ("ds_lioncub.kernels.compiled", "ds_lioncub.comm.packing.layout") in taken  # a control


def test_the_package_root_holds_at_most_ten_modules() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= 10, sorted(path.name for path in PACKAGE.glob("*.py"))


def test_the_op_builders_first_home_still_gives_every_name_it_exported() -> None:
    """``ds_lioncub.op_builder`` is ``ds_lioncub.kernels.builders`` now, and still gives the package logger it
    re-exported."""
    script = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from ds_lioncub.op_builder import BUILD_VAR, PACKAGE_DIR, REPO_DIR, LionCubPackingCPUBuilder, "
        "LionCubPackingCUDABuilder, builders, default_build_root, get_logger, ops_dir\n"
        "from ds_lioncub._logging import get_logger as logger\n"
        "from ds_lioncub.kernels.builders import builders as new\n"
        "assert get_logger is logger and builders is new and (PACKAGE_DIR / 'kernels' / 'builders.py').is_file()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

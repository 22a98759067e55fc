"""The optimizer's own vote path and the planner stand on the vote code, not on the compatibility layer.

``ds_lioncub/comm/backend.py`` (the public ``CompressedBackend``) and ``ds_lioncub/comm/legacy.py`` (1-bit
Adam's ``compressed_allreduce``) are the compatibility layer: they are built on the vote code
(``comm.votes``, ``comm.quantize``, ``comm.schedule``), never the other way round, so that the layer can
change or go without touching the aggregations or the planner (issue #23, item 3). The names that moved
stay importable from their old module, as the same objects.
"""

from __future__ import annotations

import ast
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

"""The module paths that moved into sub-packages keep importing, with a ``DeprecationWarning``.

``import ds_lioncub.aggregation_state`` (or ``from ds_lioncub.fingerprint import ...``) gives the module at
its new path itself, not a copy: the same classes and functions (so ``isinstance``, pickles and
``monkeypatch`` see one object), found by the finder below instead of one re-export file per old path at
the package's root. The old paths will be removed in 0.3.0. ``python -m OLD`` runs the new module's code
as ``__main__`` and says on stderr where it moved (``python -m ds_lioncub.comm.packing.cuda_build_check``
runs ``ds_lioncub.kernels.cuda_build_check``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from types import CodeType, FrameType, ModuleType

#: old module path -> the module's path now.
MOVED_MODULES = {
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
    # 0.2.x: the kernels' own package, the quantities, and the two re-export modules of 0.1
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


def _importer_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised in :meth:`MovedModuleFinder.create_module` at the code that
    imported the old path: the first frame outside this module and importlib. ``warnings`` skips importlib's
    bootstrap frames by itself, so they are not counted."""
    importlib_dir = os.path.dirname(importlib.__file__)
    level = 1  # create_module
    frame: FrameType | None = sys._getframe(2)  # what called create_module
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
            if filename != __file__ and not filename.startswith(importlib_dir):
                return level
        frame = frame.f_back
    return 2


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path of :data:`MOVED_MODULES` with the module at its new path."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        # The new module's file as the origin: ``python -m OLD`` sets sys.argv[0] to it.
        new_spec = importlib.util.find_spec(MOVED_MODULES[fullname])
        return importlib.machinery.ModuleSpec(fullname, self, origin=new_spec.origin if new_spec else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new_path = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new_path}; import it from there (the old path will be removed in 0.3.0)",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        module = importlib.import_module(new_path)
        self._own_specs[spec.name] = module.__spec__
        return module

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m OLD`` (runpy asks the loader for the code, and runs it as ``__main__``): the new module's
        code, after a line on stderr (a warning raised here would point into runpy, where it is not shown)."""
        new_path = MOVED_MODULES[fullname]
        print(
            f"{fullname} moved to {new_path}: run python -m {new_path} (the old path will be removed in 0.3.0)",
            file=sys.stderr,
        )
        new_spec = importlib.util.find_spec(new_path)
        loader = None if new_spec is None else new_spec.loader
        return loader.get_code(new_path) if isinstance(loader, importlib.abc.InspectLoader) else None

    def exec_module(self, module: ModuleType) -> None:
        # Creating it under the old path set the module's __spec__ to the old path's: it gets its own back.
        old_spec = module.__spec__
        assert old_spec is not None
        module.__spec__ = self._own_specs.pop(old_spec.name)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once: it answers the old paths only, and before any other
    finder could find a stale copy of an old module (an older install, an editable checkout's leftovers)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())

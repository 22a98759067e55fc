"""The compiled kernels of ``ops/csrc``: their builds, their checks, and the implementation that calls them.

The packing entry point (:mod:`ds_lioncub.comm.packing`) hands its operations to one implementation per device
type; this package holds the compiled one and everything it takes to build and trust it:

- :mod:`.builders` the DeepSpeed op builders, CPU and CUDA (``from ds_lioncub.kernels.builders import
  LionCubPackingCPUBuilder``; ``ds_lioncub.op_builder``, their first home, imports this module until 0.3.0,
  with a ``DeprecationWarning``);
- :mod:`.jit_cache` JIT builds in one immutable directory per build key;
- :mod:`.cuda_build_check` the CUDA op compiled and linked without a GPU (``python -m
  ds_lioncub.kernels.cuda_build_check``, ``make check-cuda``);
- :mod:`.compiled` the kernels as a packing implementation, the fused Lion step and option clip's sketch among them;
- :mod:`.self_check` and :mod:`.self_check_cases` the first-use check of a compiled (or cupy) implementation
  against the torch reference (:mod:`ds_lioncub.comm.packing.torch_impl`).

The kernels implement the contract of :mod:`ds_lioncub.comm.packing.layout` and are held to its torch reference;
:mod:`ds_lioncub.comm.packing.dispatch` hands them out. Importing this package imports none of them.
"""

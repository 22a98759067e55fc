"""Moving bytes between data-parallel ranks, and counting them.

A transport offers the three collectives the compressed backend needs (``all_to_all``,
``all_gather``, ``all_reduce_sum``), blocking or issued (``start_*`` then ``wait``), its
``world_size``, ``rank`` and traffic ``stats``.
:func:`make_transport` picks one by ``comm_backend_name``:

- ``"torch"``: :class:`TorchTransport` (``torch_dist.py``) runs them on a torch.distributed
  process group. Without an initialised process group it is a world of one, where every
  collective is a copy and nothing is counted as sent.
- ``"mpi"``: :class:`MpiTransport` (``mpi.py``) runs them over mpi4py (blocking only, so far).

Both share :class:`TransportBase` (``base.py``): the world of one, the rank-order floating-point sum
and the byte accounting, which counts what a bandwidth-optimal algorithm sends per rank, by the
formulas in :mod:`ds_lioncub.comm.wire`. Both transports therefore count the same bytes for the
same call and compute bit-identical results.
"""

from __future__ import annotations

import torch.distributed as dist

from ds_lioncub.comm.transport.base import (
    COMMUNICATING_METHODS,
    CommStats,
    InFlight,
    Transport,
    TransportBase,
    sum_rows_in_rank_order,
)
from ds_lioncub.comm.transport.levels import LevelledSum, Summing
from ds_lioncub.comm.transport.mpi import (
    MPI_INSTALL_HINT,
    MpiTransport,
    RankLayout,
    check_rank_layout,
    import_mpi,
    mpi_cuda_support,
)
from ds_lioncub.comm.transport.torch_dist import TorchTransport
from ds_lioncub.comm.vocabulary import COMM_BACKENDS
from ds_lioncub.errors import LionCubConfigError, MpiSetupError


def cuda_aware_conflict(comm_backend_name: str, cuda_aware: bool) -> str | None:
    """Why ``cuda_aware`` cannot be combined with ``comm_backend_name`` (``None``: it can).

    Only the MPI transport hands device buffers to a library that may not read them. The message
    has no "LionCub: " prefix and no final period, so that a config validator can embed it.
    """
    if not cuda_aware or comm_backend_name == "mpi":
        return None
    return (
        f"cuda_aware=True only applies to comm_backend_name='mpi' (comm_backend_name is "
        f"{comm_backend_name!r}, whose torch.distributed backend reads device memory itself); "
        f"set comm_backend_name='mpi' or drop cuda_aware"
    )


def make_transport(
    process_group: dist.ProcessGroup | None = None, comm_backend_name: str = "torch", cuda_aware: bool = False
) -> Transport:
    """The transport named ``comm_backend_name`` ("torch" or "mpi") over ``process_group``."""
    if comm_backend_name not in COMM_BACKENDS:
        raise LionCubConfigError(
            f"LionCub: comm_backend_name must be one of {list(COMM_BACKENDS)}, got {comm_backend_name!r}."
        )
    conflict = cuda_aware_conflict(comm_backend_name, cuda_aware)
    if conflict is not None:
        raise LionCubConfigError(f"LionCub: {conflict}.")
    if comm_backend_name == "mpi":
        return MpiTransport(process_group, cuda_aware=cuda_aware)
    return TorchTransport(process_group)


__all__ = [
    "COMMUNICATING_METHODS",
    "COMM_BACKENDS",
    "MPI_INSTALL_HINT",
    "CommStats",
    "InFlight",
    "LevelledSum",
    "MpiSetupError",
    "MpiTransport",
    "RankLayout",
    "Summing",
    "TorchTransport",
    "Transport",
    "TransportBase",
    "check_rank_layout",
    "cuda_aware_conflict",
    "import_mpi",
    "make_transport",
    "mpi_cuda_support",
    "sum_rows_in_rank_order",
]

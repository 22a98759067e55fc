"""The transport over MPI (mpi4py), and the checks that an MPI job can serve the data-parallel group.

mpi4py is imported only when an :class:`MpiTransport` is built, so ``comm_backend_name="torch"``
needs neither mpi4py nor an MPI library. How to launch an MPI job is in docs/user-guide.md's "MPI
transport" section.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport.base import TransportBase, torch_distributed_initialised
from ds_lioncub.errors import MissingDependencyError, MpiSetupError

MPI_INSTALL_HINT = 'pip install "ds_lioncub[mpi]"'


def import_mpi() -> Any:
    """mpi4py's ``MPI`` module (importing it initialises MPI), or a :class:`MissingDependencyError` naming the fix."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise MissingDependencyError(
            f"LionCub: comm_backend_name='mpi' needs mpi4py, which cannot be imported ({error}). Install it with "
            f"an MPI library: {MPI_INSTALL_HINT} (mpi4py and MPICH from the package registry; mpirun then comes "
            f"with the virtual environment), or `pip install mpi4py` built against your cluster's MPI. "
            f"comm_backend_name='torch' needs neither."
        ) from error
    except (RuntimeError, OSError) as error:  # mpi4py is there, but no MPI library it can load
        raise MissingDependencyError(
            f"LionCub: mpi4py is installed but cannot load an MPI library ({error}). {MPI_INSTALL_HINT} installs "
            f"MPICH beside it; with a system MPI, put its libmpi on LD_LIBRARY_PATH."
        ) from error
    return MPI


_LIBRARY_COMM: Any = None


def _library_comm(mpi: Any) -> Any:
    """One duplicate of MPI_COMM_WORLD per process: LionCub's messages never match a user's own."""
    global _LIBRARY_COMM
    if _LIBRARY_COMM is None:
        comm = mpi.COMM_WORLD.Dup()
        comm.Set_name("ds_lioncub")
        _LIBRARY_COMM = comm
    return _LIBRARY_COMM


RankLayout = tuple[int, int, int]  # (rank in the torch process group, size of that group, global torch rank)


def check_rank_layout(layouts: list[RankLayout | None]) -> None:
    """Raise :class:`MpiSetupError` unless MPI rank i is rank i of a torch group of the MPI world's size.

    ``layouts[i]`` is what MPI rank i reported (None: torch.distributed not initialised there). Every
    rank passes the same list, so every rank reaches the same verdict and the same message.
    """
    mpi_size = len(layouts)
    missing = [i for i, layout in enumerate(layouts) if layout is None]
    if len(missing) == mpi_size:
        return  # torch.distributed is off everywhere: the MPI world is the data-parallel group
    if missing:
        raise MpiSetupError(
            f"LionCub: torch.distributed is initialised on some MPI ranks but not on MPI ranks {missing}; "
            f"initialise it on every rank (deepspeed.init_distributed()) or on none."
        )
    present = [layout for layout in layouts if layout is not None]
    if all(group_rank == i and group_size == mpi_size for i, (group_rank, group_size, _) in enumerate(present)):
        return
    mapping = ", ".join(
        f"{i}->{group_rank if group_rank >= 0 else 'not in group'} (global {global_rank})"
        for i, (group_rank, _, global_rank) in enumerate(present)
    )
    sizes = sorted({group_size for group_rank, group_size, _ in present if group_rank >= 0})
    where = f"MPI rank -> data-parallel rank: {mapping}"
    if mpi_size == 1:
        raise MpiSetupError(
            f"LionCub: comm_backend_name='mpi', but MPI sees a world of 1 while the data-parallel torch group has "
            f"{sizes[0] if sizes else 'more'} ranks: this process was not started by mpirun, so it is an MPI "
            f"singleton. Start the job with `mpirun -np N python train.py ...`, or with the deepspeed launcher in "
            f"MPI mode (`deepspeed "
            f"--launcher mpich --force_multi --hostfile HOSTFILE ...`; plain `deepspeed --num_gpus N` does not "
            f"start an MPI job), or use comm_backend_name='torch'."
        )
    if sizes != [mpi_size]:
        raise MpiSetupError(
            f"LionCub: comm_backend_name='mpi' needs MPI_COMM_WORLD to be the data-parallel group, but the MPI world "
            f"has {mpi_size} ranks and the data-parallel torch group {' or '.join(str(s) for s in sizes) or 'none'} "
            f"({where}). Launch exactly one MPI process per data-parallel rank, without model, pipeline or "
            f"sequence parallelism, or use comm_backend_name='torch'."
        )
    raise MpiSetupError(
        f"LionCub: comm_backend_name='mpi' needs MPI ranks and data-parallel torch ranks in the same order, but "
        f"{where}. Let torch take its rank from MPI: deepspeed.init_distributed() under mpirun does, and with "
        f"env:// set RANK from PMI_RANK (MPICH) or OMPI_COMM_WORLD_RANK (Open MPI)."
    )


def mpi_cuda_support(mpi: Any) -> bool | None:
    """Whether the MPI library reads CUDA device memory: True, False, or None when it cannot tell.

    Asks MPI 4.1's ``mpi_memory_alloc_kinds`` (a "cuda" kind means yes) and the ``MPIX_Query_cuda_support``
    extension (Open MPI >= 4, MPICH >= 4; mpi4py does not wrap it, so it is looked up in the loaded library).
    """
    query_cuda = getattr(mpi, "Query_cuda_support", None)  # in case a future mpi4py wraps it
    if callable(query_cuda):
        return bool(query_cuda())
    kinds = None
    try:
        info = mpi.COMM_WORLD.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - an MPI older than 4.1, or an mpi4py without Info.Get
        kinds = None
    if kinds and any(kind.split(":")[0].strip() == "cuda" for kind in kinds.split(",")):
        return True
    for library in (getattr(mpi, "__file__", None), None):
        try:
            query = ctypes.CDLL(library).MPIX_Query_cuda_support
        except (OSError, AttributeError, TypeError):
            continue
        query.restype = ctypes.c_int
        query.argtypes = []
        return bool(query())
    return None


def _mpi_library(mpi: Any) -> str:
    try:
        return " ".join(mpi.Get_library_version().strip().splitlines()[0].split())
    except Exception:  # noqa: BLE001
        return "unknown MPI"


_MPI_INTEGER_TYPES = {
    torch.uint8: "UINT8_T",
    torch.int8: "INT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
}
_MPI_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class MpiTransport(TransportBase):
    """Collectives over MPI (mpi4py), with the same interface, results and byte accounting as the torch transport.

    Communicator: a duplicate of MPI_COMM_WORLD (or ``comm``), so LionCub's messages never match
    the application's own. Construction is collective: every rank of the MPI world must build it.
    When torch.distributed is initialised, construction checks with one allgather over MPI that MPI
    rank i is rank i of ``process_group`` (default: the global group), and raises
    :class:`MpiSetupError` on every rank otherwise (:func:`check_rank_layout`). The MPI world must
    be the data-parallel group; docs/user-guide.md's "MPI transport" section says how to launch such a job.

    Buffers: host tensors go to MPI as they are. Device tensors go straight to MPI with
    ``cuda_aware=True`` (CUDA tensors; the current stream is synchronised first, because MPI does
    not follow CUDA streams), otherwise through pinned host buffers that are reused between calls.
    The float sum's padded and per-rank buffers are reused too. All reused buffers grow to the
    largest message, so they are bounded by the optimizer's bucket.

    Issued collectives: mpi4py's blocking calls, so ``start_*`` return finished collectives
    (``supports_async`` False) and options that need collectives left running refuse this transport.

    Ordering: integer ``all_reduce_sum`` is MPI_Allreduce(SUM). Floating point is summed in rank
    order by :class:`TransportBase`, never by MPI_Allreduce: MPI does not promise the same result on
    every rank for floats, and the rank-order sum is what the torch transport computes too.
    """

    name = "mpi"

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, cuda_aware: bool = False, comm: Any = None
    ) -> None:
        distributed = torch_distributed_initialised(process_group)
        self._mpi = import_mpi()
        self.comm = comm if comm is not None else _library_comm(self._mpi)
        self.process_group = process_group
        self.cuda_aware = bool(cuda_aware)
        super().__init__(self.comm.Get_size(), self.comm.Get_rank())
        self._buffers: dict[tuple[str, str | None], torch.Tensor] = {}
        layout = None
        if distributed:
            layout = (dist.get_rank(process_group), dist.get_world_size(process_group), dist.get_rank())
        check_rank_layout(self.comm.allgather(layout))
        if self.cuda_aware:
            self._check_cuda_support()

    def _check_cuda_support(self) -> None:
        support = mpi_cuda_support(self._mpi)
        library = _mpi_library(self._mpi)
        if support is False:
            raise MpiSetupError(
                f"LionCub: cuda_aware=True, but the MPI library ({library}) reports no CUDA support "
                f"(MPIX_Query_cuda_support() returned 0): it cannot read GPU memory. Use an MPI built with CUDA "
                f"(Open MPI or MPICH configured --with-cuda; MPICH also needs MPIR_CVAR_ENABLE_GPU=1 at run time; "
                f"MVAPICH2-GDR with MV2_USE_CUDA=1), or set cuda_aware=false to stage buffers through pinned host "
                f"memory (the pip-installed MPICH of ds_lioncub[mpi] is built without CUDA)."
            )
        if support is None:
            # stacklevel 4: _check_cuda_support <- __init__ <- make_transport <- whoever built the backend
            warnings.warn(
                f"LionCub: cuda_aware=True, but the MPI library ({library}) cannot be asked whether it is CUDA-aware "
                f"(no MPIX_Query_cuda_support, no 'cuda' memory allocation kind). If it is not, it reads device "
                f"pointers as host memory and crashes or sends garbage. Check it (Open MPI: `ompi_info --parsable "
                f"--all | grep mpi_built_with_cuda_support:value`) or set cuda_aware=false to stage through pinned "
                f"host memory.",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ buffers

    def _direct(self, tensor: torch.Tensor) -> bool:
        """Whether MPI gets ``tensor``'s own memory: host tensors, and CUDA tensors when cuda_aware."""
        if tensor.device.type == "cpu":
            return True
        if self.cuda_aware and tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()  # MPI does not follow CUDA streams
            return True
        return False

    def _buffer(self, slot: str, dtype: torch.dtype, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """A reusable flat buffer: pinned host memory (``device`` None, for staging) or a device workspace.

        Buffers grow to the largest message seen, so they are bounded by the optimizer's bucket.
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        key = (slot, None if device is None else str(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = None
            self._buffers.pop(key, None)  # free the old one before allocating its successor
            if device is None:
                try:
                    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                except RuntimeError:  # no pinned-memory allocator (CPU-only torch): pageable memory works too
                    pass
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device or "cpu")
            self._buffers[key] = buffer
        return buffer[:nbytes].view(dtype)

    def _workspace(self, slot: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        return self._buffer(slot, dtype, numel, device)

    def _spec(self, flat: torch.Tensor, datatype: Any) -> list[Any]:
        """mpi4py buffer spec of a contiguous 1-D tensor: numpy for host memory, the tensor (DLPack) for device."""
        return [flat.detach().numpy() if flat.device.type == "cpu" else flat.detach(), datatype]

    def _bytes(self, flat: torch.Tensor) -> list[Any]:
        return self._spec(flat.view(torch.uint8), self._mpi.BYTE)

    def _exchange(self, collective: Any, send: torch.Tensor, received: torch.Tensor) -> None:
        """``collective(send, received)`` on flat tensors of one device, staged through host buffers if needed."""
        if self._direct(send):
            collective(self._bytes(send), self._bytes(received))
            return
        host_send = self._buffer("send", send.dtype, send.numel())
        host_send.copy_(send)
        host_received = self._buffer("received", received.dtype, received.numel())
        collective(self._bytes(host_send), self._bytes(host_received))
        received.copy_(host_received)

    # ------------------------------------------------------------------ raw collectives

    def _check_sum_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in _MPI_FLOAT_TYPES and dtype not in _MPI_INTEGER_TYPES:
            raise TypeError(f"all_reduce_sum: unsupported dtype {dtype} for the MPI transport")

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self._exchange(self.comm.Alltoall, send, received)

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self._exchange(self.comm.Allgather, send, received)

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        datatype = getattr(self._mpi, _MPI_INTEGER_TYPES[flat.dtype])
        host = flat if self._direct(flat) else self._buffer("send", flat.dtype, flat.numel()).copy_(flat)
        self.comm.Allreduce(self._mpi.IN_PLACE, self._spec(host, datatype), op=self._mpi.SUM)
        if host is not flat:
            flat.copy_(host)

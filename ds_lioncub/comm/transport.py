"""Moving bytes between data-parallel ranks, and counting them.

A transport offers the three collectives the compressed backend needs (``all_to_all``,
``all_gather``, ``all_reduce_sum``), its ``world_size``, ``rank`` and traffic ``stats``.
:func:`make_transport` picks one by ``comm_backend_name``:

- ``"torch"`` — :class:`TorchTransport` runs them on a torch.distributed process group (gloo on
  CPU, NCCL on GPU; deepspeed.comm initialises the same default group, so this also serves
  DeepSpeed jobs). Without an initialised process group it is a world of one, where every
  collective is a copy and nothing is counted as sent.
- ``"mpi"`` — :class:`MpiTransport` runs them over mpi4py (see its docstring for launching).

Byte counts are what a bandwidth-optimal algorithm moves per rank (ring all-gather / all-to-all /
ring all-reduce), so they can be compared with the formulas in DESIGN.md and with the wire; both
transports count the same bytes for the same call.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

COMM_BACKENDS = ("torch", "mpi")
MPI_INSTALL_HINT = 'pip install "ds_lioncub[mpi]"'


@dataclass
class CommStats:
    """Cumulative traffic of one rank: collectives issued and payload bytes sent / received."""

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(
            self.collectives - other.collectives,
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
        )


class Transport(Protocol):
    """What CompressedBackend needs from a transport."""

    name: str
    world_size: int
    rank: int
    stats: CommStats

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, send: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class _Counting:
    """The byte accounting both transports share: what a bandwidth-optimal algorithm moves per rank."""

    stats: CommStats
    world_size: int

    def _count(self, moved: int) -> None:
        self.stats.collectives += 1
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved

    def _count_all_to_all(self, send: torch.Tensor) -> None:
        self._count(send.numel() * send.element_size() * (self.world_size - 1) // self.world_size)

    def _count_all_gather(self, send: torch.Tensor) -> None:
        self._count(send.numel() * send.element_size() * (self.world_size - 1))

    def _count_all_reduce(self, tensor: torch.Tensor) -> None:
        self._count(2 * tensor.numel() * tensor.element_size() * (self.world_size - 1) // self.world_size)


def make_transport(
    process_group: dist.ProcessGroup | None = None, comm_backend_name: str = "torch", cuda_aware: bool = False
) -> Transport:
    """The transport named ``comm_backend_name`` ("torch" or "mpi") over ``process_group``."""
    if comm_backend_name == "torch":
        if cuda_aware:
            raise ValueError(
                "LionCub: cuda_aware=True only applies to comm_backend_name='mpi' (torch.distributed reads "
                "device memory itself); set comm_backend_name='mpi' or drop cuda_aware."
            )
        return TorchTransport(process_group)
    if comm_backend_name == "mpi":
        return MpiTransport(process_group, cuda_aware=cuda_aware)
    raise ValueError(f"LionCub: comm_backend_name must be one of {list(COMM_BACKENDS)}, got {comm_backend_name!r}.")


def sum_rows_in_rank_order(rows: torch.Tensor) -> torch.Tensor:
    """((row0 + row1) + row2) + ...: each rank's contribution to one chunk, summed in rank order.

    fp32/fp64 add in place into ``rows[0]``; fp16/bf16 accumulate in fp32 and round once. Both
    transports reduce floating point this way, so their results agree bit for bit.
    """
    if rows.dtype in (torch.float32, torch.float64):
        total = rows[0]
        for row in rows[1:]:
            total.add_(row)
        return total
    accumulated = rows[0].float()
    for row in rows[1:]:
        accumulated.add_(row)
    return accumulated.to(rows.dtype)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch,
# which setup.py still admits, has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport(_Counting):
    """Collectives over a torch.distributed process group (``None``: the default group)."""

    name = "torch"

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.stats = CommStats()

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Rank j receives chunk j of every rank's ``send`` (numel divisible by p), rank-major."""
        if self.world_size == 1:
            return send.clone()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.process_group)
        self._count_all_to_all(send)
        return received

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``send``, in rank order."""
        if self.world_size == 1:
            return send.clone()
        received = send.new_empty(send.numel() * self.world_size)
        _all_gather_flat(received, send.contiguous(), group=self.process_group)
        self._count_all_gather(send)
        return received

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place elementwise sum over ranks; floating point in rank order (see :func:`sum_rows_in_rank_order`)."""
        if self.world_size == 1:
            return tensor
        if tensor.is_floating_point():
            self._ordered_float_sum(tensor)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        self._count_all_reduce(tensor)
        return tensor

    def _ordered_float_sum(self, tensor: torch.Tensor) -> None:
        """Reduce-scatter by all-to-all, rank-order sum of each chunk on its owner, all-gather.

        The same bytes as a ring all-reduce, but the result does not depend on the backend's
        reduction order, so this transport and the MPI one agree bit for bit at any world size.
        """
        p, numel = self.world_size, tensor.numel()
        if numel == 0:
            return
        chunk = math.ceil(numel / p)
        send = torch.zeros(chunk * p, dtype=tensor.dtype, device=tensor.device)
        send[:numel].copy_(tensor.reshape(-1))
        rows = torch.empty_like(send)
        dist.all_to_all_single(rows, send, group=self.process_group)
        total = sum_rows_in_rank_order(rows.view(p, chunk))
        _all_gather_flat(send, total, group=self.process_group)
        tensor.copy_(send[:numel].view(tensor.shape))


# ---------------------------------------------------------------------------------------------------- MPI


class MpiSetupError(RuntimeError):
    """The MPI job cannot serve this data-parallel group (how it was launched, rank layout, CUDA support)."""


def import_mpi() -> Any:
    """mpi4py's ``MPI`` module (importing it initialises MPI), or an ImportError that names the fix."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise ImportError(
            f"LionCub: comm_backend_name='mpi' needs mpi4py, which cannot be imported ({error}). Install it with "
            f"an MPI library: {MPI_INSTALL_HINT} (mpi4py and MPICH from the package registry; mpirun then comes "
            f"with the virtual environment), or `pip install mpi4py` built against your cluster's MPI. "
            f"comm_backend_name='torch' needs neither."
        ) from error
    except (RuntimeError, OSError) as error:  # mpi4py is there, but no MPI library it can load
        raise ImportError(
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
            query = getattr(ctypes.CDLL(library), "MPIX_Query_cuda_support")
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


class MpiTransport(_Counting):
    """Collectives over MPI (mpi4py), with the same interface and byte accounting as :class:`TorchTransport`.

    The communicator is a duplicate of MPI_COMM_WORLD (or ``comm``). When torch.distributed is
    initialised, construction checks, with one allgather over MPI, that MPI rank i is rank i of
    ``process_group`` (default: the global group) on every rank, and raises :class:`MpiSetupError`
    on every rank otherwise. Construction is collective: every rank of the MPI world must build it.

    Buffers: host tensors go to MPI as they are. Device tensors go straight to MPI with
    ``cuda_aware=True`` (CUDA tensors; the current stream is synchronised first, MPI does not follow
    CUDA streams), otherwise through pinned host buffers that are reused between calls (they grow
    to the largest message, bounded by the optimizer's bucket).

    ``all_to_all`` and ``all_gather`` move bytes; integer ``all_reduce_sum`` is MPI_Allreduce(SUM).
    Floating-point ``all_reduce_sum`` is a reduce-scatter by all-to-all, a sum of the p
    contributions in rank order on the rank that owns the chunk (in fp32 for fp16/bf16, rounded
    once), and an all-gather: the same bytes as a ring all-reduce, identical on every rank
    whatever algorithm the MPI library picks (MPI_Allreduce does not promise that), and equal to
    the rank-order sum ((x0 + x1) + x2) + ... :class:`TorchTransport` reduces floats the same way,
    so the two transports agree bit for bit at any world size.

    Launching (the MPI world must be the data-parallel group, one MPI process per rank):

    - ``mpirun -np N python train.py``: ``deepspeed.init_distributed()`` finds rank and world size
      through mpi4py (or initialise torch.distributed yourself with ``rank=MPI.COMM_WORLD.rank``).
    - The deepspeed launcher in MPI mode: ``deepspeed --launcher mpich --force_multi --hostfile
      HOSTFILE --master_addr ADDR train.py ...`` (HOSTFILE lines like ``localhost slots=4``; add
      ``--no_ssh_check`` for a single host without ssh) or ``--launcher openmpi`` with Open MPI's
      mpirun. Plain ``deepspeed --num_gpus N`` starts processes without MPI; each is then an MPI
      singleton and construction fails with a message saying so.
    """

    name = "mpi"

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, cuda_aware: bool = False, comm: Any = None
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not distributed:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self._mpi = import_mpi()
        self.comm = comm if comm is not None else _library_comm(self._mpi)
        self.process_group = process_group
        self.cuda_aware = bool(cuda_aware)
        self.world_size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.stats = CommStats()
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

    # ------------------------------------------------------------------ collectives

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Rank j receives chunk j of every rank's ``send`` (numel divisible by p), rank-major."""
        if self.world_size == 1:
            return send.clone()
        if send.numel() % self.world_size:
            raise ValueError(f"all_to_all: {send.numel()} elements do not split into {self.world_size} equal chunks")
        flat = send.contiguous().view(-1)
        received = torch.empty_like(flat)
        self._exchange(self.comm.Alltoall, flat, received)
        received = received.view(send.shape)
        self._count_all_to_all(send)
        return received

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``send``, in rank order."""
        if self.world_size == 1:
            return send.clone()
        flat = send.contiguous().view(-1)
        received = flat.new_empty(flat.numel() * self.world_size)
        self._exchange(self.comm.Allgather, flat, received)
        self._count_all_gather(send)
        return received

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place elementwise sum over ranks (floating point: in rank order, see the class docstring)."""
        if self.world_size == 1:
            return tensor
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        if tensor.dtype in _MPI_FLOAT_TYPES:
            self._ordered_float_sum(flat)
        elif tensor.dtype in _MPI_INTEGER_TYPES:
            self._integer_sum(flat)
        else:
            raise TypeError(f"all_reduce_sum: unsupported dtype {tensor.dtype} for the MPI transport")
        if work is not tensor:
            tensor.copy_(work)
        self._count_all_reduce(tensor)
        return tensor

    def _integer_sum(self, flat: torch.Tensor) -> None:
        datatype = getattr(self._mpi, _MPI_INTEGER_TYPES[flat.dtype])
        host = flat if self._direct(flat) else self._buffer("send", flat.dtype, flat.numel()).copy_(flat)
        self.comm.Allreduce(self._mpi.IN_PLACE, self._spec(host, datatype), op=self._mpi.SUM)
        if host is not flat:
            flat.copy_(host)

    def _ordered_float_sum(self, flat: torch.Tensor) -> None:
        """Reduce-scatter by all-to-all, rank-order sum of each chunk on its owner, all-gather into ``flat``."""
        p, numel = self.world_size, flat.numel()
        if numel == 0:
            return
        chunk = math.ceil(numel / p)
        send = flat
        if chunk * p != numel:
            send = self._buffer("padded", flat.dtype, chunk * p, flat.device)
            send[:numel].copy_(flat)
            send[numel:].zero_()
        rows = self._buffer("rows", flat.dtype, chunk * p, flat.device)
        self._exchange(self.comm.Alltoall, send, rows)
        total = sum_rows_in_rank_order(rows.view(p, chunk))  # row r: rank r's values of this rank's chunk
        if send is flat:
            self._exchange(self.comm.Allgather, total, flat)
        else:
            self._exchange(self.comm.Allgather, total, send)
            flat.copy_(send[:numel])

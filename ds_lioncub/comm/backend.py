"""CompressedBackend: majority votes and low-bit sums over a data-parallel group.

Three operations, each identical on every rank of the group:

- :meth:`CompressedBackend.vote_1bit` — the 1-bit majority vote: signs travel as bits through an
  all-to-all, each rank counts the votes of its chunk, and the packed result chunks are all-gathered.
  Every rank sends (p-1)/p * n/8 bytes in each of the two phases.
- :meth:`CompressedBackend.vote_kbit` — sums of b-bit fields: either one uint8 SUM all-reduce whose
  fields cannot carry into each other, or an all-to-all with int32 sums followed by a 1-bit vote
  (or a narrow sum for "mean").
- :meth:`CompressedBackend.compressed_allreduce` — the error-compensated 1-bit averaging that
  DeepSpeed <= 0.19.7 shipped for 1-bit Adam, same signature and semantics.

The votes cut a large update into chunks of ``pipeline_chunk_numel`` elements and run them through
the three-stage schedule of :mod:`ds_lioncub.comm.schedule`: one chunk's signs travel while the next
is packed and an earlier one unpacked. Every element's result depends only on the ranks' values at
that element, so the chunking never changes a bit of it, nor (chunks are whole multiples of the
padding) the bytes sent.

The protocols themselves are in :mod:`ds_lioncub.comm.votes` and :mod:`ds_lioncub.comm.legacy`;
this class is their stable public face, taking the step and tie rule as the 1-bit Adam era API did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.legacy import compressed_allreduce, legacy_padded_numel
from ds_lioncub.comm.quantize import l1_segment_scales, tie_sign
from ds_lioncub.comm.schedule import DEFAULT_PIPELINE_CHUNK_NUMEL, chunk_bounds, run_three_stages
from ds_lioncub.comm.transport import CommStats, Transport, make_transport
from ds_lioncub.comm.vocabulary import (
    AGGREGATIONS,
    KBIT_ALGORITHMS,
    QUANTIZERS,
    Aggregation,
    KbitAlgorithm,
    Quantizer,
    TieBreak,
)
from ds_lioncub.comm.votes import (
    PendingAggregate,
    PendingResult,
    finish_aggregate,
    pack_kbit_message,
    reduce_kbit_mean,
    reduce_kbit_vote,
    reduce_sign_vote,
    start_kbit_sum,
    start_sign_vote,
)
from ds_lioncub.comm.wire import vote_padded_numel
from ds_lioncub.errors import LionCubConfigError


def _check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise LionCubConfigError(f"LionCub: {name} must be one of {list(allowed)}, got {value!r}.")


def _segments_within(
    sizes: Sequence[int], scales: torch.Tensor, begin: int, end: int
) -> tuple[list[int], torch.Tensor]:
    """The parts of the segments ``sizes`` (with their ``scales``) that fall in ``[begin, end)``."""
    part_sizes: list[int] = []
    part_scales: list[torch.Tensor] = []
    offset = 0
    for size, scale in zip(sizes, scales, strict=True):
        overlap = min(end, offset + size) - max(begin, offset)
        if overlap > 0:
            part_sizes.append(overlap)
            part_scales.append(scale)
        offset += size
    return part_sizes, torch.stack(part_scales) if part_scales else torch.zeros(0)


def _checked_chunk_numel(value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise LionCubConfigError(
            f"LionCub: pipeline_chunk_numel must be a positive int (elements) or None, got {value!r}."
        )
    return value


class CompressedBackend:
    """Compressed collectives over ``process_group`` (default: the global torch.distributed group).

    Args:
        process_group: the data-parallel group whose ranks vote together. With torch.distributed
            not initialised the backend is a world of one (votes reduce to local signs), or, with
            ``comm_backend_name="mpi"``, the MPI world.
        comm_backend_name: "torch" (torch.distributed: gloo on CPU, NCCL on GPU) or "mpi" (mpi4py;
            see :class:`ds_lioncub.comm.transport.MpiTransport` for the rank checks).
        cuda_aware: with "mpi", hand CUDA buffers straight to a CUDA-aware MPI instead of staging
            them through pinned host memory.
        pipeline_chunk_numel: elements per chunk of a vote's pipeline (rounded down to a multiple of
            8 p, the padding unit). Smaller chunks start the wire sooner and overlap more of the
            packing and unpacking with it, but each chunk pays two collectives' latency and keeps the
            link busy only while the next is ready; on the emulated 1 Gbit/s network a 1e8-element
            1-bit vote among 2 ranks was fastest at 8 Mi (benchmarks/RESULTS.md). ``None`` runs
            every vote as one piece.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        comm_backend_name: str = "torch",
        cuda_aware: bool = False,
        pipeline_chunk_numel: int | None = DEFAULT_PIPELINE_CHUNK_NUMEL,
    ) -> None:
        self.transport: Transport = make_transport(process_group, comm_backend_name, cuda_aware)
        self.pipeline_chunk_numel = _checked_chunk_numel(pipeline_chunk_numel)

    @classmethod
    def from_transport(
        cls, transport: Transport, pipeline_chunk_numel: int | None = DEFAULT_PIPELINE_CHUNK_NUMEL
    ) -> CompressedBackend:
        """A backend over an existing transport (sharing its byte accounting)."""
        backend = cls.__new__(cls)
        backend.transport = transport
        backend.pipeline_chunk_numel = _checked_chunk_numel(pipeline_chunk_numel)
        return backend

    def _vote_in_chunks(
        self,
        start: Callable[[int, int], PendingAggregate],
        reduce: Callable[[PendingAggregate], PendingResult],
        out_flat: torch.Tensor,
    ) -> None:
        """``start(begin, end)`` and ``reduce`` per pipeline chunk of ``out_flat``, each result written into
        its chunk, in the three-stage schedule (one chunk when pipelining is off)."""
        numel = out_flat.numel()
        chunk_numel = numel if self.pipeline_chunk_numel is None else self.pipeline_chunk_numel
        chunks = chunk_bounds(numel, chunk_numel, vote_padded_numel(1, self.world_size))
        run_three_stages(
            len(chunks),
            lambda k: start(*chunks[k]),
            lambda k, pending: reduce(pending),
            lambda k, result: finish_aggregate(self.transport, result, out_flat[chunks[k][0] : chunks[k][1]]),
        )

    @property
    def comm_backend_name(self) -> str:
        return self.transport.name

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def rank(self) -> int:
        return self.transport.rank

    def comm_stats(self) -> CommStats:
        """Collectives issued, bytes sent / received and seconds inside them, by this rank since construction."""
        stats = self.transport.stats
        return CommStats(stats.collectives, stats.bytes_sent, stats.bytes_received, stats.seconds)

    def vote_1bit(
        self, update: torch.Tensor, step: int, tie_break: TieBreak = "alternate", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Majority vote of the signs of ``update`` over all ranks: ±1 in ``update.dtype``.

        Exact zeros, locally and in the vote sum, resolve by the tie rule at ``step``. ``out`` (a
        contiguous tensor shaped like ``update``, possibly ``update`` itself: its signs are packed
        before anything is written) receives the vote instead of a new tensor.
        """
        positive_ties = tie_sign(step, tie_break) > 0
        if out is not None and out.shape != update.shape:
            raise ValueError(f"out must have the update's shape {tuple(update.shape)}, got {tuple(out.shape)}")
        if update.numel() == 0:
            return update.new_empty(update.shape) if out is None else out
        flat = update.reshape(-1)
        target = torch.empty(update.shape, dtype=update.dtype, device=update.device) if out is None else out
        transport = self.transport
        self._vote_in_chunks(
            lambda begin, end: start_sign_vote(transport, flat[begin:end], positive_ties),
            lambda pending: reduce_sign_vote(transport, pending),
            target.view(-1),
        )
        return target

    def vote_kbit(
        self,
        update: torch.Tensor,
        step: int,
        bits: int,
        quantizer: Quantizer = "sign",
        aggregation: Aggregation = "vote",
        algorithm: KbitAlgorithm = "allreduce",
        tie_break: TieBreak = "alternate",
        l1_clip: float = 2.0,
        segment_sizes: Sequence[int] | None = None,
        segment_means: Sequence[float] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Quantize ``update`` to b-bit fields, sum them over ranks, and vote or average.

        ``quantizer="sign"`` sends the local sign (ties by the tie rule); ``"l1"`` sends
        ``q = clamp(round(c / mu * L / l1_clip), -L, L)`` with ``mu`` the mean absolute value of each
        segment (a parameter tensor: ``segment_sizes`` splits the flat update; ``segment_means``
        overrides mu, for a segment that is a slice of a larger tensor). ``aggregation="vote"``
        returns the sign of the sum (ties by the tie rule), ``"mean"`` the sum divided by its largest
        magnitude (p for sign, p*L for l1), in [-1, 1].

        A world too large for ``algorithm="allreduce"`` raises before any communication.
        """
        _check_choice("quantizer", quantizer, QUANTIZERS)
        _check_choice("aggregation", aggregation, AGGREGATIONS)
        _check_choice("kbit_algorithm", algorithm, KBIT_ALGORITHMS)
        if not l1_clip > 0:
            raise LionCubConfigError(f"LionCub: l1_clip must be > 0, got {l1_clip!r}.")
        codec = KbitCodec.build(self.world_size, bits, quantizer, algorithm)
        positive_ties = tie_sign(step, tie_break) > 0
        flat = update.reshape(-1)
        sizes, scales = None, None
        if quantizer == "l1":
            sizes, scales = l1_segment_scales(flat, codec.levels, l1_clip, segment_sizes, segment_means)
        if flat.numel() == 0:
            return update.new_empty(update.shape)
        out = torch.empty(update.shape, dtype=update.dtype, device=update.device)
        transport = self.transport
        reduce = reduce_kbit_vote if aggregation == "vote" else reduce_kbit_mean

        def start(begin: int, end: int) -> PendingAggregate:
            chunk_sizes, chunk_scales = (None, None)
            if sizes is not None and scales is not None:
                chunk_sizes, chunk_scales = _segments_within(sizes, scales, begin, end)
            message = pack_kbit_message(codec, flat[begin:end], positive_ties, chunk_scales, chunk_sizes)
            return start_kbit_sum(transport, codec, message, end - begin, positive_ties)

        self._vote_in_chunks(start, lambda pending: reduce(transport, codec, pending), out.view(-1))
        return out

    def compressed_allreduce(
        self,
        buffer_m: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        local_rank: int | None = None,
    ) -> torch.Tensor:
        """Error-compensated 1-bit average of ``buffer_m`` (DeepSpeed <= 0.19.7 semantics).

        ``worker_error`` holds the padded size (a multiple of 8*p; DeepSpeed used p*lcm(p, 8), see
        :func:`legacy_padded_numel`), ``server_error`` that size / p. Both are updated in place;
        the average is written into ``buffer_m`` and returned. ``local_rank`` is accepted for
        compatibility (it selected the cupy device) and not otherwise used.
        """
        return compressed_allreduce(self.transport, buffer_m, worker_error, server_error)


__all__ = ["DEFAULT_PIPELINE_CHUNK_NUMEL", "CommStats", "CompressedBackend", "legacy_padded_numel", "l1_segment_scales"]

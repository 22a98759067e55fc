"""CompressedBackend: majority votes and low-bit sums over a data-parallel group.

Three operations, each identical on every rank of the group:

- :meth:`CompressedBackend.vote_1bit` — the 1-bit majority vote (DESIGN §2.3): signs travel as bits
  through an all-to-all, each rank counts the votes of its chunk, and the packed result chunks are
  all-gathered. Every rank sends (p-1)/p * n/8 bytes in each of the two phases.
- :meth:`CompressedBackend.vote_kbit` — sums of b-bit fields (DESIGN §2.4, §2.5): either one uint8
  SUM all-reduce whose fields cannot carry into each other, or an all-to-all with int32 sums followed
  by a 1-bit vote (or a narrow sum for "mean").
- :meth:`CompressedBackend.compressed_allreduce` — the error-compensated 1-bit averaging that
  DeepSpeed <= 0.19.7 shipped for 1-bit Adam (DESIGN §2.7), same signature and semantics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from ds_lioncub.comm.packing import (
    pack_fields,
    pack_l1_fields,
    pack_signs,
    packed_length,
    sum_fields_per_position,
    unpack_fields,
    unpack_signs,
    vote_packed_signs,
)
from ds_lioncub.comm.quantize import (
    KbitAlgorithm,
    Quantizer,
    TieBreak,
    check_kbit_world_size,
    field_width_for,
    l1_levels,
    l1_scale,
    tie_sign,
)
from ds_lioncub.comm.transport import CommStats, make_transport

Aggregation = Literal["vote", "mean"]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    if flat.numel() == length:
        return flat
    return torch.cat([flat, flat.new_zeros(length - flat.numel())])


def _check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"LionCub: {name} must be one of {list(allowed)}, got {value!r}.")


class CompressedBackend:
    """Compressed collectives over ``process_group`` (default: the global torch.distributed group).

    Args:
        process_group: the data-parallel group whose ranks vote together. With torch.distributed
            not initialised the backend is a world of one (votes reduce to local signs), or, with
            ``comm_backend_name="mpi"``, the MPI world.
        comm_backend_name: "torch" (torch.distributed: gloo on CPU, NCCL on GPU) or "mpi" (mpi4py;
            see :class:`ds_lioncub.comm.transport.MpiTransport` for launching and the rank checks).
        cuda_aware: with "mpi", hand CUDA buffers straight to a CUDA-aware MPI instead of staging
            them through pinned host memory.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        comm_backend_name: str = "torch",
        cuda_aware: bool = False,
    ) -> None:
        self.transport = make_transport(process_group, comm_backend_name, cuda_aware)

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
        """Collectives issued and bytes sent / received by this rank since construction or reset."""
        stats = self.transport.stats
        return CommStats(stats.collectives, stats.bytes_sent, stats.bytes_received)

    def reset_comm_stats(self) -> None:
        self.transport.stats = CommStats()

    # ------------------------------------------------------------------ 1-bit vote

    def vote_1bit(
        self, update: torch.Tensor, step: int, tie_break: TieBreak = "alternate", *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Majority vote of the signs of ``update`` over all ranks: ±1 in ``update.dtype``.

        Exact zeros, locally and in the vote sum, resolve by the tie rule at ``step``. ``out`` (a
        contiguous tensor shaped like ``update``, possibly ``update`` itself: its signs are packed
        before anything is written) receives the vote instead of a new tensor.
        """
        positive_ties = tie_sign(step, tie_break) > 0
        numel = update.numel()
        if numel == 0:
            return update.new_empty(update.shape) if out is None else out
        p = self.world_size
        padded_numel = _round_up(numel, 8 * p)
        # padding bits are 0 (-1 votes) in every rank's message
        received = self.transport.all_to_all(pack_signs(update, positive_ties, nbytes=padded_numel // 8))
        chunk_numel = padded_numel // p
        # vote sum S = 2k - p over k plus votes; ties (S == 0) follow the tie rule. Fused: count,
        # vote and pack in one pass over the packed messages.
        chunk_vote = vote_packed_signs(received.view(p, -1), chunk_numel, positive_ties)
        return self._gather_packed_signs(chunk_vote, numel, update, out)

    def _gather_signs(self, chunk_bits: torch.Tensor, numel: int, like: torch.Tensor) -> torch.Tensor:
        return self._gather_packed_signs(pack_fields(chunk_bits, 1), numel, like)

    def _gather_packed_signs(
        self, packed_chunk: torch.Tensor, numel: int, like: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        gathered = self.transport.all_gather(packed_chunk)
        if out is not None:
            if out.shape != like.shape:
                raise ValueError(f"out must have the update's shape {tuple(like.shape)}, got {tuple(out.shape)}")
            return unpack_signs(gathered, numel, out=out)
        return unpack_signs(gathered, numel, like.dtype).view(like.shape)

    # ------------------------------------------------------------------ k-bit sums

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
        _check_choice("quantizer", quantizer, ("sign", "l1"))
        _check_choice("aggregation", aggregation, ("vote", "mean"))
        _check_choice("kbit_algorithm", algorithm, ("allreduce", "alltoall"))
        if not l1_clip > 0:
            raise ValueError(f"LionCub: l1_clip must be > 0, got {l1_clip!r}.")
        p = self.world_size
        check_kbit_world_size(p, bits, quantizer, algorithm)
        numel = update.numel()
        flat = update.reshape(-1)
        if quantizer == "sign":
            levels = 1
            positive_ties = tie_sign(step, tie_break) > 0

            def pack(nbytes: int) -> torch.Tensor:  # field = 1 for +1, 0 for -1
                return pack_signs(flat, positive_ties, bits=bits, nbytes=nbytes)

        else:
            levels = l1_levels(p, bits, algorithm)
            if levels < 1:
                raise ValueError(
                    f"LionCub: {bits}-bit l1 quantization leaves no levels for {p} workers "
                    f"(L = floor((2**bits-1)/(2p)) = 0); use more bits or kbit_algorithm='alltoall'."
                )
            sizes, scales = self._segment_scales(flat, levels, l1_clip, segment_sizes, segment_means)

            def pack(nbytes: int) -> torch.Tensor:  # field = q + L, quantized and packed in one pass
                return pack_l1_fields(flat, scales, sizes, levels, bits, nbytes=nbytes)

        if numel == 0:
            return update.new_empty(update.shape)

        # Sum of q over ranks from the sum of fields: sign fields are (q+1)/2, l1 fields q+L.
        def signed_sum(field_sum: torch.Tensor) -> torch.Tensor:
            return 2 * field_sum - p if quantizer == "sign" else field_sum - p * levels

        # The vote straight from the field sums: one integer comparison, no signed sums in int32.
        votes_positive_from = _vote_threshold(p, levels, quantizer, tie_sign(step, tie_break) > 0)

        if algorithm == "allreduce":
            packed = self.transport.all_reduce_sum(pack(packed_length(numel, bits)))
            fields = unpack_fields(packed, bits, numel)
            if aggregation == "vote":
                positive = fields >= votes_positive_from  # fits uint8: the world-size check keeps p * 2L (sign: p) < 2**bits
                return unpack_signs(pack_fields(positive, 1), numel, update.dtype).view(update.shape)
            total = signed_sum(fields.to(torch.int32))
            return (total.float() / (p * levels)).to(update.dtype).view(update.shape)

        padded_numel = _round_up(numel, 8 * p)
        chunk_numel = padded_numel // p
        # padding fields are 0
        received = self.transport.all_to_all(pack(padded_numel * bits // 8)).view(p, -1)
        field_sum = sum_fields_per_position(received, bits, chunk_numel)
        if aggregation == "vote":
            return self._gather_signs(field_sum >= votes_positive_from, numel, update)
        # The field sum lies in [0, p * 2L] (sign: [0, p]); send it in the narrowest width that holds it.
        width = field_width_for(p * (1 if quantizer == "sign" else 2 * levels))
        if width <= 8:
            gathered = unpack_fields(self.transport.all_gather(pack_fields(field_sum, width)), width, padded_numel)
        else:
            wide = torch.int16 if width == 16 else torch.int32
            gathered = self.transport.all_gather(field_sum.to(wide).view(torch.uint8)).view(wide)
        total = signed_sum(gathered[:numel].to(torch.int32))
        return (total.float() / (p * levels)).to(update.dtype).view(update.shape)

    @staticmethod
    def _segment_scales(
        flat: torch.Tensor,
        levels: int,
        clip: float,
        segment_sizes: Sequence[int] | None,
        segment_means: Sequence[float] | torch.Tensor | None,
    ) -> tuple[list[int], torch.Tensor]:
        """Segment sizes and each segment's L1 scale ``L / (clip * mu)`` (0 where mu == 0)."""
        sizes = [flat.numel()] if segment_sizes is None else [int(s) for s in segment_sizes]
        if sum(sizes) != flat.numel() or any(s < 0 for s in sizes):
            raise ValueError(
                f"LionCub: segment_sizes must be non-negative and add up to the update's numel "
                f"({flat.numel()}), got a total of {sum(sizes)}."
            )
        if segment_means is not None and len(segment_means) != len(sizes):
            raise ValueError("LionCub: segment_means needs one value per segment.")
        scales = []
        start = 0
        for index, size in enumerate(sizes):
            segment = flat[start : start + size]
            if segment_means is None:
                mean_abs = segment.float().abs().mean() if size else torch.zeros(())
            else:
                mean_abs = segment_means[index]
            scales.append(l1_scale(mean_abs, levels, clip).cpu())
            start += size
        return sizes, torch.stack(scales) if scales else torch.zeros(0)

    # ------------------------------------------------------------------ legacy 1-bit Adam API

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
        p = self.world_size
        padded_numel = worker_error.numel()
        if padded_numel % (8 * p) != 0 or padded_numel < buffer_m.numel():
            raise ValueError(
                f"compressed_allreduce: worker_error has {padded_numel} elements; it must be at least "
                f"buffer_m.numel() ({buffer_m.numel()}) and a multiple of 8 * world_size ({8 * p}). "
                f"Allocate it with ds_lioncub.comm.legacy_padded_numel(numel, world_size) elements."
            )
        if server_error.numel() * p != padded_numel:
            raise ValueError(
                f"compressed_allreduce: server_error must have worker_error.numel() / world_size = "
                f"{padded_numel // p} elements, got {server_error.numel()}."
            )
        chunk_numel = padded_numel // p
        worker_flat = worker_error.view(-1)
        x = _padded(buffer_m.reshape(-1).float(), padded_numel) + worker_flat
        worker_scale = x.norm() / math.sqrt(padded_numel)
        worker_positive = x >= 0
        worker_flat.copy_(x - worker_scale * (worker_positive.float() * 2 - 1))

        received_signs = self.transport.all_to_all(pack_fields(worker_positive, 1)).view(p, -1)
        worker_scales = self.transport.all_gather(worker_scale.reshape(1))

        server_flat = server_error.view(-1)
        y = server_flat.clone()
        for sender in range(p):
            y.add_(unpack_signs(received_signs[sender], chunk_numel) * (worker_scales[sender] / p))
        server_scale = y.norm() / math.sqrt(chunk_numel)
        server_positive = y >= 0
        server_flat.copy_(y - server_scale * (server_positive.float() * 2 - 1))

        gathered_signs = self.transport.all_gather(pack_fields(server_positive, 1)).view(p, -1)
        server_scales = self.transport.all_gather(server_scale.reshape(1))
        result = torch.cat([unpack_signs(gathered_signs[r], chunk_numel) * server_scales[r] for r in range(p)])
        buffer_m.copy_(result[: buffer_m.numel()].view(buffer_m.shape))
        return buffer_m


def _vote_threshold(p: int, levels: int, quantizer: str, positive_ties: bool) -> int:
    """The smallest sum of ``p`` ranks' fields whose vote is +1.

    The signed sum is ``2f - p`` for sign fields ((q+1)/2 each) and ``f - p*L`` for L1 fields (q+L
    each); the vote is +1 where it is > 0, and where it is 0 if ties resolve to +1.
    """
    least_positive = 0 if positive_ties else 1
    if quantizer == "sign":
        return (p + least_positive + 1) // 2  # ceil((p + least_positive) / 2)
    return p * levels + least_positive


def legacy_padded_numel(numel: int, world_size: int) -> int:
    """Size DeepSpeed's 1-bit optimizers gave ``worker_error``: ``numel`` rounded up to p*lcm(p, 8)."""
    multiple = world_size * math.lcm(world_size, 8)
    return _round_up(numel, multiple)


__all__ = ["CompressedBackend", "CommStats", "legacy_padded_numel", "pack_signs"]

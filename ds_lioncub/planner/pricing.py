"""The pieces every candidate of the α-β model (:mod:`ds_lioncub.planner.model`) is priced with.

The seconds of one collective (:func:`collective_seconds`) and of a schedule of them beside local work
(:func:`pipelined_seconds`), the collectives and local passes of one aggregation
(:func:`aggregation_collectives`, :func:`aggregation_local_cost`, :func:`predict_aggregation_seconds`), a
step's running totals (:class:`Tally`) and the :class:`Candidate` they become. The flat and ZeRO-2
candidates (:mod:`ds_lioncub.planner.candidates`) and the ZeRO-3 ones (:mod:`ds_lioncub.planner.zero3`)
are built on these, and :func:`~ds_lioncub.planner.model.plan` ranks them all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.schedule import DEFAULT_PIPELINE_CHUNK_NUMEL, chunk_bounds
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.config.clip_rule import measures_noise_scale, sketch_bins_of
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import ModeRecord, mode_named, mode_of
from ds_lioncub.modes.exact import ELEMENT_SIZE as ELEMENT_SIZE  # exact Lion's bytes per element, priced from here
from ds_lioncub.planner.cluster import Network
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LION_UPDATE, LocalCosts, aggregation_key

LIONCUB_BUCKET_SIZE: int = LionCubConfig.model_fields["bucket_size"].default
# DeepSpeed's gradient all-reduce bucket at stage 0 (engine.allreduce_gradients) and ZeRO's
# reduce_bucket_size / allgather_bucket_size defaults, in elements.
DEEPSPEED_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class Candidate:
    """One way to run a step, with its predicted cost.

    Attributes:
        params: the LionCub params of the ds_config's optimizer block.
        zero_stage: the ds_config's ``zero_optimization.stage``.
        seconds_per_step: ``comm_seconds + local_seconds``, less what the bucket schedule overlaps
            (:func:`pipelined_seconds`).
        bytes_per_step_per_rank: bytes one rank sends per step, over every link.
        comm_seconds: the collectives' α-β time.
        local_seconds: Lion's arithmetic and the aggregation's local work.
        label: what it is, in words.
        node_link_bytes_per_step: bytes out of one node through its link to the network per step (what
            a slow inter-node network has to carry; the rest stays inside the nodes).
    """

    params: dict[str, Any]
    zero_stage: int
    seconds_per_step: float
    bytes_per_step_per_rank: int
    comm_seconds: float
    local_seconds: float
    label: str
    node_link_bytes_per_step: int = 0

    @property
    def compression(self) -> str:
        return str(self.params["compression"])

    @property
    def mode(self) -> ModeRecord:
        """The record of its compression mode."""
        return mode_named(self.compression)

    @property
    def exact(self) -> bool:
        """Exact Lion (the ranks average their gradients), as its mode's record says."""
        return self.mode.exact


# ---------------------------------------------------------------------------------------------- collectives


def rounds(collective: wire.Collective) -> int:
    """Rounds (α terms) of ``collective``: 2(p-1) for a ring all-reduce, p-1 for the others, 0 alone."""
    p = collective.world_size
    if p <= 1:
        return 0
    return 2 * (p - 1) if collective.kind == "all_reduce" else p - 1


def collective_seconds(
    collective: wire.Collective, placement: wire.Placement, node_size: int, network: Network
) -> float:
    """``rounds * α + max(node link bytes / β_inter, in-node bytes / β_intra) / e`` (see the module docstring)."""
    if collective.world_size <= 1:
        return 0.0
    on_links = wire.link_bytes(collective, placement, node_size)
    transfer = max(on_links.node_link / network.inter_node_bandwidth, on_links.within_node / network.in_node_bandwidth)
    return rounds(collective) * network.latency + transfer / network.efficiency.of(collective.kind)


def pipelined_seconds(comm_seconds: float, local_seconds: float, pieces: int) -> float:
    """Seconds of ``pieces`` equal pieces through the three-stage schedule (:mod:`ds_lioncub.comm.schedule`).

    The wire and the local passes work at once, so the slower sets the pace; the faster one's share
    of the first or last piece has nothing to hide behind. One piece runs serially.
    """
    if pieces <= 1:
        return comm_seconds + local_seconds
    return max(comm_seconds, local_seconds) + min(comm_seconds, local_seconds) / pieces


def vote_chunk_sizes(
    numel: int, world_size: int, pipeline_chunk_numel: int | None = DEFAULT_PIPELINE_CHUNK_NUMEL
) -> list[int]:
    """The pipeline chunks a ``CompressedBackend`` with ``pipeline_chunk_numel`` cuts a vote of ``numel`` into."""
    if pipeline_chunk_numel is None:
        return [numel]
    multiple = wire.vote_padded_numel(1, world_size)
    return [end - begin for begin, end in chunk_bounds(numel, pipeline_chunk_numel, multiple)] or [numel]


#: Error feedback's local work per element beyond its aggregation's, in units of Lion's update (the table's
#: "lion_update"): its extra passes over the bucket (design section 4.8), measured as the difference of the
#: 2- and 4-bit L1 all-to-all votes with and without it on 8,388,608-element buckets, one thread
#: (benchmarks/RESULTS.md, "Error feedback: local cost").
ERROR_FEEDBACK_LOCAL_PASSES = {"residual": 2.4, "ef21": 3.0}
#: EF21's all-gather of the per-piece spreads: 4 bytes per parameter tensor in the bucket; priced as one.
EF21_SPREAD_BYTES = 4


#: Option clip's local work per element, in units of Lion's update, by the table's device: the sketch's pass over
#: the gradient and the scaling of it, on 8,388,608-element buckets (benchmarks/bench_clip.py; benchmarks/RESULTS.md,
#: "Option clip", its local cost): 0.25 on this machine's CPU since the sketch's compiled kernel (0.20-0.22 measured,
#: "The default clip's sketch, compiled"; 0.9 before), 2.3 on an H200, where a bucket's few passes of
#: Python-issued kernels weigh against Lion's update at the memory's pace (0.8 from 64 Mi elements up).
CLIP_LOCAL_PASSES = {"cpu": 0.25, "cuda": 2.3}


def sketch_values(options: LionCubConfig, voters: int) -> int:
    """The numbers a step's sketch all-reduce carries (0: no sketch): option clip's bins, and one squared norm where
    the gradient noise scale is measured, which measures with the default bins even when nothing clips."""
    noise = measures_noise_scale(options, voters, gradients_averaged=False)
    if options.mean_clip is None and not noise:
        return 0
    return sketch_bins_of(options) + (1 if noise else 0)


def clip_collectives(
    options: LionCubConfig, world_size: int, voters: int, carries_finite_check: bool = False
) -> list[wire.Collective]:
    """The sketch's collectives per step over ``world_size`` ranks of ``voters`` voters (option clip, the noise scale;
    none without either); ``carries_finite_check``: one more value, the non-finite check's verdict, which then
    needs no all-reduce of its own (a step at ZeRO stage 0, where LionCub sketches inside its step)."""
    values = sketch_values(options, voters)
    return [] if values == 0 else wire.clip_sketch_collectives(values + int(carries_finite_check), world_size)


def clip_local_cost(costs: LocalCosts, options: LionCubConfig, voters: int) -> float:
    """Seconds per stepped element of the sketch's local work (option clip, the noise scale; 0 without either)."""
    return 0.0 if sketch_values(options, voters) == 0 else CLIP_LOCAL_PASSES[costs.device] * costs.cost(LION_UPDATE)


def aggregation_collectives(options: LionCubConfig, numel: int, world_size: int) -> list[wire.Collective]:
    """What one aggregation of ``numel`` elements over ``world_size`` ranks issues (LionCub's own collectives): its
    mode's, and EF21's all-gather of the spreads where error feedback of that kind is on."""
    collectives = mode_of(options).collectives(options, numel, world_size)
    if options.error_feedback is not None and options.error_feedback.kind == "ef21":
        collectives.insert(0, wire.Collective("all_gather", EF21_SPREAD_BYTES, world_size))
    return collectives


def aggregation_local_cost(costs: LocalCosts, options: LionCubConfig) -> float:
    """Seconds per element of a compressed aggregation's local work: the table's entry, plus error feedback's
    passes (:data:`ERROR_FEEDBACK_LOCAL_PASSES`) where it is on."""
    cost = costs.cost(aggregation_key(options))
    if options.error_feedback is not None:
        cost += ERROR_FEEDBACK_LOCAL_PASSES[options.error_feedback.kind] * costs.cost(LION_UPDATE)
    return cost


def bucket_sizes(numel: int, bucket_size: int) -> list[int]:
    """``numel`` elements cut into buckets of ``bucket_size`` (the last one shorter)."""
    full, rest = divmod(numel, bucket_size)
    return [bucket_size] * full + ([rest] if rest else [])


@dataclass
class Tally:
    """Seconds and bytes of one rank's collectives in a step."""

    seconds: float = 0.0
    bytes_sent: int = 0
    node_link_bytes: int = 0

    def add(
        self, collectives: Sequence[wire.Collective], placement: wire.Placement, node_size: int, network: Network
    ) -> None:
        for collective in collectives:
            self.seconds += collective_seconds(collective, placement, node_size, network)
            self.bytes_sent += collective.bytes_sent
            if collective.world_size > 1:
                self.node_link_bytes += wire.link_bytes(collective, placement, node_size).node_link

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.seconds + other.seconds,
            self.bytes_sent + other.bytes_sent,
            self.node_link_bytes + other.node_link_bytes,
        )


# ---------------------------------------------------------------------------------------------- one aggregation


def predict_aggregation_seconds(
    params: dict[str, Any],
    numel: int,
    world_size: int,
    network: Network,
    local_costs: LocalCosts | None = None,
    ranks_per_core: float = 1.0,
    pipeline_chunk_numel: int | None = DEFAULT_PIPELINE_CHUNK_NUMEL,
) -> float:
    """Seconds of one aggregation of ``numel`` elements over ``world_size`` ranks, one rank per node.

    What ``benchmarks/bench_comm.py`` times for one op: the collectives of the mode (exact modes: one
    all-reduce in ``comm_dtype``; no buckets, no finite check) and the aggregation's local work, a
    compressed mode's overlapped over the vote's pipeline chunks (:func:`pipelined_seconds`).
    ``ranks_per_core``: ranks sharing each CPU core of the machine(s) that run them (the emulated
    cluster puts its p ranks on one machine). The table is one rank's alone on its core; ranks that
    take turns on a core each take ``ranks_per_core`` times as long, so above 1 the local work is
    multiplied by it (at or below 1 it is as measured: idle cores do not speed up one rank's work).
    ``pipeline_chunk_numel``: that of the ``CompressedBackend`` making the call (``None``: one piece).
    """
    check_ranks_per_core(ranks_per_core)
    options = parse_config(params)
    costs = DEFAULT_LOCAL_COSTS if local_costs is None else local_costs
    pieces = [numel]
    if mode_of(options).votes:  # a vote is cut into pipeline chunks; an exact all-reduce is one piece
        pieces = vote_chunk_sizes(numel, world_size, pipeline_chunk_numel)
    tally = Tally()
    for piece in pieces:  # each chunk pays its own rounds
        tally.add(aggregation_collectives(options, piece, world_size), "spanning", 1, network)
    local = aggregation_local_cost(costs, options) * numel * max(1.0, ranks_per_core) if world_size > 1 else 0.0
    return pipelined_seconds(tally.seconds, local, len(pieces))


# ---------------------------------------------------------------------------------------------- one step


def compressed_modes(world_size: int, clip: Mapping[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(label, params) of the 1-bit vote and every k-bit vote ``KbitCodec`` admits for ``world_size`` voters; with
    ``clip`` (option clip's block) each with it, labelled so when it clips the mean gradient (rule "mean", the default
    under DeepSpeed); ``{"rule": "deepspeed"}`` keeps DeepSpeed's own clipping, unlabelled as before 0.2.0."""
    modes = _vote_modes(world_size)
    if clip is None:
        return modes
    if clip.get("rule", "mean") == "deepspeed":
        return [(label, {**params, "clip": dict(clip)}) for label, params in modes]
    return [(f"{label} + clip", {**params, "clip": dict(clip)}) for label, params in modes]


def _vote_modes(world_size: int) -> list[tuple[str, dict[str, Any]]]:
    modes: list[tuple[str, dict[str, Any]]] = [("1-bit vote", {"compression": "1bit"})]
    for bits in (2, 4, 8):
        for quantizer in ("sign", "l1"):
            for algorithm in ("allreduce", "alltoall"):
                try:
                    KbitCodec.build(world_size, bits, quantizer, algorithm)
                except LionCubConfigError:
                    continue
                params = {"compression": "kbit", "bits": bits, "quantizer": quantizer, "kbit_algorithm": algorithm}
                short = "all-reduce" if algorithm == "allreduce" else "all-to-all"
                modes.append((f"{bits}-bit {quantizer} vote, {short}", params))
    return modes


def priced_candidate(
    label: str,
    params: dict[str, Any],
    zero_stage: int,
    alone: Tally,
    local_seconds: float,
    votes: Tally | None = None,
    pieces: int = 1,
) -> Candidate:
    """``alone``: the step's collectives that run by themselves; ``votes``: those the bucket schedule runs
    over ``pieces`` buckets beside the local work (:func:`pipelined_seconds`)."""
    comm = alone if votes is None else alone + votes
    step = alone.seconds + (local_seconds if votes is None else pipelined_seconds(votes.seconds, local_seconds, pieces))
    return Candidate(
        params=params,
        zero_stage=zero_stage,
        seconds_per_step=step,
        bytes_per_step_per_rank=comm.bytes_sent,
        comm_seconds=comm.seconds,
        local_seconds=local_seconds,
        label=label,
        node_link_bytes_per_step=comm.node_link_bytes,
    )


def check_ranks_per_core(ranks_per_core: float) -> None:
    """Refuse a ``ranks_per_core`` that is not a positive finite number."""
    if not (math.isfinite(ranks_per_core) and ranks_per_core > 0):
        raise LionCubConfigError(f"LionCub: ranks per core must be a positive number, got {ranks_per_core!r}.")

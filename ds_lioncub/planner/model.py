"""The α-β model: predicted seconds and bytes per step of every LionCub mode on a cluster.

Each collective costs ``rounds * α + max(node link bytes / β_inter, in-node bytes / β_intra) / e``:

- ``α`` (``Network.latency``) is paid once per round, a step in which every rank sends one message
  and waits for one: a ring all-reduce has ``2 (p - 1)`` rounds (reduce-scatter, then all-gather),
  a ring all-gather or reduce-scatter ``p - 1``, a pairwise all-to-all ``p - 1``;
- the bytes come from :mod:`ds_lioncub.comm.wire` (the only place they are written): how many
  cross one node's link to the network, shared by the node's ranks, and how many a rank sends to
  ranks of its own node (:func:`~ds_lioncub.comm.wire.link_bytes`); the two kinds of link run at
  once, so the slower sets the time;
- ``e`` (``Network.efficiency``, a :class:`LinkEfficiency`) is the fraction of the link rate the
  transport reaches in that kind of collective: a ring (all-reduce, all-gather, reduce-scatter)
  or a pairwise all-to-all. It carries what the byte count leaves out (packet headers, the
  transport's own scheduling); its defaults are gloo's on the emulated network
  (:data:`GLOO_LINK_EFFICIENCY`, docs/design.md, section 16).

A step's local work comes from :mod:`ds_lioncub.planner.local_costs`: Lion's arithmetic on the
elements the rank steps, and what LionCub computes around its collectives (packing, votes,
unpacking). The sums inside an all-reduce or reduce-scatter are the collective's own work, pipelined
with its transfers, and are in its time. The forward and backward passes are the same in every mode
and are left out: the figures rank the modes, and say what communication and the optimizer cost.

Overlap: LionCub runs its buckets (and ``CompressedBackend`` the chunks of one large vote) through
the three-stage schedule of :mod:`ds_lioncub.comm.schedule`, so over K pieces the slower of the wire
and the local passes sets the pace and only one piece of the faster is exposed
(:func:`pipelined_seconds`). Exact Lion under DeepSpeed all-reduces first and steps after, and
ZeRO's collectives and the finite check stand alone: those add.

Buckets: LionCub's compressed modes aggregate ``bucket_size`` elements at a time (its default,
8388608) and each bucket pays its own rounds; exact Lion under DeepSpeed is the engine's own gradient
all-reduce (ZeRO: reduce-scatter and all-gather), in DeepSpeed's buckets of 5e8 elements. Gradients
and ZeRO's parameters travel in fp32 (training in fp32), except where a candidate sends bf16.

Candidates (:func:`plan`): at ZeRO stage 0 exact Lion (fp32 or bf16 all-reduce), the 1-bit vote and
every k-bit vote (2/4/8 bits, sign or L1 fields, all-reduce or all-to-all) that
:class:`~ds_lioncub.comm.kbit.KbitCodec` admits for the world; with more than one node, ZeRO-2 too:
exact Lion sharded over the world, and the hybrid (docs/design.md, section 12) with every
compressed mode over the nodes' vote groups; when asked for, ZeRO-3 (:mod:`ds_lioncub.planner.zero3`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.schedule import DEFAULT_PIPELINE_CHUNK_NUMEL, chunk_bounds
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.cluster import (
    DEFAULT_LATENCY,
    GLOO_LINK_EFFICIENCY,
    IDEAL_LINK_EFFICIENCY,
    Cluster,
    LinkEfficiency,
    Network,
    describe_network,
)
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LION_UPDATE, LocalCosts, aggregation_key

LIONCUB_BUCKET_SIZE: int = LionCubConfig.model_fields["bucket_size"].default
# DeepSpeed's gradient all-reduce bucket at stage 0 (engine.allreduce_gradients) and ZeRO's
# reduce_bucket_size / allgather_bucket_size defaults, in elements.
DEEPSPEED_BUCKET_SIZE = 500_000_000
ELEMENT_SIZE = {"fp32": 4, "bf16": 2}


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


def aggregation_collectives(options: LionCubConfig, numel: int, world_size: int) -> list[wire.Collective]:
    """What one aggregation of ``numel`` elements over ``world_size`` ranks issues (LionCub's own collectives)."""
    if options.compression == "none":
        return wire.dense_all_reduce_collectives(numel, world_size, ELEMENT_SIZE[options.comm_dtype])
    if options.compression == "1bit":
        return wire.vote_1bit_collectives(numel, world_size)
    codec = KbitCodec.build(world_size, options.bits, options.quantizer, options.kbit_algorithm)
    collectives = wire.kbit_collectives(numel, codec, options.aggregation)
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
class _Tally:
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

    def __add__(self, other: _Tally) -> _Tally:
        return _Tally(
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
    _check_ranks_per_core(ranks_per_core)
    options = parse_config(params)
    costs = DEFAULT_LOCAL_COSTS if local_costs is None else local_costs
    pieces = [numel]
    if options.compression != "none":
        pieces = vote_chunk_sizes(numel, world_size, pipeline_chunk_numel)
    tally = _Tally()
    for piece in pieces:  # each chunk pays its own rounds
        tally.add(aggregation_collectives(options, piece, world_size), "spanning", 1, network)
    local = aggregation_local_cost(costs, options) * numel * max(1.0, ranks_per_core) if world_size > 1 else 0.0
    return pipelined_seconds(tally.seconds, local, len(pieces))


# ---------------------------------------------------------------------------------------------- one step


def _compressed_modes(world_size: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, params) of the 1-bit vote and every k-bit vote ``KbitCodec`` admits for ``world_size`` voters."""
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


def _candidate(
    label: str,
    params: dict[str, Any],
    zero_stage: int,
    alone: _Tally,
    local_seconds: float,
    votes: _Tally | None = None,
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


def exact_candidate(
    num_params: int,
    cluster: Cluster,
    network: Network,
    costs: LocalCosts,
    comm_dtype: str,
    zero_stage: int,
    bucket_size: int,
) -> Candidate:
    """Exact Lion: the gradient all-reduce (stage 0) or ZeRO-2's reduce-scatter and all-gather over the world."""
    p, node_size = cluster.world_size, cluster.gpus_per_node
    params: dict[str, Any] = {"compression": "none"} | ({} if comm_dtype == "fp32" else {"comm_dtype": comm_dtype})
    tally = _Tally()
    for bucket in bucket_sizes(num_params, bucket_size):
        if zero_stage == 0:
            collectives = wire.dense_all_reduce_collectives(bucket, p, ELEMENT_SIZE[comm_dtype])
        else:
            collectives = wire.zero2_collectives(bucket, p, ELEMENT_SIZE[comm_dtype])
        tally.add(collectives, "spanning", node_size, network)
    stepped = num_params if zero_stage == 0 else wire.zero_partition_numel(num_params, p)
    conversion = costs.cost(f"none/{comm_dtype}") * num_params if p > 1 else 0.0
    local = costs.cost(LION_UPDATE) * stepped + conversion
    where = "all-reduce" if zero_stage == 0 else "ZeRO-2 over the world"
    return _candidate(f"exact Lion, {comm_dtype} {where}", params, zero_stage, tally, local)


def flat_candidate(
    label: str,
    params: dict[str, Any],
    num_params: int,
    cluster: Cluster,
    network: Network,
    costs: LocalCosts,
    bucket_size: int,
) -> Candidate:
    """A compressed mode at ZeRO stage 0: every rank a voter, the vote spanning the cluster."""
    options = parse_config(params)
    p, node_size = cluster.world_size, cluster.gpus_per_node
    alone, votes = _Tally(), _Tally()
    buckets = bucket_sizes(num_params, bucket_size)
    for bucket in buckets:
        votes.add(aggregation_collectives(options, bucket, p), "spanning", node_size, network)
    if p > 1 and options.check_finite:
        alone.add(wire.finite_check_collectives(p), "spanning", node_size, network)
    aggregation = aggregation_local_cost(costs, options) * num_params if p > 1 else 0.0
    local = costs.cost(LION_UPDATE) * num_params + aggregation
    return _candidate(label, params, 0, alone, local, votes, len(buckets))


def hybrid_candidate(
    label: str,
    params: dict[str, Any],
    num_params: int,
    cluster: Cluster,
    network: Network,
    costs: LocalCosts,
    bucket_size: int,
    zero_bucket_size: int,
    zero_stage: int = 2,
) -> Candidate:
    """A compressed mode under the ZeRO hybrid: ZeRO inside each node, the vote over the nodes (section 12).

    ``zero_stage`` 2 (what ZeRO-1 sends too) or 3 (its parameter all-gathers and gradient reduce-scatter
    inside the node, :func:`ds_lioncub.comm.wire.zero3_collectives`); the vote of each rank's 1/G slice is
    the same for both.
    """
    node_size, nodes = cluster.gpus_per_node, cluster.nodes
    hybrid_params = {**params, "hybrid": {"node_size": node_size}}
    options = parse_config(hybrid_params)
    zero_collectives = wire.zero3_collectives if zero_stage == 3 else wire.zero2_collectives
    alone, votes = _Tally(), _Tally()
    for bucket in bucket_sizes(num_params, zero_bucket_size):
        alone.add(zero_collectives(bucket, node_size, ELEMENT_SIZE["fp32"]), "within_node", node_size, network)
    shard = wire.zero_partition_numel(num_params, node_size)
    buckets = bucket_sizes(shard, bucket_size)
    for bucket in buckets:
        votes.add(aggregation_collectives(options, bucket, nodes), "one_per_node", node_size, network)
    if options.check_finite:  # agreed over the whole world (section 12)
        alone.add(wire.finite_check_collectives(cluster.world_size), "spanning", node_size, network)
    local = (costs.cost(LION_UPDATE) + aggregation_local_cost(costs, options)) * shard
    return _candidate(
        f"{label}, ZeRO-{zero_stage} hybrid", hybrid_params, zero_stage, alone, local, votes, len(buckets)
    )


def plan(
    num_params: int,
    cluster: Cluster,
    network: Network,
    local_costs: LocalCosts | None = None,
    *,
    zero_stages: Sequence[int] = (0, 2),
    exact_comm_dtypes: Sequence[str] = ("fp32", "bf16"),
    bucket_size: int = LIONCUB_BUCKET_SIZE,
    exact_bucket_size: int = DEEPSPEED_BUCKET_SIZE,
    hybrid_with_one_rank_per_node: bool = False,
    ranks_per_core: float = 1.0,
) -> list[Candidate]:
    """Every feasible candidate for ``num_params`` parameters on ``cluster``, fastest predicted step first.

    ``zero_stages``: which of stage 0 (flat), stage 2 (the hybrid and exact ZeRO-2; only with more
    than one node) and stage 3 (exact ZeRO-3; the ZeRO-3 hybrid with more than one node) to consider.
    ``exact_comm_dtypes``: the precisions exact Lion's all-reduce may use.
    ``bucket_size``: LionCub's; ``exact_bucket_size``: the elements per bucket of exact Lion's
    gradient reduction (DeepSpeed's by default; LionCub's own when it runs without DeepSpeed).
    ``hybrid_with_one_rank_per_node``: list the hybrid also when G = 1, where it is stage 0 under
    another name (for a job whose ZeRO stage is fixed at 2 or 3). ``ranks_per_core``: ranks sharing each CPU
    core of a machine; above 1 every candidate's local work is multiplied by it (the table is one
    rank's alone on its core; see :func:`predict_aggregation_seconds`).
    """
    if num_params < 1:
        raise LionCubConfigError(f"LionCub: the model needs at least 1 parameter, got {num_params}.")
    _check_ranks_per_core(ranks_per_core)
    costs = _with_shared_cores(DEFAULT_LOCAL_COSTS if local_costs is None else local_costs, ranks_per_core)
    candidates = []
    if 0 in zero_stages:
        for dtype in exact_comm_dtypes:
            candidates.append(exact_candidate(num_params, cluster, network, costs, dtype, 0, exact_bucket_size))
        for label, params in _compressed_modes(cluster.world_size):
            candidates.append(flat_candidate(label, params, num_params, cluster, network, costs, bucket_size))
    if 2 in zero_stages and cluster.nodes > 1:
        candidates.append(
            exact_candidate(num_params, cluster, network, costs, exact_comm_dtypes[0], 2, exact_bucket_size)
        )
    if 2 in zero_stages and cluster.nodes > 1 and (cluster.gpus_per_node > 1 or hybrid_with_one_rank_per_node):
        for label, params in _compressed_modes(cluster.nodes):
            candidates.append(
                hybrid_candidate(label, params, num_params, cluster, network, costs, bucket_size, exact_bucket_size)
            )
    if 3 in zero_stages:
        from ds_lioncub.planner.zero3 import zero3_candidates  # it builds on this module's pieces

        candidates += zero3_candidates(
            num_params,
            cluster,
            network,
            costs,
            exact_comm_dtype=exact_comm_dtypes[0],
            bucket_size=bucket_size,
            zero_bucket_size=exact_bucket_size,
            hybrid_with_one_rank_per_node=hybrid_with_one_rank_per_node,
        )
    return sorted(candidates, key=lambda candidate: candidate.seconds_per_step)


def _check_ranks_per_core(ranks_per_core: float) -> None:
    if not (math.isfinite(ranks_per_core) and ranks_per_core > 0):
        raise LionCubConfigError(f"LionCub: ranks per core must be a positive number, got {ranks_per_core!r}.")


def _with_shared_cores(costs: LocalCosts, ranks_per_core: float) -> LocalCosts:
    """``costs`` with every entry ``ranks_per_core`` times as long when above 1 (ranks taking turns on a core)."""
    if ranks_per_core <= 1:
        return costs
    scaled = {key: value * ranks_per_core for key, value in costs.seconds_per_element.items()}
    return replace(costs, seconds_per_element=scaled)


__all__ = [
    "DEEPSPEED_BUCKET_SIZE",
    "DEFAULT_LATENCY",
    "GLOO_LINK_EFFICIENCY",
    "IDEAL_LINK_EFFICIENCY",
    "LIONCUB_BUCKET_SIZE",
    "Candidate",
    "Cluster",
    "LinkEfficiency",
    "Network",
    "aggregation_collectives",
    "bucket_sizes",
    "collective_seconds",
    "describe_network",
    "pipelined_seconds",
    "plan",
    "predict_aggregation_seconds",
    "rounds",
    "vote_chunk_sizes",
]

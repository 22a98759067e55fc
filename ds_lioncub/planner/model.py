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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.candidates import exact_candidate, flat_candidate, hybrid_candidate
from ds_lioncub.planner.cluster import (
    DEFAULT_LATENCY,
    GLOO_LINK_EFFICIENCY,
    IDEAL_LINK_EFFICIENCY,
    Cluster,
    LinkEfficiency,
    Network,
    describe_network,
)
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LocalCosts
from ds_lioncub.planner.pricing import (
    DEEPSPEED_BUCKET_SIZE,
    ELEMENT_SIZE,
    ERROR_FEEDBACK_LOCAL_PASSES,
    LIONCUB_BUCKET_SIZE,
    Candidate,
    aggregation_collectives,
    aggregation_local_cost,
    bucket_sizes,
    check_ranks_per_core,
    collective_seconds,
    compressed_modes,
    pipelined_seconds,
    predict_aggregation_seconds,
    rounds,
    vote_chunk_sizes,
)
from ds_lioncub.planner.zero3 import zero3_candidates


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
    clip: Mapping[str, Any] | None = None,
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
    rank's alone on its core; see :func:`predict_aggregation_seconds`). ``clip``: LionCub's option clip (its block),
    which every compressed candidate then runs with and is priced with (its sketch pass and all-reduce).
    """
    if num_params < 1:
        raise LionCubConfigError(f"LionCub: the model needs at least 1 parameter, got {num_params}.")
    check_ranks_per_core(ranks_per_core)
    costs = _with_shared_cores(DEFAULT_LOCAL_COSTS if local_costs is None else local_costs, ranks_per_core)
    candidates = []
    if 0 in zero_stages:
        for dtype in exact_comm_dtypes:
            candidates.append(exact_candidate(num_params, cluster, network, costs, dtype, 0, exact_bucket_size))
        for label, params in compressed_modes(cluster.world_size, clip):
            candidates.append(flat_candidate(label, params, num_params, cluster, network, costs, bucket_size))
    if 2 in zero_stages and cluster.nodes > 1:
        candidates.append(
            exact_candidate(num_params, cluster, network, costs, exact_comm_dtypes[0], 2, exact_bucket_size)
        )
    if 2 in zero_stages and cluster.nodes > 1 and (cluster.gpus_per_node > 1 or hybrid_with_one_rank_per_node):
        for label, params in compressed_modes(cluster.nodes, clip):
            candidates.append(
                hybrid_candidate(label, params, num_params, cluster, network, costs, bucket_size, exact_bucket_size)
            )
    if 3 in zero_stages:
        candidates += zero3_candidates(
            num_params,
            cluster,
            network,
            costs,
            exact_comm_dtype=exact_comm_dtypes[0],
            bucket_size=bucket_size,
            zero_bucket_size=exact_bucket_size,
            hybrid_with_one_rank_per_node=hybrid_with_one_rank_per_node,
            clip=clip,
        )
    return sorted(candidates, key=lambda candidate: candidate.seconds_per_step)


def _with_shared_cores(costs: LocalCosts, ranks_per_core: float) -> LocalCosts:
    """``costs`` with every entry ``ranks_per_core`` times as long when above 1 (ranks taking turns on a core)."""
    if ranks_per_core <= 1:
        return costs
    scaled = {key: value * ranks_per_core for key, value in costs.seconds_per_element.items()}
    return replace(costs, seconds_per_element=scaled)


__all__ = [
    "DEEPSPEED_BUCKET_SIZE",
    "ELEMENT_SIZE",
    "ERROR_FEEDBACK_LOCAL_PASSES",
    "DEFAULT_LATENCY",
    "GLOO_LINK_EFFICIENCY",
    "IDEAL_LINK_EFFICIENCY",
    "LIONCUB_BUCKET_SIZE",
    "Candidate",
    "Cluster",
    "LinkEfficiency",
    "Network",
    "aggregation_collectives",
    "aggregation_local_cost",
    "bucket_sizes",
    "collective_seconds",
    "describe_network",
    "exact_candidate",
    "flat_candidate",
    "hybrid_candidate",
    "pipelined_seconds",
    "plan",
    "predict_aggregation_seconds",
    "rounds",
    "vote_chunk_sizes",
]

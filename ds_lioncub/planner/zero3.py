"""The ZeRO-3 candidates of the α-β model: exact Lion under ZeRO-3 over the world, and the ZeRO-3 hybrid.

ZeRO-3 partitions the parameters too, so besides ZeRO-2's gradient reduce-scatter it all-gathers the
parameters for the forward pass and again for the backward pass
(:func:`~ds_lioncub.comm.wire.zero3_collectives`, with ``stage3_param_persistence_threshold`` 0 every
parameter; a persistent one is gathered once a step, after it, instead), and no all-gather follows the
step: the updated partitions are the parameters.

- Exact Lion: those collectives over the whole world, in fp32, each of the ranks stepping ``1/p`` of the
  parameters.
- The hybrid (docs/design.md, section 12.1): the same collectives over the node's G ranks only (nothing of
  them leaves a node), and the vote of each rank's ``1/G`` slice with its counterparts on the other nodes,
  priced as the ZeRO-1/2 hybrid's (:func:`~ds_lioncub.planner.candidates.hybrid_candidate`), plus the finite check
  over the world (inside each node, then across the nodes).

What is left out, as for ZeRO-2: the gathers are priced as whole buckets of ``zero_bucket_size``
elements, while ZeRO-3 gathers layer by layer (same bytes, more rounds of α: one set per layer);
the flat parameters are padded to ``p`` (or G) equal parts, while ZeRO-3 pads each parameter (at
most ``p - 1`` elements each); the gathers run inside the forward and backward passes, and the model
adds them to the step as it adds ZeRO-2's reduce-scatter, with no overlap; the hybrid's one-byte skip
agreements over the vote group (section 12.1) are left out, as under the ZeRO-1/2 hybrid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_lioncub.comm import wire
from ds_lioncub.planner.candidates import hybrid_candidate
from ds_lioncub.planner.cluster import Cluster, Network
from ds_lioncub.planner.local_costs import LION_UPDATE, LocalCosts
from ds_lioncub.planner.pricing import (
    ELEMENT_SIZE,
    Candidate,
    Tally,
    bucket_sizes,
    compressed_modes,
    priced_candidate,
)


def exact_zero3_candidate(
    num_params: int, cluster: Cluster, network: Network, costs: LocalCosts, comm_dtype: str, bucket_size: int
) -> Candidate:
    """Exact Lion under ZeRO-3 over the world: two parameter all-gathers and a gradient reduce-scatter a step."""
    p, node_size = cluster.world_size, cluster.gpus_per_node
    params: dict[str, Any] = {"compression": "none"} | ({} if comm_dtype == "fp32" else {"comm_dtype": comm_dtype})
    tally = Tally()
    for bucket in bucket_sizes(num_params, bucket_size):
        tally.add(wire.zero3_collectives(bucket, p, ELEMENT_SIZE[comm_dtype]), "spanning", node_size, network)
    # As ZeRO-2's exact candidate: Lion on this rank's partition, the gradients' conversion on all of them.
    conversion = costs.cost(f"none/{comm_dtype}") * num_params if p > 1 else 0.0
    local = costs.cost(LION_UPDATE) * wire.zero_partition_numel(num_params, p) + conversion
    return priced_candidate(f"exact Lion, {comm_dtype} ZeRO-3 over the world", params, 3, tally, local)


def hybrid_zero3_candidate(
    label: str,
    params: dict[str, Any],
    num_params: int,
    cluster: Cluster,
    network: Network,
    costs: LocalCosts,
    bucket_size: int,
    zero_bucket_size: int,
) -> Candidate:
    """A compressed mode under the ZeRO-3 hybrid: ZeRO-3 inside each node, the vote of the slices over the nodes."""
    return hybrid_candidate(
        label, params, num_params, cluster, network, costs, bucket_size, zero_bucket_size, zero_stage=3
    )


def zero3_candidates(
    num_params: int,
    cluster: Cluster,
    network: Network,
    costs: LocalCosts,
    *,
    exact_comm_dtype: str,
    bucket_size: int,
    zero_bucket_size: int,
    hybrid_with_one_rank_per_node: bool,
    clip: Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """Exact Lion under ZeRO-3 (on any cluster), and with more than one node every compressed mode as the hybrid.

    ``hybrid_with_one_rank_per_node``: list the hybrid also when G = 1 (ZeRO-3 over one rank: nothing
    partitioned, the vote over every rank), for a job whose ZeRO stage is fixed at 3. ``clip``: option clip's
    block, on every compressed candidate.
    """
    candidates = [exact_zero3_candidate(num_params, cluster, network, costs, exact_comm_dtype, zero_bucket_size)]
    if cluster.nodes > 1 and (cluster.gpus_per_node > 1 or hybrid_with_one_rank_per_node):
        for label, params in compressed_modes(cluster.nodes, clip):
            candidates.append(
                hybrid_zero3_candidate(
                    label, params, num_params, cluster, network, costs, bucket_size, zero_bucket_size
                )
            )
    return candidates


__all__ = ["exact_zero3_candidate", "hybrid_zero3_candidate", "zero3_candidates"]

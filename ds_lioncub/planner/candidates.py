"""The candidates of the α-β model at ZeRO stage 0 and 2: exact Lion, a compressed mode over the world, and a
compressed mode as the ZeRO hybrid (docs/design.md, section 12), each priced with :mod:`ds_lioncub.planner.pricing`."""

from __future__ import annotations

from typing import Any

from ds_lioncub.comm import wire
from ds_lioncub.config import parse_config
from ds_lioncub.planner.cluster import (
    Cluster,
    Network,
)
from ds_lioncub.planner.local_costs import LION_UPDATE, LocalCosts
from ds_lioncub.planner.pricing import (
    ELEMENT_SIZE,
    Candidate,
    Tally,
    aggregation_collectives,
    aggregation_local_cost,
    bucket_sizes,
    clip_collectives,
    clip_local_cost,
    priced_candidate,
    sketch_values,
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
    tally = Tally()
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
    return priced_candidate(f"exact Lion, {comm_dtype} {where}", params, zero_stage, tally, local)


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
    alone, votes = Tally(), Tally()
    buckets = bucket_sizes(num_params, bucket_size)
    for bucket in buckets:
        votes.add(aggregation_collectives(options, bucket, p), "spanning", node_size, network)
    # Where the step sketches (option clip, the noise scale), the sketch's all-reduce carries the finite check
    # (not under overlap, whose verdict also says which buckets changed after the sketch).
    carried = options.check_finite and not options.overlap and sketch_values(options, p) > 0
    if p > 1 and options.check_finite and not carried:
        alone.add(wire.finite_check_collectives(p), "spanning", node_size, network)
    alone.add(clip_collectives(options, p, p, carries_finite_check=carried), "spanning", node_size, network)
    aggregation = aggregation_local_cost(costs, options) * num_params if p > 1 else 0.0
    local = (costs.cost(LION_UPDATE) + clip_local_cost(costs, options, p)) * num_params + aggregation
    return priced_candidate(label, params, 0, alone, local, votes, len(buckets))


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
    alone, votes = Tally(), Tally()
    for bucket in bucket_sizes(num_params, zero_bucket_size):
        alone.add(zero_collectives(bucket, node_size, ELEMENT_SIZE["fp32"]), "within_node", node_size, network)
    shard = wire.zero_partition_numel(num_params, node_size)
    buckets = bucket_sizes(shard, bucket_size)
    for bucket in buckets:
        votes.add(aggregation_collectives(options, bucket, nodes), "one_per_node", node_size, network)
    # Agreed over the whole world (section 12): an all-reduce inside each node, then one across the nodes.
    levels: list[tuple[int, wire.Placement]] = [(node_size, "within_node"), (nodes, "one_per_node")]
    for ranks, placement in levels:
        if options.check_finite:
            alone.add(wire.finite_check_collectives(ranks), placement, node_size, network)
        alone.add(clip_collectives(options, ranks, nodes), placement, node_size, network)
    sketch = clip_local_cost(costs, options, nodes)
    local = (costs.cost(LION_UPDATE) + aggregation_local_cost(costs, options) + sketch) * shard
    return priced_candidate(
        f"{label}, ZeRO-{zero_stage} hybrid", hybrid_params, zero_stage, alone, local, votes, len(buckets)
    )

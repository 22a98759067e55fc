"""The ZeRO hybrid's world-wide sums, as one all-reduce over the world against one per level (inside the node,
then over the vote group; ds_lioncub/comm/transport/levels.py), on real gloo ranks over loopback.

    python -m benchmarks.bench_levelled_sum [--nodes 4] [--node-size 2] [--rounds 15] [--calls 20]

Each rank builds the hybrid's own groups (:func:`ds_lioncub.comm.topology.create_groups`) and times, in
interleaved rounds, ``--calls`` sums of what a step sums: option clip's sketch (4,093 fp64) and the non-finite
check (one int32), once through a transport over the whole world and once through a :class:`LevelledSum` of
the node's and the vote group's transports. It prints rank 0's median per step of each and their ratio
(flat / levelled). On one machine every rank shares its cores, so this measures rounds of messages and the
scheduling they wait on, not a network's latency; the planner prices those rounds (docs/design.md,
section 17.5).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.ranks import add_rank_options, run_module_ranks

SKETCH_BINS = 4093


def rank_main(rank: int, nodes: int, node_size: int, store: str, rounds: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from ds_lioncub.comm.topology import create_groups, plan_hybrid
    from ds_lioncub.comm.transport import LevelledSum, Summing, TorchTransport

    world_size = nodes * node_size
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    groups = create_groups(plan_hybrid(world_size, node_size), rank)
    flat: Summing = TorchTransport()
    levels = [TorchTransport(group) for group in (groups.node_group, groups.vote_group) if group is not None]
    ways: dict[str, Summing] = {"flat": flat, "levelled": LevelledSum(levels)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    sketch = torch.randn(SKETCH_BINS, dtype=torch.float64)
    for _ in range(rounds):
        for name, summing in ways.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                summing.all_reduce_sum(sketch.clone())
                summing.all_reduce_sum(torch.zeros(1, dtype=torch.int32))
            seconds[name].append((time.perf_counter() - start) / calls)
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        print(
            f"{nodes} nodes x {node_size}: a step's sums (sketch of {SKETCH_BINS} fp64 + one int32), median of "
            f"{rounds} interleaved rounds of {calls}: flat {medians['flat'] * 1e3:.2f} ms, levelled "
            f"{medians['levelled'] * 1e3:.2f} ms, flat / levelled {medians['flat'] / medians['levelled']:.2f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20)
    add_rank_options(p)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.nodes, args.node_size, args.store, args.rounds, args.calls)
        return 0
    common = ["--nodes", str(args.nodes), "--node-size", str(args.node_size)]
    common += ["--rounds", str(args.rounds), "--calls", str(args.calls)]
    return max(run_module_ranks("benchmarks.bench_levelled_sum", args.nodes * args.node_size, common))


if __name__ == "__main__":
    raise SystemExit(main())

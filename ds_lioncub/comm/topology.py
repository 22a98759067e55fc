"""Hybrid topology: N ranks as M nodes of G ranks; shard inside a node, vote across nodes.

Ranks are numbered node-major (what every launcher does): node ``k`` holds ranks
``[k*G, (k+1)*G)``, and its rank ``k*G + j`` has local index ``j``. Two kinds of groups:

- node group ``k``: the G ranks of node k (inside it ZeRO reduce-scatters gradients in full
  precision and all-gathers parameters);
- vote group ``j``: the M ranks with local index j, one per node (they hold the same shard and
  vote on it).

:func:`plan_hybrid` is pure (unit-testable); :func:`create_groups` makes the torch.distributed
groups, every rank calling ``new_group`` for every group in the same order, as torch requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ds_lioncub.comm.transport.torch_dist import process_group_timeout
from ds_lioncub.errors import LionCubConfigError

# Where launchers put the number of ranks on this host, in the order they are consulted.
NODE_SIZE_VARIABLES = (
    "LIONCUB_NODE_SIZE",  # ours: overrides the launchers' values
    "LOCAL_WORLD_SIZE",  # torchrun
    "LOCAL_SIZE",  # the deepspeed launcher
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI's mpirun
    "MPI_LOCALNRANKS",  # MPICH's mpirun (hydra)
)


@dataclass(frozen=True)
class HybridLayout:
    """How ``world_size`` ranks split into ``nodes`` nodes of ``node_size`` ranks.

    Attributes:
        world_size: N.
        node_size: G, the ranks that shard the optimizer state inside a node.
        nodes: M = N / G, the workers that vote.
        node_groups: ``node_groups[k]`` = the global ranks of node k.
        vote_groups: ``vote_groups[j]`` = the global ranks with local index j, one per node.
    """

    world_size: int
    node_size: int
    nodes: int
    node_groups: tuple[tuple[int, ...], ...]
    vote_groups: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def local_index_of(self, rank: int) -> int:
        return rank % self.node_size


def plan_hybrid(world_size: int, node_size: int) -> HybridLayout:
    """The node and vote groups of ``world_size`` ranks in nodes of ``node_size`` (raises if it does not divide)."""
    if node_size < 1 or world_size % node_size != 0:
        raise LionCubConfigError(
            f"LionCub: hybrid node_size={node_size} does not divide the data-parallel world of {world_size} ranks "
            f"into whole nodes; set hybrid.node_size to a divisor of {world_size} (the ranks per machine)."
        )
    nodes = world_size // node_size
    node_groups = tuple(tuple(range(k * node_size, (k + 1) * node_size)) for k in range(nodes))
    vote_groups = tuple(tuple(range(j, world_size, node_size)) for j in range(node_size))
    return HybridLayout(world_size, node_size, nodes, node_groups, vote_groups)


def resolve_node_size(option: int | None, environ: Mapping[str, str]) -> tuple[int, str]:
    """G and where it came from: the option, else the first launcher variable set (see NODE_SIZE_VARIABLES)."""
    if option is not None:
        return option, "hybrid.node_size"
    for name in NODE_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise LionCubConfigError(
                    f"LionCub: the environment variable {name}={value!r} should be the number of ranks on this "
                    f"machine; fix it or set hybrid.node_size explicitly."
                )
            return int(value), f"environment variable {name}"
    raise LionCubConfigError(
        f"LionCub: compressed LionCub under ZeRO needs the number of ranks per node, but no launcher variable "
        f'({", ".join(NODE_SIZE_VARIABLES)}) is set; set "hybrid": {{"node_size": G}} in the optimizer params.'
    )


@dataclass
class HybridGroups:
    """This rank's two process groups (``None`` stands for a group of one rank)."""

    layout: HybridLayout
    node_group: dist.ProcessGroup | None
    vote_group: dist.ProcessGroup | None


def create_groups(layout: HybridLayout, rank: int) -> HybridGroups:
    """Create every node group, then every vote group, on every rank; return this rank's two.

    ``new_group`` is collective over the default group and must be called for every group in the
    same order on every rank, including groups this rank is not in. They wait for a silent peer as long
    as the default group does (see :func:`process_group_timeout`).
    """
    node_group = vote_group = None
    timeout = process_group_timeout()
    for members in layout.node_groups:
        group = dist.new_group(list(members), timeout=timeout)
        if rank in members:
            node_group = group
    for members in layout.vote_groups:
        group = dist.new_group(list(members), timeout=timeout)
        if rank in members:
            vote_group = group
    return HybridGroups(layout, node_group, vote_group)


__all__ = ["NODE_SIZE_VARIABLES", "HybridGroups", "HybridLayout", "create_groups", "plan_hybrid", "resolve_node_size"]

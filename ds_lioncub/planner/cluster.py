"""The cluster and its network as the planner sees them: nodes of ranks, link rates, latency, efficiency.

The α-β model (:mod:`ds_lioncub.planner.model`) prices every collective on a :class:`Network` between
the ranks of a :class:`Cluster`; :class:`LinkEfficiency` is the fraction of the link rate a transport
reaches in each kind of collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_lioncub.comm import wire
from ds_lioncub.config import NetworkConfig
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.quantities.units import format_rate

DEFAULT_LATENCY: float = NetworkConfig.model_fields["latency"].default


@dataclass(frozen=True)
class LinkEfficiency:
    """The fraction of a link's rate a transport reaches, by kind of collective (``0 < e <= 1``).

    Attributes:
        ring: ring all-reduce, all-gather and reduce-scatter.
        all_to_all: pairwise all-to-all.
    """

    ring: float
    all_to_all: float

    def __post_init__(self) -> None:
        for name, value in (("ring", self.ring), ("all_to_all", self.all_to_all)):
            if not (math.isfinite(value) and 0 < value <= 1):
                raise LionCubConfigError(
                    f"LionCub: the {name} link efficiency must be a fraction of the link rate in (0, 1], got {value!r}."
                )

    def of(self, kind: wire.CollectiveKind) -> float:
        """The efficiency of a collective of ``kind``."""
        return self.all_to_all if kind == "all_to_all" else self.ring


# gloo over TCP on the emulated network (benchmarks/RESULTS.md, "Planner vs the emulated network, pipelined"),
# fitted on the p = 2, 1 Gbit/s measurements alone by ``python -m benchmarks.validate_planner --fit``:
# time inside the collectives of calls that ran as one piece against the bytes at the full rate. Its
# all-to-all stays below its ring even with the transport's 1 MiB segments. NCCL's rings and
# all-to-alls come near the link rate on both:
# LinkEfficiency(1.0, 1.0) (IDEAL_LINK_EFFICIENCY) is the model without transport losses.
GLOO_LINK_EFFICIENCY = LinkEfficiency(ring=0.9, all_to_all=0.68)
IDEAL_LINK_EFFICIENCY = LinkEfficiency(ring=1.0, all_to_all=1.0)


@dataclass(frozen=True)
class Network:
    """The links between the ranks.

    Attributes:
        inter_node_bandwidth: bytes per second, each direction, of one node's link to the network; the
            node's ranks share it (with one rank per node: each rank's own link).
        intra_node_bandwidth: bytes per second, each direction, between two ranks of one node; ``None``:
            in-node links are no bottleneck (NVLink next to Ethernet): in-node bytes cost only their rounds.
        latency: seconds per round of a collective (α): the time for the smallest message to arrive.
        efficiency: the fraction of the link rate each kind of collective reaches (default gloo's,
            :data:`GLOO_LINK_EFFICIENCY`; :data:`IDEAL_LINK_EFFICIENCY` for none lost, near NCCL's).
    """

    inter_node_bandwidth: float
    intra_node_bandwidth: float | None = None
    latency: float = DEFAULT_LATENCY
    efficiency: LinkEfficiency = GLOO_LINK_EFFICIENCY

    def __post_init__(self) -> None:
        rates = [self.inter_node_bandwidth] + ([] if self.intra_node_bandwidth is None else [self.intra_node_bandwidth])
        if not all(math.isfinite(rate) and rate > 0 for rate in rates):
            raise LionCubConfigError(f"LionCub: bandwidths must be positive and finite, got {rates}.")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise LionCubConfigError(
                f"LionCub: the latency must be a finite number of seconds >= 0, got {self.latency!r}."
            )

    @property
    def in_node_bandwidth(self) -> float:
        return math.inf if self.intra_node_bandwidth is None else self.intra_node_bandwidth


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines (M) of ``gpus_per_node`` ranks (G) each, ranks numbered node-major."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise LionCubConfigError(
                f"LionCub: a cluster needs at least 1 node of at least 1 GPU, got {self.nodes} x {self.gpus_per_node}."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def describe_network(network: Network) -> str:
    """``"1 Gbit/s, latency 50 us"`` (with the in-node rate when it differs, the link efficiencies when not gloo's)."""
    text = format_rate(network.inter_node_bandwidth)
    if network.intra_node_bandwidth is not None:
        text += f" between nodes, {format_rate(network.intra_node_bandwidth)} inside"
    text += f", latency {network.latency * 1e6:.3g} us"
    if network.efficiency != GLOO_LINK_EFFICIENCY:
        efficiency = network.efficiency
        text += f", link efficiency {efficiency.ring:g} (rings) and {efficiency.all_to_all:g} (all-to-all)"
    return text


__all__ = [
    "DEFAULT_LATENCY",
    "GLOO_LINK_EFFICIENCY",
    "IDEAL_LINK_EFFICIENCY",
    "Cluster",
    "LinkEfficiency",
    "Network",
    "describe_network",
]

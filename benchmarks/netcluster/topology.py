"""The emulated network: one namespace per node, each behind a rate-limited veth link to a switch.

```
 ncl-<id>-n0                 ncl-<id>-sw                  ncl-<id>-n1
 [ncl0 10.77.0.1] ==veth== [p0]--br0--[p1] ==veth== [ncl0 10.77.0.2]   ...
   tbf (+netem) egress        tbf egress (towards the node)
```

Every link is shaped in both directions (a full-duplex NIC of the given rate): the node's egress
qdisc limits what it sends, the switch port's egress qdisc limits what it receives. An optional
one-way delay (netem) sits on the node's egress, so a round trip between two nodes takes twice the
delay. The switch lives in its own namespace too: nothing is created in, and no address is given to,
the namespace netcluster was started from. Deleting the namespaces removes every link, qdisc and
address with them, which is what teardown and ``cleanup_leftovers`` do.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from benchmarks.netcluster.signals import shielded
from benchmarks.netcluster.system import NetclusterError, ip, list_netns, netns_pids, require_root, run, tc

PREFIX = "ncl-"
NODE_IFNAME = "ncl0"
BRIDGE = "br0"
SUBNET = "10.77.0"
MAX_NODES = 250
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<pid>\d+)-(?P<token>[0-9a-f]+)-(?P<role>sw|n\d+)$")


@dataclass(frozen=True)
class LinkSpec:
    """One node's link to the switch.

    Args:
        rate_bps: line rate in bits per second, each direction; ``None`` leaves the link unshaped.
        delay_s: one-way delay added to every packet a node sends (needs the netem qdisc).
        mtu: link MTU in bytes.
        burst_bytes: tbf bucket size; ``None`` picks max(128 KiB, 2 ms at the line rate).
        queue_latency_s: tbf ``latency``: how long a packet may wait in the shaper's queue.
        segment_offload: keep GSO on (TCP hands the link up to 64 KiB super-frames, counted with one
            set of headers each, as most NIC drivers with TSO count); ``False`` makes every frame
            MTU-sized, so the counters see every frame's headers, at a higher CPU cost.
    """

    rate_bps: int | None = 1_000_000_000
    delay_s: float = 0.0
    mtu: int = 1500
    burst_bytes: int | None = None
    queue_latency_s: float = 0.05
    segment_offload: bool = True

    def __post_init__(self) -> None:
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None, got {self.rate_bps}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if not 68 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [68, 65535], got {self.mtu}")

    @property
    def burst(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        assert self.rate_bps is not None
        return max(128 * 1024, int(self.rate_bps / 8 * 0.002), self.mtu + 64)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` namespaces, each with the same link, and ``node_size`` ranks in each.

    The ``node_size`` ranks of one node share its namespace, hence its address: their traffic to each
    other goes over the namespace's loopback, unshaped and in no link counter (as two GPUs of one
    machine talk over NVLink or PCIe, not the NIC), while traffic to other nodes crosses the node's
    shaped link. ``node_size`` 1 (the default) makes every rank a node.
    """

    nodes: int
    link: LinkSpec = field(default_factory=LinkSpec)
    node_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in [1, {MAX_NODES}], got {self.nodes}")
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")

    @property
    def world_size(self) -> int:
        """Ranks in the whole cluster: ``nodes * node_size``."""
        return self.nodes * self.node_size


def new_cluster_id() -> str:
    """``<pid>-<token>``: the owner's pid lets ``cleanup_leftovers`` tell live clusters from dead ones."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


class Cluster:
    """An emulated cluster; a context manager that builds it on entry and removes it on exit.

    >>> with Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=10**9))) as cluster:
    ...     cluster.node_netns(0), cluster.node_address(0)   # ('ncl-123-ab12cd-n0', '10.77.0.1')
    """

    def __init__(self, spec: ClusterSpec, cluster_id: str | None = None) -> None:
        self.spec = spec
        self.cluster_id = cluster_id or new_cluster_id()

    # ------------------------------------------------------------------ names

    @property
    def switch_netns(self) -> str:
        return f"{PREFIX}{self.cluster_id}-sw"

    def node_netns(self, node: int) -> str:
        return f"{PREFIX}{self.cluster_id}-n{node}"

    def node_address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @staticmethod
    def switch_port(node: int) -> str:
        return f"p{node}"

    @property
    def node_ifname(self) -> str:
        return NODE_IFNAME

    @property
    def namespaces(self) -> list[str]:
        return [self.node_netns(node) for node in range(self.spec.nodes)] + [self.switch_netns]

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    def up(self) -> None:
        """Create the switch, the nodes and their shaped links. On any failure, undo and re-raise."""
        require_root()
        try:
            self._add_netns(self.switch_netns)
            ip("link", "add", BRIDGE, "type", "bridge", netns=self.switch_netns)
            ip("link", "set", BRIDGE, "up", netns=self.switch_netns)
            for node in range(self.spec.nodes):
                self._add_node(node)
        except BaseException:
            self.down()
            raise

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        ip("link", "set", "lo", "up", netns=name)
        # No IPv6: its router solicitations and multicast reports would add stray frames to the counters.
        run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "sysctl",
                "-q",
                "-w",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            check=False,
        )

    def _add_node(self, node: int) -> None:
        link = self.spec.link
        ns, port, mtu = self.node_netns(node), self.switch_port(node), str(link.mtu)
        self._add_netns(ns)
        ip(
            "link",
            "add",
            port,
            "mtu",
            mtu,
            "type",
            "veth",
            "peer",
            "name",
            NODE_IFNAME,
            "netns",
            ns,
            netns=self.switch_netns,
        )
        ip("link", "set", NODE_IFNAME, "mtu", mtu, netns=ns)
        if not link.segment_offload:
            ip("link", "set", NODE_IFNAME, "gso_max_segs", "1", netns=ns)
            ip("link", "set", port, "gso_max_segs", "1", netns=self.switch_netns)
        ip("link", "set", port, "master", BRIDGE, netns=self.switch_netns)
        ip("link", "set", port, "up", netns=self.switch_netns)
        ip("addr", "add", f"{self.node_address(node)}/24", "dev", NODE_IFNAME, netns=ns)
        ip("link", "set", NODE_IFNAME, "up", netns=ns)
        self._shape(ns, NODE_IFNAME, with_delay=True)
        self._shape(self.switch_netns, port, with_delay=False)

    def _shape(self, ns: str, dev: str, with_delay: bool) -> None:
        link = self.spec.link
        delay = with_delay and link.delay_s > 0
        if link.rate_bps is None and not delay:
            return
        parent = ["root"]
        if delay:
            delay_us = str(max(1, round(link.delay_s * 1e6))) + "us"
            # Enough queue for a full bandwidth-delay product, so netem never drops.
            limit = "100000"
            done = tc(
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                delay_us,
                "limit",
                limit,
                netns=ns,
                check=False,
            )
            if done.returncode != 0:
                reason = (done.stderr or done.stdout).strip()
                hint = " (this kernel has no netem qdisc: CONFIG_NET_SCH_NETEM)" if "unknown" in reason.lower() else ""
                raise NetclusterError(
                    f"cannot add a {link.delay_s * 1e3:g} ms delay on {dev}: {reason}{hint}; run without --latency"
                )
            parent = ["parent", "1:1", "handle", "10:"]
        if link.rate_bps is not None:
            tc(
                "qdisc",
                "add",
                "dev",
                dev,
                *parent,
                "tbf",
                "rate",
                f"{link.rate_bps}bit",
                "burst",
                str(link.burst),
                "latency",
                f"{max(1, round(link.queue_latency_s * 1e3))}ms",
                netns=ns,
            )

    def down(self) -> None:
        """Stop every process left in the cluster's namespaces and delete them; verify they are gone."""
        with shielded():
            remove_namespaces(self.namespaces)

    def exists(self) -> list[str]:
        """The cluster's namespaces that currently exist."""
        present = set(list_netns())
        return [name for name in self.namespaces if name in present]


def remove_namespaces(names: list[str], grace_s: float = 3.0) -> None:
    """Kill what runs inside ``names`` (SIGTERM, then SIGKILL after ``grace_s``), then delete them.

    Only namespaces netcluster created are ever passed here, so every process inside is one it
    started. Raises :class:`NetclusterError` naming any namespace that could not be removed.
    """
    present = [name for name in names if name in set(list_netns())]
    _stop_processes(present, grace_s)
    failures = {}
    for name in present:
        done = ip("netns", "del", name, check=False)
        if done.returncode != 0:
            failures[name] = done.stderr.strip()
    left = [name for name in names if name in set(list_netns())]
    # A deletion that failed because another process (a concurrent clean-up) removed the namespace
    # first has reached the goal: only namespaces still present are failures.
    if left:
        reasons = "; ".join(f"{name}: {failures.get(name, 'still present')}" for name in left)
        raise NetclusterError(f"could not remove namespaces {left}: {reasons}")


def _stop_processes(names: list[str], grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = {pid for name in names for pid in netns_pids(name)}
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = {pid for name in names for pid in netns_pids(name)}
        if not pids:
            return


@dataclass(frozen=True)
class Leftover:
    """A cluster found by its namespace names."""

    cluster_id: str
    owner_pid: int
    namespaces: list[str]
    owner_alive: bool
    busy: bool  # processes still run inside it (orphaned ranks, if the owner is dead)


def find_leftovers() -> list[Leftover]:
    """Every netcluster cluster whose namespaces exist, grouped by cluster id."""
    groups: dict[str, list[str]] = {}
    pids: dict[str, int] = {}
    for name in list_netns():
        match = _NAME.match(name)
        if match:
            cluster_id = f"{match['pid']}-{match['token']}"
            groups.setdefault(cluster_id, []).append(name)
            pids[cluster_id] = int(match["pid"])
    leftovers = []
    for cluster_id, names in sorted(groups.items()):
        leftovers.append(
            Leftover(
                cluster_id=cluster_id,
                owner_pid=pids[cluster_id],
                namespaces=sorted(names),
                owner_alive=_alive(pids[cluster_id]),
                busy=any(netns_pids(name) for name in names),
            )
        )
    return leftovers


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def cleanup_leftovers(include_live: bool = False) -> list[Leftover]:
    """Remove clusters whose owner died (or, with ``include_live``, every netcluster cluster).

    A cluster whose owner process still runs belongs to a run in progress and is left alone unless
    ``include_live``. Processes still running inside a removed cluster (ranks orphaned when their
    owner was SIGKILLed) are stopped first. Returns what was removed.
    """
    require_root()
    removed = []
    for leftover in find_leftovers():
        if leftover.owner_alive and not include_live:
            continue
        remove_namespaces(leftover.namespaces)
        removed.append(leftover)
    return removed

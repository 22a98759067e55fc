"""Making one node of a running :class:`~benchmarks.netcluster.topology.Cluster` go silent without closing
its sockets, as a pulled cable or a hung host does (a process that dies closes them, and its peers hear it).

- ``drop``: every packet to and from the node is dropped: a ``blackhole`` qdisc replaces the shaper on
  the node's egress and on its switch port's egress (the node's own ingress). Both ends keep their links
  up and their connections open; TCP retransmits into the void.
- ``unplug``: the node's port on the switch goes down (``ip link set pN down``): the cable is pulled.
  The node's interface loses carrier; nothing it sends reaches the switch, nothing reaches it.
- ``freeze``: every process in the node's namespace gets SIGSTOP: a hung host. Its kernel still
  acknowledges what arrives until the socket buffers fill, but nothing answers.

All three leave every process running, so the peers can only notice by a timeout. Teardown of the
cluster removes the qdiscs and links with the namespaces; frozen processes are killed there too.
"""

from __future__ import annotations

import os
import signal

from benchmarks.netcluster.system import ip, netns_pids, tc
from benchmarks.netcluster.topology import Cluster

FAULTS = ("drop", "unplug", "freeze")


def drop_all_traffic(cluster: Cluster, node: int) -> None:
    """Drop every packet ``node`` sends or is sent; its interfaces and sockets stay as they are."""
    tc("qdisc", "replace", "dev", cluster.node_ifname, "root", "blackhole", netns=cluster.node_netns(node))
    tc("qdisc", "replace", "dev", cluster.switch_port(node), "root", "blackhole", netns=cluster.switch_netns)


def unplug(cluster: Cluster, node: int) -> None:
    """Take ``node``'s switch port down, as if its cable were pulled."""
    ip("link", "set", cluster.switch_port(node), "down", netns=cluster.switch_netns)


def freeze(cluster: Cluster, node: int) -> list[int]:
    """SIGSTOP every process in ``node``'s namespace (a hung host); returns their pids."""
    pids = netns_pids(cluster.node_netns(node))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    return pids


def inject(cluster: Cluster, node: int, fault: str) -> None:
    """Apply ``fault`` (one of :data:`FAULTS`) to ``node``."""
    if fault == "drop":
        drop_all_traffic(cluster, node)
    elif fault == "unplug":
        unplug(cluster, node)
    elif fault == "freeze":
        freeze(cluster, node)
    else:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")

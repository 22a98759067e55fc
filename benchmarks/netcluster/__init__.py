"""netcluster: an emulated Ethernet cluster on one machine (network namespaces, veth, tc).

Modules, one job each: :mod:`~benchmarks.netcluster.topology` (namespaces, links, shaping, teardown,
leftover cleanup), :mod:`~benchmarks.netcluster.runner` (one process per rank with the
torch.distributed environment), :mod:`~benchmarks.netcluster.counters` (bytes on the wire),
:mod:`~benchmarks.netcluster.signals` (Ctrl-C / SIGTERM into exceptions), :mod:`~benchmarks.netcluster.report`
(summaries), :mod:`~benchmarks.netcluster.units` (rates and durations), :mod:`~benchmarks.netcluster.system`
(the ip / tc commands) and :mod:`~benchmarks.netcluster.cli`.

Python use::

    from benchmarks.netcluster import Cluster, ClusterSpec, LinkSpec, run_command, parse_rate
    with signals_as_exceptions(), Cluster(ClusterSpec(nodes=4, link=LinkSpec(parse_rate("1gbit")))) as cluster:
        result = run_command(cluster, ["python", "bench.py"])
    print(result.wire)   # per-node Counters(tx_bytes, rx_bytes, tx_packets, rx_packets)
"""

from benchmarks.netcluster.counters import Counters, parse_counters, read_in_netns, read_sysfs
from benchmarks.netcluster.runner import RankResult, RunResult, rank_environment, run_command
from benchmarks.netcluster.signals import Interrupted, shielded, signals_as_exceptions
from benchmarks.netcluster.system import NetclusterError, unavailable_reason
from benchmarks.netcluster.topology import (
    Cluster,
    ClusterSpec,
    LinkSpec,
    cleanup_leftovers,
    find_leftovers,
)
from benchmarks.netcluster.units import parse_count, parse_duration, parse_rate

__all__ = [
    "Cluster",
    "ClusterSpec",
    "Counters",
    "Interrupted",
    "LinkSpec",
    "NetclusterError",
    "RankResult",
    "RunResult",
    "cleanup_leftovers",
    "find_leftovers",
    "parse_count",
    "parse_counters",
    "parse_duration",
    "parse_rate",
    "rank_environment",
    "read_in_netns",
    "read_sysfs",
    "run_command",
    "shielded",
    "signals_as_exceptions",
    "unavailable_reason",
]

"""benchmarks/netcluster for real: namespaces, links, shapers, counters, teardown and leftover cleanup.

Needs root with working ``ip netns`` (marker ``netns``: skipped with the reason otherwise, see conftest.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import REPO
from benchmarks.netcluster import (
    Cluster,
    ClusterSpec,
    LinkSpec,
    NetclusterError,
    RunResult,
    cleanup_leftovers,
    find_leftovers,
    parse_rate,
    read_in_netns,
    run_command,
    system,
)
from benchmarks.netcluster.counters import as_mtu_frames
from benchmarks.netcluster.report import format_summary
from benchmarks.netcluster.system import list_netns

pytestmark = pytest.mark.netns

TRANSFER = textwrap.dedent("""
    import json, os, socket, sys, time
    n = int(sys.argv[1]); rank = int(os.environ["RANK"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        server = socket.create_server((addr, port))
        conn, _ = server.accept()
        got, buf, start = 0, bytearray(1 << 16), time.perf_counter()
        while got < n:
            k = conn.recv_into(buf)
            if not k:
                break
            got += k
        print(json.dumps({"received": got, "seconds": time.perf_counter() - start}))
        conn.sendall(b"k")
    else:
        for _ in range(200):
            try:
                sock = socket.create_connection((addr, port))
                break
            except OSError:
                time.sleep(0.01)
        sock.sendall(b"x" * n)
        sock.recv(1)
""")


def _ours(cluster: Cluster) -> list[str]:
    return [name for name in list_netns() if name.startswith(f"ncl-{cluster.cluster_id}-")]


def _transfer(cluster: Cluster, nbytes: int, tmp_path: Path) -> tuple[dict[str, float], RunResult]:
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    result = run_command(cluster, [sys.executable, str(script), str(nbytes)], echo=None, timeout_s=30)
    assert result.ok, result.ranks
    line = next(line for line in result.ranks[0].output_tail if line.startswith("{"))
    return json.loads(line), result


def test_topology_is_built_and_removed() -> None:
    spec = ClusterSpec(nodes=3, link=LinkSpec(rate_bps=parse_rate("200mbit"), mtu=1400))
    with Cluster(spec) as cluster:
        assert sorted(_ours(cluster)) == sorted(cluster.namespaces)
        ports = json.loads(system.ip("-j", "link", "show", "master", "br0", netns=cluster.switch_netns).stdout)
        assert sorted(port["ifname"] for port in ports) == ["p0", "p1", "p2"]
        for node in range(3):
            ns = cluster.node_netns(node)
            link = json.loads(system.ip("-j", "addr", "show", "ncl0", netns=ns).stdout)[0]
            assert link["mtu"] == 1400 and link["operstate"] in ("UP", "UNKNOWN")
            assert link["addr_info"][0]["local"] == f"10.77.0.{node + 1}"
            for qdisc_ns, dev in ((ns, "ncl0"), (cluster.switch_netns, f"p{node}")):
                qdiscs = json.loads(system.tc("-j", "qdisc", "show", "dev", dev, netns=qdisc_ns).stdout)
                tbf = [q for q in qdiscs if q["kind"] == "tbf"]
                assert tbf and tbf[0]["options"]["rate"] == 200_000_000 // 8  # tc reports bytes/s
    assert _ours(cluster) == []


def test_teardown_on_exception_and_on_failed_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(ClusterSpec(nodes=2))
    with pytest.raises(RuntimeError, match="boom"), cluster:
        assert len(_ours(cluster)) == 3
        raise RuntimeError("boom")
    assert _ours(cluster) == []
    # A setup that fails half-way (node 0 built, node 1 not) leaves nothing behind.
    add_node = Cluster._add_node

    def fail_on_second_node(self: Cluster, node: int) -> None:
        if node == 1:
            raise NetclusterError("injected failure")
        add_node(self, node)

    monkeypatch.setattr(Cluster, "_add_node", fail_on_second_node)
    broken = Cluster(ClusterSpec(nodes=3))
    with pytest.raises(NetclusterError, match="injected"):
        broken.up()
    assert _ours(broken) == []


def test_failing_rank_stops_the_others_and_cluster_is_removed() -> None:
    command = ["sh", "-c", 'if [ "$RANK" = 1 ]; then echo bad; exit 7; fi; sleep 30']
    started = time.monotonic()
    with Cluster(ClusterSpec(nodes=3)) as cluster:
        result = run_command(cluster, command, echo=None, grace_s=2.0)
    assert time.monotonic() - started < 10
    assert result.exit_code == 7 and result.failed_rank == 1
    assert result.ranks[1].output_tail == ["bad"]
    assert result.ranks[0].exit_code is None and result.ranks[2].exit_code is None  # stopped by netcluster
    assert "rank 1 (node 1) failed with exit code 7" in format_summary(result)
    assert _ours(cluster) == []


def test_counters_and_rate_limit(tmp_path: Path) -> None:
    nbytes, rate = 3_000_000, parse_rate("100mbit")
    with Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=rate))) as cluster:
        assert read_in_netns(cluster.node_netns(0), "ncl0").tx_bytes >= 0
        measured, result = _transfer(cluster, nbytes, tmp_path)
    sender, receiver = result.wire[1], result.wire[0]
    assert measured["received"] == nbytes
    # Payload plus headers, counted once on each side of the switch.
    assert nbytes <= sender.tx_bytes <= nbytes * 1.06 and nbytes <= receiver.rx_bytes <= nbytes * 1.06
    assert receiver.tx_bytes < nbytes * 0.05  # only ACKs go back
    frames = as_mtu_frames(sender)
    expected_s = frames.tx_bytes * 8 / rate  # 0.25 s
    assert 0.6 * expected_s < measured["seconds"] < 3 * expected_s + 0.3, (measured, expected_s)


def test_unshaped_link_is_not_limited(tmp_path: Path) -> None:
    with Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=None))) as cluster:
        measured, _ = _transfer(cluster, 3_000_000, tmp_path)
    assert measured["seconds"] < 0.25 * 0.6  # well under the 100 Mbit/s time above


PAIR = textwrap.dedent("""
    import json, os, socket, sys, time
    n, sender, rank = int(sys.argv[1]), int(sys.argv[2]), int(os.environ["RANK"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        server = socket.create_server((addr, port))
        conn, (peer, _) = server.accept()
        got, buf, start = 0, bytearray(1 << 16), time.perf_counter()
        while got < n:
            k = conn.recv_into(buf)
            if not k:
                break
            got += k
        print(json.dumps({"received": got, "seconds": time.perf_counter() - start, "peer": peer}))
        conn.sendall(b"k")
    elif rank == sender:
        for _ in range(200):
            try:
                sock = socket.create_connection((addr, port))
                break
            except OSError:
                time.sleep(0.01)
        sock.sendall(b"x" * n)
        sock.recv(1)
""")


def _pair(cluster: Cluster, nbytes: int, sender: int, port: int, tmp_path: Path) -> tuple[dict, RunResult]:
    """Rank ``sender`` sends ``nbytes`` to rank 0 over TCP; the other ranks exit at once."""
    script = tmp_path / "pair.py"
    script.write_text(PAIR)
    result = run_command(
        cluster, [sys.executable, str(script), str(nbytes), str(sender)], master_port=port, echo=None, timeout_s=30
    )
    assert result.ok, result.ranks
    line = next(line for line in result.ranks[0].output_tail if '"received"' in line)
    return json.loads(line), result


def test_node_size_ranks_of_a_node_talk_unshaped_and_nodes_through_the_link(tmp_path: Path) -> None:
    """2 nodes x 2 ranks: ranks 0 and 1 share node 0's namespace and loopback, rank 2 is behind node 1's link."""
    nbytes, rate = 6_000_000, parse_rate("100mbit")  # 0.5 s through the shaped link
    spec = ClusterSpec(nodes=2, link=LinkSpec(rate_bps=rate), node_size=2)
    with Cluster(spec) as cluster:
        assert sorted(_ours(cluster)) == sorted(cluster.namespaces) and len(cluster.namespaces) == 3
        for node in range(2):
            ns = cluster.node_netns(node)
            shaped = json.loads(system.tc("-j", "qdisc", "show", "dev", "ncl0", netns=ns).stdout)
            assert [q["options"]["rate"] for q in shaped if q["kind"] == "tbf"] == [rate // 8]
            loopback = json.loads(system.tc("-j", "qdisc", "show", "dev", "lo", netns=ns).stdout)
            assert not any(q["kind"] in ("tbf", "netem") for q in loopback)  # nothing shapes a node's own traffic
        inside, inside_run = _pair(cluster, nbytes, sender=1, port=29511, tmp_path=tmp_path)
        across, across_run = _pair(cluster, nbytes, sender=2, port=29512, tmp_path=tmp_path)
    # run_command took the cluster's node size: 4 ranks, two per node.
    assert [rank.node for rank in inside_run.ranks] == [0, 0, 1, 1] and inside_run.ranks_per_node == 2
    assert inside["received"] == across["received"] == nbytes
    # Inside a node: from the node's own address over its loopback, far faster than the link, in no link counter.
    assert inside["peer"] == cluster.node_address(0)
    assert inside["seconds"] < 0.5 * 0.5, inside
    for counters in inside_run.wire:
        assert counters.tx_bytes + counters.rx_bytes < 0.01 * nbytes, inside_run.wire
    # Across nodes: node 1's address, at the link's rate, and counted on both nodes' links.
    assert across["peer"] == cluster.node_address(1)
    expected_s = as_mtu_frames(across_run.wire[1]).tx_bytes * 8 / rate
    assert 0.6 * expected_s < across["seconds"] < 3 * expected_s + 0.3, (across, expected_s)
    assert nbytes <= across_run.wire[1].tx_bytes <= 1.06 * nbytes
    assert nbytes <= across_run.wire[0].rx_bytes <= 1.06 * nbytes
    assert across_run.wire[0].tx_bytes < 0.05 * nbytes  # only ACKs go back


def test_latency_needs_netem_or_delays() -> None:
    cluster = Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=10**9, delay_s=0.02)))
    try:
        cluster.up()
    except NetclusterError as error:
        assert "netem" in str(error) and "latency" in str(error)
        assert _ours(cluster) == []
        return
    try:
        probe = [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import os, socket, time
            if os.environ["RANK"] == "0":
                s = socket.create_server((os.environ["MASTER_ADDR"], 29500)); c, _ = s.accept(); c.recv(1)
            else:
                time.sleep(0.3); t = time.perf_counter()
                c = socket.create_connection((os.environ["MASTER_ADDR"], 29500))
                print("rtt", time.perf_counter() - t); c.sendall(b"x")
        """),
        ]
        result = run_command(cluster, probe, echo=None, timeout_s=20)
        rtt = float(result.ranks[1].output_tail[-1].split()[1])
        assert 0.035 < rtt < 0.5  # SYN and SYN-ACK each wait 20 ms
    finally:
        cluster.down()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_tears_down_on_signal(sig: int, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.netcluster",
            "--ranks",
            "2",
            "--bandwidth",
            "10mbit",
            "--",
            "sh",
            "-c",
            "echo started; sleep 60",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"ncl-{process.pid}-"
    try:
        assert process.stdout is not None
        assert process.stdout.readline().endswith("started\n")  # the ranks run, so the cluster is up
        assert any(name.startswith(prefix) for name in list_netns())
        process.send_signal(sig)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + sig, err
    assert "cluster removed" in err
    assert not any(name.startswith(prefix) for name in list_netns())


def test_cleanup_removes_only_dead_owners_clusters() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = Cluster(ClusterSpec(nodes=2), cluster_id=f"{dead.pid}-abc123")
    live = Cluster(ClusterSpec(nodes=1))  # owned by this (live) process
    orphan.up()
    try:
        with live:
            # An orphaned rank still running inside the dead owner's cluster is stopped by cleanup.
            sleeper = subprocess.Popen(["ip", "netns", "exec", orphan.node_netns(0), "sleep", "60"])
            time.sleep(0.2)
            found = {leftover.cluster_id: leftover for leftover in find_leftovers()}
            assert not found[orphan.cluster_id].owner_alive and found[orphan.cluster_id].busy
            assert found[live.cluster_id].owner_alive
            removed = [leftover.cluster_id for leftover in cleanup_leftovers()]
            assert orphan.cluster_id in removed and live.cluster_id not in removed
            assert _ours(orphan) == [] and len(_ours(live)) == 2
            assert sleeper.wait(timeout=10) != 0
    finally:
        orphan.down()
    assert _ours(live) == []

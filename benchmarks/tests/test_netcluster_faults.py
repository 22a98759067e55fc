"""benchmarks/netcluster/faults.py for real: each fault silences a node without closing its connections.

A TCP echo between two nodes answers before the fault; after it, the peer's connection stays open and
nothing comes back (no reset, no close). Needs root with working ``ip netns`` (marker ``netns``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.netcluster import Cluster, ClusterSpec
from benchmarks.netcluster.faults import FAULTS, inject

pytestmark = pytest.mark.netns

ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], 29531))
    print("listening", flush=True)
    conn, _ = server.accept()
    while data := conn.recv(64):
        conn.sendall(data)
""")

CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(200):
        try:
            sock = socket.create_connection((sys.argv[1], 29531), timeout=5)
            break
        except OSError:
            time.sleep(0.02)
    sock.sendall(b"a")
    print("before:", sock.recv(64).decode(), flush=True)
    sys.stdin.readline()  # the fault is in place
    sock.sendall(b"b")
    sock.settimeout(3)
    try:
        data = sock.recv(64)
        print("after:", "closed" if not data else "answered " + data.decode(), flush=True)
    except TimeoutError:
        print("after: silent", flush=True)
    except OSError as error:
        print("after: error", error, flush=True)
""")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_silences_the_node_and_keeps_the_connection_open(fault: str) -> None:
    with Cluster(ClusterSpec(nodes=2)) as cluster:
        address = cluster.node_address(1)
        server = subprocess.Popen(
            ["ip", "netns", "exec", cluster.node_netns(1), sys.executable, "-c", ECHO_SERVER, address],
            stdout=subprocess.PIPE,
            text=True,
        )
        client = subprocess.Popen(
            ["ip", "netns", "exec", cluster.node_netns(0), sys.executable, "-c", CLIENT, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None and client.stdout is not None and client.stdin is not None
            assert server.stdout.readline() == "listening\n"
            assert client.stdout.readline() == "before: a\n"  # the link works before the fault
            inject(cluster, 1, fault)
            time.sleep(0.1)
            client.stdin.write("go\n")
            client.stdin.flush()
            after, _ = client.communicate(timeout=30)
            assert after == "after: silent\n", after
            assert server.poll() is None  # the silent node's process is still there (running or stopped)
        finally:
            for process in (client, server):
                process.kill()
                process.communicate()


def test_an_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="freeze"):
        inject(Cluster(ClusterSpec(nodes=2)), 0, "reboot")  # refused before touching the (never built) cluster

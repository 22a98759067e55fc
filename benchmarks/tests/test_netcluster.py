"""benchmarks/netcluster: the emulated cluster harness, and bench_comm's bookkeeping.

The first half (units, counters, results, reports) runs anywhere. The second half builds real
namespaces, links and shapers and needs root with working ``ip netns``; it is skipped with the
reason otherwise.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_comm  # noqa: E402
from benchmarks.netcluster import (  # noqa: E402
    Cluster,
    ClusterSpec,
    Counters,
    LinkSpec,
    NetclusterError,
    RunResult,
    cleanup_leftovers,
    find_leftovers,
    parse_count,
    parse_counters,
    parse_duration,
    parse_rate,
    rank_environment,
    read_in_netns,
    read_sysfs,
    run_command,
    system,
    unavailable_reason,
)
from benchmarks.netcluster.counters import as_mtu_frames  # noqa: E402
from benchmarks.netcluster.report import format_summary  # noqa: E402
from benchmarks.netcluster.system import list_netns  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Logic that needs no privileges


@pytest.mark.parametrize(("text", "bits"), [
    ("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8), ("125mbps", 10**9), ("1kibit", 1024),
    ("1e9", 10**9), ("800kbit", 800_000),
])
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gbyte", "-1gbit", "0bit", "1xbit"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_parse_duration_and_count() -> None:
    assert parse_duration("0.2ms") == pytest.approx(2e-4)
    assert parse_duration("200us") == pytest.approx(2e-4)
    assert parse_duration("1s") == 1.0 and parse_duration("0") == 0.0
    assert parse_count("1e8") == 10**8 and parse_count("10M") == 10**7 and parse_count("1000") == 1000
    for bad in ("1.5", "2h", "ms"):
        with pytest.raises(ValueError):
            parse_count(bad) if bad != "2h" else parse_duration(bad)


def test_parse_counters() -> None:
    text = ("/sys/class/net/ncl0/statistics/tx_bytes:1234\n/sys/class/net/ncl0/statistics/rx_bytes:99\n"
            "/sys/class/net/ncl0/statistics/tx_packets:7\n/sys/class/net/ncl0/statistics/rx_packets:3\n")
    assert parse_counters(text) == Counters(1234, 99, 7, 3)
    with pytest.raises(ValueError, match="missing"):
        parse_counters("/x/tx_bytes:1\n")
    with pytest.raises(ValueError, match="unexpected"):
        parse_counters("/x/collisions:1\n")


def test_read_sysfs_from_a_directory(tmp_path: Path) -> None:
    stats = tmp_path / "eth9" / "statistics"
    stats.mkdir(parents=True)
    for name, value in {"tx_bytes": 10, "rx_bytes": 20, "tx_packets": 1, "rx_packets": 2}.items():
        (stats / name).write_text(f"{value}\n")
    assert read_sysfs("eth9", root=tmp_path) == Counters(10, 20, 1, 2)
    with pytest.raises(NetclusterError, match="no interface"):
        read_sysfs("eth8", root=tmp_path)


def test_counter_arithmetic_and_frames() -> None:
    assert Counters(10, 20, 1, 2) - Counters(4, 5, 1, 1) == Counters(6, 15, 0, 1)
    assert Counters.from_dict(Counters(1, 2, 3, 4).to_dict()) == Counters(1, 2, 3, 4)
    # Measured here: 50 MB over a 1 Gbit link; with offload 793 super-frames were counted, without
    # offload the counters saw 52,287,128 bytes in 34,545 frames.
    frames = as_mtu_frames(Counters(50_052_330, 0, 793, 0), mtu=1500)
    assert frames.tx_bytes == pytest.approx(52_287_128, rel=1e-3)
    assert frames.tx_packets == pytest.approx(34_545, rel=1e-3)
    # Traffic already in MTU-sized frames (and pure ACKs) is left as it is.
    assert as_mtu_frames(Counters(1514 * 10, 66 * 5, 10, 5)) == Counters(1514 * 10, 66 * 5, 10, 5)


def test_run_result_round_trip_and_summary() -> None:
    result = RunResult(
        command=["python", "x.py"], nodes=2, ranks_per_node=1, rate_bps=10**9, delay_s=0.0, exit_code=3,
        elapsed_s=1.5, ranks=[], wire=[Counters(100, 200, 1, 2), Counters(200, 100, 2, 1)], failed_rank=None,
    )
    again = RunResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result and not again.ok and again.world_size == 2
    summary = format_summary(result)
    assert "exit code 3" in summary and "| 1 | 200 (200 B) | 100 (100 B) | 2 | 1 |" in summary


def test_rank_environment() -> None:
    cluster = Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=10**8)), cluster_id="1-abc")
    env = rank_environment(cluster, rank=3, ranks_per_node=2, master_port=1234, base={"OMP_NUM_THREADS": "3"})
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["NODE_RANK"] == "1" and env["MASTER_ADDR"] == "10.77.0.1" and env["MASTER_PORT"] == "1234"
    assert env["GLOO_SOCKET_IFNAME"] == env["NETCLUSTER_IFNAME"] == "ncl0"
    assert env["NETCLUSTER_RATE_BPS"] == "100000000" and env["OMP_NUM_THREADS"] == "3"
    assert cluster.node_netns(1) == "ncl-1-abc-n1" and cluster.switch_netns == "ncl-1-abc-sw"


def test_not_root_is_said_clearly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetclusterError, match="needs root"):
        Cluster(ClusterSpec(nodes=2)).up()
    assert "needs root" in (unavailable_reason() or "")
    from benchmarks.netcluster.cli import main

    assert main(["--ranks", "2", "--", "true"]) == 1
    assert "netcluster needs root" in capsys.readouterr().err


def test_bench_comm_models_and_tables() -> None:
    assert [op.label for op in map(bench_comm.OpSpec.parse, ["1bit", "sign4-a2a"])] == [
        "1-bit vote", "4-bit sign vote, alltoall"]
    with pytest.raises(ValueError):
        bench_comm.OpSpec.parse("kbit:sign:3:allreduce")
    n, p = 10**8, 4
    assert bench_comm.OpSpec.parse("fp32").payload_bytes(n, p) == 2 * 3 / 4 * 4 * n
    assert bench_comm.OpSpec.parse("1bit").payload_bytes(n, p) == 2 * 3 / 4 * n / 8
    assert bench_comm.OpSpec.parse("kbit:l1:4:alltoall").payload_bytes(n, p) == 3 / 4 * n * 4 / 8 + 3 / 4 * n / 8
    assert bench_comm.OpSpec.parse("kbit:sign:2:allreduce").supported(4) is not None
    assert bench_comm.OpSpec.parse("kbit:l1:8:allreduce").supported(4) is None
    assert bench_comm.sizes_up_to(10**8) == [10**6, 10**7, 10**8]
    assert bench_comm.sizes_up_to(3 * 10**6) == [10**6, 3 * 10**6]
    payload = 2 * 3 / 4 * n / 8
    frames = payload + bench_comm.header_overhead(payload, 1500)
    row = {"op": "1bit", "label": "1-bit vote", "n": n, "p": p, "reps": 1, "time_s": 0.2, "times_s": [0.2],
           "collective_s": 0.15, "tx_counted": payload, "tx_frames": frames * 1.01, "busiest_frames": frames,
           "payload": payload, "ideal_s": frames * 8 / 1e9}
    fp32 = dict(row, op="fp32", label="fp32 all-reduce", time_s=5.0, busiest_frames=frames * 32)
    report = {"p": p, "rate_bps": 10**9, "mtu": 1500, "results": [fp32, row], "skipped": []}
    text = bench_comm.format_tables([report])
    assert "| 1e+08 | 1-bit vote | 0.2000 | 0.1500 | 25.0x |" in text
    assert "25.0x faster than fp32" in text and "+1.00% (target within 5%)" in text
    assert "0.1500 s vs 0.1500 s = 1.0x" in text


# ------------------------------------------------------------------------------------------------
# Real namespaces (root)

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"netcluster cannot run here: {REASON}")

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


@needs_netns
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


@needs_netns
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


@needs_netns
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


@needs_netns
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


@needs_netns
def test_unshaped_link_is_not_limited(tmp_path: Path) -> None:
    with Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=None))) as cluster:
        measured, _ = _transfer(cluster, 3_000_000, tmp_path)
    assert measured["seconds"] < 0.25 * 0.6  # well under the 100 Mbit/s time above


@needs_netns
def test_latency_needs_netem_or_delays() -> None:
    cluster = Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=10**9, delay_s=0.02)))
    try:
        cluster.up()
    except NetclusterError as error:
        assert "netem" in str(error) and "latency" in str(error)
        assert _ours(cluster) == []
        return
    try:
        probe = [sys.executable, "-c", textwrap.dedent("""
            import os, socket, time
            if os.environ["RANK"] == "0":
                s = socket.create_server((os.environ["MASTER_ADDR"], 29500)); c, _ = s.accept(); c.recv(1)
            else:
                time.sleep(0.3); t = time.perf_counter()
                c = socket.create_connection((os.environ["MASTER_ADDR"], 29500))
                print("rtt", time.perf_counter() - t); c.sendall(b"x")
        """)]
        result = run_command(cluster, probe, echo=None, timeout_s=20)
        rtt = float(result.ranks[1].output_tail[-1].split()[1])
        assert 0.035 < rtt < 0.5  # SYN and SYN-ACK each wait 20 ms
    finally:
        cluster.down()


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_tears_down_on_signal(sig: int, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.netcluster", "--ranks", "2", "--bandwidth", "10mbit", "--",
         "sh", "-c", "echo started; sleep 60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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


@needs_netns
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


@needs_netns
def test_bench_comm_runs_in_the_cluster(tmp_path: Path) -> None:
    """End to end: torch.distributed (gloo) over the shaped links, wire bytes as the model says."""
    pytest.importorskip("torch")
    out = tmp_path / "p2.json"
    command = [sys.executable, str(REPO / "benchmarks" / "bench_comm.py"), "--sizes=400000", "--ops=fp32,1bit",
               "--reps=1", "--warmup=0", f"--out={out}"]
    # Pure-torch packing: this test checks traffic, not speed, and must not wait for a kernel JIT build.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_LIONCUB_PACKING": "torch"}
    with Cluster(ClusterSpec(nodes=2, link=LinkSpec(rate_bps=parse_rate("1gbit")))) as cluster:
        result = run_command(cluster, command, echo=None, env=env, timeout_s=120)
    assert result.ok, result.ranks[result.failed_rank or 0].output_tail
    report = json.loads(out.read_text())
    by_op = {row["op"]: row for row in report["results"]}
    for op in ("fp32", "1bit"):
        row = by_op[op]
        model = row["payload"] + bench_comm.header_overhead(row["payload"], 1500)
        assert math.isclose(row["tx_frames"], model, rel_tol=0.05), (op, row)
    # The traffic went over the shaped interface: the run's counters hold at least both calls' bytes.
    assert result.wire[0].tx_bytes >= by_op["fp32"]["tx_counted"] + by_op["1bit"]["tx_counted"]

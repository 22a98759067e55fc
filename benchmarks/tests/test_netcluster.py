"""benchmarks/netcluster's logic that needs no privileges: units, counters, results, reports, rank
environments and the not-root error. The real namespaces, links and shapers (root) are tested in
test_netcluster_netns.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import REPO
from benchmarks.netcluster import (
    Cluster,
    ClusterSpec,
    Counters,
    LinkSpec,
    NetclusterError,
    RunResult,
    parse_count,
    parse_counters,
    parse_duration,
    parse_rate,
    rank_environment,
    read_sysfs,
    unavailable_reason,
)
from benchmarks.netcluster.counters import as_mtu_frames
from benchmarks.netcluster.report import format_summary


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("2.5Gbit", 25 * 10**8),
        ("125mbps", 10**9),
        ("1kibit", 1024),
        ("1e9", 10**9),
        ("800kbit", 800_000),
    ],
)
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
    text = (
        "/sys/class/net/ncl0/statistics/tx_bytes:1234\n/sys/class/net/ncl0/statistics/rx_bytes:99\n"
        "/sys/class/net/ncl0/statistics/tx_packets:7\n/sys/class/net/ncl0/statistics/rx_packets:3\n"
    )
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
        command=["python", "x.py"],
        nodes=2,
        ranks_per_node=1,
        rate_bps=10**9,
        delay_s=0.0,
        exit_code=3,
        elapsed_s=1.5,
        ranks=[],
        wire=[Counters(100, 200, 1, 2), Counters(200, 100, 2, 1)],
        failed_rank=None,
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
    # A rank started by path imports this checkout's packages, whatever PYTHONPATH held before.
    env = rank_environment(cluster, rank=0, ranks_per_node=1, master_port=1, base={"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
    assert cluster.node_netns(1) == "ncl-1-abc-n1" and cluster.switch_netns == "ncl-1-abc-sw"


def test_not_root_is_said_clearly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetclusterError, match="needs root"):
        Cluster(ClusterSpec(nodes=2)).up()
    assert "needs root" in (unavailable_reason() or "")
    from benchmarks.netcluster.cli import main

    assert main(["--ranks", "2", "--", "true"]) == 1
    assert "netcluster needs root" in capsys.readouterr().err


def test_node_size_of_a_cluster() -> None:
    assert ClusterSpec(nodes=3).node_size == 1 and ClusterSpec(nodes=3).world_size == 3  # the default: a rank a node
    spec = ClusterSpec(nodes=2, node_size=4)
    assert spec.world_size == 8
    with pytest.raises(ValueError, match="node_size must be >= 1"):
        ClusterSpec(nodes=2, node_size=0)
    # The ranks of one node share its namespace and address; LOCAL_* number them inside the node.
    cluster = Cluster(spec, cluster_id="1-abc")
    env = rank_environment(cluster, rank=5, ranks_per_node=spec.node_size, master_port=1, base={})
    assert env["NODE_RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["WORLD_SIZE"] == "8" and env["MASTER_ADDR"] == "10.77.0.1"


def test_cli_node_size_option() -> None:
    from benchmarks.netcluster.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["--ranks", "4", "--node-size", "2", "--", "true"]).ranks_per_node == 2
    assert parser.parse_args(["--ranks", "4", "--ranks-per-node", "2", "--", "true"]).ranks_per_node == 2
    assert parser.parse_args(["--ranks", "4", "--", "true"]).ranks_per_node == 1

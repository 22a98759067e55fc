"""ds_lioncub.planner: bytes per step against the protocols written out here, the α-β times against hand
formulas, the recommendations at the two ends of the network range, the units, and the CLI.

The expected bytes are written from the protocol descriptions in ds_lioncub/comm/votes.py and
docs/design.md (sections 3, 4, 12 and 16), not taken from ds_lioncub.comm.wire; the link loads are
checked against plain loops over the ranks of a node-major cluster.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from ds_lioncub import parse_config
from ds_lioncub.comm import wire
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner import (
    Candidate,
    Cluster,
    LocalCosts,
    Network,
    parse_duration,
    parse_rate,
    plan,
    predict_aggregation_seconds,
)
from ds_lioncub.planner.cli import main
from ds_lioncub.planner.local_costs import aggregation_key
from ds_lioncub.planner.model import DEEPSPEED_BUCKET_SIZE, LIONCUB_BUCKET_SIZE
from tests.support.launch import REPO

GBIT = 1e9 / 8
NO_LOCAL_WORK = LocalCosts({}, "nothing")


class ZeroCosts(LocalCosts):
    """Every entry 0: the model's communication alone."""

    def cost(self, key: str) -> float:
        return 0.0


# ---------------------------------------------------------------------------------------------- the protocols, by hand


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded(n: int, p: int) -> int:
    """n rounded up to a multiple of 8p (votes.py: every rank's chunk is whole bytes)."""
    return 8 * p * ceil_div(n, 8 * p)


def ring_all_reduce(message: int, p: int) -> int:
    return 2 * message * (p - 1) // p


def expected_aggregation_bytes(params: dict[str, Any], n: int, p: int) -> int:
    """Bytes one rank sends for one n-element aggregation over p ranks, from the protocol descriptions."""
    if p == 1:
        return 0
    compression = params["compression"]
    if compression == "none":
        size = 2 if params.get("comm_dtype") == "bf16" else 4
        return ring_all_reduce(n * size, p)
    n_pad = padded(n, p)
    if compression == "1bit":
        # all-to-all of n_pad/8 packed sign bytes (keep 1/p), all-gather of the n_pad/(8p) vote bytes
        return (p - 1) * n_pad // 8 // p + (p - 1) * n_pad // (8 * p)
    bits = params["bits"]
    if params["kbit_algorithm"] == "allreduce":
        return ring_all_reduce(ceil_div(n * bits, 8), p)
    # all-to-all of n_pad*b/8 field bytes, all-gather of the 1-bit votes of each chunk
    return (p - 1) * n_pad * bits // 8 // p + (p - 1) * n_pad // (8 * p)


def expected_step_bytes(candidate: Candidate, n: int, cluster: Cluster) -> int:
    """Bytes one rank sends in a step of ``candidate``: buckets, the finite check, ZeRO inside the node."""
    params, world = candidate.params, cluster.world_size
    finite_check = ring_all_reduce(4, world)  # one int32 per rank, compressed modes only
    if params["compression"] == "none":
        if candidate.zero_stage == 0:
            buckets = [DEEPSPEED_BUCKET_SIZE] * (n // DEEPSPEED_BUCKET_SIZE) + [n % DEEPSPEED_BUCKET_SIZE]
            return sum(expected_aggregation_bytes(params, b, world) for b in buckets if b)
        part = ceil_div(n, world)  # ZeRO-2 over the world: reduce-scatter + all-gather of fp32 partitions
        return (world - 1) * part * 4 + (world - 1) * part * 4
    if candidate.zero_stage == 0:
        buckets = [LIONCUB_BUCKET_SIZE] * (n // LIONCUB_BUCKET_SIZE) + [n % LIONCUB_BUCKET_SIZE]
        return sum(expected_aggregation_bytes(params, b, world) for b in buckets if b) + finite_check
    g, m = cluster.gpus_per_node, cluster.nodes
    shard = ceil_div(n, g)  # docs/design.md section 16: ZeRO-2 inside the node, the vote over the nodes
    zero = (g - 1) * shard * 4 + (g - 1) * shard * 4
    buckets = [LIONCUB_BUCKET_SIZE] * (shard // LIONCUB_BUCKET_SIZE) + [shard % LIONCUB_BUCKET_SIZE]
    return zero + sum(expected_aggregation_bytes(params, b, m) for b in buckets if b) + finite_check


@pytest.mark.parametrize(
    ("n", "nodes", "gpus"),
    [(1000, 1, 2), (12345, 3, 1), (123_457, 2, 4), (LIONCUB_BUCKET_SIZE * 2 + 77, 4, 2), (10**9 + 3, 2, 8)],
)
def test_bytes_per_step_equal_the_protocols(n: int, nodes: int, gpus: int) -> None:
    cluster = Cluster(nodes, gpus)
    candidates = plan(n, cluster, Network(GBIT))
    assert len({(json.dumps(c.params, sort_keys=True), c.zero_stage) for c in candidates}) == len(candidates)
    for candidate in candidates:
        assert candidate.bytes_per_step_per_rank == expected_step_bytes(candidate, n, cluster), candidate.label


def kbit_params(bits: int, quantizer: str, algorithm: str) -> dict[str, Any]:
    return {"compression": "kbit", "bits": bits, "quantizer": quantizer, "kbit_algorithm": algorithm}


# docs/design.md section 4.3: a k-bit all-reduce holds 3/15/255 sign and 1/7/127 L1 workers.
ALLREDUCE_HOLDS = {("sign", 2): 3, ("sign", 4): 15, ("sign", 8): 255, ("l1", 2): 1, ("l1", 4): 7, ("l1", 8): 127}


def compressed_modes_for(voters: int) -> list[dict[str, Any]]:
    modes = [{"compression": "1bit"}]
    for (quantizer, bits), largest in ALLREDUCE_HOLDS.items():
        modes.append(kbit_params(bits, quantizer, "alltoall"))
        if voters <= largest:
            modes.append(kbit_params(bits, quantizer, "allreduce"))
    return modes


def keys(params_list: list[dict[str, Any]]) -> set[str]:
    return {json.dumps(params, sort_keys=True) for params in params_list}


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 4), (2, 8), (16, 1), (3, 3)])
def test_every_feasible_mode_is_a_candidate_and_no_other(nodes: int, gpus: int) -> None:
    cluster = Cluster(nodes, gpus)
    candidates = plan(1000, cluster, Network(GBIT))
    flat = [c.params for c in candidates if c.zero_stage == 0]
    exact = [{"compression": "none"}, {"compression": "none", "comm_dtype": "bf16"}]
    assert keys(flat) == keys(exact + compressed_modes_for(nodes * gpus))
    zero2 = [c.params for c in candidates if c.zero_stage == 2]
    expected_zero2: list[dict[str, Any]] = []
    if nodes > 1:
        expected_zero2.append({"compression": "none"})
    if nodes > 1 and gpus > 1:
        expected_zero2 += [{**mode, "hybrid": {"node_size": gpus}} for mode in compressed_modes_for(nodes)]
    assert keys(zero2) == keys(expected_zero2)
    assert len(candidates) == len(flat) + len(zero2)
    assert [c.seconds_per_step for c in candidates] == sorted(c.seconds_per_step for c in candidates)
    for candidate in candidates:
        parse_config(candidate.params)  # every block is valid as it stands
        assert candidate.seconds_per_step == pytest.approx(candidate.comm_seconds + candidate.local_seconds)


# ---------------------------------------------------------------------------------------------- links, by plain loops


def node_major(p: int, g: int) -> list[int]:
    return [rank // g for rank in range(p)]


def simulated_link_bytes(kind: str, message: int, p: int, g: int) -> tuple[int, int]:
    """(most bytes out of one node, most bytes one rank sends inside its node) for a group spanning the cluster.

    Ring collectives: every step each rank sends one chunk to rank + 1; all-to-all: rank r sends
    chunk j of its message to rank j.
    """
    node = node_major(p, g)
    out_of_node = [0] * (p // g)
    in_node = [0] * p
    if kind == "all_to_all":
        sends = [(r, j, message // p) for r in range(p) for j in range(p) if j != r]
    else:
        steps, chunk = {"all_gather": (p - 1, message), "all_reduce": (2 * (p - 1), message // p)}[kind]
        sends = [(r, (r + 1) % p, chunk) for _ in range(steps) for r in range(p)]
    for source, target, size in sends:
        if node[source] != node[target]:
            out_of_node[node[source]] += size
        else:
            in_node[source] += size
    return max(out_of_node), max(in_node)


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather", "all_reduce"])
@pytest.mark.parametrize(("p", "g"), [(2, 1), (4, 2), (8, 4), (6, 3), (8, 8)])
def test_link_bytes_of_a_group_spanning_the_cluster_equal_a_plain_loop(kind: str, p: int, g: int) -> None:
    message = 96 * p  # divisible by p: the loops' chunks are whole
    loads = wire.link_bytes(wire.Collective(kind, message, p), "spanning", g)  # type: ignore[arg-type]
    out_of_node, in_node = simulated_link_bytes(kind, message, p, g)
    assert (loads.node_link, loads.within_node) == (out_of_node, in_node)


def test_the_hybrid_vote_groups_share_the_node_link() -> None:
    """G vote groups of one rank per node: every byte each member sends leaves the node, G-fold."""
    vote = wire.Collective("all_to_all", 800, 4)
    loads = wire.link_bytes(vote, "one_per_node", 8)
    assert (loads.node_link, loads.within_node) == (8 * 800 * 3 // 4, 0)
    zero = wire.Collective("reduce_scatter", 800, 8)
    assert (wire.link_bytes(zero, "within_node", 8).node_link, wire.link_bytes(zero, "within_node", 8).within_node) == (
        0,
        800 * 7 // 8,
    )


# ---------------------------------------------------------------------------------------------- times, by hand


@pytest.mark.parametrize("p", [2, 3, 8])
def test_one_aggregation_costs_its_rounds_and_bytes(p: int) -> None:
    """rounds x latency + bytes / bandwidth + local work per element, with one rank per node."""
    n, beta, alpha = 1_000_003, 1.25e8, 40e-6
    costs = LocalCosts({"1bit": 2e-9, "none/fp32": 0.0, "kbit/sign/4/alltoall/vote": 3e-9})
    network = Network(beta, None, alpha)
    n_pad = padded(n, p)
    one_bit = 2 * (p - 1) * alpha + ((p - 1) * n_pad // 8 // p + (p - 1) * n_pad // (8 * p)) / beta + 2e-9 * n
    assert predict_aggregation_seconds({"compression": "1bit"}, n, p, network, costs) == pytest.approx(one_bit)
    exact = 2 * (p - 1) * alpha + ring_all_reduce(4 * n, p) / beta
    assert predict_aggregation_seconds({"compression": "none"}, n, p, network, costs) == pytest.approx(exact)
    sign4 = kbit_params(4, "sign", "alltoall")
    kbit = 2 * (p - 1) * alpha + expected_aggregation_bytes(sign4, n, p) / beta + 3e-9 * n
    assert predict_aggregation_seconds(sign4, n, p, network, costs) == pytest.approx(kbit)


def test_the_node_link_is_shared_and_in_node_bytes_use_the_in_node_rate() -> None:
    """Exact Lion on 2 x 4 ranks: the ring's bytes cross the 1 Gbit/s node link; 1 node: only the in-node rate."""
    n = 10**6
    slow_nodes = Network(GBIT, 100 * GBIT, 0.0)
    [two_nodes] = [
        c
        for c in plan(n, Cluster(2, 4), slow_nodes, ZeroCosts({}))
        if c.params == {"compression": "none"} and c.zero_stage == 0
    ]
    assert two_nodes.comm_seconds == pytest.approx(ring_all_reduce(4 * n, 8) / GBIT)
    [one_node] = [c for c in plan(n, Cluster(1, 8), slow_nodes, ZeroCosts({})) if c.params == {"compression": "none"}]
    assert one_node.comm_seconds == pytest.approx(ring_all_reduce(4 * n, 8) / (100 * GBIT))
    [free] = [
        c
        for c in plan(n, Cluster(1, 8), Network(GBIT, None, 5e-6), ZeroCosts({}))
        if c.params == {"compression": "none"}
    ]
    assert free.comm_seconds == pytest.approx(2 * 7 * 5e-6)  # intra-node rate not given: no bottleneck


# ---------------------------------------------------------------------------------------------- recommendations


def test_on_a_slow_network_a_large_model_is_compressed_and_exact_lion_is_10x_slower() -> None:
    candidates = plan(1_500_000_000, Cluster(4, 8), Network(parse_rate("1gbit"), None, parse_duration("50us")))
    best = candidates[0]
    assert best.compression != "none"
    for exact in (c for c in candidates if c.compression == "none"):
        assert exact.seconds_per_step >= 10 * best.seconds_per_step, exact.label
    # and on communication alone, without this machine's local costs
    comm_only = plan(1_500_000_000, Cluster(4, 8), Network(GBIT), ZeroCosts({}))
    assert comm_only[0].compression != "none"
    assert min(c.seconds_per_step for c in comm_only if c.compression == "none") >= 10 * comm_only[0].seconds_per_step


@pytest.mark.parametrize("gpus", [1, 8])
def test_on_a_fast_network_a_small_model_runs_exact_lion(gpus: int) -> None:
    network = Network(parse_rate("400gbit"), None, parse_duration("5us"))
    best = plan(100_000, Cluster(2, gpus), network)[0]
    assert best.params["compression"] == "none"


def test_a_world_of_one_sends_nothing() -> None:
    candidates = plan(10**6, Cluster(1, 1), Network(GBIT))
    assert all(c.bytes_per_step_per_rank == 0 and c.comm_seconds == 0 for c in candidates)
    assert candidates[0].compression == "none"  # no local work to add


# ---------------------------------------------------------------------------------------------- units and input


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("1gbit", 1e9 / 8),
        ("400gbit", 400e9 / 8),
        ("250mbit", 250e6 / 8),
        ("10GB/s", 10e9),
        ("125mbps", 125e6),
        ("1.5 Gbit", 1.5e9 / 8),
        ("100kbit", 100e3 / 8),
    ],
)
def test_parse_rate(text: str, bytes_per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize(
    ("text", "seconds"), [("5us", 5e-6), ("50us", 50e-6), ("1ms", 1e-3), ("0.2s", 0.2), ("0s", 0.0)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "fast", "1", "1 gbyte", "-1gbit", "0gbit", "1xbit"])
def test_a_bad_rate_is_refused_with_examples(text: str) -> None:
    with pytest.raises(LionCubConfigError, match="LionCub: "):
        parse_rate(text)


@pytest.mark.parametrize("text", ["5", "5 lightyears", "abc"])
def test_a_bad_duration_is_refused(text: str) -> None:
    with pytest.raises(LionCubConfigError, match="LionCub: "):
        parse_duration(text)


def test_bad_clusters_and_networks_are_refused() -> None:
    for make in (
        lambda: Cluster(0, 8),
        lambda: Cluster(2, 0),
        lambda: Network(0.0),
        lambda: Network(GBIT, -1.0),
        lambda: Network(GBIT, None, -1e-6),
        lambda: Network(math.inf),
    ):
        with pytest.raises(LionCubConfigError, match="LionCub: "):
            make()


def test_a_table_without_an_entry_names_the_fix() -> None:
    with pytest.raises(LionCubConfigError, match="--calibrate"):
        predict_aggregation_seconds({"compression": "1bit"}, 1000, 2, Network(GBIT), NO_LOCAL_WORK)
    assert (
        aggregation_key(parse_config({"compression": "kbit", "quantizer": "l1", "bits": 8}))
        == "kbit/l1/8/allreduce/vote"
    )


def test_a_saved_table_loads_back(tmp_path: Any) -> None:
    table = LocalCosts({"lion_update": 1e-9, "1bit": 2e-9}, "here")
    path = tmp_path / "costs.json"
    path.write_text(table.to_json())
    loaded = LocalCosts.load(path)
    assert dict(loaded.seconds_per_element) == {"lion_update": 1e-9, "1bit": 2e-9} and loaded.measured_on == "here"
    path.write_text('{"seconds_per_element": {"1bit": -1}}')
    with pytest.raises(LionCubConfigError, match="--calibrate --save"):
        LocalCosts.load(path)


# ---------------------------------------------------------------------------------------------- the command line


def test_cli_json_matches_the_schema_and_the_model() -> None:
    """One real ``python -m ds_lioncub.planner --json`` run."""
    command = [
        sys.executable,
        "-m",
        "ds_lioncub.planner",
        "--params",
        "1.5e9",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--inter-node-bandwidth",
        "1gbit",
        "--latency",
        "50us",
        "--json",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout)
    assert set(output) == {"recommended", "candidates"}
    assert set(output["recommended"]) == {"params", "zero_stage"}
    rows = output["candidates"]
    for row in rows:
        assert set(row) == {"params", "zero_stage", "seconds_per_step", "bytes_per_step_per_rank"}
        parse_config(row["params"])
        assert row["zero_stage"] in (0, 2) and isinstance(row["bytes_per_step_per_rank"], int)
    assert [row["seconds_per_step"] for row in rows] == sorted(row["seconds_per_step"] for row in rows)
    assert output["recommended"] == {"params": rows[0]["params"], "zero_stage": rows[0]["zero_stage"]}
    expected = plan(1_500_000_000, Cluster(4, 8), Network(GBIT, None, 50e-6))
    assert [(row["params"], row["zero_stage"], row["bytes_per_step_per_rank"]) for row in rows] == [
        (c.params, c.zero_stage, c.bytes_per_step_per_rank) for c in expected
    ]


def test_cli_table_shows_every_candidate_and_the_block_to_paste(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--params",
        "1e5",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--inter-node-bandwidth",
        "400gbit",
        "--latency",
        "5us",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    candidates = plan(100_000, Cluster(2, 8), Network(parse_rate("400gbit"), None, 5e-6))
    assert all(candidate.label in text for candidate in candidates)
    block = json.loads(text[text.index("ds_config:") + len("ds_config:") :])
    assert block["optimizer"] == {"type": "LionCub", "params": candidates[0].params}
    assert block["zero_optimization"] == {"stage": candidates[0].zero_stage}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2", "--gpus-per-node", "8", "--inter-node-bandwidth", "1gbit"], "--params"),
        (["--params", "1e9", "--nodes", "2", "--gpus-per-node", "8", "--inter-node-bandwidth", "fast"], "fast"),
        (["--params", "-3", "--nodes", "2", "--gpus-per-node", "8", "--inter-node-bandwidth", "1gbit"], "-3"),
        (
            [
                "--params",
                "1e9",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--inter-node-bandwidth",
                "1gbit",
                "--latency",
                "5",
            ],
            "unit",
        ),
        (["--params", "1e9", "--nodes", "0", "--gpus-per-node", "8", "--inter-node-bandwidth", "1gbit"], "--nodes"),
    ],
)
def test_cli_bad_arguments_exit_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "usage:" in error and message in error, error

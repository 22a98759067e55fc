"""bench_comm's bookkeeping (op specs, payload models, tables) and one real run in an emulated cluster."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from benchmarks import bench_comm
from benchmarks.netcluster import Cluster, ClusterSpec, LinkSpec, parse_rate, run_command
from ds_lioncub.comm import CompressedBackend


def test_bench_comm_models_and_tables() -> None:
    assert [op.label for op in map(bench_comm.OpSpec.parse, ["1bit", "sign4-a2a"])] == [
        "1-bit vote",
        "4-bit sign vote, alltoall",
    ]
    with pytest.raises(ValueError):
        bench_comm.OpSpec.parse("kbit:sign:3:allreduce")
    # Pipeline chunks: a count, "whole" (one piece), or the backend's default; never on a dense op.
    assert bench_comm.OpSpec.parse("1bit@2M").pipeline_chunk_numel == 2 * 10**6
    assert bench_comm.OpSpec.parse("sign4-a2a@whole").pipeline_chunk_numel is None
    assert bench_comm.OpSpec.parse("sign4-a2a@whole").name == "kbit:sign:4:alltoall@whole"
    assert bench_comm.OpSpec.parse("1bit").pipeline_chunk_numel == CompressedBackend().pipeline_chunk_numel
    for bad in ("fp32@2M", "1bit@two"):
        with pytest.raises(ValueError):
            bench_comm.OpSpec.parse(bad)
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
    row = {
        "op": "1bit",
        "label": "1-bit vote",
        "n": n,
        "p": p,
        "reps": 1,
        "time_s": 0.2,
        "times_s": [0.2],
        "collective_s": 0.15,
        "tx_counted": payload,
        "tx_frames": frames * 1.01,
        "busiest_frames": frames,
        "payload": payload,
        "ideal_s": frames * 8 / 1e9,
    }
    fp32 = dict(row, op="fp32", label="fp32 all-reduce", time_s=5.0, busiest_frames=frames * 32)
    report = {"p": p, "rate_bps": 10**9, "mtu": 1500, "results": [fp32, row], "skipped": []}
    text = bench_comm.format_tables([report])
    assert "| 1e+08 | 1-bit vote | 0.2000 | 0.1500 | 25.0x |" in text
    assert "25.0x faster than fp32" in text and "+1.00% (target within 5%)" in text
    assert "0.1500 s vs 0.1500 s = 1.0x" in text


@pytest.mark.netns
def test_bench_comm_runs_in_the_cluster(tmp_path: Path) -> None:
    """End to end: torch.distributed (gloo) over the shaped links, wire bytes as the model says."""
    pytest.importorskip("torch")
    out = tmp_path / "p2.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_comm",
        "--sizes=400000",
        "--ops=fp32,1bit",
        "--reps=1",
        "--warmup=0",
        f"--out={out}",
    ]
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

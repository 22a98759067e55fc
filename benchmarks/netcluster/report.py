"""Human-readable summaries of a run: per-node wire traffic and the ranks that failed."""

from __future__ import annotations

from benchmarks.netcluster.runner import RunResult
from benchmarks.netcluster.units import format_bytes, format_rate


def format_summary(result: RunResult) -> str:
    """A markdown table of each node's counters, with the average send rate over the run."""
    rate = "unshaped" if result.rate_bps is None else format_rate(result.rate_bps)
    delay = f", +{result.delay_s * 1e3:g} ms one-way" if result.delay_s else ""
    lines = [
        (
            f"netcluster: {result.nodes} node(s) x {result.ranks_per_node} rank(s), links {rate}{delay}; "
            f"exit code {result.exit_code} after {result.elapsed_s:.2f} s"
        ),
        "",
        "| node | tx bytes | rx bytes | tx packets | rx packets | avg tx rate |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for node, wire in enumerate(result.wire):
        tx_rate = format_rate(wire.tx_bytes * 8 / result.elapsed_s) if result.elapsed_s > 0 else "-"
        lines.append(
            f"| {node} | {wire.tx_bytes} ({format_bytes(wire.tx_bytes)}) | {wire.rx_bytes} "
            f"({format_bytes(wire.rx_bytes)}) | {wire.tx_packets} | {wire.rx_packets} | {tx_rate} |"
        )
    if result.timed_out:
        lines.append("\ntimed out: every rank was stopped")
    if result.failed_rank is not None:
        failed = result.ranks[result.failed_rank]
        lines.append(
            f"\nrank {failed.rank} (node {failed.node}) failed with exit code {failed.exit_code}; "
            f"the other ranks were stopped. Its last output lines:"
        )
        lines.extend(f"    {line}" for line in failed.output_tail)
    return "\n".join(lines)

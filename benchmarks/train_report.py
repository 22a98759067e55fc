"""Tables, target checks and plots from bench_train.py's per-method results.

A result is the JSON a worker wrote (benchmarks/train_worker.py): per-step columns (means over
ranks) plus the final validation loss. Everything here is plain arithmetic over those columns, so
it can be re-run on saved results (``bench_train.py --report-only``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.train_methods import (
    HYBRID,
    HYBRID_BYTES_TARGET,
    HYBRID_SPEEDUP_TARGET,
    HYBRID_STAGE0,
    HYBRID_ZERO_BASELINE,
    METHODS_BY_NAME,
    QUALITY_TARGETS,
    QUALITY_TOLERANCE,
)

BASELINE = "lion_fp32"
WARMUP_STEPS = 3  # lazy state allocation, first JIT loads, allocator growth: left out of step means
TRAIN_LOSS_TAIL = 20  # steps averaged for the final train loss (single steps are noisy)
SPEEDUP_TARGET = 4.0
COMM_SHARE_CONDITION = 0.80


@dataclass(frozen=True)
class Breakdown:
    """Mean seconds per step (after the warm-up steps) and bytes sent per step per rank."""

    forward_s: float
    backward_s: float
    update_s: float
    comm_s: float
    total_s: float
    tx_bytes: float

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.total_s if self.total_s > 0 else 0.0


def load_results(directory: Path, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{method: result}`` for every ``<method>.json`` in ``directory`` (in ``names`` order if given)."""
    wanted = names if names is not None else [name for name in METHODS_BY_NAME if (directory / f"{name}.json").exists()]
    results = {}
    for name in wanted:
        path = directory / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"no result for {name}: {path} is missing (did its run fail? see the logs)")
        results[name] = json.loads(path.read_text())
    return results


def breakdown(result: dict[str, Any], warmup: int = WARMUP_STEPS) -> Breakdown:
    per_step = result["per_step"]
    steps = len(per_step["total_s"])
    skip = min(warmup, steps - 1)

    def mean(column: str) -> float:
        return statistics.fmean(per_step[column][skip:])

    return Breakdown(
        mean("forward_s"), mean("backward_s"), mean("update_s"), mean("comm_s"), mean("total_s"), mean("tx_bytes")
    )


def final_train_loss(result: dict[str, Any], tail: int = TRAIN_LOSS_TAIL) -> float:
    losses = result["per_step"]["loss"]
    return statistics.fmean(losses[-min(tail, len(losses)) :])


def wall_clock(result: dict[str, Any]) -> list[float]:
    """Seconds of training at the end of each step (the steps' totals, summed)."""
    elapsed, total = [], 0.0
    for seconds in result["per_step"]["total_s"]:
        total += seconds
        elapsed.append(total)
    return elapsed


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, running = [], 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        out.append(running / min(i + 1, window))
    return out


def relative_gap(loss: float, reference: float) -> float:
    """(loss - reference) / reference: positive when worse than the reference."""
    return (loss - reference) / reference


def _label(name: str) -> str:
    method = METHODS_BY_NAME.get(name)
    return method.label if method else name


def breakdown_table(results: dict[str, dict[str, Any]]) -> str:
    base = breakdown(results[BASELINE]) if BASELINE in results else None
    lines = [
        "| method | forward (ms) | backward (ms) | update (ms) | communication (ms) | total (ms) | comm share "
        "| speed-up vs Lion fp32 | sent/step/rank (MB) | bits/param/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        row = breakdown(result)
        speedup = f"{base.total_s / row.total_s:.2f}x" if base else "-"
        bits = 8 * row.tx_bytes / result["n_params"]
        lines.append(
            f"| {_label(name)} | {1e3 * row.forward_s:.0f} | {1e3 * row.backward_s:.0f} | {1e3 * row.update_s:.0f} "
            f"| {1e3 * row.comm_s:.0f} | {1e3 * row.total_s:.0f} | {100 * row.comm_share:.0f}% | {speedup} "
            f"| {row.tx_bytes / 1e6:.2f} | {bits:.2f} |"
        )
    return "\n".join(lines)


def quality_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| method | β2 | val loss | vs reference | reference | train loss (last 20) | training time (s) "
        "| params equal on all ranks |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for name, result in results.items():
        method = result["method"]
        reference = method["reference"]
        gap = "-"
        if reference in results and reference != name:
            gap = f"{100 * relative_gap(result['val_loss'], results[reference]['val_loss']):+.2f}%"
        lines.append(
            f"| {_label(name)} | {method['beta2']} | {result['val_loss']:.4f} | {gap} | {_label(reference)} "
            f"| {final_train_loss(result):.4f} | {wall_clock(result)[-1]:.1f} | {result['params_in_sync']} |"
        )
    return "\n".join(lines)


def target_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The benchmark's targets (step speed-up over Lion fp32 where communication dominates, validation loss
    within QUALITY_TOLERANCE of the reference), each with the measured figure and whether it is met."""
    lines = []
    if BASELINE in results:
        base = breakdown(results[BASELINE])
        condition = "met" if base.comm_share >= COMM_SHARE_CONDITION else "NOT met"
        lines.append(
            f"Lion fp32 step: communication is {100 * base.comm_share:.0f}% of it "
            f"(the speed target assumes >= {100 * COMM_SHARE_CONDITION:.0f}%: {condition})."
        )
        for name in ("lioncub_1bit", "lioncub_4bit_sign", "lioncub_8bit_l1"):
            if name in results:
                row = breakdown(results[name])
                speedup = base.total_s / row.total_s
                verdict = "met" if speedup >= SPEEDUP_TARGET else "NOT met"
                lines.append(
                    f"{_label(name)} step {speedup:.2f}x faster than Lion fp32 "
                    f"({1e3 * row.total_s:.0f} ms vs {1e3 * base.total_s:.0f} ms; target >= "
                    f"{SPEEDUP_TARGET:.0f}x: {verdict}); communication {1e3 * row.comm_s:.0f} ms vs "
                    f"{1e3 * base.comm_s:.0f} ms ({base.comm_s / max(row.comm_s, 1e-9):.1f}x less)."
                )
    for name in QUALITY_TARGETS:
        if name in results and results[name]["method"]["reference"] in results:
            reference = results[name]["method"]["reference"]
            gap = relative_gap(results[name]["val_loss"], results[reference]["val_loss"])
            verdict = "met" if gap <= QUALITY_TOLERANCE else "NOT met"
            lines.append(
                f"{_label(name)}: val loss {results[name]['val_loss']:.4f} vs {_label(reference)} "
                f"{results[reference]['val_loss']:.4f}, {100 * gap:+.2f}% (target within "
                f"{100 * QUALITY_TOLERANCE:.0f}%: {verdict})."
            )
    for name in ("lioncub_1bit", "lioncub_1bit_b95", "lioncub_1bit_b95_sync"):
        if name in results and results[name]["method"]["reference"] in results:
            reference = results[name]["method"]["reference"]
            gap = relative_gap(results[name]["val_loss"], results[reference]["val_loss"])
            lines.append(
                f"{_label(name)}: val loss {results[name]['val_loss']:.4f}, {100 * gap:+.2f}% vs "
                f"{_label(reference)} ({results[reference]['val_loss']:.4f})."
            )
    return lines


def state_bytes(result: dict[str, Any]) -> int | None:
    """The most optimizer-state bytes (``exp_avg``) any rank held, or None for a result without the figure."""
    per_rank = result.get("optimizer_state_bytes")
    return max(per_rank) if per_rank else None


def _zero_stage(result: dict[str, Any]) -> int:
    return int(result["method"].get("zero_stage", 0))


def zero_table(results: dict[str, dict[str, Any]]) -> str:
    """Step time, bytes between nodes and optimizer state per rank, for the results that record the state.

    With several ranks per node the link counters only see traffic between nodes, shared by the node's
    ranks: *between nodes/step/rank* is the node link's bytes sent per step divided by its ranks.
    """
    lines = [
        "| method | ZeRO stage | ranks/node | total (ms) | communication (ms) | between nodes/step/rank (MB) "
        "| optimizer state/rank (MB) | val loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        held = state_bytes(result)
        if held is None:
            continue
        row = breakdown(result)
        lines.append(
            f"| {_label(name)} | {_zero_stage(result)} | {result.get('node_size', 1)} | {1e3 * row.total_s:.0f} "
            f"| {1e3 * row.comm_s:.0f} | {row.tx_bytes / 1e6:.3f} | {held / 1e6:.2f} | {result['val_loss']:.4f} |"
        )
    return "\n".join(lines)


def hybrid_target_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The ZeRO hybrid's targets against ZeRO-2 Lion (step time, bytes between nodes) and stage-0 Lion Cub
    1-bit (optimizer state 1/G of it, validation loss within QUALITY_TOLERANCE), each measured and judged."""
    if HYBRID not in results:
        return []
    hybrid = results[HYBRID]
    row = breakdown(hybrid)
    lines = []
    if HYBRID_ZERO_BASELINE in results:
        base = breakdown(results[HYBRID_ZERO_BASELINE])
        speedup = base.total_s / row.total_s
        fewer = base.tx_bytes / max(row.tx_bytes, 1e-9)
        lines.append(
            f"{_label(HYBRID)} step {speedup:.2f}x faster than {_label(HYBRID_ZERO_BASELINE)} "
            f"({1e3 * row.total_s:.0f} ms vs {1e3 * base.total_s:.0f} ms; target >= {HYBRID_SPEEDUP_TARGET:g}x: "
            f"{'met' if speedup >= HYBRID_SPEEDUP_TARGET else 'NOT met'})."
        )
        lines.append(
            f"{_label(HYBRID)} sends {fewer:.1f}x fewer bytes between nodes than {_label(HYBRID_ZERO_BASELINE)} "
            f"({row.tx_bytes / 1e6:.3f} MB vs {base.tx_bytes / 1e6:.2f} MB per step per rank; target >= "
            f"{HYBRID_BYTES_TARGET:g}x: {'met' if fewer >= HYBRID_BYTES_TARGET else 'NOT met'})."
        )
    if HYBRID_STAGE0 in results:
        stage0 = results[HYBRID_STAGE0]
        node_size = int(hybrid.get("node_size", 1))
        held, full = state_bytes(hybrid), state_bytes(stage0)
        if held is not None and full:
            # ZeRO pads each partition to an alignment boundary: allow a little over full / G.
            met = held * node_size <= full * 1.001
            lines.append(
                f"{_label(HYBRID)} optimizer state {held / 1e6:.2f} MB per rank = 1/{full / held:.3f} of "
                f"{_label(HYBRID_STAGE0)}'s {full / 1e6:.2f} MB (target 1/G = 1/{node_size}: "
                f"{'met' if met else 'NOT met'})."
            )
        gap = relative_gap(hybrid["val_loss"], stage0["val_loss"])
        lines.append(
            f"{_label(HYBRID)}: val loss {hybrid['val_loss']:.4f} vs {_label(HYBRID_STAGE0)} "
            f"{stage0['val_loss']:.4f} at {hybrid['steps']} vs {stage0['steps']} steps, {100 * gap:+.2f}% "
            f"(target within {100 * QUALITY_TOLERANCE:.0f}%: {'met' if abs(gap) <= QUALITY_TOLERANCE else 'NOT met'})."
        )
    return lines


def write_plots(results: dict[str, dict[str, Any]], out_dir: Path, smoothing: int = 10) -> list[Path]:
    """loss_vs_step.png and loss_vs_time.png: train loss (mean over ranks, trailing mean of ``smoothing`` steps)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    for file_name, x_label, x_of in (
        ("loss_vs_step.png", "step", lambda r: list(range(1, len(r["per_step"]["loss"]) + 1))),
        ("loss_vs_time.png", "training time (s, sum of step times)", wall_clock),
    ):
        figure, axes = plt.subplots(figsize=(8, 5), dpi=110)
        for name, result in results.items():
            style = "--" if result["method"]["beta2"] != 0.99 else "-"
            axes.plot(
                x_of(result),
                moving_average(result["per_step"]["loss"], smoothing),
                style,
                label=_label(name),
                linewidth=1.2,
            )
        first = next(iter(results.values()))
        settings = first["settings"]
        # The first steps fall from ~5.5 nats; the differences between methods are in what follows.
        tails = [
            moving_average(r["per_step"]["loss"], smoothing)[len(r["per_step"]["loss"]) // 10 :]
            for r in results.values()
        ]
        if all(tails):
            low, high = min(min(t) for t in tails), max(max(t) for t in tails)
            axes.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
        axes.set_xlabel(x_label)
        axes.set_ylabel(f"train loss (trailing mean of {smoothing} steps)")
        rate = first.get("link_rate_bps")
        link = f"{rate / 1e9:g} Gbit/s links" if rate else "unshaped loopback"
        axes.set_title(
            f"GPT {first['n_params'] / 1e6:.1f}M params, {first['world_size']} ranks, {link}, lr {settings['lr']:g}",
            fontsize=10,
        )
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = out_dir / file_name
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


def markdown_report(results: dict[str, dict[str, Any]]) -> str:
    first = next(iter(results.values()))
    settings = first["settings"]
    rate = first.get("link_rate_bps")
    node_size = int(first.get("node_size", 1))
    layout = f" ({first['world_size'] // node_size} nodes x {node_size})" if node_size > 1 else ""
    header = (
        f"GPT with {first['n_params']:,} parameters ({settings['n_layer']} layers, d_model {settings['d_model']}), "
        f"{first['world_size']} ranks{layout}, {'%g Gbit/s links' % (rate / 1e9) if rate else 'unshaped loopback'}, "
        f"{first['steps']} steps of {settings['micro_batch']} x {settings['seq_len']} tokens per rank, "
        f"lr {settings['lr']:g}, weight decay {settings['weight_decay']:g}, {first['threads_per_rank']} thread(s) "
        f"per rank. Step times: means over steps {WARMUP_STEPS + 1}-{first['steps']} of the mean over ranks."
    )
    parts = [header, "", "Per step:", "", breakdown_table(results), "", "Quality:", "", quality_table(results), ""]
    parts += [f"- {line}" for line in target_lines(results)]
    if any(state_bytes(result) is not None for result in results.values()):
        parts += ["", "Between nodes and optimizer state:", "", zero_table(results), ""]
        parts += [f"- {line}" for line in hybrid_target_lines(results)]
    return "\n".join(parts) + "\n"

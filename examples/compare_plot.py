"""examples/compare.py's loss plot: each run's per-step training loss, and its difference to the baseline's.

:func:`write_loss_plot` draws each run's per-step training loss (rank 0's, as train_gpt.py records it
in ``train_loss_rank0``) into one PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1) : index + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def write_loss_plot(runs: Sequence[tuple[str, list[float]]], path: Path, title: str, smoothing: int = 10) -> Path:
    """One curve per (label, per-step losses) into a PNG at ``path``; returns ``path``.

    Top: the losses as recorded. The runs share seed, data and model, so their curves lie on top of
    each other; the bottom panel shows each later run's loss minus the first run's (the baseline),
    as a trailing mean over ``smoothing`` steps, where the differences can be seen.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (losses_axes, difference_axes) = plt.subplots(
        2, 1, figsize=(8, 7), dpi=110, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    # Runs can train identically (with 2 ranks the 1-bit and 4-bit sign votes are the same vote):
    # distinct dash patterns keep a curve drawn under another visible.
    styles = ["-", "--", "-.", ":"]
    baseline_label, baseline = runs[0]
    for index, (label, losses) in enumerate(runs):
        style, colour = styles[index % len(styles)], f"C{index}"
        steps = range(1, len(losses) + 1)
        losses_axes.plot(steps, losses, style, color=colour, label=label, linewidth=1.2)
        if index > 0:
            difference = [mine - base for mine, base in zip(losses, baseline, strict=False)]
            difference_axes.plot(
                steps[: len(difference)], trailing_mean(difference, smoothing), style, color=colour, linewidth=1.2
            )
    losses_axes.set_ylabel("train loss (rank 0, one batch)")
    losses_axes.set_title(title, fontsize=10)
    losses_axes.legend(fontsize=8)
    difference_axes.axhline(0.0, color="0.5", linewidth=0.8)
    difference_axes.set_ylabel(f"minus {baseline_label.split(':')[0]}\n(trailing mean, {smoothing} steps)", fontsize=8)
    difference_axes.set_xlabel("optimizer step")
    for axes in (losses_axes, difference_axes):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


__all__ = ["trailing_mean", "write_loss_plot"]

"""examples/compare_plot.py: the loss plot examples.compare writes (no DeepSpeed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples import compare_plot

# matplotlib's default colour cycle: curve i is drawn in CYCLE[i].
CYCLE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def _colours_present(path: Path) -> list[bool]:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))[..., :3]
    present = []
    for colour in CYCLE:
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        close = (abs(pixels - rgb) < 0.02).all(axis=-1)
        present.append(int(close.sum()) > 50)
    return present


def test_trailing_mean() -> None:
    assert compare_plot.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert compare_plot.trailing_mean([3.0, 6.0, 0.0], 10) == [3.0, 4.5, 3.0]


def test_loss_plot_has_one_curve_per_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the loss plot needs matplotlib (setup.py's bench extra)")
    runs = [(f"run {i}", [5.0 - 0.01 * step - 0.3 * i for step in range(150)]) for i in range(4)]
    path = compare_plot.write_loss_plot(runs, tmp_path / "plots" / "loss.png", "test")
    assert path == tmp_path / "plots" / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _colours_present(path) == [True, True, True, True, False, False]

"""``--plot``: the figure's points and error bars against per-seed values, and paths refused before training.

The expected means and error bars are computed here with the standard library's statistics: the half-width of
the 95% Student-t interval over 3 seeds, t(2) x the sample standard deviation / sqrt(3), with t(2) in closed
form (P(|T| < t) = t / sqrt(2 + t^2) at 2 degrees of freedom), not with ds_lioncub's seed_summary.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib)")

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.simulate.plot import check_plot_path, gap_figure, write_gap_plot
from ds_lioncub.simulate.table import Row
from ds_lioncub.simulate.train import seed_summary

GAPS = {4: [0.5, 1.5, 1.0], 16: [2.0, 3.5, 2.6], 64: [4.0, 7.0, 5.5]}
T2 = 0.95 * math.sqrt(2 / (1 - 0.95**2))  # 4.3027, the 0.975 quantile of t with 2 degrees of freedom


def rows() -> list[Row]:
    vals = seed_summary([5.0, 5.1, 5.2])
    return [Row(n, vals, vals, seed_summary(gaps), None) for n, gaps in GAPS.items()]


def test_points_are_the_mean_gaps_and_bars_the_t_interval() -> None:
    figure = gap_figure(rows(), "1bit", "nodes (voters)")
    [ax] = figure.axes
    line = ax.lines[0]
    assert list(line.get_xdata()) == list(GAPS)
    assert list(line.get_ydata()) == pytest.approx([statistics.fmean(g) for g in GAPS.values()], abs=1e-12)
    [bars] = [c for c in ax.collections if len(c.get_segments()) == len(GAPS)]
    for segment, gaps in zip(bars.get_segments(), GAPS.values(), strict=True):
        (x0, low), (x1, high) = segment
        half_width = T2 * statistics.stdev(gaps) / math.sqrt(len(gaps))
        assert x0 == x1 and low == pytest.approx(statistics.fmean(gaps) - half_width)
        assert high == pytest.approx(statistics.fmean(gaps) + half_width)
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "nodes (voters)"


def test_the_plot_is_written_in_the_format_its_name_asks(tmp_path: Path) -> None:
    path = tmp_path / "deeper" / "gap.svg"
    check_plot_path(path)  # creates the folder
    write_gap_plot(rows(), path, "1bit")
    assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()


@pytest.mark.parametrize(("name", "expected"), [("gap.xyz", "not 'xyz'"), ("gap", "has no extension")])
def test_a_name_matplotlib_cannot_write_is_refused(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: --plot") as error:
        check_plot_path(tmp_path / name)
    assert expected in str(error.value) and "png" in str(error.value)

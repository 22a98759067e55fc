"""``--plot PATH``: the gap to exact Lion against the worker count, its 95% Student-t interval as error bars.

matplotlib is optional (``pip install matplotlib``): :func:`check_plot_path` runs before any training,
so a missing matplotlib or a format it cannot write is an error then, not after the runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_lioncub.errors import LionCubConfigError, MissingDependencyError
from ds_lioncub.simulate.table import Row


def check_plot_path(path: Path) -> None:
    """Raise unless matplotlib is importable and can write ``path``'s format; creates its folder."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise MissingDependencyError(
            "LionCub: --plot needs matplotlib, which is not installed: pip install matplotlib (or drop --plot)."
        ) from None
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        given = f"not {suffix!r}" if suffix else "and the name has no extension"
        raise LionCubConfigError(
            f"LionCub: --plot {path}: matplotlib writes {', '.join(sorted(formats))}, {given}; name the file e.g. "
            f"gap.png."
        )
    if path.is_dir():
        raise LionCubConfigError(f"LionCub: --plot {path} is a folder; name a file in it, e.g. {path / 'gap.png'}.")
    path.parent.mkdir(parents=True, exist_ok=True)


def gap_figure(rows: list[Row], title: str, xlabel: str = "workers") -> Any:
    """The figure: gap % (mean over seeds) at each worker count, error bars the mean's 95% Student-t interval
    (± its half-width, the table's; none with one seed), a log2 worker axis and the zero line (exact Lion)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.5, 4.5))
    ax = figure.add_subplot()
    workers = [row.workers for row in rows]
    ax.errorbar(
        workers,
        [row.gap.mean for row in rows],
        yerr=[row.gap.half_width or 0.0 for row in rows],
        marker="o",
        capsize=3,
        label="mode vs exact Lion",
    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(n) for n in workers])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("val loss vs exact Lion, % (mean, 95% t interval over seeds)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def write_gap_plot(rows: list[Row], path: Path, title: str, xlabel: str = "workers") -> None:
    """Draw :func:`gap_figure` into ``path`` (its format from the extension)."""
    gap_figure(rows, title, xlabel).savefig(path, dpi=120)

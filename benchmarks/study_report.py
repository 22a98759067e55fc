"""The report of the convergence study (benchmarks/study_convergence.py): a Markdown table and a plot.

Reads every run JSON of one study directory. For each (beta2, workers, mode) it pairs the mode's runs
with exact Lion's runs of the same worker count and seed, and summarises over the seeds both have:

- gap %: 100 x (mode val - exact val) / exact val per seed; mean ± half-width of the mean's two-sided
  95% Student-t interval over the n seeds, t(n - 1) x sample sd / sqrt(n) (ds_lioncub.quantities.student_t);
  "real" only where the interval excludes 0 (never with one seed);
- exact 2 sd %: exact Lion's own seed-to-seed spread at that worker count (2 x the sample standard
  deviation of its val losses, in % of their mean; no interval): how far val loss moves between seeds
  with no compression;
- match / flip / tie: the applied update's sign against exact Lion's sign(mean_i c_i) at the same
  step, averaged over steps and seeds.

The planner's summary of the same cells (convergence_evidence.json) is benchmarks/study_evidence.py's.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_lioncub.quantities.student_t import mean_interval, sample_sd
from ds_lioncub.simulate.train import gap_percent

MODE_LABELS = {
    "1bit": "1-bit vote",
    "1bit_sync": "1-bit + emb/head sync /10",
    "8bit_l1_a2a": "8-bit L1 all-to-all",
    "8bit_l1_a2a_clip8": "8-bit L1 all-to-all, l1_clip 8",
    "1bit_sketchclip": "1-bit vote, option clip (sketched mean-gradient norm)",
    "1bit_syncall128_sketchclip": "1-bit + all momentum sync /128 (bf16), option clip",
    "4bit_l1_a2a_sketchclip": "4-bit L1 all-to-all, option clip",
    "8bit_l1_a2a_sketchclip": "8-bit L1 all-to-all, option clip",
    "1bit_syncall32": "1-bit + all momentum sync /32 (bf16)",
    "1bit_syncall128": "1-bit + all momentum sync /128 (bf16)",
    "4bit_sign": "4-bit sign (a-r <=15, else a2a)",
    "2bit_l1_a2a": "2-bit L1 all-to-all",
    "4bit_l1_a2a": "4-bit L1 all-to-all",
    "8bit_l1": "8-bit L1 all-reduce",
    "2bit_l1_a2a_ef_residual": "2-bit L1 a2a + EF residual",
    "2bit_l1_a2a_ef21": "2-bit L1 a2a + EF21",
    "4bit_l1_a2a_ef_residual": "4-bit L1 a2a + EF residual",
    "4bit_l1_a2a_ef21": "4-bit L1 a2a + EF21",
    "2bit_l1_a2a_ef_residual_rounding": "2-bit L1 a2a + EF residual (rounding only)",
    "4bit_l1_a2a_ef_residual_rounding": "4-bit L1 a2a + EF residual (rounding only)",
    "2bit_l1_a2a_ef_residual_bf16": "2-bit L1 a2a + EF residual (bf16)",
    "4bit_l1_a2a_ef_residual_bf16": "4-bit L1 a2a + EF residual (bf16)",
}

#: The error-feedback forms, by the mode suffix the study gives them.
EF_FORMS = {"_ef_residual": "residual (all)", "_ef21": "ef21", "_ef_residual_rounding": "residual (rounding)"}


def load_runs(directory: Path) -> dict[tuple[float, int, str], dict[int, dict[str, Any]]]:
    """(beta2, workers, mode) -> seed -> the run's JSON, without the runs :func:`runs_on_other_data` names."""
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    outliers = set(runs_on_other_data(directory))
    for path in sorted(directory.glob("N*_seed*.json")):
        if path.name in outliers:
            continue
        record = json.loads(path.read_text())
        cells[(record["beta2"], record["workers"], record["mode"])][record["seed"]] = record
    return cells


def runs_on_other_data(directory: Path) -> list[str]:
    """The runs whose first training loss differs from that of most runs of the same seed.

    The first loss is measured before any update, on the seed's first global batch and initial model,
    the same for every mode, worker count and beta2: a run where it differs trained another task (the
    example's corpus is the running Python's standard library, so another Python version means other
    data) and cannot be compared with the others.
    """
    first_losses: dict[int, dict[str, float]] = defaultdict(dict)
    for path in sorted(directory.glob("N*_seed*.json")):
        record = json.loads(path.read_text())
        first_losses[record["seed"]][path.name] = record["train_losses"][0]
    outliers = []
    for runs in first_losses.values():
        usual = Counter(runs.values()).most_common(1)[0][0]
        outliers += [name for name, loss in runs.items() if loss != usual]
    return sorted(outliers)


def pair_with_exact(exact_dir: Path, run: dict[str, Any]) -> tuple[dict[str, Any], float] | None:
    """Exact Lion's run of ``run``'s worker count, beta2 and seed in ``exact_dir`` and ``run``'s gap to it:
    (exact record, :func:`gap_percent` of the two ``val_loss``), or None when there is no such exact run.

    ``run`` needs ``workers``, ``beta2``, ``seed``, ``val_loss`` and ``train_losses``: a study run's JSON or
    any run trained like one (benchmarks/screen_vote.py's). Exact Lion's run is
    ``N<workers:02d>_exact_b2-<beta2>_seed<seed>.json``, as benchmarks/study_convergence.py names it.

    A pair whose first training losses differ is refused: None, and a warning line on stderr naming
    both. The first loss is measured before any update, so two runs of one seed on the same data and
    initial model start from the same loss (the criterion of :func:`runs_on_other_data`, here applied to
    the pair alone); a pair that does not trained two tasks and its gap means nothing. The callers are
    reports, which leave such a pair out of their tables and go on.
    """
    path = exact_dir / f"N{run['workers']:02d}_exact_b2-{run['beta2']}_seed{run['seed']}.json"
    if not path.exists():
        return None
    exact = json.loads(path.read_text())
    if run["train_losses"][0] != exact["train_losses"][0]:
        label = run.get("name") or run.get("candidate") or run.get("mode")
        print(
            f"warning: left out {label} at {run['workers']} workers, beta2 {run['beta2']}, seed {run['seed']}: "
            f"its first training loss {run['train_losses'][0]} differs from {path}'s {exact['train_losses'][0]} "
            "(trained on other data)",
            file=sys.stderr,
        )
        return None
    return exact, gap_percent(run["val_loss"], exact["val_loss"])


def paired(
    directory: Path, workers: int, beta2: float, mode: str
) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    """(mode record, exact record, gap %) for every seed with both runs on the same data, in seed order
    (:func:`pair_with_exact`)."""
    pairs = []
    for path in directory.glob(f"N{workers:02d}_{mode}_b2-{beta2}_seed*.json"):
        run = json.loads(path.read_text())
        pair = pair_with_exact(directory, run)
        if pair is not None:
            pairs.append((run, *pair))
    return sorted(pairs, key=lambda pair: int(pair[0]["seed"]))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarise(
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]], beta2: float, workers: int, mode: str
) -> dict[str, Any] | None:
    """The row of one cell, or None when no seed has both the mode and exact Lion."""
    mode_runs = cells.get((beta2, workers, mode), {})
    exact_runs = cells.get((beta2, workers, "exact"), {})
    seeds = sorted(set(mode_runs) & set(exact_runs))
    if not seeds:
        return None
    gaps = [gap_percent(mode_runs[s]["val_loss"], exact_runs[s]["val_loss"]) for s in seeds]
    exact_vals = [exact_runs[s]["val_loss"] for s in sorted(exact_runs)]
    exact_spread = 100.0 * 2.0 * sample_sd(exact_vals) / _mean(exact_vals) if len(exact_vals) > 1 else None
    agreements = [mode_runs[s]["agreement"] for s in seeds if mode_runs[s]["agreement"] is not None]
    rates = {key: _mean([a[key] for a in agreements]) for key in ("match", "flip", "tie")} if agreements else None
    return {
        "seeds": seeds,
        "gap": mean_interval(gaps),
        "exact_val": mean_interval([exact_runs[s]["val_loss"] for s in seeds]),
        "mode_val": mean_interval([mode_runs[s]["val_loss"] for s in seeds]),
        "exact_spread_percent": exact_spread,
        "rates": rates,
        "seconds_per_step": _mean([mode_runs[s]["seconds_per_step"] for s in seeds]),
    }


def summarised_cells(
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]],
    workers: list[int],
    modes: list[str],
    beta2s: list[float],
) -> Iterator[tuple[float, int, str, dict[str, Any]]]:
    """(beta2, workers, mode, :func:`summarise`'s row) of every cell with a seed of both the mode and exact Lion."""
    for beta2 in beta2s:
        for n in workers:
            for mode in modes:
                row = summarise(cells, beta2, n, mode)
                if row is not None:
                    yield beta2, n, mode, row


def report_table(
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]],
    workers: list[int],
    modes: list[str],
    beta2s: list[float],
) -> str:
    lines = [
        "| beta2 | workers | mode | seeds | exact Lion val | mode val | gap % (mean ± 95% t half-width) | real "
        "| exact 2 sd % | match | flip | tie |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for beta2, n, mode, row in summarised_cells(cells, workers, modes, beta2s):
        rates = row["rates"]
        rate_text = " | ".join(f"{rates[k]:.3f}" for k in ("match", "flip", "tie")) if rates else "- | - | -"
        exact_spread = "n/a" if row["exact_spread_percent"] is None else f"{row['exact_spread_percent']:.2f}"
        lines.append(
            f"| {beta2} | {n} | {MODE_LABELS.get(mode, mode)} | {len(row['seeds'])} | "
            f"{row['exact_val'].mean:.4f} | {row['mode_val'].mean:.4f} | {row['gap'].text(2)} | "
            f"{'**yes**' if row['gap'].real else 'no'} | {exact_spread} | {rate_text} |"
        )
    return "\n".join(lines)


def write_plot(
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]],
    workers: list[int],
    modes: list[str],
    beta2s: list[float],
    path: Path,
) -> None:
    """Gap % vs workers, one line per mode, one panel per beta2; error bars are the 95% Student-t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(beta2s), figsize=(6.5 * len(beta2s), 4.5), squeeze=False, sharey=True)
    for ax, beta2 in zip(axes[0], beta2s, strict=True):
        for mode in modes:
            points = [(n, summarise(cells, beta2, n, mode)) for n in workers]
            kept = [(n, row) for n, row in points if row is not None]
            if not kept:
                continue
            xs = [n for n, _ in kept]
            ys = [row["gap"].mean for _, row in kept]
            errs = [row["gap"].half_width or 0.0 for _, row in kept]
            # One colour per mode in every panel, whichever modes a panel has.
            color = f"C{list(MODE_LABELS).index(mode) % 10}" if mode in MODE_LABELS else None
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, color=color, label=MODE_LABELS.get(mode, mode))
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.set_xlabel("workers")
        ax.set_title(f"beta2 = {beta2}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("val loss vs exact Lion, % (mean, 95% t interval over seeds)")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ef_target(no_ef_gap: float, ef_gap: float) -> bool:
    """The error-feedback target for one cell: the EF form's mean gap at most half of the same mode's without EF,
    and never worse than without EF (where the mode without EF is no worse than exact Lion, the EF gap
    must simply not exceed it)."""
    if ef_gap > no_ef_gap:
        return False
    return no_ef_gap <= 0 or ef_gap <= 0.5 * no_ef_gap


def paired_gaps(
    cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]], beta2: float, n: int, mode: str, other: str
) -> tuple[list[int], list[float], list[float]]:
    """The seeds that ``mode``, ``other`` and exact Lion all have in the cell (beta2, n), and per seed the gap
    to exact Lion in % of ``mode`` and of ``other``."""
    runs, other_runs = cells[(beta2, n, mode)], cells.get((beta2, n, other), {})
    exact_runs = cells.get((beta2, n, "exact"), {})
    seeds = sorted(set(runs) & set(other_runs) & set(exact_runs))
    gaps = [gap_percent(runs[s]["val_loss"], exact_runs[s]["val_loss"]) for s in seeds]
    other_gaps = [gap_percent(other_runs[s]["val_loss"], exact_runs[s]["val_loss"]) for s in seeds]
    return seeds, gaps, other_gaps


def ef_table(cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]], beta2s: list[float]) -> str:
    """Every cell with error-feedback runs: the form's gap against exact Lion beside the same mode's gap
    without EF (both over the seeds that all three have), its sign agreement with exact Lion, the number
    of seeds on which EF beat no-EF, and the error-feedback target (:func:`ef_target`)."""
    lines = [
        "| beta2 | workers | mode | EF form | seeds | no-EF gap % | EF gap % | EF better (seeds) | "
        "EF match | EF flip | EF tie | no-EF match | target (<= half, never worse) | EF run device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ef_keys = sorted((beta2, n, mode) for beta2, n, mode in cells if any(mode.endswith(suffix) for suffix in EF_FORMS))
    passed = total = 0
    for beta2, n, mode in ef_keys:
        if beta2 not in beta2s:
            continue
        suffix = next(suffix for suffix in EF_FORMS if mode.endswith(suffix))
        base = mode.removesuffix(suffix)
        ef_runs, no_ef_runs = cells[(beta2, n, mode)], cells.get((beta2, n, base), {})
        seeds, ef_gaps, no_ef_gaps = paired_gaps(cells, beta2, n, mode, base)
        if not seeds:
            continue
        ef_gap, no_ef_gap = mean_interval(ef_gaps), mean_interval(no_ef_gaps)
        better = sum(e < b for e, b in zip(ef_gaps, no_ef_gaps, strict=True))
        met = ef_target(no_ef_gap.mean, ef_gap.mean)
        passed, total = passed + met, total + 1
        rates = [ef_runs[s]["agreement"] for s in seeds if ef_runs[s]["agreement"]]
        base_rates = [no_ef_runs[s]["agreement"] for s in seeds if no_ef_runs[s]["agreement"]]
        ef_rate_text = (
            " | ".join(f"{_mean([r[k] for r in rates]):.3f}" for k in ("match", "flip", "tie"))
            if rates
            else "- | - | -"
        )
        base_match = f"{_mean([r['match'] for r in base_rates]):.3f}" if base_rates else "-"
        devices = sorted({str(ef_runs[s].get("device", "cpu")) for s in seeds})
        lines.append(
            f"| {beta2} | {n} | {MODE_LABELS.get(base, base)} | {EF_FORMS[suffix]} | {len(seeds)} | "
            f"{no_ef_gap.text(2)} | {ef_gap.text(2)} | {better}/{len(seeds)} | {ef_rate_text} | "
            f"{base_match} | {'**met**' if met else 'missed'} | {', '.join(devices)} |"
        )
    if total == 0:
        return ""
    return "\n".join(lines) + f"\n\nTarget met in {passed} of {total} cells.\n"


#: The mode suffix of the residual form with its residual stored in bf16, after the fp32 residual's mode name.
BF16_STORAGE = "_bf16"


def storage_table(cells: dict[tuple[float, int, str], dict[int, dict[str, Any]]], beta2s: list[float]) -> str:
    """Every cell with bf16-residual runs beside the same cell's fp32 residual: both gaps to exact Lion, and
    the per-seed difference of the bf16 gap from the fp32 gap in points (mean ± 95% t half-width), over the seeds
    that bf16, fp32 and exact Lion all have; "" when there are none."""
    lines = [
        "| beta2 | workers | mode | seeds | fp32 residual gap % | bf16 residual gap % | bf16 - fp32 (points) |",
        "|---|---|---|---|---|---|---|",
    ]
    for beta2, n, mode in sorted(key for key in cells if key[2].endswith("_ef_residual" + BF16_STORAGE)):
        if beta2 not in beta2s:
            continue
        seeds, bf16_gaps, fp32_gaps = paired_gaps(cells, beta2, n, mode, mode.removesuffix(BF16_STORAGE))
        if not seeds:
            continue
        difference = mean_interval([b - f for b, f in zip(bf16_gaps, fp32_gaps, strict=True)])
        lines.append(
            f"| {beta2} | {n} | {MODE_LABELS.get(mode, mode)} | {len(seeds)} | "
            f"{mean_interval(fp32_gaps).text(2)} | {mean_interval(bf16_gaps).text(2)} | "
            f"{difference.text(2)} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_report(directory: Path, workers: list[int], modes: list[str], beta2s: list[float]) -> str:
    """Write report.md and gap_vs_workers.png into ``directory``; returns the report's text."""
    cells = load_runs(directory)
    if not cells:
        return f"no runs in {directory} yet"
    runs = sum(len(seeds) for seeds in cells.values())
    text = (
        f"# Convergence study: {directory.name}\n\n"
        f"{runs} runs. Gap: the mode's validation loss relative to exact Lion's (fp32 mean) at the same worker "
        f"count and seed, in %; mean ± half-width (95% t, n seeds) over the n seeds both have: t(n - 1) x the "
        f"per-seed gaps' sample standard deviation / sqrt(n), t(2) = 4.303 for 3 seeds; real only where the interval "
        f"excludes 0. Exact 2 sd: exact Lion's own seed-to-seed spread (2 x the sample standard deviation of its val "
        f"loss, % of the mean; not an interval). match / flip / tie: the applied update's sign against exact "
        f"Lion's at the same step.\n\n"
        f"{report_table(cells, workers, modes, beta2s)}\n\n![gap vs workers](gap_vs_workers.png)\n"
    )
    outliers = runs_on_other_data(directory)
    if outliers:
        text += (
            f"\nLeft out: {len(outliers)} run(s) whose first training loss (before any update) differs from the other "
            f"runs of their seed, i.e. trained on other data or from another initial model: {', '.join(outliers)}.\n"
        )
    feedback = ef_table(cells, beta2s)
    if feedback:
        text += (
            "\n## Error feedback\n\n"
            "Each error-feedback form against the same mode without it: both gaps to exact Lion over the seeds "
            "that EF, no-EF and exact Lion all have (mean ± 95% t half-width, as above); EF better: the seeds on "
            "which the EF gap is below the no-EF gap; match / flip / tie: the EF run's applied sign against exact "
            "Lion's. "
            "Target: the EF gap at most half of the no-EF gap and never above it (by the means).\n\n"
            f"{feedback}"
        )
    storage = storage_table(cells, beta2s)
    if storage:
        text += (
            "\n### The residual stored in bf16\n\n"
            "The residual form with `storage: bf16` against the same cell with the default fp32 residual: both "
            "gaps to exact Lion, and bf16's gap minus fp32's per seed, in points (mean ± 95% t half-width).\n\n"
            f"{storage}"
        )
    (directory / "report.md").write_text(text)
    write_plot(cells, workers, modes, beta2s, directory / "gap_vs_workers.png")
    return text

"""The comparison's results: one :class:`Row` per worker count, as a table and as JSON.

Each quantity over seeds is a :class:`~ds_lioncub.quantities.student_t.MeanInterval`: the mean and the half-width of its
two-sided 95% Student-t interval, t(n - 1) x the per-seed sample sd / sqrt(n) over n seeds; a gap is "real"
where that interval excludes 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ds_lioncub.quantities.student_t import MeanInterval
from ds_lioncub.simulate.agreement import AgreementStats
from ds_lioncub.simulate.time_to_loss import RatioRow


@dataclass(frozen=True)
class Row:
    """One worker count of the table.

    Fields:
        workers: N (under the ZeRO hybrid: nodes).
        exact_val, mode_val: the validation losses over seeds.
        gap: the per-seed gap in % (:func:`~ds_lioncub.simulate.train.gap_percent`) over seeds, with its 95%
            Student-t interval.
        agreement: the mode's agreement with exact Lion, averaged over steps and seeds (None for exact Lion).
        time_to_loss: r, the steps to exact Lion's loss, and the noise scale (``--time-to-loss``; None without).
    """

    workers: int
    exact_val: MeanInterval
    mode_val: MeanInterval
    gap: MeanInterval
    agreement: AgreementStats | None
    time_to_loss: RatioRow | None = None


def format_table(rows: list[Row]) -> str:
    """The table: one line per worker count, gap with 3 decimals (mean ± 95% t half-width, in %; "real" where the
    interval excludes 0, "no" with one seed)."""
    header = (
        f"{'workers':>7}  {'exact Lion val':>14}  {'mode val':>8}  {'gap % (mean ± 95% t half-width)':>31}  "
        f"{'real':>4}  {'match':>6}  {'flip':>6}  {'tie':>6}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        a = row.agreement
        rates = f"{a.match:>6.3f}  {a.flip:>6.3f}  {a.tie:>6.3f}" if a is not None else f"{'-':>6}  {'-':>6}  {'-':>6}"
        lines.append(
            f"{row.workers:>7}  {row.exact_val.mean:>14.4f}  {row.mode_val.mean:>8.4f}  {row.gap.text(3):>31}  "
            f"{'yes' if row.gap.real else 'no':>4}  {rates}"
        )
    return "\n".join(lines)


def rows_as_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows' per-seed values (what ``--json-out`` writes)."""
    return [
        {
            "workers": r.workers,
            "exact_val": list(r.exact_val.values),
            "mode_val": list(r.mode_val.values),
            "gap_percent": list(r.gap.values),
            "agreement": None if r.agreement is None else asdict(r.agreement),
            **({} if r.time_to_loss is None else {"time_to_loss": _ratios_json(r.time_to_loss)}),
        }
        for r in rows
    ]


def _ratios_json(row: RatioRow) -> dict[str, Any]:
    return {
        "lengths": list(row.lengths),
        "r_per_seed": {str(seed.seed): seed.r for seed in row.seeds},
        "extrapolated_seeds": [seed.seed for seed in row.seeds if seed.extrapolated],
        "not_bracketed": {str(seed.seed): seed.bound for seed in row.unbracketed},
        "b_simple_per_seed": None if row.noise_scale is None else list(row.noise_scale.values),
        "batch_samples": row.batch_samples,
    }

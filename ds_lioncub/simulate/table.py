"""The comparison's results: one :class:`Row` per worker count, as a table and as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ds_lioncub.simulate.agreement import AgreementStats
from ds_lioncub.simulate.train import SeedSummary


@dataclass(frozen=True)
class Row:
    """One worker count of the table.

    Fields:
        workers: N (under the ZeRO hybrid: nodes).
        exact_val, mode_val: the validation losses over seeds.
        gap: the per-seed gap in % (:func:`~ds_lioncub.simulate.train.gap_percent`) over seeds.
        agreement: the mode's agreement with exact Lion, averaged over steps and seeds (None for exact Lion).
    """

    workers: int
    exact_val: SeedSummary
    mode_val: SeedSummary
    gap: SeedSummary
    agreement: AgreementStats | None


def format_table(rows: list[Row]) -> str:
    """The table: one line per worker count, gap with 3 decimals (mean ± spread, in %)."""
    header = (
        f"{'workers':>7}  {'exact Lion val':>14}  {'mode val':>8}  {'gap % (mean ± spread)':>22}  {'real':>4}  "
        f"{'match':>6}  {'flip':>6}  {'tie':>6}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        a = row.agreement
        rates = f"{a.match:>6.3f}  {a.flip:>6.3f}  {a.tie:>6.3f}" if a is not None else f"{'-':>6}  {'-':>6}  {'-':>6}"
        lines.append(
            f"{row.workers:>7}  {row.exact_val.mean:>14.4f}  {row.mode_val.mean:>8.4f}  {row.gap.text(3):>22}  "
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
        }
        for r in rows
    ]

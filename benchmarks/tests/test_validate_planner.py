"""validate_planner's bookkeeping: bench_comm ops -> LionCub options, and the table, on synthetic reports.

The predictor is a stand-in written here (the planner itself is tested in tests/); what is checked is
what the script feeds it and what it makes of the answers, against figures worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import validate_planner
from benchmarks.validate_planner import Prediction
from ds_lioncub.comm import CompressedBackend
from ds_lioncub.config import parse_config


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("fp32", {"compression": "none", "comm_dtype": "fp32"}),
        ("bf16", {"compression": "none", "comm_dtype": "bf16"}),
        ("1bit", {"compression": "1bit"}),
        (
            "sign4-ar",
            {
                "compression": "kbit",
                "bits": 4,
                "quantizer": "sign",
                "kbit_algorithm": "allreduce",
                "aggregation": "vote",
            },
        ),
        (
            "kbit:sign:4:alltoall",
            {
                "compression": "kbit",
                "bits": 4,
                "quantizer": "sign",
                "kbit_algorithm": "alltoall",
                "aggregation": "vote",
            },
        ),
        (
            "kbit:l1:8:allreduce",
            {"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "allreduce", "aggregation": "vote"},
        ),
        (
            "l1-4-a2a",
            {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall", "aggregation": "vote"},
        ),
    ],
)
def test_ops_map_to_the_lioncub_options_that_run_them(op: str, params: dict[str, Any]) -> None:
    assert validate_planner.lioncub_params(op) == params
    parse_config(params)  # options LionCub accepts as they are


def _result(op: str, label: str, n: int, p: int, time_s: float, collective_s: float) -> dict[str, Any]:
    return {"op": op, "label": label, "n": n, "p": p, "time_s": time_s, "collective_s": collective_s}


def test_rows_and_table_from_synthetic_reports(tmp_path: Path) -> None:
    # One driver file (a list of reports) and one worker file (a single report); an unshaped run is ignored.
    p2 = {
        "p": 2,
        "rate_bps": 10**9,
        "results": [
            _result("fp32", "fp32 all-reduce", 10**7, 2, 0.40, 0.39),
            _result("1bit", "1-bit vote", 10**7, 2, 0.05, 0.02),
            _result("fp32", "fp32 all-reduce", 10**6, 2, 0.05, 0.05),
        ],
    }
    unshaped = {"p": 2, "rate_bps": None, "results": [_result("fp32", "fp32 all-reduce", 10**7, 2, 0.1, 0.1)]}
    p4 = {
        "p": 4,
        "rate_bps": 250 * 10**6,
        "results": [_result("kbit:l1:4:alltoall", "4-bit l1 vote, alltoall", 10**8, 4, 2.0, 1.0)],
    }
    (tmp_path / "a_driver.json").write_text(json.dumps([p2, unshaped]))
    (tmp_path / "b_worker.json").write_text(json.dumps(p4))
    (tmp_path / "notes.txt").write_text("not a report")

    calls: list[tuple[dict[str, Any], int, int, float, float, int | None]] = []
    # Hand-picked answers per (compression, n): fp32 1e7 -> 0.32 s (0.30 of it the collectives),
    # 1-bit 1e7 -> 0.02 s (0.01), fp32 1e6 -> 0.2 s (0.1), 4-bit l1 1e8 -> 2.4 s (1.5).
    answers = {
        ("none", 10**7): Prediction(0.32, 0.30),
        ("1bit", 10**7): Prediction(0.02, 0.01),
        ("none", 10**6): Prediction(0.2, 0.1),
        ("kbit", 10**8): Prediction(2.4, 1.5),
    }

    def fake_planner(
        params: dict[str, Any],
        numel: int,
        world_size: int,
        link_bytes_per_s: float,
        ranks_per_core: float,
        pipeline_chunk_numel: int | None,
    ) -> Prediction:
        assert pipeline_chunk_numel == CompressedBackend().pipeline_chunk_numel  # the ops name no chunks
        calls.append((params, numel, world_size, link_bytes_per_s, ranks_per_core, pipeline_chunk_numel))
        return answers[(params["compression"], numel)]

    rows = validate_planner.build_rows(validate_planner.load_reports(tmp_path), fake_planner)

    # The planner is asked in bytes per second: 1 Gbit/s = 1.25e8 B/s, 250 Mbit/s = 3.125e7 B/s; p ranks of
    # one thread on a 2-core machine: 1 rank per core at p = 2, 2 at p = 4.
    assert sorted((c[1], c[2], c[3], c[4]) for c in calls) == [
        (10**6, 2, 1.25e8, 1.0),
        (10**7, 2, 1.25e8, 1.0),
        (10**7, 2, 1.25e8, 1.0),
        (10**8, 4, 3.125e7, 2.0),
    ]
    assert {
        "compression": "kbit",
        "bits": 4,
        "quantizer": "l1",
        "kbit_algorithm": "alltoall",
        "aggregation": "vote",
    } in [c[0] for c in calls]
    # Fastest link first, then p, then n, then the order the ops were measured in.
    assert [(r.rate_bps, r.p, r.n, r.op) for r in rows] == [
        (10**9, 2, 10**6, "fp32"),
        (10**9, 2, 10**7, "fp32"),
        (10**9, 2, 10**7, "1bit"),
        (250 * 10**6, 4, 10**8, "kbit:l1:4:alltoall"),
    ]
    # ratio = predicted / measured: 0.2/0.05 = 4 (below 1e7: not judged), 0.32/0.40 = 0.8 (in),
    # 0.02/0.05 = 0.4 (out), 2.4/2.0 = 1.2 (in); comm ratio = predicted comm / in collectives.
    assert [r.ratio for r in rows] == pytest.approx([4.0, 0.8, 0.4, 1.2])
    assert [r.in_target for r in rows] == [None, True, False, True]
    assert [r.comm_ratio for r in rows] == pytest.approx([2.0, 0.30 / 0.39, 0.5, 1.5])

    table = validate_planner.format_table(rows)
    assert "| fp32 all-reduce | 2 | 1 Gbit/s | 1e+07 | 0.4000 | 0.3200 | 0.80 | yes | 0.3900 | 0.3000 | 0.77 |" in table
    assert "| 1-bit vote | 2 | 1 Gbit/s | 1e+07 | 0.0500 | 0.0200 | 0.40 | **no** |" in table
    assert "| fp32 all-reduce | 2 | 1 Gbit/s | 1e+06 | 0.0500 | 0.2000 | 4.00 | - |" in table
    assert "| 4-bit l1 vote, alltoall | 4 | 250 Mbit/s | 1e+08 | 2.000 | 2.400 | 1.20 | yes |" in table
    # Judged (n >= 1e7): 0.8, 0.4, 1.2 (median 0.8); the fit subset (p = 2, 1 Gbit/s) holds 0.8 and 0.4.
    assert (
        "n >= 1e+07: 2 of 3 points within 25%, median ratio 0.80; furthest: 1-bit vote, p = 2, 1 Gbit/s, n = 1e+07, "
        "ratio 0.40." in table
    )
    assert (
        "- fit subset (p = 2, 1 Gbit/s): 1 of 2 points within 25%, median ratio 0.60; furthest: 1-bit vote, p = 2, "
        "1 Gbit/s, n = 1e+07, ratio 0.40." in table
    )
    assert (
        "- held out (the rest): 1 of 1 points within 25%, median ratio 1.20; furthest: 4-bit l1 vote, alltoall, "
        "p = 4, 250 Mbit/s, n = 1e+08, ratio 1.20." in table
    )


def test_link_efficiencies_are_fitted_on_the_fit_subset_alone() -> None:
    # p = 2 at 1 Gbit/s (1.25e8 B/s), n = 1e7, built so that rings run at 80% of the link and all-to-alls at 40%:
    # fp32 all-reduce: 4n bytes sent (2 * 4n * (p-1)/p); 4-bit sign all-to-all: n/4 bytes of fields
    # (4n/8 * (p-1)/p), then an all-gather of n/16 bytes of votes (n/p/8 * (p-1)).
    n, rate = 10**7, 1.25e8
    fp32 = 4 * n / (0.8 * rate)
    sign4 = (n / 4) / (0.4 * rate) + (n / 16) / (0.8 * rate)
    fit = {
        "p": 2,
        "rate_bps": 10**9,
        "results": [
            _result("fp32", "fp32 all-reduce", n, 2, fp32, fp32),
            _result("kbit:sign:4:alltoall@whole", "4-bit sign vote, alltoall (one piece)", n, 2, sign4, sign4),
            _result("fp32", "fp32 all-reduce", 10**6, 2, 1.0, 1.0),  # below 1e7: not fitted on
            # in two pipeline chunks: its time in collectives is only the unhidden part, not fitted on
            _result("kbit:sign:4:alltoall", "4-bit sign vote, alltoall", n, 2, 9.0, 0.001),
        ],
    }
    held_out = {"p": 4, "rate_bps": 10**9, "results": [_result("fp32", "fp32 all-reduce", n, 4, 9.0, 9.0)]}
    ring, all_to_all = validate_planner.fit_link_efficiency([fit, held_out])
    assert ring == pytest.approx(0.8, rel=1e-6) and all_to_all == pytest.approx(0.4, rel=1e-6)


def test_a_directory_without_reports_is_refused(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text(json.dumps({"steps": 3}))
    with pytest.raises(SystemExit, match="no bench_comm reports"):
        validate_planner.load_reports(tmp_path)

"""``run_ranks`` reports a failed job whole: every failing rank's exit code and entire output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import run_ranks

# A job of plain Python ranks (no torch): rank 1 prints 300 lines and exits 3, rank 2 aborts as a C++
# std::terminate would, rank 0 succeeds.
FAILING_JOB = """
import os, sys
rank = int(sys.argv[1])
if rank == 1:
    for line in range(300):
        print(f"rank 1 line {line}")
    sys.exit(3)
if rank == 2:
    print("rank 2 about to abort", flush=True)
    os.abort()
"""


def test_every_failing_rank_is_reported_with_its_whole_output(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(FAILING_JOB)
    with pytest.raises(AssertionError) as failure:
        run_ranks(script, 3, tmp_path / "work", timeout_s=60)
    report = str(failure.value)
    assert "rank(s) 1, 2 of 3 failed (exit codes [0, 3, -6])" in report, report
    assert all(f"rank 1 line {line}\n" in report for line in range(300)), report  # whole, not a tail
    assert "rank 2 exited with -6" in report and "rank 2 about to abort" in report, report
    assert "rank 0 exited" not in report, report


def test_a_hung_job_is_killed_and_reported_with_every_rank_output(tmp_path: Path) -> None:
    """Rank 1 fails at once, rank 0 waits for it forever: the report keeps rank 1's code and both outputs."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import sys, time\nrank = sys.argv[1]\nprint('rank', rank, 'started', flush=True)\n"
        "if rank == '1':\n    sys.exit(5)\ntime.sleep(600)\n"
    )
    with pytest.raises(AssertionError) as failure:
        run_ranks(script, 2, tmp_path / "work", timeout_s=15)
    report = str(failure.value)
    assert "did not finish in 15 s" in report, report
    assert "(exit codes [None, 5])" in report, report
    assert "rank 0 started" in report and "rank 1 started" in report, report

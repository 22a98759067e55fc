"""``python -m ds_lioncub.simulate --time-to-loss``: r and the noise scale on the user's own task, and the planner's
evidence it writes, against separate train_virtual runs read by hand (the crossing written out here as a loop, the
noise scale from the run's own terms).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.evidence import read_evidence
from ds_lioncub.simulate.cli import main
from ds_lioncub.simulate.time_to_loss import b_simple, time_to_loss_lengths
from ds_lioncub.simulate.train import train_virtual
from tests.unit.test_simulate_cli import MODE, TASK, tiny_task, write_config


def length_at(points: list[tuple[int, float]], target: float) -> float | None:
    """Where the losses reach ``target``: between the first pair that brackets it from above, or on the line
    through the two shortest runs when the shortest is already at or below it (None if that line does not fall)."""
    points = sorted(points)
    if points[0][1] <= target:
        (a, la), (b, lb) = points[0], points[1]
        return None if lb >= la else a + (b - a) * (la - target) / (la - lb)
    for (a, la), (b, lb) in zip(points[:-1], points[1:], strict=True):
        if la > target >= lb:
            return a + (b - a) * (la - target) / (la - lb)
    return None


def test_b_simple_is_the_batch_times_the_mean_trace_over_the_mean_square() -> None:
    terms = [(100.0, 1.0), None, (2.0, 10.0), (4.0, 30.0)]
    assert b_simple(terms, 4, 1) == pytest.approx(4 * 20.0 / 3.0)  # steps 2 and 3: mean trace 20, mean square 3
    assert b_simple(terms, 4, 0, 1) == pytest.approx(0.04)
    assert b_simple([None, None], 4, 0) is None and b_simple([(0.0, 1.0)], 4, 0) is None


@pytest.mark.parametrize("multiples", [[1.0], [-1.25], [0.001]])
def test_multiples_that_give_no_other_length_are_refused(multiples: list[float]) -> None:
    with pytest.raises(LionCubConfigError, match="--time-to-loss"):
        time_to_loss_lengths(6, multiples)
    assert time_to_loss_lengths(6, [0.5, 1.5, 1.5]) == [3, 9]


@pytest.mark.slow  # 10 short trainings of the tiny task: 10-40 s on this shared 2-core machine
def test_r_and_the_noise_scale_equal_separate_runs_and_the_planner_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})  # gradient_clipping 1.0
    evidence, rows = tmp_path / "own.json", tmp_path / "rows.json"
    argv = [str(config), "--workers", "2", "--steps", "6", "--seeds", "0", "1", "--task", TASK]
    argv += ["--time-to-loss", "0.5", "1.5", "--evidence-out", str(evidence), "--json-out", str(rows)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "plan: 8 runs" in out and "and the mode for 3, 9 steps" in out
    assert "steps to exact Lion's loss after 6 steps" in out and "--job-evidence" in out

    task = tiny_task()
    exact = {"compression": "none", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
    clipped = {**MODE, "clip": {"max_norm": 1.0}}  # what the default clipping of a compressed mode trains with
    ratios, scales = [], []
    for seed in (0, 1):
        target = train_virtual(task, exact, 2, 6, seed, noise_terms=True)
        points = [
            (length, train_virtual(task, clipped, 2, length, seed, grad_clip=0.0).val_loss) for length in (3, 6, 9)
        ]
        at = length_at(points, target.val_loss)
        ratios.append(None if at is None else at / 6)
        assert target.noise_terms is not None
        kept = [term for term in target.noise_terms[5:] if term is not None]  # after min(10 warm-up, 6 - 1) steps
        scales.append(4 * sum(t[1] for t in kept) / sum(t[0] for t in kept))  # b = 8 / 2 windows a worker
    [row] = json.loads(rows.read_text())
    written = row["time_to_loss"]
    assert written["lengths"] == [3, 6, 9] and written["batch_samples"] == 8
    for seed, ratio in enumerate(ratios):
        if ratio is None:
            assert str(seed) in written["not_bracketed"]
        else:
            assert written["r_per_seed"][str(seed)] == pytest.approx(ratio)
    assert written["b_simple_per_seed"] == pytest.approx(scales)

    [cell] = read_evidence(evidence)
    assert (cell.mode, cell.workers, cell.beta2, cell.seeds) == ("1bit+clip", 2, 0.95, 2)
    found = [ratio for ratio in ratios if ratio is not None]
    if found:
        assert cell.measured_ratio is not None
        assert cell.measured_ratio.value == pytest.approx(sum(found) / len(found), abs=1e-4)
        assert cell.measured_ratio.batch_samples == 8
        assert cell.measured_ratio.noise_scale_samples == pytest.approx(sum(scales) / 2, abs=1e-3)
    else:
        assert cell.measured_ratio is None
    assert not math.isnan(cell.gap_percent)

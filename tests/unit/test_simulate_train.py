"""ds_lioncub.simulate.train's schedule, clipping rules and seed statistics against independent references.

The lr schedule is checked against DeepSpeed's own WarmupCosineLR; clipping against norms computed
here from the concatenated gradients; the seed spread against the standard library's statistics.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from ds_lioncub.simulate.train import clip_worker_gradients, gap_percent, lr_ratio, seed_summary, train_virtual


def test_lr_ratio_is_deepspeeds_warmup_cosine_one_step_ahead() -> None:
    # DeepSpeed's scheduler is at iteration 0 only after its first step (before that: lr 0), so its
    # ratio after k steps is ours at step k; ours also defines step 0 as the warmup's start.
    total, warmup = 50, 10
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ds = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_min_ratio=0.1,
        warmup_num_steps=warmup,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    for step in range(total + 5):
        ds.step()
        assert lr_ratio(step, total, warmup, 0.1, 0.1) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
    assert lr_ratio(0, total, warmup, 0.1, 0.1) == pytest.approx(0.1)


def make_grads(scales: list[float]) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [[s * torch.randn(4, 3, generator=gen), s * torch.randn(5, generator=gen)] for s in scales]


def flat_norm(worker: list[torch.Tensor]) -> float:
    return float(torch.cat([g.flatten() for g in worker]).norm())


def test_deepspeed_rule_scales_every_worker_by_the_mean_norm() -> None:
    grads = make_grads([1.0, 3.0, 0.5])
    before = [[g.clone() for g in w] for w in grads]
    mean_norm = sum(flat_norm(w) for w in before) / 3
    clip_worker_gradients(grads, 1.0, "deepspeed", exact=False)
    coef = 1.0 / (mean_norm + 1e-6)
    for w, b in zip(grads, before, strict=True):
        for g, g0 in zip(w, b, strict=True):
            torch.testing.assert_close(g, g0 * coef)


def test_per_worker_rule_clips_each_worker_by_its_own_norm() -> None:
    grads = make_grads([0.01, 3.0])  # the first is under the threshold and must stay as it is
    before = [[g.clone() for g in w] for w in grads]
    clip_worker_gradients(grads, 1.0, "per_worker", exact=False)
    for w, b in zip(grads, before, strict=True):
        coef = min(1.0, 1.0 / (flat_norm(b) + 1e-6))
        for g, g0 in zip(w, b, strict=True):
            torch.testing.assert_close(g, g0 * coef)
    assert flat_norm(grads[0]) == pytest.approx(flat_norm(before[0]))


@pytest.mark.parametrize("rule", ["deepspeed", "per_worker"])
def test_exact_lion_clips_the_mean_gradient(rule: str) -> None:
    grads = make_grads([2.0, -1.0, 4.0])
    before = [[g.clone() for g in w] for w in grads]
    mean = [sum(b[j] for b in before) / 3 for j in range(2)]
    coef = min(1.0, 1.0 / (flat_norm(mean) + 1e-6))
    clip_worker_gradients(grads, 1.0, rule, exact=True)  # type: ignore[arg-type]
    for w, b in zip(grads, before, strict=True):
        for g, g0 in zip(w, b, strict=True):
            torch.testing.assert_close(g, g0 * coef)


def test_seed_summary_and_gap() -> None:
    values = [1.5, -0.25, 2.0]
    summary = seed_summary(values)
    assert summary.mean == pytest.approx(statistics.mean(values))
    assert summary.spread == pytest.approx(2 * statistics.stdev(values))
    assert summary.real is (abs(statistics.mean(values)) > 2 * statistics.stdev(values))
    single = seed_summary([3.0])
    assert single.spread is None and not single.real and single.text() == "+3.00 ± n/a"
    assert gap_percent(2.02, 2.0) == pytest.approx(1.0)


def test_on_step_sees_every_step_and_its_training_loss() -> None:
    from tests.unit.test_golden_losses import TeacherTask

    seen: list[tuple[int, float]] = []
    result = train_virtual(
        TeacherTask(), {"compression": "1bit"}, 4, 5, 0, on_step=lambda s, loss: seen.append((s, loss))
    )
    assert seen == list(enumerate(result.train_losses)) and len(seen) == 5

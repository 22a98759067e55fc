"""ds_lioncub.simulate.train's schedule, clipping rules and seed statistics against independent references.

The lr schedule is checked against DeepSpeed's own WarmupCosineLR; clipping against norms computed
here from the concatenated gradients; the seeds' 95% Student-t interval against the standard library's
statistics and t's closed forms at 1 and 2 degrees of freedom, t(1) = tan(0.95 pi / 2) and
t(2) = 0.95 sqrt(2 / (1 - 0.95^2)) (P(|T| < t) = t / sqrt(2 + t^2) at df 2), and at 3 the tabulated 3.1824.
"""

from __future__ import annotations

import math
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


#: The 0.975 quantiles of Student's t: closed forms at df 1 and 2, the textbook table's value at df 3.
T_975 = {1: math.tan(0.95 * math.pi / 2), 2: 0.95 * math.sqrt(2 / (1 - 0.95**2)), 3: 3.182446305}


def t_half_width(values: list[float]) -> float:
    """t(n - 1) x sample sd / sqrt(n), written out."""
    return T_975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def test_seed_summary_and_gap() -> None:
    assert (T_975[1], T_975[2]) == (pytest.approx(12.7062047), pytest.approx(4.3026527))
    values = [1.5, -0.25, 2.0]
    summary = seed_summary(values)
    assert summary.values == tuple(values)
    assert summary.mean == pytest.approx(statistics.mean(values))
    assert summary.half_width == pytest.approx(t_half_width(values))
    assert summary.real is (abs(statistics.mean(values)) > t_half_width(values))
    assert summary.text(3) == f"{statistics.mean(values):+.3f} ± {t_half_width(values):.3f}"
    pair = seed_summary([1.0, 2.0])  # sd = 1 / sqrt(2): half-width t(1) / 2
    assert pair.half_width == pytest.approx(T_975[1] / 2) and not pair.real
    single = seed_summary([3.0])
    assert single.half_width is None and not single.real and single.text() == "+3.00 ± n/a"
    assert gap_percent(2.02, 2.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("values", "real"),
    [
        # 3 seeds: mean 2.2, sd 1. Outside 2 sd (2.0) but inside t(2) / sqrt(3) x sd (2.484): not real.
        ([1.2, 2.2, 3.2], False),
        ([2.0, 3.0, 4.0], True),  # mean 3 > 2.484
        # 4 seeds: mean 2.3, sd sqrt(5 / 3) = 1.291. Inside 2 sd (2.582) but outside t(3) / 2 x sd (2.054): real.
        ([0.8, 1.8, 2.8, 3.8], True),
        ([-0.8, -1.8, -2.8, -3.8], True),  # the sign does not matter
        ([0.0, 1.0, 2.0, 3.0], False),  # mean 1.5 < 2.054
    ],
)
def test_a_gap_is_real_where_the_t_interval_excludes_0(values: list[float], real: bool) -> None:
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half_width = t_half_width(values)
    assert (abs(mean) > half_width) is real  # the case is what its comment says
    if len(values) == 3:
        assert abs(mean) > 2 * sd  # the old rule (|mean| > 2 sd) called it real
    summary = seed_summary(values)
    assert summary.half_width == pytest.approx(half_width)
    assert summary.real is real


def test_on_step_sees_every_step_and_its_training_loss() -> None:
    from tests.unit.test_golden_losses import TeacherTask

    seen: list[tuple[int, float]] = []
    result = train_virtual(
        TeacherTask(), {"compression": "1bit"}, 4, 5, 0, on_step=lambda s, loss: seen.append((s, loss))
    )
    assert seen == list(enumerate(result.train_losses)) and len(seen) == 5

"""The sign errors' drift and persistence (ds_lioncub.simulate.drift) against a per-element plain loop,
and inside the virtual world against its own per-step agreement counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_lioncub.simulate import VirtualLionCub
from ds_lioncub.simulate.drift import DriftTally, overall


def brute_force(steps: list[dict[str, tuple[list[float], list[float]]]], window: int) -> dict[str, dict]:
    """Per tensor, element by element: flips, flip runs, and each complete window's three sums."""

    def sign(x: float) -> int:
        return (x > 0) - (x < 0)

    out: dict[str, dict] = {}
    for name in steps[0]:
        numel = len(steps[0][name][0])
        flips = runs = 0
        windows = []
        previous_flipped = [False] * numel
        err_sum, exact_sum, err_l1 = [0] * numel, [0] * numel, 0
        for t, step in enumerate(steps, start=1):
            exact, applied = step[name]
            for k in range(numel):
                e = sign(applied[k]) - sign(exact[k])
                flipped = abs(e) == 2
                flips += flipped
                runs += flipped and not previous_flipped[k]
                previous_flipped[k] = flipped
                err_sum[k] += e
                exact_sum[k] += sign(exact[k])
                err_l1 += abs(e)
            if t % window == 0:
                windows.append((err_l1, sum(abs(v) for v in err_sum), sum(abs(v) for v in exact_sum)))
                err_sum, exact_sum, err_l1 = [0] * numel, [0] * numel, 0
        out[name] = {"flips": flips, "runs": runs, "windows": windows}
    return out


def test_the_tally_equals_a_per_element_loop() -> None:
    generator = torch.Generator().manual_seed(7)
    sizes = {"a": 13, "b": 29}
    steps = []
    for _ in range(11):
        step = {}
        for name, numel in sizes.items():
            exact = torch.randn(numel, generator=generator)
            exact[torch.rand(numel, generator=generator) < 0.1] = 0.0  # exact Lion's zeros
            # Applied: mostly agreeing, some flipped, some zero (a mean that cancels).
            flip = torch.rand(numel, generator=generator) < 0.3
            applied = torch.where(flip, -exact, exact) + 0.0
            applied[torch.rand(numel, generator=generator) < 0.05] = 0.0
            step[name] = (exact.tolist(), applied.tolist())
        steps.append(step)
    tally = DriftTally(window=4)
    for step in steps:
        for name, (exact, applied) in step.items():
            # Fed in pieces, as buckets cut a tensor: [0, 5) then the rest.
            x, y = torch.tensor(exact), torch.tensor(applied)
            tally.add(name, len(exact), 0, x[:5], y[:5])
            tally.add(name, len(exact), 5, x[5:], y[5:])
        tally.end_step()
    expected = brute_force(steps, window=4)
    stats = {d.name: d for d in tally.stats()}
    assert set(stats) == set(sizes)
    for name, want in expected.items():
        got = stats[name]
        assert got.steps == 11 and got.numel == sizes[name]
        assert got.flips == want["flips"] and got.flip_runs == want["runs"]
        assert [(w.err_l1, w.drift_l1, w.exact_l1) for w in got.windows] == want["windows"]  # 2 complete windows
    total = overall(list(stats.values()))
    assert total.flips == sum(w["flips"] for w in expected.values())
    assert total.windows[1].drift_l1 == sum(w["windows"][1][1] for w in expected.values())


def test_persistent_errors_score_one_and_alternating_errors_zero() -> None:
    tally = DriftTally(window=10)
    exact = torch.tensor([1.0, 1.0, -1.0])
    for t in range(10):
        # Element 0 flipped every step; element 1 flipped then right, alternately; element 2 never.
        applied = torch.tensor([-1.0, -1.0 if t % 2 == 0 else 1.0, -1.0])
        tally.add("w", 3, 0, exact, applied)
        tally.end_step()
    [drift] = tally.stats()
    # Errors: element 0 ten times -2 (|sum| 20), element 1 five times -2 (|sum| 10): 30 of 30 accumulate.
    assert drift.persistence == 1.0 and drift.flips == 15
    assert drift.flip_runs == 1 + 5 and drift.mean_flip_run == pytest.approx(15 / 6)
    assert drift.drift_ratio == pytest.approx(30 / 30)  # exact Lion moved 10 + 10 + 10

    tally = DriftTally(window=10)
    for t in range(10):
        # Flipped one way, then the exact sign moves and the error the other way: nothing accumulates.
        exact = torch.tensor([1.0 if t % 2 == 0 else -1.0])
        tally.add("w", 1, 0, exact, -exact)
        tally.end_step()
    assert tally.stats()[0].persistence == 0.0 and tally.stats()[0].mean_flip_run == 10.0


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "1bit"},  # the packed-sign path
        {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"},  # the delta path
    ],
)
def test_the_virtual_worlds_drift_equals_a_loop_over_its_momenta_and_updates(options: dict) -> None:
    """Each step's reference, from outside the world: exact Lion's direction from the workers' momenta and
    gradients (worker-order fp32 sum of beta1 m_i + (1 - beta1) g_i, as exact Lion sums them), and the applied
    direction from the parameters' change (weight decay 0: the change is -lr x the applied update)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 3))  # 2,819 elements: cut into 3 buckets
    optimizer = VirtualLionCub(
        model.named_parameters(), workers=4, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, module=model,
        drift_stats=True, bucket_size=1024, **options,
    )  # fmt: skip
    assert optimizer.drift is not None
    optimizer.drift = DriftTally(window=3)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    steps: list[dict[str, tuple[list[float], list[float]]]] = []
    for step in range(8):
        grads = [
            [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)) for p in params]
            for i in range(4)
        ]
        momenta = [optimizer.worker_momentum(i) for i in range(4)]
        exact = []
        for j, param in enumerate(params):
            total = torch.zeros(param.numel())
            for i in range(4):
                total.add_(momenta[i][j].reshape(-1).clone().mul_(0.9).add_(grads[i][j].reshape(-1), alpha=0.1))
            exact.append(total)
        before = [p.detach().clone() for p in params]
        optimizer.step(grads)
        applied = [(b - p.detach()).reshape(-1) for b, p in zip(before, params, strict=True)]
        steps.append({n: (e.tolist(), a.tolist()) for n, e, a in zip(names, exact, applied, strict=True)})
    expected = brute_force(steps, window=3)
    stats = {d.name: d for d in optimizer.drift.stats()}
    assert set(stats) == set(names)
    for name, want in expected.items():
        got = stats[name]
        assert got.steps == 8
        assert (got.flips, got.flip_runs) == (want["flips"], want["runs"]), name
        assert [(w.err_l1, w.drift_l1, w.exact_l1) for w in got.windows] == want["windows"], name  # 2 windows
    assert sum(d.flips for d in stats.values()) > 0  # the check saw errors to count


def test_drift_is_off_unless_asked_for() -> None:
    model = nn.Linear(4, 2)
    assert VirtualLionCub(model.parameters(), workers=2, agreement_stats=True).drift is None

"""VirtualLionCub at many workers against brute-force references, and what it refuses.

tests/distributed/test_virtual_world_vs_ranks.py holds it to real gloo ranks at p = 1-4; here the
worlds are larger than this machine can launch (16-64 workers), and the reference is a plain loop:
a majority-vote Lion written below, and tests/support/reference.py's ``simulate_lioncub`` for the
other modes. Both take every worker's gradients at once and share no code with the library.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub import LionCub
from ds_lioncub.errors import LionCubConfigError, NonFiniteGradientError
from ds_lioncub.simulate import NETWORK_OPTIONS, VirtualLionCub
from ds_lioncub.simulate.transport import VirtualNetwork
from tests.support import scenarios as sc
from tests.support.reference import brute_force_vote_1bit, brute_force_vote_kbit, brute_force_vote_stats_for_options
from tests.support.scenario_optimizer import fresh_params, scenario_settings

PARAM_NAMES = list(sc.PARAM_SHAPES)
NUMELS = [torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values()]

# Modes past the reach of real ranks here; each cuts w1 across buckets (BUCKET_SIZE 1024).
LARGE_WORLD_MODES: dict[str, dict[str, Any]] = {
    "1bit": {"compression": "1bit"},
    "1bit-positive": {"compression": "1bit", "tie_break": "positive"},
    "4bit-sign-alltoall": {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall"},
    "4bit-sign-alltoall-mean": {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall", "aggregation": "mean"},
    "2bit-l1-alltoall": {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    "4bit-l1-alltoall-mean": {
        "compression": "kbit",
        "bits": 4,
        "quantizer": "l1",
        "kbit_algorithm": "alltoall",
        "aggregation": "mean",
    },
    "8bit-l1": {"compression": "kbit", "bits": 8, "quantizer": "l1"},  # L = floor(255 / 2N) >= 1 up to 127
    "8bit-sign": {"compression": "kbit", "bits": 8},  # an all-reduce of sign fields holds up to 255
    "none-fp32": {"compression": "none"},
    "1bit-sync": {"compression": "1bit", "momentum_sync": {"interval": sc.SYNC_INTERVAL, "layers": sc.SYNC_LAYERS}},
}


def run_virtual(workers: int, options: dict[str, Any], **extra: Any) -> tuple[VirtualLionCub, dict[str, torch.Tensor]]:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=workers, **scenario_settings(**options), **extra)
    for step in range(1, sc.TRAIN_STEPS + 1):
        optimizer.step([sc.model_grads(list(params.values()), worker, step) for worker in range(workers)])
    return optimizer, params


def majority_vote_lion(
    workers: int, steps: int, tie_break: str = "alternate"
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Distributed Lion with a majority vote, as a plain loop: every worker's momentum, one shared model."""
    beta1, beta2 = sc.TRAIN_BETAS
    lr, wd = sc.TRAIN_LR, sc.TRAIN_WEIGHT_DECAY
    params = [p.clone() for p in sc.init_params().values()]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    for step in range(1, steps + 1):
        tie = 1 if tie_break == "positive" or step % 2 == 1 else -1
        grads = [sc.model_grads(params, worker, step) for worker in range(workers)]
        for j, param in enumerate(params):
            votes = torch.zeros(param.shape, dtype=torch.int64)
            for worker in range(workers):
                c = momenta[worker][j] * beta1 + grads[worker][j] * (1 - beta1)
                votes += torch.where(c > 0, 1, torch.where(c < 0, -1, tie))
                momenta[worker][j].mul_(beta2).add_(grads[worker][j], alpha=1 - beta2)
            direction = torch.where(votes > 0, 1.0, torch.where(votes < 0, -1.0, float(tie)))
            param.mul_(1 - lr * wd).add_(direction, alpha=-lr)
    return params, momenta


@pytest.mark.parametrize(("workers", "tie_break"), [(16, "alternate"), (17, "positive"), (64, "alternate")])
def test_one_bit_equals_a_majority_vote_lion_written_here(workers: int, tie_break: str) -> None:
    optimizer, params = run_virtual(workers, {"compression": "1bit", "tie_break": tie_break})
    expected_params, expected_momenta = majority_vote_lion(workers, sc.TRAIN_STEPS, tie_break)
    for got, expected in zip(params.values(), expected_params, strict=True):
        assert torch.equal(got.detach(), expected)
    for worker in (0, workers // 2, workers - 1):
        for got, expected in zip(optimizer.worker_momentum(worker), expected_momenta[worker], strict=True):
            assert torch.equal(got, expected), worker


@pytest.mark.parametrize(
    ("workers", "mode"),
    [(16, mode) for mode in LARGE_WORLD_MODES]
    + [(33, mode) for mode in ("1bit-sync", "2bit-l1-alltoall", "4bit-l1-alltoall-mean")],
)
def test_every_mode_equals_the_brute_force_simulation_at_many_workers(workers: int, mode: str) -> None:
    options = LARGE_WORLD_MODES[mode]
    optimizer, params = run_virtual(workers, options)
    expected_params, expected_momenta = sc.simulate_mode(workers, options)
    init = sc.init_params()
    for name, got, expected in zip(PARAM_NAMES, params.values(), expected_params, strict=True):
        assert not torch.equal(got.detach(), init[name])
        assert torch.equal(got.detach(), expected), name
    for worker in range(workers):
        for got, expected in zip(optimizer.worker_momentum(worker), expected_momenta[worker], strict=True):
            assert torch.equal(got, expected), worker


@pytest.mark.parametrize(
    "mode", ["1bit", "4bit-sign-alltoall", "2bit-l1-alltoall", "8bit-l1", "4bit-sign-alltoall-mean", "1bit-positive"]
)
def test_agreement_with_exact_lion_equals_brute_force(mode: str) -> None:
    workers = 16
    options = LARGE_WORLD_MODES[mode]
    optimizer, _ = run_virtual(workers, options, agreement_stats=True)
    pre_sign: list[list[torch.Tensor]] = []
    sc.simulate_mode(workers, options, pre_sign_updates=pre_sign)
    c = pre_sign[-1]  # the last step's per-worker pre-sign updates
    step = sc.TRAIN_STEPS
    exact = torch.zeros_like(c[0])
    for mine in c:
        exact += mine
    if options["compression"] == "1bit":
        applied = brute_force_vote_1bit(c, step, str(options.get("tie_break", "alternate")))
    else:
        applied = brute_force_vote_kbit(
            c,
            step,
            int(options["bits"]),
            str(options.get("quantizer", "sign")),
            str(options.get("aggregation", "vote")),
            str(options.get("kbit_algorithm", "allreduce")),
            segment_sizes=NUMELS,
            bucket_size=sc.BUCKET_SIZE,
        )
    numel = exact.numel()
    match = int(((torch.sign(applied) == torch.sign(exact)) & (exact != 0)).sum()) / numel
    flip = int(((torch.sign(applied) == -torch.sign(exact)) & (exact != 0)).sum()) / numel
    tie = brute_force_vote_stats_for_options(c, step, options, NUMELS, sc.BUCKET_SIZE).tie_rate
    stats = optimizer.last_agreement
    assert stats is not None
    assert stats.match == pytest.approx(match, abs=1e-12)
    assert stats.flip == pytest.approx(flip, abs=1e-12)
    assert stats.zero == pytest.approx(1 - match - flip, abs=1e-12)
    assert stats.tie == pytest.approx(tie, abs=1e-12)
    assert 0 < stats.flip < stats.match  # a real vote at 16 workers: mostly right, not always


def test_exact_lion_keeps_one_momentum_that_every_worker_shares() -> None:
    optimizer, _ = run_virtual(8, {"compression": "none"})
    first = optimizer.worker_momentum(0)
    for worker in range(1, 8):
        for mine, shared in zip(optimizer.worker_momentum(worker), first, strict=True):
            assert mine.data_ptr() == shared.data_ptr()
    assert optimizer.last_agreement is None


def test_a_learning_rate_scheduler_drives_the_groups() -> None:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=4, lr=0.01, compression="1bit")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0 if step >= 1 else 1.0)
    optimizer.step([sc.model_grads(list(params.values()), worker, 1) for worker in range(4)])
    scheduler.step()  # lr 0 from here on: with no weight decay, the parameters must stay put
    moved = {name: param.detach().clone() for name, param in params.items()}
    optimizer.step([sc.model_grads(list(params.values()), worker, 2) for worker in range(4)])
    assert moved["w1"].ne(sc.init_params()["w1"]).any()
    for name, param in params.items():
        assert torch.equal(param.detach(), moved[name]), name


@pytest.mark.parametrize("option", sorted(NETWORK_OPTIONS))
def test_options_that_need_a_real_network_are_refused(option: str) -> None:
    values = {
        "comm_backend_name": "mpi",
        "cuda_aware": True,
        "overlap": True,
        "hybrid": {"node_size": 2},
        "consistency_check": {"interval": 10},
        "network": {"bandwidth": "1gbit"},
    }
    with pytest.raises(LionCubConfigError, match=rf"^LionCub: VirtualLionCub does not take \['{option}'\]"):
        VirtualLionCub(list(fresh_params().items()), workers=4, **{option: values[option]})


def test_auto_and_telemetry_are_refused_with_the_way_out() -> None:
    with pytest.raises(LionCubConfigError, match="ds_lioncub.planner"):
        VirtualLionCub(list(fresh_params().items()), workers=4, compression="auto")
    with pytest.raises(LionCubConfigError, match="agreement_stats=True"):
        VirtualLionCub(list(fresh_params().items()), workers=4, telemetry={"vote_stats": True})


def test_a_kbit_all_reduce_too_narrow_for_the_workers_gets_lioncubs_error() -> None:
    # LionCub raises this at construction on a real world of 16; a world of one shows it its own message
    # through the same validation (bits=4 sign holds 15 fields).
    with pytest.raises(LionCubConfigError) as virtual:
        VirtualLionCub(list(fresh_params().items()), workers=16, compression="kbit", bits=4)
    assert "hold at most 15 workers, but the data-parallel world has 16" in str(virtual.value)
    assert "kbit_algorithm='alltoall'" in str(virtual.value)
    LionCub(list(fresh_params().items()), compression="kbit", bits=4)  # a world of one: fine


def test_a_nan_on_one_worker_stops_the_step_before_any_change() -> None:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=8, compression="1bit")
    grads = [sc.model_grads(list(params.values()), worker, 1) for worker in range(8)]
    grads[5][1][3] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"on 1 of 8 virtual workers at step 1 \(workers \[5\]\)"):
        optimizer.step(grads)
    for name, param in params.items():
        assert torch.equal(param.detach(), sc.init_params()[name])
    assert all(m.abs().sum() == 0 for m in optimizer.worker_momentum(5))
    assert optimizer.param_groups[0]["step"] == 0


def test_gradients_of_the_wrong_world_or_shape_are_refused() -> None:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=3, compression="1bit")
    grads = [sc.model_grads(list(params.values()), worker, 1) for worker in range(3)]
    with pytest.raises(LionCubConfigError, match="gradients of 2 workers for a world of 3"):
        optimizer.step(grads[:2])
    with pytest.raises(LionCubConfigError, match="worker 1 has 3 gradients for 4 parameters"):
        optimizer.step([grads[0], grads[1][:3], grads[2]])
    with pytest.raises(LionCubConfigError, match=r"worker 2's gradient of parameter #0 has shape \(64, 40\)"):
        optimizer.step([grads[0], grads[1], [grads[2][0].t(), *grads[2][1:]]])


def test_the_network_refuses_collectives_out_of_order_and_early_waits() -> None:
    network = VirtualNetwork(3)
    first, second, _ = network.transports
    pending = first.start_all_gather(torch.ones(2))
    with pytest.raises(RuntimeError, match="only 1 rank"):
        first.wait(pending)
    with pytest.raises(RuntimeError, match="issued collective #0 as a all-to-all"):
        second.start_all_to_all(torch.ones(3))


@pytest.mark.parametrize("workers", [16, 40])
def test_kbit_votes_of_sign_fields_train_exactly_as_the_one_bit_vote(workers: int) -> None:
    # Every sign vote sums the same signs under the same tie rule (the planner's convergence rule relies on it).
    _, one_bit = run_virtual(workers, {"compression": "1bit"})
    for options in (
        {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall"},
        {"compression": "kbit", "bits": 8},
    ):
        _, params = run_virtual(workers, options)
        for name in PARAM_NAMES:
            assert torch.equal(params[name], one_bit[name]), (options, name)


def two_group_model() -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The scenarios' parameters in two groups of their own lr / betas / weight decay, b2 frozen."""
    params = fresh_params()
    params["b2"].requires_grad_(False)
    groups = [
        {"params": [params["w1"], params["b1"]], "param_names": ["w1", "b1"]},
        {"params": [params["w2"], params["b2"]], "param_names": ["w2", "b2"], "lr": 0.003, "betas": (0.8, 0.95)},
    ]
    return params, groups


@pytest.mark.parametrize(
    "options",
    [{"compression": "1bit"}, {"compression": "kbit", "bits": 8, "quantizer": "l1"}, {"compression": "none"}],
    ids=["1bit", "8bit-l1", "none"],
)
def test_groups_missing_gradients_and_frozen_parameters_follow_lioncub(options: dict[str, Any]) -> None:
    # A world of one is where LionCub itself runs in this process: the same groups, a parameter without a
    # gradient on some steps (skipped alone) and a frozen one must leave both with the same bits.
    real_params, real_groups = two_group_model()
    virtual_params, virtual_groups = two_group_model()
    settings = scenario_settings(**options)
    real = LionCub(real_groups, **settings)
    virtual = VirtualLionCub(virtual_groups, workers=1, **settings)
    for step in range(1, sc.TRAIN_STEPS + 1):
        grads = sc.model_grads([p.detach() for p in real_params.values()], 0, step)
        missing = step % 3 == 0  # w2 gets no gradient on steps 3 and 6
        for name, param, grad in zip(PARAM_NAMES, real_params.values(), grads, strict=True):
            param.grad = None if (missing and name == "w2") or name == "b2" else grad.clone()
        real.step()
        virtual.step(
            [[None if (missing and n == "w2") or n == "b2" else g for n, g in zip(PARAM_NAMES, grads, strict=True)]]
        )
    for name in PARAM_NAMES:
        assert torch.equal(virtual_params[name].detach(), real_params[name].detach()), name
    for param, momentum in zip(real_params.values(), virtual.worker_momentum(0), strict=True):
        expected = real.state[param]["exp_avg"] if "exp_avg" in real.state[param] else torch.zeros_like(param)
        assert torch.equal(momentum, expected)
    assert virtual.param_groups[1]["step"] == real.param_groups[1]["step"] == sc.TRAIN_STEPS


def test_a_missing_gradient_counts_as_zeros_on_a_worker_of_many() -> None:
    workers = 6
    with_none, with_zeros = fresh_params(), fresh_params()
    a = VirtualLionCub(list(with_none.items()), workers=workers, **scenario_settings(compression="1bit"))
    b = VirtualLionCub(list(with_zeros.items()), workers=workers, **scenario_settings(compression="1bit"))
    for step in range(1, 4):
        grads = [sc.model_grads([p.detach() for p in with_none.values()], worker, step) for worker in range(workers)]
        a.step(
            [[None if (worker == 2 and j == 1) else g for j, g in enumerate(mine)] for worker, mine in enumerate(grads)]
        )
        grads[2][1] = torch.zeros_like(grads[2][1])
        b.step(grads)
    for name in PARAM_NAMES:
        assert torch.equal(with_none[name], with_zeros[name]), name


def test_the_step_counts_when_nothing_takes_part() -> None:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=1, compression="1bit")
    optimizer.step([[None] * len(params)])
    assert optimizer.param_groups[0]["step"] == 1  # as LionCub's: the tie rule and the sync stay in phase


def test_an_added_group_is_checked_and_joins_momentum_sync() -> None:
    params = fresh_params()
    first = {name: params[name] for name in ("w1", "b1")}
    optimizer = VirtualLionCub(
        list(first.items()), workers=2, compression="1bit", momentum_sync={"interval": 1, "layers": "all"}
    )
    with pytest.raises(LionCubConfigError, match="betas"):
        optimizer.add_param_group({"params": [params["w2"]], "param_names": ["w2"], "betas": (1.5, 0.9)})
    with pytest.raises(LionCubConfigError, match="dtype torch.int64"):
        optimizer.add_param_group({"params": [torch.zeros(3, dtype=torch.int64)], "param_names": ["ints"]})
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": [params["w2"], params["b2"]], "param_names": ["w2", "b2"]})
    grads = [sc.model_grads([p.detach() for p in params.values()], worker, 1) for worker in range(2)]
    optimizer.step(grads)
    w2 = [optimizer.worker_momentum(worker)[2] for worker in range(2)]
    assert torch.equal(w2[0], w2[1]) and w2[0].abs().sum() > 0  # synced: the new group is in the selection


def test_gradients_of_another_dtype_are_refused_and_reading_momenta_creates_none() -> None:
    params = fresh_params()
    optimizer = VirtualLionCub(list(params.items()), workers=2, compression="1bit")
    assert all(m.abs().sum() == 0 for m in optimizer.worker_momentum(1))
    assert not any("worker_exp_avg" in state for state in optimizer.state.values())  # reading is not a step
    grads = [sc.model_grads(list(params.values()), worker, 1) for worker in range(2)]
    with pytest.raises(LionCubConfigError, match="is torch.float64 on cpu, the parameter torch.float32"):
        optimizer.step([grads[0], [grads[1][0].double(), *grads[1][1:]]])


def test_agreement_under_option_clip_compares_with_exact_lion_on_the_clipped_gradients() -> None:
    """Option clip scales every worker's gradient by the step's factor before any bucket is voted: the agreement
    compares the applied signs with sign(sum of the workers' c) on the clipped gradients, computed here."""
    workers, beta1 = 8, 0.9
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(3000, generator=generator) * (1 + worker) for worker in range(workers)]
    param = torch.nn.Parameter(torch.zeros(3000))
    optimizer = VirtualLionCub(
        [param],
        workers=workers,
        lr=0.1,
        betas=(beta1, 0.99),
        compression="1bit",
        clip={"max_norm": 1.0},
        agreement_stats=True,
    )
    optimizer.step([[grad.clone()] for grad in grads])
    coefficient = optimizer.last_clip_coefficient
    assert coefficient is not None and coefficient < 0.1  # the clip is at work
    c = [(1 - beta1) * coefficient * grad for grad in grads]  # Lion's direction from a zero momentum
    exact = torch.stack(c).sum(0)
    applied = brute_force_vote_1bit(c, 1, "alternate")
    assert torch.equal(torch.sign(param.detach()), -torch.sign(applied))  # what was applied: -lr sign(vote)
    stats = optimizer.last_agreement
    assert stats is not None
    assert stats.match == pytest.approx(
        float(((torch.sign(applied) == torch.sign(exact)) & (exact != 0)).float().mean())
    )
    assert stats.flip == pytest.approx(
        float(((torch.sign(applied) == -torch.sign(exact)) & (exact != 0)).float().mean())
    )

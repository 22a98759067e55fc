"""VirtualLionCub against LionCub on 1-4 real gloo ranks: the same parameters, momenta and bytes, bit for bit.

The gloo jobs of tests/distributed/conftest.py trained every mode of ``scenarios.training_modes`` on p
real ranks, each rank on its own gradients. Here one process runs p virtual workers fed those same
per-rank gradients. Every mode must leave the parameters (equal on every rank), each worker's momentum
(after every momentum-sync step too) and each rank's traffic exactly as the real ranks left them, and
measure the same gradient noise scale (telemetry.noise_scale, on by default) after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub.simulate import VirtualLionCub
from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_settings

pytestmark = pytest.mark.distributed

PARAM_NAMES = list(sc.PARAM_SHAPES)


def virtual_run(world_size: int, options: dict[str, Any], device: str | torch.device = "cpu") -> dict[str, Any]:
    """``sc.TRAIN_STEPS`` steps of ``world_size`` virtual workers on the real ranks' gradients (the results
    keyed like the ranks' own, on the CPU). The gradients are computed on the CPU from the parameters, as
    the ranks computed them, and moved to ``device``."""
    options = {key: value for key, value in options.items() if key != "telemetry"}  # the ranks' telemetry is opt-in
    params = fresh_params(device)
    optimizer = VirtualLionCub(list(params.items()), workers=world_size, **scenario_settings(**options))
    results: dict[str, Any] = {}
    for step in range(1, sc.TRAIN_STEPS + 1):
        before = [optimizer.worker_comm_stats(i) for i in range(world_size)]
        on_cpu = [param.detach().cpu() for param in params.values()]
        optimizer.step([[grad.to(device) for grad in sc.model_grads(on_cpu, rank, step)] for rank in range(world_size)])
        results[f"noise/{step}"] = optimizer.noise_scale
        for rank in range(world_size):
            results[f"stats/{rank}/{step}"] = optimizer.worker_comm_stats(rank) - before[rank]
            for name, momentum in zip(PARAM_NAMES, optimizer.worker_momentum(rank), strict=True):
                results[f"exp-avg/{rank}/{step}/{name}"] = momentum.cpu().clone()
    for name, param in params.items():
        results[f"param/{name}"] = param.detach().cpu().clone()
    return results


def test_every_mode_matches_the_gloo_ranks_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    modes = sc.training_modes(p)
    init = sc.init_params()
    for mode, options in modes.items():
        virtual = virtual_run(p, options)
        for name in PARAM_NAMES:
            got = virtual[f"param/{name}"]
            assert not torch.equal(got, init[name]), f"{mode}: {name} never moved"
            for rank in range(p):
                assert torch.equal(got, ranks[rank][f"train-param/{mode}/{name}"]), f"{mode}: {name} vs rank {rank}"
                final = virtual[f"exp-avg/{rank}/{sc.TRAIN_STEPS}/{name}"]
                assert torch.equal(final, ranks[rank][f"train-exp-avg/{mode}/final/{name}"]), f"{mode}: {rank} {name}"
        if "momentum_sync" in options:  # every step's momenta, before and after the sync steps
            for rank in range(p):
                for step in range(1, sc.TRAIN_STEPS + 1):
                    for name in PARAM_NAMES:
                        expected = ranks[rank][f"train-exp-avg/{mode}/{step}/{name}"]
                        assert torch.equal(virtual[f"exp-avg/{rank}/{step}/{name}"], expected), (mode, rank, step, name)


def test_every_worker_counts_the_bytes_its_rank_sent(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    for mode, options in sc.training_modes(p).items():
        virtual = virtual_run(p, options)
        for rank in range(p):
            for step in range(1, sc.TRAIN_STEPS + 1):
                got, expected = virtual[f"stats/{rank}/{step}"], ranks[rank][f"train-stats/{mode}/{step}"]
                assert (got.collectives, got.bytes_sent, got.bytes_received) == (
                    expected.collectives,
                    expected.bytes_sent,
                    expected.bytes_received,
                ), (mode, rank, step)


def test_every_mode_measures_the_noise_scale_its_ranks_measured(ranks: list[dict[str, Any]]) -> None:
    """The same summed sketch and squared norms on every rank and in the virtual world: the same estimate, exactly
    (a compressed mode with two voters or more measures one; compression "none" and one voter do not)."""
    p = len(ranks)
    for mode, options in sc.training_modes(p).items():
        virtual = virtual_run(p, options)
        measured = p > 1 and options["compression"] != "none"
        for step in range(1, sc.TRAIN_STEPS + 1):
            expected = virtual[f"noise/{step}"]
            assert (expected is not None) == measured, (mode, step)
            assert expected is None or expected.steps == step
            for rank in range(p):
                assert ranks[rank][f"train-noise/{mode}/{step}"] == expected, (mode, rank, step)

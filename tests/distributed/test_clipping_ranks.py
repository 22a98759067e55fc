"""Option ``clip`` on real gloo ranks (p = 1-4): every mode of ``scenarios.clip_modes`` equal, bit for bit, to the
plain loop (tests/support/clip_reference.py feeding tests/support/reference.py) and to the virtual world on the
same gradients, with one all-reduce of the sketch per step more than the same mode without clip (or, where the noise
scale's sketch runs anyway, that one all-reduce carrying clip's bins instead of the default's).

The gloo jobs of tests/distributed/conftest.py trained those modes (pipelined and serial bucket schedules) in the
launch the distributed tier runs anyway; nothing is launched here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub.comm import wire
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from tests.distributed.test_virtual_world_vs_ranks import virtual_run
from tests.support import scenarios as sc
from tests.support.checks import trained_mode_equals_reference
from tests.support.clip_reference import clipped_grads_fn
from tests.support.reference import simulate_lioncub
from tests.support.scenario_optimizer import scenario_settings

pytestmark = pytest.mark.distributed

# The same mode without clip, in scenarios.training_modes or here: what clip adds to each step's traffic.
UNCLIPPED = {"clip-1bit": "1bit", "clip-4bit-l1-alltoall": "4bit-l1-alltoall", "clip-none": "none-fp32"}


def reference(p: int, options: dict[str, Any]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[float]]:
    """The plain loop of ``options`` on p ranks: (parameters, momenta per rank, the factor of each step)."""
    settings = scenario_settings(**options)
    clip = settings.pop("clip")
    settings.pop("telemetry", None)
    factors: list[float] = []
    grads = clipped_grads_fn(
        lambda rank, step, params: sc.model_grads(params, rank, step), p, clip["max_norm"], clip["sketch_bins"], factors
    )
    params, momenta = simulate_lioncub(list(sc.init_params().values()), grads, p, sc.TRAIN_STEPS, **settings)
    return params, momenta, factors


def test_each_mode_equals_the_plain_loop_and_the_virtual_world_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    for mode, options in sc.clip_modes(p).items():
        params, momenta, factors = reference(p, options)
        assert any(f < 1.0 for f in factors), f"{mode}: no step clipped"
        trained_mode_equals_reference(ranks, "clip/", mode, params, momenta, virtual_run(p, options))
        for rank in range(p):
            got = [ranks[rank][f"clip/train-clip/{mode}/{step}"] for step in range(1, sc.TRAIN_STEPS + 1)]
            assert got == pytest.approx(factors, rel=1e-12, abs=0), f"{mode}: rank {rank}'s factors"


def test_clip_adds_one_all_reduce_of_the_sketch_per_step(ranks: list[dict[str, Any]]) -> None:
    """Counted on the real ranks against the same mode without clip: one fp64 all-reduce of sketch_bins numbers
    per step (a world of one has no collectives). A compressed mode measures the noise scale (on by default), whose
    sketch of the default bins, a squared norm and the non-finite check's verdict the mode without clip sends
    already: with clip the same one all-reduce carries clip's bins, the squared norm and the verdict. The virtual
    world counts what the ranks sent."""
    p = len(ranks)
    bins = int(sc.CLIP["sketch_bins"])
    noise_sketch = wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), p)
    for mode, options in sc.clip_modes(p).items():
        virtual = virtual_run(p, options)
        if p == 1:
            collectives, extra = 0, 0
        elif options["compression"] == "none":
            collectives, extra = 1, wire.all_reduce_bytes(8 * bins, p)
        else:
            collectives, extra = 0, wire.all_reduce_bytes(8 * (bins + 2), p) - noise_sketch
        for rank in range(p):
            for step in range(1, sc.TRAIN_STEPS + 1):
                clipped = ranks[rank][f"clip/train-stats/{mode}/{step}"]
                plain = ranks[rank][f"train-stats/{UNCLIPPED[mode]}/{step}"]
                assert clipped.collectives == plain.collectives + collectives, (mode, rank, step)
                assert clipped.bytes_sent == plain.bytes_sent + extra, (mode, rank, step)
                counted = virtual[f"stats/{rank}/{step}"]
                assert (counted.collectives, counted.bytes_sent) == (clipped.collectives, clipped.bytes_sent)

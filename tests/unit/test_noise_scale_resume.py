"""The gradient noise scale across a resume: a run stopped after K steps and resumed from its checkpoint reports,
after every later step, what the uninterrupted run reports (compared with that run, which never saved or loaded).

Two ways in: ``LionCub.state_dict()`` (plain torch, and DeepSpeed's stage 0, which saves the optimizer's state
dict), and the per-rank file of ds_lioncub/integration/checkpoint.py, which the ZeRO hybrids need because ZeRO
keeps only the optimizer's per-parameter state.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ds_lioncub.integration.checkpoint import momentum_file, momentum_state, prepare_load, restore
from ds_lioncub.step.local_state import NOISE_SCALE_KEY
from ds_lioncub.step.noise_scale import NoiseScale
from tests.support.thread_world import ThreadLionCub, ThreadTransport, on_every_rank

P, STEPS, STOP = 3, 6, 3
DIMENSIONS = 500
TAG = "step3"


def gradient(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(DIMENSIONS, generator=generator) * 0.5 + 0.2


def optimizer_over(transport: ThreadTransport, param: torch.nn.Parameter) -> ThreadLionCub:
    return ThreadLionCub(transport, [param], lr=1e-3, compression="1bit")


def train(optimizer: ThreadLionCub, param: torch.nn.Parameter, first: int, last: int) -> list[NoiseScale | None]:
    """Steps ``first`` to ``last``; the noise scale after each."""
    noise = []
    for step in range(first, last + 1):
        param.grad = gradient(optimizer.transport.rank, step)
        optimizer.step()
        noise.append(optimizer.noise_scale)
    return noise


def uninterrupted() -> list[list[NoiseScale | None]]:
    def run(transport: ThreadTransport) -> list[NoiseScale | None]:
        param = torch.nn.Parameter(torch.zeros(DIMENSIONS))
        return train(optimizer_over(transport, param), param, 1, STEPS)

    return on_every_rank(P, run)


def stopped(directory: Path | None) -> list[dict[str, Any]]:
    """STOP steps, then what a checkpoint keeps: the parameter, the state dict (as saved bytes) and, given a
    directory, the rank's file of ds_lioncub/integration/checkpoint.py in ``directory / TAG``."""

    def run(transport: ThreadTransport) -> dict[str, Any]:
        param = torch.nn.Parameter(torch.zeros(DIMENSIONS))
        optimizer = optimizer_over(transport, param)
        train(optimizer, param, 1, STOP)
        saved = io.BytesIO()
        torch.save(optimizer.state_dict(), saved)
        if directory is not None:
            (directory / TAG).mkdir(parents=True, exist_ok=True)
            torch.save(momentum_state(optimizer, transport.rank), momentum_file(str(directory / TAG), transport.rank))
        return {"param": param.detach().clone(), "state_dict": saved.getvalue()}

    return on_every_rank(P, run)


def resumed(saved: list[dict[str, Any]], directory: Path | None, drop_key: bool) -> list[list[NoiseScale | None]]:
    """A fresh optimizer per rank from ``saved`` (without the noise scale's key in the state dict when
    ``drop_key``, as ZeRO keeps it), the rank's file restored from ``directory`` when given, then the other steps."""

    def run(transport: ThreadTransport) -> list[NoiseScale | None]:
        mine = saved[transport.rank]
        param = torch.nn.Parameter(mine["param"].clone())
        optimizer = optimizer_over(transport, param)
        state = torch.load(io.BytesIO(mine["state_dict"]), weights_only=True)
        if drop_key:
            del state[NOISE_SCALE_KEY]
        optimizer.load_state_dict(state)
        if directory is not None:
            found = prepare_load(optimizer, str(directory), TAG, None)
            assert found is not None
            restore(optimizer, found)
        return train(optimizer, param, STOP + 1, STEPS)

    return on_every_rank(P, run)


def test_the_state_dict_carries_the_noise_scale_across_a_resume() -> None:
    expected = uninterrupted()
    saved = stopped(None)
    for rank, record in enumerate(saved):
        state = torch.load(io.BytesIO(record["state_dict"]), weights_only=True)
        assert state[NOISE_SCALE_KEY]["steps"] == STOP, rank
    got = resumed(saved, None, drop_key=False)
    for rank in range(P):
        assert got[rank] == expected[rank][STOP:], rank  # the same floats: the same averages, the same updates
    assert all(isinstance(noise, NoiseScale) and noise.steps == STEPS for noise in got[0][-1:])
    # Without the key (a state dict of 0.2.0), the average starts over: what the key is for.
    restarted = resumed(saved, None, drop_key=True)
    assert restarted[0][-1] is not None and restarted[0][-1].steps == STEPS - STOP
    assert restarted[0] != expected[0][STOP:]


def test_the_checkpoint_file_carries_the_noise_scale_where_the_state_dict_loses_it(tmp_path: Path) -> None:
    expected = uninterrupted()
    saved = stopped(tmp_path)
    for rank in range(P):
        file = torch.load(momentum_file(str(tmp_path / TAG), rank), weights_only=True)
        assert file[NOISE_SCALE_KEY]["steps"] == STOP, rank
    got = resumed(saved, tmp_path, drop_key=True)
    for rank in range(P):
        assert got[rank] == expected[rank][STOP:], rank

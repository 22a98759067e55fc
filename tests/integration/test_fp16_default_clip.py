"""The default clip under fp16 with a dynamic loss scale of 2^16, under the ZeRO-1/2 and ZeRO-3 hybrids (issue #44):
the loss scale is divided out exactly once.

One launch of 4 CPU ranks as 2 nodes x 2 (tests/workers/fp16_hybrid_clip.py, which overrides only DeepSpeed's CPU
fp16 capability check). Each step the engine's factor is compared with a plain-torch one at the same parameters:
every rank's fp32 gradient of its micro-batch by torch autograd on an fp32 copy of the model, each node's gradient
their mean, and option clip's sketch of the nodes' shards from its definition (tests/support/reference.py and
tests/support/zero3_reference.py, the references of the hybrids' fp32 tests), unscaled. fp16's rounding of the
forward, backward and node reduction moves the factor by about 1e-4; a loss scale divided twice or not at all would
move it by 2^16 (to 1, or by 2^16).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.support.launch import REPO, run_deepspeed
from tests.support.reference import _sketched_clip_factor as zero12_factor
from tests.support.zero3_reference import _sketched_clip_factor as zero3_factor
from tests.workers.fp16_hybrid_clip import MAX_NORM, NODE_SIZE, STAGES, STEPS, batch, build_model

pytestmark = pytest.mark.deepspeed

WORKER = REPO / "tests" / "workers" / "fp16_hybrid_clip.py"
WORLD = 4
BINS = 4093
#: fp16's rounding against the fp32 reference, on the factor.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("fp16_hybrid_clip")
    files = [out / f"rank{rank}.pt" for rank in range(WORLD)]
    run_deepspeed(WORKER, WORLD, ["--out", str(out)], files, timeout_s=900)
    return [torch.load(path, weights_only=False) for path in files]


def node_gradients(params: list[Tensor], step: int) -> list[list[Tensor]]:
    """Each node's gradient at ``params``: its ranks' fp32 gradients (plain autograd) averaged."""
    model = build_model()
    with torch.no_grad():
        for target, value in zip(model.parameters(), params, strict=True):
            target.copy_(value)
    ranks = []
    for rank in range(WORLD):
        model.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x.float()), y).backward()
        ranks.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
    nodes = WORLD // NODE_SIZE
    return [
        [torch.stack([ranks[r][i] for r in range(k * NODE_SIZE, (k + 1) * NODE_SIZE)]).mean(0) for i in range(4)]
        for k in range(nodes)
    ]


@pytest.mark.parametrize("stage", STAGES)
def test_the_factor_is_the_plain_torch_one_with_the_loss_scale_divided_out_once(
    launched: list[dict[str, Any]], stage: int
) -> None:
    records = [ranks[f"zero{stage}"] for ranks in launched]
    steps = records[0]["steps"]
    assert all(record["loss_scale"] == 2.0**16 for record in steps[:1]), "the run starts at 2^16"
    for rank, record in enumerate(records):
        assert [s["factor"] for s in record["steps"]] == [s["factor"] for s in steps], f"rank {rank}'s factors"
        for index, param in enumerate(record["final_params"]):
            assert torch.equal(param, records[0]["final_params"][index]), f"rank {rank}: parameter {index}"
    checked = 0
    skipped_before = 0
    for step, record in enumerate(steps, 1):
        if record["skipped"] > skipped_before:  # DeepSpeed skipped it (overflow): LionCub neither clipped nor stepped
            skipped_before = record["skipped"]
            continue
        grads = node_gradients(record["params"], step)
        lioncub_step = record["lioncub_step"]
        if stage == 3:
            expected = zero3_factor(grads, [[0, 1, 2, 3]], NODE_SIZE, lioncub_step, (MAX_NORM, BINS))
        else:
            # The flat group's padding at its end: G shards of ZeRO's size, less the parameters' elements.
            [size] = records[0]["partition_size"]
            padding = [size * NODE_SIZE - sum(p.numel() for p in build_model().parameters())]
            expected = zero12_factor(grads, [[0, 1, 2, 3]], padding, NODE_SIZE, lioncub_step, (MAX_NORM, BINS))
        assert expected < 1.0, f"step {step}: the clip should bind"
        assert record["factor"] == pytest.approx(expected, rel=TOLERANCE), f"step {step}"
        # What a loss scale divided twice (factor 1) or not at all (2^16 times smaller) would give is far outside.
        assert abs(math.log2(record["factor"] / expected)) < 0.1
        checked += 1
    assert checked >= STEPS - 2, f"only {checked} of {STEPS} steps taken"

"""LionCub's sign-vote steps on the fused packing operations give the same bits on every packing path.

The 1-bit vote and the k-bit vote of sign fields run a bucket through the bucket schedule as
``prepare_sign_message`` -> ``issue`` -> ``reduce`` -> ``complete_packed`` -> ``apply_voted_signs``
(no fp32 bucket of ``c``, no unpacked result); the compiled path does each local half in one pass over memory. Here
the same steps run with the packing forced to ``torch`` (the composition of today's operations) and to
``compiled``, at a world of one, and every parameter and momentum must be equal bit for bit. The
multi-rank scenarios (tests/distributed) run the same code on the path the environment selects.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ds_lioncub import LionCub
from ds_lioncub.aggregation import Bucket, KbitVote, OneBitVote, build_aggregation
from ds_lioncub.comm import packing
from ds_lioncub.comm.transport import TorchTransport
from ds_lioncub.config import parse_config
from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder
from tests.support.implementations import load_op_or_skip

# Odd sizes and the smallest bucket (1024 elements): pieces start and end mid-byte, and tensors are cut.
SHAPES = [(1037,), (40, 41), (1,), (2500,), (33, 65)]
BUCKET = 1024
STEPS = 5
SIGN_VOTES = [
    {"compression": "1bit"},
    {"compression": "1bit", "tie_break": "positive"},
    *(
        {"compression": "kbit", "bits": bits, "quantizer": "sign", "aggregation": "vote", "kbit_algorithm": algorithm}
        for bits in (2, 4, 8)
        for algorithm in ("allreduce", "alltoall")
    ),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the torch composition on both


def mode_id(options: dict[str, Any]) -> str:
    return "-".join(str(value) for value in options.values())


@pytest.fixture(scope="module")
def cpu_op() -> Any:
    return load_op_or_skip(LionCubPackingCPUBuilder())


@pytest.fixture(autouse=True)
def _restore_packing_path() -> Iterator[None]:
    yield
    packing.set_packing_path(None)


def gradients(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-step gradients with exact zeros (c == 0 on the first step: a tie) and a few large values."""
    g = torch.Generator().manual_seed(500 + step)
    grads = []
    for shape in SHAPES:
        grad = torch.randn(shape, generator=g)
        grad[torch.rand(shape, generator=g) < 0.15] = 0.0
        grad.view(-1)[-1] = 0.0
        grads.append(grad.to(dtype))
    return grads


def train(path: str, options: dict[str, Any], dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """STEPS steps of LionCub on the packing ``path``: (parameters, momenta) afterwards."""
    packing.set_packing_path(path)
    g = torch.Generator().manual_seed(7)
    params = [nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in SHAPES]
    groups = [
        {"params": params[:2], "lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
        {"params": params[2:4], "lr": 1e-2, "betas": (0.95, 0.98), "weight_decay": 0.0},
        {"params": params[4:], "lr": 0.5, "betas": (0.5, 0.9), "weight_decay": 1.0},
    ]
    optimizer = LionCub(groups, bucket_size=BUCKET, **options)
    for step in range(1, STEPS + 1):
        for param, grad in zip(params, gradients(step, dtype), strict=True):
            param.grad = grad
        optimizer.step()
    return [p.detach().clone() for p in params], [optimizer.state[p]["exp_avg"].clone() for p in params]


def bits_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32 if t.dtype == torch.float32 else torch.int16) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("options", SIGN_VOTES, ids=mode_id)
def test_torch_and_compiled_paths_give_identical_parameters_and_momenta(
    cpu_op: Any, options: dict[str, Any], dtype: torch.dtype
) -> None:
    params_torch, momenta_torch = train("torch", options, dtype)
    params_compiled, momenta_compiled = train("compiled", options, dtype)
    for got, expected in zip(bits_of(params_compiled), bits_of(params_torch), strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(bits_of(momenta_compiled), bits_of(momenta_torch), strict=True):
        assert torch.equal(got, expected)
    # the steps moved every parameter (a path that skipped the update would agree with itself only)
    g = torch.Generator().manual_seed(7)
    for param, shape in zip(params_torch, SHAPES, strict=True):
        assert not torch.equal(param, torch.randn(shape, generator=g).to(dtype))


@pytest.mark.parametrize("options", SIGN_VOTES, ids=mode_id)
def test_sign_votes_take_the_packed_entry_and_exit(monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]) -> None:
    def unpacked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a sign vote went through the unpacked pack/start/complete/finish")

    for kind in (OneBitVote, KbitVote):
        for stage in ("pack", "start", "complete", "finish"):
            monkeypatch.setattr(kind, stage, unpacked)
    params, _ = train("auto", options, torch.float32)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "kbit", "bits": 4, "quantizer": "sign", "aggregation": "mean"},
        {"compression": "kbit", "bits": 8, "quantizer": "l1", "aggregation": "vote"},
        {"compression": "kbit", "bits": 8, "quantizer": "l1", "aggregation": "mean"},
    ],
    ids=mode_id,
)
def test_means_and_l1_stay_on_the_unpacked_path(monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]) -> None:
    def packed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a mean or L1 vote went through the packed message or result")

    monkeypatch.setattr(KbitVote, "sign_message_layout", packed)
    monkeypatch.setattr(KbitVote, "complete_packed", packed)
    params, _ = train("auto", options, torch.float32)
    assert all(torch.isfinite(p).all() for p in params)


# ------------------------------------------------------------------ the packed message and result of the votes


def sign_vote_aggregations() -> list[Any]:
    return [build_aggregation(parse_config(options), TorchTransport(), False) for options in SIGN_VOTES]


@pytest.mark.parametrize("index", range(len(SIGN_VOTES)), ids=[mode_id(options) for options in SIGN_VOTES])
@pytest.mark.parametrize("positive_ties", [True, False])
def test_the_packed_vote_is_the_unpacked_vote_packed(index: int, positive_ties: bool) -> None:
    # At a world of one the vote of a sign is that sign: +1 where c > 0, ties by the rule, NaN -1.
    vote = sign_vote_aggregations()[index]
    c = torch.tensor([1.5, -2.0, 0.0, -0.0, float("nan"), 3.0, -1e-30, 7.0, 0.0, -4.0, 2.0])
    bits, nbytes = vote.sign_message_layout(c.numel())
    message = packing.pack_signs(c, positive_ties, bits=bits, nbytes=nbytes)
    packed = vote.complete_packed(vote.reduce(vote.issue(message, c.numel(), positive_ties)))
    tie = 1.0 if positive_ties else -1.0
    expected = torch.tensor([1.0, -1.0, tie, tie, -1.0, 1.0, -1.0, 1.0, tie, -1.0, 1.0])
    assert torch.equal(packing.unpack_signs(packed, c.numel()), expected)
    unpacked = vote.finish(vote.start(Bucket(c.clone(), [c.numel()], []), positive_ties))
    assert torch.equal(unpacked, expected)


def test_a_message_of_the_wrong_length_or_a_non_sign_vote_is_refused() -> None:
    one_bit, kbit_sign = sign_vote_aggregations()[0], sign_vote_aggregations()[2]
    with pytest.raises(ValueError, match="packed sign message"):
        one_bit.issue(torch.zeros(3, dtype=torch.uint8), 8, True)
    with pytest.raises(ValueError, match="packed k-bit message"):
        kbit_sign.issue(torch.zeros(3, dtype=torch.uint8), 64, True)
    l1 = build_aggregation(parse_config({"compression": "kbit", "bits": 8, "quantizer": "l1"}), TorchTransport(), False)
    with pytest.raises(ValueError, match="votes of sign fields"):
        l1.sign_message_layout(8)
    mean = build_aggregation(
        parse_config({"compression": "kbit", "bits": 4, "quantizer": "sign", "aggregation": "mean"}),
        TorchTransport(),
        False,
    )
    values = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(ValueError, match="votes of sign fields"):
        mean.complete_packed(mean.reduce(mean.start(Bucket(values, [3], []), True)))

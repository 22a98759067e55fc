"""The vote screen's harness: its plain-torch ``vote`` trains bit for bit like the virtual world's 1-bit vote,
and its block helpers and candidates equal element-by-element loops."""

from __future__ import annotations

import pytest
import torch

from benchmarks.screen_vote import TensorState, block_max_abs, block_mean_abs, make_candidate, train_candidate
from benchmarks.study_convergence import Design
from ds_lioncub.simulate.tasks.gpt import GPTConfig
from ds_lioncub.simulate.tasks.gpt_task import GPTTask
from ds_lioncub.simulate.train import train_virtual

TINY = GPTTask(
    name="gpt-tiny",
    config=GPTConfig(max_seq_len=16, n_layer=1, n_head=2, d_model=16),
    global_batch_size=8,
    seq_len=16,
    eval_windows=16,
    corpus_bytes=100_000,
)


def test_the_screens_vote_is_the_virtual_worlds_one_bit_vote() -> None:
    design = Design(lr=3e-3, grad_clip=1.0, global_batch=8)
    screened = train_candidate("vote", TINY, design, workers=4, beta2=0.99, seed=3, steps=6)
    options = {"lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, "compression": "1bit"}
    reference = train_virtual(TINY, options, 4, 6, 3, grad_clip=1.0)
    assert screened["train_losses"] == reference.train_losses
    assert screened["val_loss"] == reference.val_loss


def test_block_helpers_equal_loops() -> None:
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    means, maxima = block_mean_abs(x, 4), block_max_abs(x, 4)
    for k in range(10):
        start, end = 4 * (k // 4), min(10, 4 * (k // 4) + 4)
        for i in range(3):
            assert means[i, k] == pytest.approx(float(x[i, start:end].abs().mean()))
        assert maxima[k] == float(x[:, start:end].abs().max())


def test_error_feedback_keeps_what_the_scaled_sign_rounded_off() -> None:
    c = torch.tensor([[3.0, -1.0, 0.5, 0.5], [-2.0, 1.0, 1.0, 1.0]])
    state = TensorState()
    direction = make_candidate("ef_scaled_sign:2")(c, state, 1, torch.Generator())
    # Worker 0 blocks: mean|.| 2 and 0.5; worker 1: 1.5 and 1. Sent: [2, -2, .5, .5] and [-1.5, 1.5, 1, 1].
    assert direction.tolist() == [1.0, -1.0, 1.0, 1.0]
    assert state.residual is not None
    assert state.residual.tolist() == [[1.0, 1.0, 0.0, 0.0], [-0.5, -0.5, 0.0, 0.0]]
    # Without feedback the same sums, and no memory.
    plain_state = TensorState()
    assert make_candidate("scaled_sign:2")(c, plain_state, 1, torch.Generator()).tolist() == direction.tolist()
    assert plain_state.residual is None


def test_unknown_candidates_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown candidate"):
        make_candidate("median")

"""The vote screen's harness: its plain-torch ``vote`` trains bit for bit like the virtual world's 1-bit vote
with the study's options, and its block helpers and candidates equal element-by-element loops or sums worked
out by hand."""

from __future__ import annotations

import pytest
import torch

from benchmarks import screen_vote
from benchmarks.screen_clipping import SketchClip
from benchmarks.screen_vote import (
    TensorState,
    block_max_abs,
    block_mean_abs,
    make_candidate,
    tail_kept,
    train_candidate,
)
from benchmarks.study_grid import STUDY_CLIP_RULE, Design, Run
from ds_lioncub.comm.quantize import sign_with_tie
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
    # What the study trains for its 1-bit cell (its options, the design's lr, train_virtual's schedule).
    options = {**Run("small", 6, 4, "1bit", 0.99, 3).options(), "lr": design.lr}
    assert options["compression"] == "1bit"
    reference = train_virtual(TINY, options, 4, 6, 3, grad_clip=design.grad_clip, clip_rule=STUDY_CLIP_RULE)
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
    plain = make_candidate("scaled_sign:2")
    plain_state = TensorState()
    assert plain(c, plain_state, 1, torch.Generator()).tolist() == direction.tolist()
    assert plain_state.residual is None

    # Step 2: the residual is added first, x = c2 + e = [[2, 2, -1, 2], [1, -1.5, 2, -2]]. Worker 0 blocks:
    # mean|x| 2 and 1.5, sent [2, 2, -1.5, 1.5]; worker 1: 1.25 and 2, sent [1.25, -1.25, 2, -2]. Sum
    # [3.25, 0.75, 0.5, -0.5]; the new residual x - sent = [[0, 0, 0.5, 0.5], [-0.25, -0.25, 0, 0]].
    c2 = torch.tensor([[1.0, 1.0, -1.0, 2.0], [1.5, -1.0, 2.0, -2.0]])
    second = make_candidate("ef_scaled_sign:2")(c2, state, 2, torch.Generator())
    assert second.tolist() == [1.0, 1.0, 1.0, -1.0]
    assert state.residual.tolist() == [[0.0, 0.0, 0.5, 0.5], [-0.25, -0.25, 0.0, 0.0]]
    # Without the residual, c2 alone: worker 0 sends [1, 1, -1.5, 1.5], worker 1 as above, sum
    # [2.25, -0.25, 0.5, -0.5]: the feedback turned element 1.
    assert plain(c2, TensorState(), 2, torch.Generator()).tolist() == [1.0, -1.0, 1.0, -1.0]


@pytest.mark.parametrize("name", ["dither_max", "dither_mean"])
def test_the_dithered_votes_equal_a_loop_over_the_same_draw(name: str) -> None:
    workers, numel, block, seed = 3, 10, 4, 7  # odd workers: a sum of signs is never 0
    c = torch.randn(workers, numel, generator=torch.Generator().manual_seed(1))
    candidate = make_candidate(f"{name}:{block}")
    direction = candidate(c, TensorState(), 1, torch.Generator().manual_seed(seed))
    # Same seed, same result.
    assert candidate(c, TensorState(), 1, torch.Generator().manual_seed(seed)).tolist() == direction.tolist()
    # The noise: one (workers, numel) draw of uniforms in [0, 1) from a generator of that seed, to [-1, 1).
    u = torch.rand((workers, numel), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    x = c.tolist()
    turned = 0  # elements where the noise turned the plain vote of sign(c_i)
    for k in range(numel):
        start, end = block * (k // block), min(numel, block * (k // block) + block)
        if name == "dither_max":  # the block's largest |c| over every worker
            scale = max(abs(x[i][m]) for i in range(workers) for m in range(start, end))
        else:  # the workers' mean of their block's mean |c|
            scale = sum(sum(abs(x[i][m]) for m in range(start, end)) / (end - start) for i in range(workers)) / workers
        votes = sum(1 if x[i][k] + scale * float(u[i, k]) > 0 else -1 for i in range(workers))
        assert direction[k] == (1.0 if votes > 0 else -1.0), k
        turned += (votes > 0) != (sum(1 if x[i][k] > 0 else -1 for i in range(workers)) > 0)
    assert turned > 0  # so the check above sees the noise and its scale, not only the signs of c


def test_unknown_candidates_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown candidate"):
        make_candidate("median")
    with pytest.raises(ValueError, match="no blocks"):
        make_candidate("vote:64")
    with pytest.raises(ValueError, match="block size"):
        make_candidate("scaled_sign:0")


def test_the_sparse_tail_keeps_each_workers_largest_and_scales_the_rest_like_a_loop() -> None:
    workers, numel, block = 3, 600, 256  # blocks of 256, 256 and 88 elements, 2 kept in each
    c = torch.randn(workers, numel, generator=torch.Generator().manual_seed(2))
    c[1, 5] = c[1, 6] = c[1, 7] = -9.0  # a tie among the largest: the lower indices are kept
    keep = 2  # 256 // 128
    expected = torch.zeros(workers, numel)
    for i in range(workers):
        for start in range(0, numel, block):
            indices = list(range(start, min(numel, start + block)))
            ranked = sorted(indices, key=lambda k: (-abs(float(c[i, k])), k))
            kept = set(ranked[:keep])
            others = [k for k in indices if k not in kept]
            scale = sum(abs(float(c[i, k])) for k in others) / len(others)
            for k in indices:
                value = float(c[i, k])
                expected[i, k] = value if k in kept else scale * (1.0 if value > 0 else -1.0 if value < 0 else 0.0)
    assert expected[1, 5] == expected[1, 6] == -9.0 and expected[1, 7] != -9.0
    torch.testing.assert_close(tail_kept(c, block), expected)
    direction = make_candidate(f"sparse_tail:{block}")(c, TensorState(), 1, torch.Generator())
    total = expected.sum(dim=0)
    assert bool((total != 0).all())  # no tie: the direction is the sum's sign
    assert direction.tolist() == torch.sign(total).tolist()


def test_the_mean_candidate_is_the_sign_of_the_workers_sum_with_the_tie_rule() -> None:
    c = torch.tensor([[1.0, -3.0, 2.0, 0.5], [-2.0, 1.0, -2.0, 0.25], [0.5, 1.0, 0.0, -1.0]])
    # Column sums -0.5, -1, 0 (a tie), -0.25; the vote of the same signs would say +1 for column 0 (2 of 3).
    for step in (1, 2):
        direction = make_candidate("mean")(c, TensorState(), step, torch.Generator())
        tie = sign_with_tie(torch.zeros(1), step, "alternate")
        assert direction.tolist() == [-1.0, -1.0, float(tie), -1.0]
    assert make_candidate("vote")(c, TensorState(), 1, torch.Generator())[0] == 1.0
    with pytest.raises(ValueError, match="it has no blocks; write 'mean'"):
        make_candidate("mean:64")


def test_exactclip_clips_by_the_norm_of_the_workers_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    # clip_worker_gradients' two rules are tested against plain norms in tests/unit; here: which one each spec uses.
    used: list[bool] = []

    def record(grads: list[list[torch.Tensor]], max_norm: float, rule: str, exact: bool) -> None:
        used.append(exact)

    monkeypatch.setattr(screen_vote, "clip_worker_gradients", record)
    design = Design(lr=3e-3, grad_clip=1.0, global_batch=8)
    for spec, exact in (("vote", False), ("vote+exactclip", True), ("sparse_tail:256+exactclip", True)):
        used.clear()
        train_candidate(spec, TINY, design, workers=4, beta2=0.99, seed=3, steps=2)
        assert used == [exact, exact], spec
    used.clear()  # a sketched clip does not call the rules at all
    train_candidate("vote+sketchclip64", TINY, design, workers=4, beta2=0.99, seed=3, steps=2)
    assert used == []
    with pytest.raises(ValueError, match=r"unknown candidate 'vote\+clip'"):
        make_candidate("vote+clip")


def test_a_sketch_as_wide_as_the_model_with_one_element_per_bin_clips_exactly_as_the_mean_norm() -> None:
    params = [torch.zeros(3, 4), torch.zeros(5)]
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    sketch = SketchClip(params, width=17)
    # One element per bin (a permutation of the 17 elements into 17 bins), so the sketch's norm is the norm.
    sketch.bins = [torch.tensor([5, 0, 16, 2, 9, 11, 3, 14, 7, 1, 12, 6]), torch.tensor([4, 8, 10, 13, 15])]
    mean = [sum(worker[j] for worker in grads) / 3 for j in range(2)]
    norm = float(torch.sqrt(sum((m**2).sum() for m in mean)))
    assert sketch.norm_estimate(grads) == pytest.approx(norm, rel=1e-6)
    expected = [[g * (0.5 / (norm + 1e-6)) for g in worker] for worker in grads]
    sketch.clip(grads, 0.5)
    for worker, want in zip(grads, expected, strict=True):
        for g, w in zip(worker, want, strict=True):
            torch.testing.assert_close(g, w)


def test_a_narrow_sketch_estimates_the_mean_norm_without_bias() -> None:
    params = [torch.zeros(4096)]
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(4096, generator=gen)] for _ in range(4)]
    norm2 = float(((sum(w[0] for w in grads) / 4) ** 2).sum())
    # Over 200 independent sketches of 64 bins the mean of the squared estimate is within 3 standard errors of
    # the squared norm (relative sd of one estimate about sqrt(2 / 64) = 0.18; of the mean, 0.0125).
    estimates = [SketchClip(params, 64, seed=s).norm_estimate(grads) ** 2 for s in range(200)]
    assert sum(estimates) / 200 == pytest.approx(norm2, rel=3 * 0.0125)
    with pytest.raises(ValueError, match="write the sketch's width after"):
        make_candidate("vote+sketchclip")


def test_a_sketchclip_run_is_the_default_run_and_the_named_old_rule_is_the_studys() -> None:
    """Since 0.2.0 a compressed mode clips the mean gradient by its sketched norm by default: the study's
    ``1bit_sketchclip`` run (option clip, DeepSpeed's clipping 0) and a default run of ``1bit`` with the design's
    clipping are the same run, bit for bit; the study's own ``1bit`` runs name DeepSpeed's old rule and differ."""
    design = Design(lr=3e-3, grad_clip=0.05, global_batch=8)  # a norm low enough to clip every step
    plain = {**Run("small", 6, 4, "1bit", 0.99, 3).options(), "lr": design.lr}
    sketchclip = {**Run("small", 6, 4, "1bit_sketchclip", 0.99, 3).options(), "lr": design.lr}
    sketchclip["clip"] = {**sketchclip["clip"], "max_norm": design.grad_clip}
    as_studied = train_virtual(TINY, sketchclip, 4, 6, 3, grad_clip=0.0)
    default = train_virtual(TINY, plain, 4, 6, 3, grad_clip=design.grad_clip)
    assert default.train_losses == as_studied.train_losses and default.val_loss == as_studied.val_loss
    old_rule = train_virtual(TINY, plain, 4, 6, 3, grad_clip=design.grad_clip, clip_rule=STUDY_CLIP_RULE)
    assert old_rule.train_losses != default.train_losses
    # The old rule, by a plain loop: every worker scaled by one factor from the mean of the workers' own norms.
    reference = train_candidate("vote", TINY, design, workers=4, beta2=0.99, seed=3, steps=6)
    assert reference["train_losses"] == old_rule.train_losses

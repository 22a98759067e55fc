"""Per-worker gradients (ds_lioncub.simulate.gradients): the loop and the fused pass against a direct loop.

The reference is written here: for each worker, its micro-batch sliced by hand, one forward and
backward, the parameters' .grad cloned. The fused pass is compared with allclose, not bitwise: it
sums a worker's rows inside one bmm / index_add_ over the whole batch (another summation order),
scales the output gradient by 1/B and then N instead of N/B, and recomputes a norm layer's
normalised input outside autograd; all of these move the last bits of fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.simulate.gradients import Batch, GradientBuffers, split_batch, worker_gradients
from examples.gpt import GPT, GPTConfig

RTOL, ATOL = 1e-5, 1e-7


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0], batch[1])[1]


class NormBiasNet(nn.Module):
    """Embedding with a padding row, LayerNorm with bias, biased Linears, a bias-free RMSNorm with eps,
    a LayerNorm over two dims, and a head tied to the embedding: every case the fused pass handles."""

    def __init__(self, vocab: int = 11, dim: int = 8, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.rms = nn.RMSNorm(2 * dim, eps=1e-5)
        self.ln2 = nn.LayerNorm((2, dim))
        self.fc2 = nn.Linear(2 * dim, dim, bias=True)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight  # one parameter, two modules
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * torch.randn_like(p))  # non-trivial norm weights and biases

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(idx))
        h = self.rms(F.gelu(self.fc1(h)))
        h = self.ln2(h.view(*h.shape[:-1], 2, -1)).flatten(-2)
        logits = self.head(torch.tanh(self.fc2(h)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def net_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0], batch[1])


def direct_loop(model: nn.Module, loss_fn, batch: Batch, workers: int) -> list[list[torch.Tensor]]:
    size = batch[0].shape[0] // workers
    out = []
    for i in range(workers):
        model.zero_grad(set_to_none=True)
        loss_fn(model, tuple(t[i * size : (i + 1) * size] for t in batch)).backward()
        out.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def assert_all_close(actual: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    assert len(actual) == len(expected)
    for worker_a, worker_e in zip(actual, expected, strict=True):
        for a, e in zip(worker_a, worker_e, strict=True):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)


def gpt_case(batch_size: int) -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, d_model=32, n_head=2, n_layer=2))
    windows = torch.randint(0, 256, (batch_size, 17))
    return model, (windows[:, :-1], windows[:, 1:])


def net_case(batch_size: int, tied: bool = True) -> tuple[nn.Module, Batch]:
    torch.manual_seed(1)
    model = NormBiasNet(tied=tied)
    tokens = torch.randint(0, 11, (batch_size, 6))  # includes the padding token 0
    return model, (tokens, torch.randint(0, 11, (batch_size, 6)))


@pytest.mark.parametrize("case", [gpt_case, net_case])
@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("method", ["loop", "fused"])
def test_matches_direct_loop(case, workers: int, method: str) -> None:
    model, batch = case(12)
    loss_fn = gpt_loss if case is gpt_case else net_loss
    expected = direct_loop(model, loss_fn, batch, workers)
    result = worker_gradients(model, loss_fn, batch, workers, method=method)
    assert result.method == method
    assert_all_close(result.grads, expected)
    with torch.no_grad():
        whole = float(loss_fn(model, batch))
    assert result.loss == pytest.approx(whole, rel=1e-6)  # equal micro-batches: mean of worker losses


def test_fused_and_loop_agree_on_gpt_with_many_workers() -> None:
    model, batch = gpt_case(32)
    fused = worker_gradients(model, gpt_loss, batch, 16, method="fused")
    loop = worker_gradients(model, gpt_loss, batch, 16, method="loop")
    assert_all_close(fused.grads, loop.grads)


@pytest.mark.parametrize("case", [gpt_case, net_case])
def test_reused_buffers_are_overwritten_not_accumulated(case) -> None:
    model, first = case(8)
    _, second = case(8)
    second = tuple(t.flip(0) for t in second)  # another batch of the same shapes
    loss_fn = gpt_loss if case is gpt_case else net_loss
    buffers = GradientBuffers()
    worker_gradients(model, loss_fn, first, 4, method="fused", buffers=buffers)
    result = worker_gradients(model, loss_fn, second, 4, method="fused", buffers=buffers)
    assert_all_close(result.grads, direct_loop(model, loss_fn, second, 4))


def test_padding_row_of_the_embedding_gets_no_gradient() -> None:
    model, batch = net_case(8, tied=False)  # tied, the head would write into row 0
    assert bool((batch[0] == 0).any())
    result = worker_gradients(model, net_loss, batch, 2, method="fused")
    emb_index = [id(p) for p in model.parameters()].index(id(model.emb.weight))
    for worker in result.grads:
        assert torch.count_nonzero(worker[emb_index][0]) == 0


def test_fused_pass_leaves_the_model_as_it_was() -> None:
    model, batch = gpt_case(8)
    model.lm_head.weight.requires_grad_(False)  # a frozen parameter stays frozen and is not differentiated
    sentinel = torch.full_like(model.tok_emb.weight, 7.0)
    model.tok_emb.weight.grad = sentinel
    params = [p for p in model.parameters() if p.requires_grad]
    result = worker_gradients(model, gpt_loss, batch, 2, method="fused")
    assert len(result.grads[0]) == len(params) == len(list(model.parameters())) - 1
    assert model.tok_emb.weight.grad is sentinel
    assert all(p.grad is None for p in params[1:])  # no global weight gradient was computed
    assert not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for p in params)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc(self.conv(x).transpose(1, 2)).squeeze(-1), y)


def conv_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0], batch[1])


def test_fused_refuses_other_modules_and_auto_falls_back() -> None:
    torch.manual_seed(2)
    model = ConvNet()
    batch = (torch.randn(6, 2, 5), torch.randn(6, 5))
    with pytest.raises(LionCubConfigError, match=r"^LionCub: .*conv \(Conv1d\).*method='loop'"):
        worker_gradients(model, conv_loss, batch, 3, method="fused")
    result = worker_gradients(model, conv_loss, batch, 3, method="auto")
    assert result.method == "loop" and "Conv1d" in result.reason
    assert_all_close(result.grads, direct_loop(model, conv_loss, batch, 3))


def test_auto_takes_the_fused_pass_where_it_can() -> None:
    model, batch = gpt_case(4)
    result = worker_gradients(model, gpt_loss, batch, 2, method="auto")
    assert (result.method, result.reason) == ("fused", "")


def test_uneven_split_is_refused() -> None:
    batch = (torch.zeros(10, 3),)
    with pytest.raises(LionCubConfigError, match=r"^LionCub: a global batch of 10 samples cannot be split into 4"):
        split_batch(batch, 4)
    assert [tuple(t.shape) for (t,) in split_batch(batch, 5)] == [(2, 3)] * 5

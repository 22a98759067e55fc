"""LionCub in one process (torch.distributed not initialised: a world of one).

At p = 1 the vote of one worker is its own sign (zeros by the tie rule), so every mode can be checked
against a hand-written Lion loop here. CompressedBackend's legacy compressed_allreduce at a world of one
is in tests/unit/test_backend_local.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ds_lioncub import LionCub, LionCubConfigError
from ds_lioncub.step.engine_side import MOVED_TO_ENGINE_SIDE
from tests.support.reference import simulate_lioncub, tie_value

# ------------------------------------------------------------------ helpers

Hyper = tuple[float, tuple[float, float], float]  # lr, betas, weight_decay


def make_grads(step: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Deterministic gradients per step; column 0 of every tensor is exactly 0 so that c == 0 there
    (exact Lion leaves it alone, a vote resolves it by the tie rule)."""
    g = torch.Generator().manual_seed(1000 + step)
    grads = []
    for shape in shapes:
        grad = torch.randn(shape, generator=g)
        grad.view(-1)[0] = 0.0
        grads.append(grad)
    return grads


def lion_loop(
    init: list[torch.Tensor],
    hypers: list[Hyper],
    steps: int,
    compression: str,
    lr_at: Callable[[int, float], float] = lambda step, lr: lr,
    tie_break: str = "alternate",
) -> list[torch.Tensor]:
    """Plain per-parameter Lion at world size 1, each parameter with its own (lr, betas, wd)."""
    params = [t.clone() for t in init]
    momenta = [torch.zeros_like(t) for t in init]
    for step in range(1, steps + 1):
        grads = make_grads(step, [tuple(t.shape) for t in init])
        for param, m, g, (lr, (b1, b2), wd) in zip(params, momenta, grads, hypers, strict=True):
            c = m * b1 + g * (1 - b1)
            if compression == "none":
                direction = torch.sign(c)
            else:
                direction = torch.where(c > 0, 1.0, torch.where(c < 0, -1.0, float(tie_value(step, tie_break))))
            param.mul_(1 - lr_at(step, lr) * wd).sub_(direction * lr_at(step, lr))
            m.mul_(b2).add_(g * (1 - b2))
    return params


def run_optimizer(
    optimizer: LionCub,
    params: list[nn.Parameter],
    steps: int,
    first_step: int = 1,
    after_step: Callable[[], None] = lambda: None,
) -> None:
    for step in range(first_step, first_step + steps):
        for param, grad in zip(params, make_grads(step, [tuple(p.shape) for p in params]), strict=True):
            param.grad = grad
        optimizer.step()
        after_step()


def fresh_params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(self.embed(tokens)))))


# ------------------------------------------------------------------ input errors


def test_integer_parameter_rejected() -> None:
    with pytest.raises(TypeError, match="int64"):
        LionCub([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.parametrize("compression", ["none", "1bit"])
def test_sparse_gradient_rejected_at_step(compression: str) -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = LionCub(embedding.parameters(), compression=compression)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse
    with pytest.raises(TypeError, match="sparse"):
        optimizer.step()


def test_regex_layers_need_names() -> None:
    model = TinyLM()
    with pytest.raises(LionCubConfigError, match="names"):
        LionCub(model.parameters(), momentum_sync={"interval": 2, "layers": ["head"]})


def test_auto_layers_need_module() -> None:
    model = TinyLM()
    with pytest.raises(LionCubConfigError, match="module=model"):
        LionCub(model.named_parameters(), momentum_sync={"interval": 2, "layers": "auto"})


def test_regex_matching_nothing_is_named() -> None:
    model = TinyLM()
    with pytest.raises(LionCubConfigError, match="lm_head"):
        LionCub(model.named_parameters(), momentum_sync={"interval": 2, "layers": ["head", "lm_head"]})


# ------------------------------------------------------------------ momentum-sync selection


def same_tensors(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return [id(t) for t in got] == [id(t) for t in expected]


def test_auto_selects_embedding_and_last_linear() -> None:
    model = TinyLM()
    optimizer = LionCub(model.parameters(), module=model, momentum_sync={"interval": 4, "layers": "auto"})
    expected = [model.embed.weight, model.head.weight, model.head.bias]
    assert same_tensors(optimizer.momentum_synced_parameters, expected)


def test_regex_selects_by_parameter_name() -> None:
    model = TinyLM()
    optimizer = LionCub(model.named_parameters(), momentum_sync={"interval": 4, "layers": [r"^head\.", "embed"]})
    assert same_tensors(optimizer.momentum_synced_parameters, [model.embed.weight, model.head.weight, model.head.bias])
    # Names can also come from module= when plain parameters are passed.
    by_module = LionCub(model.parameters(), module=model, momentum_sync={"interval": 4, "layers": [r"\.bias$"]})
    biases = [model.body.bias, model.norm.bias, model.head.bias]
    assert same_tensors(by_module.momentum_synced_parameters, biases)


def test_all_selects_everything() -> None:
    model = TinyLM()
    optimizer = LionCub(model.parameters(), momentum_sync={"interval": 4, "layers": "all"})
    assert same_tensors(optimizer.momentum_synced_parameters, list(model.parameters()))


# ------------------------------------------------------------------ per-group hyper-parameters

SHAPES = [(5, 3), (7,), (2, 2, 2)]
GROUP_HYPERS: list[Hyper] = [(0.01, (0.9, 0.99), 0.1), (0.003, (0.5, 0.9), 0.0), (0.02, (0.95, 0.98), 0.3)]


@pytest.mark.parametrize("compression", ["none", "1bit"])
def test_param_groups_honour_their_hyper_parameters(compression: str) -> None:
    init = [p.detach().clone() for p in fresh_params(SHAPES)]
    params = [nn.Parameter(t.clone()) for t in init]
    groups = [
        {"params": [p], "lr": lr, "betas": betas, "weight_decay": wd}
        for p, (lr, betas, wd) in zip(params, GROUP_HYPERS, strict=True)
    ]
    # The defaults differ from every group: falling back to them would change the result.
    optimizer = LionCub(groups, lr=0.5, betas=(0.1, 0.2), weight_decay=0.7, compression=compression)
    run_optimizer(optimizer, params, steps=8)
    expected = lion_loop(init, GROUP_HYPERS, steps=8, compression=compression)
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("compression", ["none", "1bit"])
def test_step_lr_scheduler_changes_applied_lr(compression: str) -> None:
    init = [p.detach().clone() for p in fresh_params(SHAPES, seed=1)]
    params = [nn.Parameter(t.clone()) for t in init]
    optimizer = LionCub(params, lr=0.02, betas=(0.9, 0.99), weight_decay=0.1, compression=compression)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    run_optimizer(optimizer, params, steps=7, after_step=scheduler.step)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5**3)
    hypers: list[Hyper] = [(0.02, (0.9, 0.99), 0.1)] * len(SHAPES)
    expected = lion_loop(init, hypers, 7, compression, lr_at=lambda step, lr: lr * 0.5 ** ((step - 1) // 2))
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize(
    "options",
    [{"compression": "none"}, {"compression": "1bit"}, {"compression": "kbit", "bits": 8, "quantizer": "l1"}],
)
def test_state_dict_round_trip_continues_identically(options: dict[str, object]) -> None:
    def build(params: list[nn.Parameter]) -> LionCub:
        return LionCub(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.05, **options)

    straight = fresh_params(SHAPES, seed=2)
    run_optimizer(build(straight), straight, steps=6)

    first_half = fresh_params(SHAPES, seed=2)
    optimizer = build(first_half)
    run_optimizer(optimizer, first_half, steps=3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)

    # A new process would rebuild the model and the optimizer, then load the checkpoint.
    resumed = [nn.Parameter(p.detach().clone()) for p in first_half]
    reloaded = build(resumed)
    buffer.seek(0)
    reloaded.load_state_dict(torch.load(buffer))
    assert reloaded.param_groups[0]["step"] == 3  # the tie rule depends on the step: it must survive
    run_optimizer(reloaded, resumed, steps=3, first_step=4)
    for got, want in zip(resumed, straight, strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ buckets


def test_small_buckets_match_one_bucket_for_l1() -> None:
    # 3000 elements cut into 1024-element buckets. The first third gets large gradients, the rest tiny
    # ones, so a per-piece mu (instead of the whole tensor's mean |c|) would quantize the tiny tail
    # away from 0 and change its tie-resolved sign.
    shapes = [(3000,), (50,), (40, 30)]
    scale = torch.ones(3000)
    scale[:1000] = 100.0
    scale[1000:] = 0.01

    def grads(rank: int, step: int, _: list[torch.Tensor]) -> list[torch.Tensor]:
        out = make_grads(step, shapes)
        out[0] = out[0] * scale
        return out

    init = [p.detach().clone() for p in fresh_params(shapes, seed=3)]
    options = {"compression": "kbit", "quantizer": "l1", "bits": 8}
    for bucket_size in (1024, 1 << 20):
        # the reference sums the whole tensor's |c| chunk-wise past bucket_size, as the optimizer must
        expected, _ = simulate_lioncub(init, grads, world_size=1, steps=4, lr=0.01, bucket_size=bucket_size, **options)
        params = [nn.Parameter(t.clone()) for t in init]
        optimizer = LionCub(params, lr=0.01, bucket_size=bucket_size, **options)
        for step in range(1, 5):
            for param, grad in zip(params, grads(0, step, []), strict=True):
                param.grad = grad
            optimizer.step()
        for got, want in zip(params, expected, strict=True):
            assert torch.equal(got.detach(), want), f"bucket_size={bucket_size}"


# ------------------------------------------------------------------ step() details


def test_closure_called_once_and_loss_returned() -> None:
    torch.manual_seed(0)  # an unseeded loss near 0 would make approx()'s relative tolerance flaky
    model = nn.Linear(3, 1)
    before = model.weight.detach().clone()
    optimizer = LionCub(model.parameters(), lr=0.1)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        optimizer.zero_grad()
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert calls == 1
    assert isinstance(loss, torch.Tensor) and loss.item() == pytest.approx(
        before.sum().item() + model.bias.item() + 0.1
    )
    # d loss / d w = 1 everywhere: the first Lion step moves every weight by -lr.
    torch.testing.assert_close(model.weight.detach(), before - 0.1)


@pytest.mark.parametrize("compression", ["none", "1bit", "kbit"])
def test_parameter_without_gradient_is_skipped(compression: str) -> None:
    used, unused = nn.Parameter(torch.ones(4)), nn.Parameter(torch.full((3,), 2.0))
    # Weight decay would shrink the unused parameter if it were touched at all.
    optimizer = LionCub([used, unused], lr=0.1, weight_decay=0.5, compression=compression)
    used.grad = torch.ones(4)
    optimizer.step()
    assert torch.equal(unused.detach(), torch.full((3,), 2.0))
    assert "exp_avg" not in optimizer.state[unused]
    torch.testing.assert_close(used.detach(), torch.full((4,), 1.0 * (1 - 0.05) - 0.1))
    assert "exp_avg" in optimizer.state[used]


def test_deprecated_attach_and_backend_warn_and_still_work() -> None:
    params = [nn.Parameter(torch.randn(10))]
    optimizer = LionCub(params, compression="1bit")
    with pytest.warns(DeprecationWarning, match="bind"):
        optimizer.attach(None, None)
    with pytest.warns(DeprecationWarning, match="transport"):
        backend = optimizer.backend
    assert backend.transport is optimizer.transport
    # The deprecated backend shares the optimizer's byte accounting: a vote through it is alone, so it counts nothing,
    # and its result is the local sign with the tie rule, as the optimizer's own vote would be.
    update = torch.tensor([1.0, -2.0, 0.0])
    assert backend.vote_1bit(update, step=2).tolist() == [1.0, -1.0, -1.0]


def test_the_calls_moved_to_the_engine_side_still_answer_on_lioncub_with_a_warning() -> None:
    """DeepSpeed's wiring's calls moved to ``LionCub.engine_side``; until 0.3.0 LionCub forwards each, warning."""
    optimizer = LionCub([nn.Parameter(torch.randn(10))], compression="1bit", clip={"max_norm": 1.0})
    for name in MOVED_TO_ENGINE_SIDE:
        with pytest.warns(DeprecationWarning, match=rf"LionCub\.{name} is deprecated.*LionCub\.engine_side\.{name}"):
            forwarded = getattr(optimizer, name)
        direct = getattr(optimizer.engine_side, name)
        if callable(direct):  # the same method of an engine side of the same optimizer
            assert forwarded.__func__ is direct.__func__ and forwarded.__self__ == direct.__self__
        else:
            assert forwarded == direct
    with pytest.raises(AttributeError, match="no_such_option"):
        optimizer.no_such_option  # noqa: B018 - the attribute access is the test

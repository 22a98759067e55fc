"""Set-up once: LionCub's options are parsed once and its aggregation is built once.

``LionCub(params, **options)`` parses its options; :meth:`LionCub.from_config` takes them parsed already (the
DeepSpeed hook parses the ds_config's block once, for the every-rank model check and the construction alike).
Built to be bound (``bound_later``), it leaves the aggregation to :meth:`LionCub.bind`, which builds it for the
ranks that vote. The calls are counted through the module attributes the optimizer calls; what each step does is
compared with a LionCub built from raw options, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ds_lioncub
from ds_lioncub import LionCub, LionCubConfig, optimizer, parse_config
from ds_lioncub.step import rank_step

OPTIONS: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "compression": "kbit", "bits": 4}


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Every call of ``<name>`` from now on, by its first argument, where LionCub calls it: ``parse_config`` in
    ``ds_lioncub.optimizer``, ``build_aggregation`` in the rank's step (``ds_lioncub.step.rank_step``)."""
    module = rank_step if name == "build_aggregation" else optimizer
    calls: list[Any] = []
    original: Callable[..., Any] = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def params() -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(300, generator=generator)), nn.Parameter(torch.randn(7, generator=generator))]


def stepped(lioncub: LionCub, steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in lioncub.param_groups[0]["params"]:
            param.grad = torch.randn(param.shape, generator=generator)
        lioncub.step()
    return [param.detach().clone() for param in lioncub.param_groups[0]["params"]]


def test_raw_options_are_parsed_once_and_the_aggregation_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed, built = counted(monkeypatch, "parse_config"), counted(monkeypatch, "build_aggregation")
    lioncub = ds_lioncub.LionCub(params(), **OPTIONS)
    assert [sorted(options) for options in parsed] == [sorted(OPTIONS)]
    assert len(built) == 1
    assert lioncub.options == parse_config(OPTIONS)


def test_from_config_takes_the_parsed_options_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config(OPTIONS)
    parsed, built = counted(monkeypatch, "parse_config"), counted(monkeypatch, "build_aggregation")
    lioncub = LionCub.from_config(params(), config)
    assert parsed == [] and len(built) == 1
    assert lioncub.options is config
    group = lioncub.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (config.lr, config.betas, config.weight_decay)
    assert all(torch.equal(a, b) for a, b in zip(stepped(lioncub), stepped(LionCub(params(), **OPTIONS)), strict=True))


def test_built_to_be_bound_the_aggregation_is_built_by_bind_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = stepped(LionCub(params(), **OPTIONS))
    built = counted(monkeypatch, "build_aggregation")
    lioncub = LionCub.from_config(params(), parse_config(OPTIONS), bound_later=True)
    assert built == []
    lioncub.bind(None, None, gradients_averaged=False)
    assert len(built) == 1
    assert all(torch.equal(a, b) for a, b in zip(stepped(lioncub), plain, strict=True))
    assert len(built) == 1


def test_built_to_be_bound_and_stepped_unbound_it_builds_the_aggregation_at_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = stepped(LionCub(params(), **OPTIONS))
    built = counted(monkeypatch, "build_aggregation")
    lioncub = LionCub.from_config(params(), parse_config(OPTIONS), bound_later=True)
    assert built == []
    assert all(torch.equal(a, b) for a, b in zip(stepped(lioncub), plain, strict=True))
    assert len(built) == 1


def test_from_config_refuses_raw_options_beside_the_parsed_ones() -> None:
    config: LionCubConfig = parse_config(OPTIONS)
    with pytest.raises(TypeError, match="beside options already parsed"):
        LionCub(params(), _config=config, bits=8)

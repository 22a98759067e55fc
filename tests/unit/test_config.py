"""Option validation: every bad value, unknown key and conflict gives a LionCubConfigError that names the
option and the value and says how to fix it; valid configurations parse to what was asked for; the ready
ds_config files in configs/ select LionCub."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_lioncub
from ds_lioncub import LionCub, LionCubConfigError, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
KBIT = {"compression": "kbit"}
KBIT_L1 = {"compression": "kbit", "quantizer": "l1"}

# (option as it appears in the message, bad value as repr() shows it, the options)
BAD_VALUES: list[tuple[str, str, dict[str, Any]]] = [
    ("lr", "-1.0", {"lr": -1.0}),
    ("lr", "'fast'", {"lr": "fast"}),
    ("betas", "(0.9, 1.0)", {"betas": (0.9, 1.0)}),
    ("betas", "(-0.1, 0.99)", {"betas": (-0.1, 0.99)}),
    ("betas", "(0.9,)", {"betas": (0.9,)}),
    ("weight_decay", "-0.1", {"weight_decay": -0.1}),
    ("compression", "'2bit'", {"compression": "2bit"}),
    ("bits", "3", {**KBIT, "bits": 3}),
    ("bits", "16", {**KBIT, "bits": 16}),
    ("quantizer", "'maxnorm'", {**KBIT, "quantizer": "maxnorm"}),
    ("aggregation", "'median'", {**KBIT, "aggregation": "median"}),
    ("kbit_algorithm", "'ring'", {**KBIT, "kbit_algorithm": "ring"}),
    ("tie_break", "'random'", {"tie_break": "random"}),
    ("l1_clip", "0", {**KBIT_L1, "l1_clip": 0}),
    ("l1_clip", "-2.0", {**KBIT_L1, "l1_clip": -2.0}),
    ("comm_dtype", "'fp16'", {"compression": "none", "comm_dtype": "fp16"}),
    ("bucket_size", "0", {"bucket_size": 0}),
    ("bucket_size", "2.5", {"bucket_size": 2.5}),
    ("momentum_sync", "5", {"momentum_sync": 5}),
    ("momentum_sync.interval", "-1", {"momentum_sync": {"interval": -1}}),
    ("momentum_sync.layers", "'some'", {"momentum_sync": {"interval": 1, "layers": "some"}}),
    ("momentum_sync.layers", "'('", {"momentum_sync": {"interval": 1, "layers": ["("]}}),
    ("momentum_sync.dtype", "'fp16'", {"momentum_sync": {"dtype": "fp16"}}),
]


@pytest.mark.parametrize(("option", "shown", "options"), BAD_VALUES, ids=[f"{o}={s}" for o, s, _ in BAD_VALUES])
def test_bad_value_names_option_and_value(option: str, shown: str, options: dict[str, Any]) -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config(options)
    message = str(raised.value)
    assert option in message and shown in message, message


@pytest.mark.parametrize(
    ("options", "value"),
    [
        ({"lr": math.inf}, "inf"),
        ({"lr": math.nan}, "nan"),
        ({"weight_decay": math.inf}, "inf"),
        ({**KBIT_L1, "l1_clip": math.inf}, "inf"),
    ],
)
def test_non_finite_hyper_parameters_rejected(options: dict[str, Any], value: str) -> None:
    # An infinite lr / weight decay turns every parameter into inf/NaN on the first step, and an
    # infinite l1_clip quantizes every update to 0 (all ties): none is a usable setting.
    with pytest.raises(LionCubConfigError, match=value):
        parse_config(options)


def test_config_error_is_a_value_error() -> None:
    # The documented contract is ValueError; LionCubConfigError must stay a subclass so callers can catch either.
    assert issubclass(ds_lioncub.LionCubConfigError, ValueError)


@pytest.mark.parametrize("key", ["lrr", "compresion", "beta1"])
def test_unknown_key_named_and_valid_options_listed(key: str) -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({key: 1})
    message = str(raised.value)
    assert repr(key) in message
    valid = (
        "lr",
        "betas",
        "weight_decay",
        "compression",
        "bits",
        "quantizer",
        "aggregation",
        "kbit_algorithm",
        "tie_break",
        "l1_clip",
        "comm_dtype",
        "bucket_size",
        "momentum_sync",
    )
    listed = message.split("Valid options:", 1)[1]
    for name in valid:
        assert name in listed, f"{name} missing from {message}"


def test_unknown_momentum_sync_key_named() -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({"momentum_sync": {"intervall": 10}})
    message = str(raised.value)
    assert "intervall" in message
    for name in ("interval", "layers", "dtype"):
        assert name in message.split("momentum_sync takes", 1)[1]


# (options, words the message must contain: the options in conflict and the fix)
CONFLICTS: list[tuple[dict[str, Any], list[str]]] = [
    ({"compression": "1bit", "bits": 8}, ["bits", "compression='kbit'", "drop bits"]),
    ({"compression": "none", "bits": 4}, ["bits", "compression='kbit'", "drop bits"]),
    ({"compression": "1bit", "quantizer": "l1"}, ["quantizer", "compression='kbit'", "drop quantizer"]),
    ({"compression": "1bit", "aggregation": "mean"}, ["aggregation", "compression='kbit'", "drop aggregation"]),
    ({"compression": "1bit", "kbit_algorithm": "alltoall"}, ["kbit_algorithm", "drop kbit_algorithm"]),
    ({"compression": "1bit", "comm_dtype": "bf16"}, ["comm_dtype", "'bf16'", "drop comm_dtype"]),
    ({"compression": "kbit", "comm_dtype": "bf16"}, ["comm_dtype", "drop comm_dtype"]),
    ({"compression": "kbit", "quantizer": "sign", "l1_clip": 1.5}, ["l1_clip", "quantizer='l1'", "drop l1_clip"]),
    ({"compression": "kbit", "l1_clip": 1.5}, ["l1_clip", "quantizer='l1'"]),
]


@pytest.mark.parametrize(("options", "words"), CONFLICTS, ids=[str(o) for o, _ in CONFLICTS])
def test_conflicting_options_say_how_to_fix(options: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config(options)
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_fix_hints_for_ranges() -> None:
    with pytest.raises(LionCubConfigError, match=r"\[0, 1\)"):
        parse_config({"betas": (0.9, 1.5)})
    with pytest.raises(LionCubConfigError, match="not a valid regex"):
        parse_config({"momentum_sync": {"interval": 10, "layers": ["lm_head", "[unclosed"]}})
    with pytest.raises(LionCubConfigError, match="greater than or equal to 0"):
        parse_config({"lr": -1e-3})


def test_optimizer_constructor_validates_too() -> None:
    # LionCub(...) and the ds_config path share parse_config, so the constructor raises the same error.
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(LionCubConfigError, match="lr=-0.1"):
        LionCub(params, lr=-0.1)
    with pytest.raises(LionCubConfigError, match="betas"):
        LionCub(params, betas=(1.0, 0.99))
    with pytest.raises(LionCubConfigError, match="'compressoin'"):
        LionCub(params, compressoin="1bit")
    with pytest.raises(LionCubConfigError, match="drop bits"):
        LionCub(params, bits=8)


def test_param_group_hyper_parameters_validated() -> None:
    opt = LionCub([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    with pytest.raises(LionCubConfigError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1.0})
    with pytest.raises(LionCubConfigError, match="betas"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.9, 2.0)})


def test_defaults_parse() -> None:
    config = parse_config({})
    assert config.lr == 1e-4 and config.betas == (0.9, 0.99) and config.weight_decay == 0.0
    assert config.compression == "1bit" and config.tie_break == "alternate"
    assert config.momentum_sync.interval == 0


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "none", "comm_dtype": "bf16", "lr": 3e-4, "weight_decay": 0.1},
        {"compression": "1bit", "tie_break": "positive", "bucket_size": 1 << 20},
        {"compression": "1bit", "comm_dtype": "fp32"},  # the default value, given explicitly, is fine
        {"compression": "kbit", "bits": 8, "quantizer": "l1", "l1_clip": 1.5, "kbit_algorithm": "alltoall"},
        {"compression": "kbit", "bits": 2, "quantizer": "sign", "aggregation": "mean"},
        {"betas": [0.95, 0.98], "momentum_sync": {"interval": 10, "layers": ["^lm_head\\.", "wte"], "dtype": "bf16"}},
        {"momentum_sync": {"interval": 5, "layers": "all"}},
        {"betas": (0.0, 0.0), "lr": 0.0},
    ],
)
def test_valid_configs_parse(options: dict[str, Any]) -> None:
    config = parse_config(options)
    for key, value in options.items():
        got = getattr(config, key)
        if key == "momentum_sync":
            for sub_key, sub_value in value.items():
                assert getattr(got, sub_key) == sub_value
        elif key == "betas":
            assert tuple(got) == tuple(value)
        else:
            assert got == value


def test_transport_options() -> None:
    from ds_lioncub import LionCubConfigError, parse_config
    from ds_lioncub.comm import make_transport

    assert parse_config({}).comm_backend_name == "torch" and parse_config({}).cuda_aware is False
    config = parse_config({"comm_backend_name": "mpi", "cuda_aware": True})
    assert config.comm_backend_name == "mpi" and config.cuda_aware is True
    with pytest.raises(LionCubConfigError, match=r"comm_backend_name='openmpi': Input should be 'torch' or 'mpi'"):
        parse_config({"comm_backend_name": "openmpi"})
    with pytest.raises(LionCubConfigError, match=r"comm_backend_name='nccl': must be 'torch' or 'mpi'.*'torch' uses"):
        parse_config({"comm_backend_name": "nccl"})
    with pytest.raises(LionCubConfigError, match=r"cuda_aware=True only applies to comm_backend_name='mpi'"):
        parse_config({"cuda_aware": True})
    with pytest.raises(ValueError, match=r"cuda_aware=True only applies"):
        make_transport(None, "torch", cuda_aware=True)
    with pytest.raises(ValueError, match=r"comm_backend_name must be one of \['torch', 'mpi'\]"):
        make_transport(None, "nccl")


def test_config_files_are_valid_json_with_lioncub() -> None:
    for path in CONFIGS.glob("*.json"):
        config = json.loads(path.read_text())
        assert config["optimizer"]["type"].lower() == "lioncub", path.name

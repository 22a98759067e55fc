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


def test_every_config_file_and_documented_example_parses() -> None:
    # The witnesses that strict inputs refuse nothing that trains today: every ready config and every options block
    # the README and the user guide show, parsed as DeepSpeed hands them to LionCub.
    params = [json.loads(path.read_text())["optimizer"]["params"] for path in sorted(CONFIGS.glob("*.json"))]
    assert len(params) >= 8
    for page, least in (("README.md", 1), ("docs/user-guide.md", 2)):
        text = (CONFIGS.parent / page).read_text()
        blocks = [block.split("```", 1)[0].strip() for block in text.split("```json\n")[1:]]
        assert len(blocks) >= least, f"{page}'s ds_config examples were not found"
        for block in blocks:
            config = json.loads(block if block.startswith("{") else "{" + block + "}")
            params.append(config["optimizer"]["params"])
    for options in params:
        parse_config(options)
    # The user guide's Python example and the option reference's examples.
    LionCub([torch.nn.Parameter(torch.zeros(3))], lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1, compression="1bit")
    parse_config({"telemetry": {"vote_stats": True}, "consistency_check": {"interval": 0}, "hybrid": {}})
    parse_config({"compression": "kbit", "bits": 8, "quantizer": "l1", "l1_clip": 2.0, "bucket_size": 5e8})


# ---------------------------------------------------------------------------------------------- strict types


# (options, the option as the message names it): booleans, which pydantic alone reads as 1 and 0.
BOOLEANS_AS_NUMBERS: list[tuple[dict[str, Any], str]] = [
    ({"lr": True}, "lr=True"),
    ({"weight_decay": True}, "weight_decay=True"),
    ({"lr": False}, "lr=False"),
    ({"betas": [True, 0.99]}, "betas.0=True"),
    ({**KBIT_L1, "l1_clip": True}, "l1_clip=True"),
    ({"bucket_size": True}, "bucket_size=True"),
    ({**KBIT, "bits": True}, "bits=True"),
    ({"momentum_sync": {"interval": True}}, "momentum_sync.interval=True"),
    ({"consistency_check": {"interval": True}}, "consistency_check.interval=True"),
    ({"hybrid": {"node_size": True}}, "hybrid.node_size=True"),
    ({"compression": "auto", "network": {"bandwidth": "1gbit", "ring_efficiency": True}}, "ring_efficiency=True"),
]


@pytest.mark.parametrize(("options", "named"), BOOLEANS_AS_NUMBERS, ids=[n for _, n in BOOLEANS_AS_NUMBERS])
def test_booleans_are_not_numbers(options: dict[str, Any], named: str) -> None:
    with pytest.raises(LionCubConfigError, match="booleans are not numbers") as raised:
        parse_config(options)
    assert named in str(raised.value) and str(raised.value).startswith("LionCub: ")


def test_booleans_are_not_numbers_in_the_python_api() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(LionCubConfigError, match=r"lr=True: booleans are not numbers"):
        LionCub(params, lr=True)
    with pytest.raises(LionCubConfigError, match=r"weight_decay=True: booleans are not numbers"):
        LionCub(params, weight_decay=True)
    with pytest.raises(LionCubConfigError, match=r"betas.1=False: booleans are not numbers"):
        LionCub(params, betas=(0.9, False))
    optimizer = LionCub(params, lr=1e-3)
    with pytest.raises(LionCubConfigError, match=r"lr=True: booleans are not numbers"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": True})


# (options, the option and value as the message shows them, what to write instead): one rule for every number.
STRINGS_AS_NUMBERS: list[tuple[dict[str, Any], str, str]] = [
    ({"lr": "1e-3"}, "lr='1e-3'", "write 1e-3 without quotes"),
    ({**KBIT, "bits": "4"}, "bits='4'", "write 4 without quotes"),
    ({"consistency_check": {"interval": "10"}}, "consistency_check.interval='10'", "write 10 without quotes"),
    ({"bucket_size": "2048"}, "bucket_size='2048'", "write 2048 without quotes"),
    ({"momentum_sync": {"interval": "10"}}, "momentum_sync.interval='10'", "write 10 without quotes"),
    ({"betas": ["0.9", 0.99]}, "betas.0='0.9'", "write 0.9 without quotes"),
    ({"lr": "fast"}, "lr='fast'", "must be a number"),
]


@pytest.mark.parametrize(("options", "named", "fix"), STRINGS_AS_NUMBERS, ids=[n for _, n, _ in STRINGS_AS_NUMBERS])
def test_strings_are_not_numbers(options: dict[str, Any], named: str, fix: str) -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config(options)
    message = str(raised.value)
    assert named in message and fix in message and "strings are not numbers" in message, message


@pytest.mark.parametrize(
    "options",
    [
        {"check_finite": 0},
        {"check_finite": "false"},
        {"overlap": 1},
        {"cuda_aware": "yes"},
        {"telemetry": {"vote_stats": 1}},
    ],
)
def test_only_true_and_false_are_booleans(options: dict[str, Any]) -> None:
    with pytest.raises(LionCubConfigError, match="must be true or false") as raised:
        parse_config(options)
    assert next(iter(options)) in str(raised.value)


def test_numbers_keep_their_json_spellings() -> None:
    # JSON writes 0 for a real and 5e8 for a whole number (DeepSpeed's configs write sizes so): both stay valid.
    config = parse_config({"weight_decay": 0, "lr": 1, "bucket_size": 5e8, "betas": [0, 0.5]})
    assert (config.weight_decay, config.lr, config.bucket_size, config.betas) == (0.0, 1.0, 500_000_000, (0.0, 0.5))
    assert isinstance(config.bucket_size, int) and isinstance(config.lr, float)
    with pytest.raises(LionCubConfigError, match="fractional part"):
        parse_config({"bucket_size": 5e3 + 0.5})


AUTO_ON_A_NETWORK: dict[str, Any] = {"compression": "auto", "network": {"bandwidth": "1gbit"}}
# The numeric fields of the options model, found by walking it (so a new one cannot escape the walk below), with
# the options that make each one apply. A field missing here fails test_numeric_fields_are_all_known.
NUMERIC_FIELD_CONTEXT: dict[str, dict[str, Any]] = {
    "lr": {},
    "betas.0": {},
    "betas.1": {},
    "weight_decay": {},
    "bits": KBIT,
    "l1_clip": KBIT_L1,
    "bucket_size": {},
    "momentum_sync.interval": {},
    "consistency_check.interval": {},
    "hybrid.node_size": {},
    "clip.max_norm": {},
    "clip.sketch_bins": {"clip": {"max_norm": 1.0}},
    "telemetry.noise_scale_beta": {},
    "error_feedback.beta": {**KBIT_L1, "error_feedback": {"kind": "residual"}},
    "error_feedback.reset_interval": {**KBIT_L1, "error_feedback": {"kind": "residual"}},
    "network.bandwidth": {"compression": "auto"},
    "network.latency": {"compression": "auto"},
    "network.intra_node_bandwidth": {"compression": "auto"},
    "network.ring_efficiency": {"compression": "auto"},
    "network.all_to_all_efficiency": {"compression": "auto"},
    "network.device_bandwidth": {"compression": "auto"},
    "job.global_batch": AUTO_ON_A_NETWORK,
    "job.noise_scale": {**AUTO_ON_A_NETWORK, "job": {"global_batch": 1024}},
    "job.compute_per_step": AUTO_ON_A_NETWORK,
}
# Values of a numeric field that are refused unless listed here as meaningful (with where the docs say so).
# None is today: no option takes NaN, an infinity or a negative number.
MEANINGFUL: dict[tuple[str, str], str] = {}


def _numeric_fields(model: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every int/float field (tuples by position, Literal ints as numbers), nested models walked."""
    import types
    import typing

    from pydantic import BaseModel

    found = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        members = typing.get_args(annotation) if union else (annotation,)
        members = tuple(member for member in members if member is not type(None))
        for member in members:
            if isinstance(member, type) and issubclass(member, BaseModel):
                found += _numeric_fields(member, f"{prefix}{name}.")
            elif typing.get_origin(member) is tuple:
                found += [
                    f"{prefix}{name}.{i}"
                    for i, part in enumerate(typing.get_args(member))
                    if _bare(part) in (int, float)
                ]
            elif member in (int, float) and member is not bool:
                found.append(prefix + name)
            elif typing.get_origin(member) is typing.Literal and all(
                isinstance(value, int) and not isinstance(value, bool) for value in typing.get_args(member)
            ):
                found.append(prefix + name)
    return found


def _bare(annotation: Any) -> Any:
    """``float`` of ``Annotated[float, ...]``; anything else as it is."""
    import typing

    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _with_value(context: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``context`` with ``value`` at the dotted ``path`` (a network gets its required bandwidth; betas a partner)."""
    options = json.loads(json.dumps(context))
    head, _, rest = path.partition(".")
    if head == "betas":
        betas = [0.9, 0.99]
        betas[int(rest)] = value
        options["betas"] = betas
    elif rest:
        block = options.setdefault(head, {"bandwidth": "1gbit"} if head == "network" else {})
        block[rest] = value
    else:
        options[head] = value
    return options


def test_numeric_fields_are_all_known() -> None:
    from ds_lioncub.config import LionCubConfig

    assert sorted(_numeric_fields(LionCubConfig)) == sorted(NUMERIC_FIELD_CONTEXT)
    # Each context with a valid value parses, so the refusals below are the value's, not the context's.
    valid = {
        "betas.0": 0.5,
        "betas.1": 0.5,
        "bits": 8,
        "error_feedback.beta": 0.5,
        "telemetry.noise_scale_beta": 0.5,
        "network.ring_efficiency": 1,
        "network.all_to_all_efficiency": 1,
    }
    for path, context in NUMERIC_FIELD_CONTEXT.items():
        parse_config(_with_value(context, path, valid.get(path, 4096)))


@pytest.mark.parametrize("path", sorted(NUMERIC_FIELD_CONTEXT))
@pytest.mark.parametrize(
    ("kind", "value"), [("boolean", True), ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("negative", -1)]
)
def test_every_numeric_field_refuses_booleans_nan_inf_and_negatives(path: str, kind: str, value: Any) -> None:
    if (path, kind) in MEANINGFUL:
        parse_config(_with_value(NUMERIC_FIELD_CONTEXT[path], path, value))
        return
    with pytest.raises(LionCubConfigError) as raised:
        parse_config(_with_value(NUMERIC_FIELD_CONTEXT[path], path, value))
    message = str(raised.value)
    # A position of betas may be named as itself (betas.0=True) or as the pair the range check reads.
    assert message.startswith("LionCub: ") and any(f"{name}=" in message for name in (path, path.partition(".")[0]))


# ---------------------------------------------------------------------------------------------- momentum_sync blocks


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"interval": 1, "layers": []}, ["momentum_sync.layers=[]", "empty list", '"auto" or "all"']),
        ({"layers": ["lm_head"]}, ["layers=['lm_head']", "interval is missing", "set momentum_sync.interval"]),
        ({"dtype": "bf16"}, ["dtype='bf16'", "interval is missing", "drop momentum_sync"]),
        ({"layers": "auto"}, ["layers='auto'", "interval is missing"]),  # "auto" is a value here, not HF's blank
        ({"interval": 0, "layers": "all"}, ["layers='all'", "interval is 0", "set momentum_sync.interval"]),
    ],
)
def test_momentum_sync_blocks_that_cannot_sync_are_refused(block: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({"momentum_sync": block})
    for word in words:
        assert word in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    "options",
    [
        {"momentum_sync": {}},
        {"momentum_sync": {"interval": 0}},
        {"momentum_sync": {"interval": 0, "layers": "auto", "dtype": "fp32"}},  # interval 0 with the defaults: off
        {"momentum_sync": {"interval": 5, "layers": "auto"}},
        {"momentum_sync": {"interval": 10, "layers": ["^lm_head\\."], "dtype": "bf16"}},
        {"compression": "none", "momentum_sync": {"interval": 0}},
        {"compression": "auto", "network": {"bandwidth": "1gbit"}, "momentum_sync": {"interval": 10}},
    ],
)
def test_valid_momentum_sync_blocks_survive_a_round_trip(options: dict[str, Any]) -> None:
    # compression="auto" and the engine dump the options they were given and parse them again.
    config = parse_config(options)
    again = parse_config(config.model_dump(include=config.model_fields_set))
    assert again.momentum_sync == config.momentum_sync


# ---------------------------------------------------------------------------------------------- messages


def test_betas_of_the_wrong_length_say_what_to_write() -> None:
    for betas in ([0.9], [0.9, 0.99, 0.999], 0.9):
        with pytest.raises(LionCubConfigError) as raised:
            parse_config({"betas": betas})
        message = str(raised.value)
        assert f"betas={betas!r}: must be two numbers" in message and "[0.9, 0.99]" in message, message
        assert "Field required" not in message


def test_a_missing_network_bandwidth_is_named_with_the_fix() -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({"compression": "auto", "network": {"latency": "50us"}})
    message = str(raised.value)
    assert "network.bandwidth is required" in message and '"bandwidth": "1gbit"' in message, message
    assert "{'latency'" not in message  # the enclosing block is not the bad value


@pytest.mark.parametrize(("key", "text"), [("bandwidth", "1e400gbit"), ("latency", "1e400s")])
def test_network_quantities_too_large_name_what_was_typed(key: str, text: str) -> None:
    network = {"bandwidth": "1gbit", key: text}
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({"compression": "auto", "network": network})
    message = str(raised.value)
    assert f"network.{key}={text!r}" in message and "infinity" in message, message

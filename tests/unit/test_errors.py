"""One error hierarchy and one message prefix, from every layer that raises for a user."""

from __future__ import annotations

import pytest
import torch

from ds_lioncub import LionCub, parse_config
from ds_lioncub.comm import CompressedBackend
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.errors import (
    MESSAGE_PREFIX,
    LionCubConfigError,
    LionCubError,
    LionCubSetupError,
    MissingDependencyError,
    MpiSetupError,
    NonFiniteGradientError,
    UnsupportedParameterError,
)


@pytest.mark.parametrize(
    "error_class,builtin",
    [
        (LionCubConfigError, ValueError),
        (UnsupportedParameterError, TypeError),
        (UnsupportedParameterError, ValueError),
        (LionCubSetupError, RuntimeError),
        (MpiSetupError, RuntimeError),
        (MissingDependencyError, ImportError),
        (NonFiniteGradientError, FloatingPointError),
    ],
)
def test_every_error_is_a_lioncub_error_and_the_builtin_callers_already_catch(
    error_class: type[Exception], builtin: type[Exception]
) -> None:
    error = error_class("something is off")
    assert isinstance(error, LionCubError) and isinstance(error, builtin)
    assert str(error) == "LionCub: something is off"


def test_the_prefix_is_added_once() -> None:
    assert str(LionCubConfigError("LionCub: bits=3 is not a width")) == "LionCub: bits=3 is not a width"
    assert MESSAGE_PREFIX == "LionCub: "


def raise_bad_option() -> None:
    parse_config({"compresion": "1bit"})


def raise_kbit_world() -> None:
    KbitCodec.build(16, 4, "sign", "allreduce")


def raise_integer_parameter() -> None:
    LionCub([torch.zeros(3, dtype=torch.int64)])


def raise_bad_backend_choice() -> None:
    CompressedBackend().vote_kbit(torch.ones(8), 1, 4, quantizer="max")  # type: ignore[arg-type]


def raise_unmatched_sync_regex() -> None:
    LionCub([("w", torch.nn.Parameter(torch.zeros(3)))], momentum_sync={"interval": 2, "layers": ["^head"]})


def raise_legacy_buffer_size() -> None:
    CompressedBackend().compressed_allreduce(torch.zeros(10), torch.zeros(9), torch.zeros(9))


@pytest.mark.parametrize(
    "trigger,error_class",
    [
        (raise_bad_option, LionCubConfigError),
        (raise_kbit_world, LionCubConfigError),
        (raise_integer_parameter, UnsupportedParameterError),
        (raise_bad_backend_choice, LionCubConfigError),
        (raise_unmatched_sync_regex, LionCubConfigError),
        (raise_legacy_buffer_size, LionCubConfigError),
    ],
)
def test_user_mistakes_from_every_layer_raise_the_hierarchy_with_the_prefix(trigger, error_class) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error_class) as caught:
        trigger()
    assert isinstance(caught.value, LionCubError)
    assert str(caught.value).startswith(MESSAGE_PREFIX) and not str(caught.value).startswith(MESSAGE_PREFIX * 2)

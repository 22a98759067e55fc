"""The non-finite check (option ``check_finite``): every rank raises the same error, before any state changes, when
some rank's gradient holds a NaN or inf.

A vote would silently turn a NaN into a -1 (or an L1 scale into garbage); exact Lion at least propagates it. One
4-byte all-reduce per step makes every rank reach the same verdict (:func:`finite_check_rounds`); when the step's
sketch runs (option ``clip``, the noise scale) its all-reduce carries the verdict instead (:func:`runs_finite_check`),
one collective round where there were two.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.transport import Summing
from ds_lioncub.errors import NonFiniteGradientError
from ds_lioncub.step.bucket_work import Entry, non_finite_parameters
from ds_lioncub.step.overlap import OverlapController


def runs_finite_check(aggregator: Aggregator | None, overlap: OverlapController, check_finite: bool) -> bool:
    """Whether this step's path runs :func:`finite_check_rounds`: the compressed step without an armed backward,
    with option ``check_finite``. The step's sketch, when one runs, then carries the check's verdict in its
    all-reduce instead, which saves the step one collective round."""
    return check_finite and aggregator is not None and not aggregator.reduces_gradients and overlap.armed is None


def finite_check_rounds(
    entries: list[Entry], step: int, agreement: Summing, label: ParameterLabel
) -> Generator[None, None, None]:
    """The agreed check: this rank's verdict through one int32 all-reduce over ``agreement`` (a round: every rank
    issues it before any reads it), then the same error on every rank if any rank's gradient is not finite."""
    bad = non_finite_parameters(entries)
    device = entries[0].grad.device if entries else torch.device("cpu")
    ranks_with_bad = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
    agreement.all_reduce_sum(ranks_with_bad)
    yield
    raise_if_non_finite(int(ranks_with_bad.item()), bad, step, agreement.world_size, label)


class ParameterLabel:
    """How an error message names a parameter: its name, else its flat position and shape."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str] | None) -> None:
        self._params = params
        self._names = names

    def __call__(self, param: torch.Tensor) -> str:
        position = next(i for i, p in enumerate(self._params) if p is param)
        if self._names:
            return repr(self._names[position])
        return f"parameter #{position} of shape {tuple(param.shape)}"


def raise_if_non_finite(count: int, bad: list[torch.Tensor], step: int, ranks: int, label: ParameterLabel) -> None:
    """Raise the same error on every rank when ``count`` of the ``ranks`` (agreed) have non-finite gradients."""
    if count == 0:
        return
    here = ", ".join(label(param) for param in bad[:5]) or "none"
    raise NonFiniteGradientError(
        f"LionCub: non-finite (NaN/inf) gradients on {count} of {ranks} ranks at "
        f"step {step}; the step was not applied on any rank (this rank's offending parameters: {here}). "
        f"Lower the learning rate, enable gradient clipping or loss scaling; check_finite=False turns "
        f"this check off."
    )


__all__ = ["ParameterLabel", "finite_check_rounds", "raise_if_non_finite", "runs_finite_check"]

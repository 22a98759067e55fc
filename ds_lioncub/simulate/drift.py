"""How the applied update's sign errors against exact Lion's add up over steps: drift and persistence.

:mod:`ds_lioncub.simulate.agreement` counts, step by step, how often the applied sign differs from exact
Lion's ``sign(mean_i c_i)``. The same flip rate can do very different harm. Errors that change direction
from step to step cancel in the weights; errors that keep the same coordinates wrong for many steps push
those weights steadily away from exact Lion's path (for the aggregations that apply signs, every vote;
one that applies magnitudes moves the weights by more or less than its signs say). This module measures
which one happens, per tensor, over windows of ``window`` steps. With ``e_t = sign(applied_t) - sign(exact_t)`` and
``s_t = sign(exact_t)`` per element (both in {-1, 0, 1}):

- ``err_l1``: the window's summed ``|e_t|`` (how much error the steps made);
- ``drift_l1``: ``|sum_t e_t|`` summed over elements (how much of it accumulated in the weights);
- ``exact_l1``: ``|sum_t s_t|`` summed over elements (how far exact Lion's own steps moved, for scale).

``persistence = drift_l1 / err_l1`` is 1 when every element errs the same way every step of the window
and about ``sqrt(2 / (pi * k))`` for an element that errs ``k`` times in independent directions (a
random walk); ``drift_ratio = drift_l1 / exact_l1`` is the accumulated error against exact Lion's
accumulated movement. A flip run is a stretch of consecutive steps in which an element's applied sign
is the opposite of exact Lion's; its mean length says how long a flip persists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ds_lioncub.step.bucket_plan import Piece

DEFAULT_WINDOW = 50


@dataclass(frozen=True)
class WindowDrift:
    """One tensor's sums over one window of steps (see the module docstring).

    Attributes:
        err_l1: sum over the window's steps and the tensor's elements of ``|e_t|``.
        drift_l1: sum over elements of ``|sum over the window's steps of e_t|``.
        exact_l1: sum over elements of ``|sum over the window's steps of s_t|``.
    """

    err_l1: int
    drift_l1: int
    exact_l1: int


@dataclass(frozen=True)
class TensorDrift:
    """One tensor's drift over a run.

    Attributes:
        name: the parameter's name (``param<j>`` without a module).
        numel: its elements.
        steps: the steps recorded.
        flips: element-steps whose applied sign was the opposite of exact Lion's.
        flip_runs: runs of consecutive flipped steps (a run still open at the end counts).
        windows: the complete windows, in order (a last partial window is left out).
    """

    name: str
    numel: int
    steps: int
    flips: int
    flip_runs: int
    windows: tuple[WindowDrift, ...]

    @property
    def flip_rate(self) -> float:
        return self.flips / max(1, self.numel * self.steps)

    @property
    def mean_flip_run(self) -> float:
        """Mean length, in steps, of a flip run (0 without flips)."""
        return self.flips / self.flip_runs if self.flip_runs else 0.0

    @property
    def persistence(self) -> float:
        """Accumulated over made error, over the complete windows (0 without error)."""
        return persistence_of(self.windows)

    @property
    def drift_ratio(self) -> float:
        """Accumulated error over exact Lion's accumulated movement, over the complete windows."""
        return drift_ratio_of(self.windows)


def persistence_of(windows: Sequence[WindowDrift]) -> float:
    """Sum of ``drift_l1`` over sum of ``err_l1`` across ``windows``; 0 without error."""
    err = sum(w.err_l1 for w in windows)
    return sum(w.drift_l1 for w in windows) / err if err else 0.0


def drift_ratio_of(windows: Sequence[WindowDrift]) -> float:
    """Sum of ``drift_l1`` over sum of ``exact_l1`` across ``windows``; 0 when exact Lion did not move."""
    exact = sum(w.exact_l1 for w in windows)
    return sum(w.drift_l1 for w in windows) / exact if exact else 0.0


@dataclass
class _TensorState:
    """Counts kept on the tensors' device (no host sync per step) until a window closes."""

    err_sum: torch.Tensor  # int32: sum of e_t over the open window
    exact_sum: torch.Tensor  # int32: sum of s_t over the open window
    run: torch.Tensor  # int32: the current flip run's length, 0 when not flipped
    err_l1: torch.Tensor  # int64 scalar: the open window's sum of |e_t|
    flips: torch.Tensor  # int64 scalar
    flip_runs: torch.Tensor  # int64 scalar
    windows: list[WindowDrift] = field(default_factory=list)


class DriftTally:
    """Per-element sums of the sign errors of a run's compressed steps, closed into windows of steps.

    Call :meth:`add` for each piece of a step's buckets, then :meth:`end_step` once per step;
    :meth:`stats` gives each tensor's :class:`TensorDrift`. Costs three int32 tensors per parameter; the
    counts stay on the tensors' device until a window closes.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.steps = 0
        self._tensors: dict[str, _TensorState] = {}

    def add(self, name: str, numel: int, start: int, exact: torch.Tensor, applied: torch.Tensor) -> None:
        """Elements ``[start, start + len(exact))`` of tensor ``name``: exact Lion's direction and the applied one."""
        state = self._tensors.get(name)
        if state is None:
            zeros = torch.zeros(numel, dtype=torch.int32, device=exact.device)
            count = torch.zeros((), dtype=torch.int64, device=exact.device)
            state = _TensorState(zeros, zeros.clone(), zeros.clone(), count, count.clone(), count.clone())
            self._tensors[name] = state
        end = start + exact.numel()
        exact_sign = torch.sign(exact).to(torch.int32)
        error = torch.sign(applied).to(torch.int32) - exact_sign
        state.err_sum[start:end] += error
        state.exact_sum[start:end] += exact_sign
        state.err_l1 += error.abs().sum()
        flipped = (error.abs() == 2).to(torch.int32)
        run = state.run[start:end]
        state.flips += flipped.sum()
        state.flip_runs += ((run == 0) & (flipped == 1)).sum()  # a run starts
        run.add_(flipped).mul_(flipped)

    def add_bucket(
        self, bucket: list[Piece], names: list[str], numels: list[int], exact: torch.Tensor, applied: torch.Tensor
    ) -> None:
        """A bucket's pieces (concatenated in ``exact`` and ``applied``), piece k under tensor ``names[k]`` of
        ``numels[k]`` elements."""
        sizes = [piece.length for piece in bucket]
        for piece, name, numel, exact_piece, applied_piece in zip(
            bucket, names, numels, exact.split(sizes), applied.split(sizes), strict=True
        ):
            self.add(name, numel, piece.start, exact_piece, applied_piece)

    def end_step(self) -> None:
        """Count the step; close the window when it is full."""
        self.steps += 1
        if self.steps % self.window:
            return
        for state in self._tensors.values():
            state.windows.append(
                WindowDrift(
                    err_l1=int(state.err_l1),
                    drift_l1=int(state.err_sum.abs().sum()),
                    exact_l1=int(state.exact_sum.abs().sum()),
                )
            )
            state.err_sum.zero_()
            state.exact_sum.zero_()
            state.err_l1.zero_()

    def stats(self) -> list[TensorDrift]:
        return [
            TensorDrift(
                name=name,
                numel=state.err_sum.numel(),
                steps=self.steps,
                flips=int(state.flips),
                flip_runs=int(state.flip_runs),
                windows=tuple(state.windows),
            )
            for name, state in self._tensors.items()
        ]


def overall(drifts: list[TensorDrift]) -> TensorDrift:
    """Every tensor's sums added up: the whole model's drift as one tensor named ``"all"``."""
    windows = min((len(d.windows) for d in drifts), default=0)
    return TensorDrift(
        name="all",
        numel=sum(d.numel for d in drifts),
        steps=max((d.steps for d in drifts), default=0),
        flips=sum(d.flips for d in drifts),
        flip_runs=sum(d.flip_runs for d in drifts),
        windows=tuple(
            WindowDrift(
                err_l1=sum(d.windows[w].err_l1 for d in drifts),
                drift_l1=sum(d.windows[w].drift_l1 for d in drifts),
                exact_l1=sum(d.windows[w].exact_l1 for d in drifts),
            )
            for w in range(windows)
        ),
    )


__all__ = [
    "DEFAULT_WINDOW",
    "DriftTally",
    "TensorDrift",
    "WindowDrift",
    "drift_ratio_of",
    "overall",
    "persistence_of",
]

"""A step taken in parts, and ``step()`` calls that only create state: how callers that step the parameters
in several calls (DeepSpeed's ZeRO) or once on zeros (its mixed-precision wrapper) tell
:class:`~ds_lioncub.optimizer.LionCub` so."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ds_lioncub.errors import LionCubSetupError


@dataclass
class StepInParts:
    """The optimizer step that ``step()`` calls are parts of (:meth:`LionCub.optimizer_step_in_parts`)."""

    step: int
    taken: int = 0


class SteppedInParts:
    """:class:`~ds_lioncub.optimizer.LionCub`'s blocks that change what a ``step()`` call is (a base class of
    LionCub: the attributes below are LionCub's)."""

    param_groups: list[dict[str, Any]]
    #: Inside :meth:`initialising_states`: ``step()`` only creates state.
    _states_only: bool
    #: Inside :meth:`optimizer_step_in_parts`: the step every ``step()`` call is a part of (None outside).
    _parts: StepInParts | None
    #: Inside :meth:`bucket_keys_from`: the number the first tensor of a ``step()`` call has in bucket keys.
    _first_key_tensor: int

    @contextmanager
    def initialising_states(self) -> Iterator[None]:
        """Within this block ``step()`` only creates optimizer state and changes nothing.

        DeepSpeed's fp16/bf16 wrapper calls ``step()`` once on zero gradients to create the state;
        for Lion Cub a real step would move every parameter by lr (a zero vote is a tie).
        """
        self._states_only = True
        try:
            yield
        finally:
            self._states_only = False

    @contextmanager
    def optimizer_step_in_parts(self) -> Iterator[None]:
        """Within this block every ``step()`` call is one part of a single optimizer step.

        For callers that step the parameters in several calls, each with only some of them in
        ``param_groups`` (DeepSpeed's ZeRO-3 steps one flat sub-group per call). Every part runs with
        the same step number, so the tie rule is the step's; each part does its own tensors' work (the
        vote, the post-step hooks on its tensors, one telemetry record). The step count advances once,
        when the block ends after at least one part; a block in which no part ran (a skipped step) or
        that raised leaves it as it was.
        """
        if self._parts is not None:
            raise LionCubSetupError("LionCub: optimizer_step_in_parts() blocks do not nest; end the first one.")
        parts = StepInParts(self.param_groups[0]["step"] + 1 if self.param_groups else 1)
        self._parts = parts
        try:
            yield
        finally:
            self._parts = None
        if parts.taken:
            for group in self.param_groups:
                group["step"] = parts.step

    @contextmanager
    def bucket_keys_from(self, first_tensor: int) -> Iterator[None]:
        """Within this block the tensors of a ``step()`` call are numbered from ``first_tensor`` in the bucket
        keys under which error feedback keeps its state (:attr:`~ds_lioncub.aggregation.Bucket.key`).

        For callers that step the parameters in several calls per optimizer step (DeepSpeed's ZeRO-1/2
        steps each param group in its own call, every call's tensors then numbered from 0): numbering each
        call's tensors after the earlier calls' keeps each tensor's state its own.
        """
        before, self._first_key_tensor = self._first_key_tensor, first_tensor
        try:
            yield
        finally:
            self._first_key_tensor = before


__all__ = ["StepInParts", "SteppedInParts"]

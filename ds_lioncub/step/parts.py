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
    """The optimizer step that ``step()`` calls are parts of (:meth:`StepCalls.optimizer_step_in_parts`)."""

    step: int
    taken: int = 0


class StepCalls:
    """The blocks that change what a ``step()`` call of :class:`~ds_lioncub.optimizer.LionCub` is (its methods of
    the same names hand over to these)."""

    def __init__(self) -> None:
        #: Inside :meth:`initialising_states`: ``step()`` only creates state.
        self.states_only = False
        #: Inside :meth:`optimizer_step_in_parts`: the step every ``step()`` call is a part of (None outside).
        self.parts: StepInParts | None = None
        #: Inside :meth:`bucket_keys_from`: the number the first tensor of a ``step()`` call has in bucket keys.
        self.first_key_tensor = 0

    @property
    def in_parts(self) -> bool:
        """Whether a ``step()`` call now is one part of a step (not the whole gradient)."""
        return self.parts is not None or self.first_key_tensor != 0

    @contextmanager
    def initialising_states(self) -> Iterator[None]:
        """Within this block ``step()`` only creates optimizer state and changes nothing.

        DeepSpeed's fp16/bf16 wrapper calls ``step()`` once on zero gradients to create the state;
        for Lion Cub a real step would move every parameter by lr (a zero vote is a tie).
        """
        self.states_only = True
        try:
            yield
        finally:
            self.states_only = False

    @contextmanager
    def optimizer_step_in_parts(self, param_groups: list[dict[str, Any]]) -> Iterator[None]:
        """Within this block every ``step()`` call is one part of a single optimizer step.

        For callers that step the parameters in several calls, each with only some of them in
        ``param_groups`` (DeepSpeed's ZeRO-3 steps one flat sub-group per call). Every part runs with
        the same step number, so the tie rule is the step's; each part does its own tensors' work (the
        vote, the post-step hooks on its tensors, one telemetry record). The step count advances once,
        when the block ends after at least one part; a block in which no part ran (a skipped step) or
        that raised leaves it as it was.
        """
        if self.parts is not None:
            raise LionCubSetupError("LionCub: optimizer_step_in_parts() blocks do not nest; end the first one.")
        parts = StepInParts(param_groups[0]["step"] + 1 if param_groups else 1)
        self.parts = parts
        try:
            yield
        finally:
            self.parts = None
        if parts.taken:
            for group in param_groups:
                group["step"] = parts.step

    @contextmanager
    def bucket_keys_from(self, first_tensor: int) -> Iterator[None]:
        """Within this block the tensors of a ``step()`` call are numbered from ``first_tensor`` in the bucket
        keys under which error feedback keeps its state (:attr:`~ds_lioncub.aggregation.Bucket.key`).

        For callers that step the parameters in several calls per optimizer step (DeepSpeed's ZeRO-1/2
        steps each param group in its own call, every call's tensors then numbered from 0): numbering each
        call's tensors after the earlier calls' keeps each tensor's state its own.
        """
        before, self.first_key_tensor = self.first_key_tensor, first_tensor
        try:
            yield
        finally:
            self.first_key_tensor = before


__all__ = ["StepCalls", "StepInParts"]

"""Who a rank's step communicates with, and what the caller hands it: :class:`Wiring`, one object shared by the
parts of the step that need it (:class:`~ds_lioncub.step.clipping.ClipState`,
:class:`~ds_lioncub.step.rank_step.RankStep`)."""

from __future__ import annotations

from dataclasses import dataclass

from ds_lioncub.comm.transport import Summing, Transport


@dataclass
class Wiring:
    """Who a rank's step communicates with, and what the caller hands it; :meth:`~ds_lioncub.LionCub.bind` changes
    it (through :meth:`~ds_lioncub.step.rank_step.RankStep.rewire`).

    Attributes:
        transport: the voters' group.
        agreement_transport: the ranks whose finite checks must agree: the voters, or the whole world under the
            ZeRO hybrid.
        agreement_sum: the same ranks' per-step sums (the finite check, the sketch), one all-reduce or one per
            level (:mod:`ds_lioncub.comm.transport.levels`).
        gradients_are_averaged: the caller averages the gradients before the step (DeepSpeed's engine with
            compression "none"), so no voter's own gradient is seen.
        params_are_replicas: every voter holds the same parameters (the replica check compares them).
        clip_shard: which shard's signs this rank's sketch draws (:func:`~ds_lioncub.step.clipping.clip_shard_of`).
    """

    transport: Transport
    agreement_transport: Transport
    agreement_sum: Summing
    gradients_are_averaged: bool = False
    params_are_replicas: bool = True
    clip_shard: int = 0


__all__ = ["Wiring"]

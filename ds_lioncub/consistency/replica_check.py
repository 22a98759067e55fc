"""Replica checksums: every few steps, confirm that all ranks hold bitwise identical parameters.

Every LionCub mode keeps the replicas bitwise identical; if they ever differ (faulty memory or
network, a non-deterministic kernel, user code that changed a parameter on one rank), training goes
on silently on diverged models. The check sums each parameter's bits as integers (one read pass, no
temporary the size of the model), folds the sums into one 64-bit digest, and all-gathers it: 8 bytes
per rank. Only when the digests differ does it gather the per-parameter sums to name the first
parameter that differs, on every rank alike.
"""

from __future__ import annotations

import torch

from ds_lioncub.comm.transport import Transport
from ds_lioncub.consistency.fingerprint import gather_texts
from ds_lioncub.errors import LionCubSetupError

_BITS_AS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def parameter_checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the sum of its elements' bit patterns read as integers (wrapping)."""
    sums = [p.detach().reshape(-1).view(_BITS_AS[p.element_size()]).sum(dtype=torch.int64) for p in params]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)


def _digest(checksums: torch.Tensor) -> torch.Tensor:
    # Position-weighted, so that two parameters' differences cannot cancel out.
    weights = torch.arange(1, checksums.numel() + 1, dtype=torch.int64) * 1_000_003
    return (checksums * weights).sum().reshape(1)


def check_replicas(
    transport: Transport,
    params: list[torch.Tensor],
    names: list[str],
    step: int,
    agreement: Transport | None = None,
) -> None:
    """Raise the same :class:`~ds_lioncub.errors.LionCubSetupError` on every rank if the ranks' parameters differ.

    ``transport`` connects the ranks that hold replicas of ``params``. ``agreement``, when it is a
    larger group (the whole world under the ZeRO hybrid, where each vote group compares its own
    shard), hears every group's verdict, so that all of its ranks raise together: a rank that went
    on alone would wait forever in the next collective of its node.
    """
    problem = _replica_problem(transport, params, names, step)
    if agreement is not None and agreement is not transport and agreement.world_size > 1:
        reports = [report for report in gather_texts(agreement, problem) if report]
        problem = reports[0] if reports else ""
    if problem:
        raise LionCubSetupError(problem)


def _replica_problem(transport: Transport, params: list[torch.Tensor], names: list[str], step: int) -> str:
    """The error message when the replicas of ``params`` differ over ``transport``, else ""."""
    if transport.world_size == 1:
        return ""
    checksums = parameter_checksums(params)
    digests = transport.all_gather(_digest(checksums))
    if bool((digests == digests[0]).all()):
        return ""
    rows = transport.all_gather(checksums).view(transport.world_size, -1)
    position = next(i for i in range(rows.size(1)) if bool((rows[:, i] != rows[0, i]).any()))
    groups: dict[int, list[int]] = {}
    for rank in range(transport.world_size):
        groups.setdefault(int(rows[rank, position]), []).append(rank)
    split = " vs ".join(f"ranks {', '.join(map(str, ranks))}" for ranks in groups.values())
    return (
        f"LionCub: the ranks' parameters differ after step {step}, first at {names[position]} ({split} hold "
        f"different values): a replica diverged silently (faulty hardware, a non-deterministic kernel, or code "
        f"that changed parameters on one rank). Resume every rank from the last checkpoint saved before step "
        f"{step}; consistency_check.interval sets how often this is checked."
    )


__all__ = ["check_replicas", "parameter_checksums"]

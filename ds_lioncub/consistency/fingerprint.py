"""Every rank must run the same LionCub: one small all-gather at set-up compares what each rank was built with.

A rank started with other options, another model or another ds_lioncub would otherwise issue
collectives of other sizes or in another order than its peers: the job hangs until a timeout and dies
with transport noise that names nothing. Instead, every rank describes its set-up as labelled
components (the ds_lioncub version, the world, the transport, each option, the parameters' names,
shapes and dtypes in order), all-gathers a fixed-size vector of their digests, and when the vectors
differ every rank raises the same :class:`~ds_lioncub.errors.LionCubConfigError` naming the first
component that differs and what each rank has there. The vector has a fixed size, so even ranks
running different code exchange messages of equal size.

Cost: one all-gather of 512 bytes per rank at set-up (more only on the error path).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from ds_lioncub.comm.transport import Transport
from ds_lioncub.errors import LionCubConfigError

SLOTS = 64  # digests per rank; slot 0 holds the number of components
_MASK = (1 << 63) - 1


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def describe_parameters(names: Sequence[str | None], params: Sequence[torch.Tensor]) -> list[str]:
    """One line per parameter, in optimizer order: name (or position), shape, dtype."""
    return [
        f"{name if name is not None else f'#{position}'} {tuple(param.shape)} {param.dtype}".replace("torch.", "")
        for position, (name, param) in enumerate(zip(names, params, strict=True))
    ]


def _digest_vector(components: Sequence[tuple[str, str]]) -> torch.Tensor:
    """Slot 0: the number of components; then one digest per component."""
    if len(components) >= SLOTS:
        raise ValueError(f"{len(components)} fingerprint components do not fit {SLOTS - 1} slots")
    vector = torch.zeros(SLOTS, dtype=torch.int64)
    vector[0] = len(components)
    for index, (label, text) in enumerate(components):
        vector[index + 1] = _digest(f"{label}={text}")
    return vector


def gather_texts(transport: Transport, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (two all-gathers: the lengths, then the padded bytes)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = transport.all_gather(torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(lengths.max())
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = transport.all_gather(padded).view(transport.world_size, -1)
    return [bytes(rows[rank, : int(lengths[rank])].tolist()).decode() for rank in range(transport.world_size)]


def agreed_text(transport: Transport, what: str, compute: Callable[[], str]) -> str:
    """``compute()``'s text, which every rank must reach alike; else the same error on every rank.

    For a value each rank works out from its own surroundings (its environment variables), where a
    rank that disagrees, or fails, while the others go on would leave them waiting in a collective.
    A :class:`~ds_lioncub.errors.LionCubConfigError` from ``compute`` on any rank is raised on every
    rank, naming the ranks it came from. Two small all-gathers (:func:`gather_texts`).
    """
    try:
        mine = "value " + compute()
    except LionCubConfigError as error:
        mine = "error " + str(error).removeprefix("LionCub: ")
    texts = gather_texts(transport, mine)
    if any(text.startswith("error ") for text in texts):
        failures = [text.removeprefix("error ") for text in texts if text.startswith("error ")]
        ranks = [rank for rank, text in enumerate(texts) if text.startswith("error ")]
        raise LionCubConfigError(
            f"LionCub: {what} could not be worked out on rank(s) {', '.join(map(str, ranks))} of {len(texts)}: "
            f"{failures[0]}"
        )
    if len(set(texts)) > 1:
        values = [text.removeprefix("value ") for text in texts]
        raise LionCubConfigError(
            f"LionCub: the ranks differ in {what}: {_who_has_what(values)}. Start every rank with the same "
            f"settings (the same launcher variables), or set the value in the config."
        )
    return texts[0].removeprefix("value ")


def _who_has_what(values: Sequence[str]) -> str:
    """'rank 0, 2: X; rank 1: Y' (ranks grouped by value, in order of first appearance)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {value}" for value, ranks in groups.items()
    )


def check_same_on_every_rank(
    transport: Transport, components: Sequence[tuple[str, str]], parameters: list[str]
) -> None:
    """Raise the same error on every rank unless every rank has the same ``components`` and ``parameters``.

    ``components`` are (label, value) pairs in a fixed order; ``parameters`` are
    :func:`describe_parameters` lines. Collective over the transport's group.
    """
    if transport.world_size == 1:
        return
    everything = [*components, ("parameters", "\n".join(parameters))]
    table = transport.all_gather(_digest_vector(everything)).view(transport.world_size, SLOTS)
    differing = [slot for slot in range(SLOTS) if bool((table[:, slot] != table[0, slot]).any())]
    if not differing:
        return
    slot = differing[0]
    fix = "Start every rank with the same model, options and ds_lioncub."
    if slot == 0:
        counts = gather_texts(transport, str(len(everything)))
        raise LionCubConfigError(
            f"LionCub: the ranks were set up differently (their set-ups have different shapes: {_who_has_what(counts)} "
            f"components; different ds_lioncub versions?). {fix}"
        )
    label, _ = everything[slot - 1]
    if label != "parameters":
        values = gather_texts(transport, everything[slot - 1][1])
        raise LionCubConfigError(f"LionCub: the ranks differ in {label}: {_who_has_what(values)}. {fix}")
    counts = gather_texts(transport, str(len(parameters)))
    if len(set(counts)) > 1:
        raise LionCubConfigError(
            f"LionCub: the ranks optimize different numbers of parameters ({_who_has_what(counts)}). {fix}"
        )
    per_parameter = torch.tensor([_digest(line) for line in parameters], dtype=torch.int64)
    rows = transport.all_gather(per_parameter).view(transport.world_size, -1)
    position = next(i for i in range(rows.size(1)) if bool((rows[:, i] != rows[0, i]).any()))
    values = gather_texts(transport, parameters[position])
    raise LionCubConfigError(
        f"LionCub: the ranks' models differ at parameter #{position}: {_who_has_what(values)}. {fix}"
    )


__all__ = ["SLOTS", "check_same_on_every_rank", "describe_parameters", "gather_texts"]

"""LionCub's side files in DeepSpeed checkpoints: one momentum file per data-parallel rank.

With compression each rank's momentum differs, and DeepSpeed saves only one rank's optimizer state,
so each rank writes ``lioncub_dp_rank_XXXXX.pt`` (its ``exp_avg`` by flat parameter position and
the world size) into the tag's directory beside DeepSpeed's files, and reads it back on load.

Resharding rule: loaded at the world size it was saved with, rank r reads file r; at another world
size every rank starts from the element-wise mean of all saved momenta (parameters with no saved
state anywhere keep theirs).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.optimizer import LionCub

MOMENTUM_FILE_PREFIX = "lioncub_dp_rank_"


def momentum_file(directory: str, rank: int) -> str:
    """The path of data-parallel rank ``rank``'s momentum file in a tag's directory."""
    return os.path.join(directory, f"{MOMENTUM_FILE_PREFIX}{rank:05d}.pt")


def momentum_files(directory: str) -> list[str]:
    """Every rank's momentum file in a tag's directory, in rank order."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), f"{MOMENTUM_FILE_PREFIX}*.pt")))


def latest_tag(load_dir: str) -> str:
    """The tag DeepSpeed's ``latest`` file names (what ``load_checkpoint(tag=None)`` loads)."""
    with open(os.path.join(load_dir, "latest")) as latest:
        return latest.read().strip()


def momentum_state(optimizer: LionCub) -> dict[str, Any]:
    """This rank's momentum file content: the world size and ``exp_avg`` by flat parameter position."""
    momenta = optimizer.local_momentum_state()
    return {"world_size": optimizer.transport.world_size, "exp_avg": [None if m is None else m.cpu() for m in momenta]}


def save_local_momentum(optimizer: LionCub, save_dir: str, tag: str) -> None:
    """Write this rank's momentum file into ``save_dir/tag`` and wait for every rank to have written."""
    torch.save(momentum_state(optimizer), momentum_file(os.path.join(save_dir, tag), optimizer.transport.rank))
    import deepspeed.comm as ds_dist

    ds_dist.barrier()


def load_local_momentum(optimizer: LionCub, load_dir: str, tag: str | None) -> None:
    """Restore this rank's momentum from ``load_dir/tag`` (``None``: DeepSpeed's latest tag), if saved."""
    files = momentum_files(os.path.join(load_dir, tag if tag is not None else latest_tag(load_dir)))
    if files:
        load_momentum(optimizer, files)


def load_momentum(optimizer: LionCub, files: list[str]) -> None:
    """Restore this rank's momentum from the saved files; from a different world size, their mean."""
    world_size, rank = optimizer.transport.world_size, optimizer.transport.rank
    if len(files) == world_size:
        saved = [torch.load(files[rank], map_location="cpu", weights_only=True)["exp_avg"]]
    else:
        saved = [torch.load(path, map_location="cpu", weights_only=True)["exp_avg"] for path in files]
    counts = sorted({len(momenta) for momenta in saved})
    if len(counts) != 1:
        raise LionCubSetupError(
            f"LionCub: the checkpoint's per-rank momentum files disagree on the number of tensors ({counts}); "
            f"they come from different runs or were damaged. Save the checkpoint again."
        )
    merged: list[torch.Tensor | None] = []
    for position in range(counts[0]):
        values = [momenta[position] for momenta in saved if momenta[position] is not None]
        if not values:
            merged.append(None)
        else:
            merged.append(torch.stack([v.float() for v in values]).mean(dim=0) if len(values) > 1 else values[0])
    optimizer.load_local_momentum(merged)

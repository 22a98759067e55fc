"""LionCub's side files in DeepSpeed checkpoints: one momentum file per data-parallel rank.

With compression each rank's momentum differs, and DeepSpeed saves only one rank's optimizer state,
so each rank writes ``lioncub_dp_rank_XXXXX.pt`` (its ``exp_avg`` by flat parameter position and
the world size) into the tag's directory beside DeepSpeed's files, and reads it back on load.

Resharding rule: loaded at the world size it was saved with, rank r reads file r; at another world
size every rank starts from the element-wise mean of all saved momenta (parameters with no saved
state anywhere keep theirs).

Under the ZeRO hybrid every global rank holds its node's momentum for its own shard, and DeepSpeed's
optimizer files come from node 0 only; each rank writes ``lioncub_hybrid_rank_XXXXX.pt`` (global
rank) with the topology, and loading requires the same topology (M nodes x G ranks): a different
one is refused, naming both.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.integration.hybrid_zero import HybridSetup
from ds_lioncub.optimizer import LionCub

MOMENTUM_FILE_PREFIX = "lioncub_dp_rank_"
HYBRID_FILE_PREFIX = "lioncub_hybrid_rank_"


def momentum_file(directory: str, rank: int, prefix: str = MOMENTUM_FILE_PREFIX) -> str:
    """The path of rank ``rank``'s momentum file in a tag's directory."""
    return os.path.join(directory, f"{prefix}{rank:05d}.pt")


def momentum_files(directory: str, prefix: str = MOMENTUM_FILE_PREFIX) -> list[str]:
    """Every rank's momentum file of one kind in a tag's directory, in rank order."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), f"{prefix}*.pt")))


def latest_tag(load_dir: str) -> str:
    """The tag DeepSpeed's ``latest`` file names (what ``load_checkpoint(tag=None)`` loads)."""
    with open(os.path.join(load_dir, "latest")) as latest:
        return latest.read().strip()


def momentum_state(optimizer: LionCub) -> dict[str, Any]:
    """This rank's momentum file content: the world size and ``exp_avg`` by flat parameter position."""
    momenta = optimizer.local_momentum_state()
    return {"world_size": optimizer.transport.world_size, "exp_avg": [None if m is None else m.cpu() for m in momenta]}


def save_local_momentum(optimizer: LionCub, save_dir: str, tag: str, hybrid: HybridSetup | None = None) -> None:
    """Write this rank's momentum file into ``save_dir/tag`` and wait for every rank to have written."""
    directory = os.path.join(save_dir, tag)
    if hybrid is None:
        torch.save(momentum_state(optimizer), momentum_file(directory, optimizer.transport.rank))
    else:
        layout = hybrid.groups.layout
        state = {**momentum_state(optimizer), "nodes": layout.nodes, "node_size": layout.node_size}
        torch.save(state, momentum_file(directory, dist.get_rank(), HYBRID_FILE_PREFIX))
    import deepspeed.comm as ds_dist

    ds_dist.barrier()


def tag_directory(load_dir: str, tag: str | None) -> str | None:
    """The directory ``load_checkpoint(load_dir, tag)`` reads (``None``: no tag given and no ``latest`` file)."""
    if tag is not None:
        return os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(load_dir, "latest")):
        return None
    return os.path.join(load_dir, latest_tag(load_dir))


def check_saved_layout(load_dir: str, tag: str | None, hybrid: HybridSetup | None) -> None:
    """Refuse, before DeepSpeed reads anything, a checkpoint whose LionCub layout this engine cannot load.

    Under the hybrid DeepSpeed's own ZeRO files are named by the rank inside a node, so at another
    topology DeepSpeed's load fails differently on different ranks (missing files, shape mismatches);
    this check runs first and gives every rank the same message: every rank reads the same file.
    """
    directory = tag_directory(load_dir, tag)
    if directory is None or not os.path.isdir(directory):
        return  # DeepSpeed reports a missing checkpoint itself
    plain, hybrid_files = momentum_files(directory), momentum_files(directory, HYBRID_FILE_PREFIX)
    if hybrid is None:
        if hybrid_files:
            raise LionCubSetupError(
                f"LionCub: {directory} was saved by compressed LionCub under the ZeRO hybrid (files "
                f"{HYBRID_FILE_PREFIX}*), but this engine runs at ZeRO stage 0; resume it under the same ZeRO stage "
                f"and hybrid topology."
            )
        return
    layout = hybrid.groups.layout
    current = f"{layout.nodes} node(s) x {layout.node_size} rank(s)"
    if plain or not hybrid_files:
        raise LionCubSetupError(
            f"LionCub: {directory} holds no ZeRO hybrid momentum files ({HYBRID_FILE_PREFIX}*), so it was not saved by "
            f"compressed LionCub under the hybrid; this engine runs {current}. Resume with the configuration it was "
            f"saved with."
        )
    first = torch.load(hybrid_files[0], map_location="cpu", weights_only=True)
    saved = f"{first['nodes']} node(s) x {first['node_size']} rank(s)"
    if (first["nodes"], first["node_size"]) != (layout.nodes, layout.node_size) or len(
        hybrid_files
    ) != layout.world_size:
        raise LionCubSetupError(
            f"LionCub: {directory} was saved by the ZeRO hybrid as {saved} ({len(hybrid_files)} files), but this "
            f"engine runs {current}; the momenta are per node and per shard, so they cannot be redistributed. "
            f"Resume with hybrid.node_size={first['node_size']} on {first['nodes'] * first['node_size']} ranks."
        )


def load_local_momentum(optimizer: LionCub, load_dir: str, tag: str | None, hybrid: HybridSetup | None = None) -> None:
    """Restore this rank's momentum from ``load_dir/tag`` (``None``: DeepSpeed's latest tag), if saved.

    :func:`check_saved_layout` has accepted the checkpoint before DeepSpeed loaded it.
    """
    directory = tag_directory(load_dir, tag)
    if directory is None:
        return
    if hybrid is None:
        plain = momentum_files(directory)
        if plain:
            load_momentum(optimizer, plain)
        return
    state = torch.load(
        momentum_file(directory, dist.get_rank(), HYBRID_FILE_PREFIX), map_location="cpu", weights_only=True
    )
    optimizer.load_local_momentum(state["exp_avg"])


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

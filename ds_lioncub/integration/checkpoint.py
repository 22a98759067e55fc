"""LionCub's side files in DeepSpeed checkpoints: one momentum file per rank, validated as a set.

With compression each rank's momentum differs, and DeepSpeed saves only one rank's optimizer state,
so each data-parallel rank writes ``lioncub_dp_rank_XXXXX.pt`` into the tag's directory beside
DeepSpeed's files, and reads it back on load. Under the ZeRO hybrid every global rank holds its
node's momentum for its own shard, and DeepSpeed's optimizer files come from node 0 only: each global
rank writes ``lioncub_hybrid_rank_XXXXX.pt``. Under the ZeRO-3 hybrid the shards are the flat tensors of
ZeRO-3's sub-groups (this rank's slice of each parameter), and DeepSpeed's model-state files come from
node 0 only too (their names, by rank in the node, would collide across nodes).

A file holds its format version, the world size, its rank, the LionCub step, the parameter layout
(names, shapes, dtypes in optimizer order), the options the run used, the hybrid topology where there
is one, ``exp_avg`` by flat parameter position, and, with error feedback, ``aggregation``: the rank's
aggregation state (its residuals or EF21 estimates per bucket; absent otherwise), and ``noise_scale``: the
gradient noise scale's moving averages (the same on every rank; ZeRO keeps only per-parameter optimizer state,
so the hybrids would lose them). It is written to a
temporary name and renamed, and every rank's file is complete before DeepSpeed's own save starts, so
DeepSpeed's ``latest`` only ever names a tag whose LionCub set is complete (a save interrupted part-way
leaves ``latest`` at the previous tag).

Loading validates the whole set before DeepSpeed reads anything, and every rank reaches the same
verdict (the ranks exchange what they found): a missing, truncated or unreadable file, a file from
another run or another world size, a parameter layout that changed, or a hybrid topology that
changed is refused with :class:`~ds_lioncub.errors.LionCubSetupError` naming the files and what is
wrong. What may change across a resume: lr and its schedule, betas, weight decay, the compression
mode and its options, bucket size (the momenta are the same kind of tensor in every mode). What may
not: the parameter layout, and the hybrid topology (M nodes x G ranks, and ZeRO-3 or ZeRO-1/2 shards).

Resharding rule (per-rank files): loaded at the world size it was saved with, rank r reads file r; at
another world size, and only from a complete set, every rank starts from the element-wise mean of all
saved momenta (parameters with no saved state anywhere keep theirs). Files written by ds_lioncub
0.1.0 (no format field) are read without the layout checks. The aggregation state is restored only at the
world size it was saved with and under the same error-feedback knobs; otherwise error feedback starts
over from zeros (rank 0 logs why), as at a change of topology (docs/design.md, section 4.8).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.transport import make_transport
from ds_lioncub.consistency.fingerprint import gather_texts
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.integration.hybrid_zero import HybridSetup
from ds_lioncub.optimizer import LionCub
from ds_lioncub.step.local_state import NOISE_SCALE_KEY

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


FORMAT = 2
_TEMPORARY_SUFFIX = ".tmp"  # the temporary name keeps "lioncub" in it, so it is recognisable


def momentum_state(optimizer: LionCub, rank: int, hybrid: HybridSetup | None = None) -> dict[str, Any]:
    """This rank's momentum file content (see the module docstring)."""
    momenta = optimizer.engine_side.local_momentum_state()
    state: dict[str, Any] = {
        "format": FORMAT,
        "world_size": dist.get_world_size() if hybrid is not None else optimizer.transport.world_size,
        "rank": rank,
        "step": optimizer.param_groups[0]["step"] if optimizer.param_groups else 0,
        "parameters": optimizer.engine_side.parameter_layout(),
        "options": repr(optimizer.options.model_dump()),  # what the run used; options may change across a resume
        "exp_avg": [None if m is None else m.cpu() for m in momenta],
    }
    aggregation = optimizer.engine_side.aggregation_state()
    if aggregation is not None:
        state["aggregation"] = aggregation
    state[NOISE_SCALE_KEY] = optimizer.engine_side.noise_scale_state()
    if hybrid is not None:
        state.update(
            nodes=hybrid.groups.layout.nodes, node_size=hybrid.groups.layout.node_size, zero_stage=hybrid.zero_stage
        )
    return state


def save_local_momentum(optimizer: LionCub, save_dir: str, tag: str, hybrid: HybridSetup | None = None) -> None:
    """Write this rank's momentum file into ``save_dir/tag`` atomically; return when every rank has written.

    Call it before DeepSpeed's own save, which writes ``latest`` last.
    """
    directory = os.path.join(save_dir, tag)
    os.makedirs(directory, exist_ok=True)
    if hybrid is None:
        rank, prefix = optimizer.transport.rank, MOMENTUM_FILE_PREFIX
    else:
        rank, prefix = dist.get_rank(), HYBRID_FILE_PREFIX
    path = momentum_file(directory, rank, prefix)
    torch.save(momentum_state(optimizer, rank, hybrid), path + _TEMPORARY_SUFFIX)
    os.replace(path + _TEMPORARY_SUFFIX, path)
    import deepspeed.comm as ds_dist

    ds_dist.barrier()


def tag_directory(load_dir: str, tag: str | None) -> str | None:
    """The directory ``load_checkpoint(load_dir, tag)`` reads (``None``: no tag given and no ``latest`` file)."""
    if tag is not None:
        return os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(load_dir, "latest")):
        return None
    return os.path.join(load_dir, latest_tag(load_dir))


class _Problems(Exception):
    """What one rank found wrong with the saved set (collected, then agreed on by every rank)."""


def _first_sentence(text: str, limit: int = 200) -> str:
    """The first sentence of ``text`` (torch's load errors go on for several), shortened at a word if still long."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    sentence = line.split(". ", 1)[0].rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " ..."
    return sentence


def _read(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or damaged file: torch's own message names neither
        # Its first sentence says what failed; the rest is advice about weights_only or corruption in general.
        detail = _first_sentence(str(error)) or type(error).__name__
        raise _Problems(f"{os.path.basename(path)} is truncated or unreadable ({detail})") from None
    if not isinstance(state, dict) or "exp_avg" not in state or "world_size" not in state:
        raise _Problems(f"{os.path.basename(path)} is not a LionCub momentum file")
    return state


def _check_file(state: dict[str, Any], path: str, rank: int, world_size: int, layout: list[str]) -> None:
    """Raise _Problems unless the file is rank ``rank``'s of a ``world_size``-rank save of this model."""
    name = os.path.basename(path)
    if state["world_size"] != world_size or state.get("rank", rank) != rank:
        raise _Problems(
            f"{name} comes from another run (it says rank {state.get('rank', '?')} of {state['world_size']}, "
            f"the set is {world_size} files)"
        )
    if "parameters" in state and state["parameters"] != layout:
        saved, now = state["parameters"], layout
        if len(saved) != len(now):
            difference = f"{len(saved)} parameters saved, {len(now)} now"
        else:
            position = next(i for i, (a, b) in enumerate(zip(saved, now, strict=True)) if a != b)
            difference = f"parameter #{position} was {saved[position]}, is {now[position]}"
        raise _Problems(f"{name} was saved for another model ({difference})")
    if len(state["exp_avg"]) != len(layout):
        raise _Problems(f"{name} holds {len(state['exp_avg'])} momenta for {len(layout)} parameters")


@dataclass(frozen=True)
class RankRestore:
    """What :func:`prepare_load` found for this rank: its momenta, and its aggregation state (None: not saved,
    or saved at another world size: error feedback starts over)."""

    momenta: list[torch.Tensor | None]
    aggregation: dict[str, Any] | None = None
    #: Why no aggregation state comes back although one may have been saved ("" otherwise).
    aggregation_dropped: str = ""
    #: The gradient noise scale's moving averages (None: saved by 0.2.0 or older).
    noise_scale: dict[str, float | int] | None = None


def _momenta_to_restore(optimizer: LionCub, directory: str, hybrid: HybridSetup | None) -> RankRestore | None:
    """This rank's momenta (and aggregation state) from a validated set (None: no LionCub files); raises _Problems."""
    plain, hybrid_files = momentum_files(directory), momentum_files(directory, HYBRID_FILE_PREFIX)
    if hybrid is None and hybrid_files:
        raise _Problems(
            f"the tag was saved by compressed LionCub under the ZeRO hybrid ({HYBRID_FILE_PREFIX}* files), but this "
            f"engine runs at ZeRO stage 0; resume under the same ZeRO stage and hybrid topology"
        )
    if hybrid is not None and (plain or not hybrid_files):
        topology = hybrid.groups.layout
        raise _Problems(
            f"the tag holds no ZeRO hybrid momentum files ({HYBRID_FILE_PREFIX}*), so it was not saved by compressed "
            f"LionCub under the hybrid, and this engine runs {topology.nodes} node(s) x {topology.node_size} rank(s); "
            f"resume with the configuration it was saved with"
        )
    files, prefix = (plain, MOMENTUM_FILE_PREFIX) if hybrid is None else (hybrid_files, HYBRID_FILE_PREFIX)
    if not files:
        return None  # nothing LionCub-specific was saved (e.g. by compression "none")
    read: dict[str, dict[str, Any]] = {}  # every file is read at most once

    def state_of(path: str) -> dict[str, Any]:
        if path not in read:
            read[path] = _read(path)
        return read[path]

    first = state_of(files[0])
    saved_world = int(first["world_size"])
    expected = [momentum_file(directory, rank, prefix) for rank in range(saved_world)]
    missing = [os.path.basename(path) for path in expected if path not in files]
    foreign = [os.path.basename(path) for path in files if path not in expected]
    if missing or foreign:
        raise _Problems(
            f"the set of {prefix}* files is incomplete or mixed: saved by {saved_world} ranks"
            + (f", missing {', '.join(missing)}" if missing else "")
            + (f", not part of it: {', '.join(foreign)}" if foreign else "")
        )
    layout = optimizer.engine_side.parameter_layout()
    if hybrid is not None:
        saved_zero3, zero3 = int(first.get("zero_stage", 2)) == 3, hybrid.zero_stage == 3
        if saved_zero3 != zero3:
            raise _Problems(
                f"it was saved by the {_hybrid_kind(saved_zero3)} hybrid, but this engine runs the "
                f"{_hybrid_kind(zero3)} hybrid, whose shards hold other elements; resume at the ZeRO stage it was "
                f"saved with"
            )
        current = hybrid.groups.layout
        saved = (first.get("nodes"), first.get("node_size"))
        if saved != (current.nodes, current.node_size):
            raise _Problems(
                f"it was saved by the ZeRO hybrid as {saved[0]} node(s) x {saved[1]} rank(s), but this engine runs "
                f"{current.nodes} node(s) x {current.node_size} rank(s); the momenta are per node and per shard, so "
                f"they cannot be redistributed. Resume with hybrid.node_size={saved[1]} on "
                f"{(saved[0] or 0) * (saved[1] or 0)} ranks"
            )
    rank = dist.get_rank() if hybrid is not None else optimizer.transport.rank
    if hybrid is not None or saved_world == optimizer.transport.world_size:  # each rank its own file
        own = state_of(expected[rank])
        _check_file(own, expected[rank], rank, saved_world, layout)
        return RankRestore(list(own["exp_avg"]), own.get("aggregation"), noise_scale=own.get(NOISE_SCALE_KEY))
    states = []
    for saved_rank, path in enumerate(expected):
        state = state_of(path)
        _check_file(state, path, saved_rank, saved_world, layout)
        states.append(state["exp_avg"])
    dropped = ""
    if any("aggregation" in state_of(path) for path in expected):
        dropped = (
            f"it was saved by {saved_world} ranks and this world has {optimizer.transport.world_size}; the "
            f"feedback state is each rank's own, in its world's chunks, and is not resharded"
        )
    # The noise scale's averages are the same in every file; they are per voter batch, so they hold in any world.
    return RankRestore(_mean_momenta(states), None, dropped, first.get(NOISE_SCALE_KEY))


def _hybrid_kind(zero3: bool) -> str:
    return "ZeRO-3" if zero3 else "ZeRO-1/2"


def _mean_momenta(saved: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """The resharding rule: per parameter, the element-wise mean of the saved ranks' momenta."""
    merged: list[torch.Tensor | None] = []
    for position in range(len(saved[0])):
        values = [value for momenta in saved if (value := momenta[position]) is not None]
        if not values:
            merged.append(None)
        else:
            merged.append(torch.stack([v.float() for v in values]).mean(dim=0) if len(values) > 1 else values[0])
    return merged


def prepare_load(optimizer: LionCub, load_dir: str, tag: str | None, hybrid: HybridSetup | None) -> RankRestore | None:
    """Validate the saved LionCub set before DeepSpeed reads the checkpoint; this rank's momenta to restore after.

    Collective over the world: the ranks exchange what they found, and if any found a problem every rank
    raises the same :class:`~ds_lioncub.errors.LionCubSetupError`. ``None``: nothing to restore.
    """
    directory = tag_directory(load_dir, tag)
    if directory is None or not os.path.isdir(directory):
        return None  # DeepSpeed reports a missing checkpoint itself
    momenta: RankRestore | None = None
    try:
        momenta = _momenta_to_restore(optimizer, directory, hybrid)
        found = ""
    except _Problems as problem:
        found = str(problem)
    # Over DeepSpeed's world (torch.distributed), which every rank that loads the checkpoint belongs to.
    reports = gather_texts(make_transport(None, comm_backend_name="torch"), found) if dist.is_initialized() else [found]
    problems: dict[str, list[int]] = {}
    for rank, report in enumerate(reports):
        if report:
            problems.setdefault(report, []).append(rank)
    if problems:
        listed = "; ".join(
            f"{report} (found by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            for report, ranks in problems.items()
        )
        raise LionCubSetupError(
            f"LionCub: cannot resume from {directory}: {listed}. Nothing was loaded. Resume from a complete "
            f"checkpoint of this model (another tag), or start without load_checkpoint."
        )
    return momenta


def restore(optimizer: LionCub, found: RankRestore) -> None:
    """Load what :func:`prepare_load` found into ``optimizer`` (after DeepSpeed's own load); logs on rank 0 when
    the optimizer has error feedback and its saved state could not be taken (it starts over from zeros)."""
    optimizer.engine_side.load_local_momentum(found.momenta)
    if found.noise_scale is not None:
        optimizer.engine_side.load_noise_scale_state(found.noise_scale)
    if optimizer.options.error_feedback is None:
        return
    why = found.aggregation_dropped or optimizer.engine_side.load_aggregation_state(found.aggregation)
    first = dist.get_rank() == 0 if dist.is_initialized() else optimizer.transport.rank == 0  # the world's, hybrid too
    if why and first:
        get_logger().warning(f"LionCub: error feedback starts over from zeros after this resume: {why}")


__all__ = [
    "FORMAT",
    "HYBRID_FILE_PREFIX",
    "MOMENTUM_FILE_PREFIX",
    "RankRestore",
    "momentum_file",
    "momentum_files",
    "momentum_state",
    "prepare_load",
    "restore",
    "save_local_momentum",
]

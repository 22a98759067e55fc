"""LionCub as a DeepSpeed optimizer: ``"optimizer": {"type": "LionCub", "params": {...}}``.

:func:`register` (run by ``import ds_lioncub``) hooks five DeepSpeedEngine methods, each wrapper
doing nothing unless the engine's optimizer is a LionCub:

- ``_configure_basic_optimizer``: builds LionCub from the ds_config params (validated by the same
  model as the Python API) over the engine's data-parallel group, with the engine's module for names;
- ``_do_optimizer_sanity_check`` (runs after the basic optimizer exists, before any wrapper): wires a
  LionCub however it was made (config, object or callable): process group, names, who communicates
  (with compression the engine's gradient all-reduce is switched off), and refuses compressed modes
  under ZeRO, before training starts;
- ``_configure_fp16_optimizer``: the fp16/bf16 wrapper's state-creating dummy step must not move
  the parameters;
- ``save_checkpoint`` / ``load_checkpoint``: with compression each rank's momentum differs, so each
  data-parallel rank writes its own ``lioncub_dp_rank_XXXXX.pt`` beside DeepSpeed's files and reads
  it back. Loaded with a different world size, every rank starts from the mean of the saved momenta.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Callable
from typing import Any

import torch

from ds_lioncub.config import LionCubConfigError, parse_config
from ds_lioncub.optimizer import LionCub

OPTIMIZER_NAME = "lioncub"
_MOMENTUM_FILE = "lioncub_dp_rank_{rank:05d}.pt"
_WRAPPED_MARK = "_lioncub_original"


def find_lioncub(optimizer: Any) -> LionCub | None:
    """The LionCub inside ``optimizer`` or any of DeepSpeed's wrappers around it."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, LionCub):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def _wrap(cls: type, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    current = getattr(cls, name)
    if hasattr(current, _WRAPPED_MARK):
        return
    wrapper = functools.wraps(current)(make_wrapper(current))
    setattr(wrapper, _WRAPPED_MARK, current)
    setattr(cls, name, wrapper)


def register() -> None:
    """Make ``"type": "LionCub"`` known to DeepSpeed. Idempotent; other optimizers are untouched."""
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import utils as zero_utils

    if OPTIMIZER_NAME not in ds_config.DEEPSPEED_OPTIMIZERS:
        ds_config.DEEPSPEED_OPTIMIZERS.append(OPTIMIZER_NAME)
    # Exact Lion (compression "none") on ZeRO's flat fp32 partitions is tested here.
    if LionCub not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(LionCub)

    _wrap(DeepSpeedEngine, "_configure_basic_optimizer", _wrap_configure_basic_optimizer)
    _wrap(DeepSpeedEngine, "_do_optimizer_sanity_check", _wrap_optimizer_sanity_check)
    _wrap(DeepSpeedEngine, "_configure_fp16_optimizer", _wrap_configure_fp16_optimizer)
    _wrap(DeepSpeedEngine, "save_checkpoint", _wrap_save_checkpoint)
    _wrap(DeepSpeedEngine, "load_checkpoint", _wrap_load_checkpoint)


def _wrap_configure_basic_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_basic_optimizer(engine: Any, model_parameters: Any) -> Any:
        if engine.optimizer_name() != OPTIMIZER_NAME:
            return original(engine, model_parameters)
        params = dict(engine.optimizer_params() or {})
        parse_config(params)  # the same message on every rank, before anything is allocated
        if model_parameters is None:
            model_parameters = engine.module.parameters()
        return LionCub(model_parameters, process_group=engine.seq_data_parallel_group, module=engine.module, **params)

    return configure_basic_optimizer


def _wrap_optimizer_sanity_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_optimizer_sanity_check(engine: Any, basic_optimizer: Any) -> Any:
        if isinstance(basic_optimizer, LionCub):
            wire_engine(engine, basic_optimizer)
        return original(engine, basic_optimizer)

    return do_optimizer_sanity_check


def wire_engine(engine: Any, optimizer: LionCub) -> None:
    """Decide who communicates, and refuse what LionCub cannot do under this engine config."""
    compression = optimizer.options.compression
    stage = int(engine.zero_optimization_stage())
    if compression != "none" and stage >= 1:
        raise LionCubConfigError(
            f"LionCub: compression={compression!r} does not run under ZeRO stage {stage} yet (LionCub's "
            f"votes need every rank's full update, which ZeRO partitions away). Set "
            f"zero_optimization.stage to 0, or use compression='none' (exact Lion, sharded by ZeRO)."
        )
    optimizer.attach(engine.seq_data_parallel_group, engine.module)
    if compression == "none":
        # The engine (or ZeRO) averages the gradients; LionCub applies exact Lion to the result.
        optimizer.gradients_are_averaged = True
    else:
        # LionCub's compressed collectives replace the engine's gradient all-reduce.
        engine.enable_backward_allreduce = False
        optimizer.gradients_are_averaged = False


def _wrap_configure_fp16_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_fp16_optimizer(engine: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        lioncub = find_lioncub(optimizer)
        if lioncub is None:
            return original(engine, optimizer, *args, **kwargs)
        with lioncub.initialising_states():
            return original(engine, optimizer, *args, **kwargs)

    return configure_fp16_optimizer


def _compressed_lioncub(engine: Any) -> LionCub | None:
    lioncub = find_lioncub(getattr(engine, "basic_optimizer", None))
    if lioncub is None or lioncub.options.compression == "none":
        return None
    return lioncub


def _wrap_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        lioncub = _compressed_lioncub(engine)
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default, fixed before saving
        result = original(engine, save_dir, tag, *args, **kwargs)
        if lioncub is not None:
            rank = lioncub.backend.rank
            path = os.path.join(save_dir, str(tag), _MOMENTUM_FILE.format(rank=rank))
            torch.save(momentum_state(lioncub), path)
            import deepspeed.comm as ds_dist

            ds_dist.barrier()
        return result

    return save_checkpoint


def _wrap_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = original(engine, load_dir, tag, *args, **kwargs)
        lioncub = _compressed_lioncub(engine)
        load_path = result[0] if isinstance(result, tuple) else None
        skip_optimizer = kwargs.get("load_module_only", False) or not kwargs.get("load_optimizer_states", True)
        if lioncub is None or load_path is None or skip_optimizer:
            return result
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as latest:
                tag = latest.read().strip()
        files = sorted(glob.glob(os.path.join(load_dir, str(tag), _MOMENTUM_FILE.replace("{rank:05d}", "*"))))
        if files:
            load_momentum(lioncub, files)
        return result

    return load_checkpoint


def momentum_state(optimizer: LionCub) -> dict[str, Any]:
    """This rank's momentum by flat parameter position, for a per-rank checkpoint file."""
    momenta = [optimizer.state[p].get("exp_avg") for p in optimizer._flat_params()]
    return {"world_size": optimizer.backend.world_size, "exp_avg": [None if m is None else m.cpu() for m in momenta]}


def load_momentum(optimizer: LionCub, files: list[str]) -> None:
    """Restore this rank's momentum; from a different world size, the mean of all saved ranks."""
    world_size, rank = optimizer.backend.world_size, optimizer.backend.rank
    if len(files) == world_size:
        saved = [torch.load(files[rank], map_location="cpu", weights_only=True)["exp_avg"]]
    else:
        saved = [torch.load(path, map_location="cpu", weights_only=True)["exp_avg"] for path in files]
    params = optimizer._flat_params()
    if any(len(momenta) != len(params) for momenta in saved):
        raise ValueError(
            f"LionCub: the checkpoint's per-rank momentum files hold {len(saved[0])} tensors but the optimizer "
            f"has {len(params)} parameters; the model or its parameter groups changed since saving."
        )
    for position, param in enumerate(params):
        values = [momenta[position] for momenta in saved if momenta[position] is not None]
        if not values:
            continue
        mean = torch.stack([v.float() for v in values]).mean(dim=0) if len(values) > 1 else values[0]
        state = optimizer.state[param]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg"].copy_(mean.view(param.shape))

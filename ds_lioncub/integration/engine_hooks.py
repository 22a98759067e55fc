"""Registration with DeepSpeed: the optimizer name, ZeRO's list of optimizers, the engine-method wrappers.

- ``_configure_distributed_model`` (runs before DeepSpeed broadcasts rank 0's parameters): with
  ``"type": "LionCub"`` every rank first checks that all ranks built the same model and optimizer
  params, so a mismatch is a clear error on every rank instead of a crash inside the broadcast;
- ``_configure_basic_optimizer``: builds LionCub from the ds_config params (validated by the same
  model as the Python API, once per engine: the model check above parsed them) over the engine's
  data-parallel group, with the engine's module for names, its clipping resolved;
- ``_do_optimizer_sanity_check`` (runs after the basic optimizer exists, before any wrapper): wires a
  LionCub however it was made (config, object or callable) and refuses what cannot run, before
  training starts (:func:`ds_lioncub.integration.wiring.wire_engine`);
- ``_configure_fp16_optimizer``: the fp16/bf16 wrapper's state-creating dummy step must not move
  the parameters;
- ``_configure_zero_optimizer``: under ZeRO stage 1/2 with compression, builds ZeRO inside the node
  (:mod:`ds_lioncub.integration.hybrid_zero`); at stage 3, ZeRO-3 whose sub-group steps are parts of one
  LionCub step, inside the node with compression (:mod:`ds_lioncub.integration.hybrid_zero3`);
- ``_take_model_step``: closes the step's telemetry record (a step DeepSpeed skipped on overflow,
  where LionCub's ``step`` never ran, as skipped) and writes it through the engine's monitor
  (docs/design.md, section 15); with ``overlap=True`` drops the votes of a skipped step;
- ``save_checkpoint`` / ``load_checkpoint``: the per-rank momentum files
  (:mod:`ds_lioncub.integration.checkpoint`); a save between an armed backward and its step is refused;
- ``backward`` (``overlap=True``): the backward of the accumulation boundary is armed
  (``LionCub.overlap_next_backward``).

Wrapping is idempotent (a wrapped method carries its original), so :func:`register` may run twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ds_lioncub._version import __version__
from ds_lioncub.comm.transport import make_transport
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.consistency.fingerprint import check_same_on_every_rank, describe_parameters
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.integration import checkpoint
from ds_lioncub.integration.hybrid_zero import ENGINE_ATTRIBUTE, configure_hybrid_zero
from ds_lioncub.integration.hybrid_zero3 import configure_zero3, flat_groups_visible, node_zero_writes_the_model_states
from ds_lioncub.integration.wiring import (
    CLIP_ATTRIBUTE,
    refuse_before_construction,
    resolve_auto_for_engine,
    resolve_clipping_for_engine,
    wire_engine,
)
from ds_lioncub.modes import mode_of
from ds_lioncub.optimizer import LionCub
from ds_lioncub.telemetry import StepRecord

OPTIMIZER_NAME = "lioncub"
_WRAPPED_MARK = "_lioncub_original"
# The attribute of a DeepSpeedEngine that holds its ds_config's LionCub params and the options parsed from them.
_PARSED_ATTRIBUTE = "_lioncub_parsed_options"


def find_lioncub(optimizer: Any) -> LionCub | None:
    """The LionCub inside ``optimizer`` or any of DeepSpeed's wrappers around it."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, LionCub):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def ds_config_options(engine: Any) -> LionCubConfig:
    """The ds_config's LionCub params, validated: parsed once per engine, by the first hook that reads them (the
    model check, then the optimizer's construction read the same block)."""
    params = dict(engine.optimizer_params() or {})
    parsed = getattr(engine, _PARSED_ATTRIBUTE, None)
    if parsed is None or parsed[0] != params:
        parsed = (params, parse_config(params))
        setattr(engine, _PARSED_ATTRIBUTE, parsed)
    options: LionCubConfig = parsed[1]
    return options


def check_same_model_on_every_rank(model: Any, options: LionCubConfig) -> None:
    """Every rank of the world built the same model (names, shapes, dtypes) and LionCub params, or all raise."""
    named = list(model.named_parameters())
    fields = options.model_dump()  # every field on every rank: the same components
    components = [("ds_lioncub version", __version__), *((f"option {key}", repr(v)) for key, v in fields.items())]
    parameters = describe_parameters([name for name, _ in named], [param for _, param in named])
    # Before LionCub exists, over DeepSpeed's world: torch.distributed, whatever will carry the votes.
    check_same_on_every_rank(make_transport(None, comm_backend_name="torch"), components, parameters)


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
    # ZeRO checks the basic optimizer against this list; exact Lion (compression "none") runs on
    # ZeRO's flat fp32 partitions, and the wiring refuses the compressed modes under ZeRO.
    if LionCub not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(LionCub)

    _wrap(DeepSpeedEngine, "_configure_distributed_model", _wrap_configure_distributed_model)
    _wrap(DeepSpeedEngine, "_configure_basic_optimizer", _wrap_configure_basic_optimizer)
    _wrap(DeepSpeedEngine, "_do_optimizer_sanity_check", _wrap_optimizer_sanity_check)
    _wrap(DeepSpeedEngine, "_configure_fp16_optimizer", _wrap_configure_fp16_optimizer)
    _wrap(DeepSpeedEngine, "_configure_zero_optimizer", _wrap_configure_zero_optimizer)
    _wrap(DeepSpeedEngine, "_take_model_step", _wrap_take_model_step)
    _wrap(DeepSpeedEngine, "save_checkpoint", _wrap_save_checkpoint)
    _wrap(DeepSpeedEngine, "load_checkpoint", _wrap_load_checkpoint)
    _wrap(DeepSpeedEngine, "backward", _wrap_backward)


def _wrap_configure_distributed_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_distributed_model(engine: Any, model: Any) -> Any:
        if engine.optimizer_name() == OPTIMIZER_NAME:
            check_same_model_on_every_rank(model, ds_config_options(engine))
        return original(engine, model)

    return configure_distributed_model


def _wrap_configure_basic_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_basic_optimizer(engine: Any, model_parameters: Any) -> Any:
        if engine.optimizer_name() != OPTIMIZER_NAME:
            return original(engine, model_parameters)
        options = ds_config_options(engine)
        if model_parameters is None:
            model_parameters = engine.module.parameters()
        # "auto" is resolved here, where the engine's ZeRO stage and gradient path are known.
        if mode_of(options).chosen_by_planner:
            model_parameters = list(model_parameters)
            options = resolve_auto_for_engine(engine, options, model_parameters)
        # The same message on every rank, before anything is allocated (an MPI transport would be).
        refuse_before_construction(engine, options)
        # Option clip's max_norm may come from gradient_clipping: resolved once, here (the block as written); the
        # wiring applies this resolution (it switches DeepSpeed's clipping off where LionCub clips).
        clipping = resolve_clipping_for_engine(engine, options)
        # Built to be bound: the wiring's bind() builds the aggregation, once, for the group that votes.
        lioncub = LionCub.from_config(
            model_parameters,
            clipping.options,
            process_group=engine.seq_data_parallel_group,
            module=engine.module,
            bound_later=True,
        )
        setattr(engine, CLIP_ATTRIBUTE, (lioncub, clipping))
        return lioncub

    return configure_basic_optimizer


def _wrap_optimizer_sanity_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_optimizer_sanity_check(engine: Any, basic_optimizer: Any) -> Any:
        if isinstance(basic_optimizer, LionCub):
            wire_engine(engine, basic_optimizer)
        return original(engine, basic_optimizer)

    return do_optimizer_sanity_check


def _wrap_configure_fp16_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_fp16_optimizer(engine: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        lioncub = find_lioncub(optimizer)
        if lioncub is None:
            return original(engine, optimizer, *args, **kwargs)
        with lioncub.engine_side.initialising_states():
            return original(engine, optimizer, *args, **kwargs)

    return configure_fp16_optimizer


def _wrap_configure_zero_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure_zero_optimizer(engine: Any, optimizer: Any) -> Any:
        if _zero3_steps_lioncub(engine, optimizer):
            return configure_zero3(engine, original, optimizer)
        if getattr(engine, ENGINE_ATTRIBUTE, None) is None:
            return original(engine, optimizer)
        return configure_hybrid_zero(engine, original, optimizer)

    return configure_zero_optimizer


def _zero3_steps_lioncub(engine: Any, optimizer: Any) -> bool:
    """Whether ZeRO-3 will step ``optimizer``, a LionCub, on the device (the hybrid, or exact Lion without offload)."""
    if int(engine.zero_optimization_stage()) != 3 or not isinstance(optimizer, LionCub):
        return False
    offload = engine.zero_offload_optimizer()
    offloaded = offload is not None and str(offload.device) != "none"
    return getattr(engine, ENGINE_ATTRIBUTE, None) is not None or not (offloaded or engine.super_offload())


def write_step_telemetry(engine: Any, record: StepRecord) -> None:
    """Write ``record`` through the engine's monitor, as DeepSpeed writes its own ``Train/Samples/`` events.

    Only where the monitor writes: it is enabled and this is global rank 0 (MonitorMaster's writers
    exist there only). The x-axis is ``engine.global_samples``, the engine's own events' step.
    """
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled or engine.global_rank != 0:
        return
    monitor.write_events([(name, value, engine.global_samples) for name, value in record.monitor_events()])


def _wrap_take_model_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def take_model_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        lioncub = find_lioncub(getattr(engine, "basic_optimizer", None) or engine.optimizer)
        if lioncub is None:
            return original(engine, *args, **kwargs)
        # One record per engine step: ZeRO calls LionCub.step once per param group, and not at all when
        # it, or the fp16/bf16 wrapper, skips the step on overflow (then the record says skipped).
        lioncub.telemetry.hold()
        try:
            result = original(engine, *args, **kwargs)
        except BaseException:
            lioncub.telemetry.drop_held()
            raise
        finally:
            # overlap=True: a wrapper that skipped the step (overflow) returned before LionCub.step. Every
            # rank skips together (the wrapper agrees on overflow), so every rank drains the votes here.
            lioncub.discard_overlapped_votes()
        step = lioncub.param_groups[0]["step"]
        write_step_telemetry(engine, lioncub.telemetry.release(step, lioncub.engine_side.take_traffic_before_step()))
        return result

    return take_model_step


def _compressed_lioncub(engine: Any) -> LionCub | None:
    """The engine's LionCub when its ranks' momenta differ (a compressed mode), else None."""
    lioncub = find_lioncub(getattr(engine, "basic_optimizer", None))
    if lioncub is None or mode_of(lioncub.options).exact:
        return None
    return lioncub


def _wrap_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        lioncub = _compressed_lioncub(engine)
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default, fixed before saving
        if lioncub is not None and lioncub.votes_in_flight:
            raise LionCubConfigError(
                "LionCub: save_checkpoint was called between an armed backward (overlap=True) and its step(): "
                "votes are in flight and the momentum is not yet updated. Save after engine.step()."
            )
        if lioncub is not None:
            # First, so that DeepSpeed's latest (written at the end of its save) never names an incomplete set.
            with flat_groups_visible(engine, lioncub):
                checkpoint.save_local_momentum(lioncub, save_dir, str(tag), getattr(engine, ENGINE_ATTRIBUTE, None))
        with node_zero_writes_the_model_states(engine):
            return original(engine, save_dir, tag, *args, **kwargs)

    return save_checkpoint


def _wrap_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        lioncub = _compressed_lioncub(engine)
        if lioncub is not None:
            lioncub.discard_overlapped_votes()  # votes of an armed backward belong to the state being replaced
        hybrid = getattr(engine, ENGINE_ATTRIBUTE, None)
        tag_name = None if tag is None else str(tag)
        skip_optimizer = kwargs.get("load_module_only", False) or not kwargs.get("load_optimizer_states", True)
        momenta = None
        if lioncub is not None and not skip_optimizer:
            with flat_groups_visible(engine, lioncub):  # before DeepSpeed reads anything
                momenta = checkpoint.prepare_load(lioncub, load_dir, tag_name, hybrid)
        result = original(engine, load_dir, tag, *args, **kwargs)
        load_path = result[0] if isinstance(result, tuple) else None
        if lioncub is not None and load_path is not None and momenta is not None:
            with flat_groups_visible(engine, lioncub):
                checkpoint.restore(lioncub, momenta)
        return result

    return load_checkpoint


def _overlapping_lioncub(engine: Any) -> LionCub | None:
    """The engine's LionCub when it starts votes during backward (``overlap=True``), else None."""
    lioncub = _compressed_lioncub(engine)
    return lioncub if lioncub is not None and lioncub.options.overlap else None


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(engine: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        lioncub = _overlapping_lioncub(engine)
        # True during the last micro-step's backward: the engine counts the micro-step in step().
        if lioncub is not None and engine.is_gradient_accumulation_boundary():
            lioncub.overlap_next_backward()
        return original(engine, loss, *args, **kwargs)

    return backward

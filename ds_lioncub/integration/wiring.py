"""Who communicates under each LionCub mode inside a DeepSpeed engine, and what is refused.

- ``compression="none"``: the engine (or ZeRO, any stage) averages the gradients as it always does;
  LionCub applies exact Lion to the mean and communicates nothing itself.
- compressed modes at ZeRO stage 0: LionCub's votes replace the engine's gradient all-reduce, which
  is switched off.
- compressed modes at ZeRO stage 1, 2 or 3: the hybrid (:mod:`ds_lioncub.integration.hybrid_zero`,
  :mod:`ds_lioncub.integration.hybrid_zero3`): ZeRO averages and shards inside each node, LionCub votes
  across nodes.

Every refusal is raised here, before training starts, from values every rank shares, so every rank
raises the same message.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import deepspeed
import torch

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.topology import create_groups, plan_hybrid, resolve_node_size
from ds_lioncub.comm.transport import make_transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.clip_rule import ClipResolution, resolve_clipping
from ds_lioncub.config.rules import hybrid_refusal
from ds_lioncub.consistency.fingerprint import agreed_text
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.integration.hybrid_zero import ENGINE_ATTRIBUTE, HybridSetup, check_node_blocks_on_one_host
from ds_lioncub.integration.hybrid_zero3 import refuse_a_model_partitioned_elsewhere
from ds_lioncub.modes import mode_of
from ds_lioncub.optimizer import LionCub
from ds_lioncub.planner.auto import AUTO_NODE_SIZE_LABEL, auto_node_size, log_auto_resolution, resolve_auto
from ds_lioncub.planner.devices import device_of
from ds_lioncub.planner.model import DEEPSPEED_BUCKET_SIZE

# The hybrid relies on private parts of DeepSpeed's engine and ZeRO optimizers, checked against these releases.
TESTED_DEEPSPEED_MINOR = (0, 19)
# The attribute of a DeepSpeedEngine that holds (the LionCub built from its ds_config, the clipping resolved to build
# it): absent where the caller made the LionCub.
CLIP_ATTRIBUTE = "_lioncub_clip_resolution"


def refuse_before_construction(engine: Any, options: LionCubConfig) -> None:
    """What must be refused before LionCub is built from a ds_config (building it would already communicate)."""
    stage = int(engine.zero_optimization_stage())
    if not mode_of(options).exact and stage in (1, 2, 3) and options.comm_backend_name != "torch":
        raise hybrid_refusal(
            options,
            stage,
            "comm_backend_name='mpi' (the MPI world would have to be the vote group)",
            "use comm_backend_name='torch'",
        )


def resolve_auto_for_engine(engine: Any, options: LionCubConfig, model_parameters: Iterable[Any]) -> LionCubConfig:
    """``compression="auto"`` resolved for this engine (logged on rank 0): its world, ZeRO stage and gradient path.

    Exact Lion would be the engine's own gradient reduction: in its communication dtype, in
    DeepSpeed's buckets (stage 0: the engine's all-reduce buckets; ZeRO: ``reduce_bucket_size``).
    """
    stage = int(engine.zero_optimization_stage())
    exact_dtype = "fp32" if engine.communication_data_type == torch.float32 else "bf16"  # bf16 or fp16: 2 bytes
    bucket = DEEPSPEED_BUCKET_SIZE if stage == 0 else int(engine.zero_reduce_bucket_size())
    # Each rank reads G from its own environment; they must agree before each resolves alone.
    transport = make_transport(engine.seq_data_parallel_group, comm_backend_name="torch")  # the engine's own group
    node_size = int(agreed_text(transport, AUTO_NODE_SIZE_LABEL, lambda: str(auto_node_size(options, os.environ))))
    # Where the optimizer's local work runs: the engine's device (its ranks' GPUs under the CUDA
    # accelerator), or the CPU when ZeRO offloads the optimizer there.
    device = "cpu" if engine.zero_cpu_offload() else device_of(torch.device(engine.device).type)
    resolution = resolve_auto(
        options,
        _count_trained(model_parameters),
        int(engine.seq_dp_world_size),
        node_size,
        stage,
        exact_comm_dtypes=(exact_dtype,),
        exact_bucket_size=bucket,
        device=device,
        default_clip=float(engine.gradient_clipping() or 0.0),
    )
    log_auto_resolution(resolution, int(engine.global_rank))
    return resolution.options


def _count_trained(model_parameters: Iterable[Any]) -> int:
    """Elements that require grad in tensors, (name, tensor) pairs or param-group dicts."""
    total = 0
    for item in model_parameters:
        if isinstance(item, dict):
            total += _count_trained(item["params"])
            continue
        tensor = item[1] if isinstance(item, tuple) else item
        total += tensor.numel() if tensor.requires_grad else 0
    return total


def wire_engine(engine: Any, optimizer: LionCub) -> None:
    """Decide who communicates, and refuse what LionCub cannot do under this engine config."""
    exact = mode_of(optimizer.options).exact
    stage = int(engine.zero_optimization_stage())
    if optimizer.options.hybrid is not None and stage == 0:
        raise LionCubConfigError(
            "LionCub: hybrid applies under ZeRO stage 1, 2 or 3 (shard inside a node, vote across nodes); at stage 0 "
            "every rank is a voter already. Drop hybrid, or set zero_optimization.stage to 1, 2 or 3."
        )
    resolve_engine_clipping(engine, optimizer)
    if exact:
        # Under ZeRO each rank steps its own partition: those are not replicas to compare.
        optimizer.bind(
            engine.seq_data_parallel_group, engine.module, gradients_averaged=True, params_are_replicas=stage == 0
        )
        return
    if stage == 0:
        _refuse_what_overlap_cannot_do(engine, optimizer)
        optimizer.bind(engine.seq_data_parallel_group, engine.module, gradients_averaged=False)
        engine.enable_backward_allreduce = False
        optimizer.set_noise_scale_batch(voter_batch_samples(engine, 1))
        return
    _refuse_what_the_hybrid_cannot_do(engine, optimizer, stage)
    world = engine.seq_data_parallel_group
    world_size = int(engine.seq_dp_world_size)
    node_size, source = resolve_node_size(_node_size_option(optimizer), os.environ)
    layout = plan_hybrid(world_size, node_size)
    setup = HybridSetup(create_groups(layout, int(engine.global_rank)), source, zero_stage=stage)
    if source != "hybrid.node_size":
        check_node_blocks_on_one_host(setup)
    if stage == 3:
        refuse_a_model_partitioned_elsewhere(engine, setup)
    # ZeRO keeps the engine's gradient reduction (inside the node); LionCub votes over the vote group. Its
    # finite check and option clip's sketch agree over the whole world: summed inside the node, then across.
    groups = setup.groups
    optimizer.bind(
        groups.vote_group,
        engine.module,
        gradients_averaged=False,
        agreement_group=world,
        agreement_levels=(groups.node_group, groups.vote_group),
    )
    setattr(engine, ENGINE_ATTRIBUTE, setup)
    optimizer.set_noise_scale_batch(voter_batch_samples(engine, layout.node_size))


def resolve_clipping_for_engine(engine: Any, options: LionCubConfig) -> ClipResolution:
    """Which clipping runs for ``options`` in this engine (:func:`~ds_lioncub.config.clip_rule.resolve_clipping`),
    from its ds_config's ``gradient_clipping`` (written or defaulted) and its ZeRO stage."""
    written = "gradient_clipping" in (getattr(engine._config, "_param_dict", None) or {})
    stage = int(engine.zero_optimization_stage())
    return resolve_clipping(options, float(engine.gradient_clipping() or 0.0), written, stage)


def resolve_engine_clipping(engine: Any, optimizer: LionCub) -> None:
    """Which clipping runs in this engine (:mod:`ds_lioncub.config.clip_rule`): LionCub's options take the resolved
    ``clip``, DeepSpeed's ``gradient_clipping`` becomes 0 where LionCub clips (before the engine builds the fp16/bf16
    or ZeRO wrapper, which read it then), and rank 0 logs the one line that says which clipping runs.

    A LionCub built from the ds_config was built with its clip block resolved as written (the engine hook, which
    keeps that resolution on the engine), so the log line names where the norm came from; one the caller made is
    resolved here."""
    built = getattr(engine, CLIP_ATTRIBUTE, None)
    if built is not None and built[0] is optimizer:
        resolution: ClipResolution = built[1]
    else:
        resolution = resolve_clipping_for_engine(engine, optimizer.options)
    optimizer.options = resolution.options
    engine._config.gradient_clipping = resolution.engine_clipping
    if int(engine.global_rank) == 0:
        get_logger().info(resolution.description)


def _refuse_what_overlap_cannot_do(engine: Any, optimizer: LionCub) -> None:
    """overlap=True at ZeRO stage 0: managed gradient accumulation, and not under torch autocast, for now."""
    if not optimizer.options.overlap:
        return
    if engine.torch_autocast_enabled():
        raise LionCubConfigError(
            "LionCub: overlap=True is not supported with torch_autocast yet (its gradient scaler may skip "
            "LionCub.step in ways not handled). Drop overlap, or use DeepSpeed's bf16/fp16 or fp32 training."
        )
    if not engine.managed_gradient_accumulation():
        raise LionCubConfigError(
            "LionCub: overlap=True arms the backward of the accumulation boundary, which unmanaged gradient "
            "accumulation does not mark. Drop overlap, or let the engine manage gradient accumulation."
        )


def voter_batch_samples(engine: Any, ranks_per_voter: int) -> int:
    """The samples in one voter's gradient each step, for the noise scale in samples: a rank's micro-batch x the
    accumulation steps (the engine averages the micro-batches' gradients), x the ranks whose gradients a voter
    averages (a node's under the ZeRO hybrid; 1 at stage 0)."""
    return int(engine.train_micro_batch_size_per_gpu()) * int(engine.gradient_accumulation_steps()) * ranks_per_voter


def _node_size_option(optimizer: LionCub) -> int | None:
    hybrid = optimizer.options.hybrid
    return None if hybrid is None else hybrid.node_size


def _refuse_what_the_hybrid_cannot_do(engine: Any, optimizer: LionCub, stage: int) -> None:
    """Refuse the features the hybrid does not handle (yet), naming the alternative."""
    refuse_before_construction(engine, optimizer.options)  # also for a LionCub the user built (MPI)
    version = tuple(int(part) for part in deepspeed.__version__.split(".")[:2])
    if version != TESTED_DEEPSPEED_MINOR:
        raise LionCubConfigError(
            f"LionCub: the ZeRO hybrid hooks private parts of DeepSpeed's ZeRO optimizers and was tested with "
            f"DeepSpeed {'.'.join(map(str, TESTED_DEEPSPEED_MINOR))}.x, but {deepspeed.__version__} is installed. "
            f"Install deepspeed=={'.'.join(map(str, TESTED_DEEPSPEED_MINOR))}.8, or run at zero_optimization.stage 0."
        )
    refusals = [
        (
            engine.zero_offload_optimizer() is not None and str(engine.zero_offload_optimizer().device) != "none",
            "optimizer offload",
            "drop zero_optimization.offload_optimizer",
        ),
        (
            engine.zero_offload_param() is not None and str(engine.zero_offload_param().device) != "none",
            "parameter offload",
            "drop zero_optimization.offload_param",
        ),
        (bool(getattr(engine, "zenflow", False)), "ZenFlow", "drop zero_optimization.zenflow"),
        (bool(engine.has_moe_layers), "mixture-of-experts layers", "use zero_optimization.stage 0"),
        (bool(engine.pipeline_parallelism), "pipeline parallelism", "use zero_optimization.stage 0"),
        (engine.mpu is not None, "model, tensor or sequence parallelism (an mpu)", "use zero_optimization.stage 0"),
        (
            bool(engine.zero_elastic_checkpoint()),
            "elastic checkpoints",
            "set zero_optimization.elastic_checkpoint to false",
        ),
        (
            bool(engine.load_universal_checkpoint()),
            "universal checkpoints (they hold node 0's momentum only)",
            "load a regular checkpoint",
        ),
        (optimizer.options.overlap, "overlap (votes started during backward)", "drop overlap"),
        (
            optimizer.options.momentum_sync.interval > 0 and optimizer.options.momentum_sync.layers != "all",
            "momentum_sync by layer (LionCub steps flat ZeRO shards that mix layers)",
            "use momentum_sync.layers='all'",
        ),
    ]
    if stage == 3:
        refusals += _stage3_refusals(engine)
    for refused, what, fix in refusals:
        if refused:
            raise hybrid_refusal(optimizer.options, stage, what, fix)


def _stage3_refusals(engine: Any) -> list[tuple[bool, str, str]]:
    """What the ZeRO-3 hybrid refuses beyond the ZeRO-1/2 hybrid: ZeRO++'s groups span the whole world."""
    return [
        (
            int(engine.zero_hpz_partition_size()) > 1,
            "hpZ (zero_hpz_partition_size > 1: a secondary parameter partition over the whole world's groups)",
            "set zero_optimization.zero_hpz_partition_size to 1 (the hybrid already gathers parameters inside a node)",
        ),
        (
            bool(engine.zero_quantized_gradients()),
            "zero_quantized_gradients (its all-to-all reduces gradients across nodes)",
            "set zero_optimization.zero_quantized_gradients to false",
        ),
        (
            bool(engine.zero_quantized_weights()) or bool(engine.zero_quantized_nontrainable_weights()),
            "zero_quantized_weights / zero_quantized_nontrainable_weights",
            "set both to false",
        ),
        (bool(engine.super_offload()), "SuperOffload", "drop zero_optimization.super_offload"),
    ]

"""LionCub: Lion whose update direction is agreed on by a compressed vote of the workers.

Each rank keeps its own momentum and computes its own pre-sign update ``c``; the ranks then vote on
(or average) ``sign(c)`` through an aggregation (:mod:`ds_lioncub.aggregation`), sending 1-8 bits
per parameter, and every rank applies the same update, so parameters stay bitwise identical. With
``compression="none"`` it is exact Lion on the mean gradient. Lion's equations are in
:mod:`ds_lioncub.lion`. This module keeps the torch.optim surface and orchestrates: set-up, state,
which step path runs (:mod:`ds_lioncub.step.paths`), the overlap controller
(:mod:`ds_lioncub.step.overlap`), the post-step hooks (:mod:`ds_lioncub.step.post_step`) and telemetry.
Four groups of its public methods live beside their machinery, as base classes: a step in parts
(:class:`~ds_lioncub.step.parts.SteppedInParts`), option ``overlap``
(:class:`~ds_lioncub.step.overlap.OverlapControls`), what a checkpoint keeps
(:class:`~ds_lioncub.step.local_state.CheckpointedState`) and option ``clip``
(:class:`~ds_lioncub.step.clipping.ClipControls`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_lioncub.aggregation import Aggregator, build_aggregation
from ds_lioncub.comm.backend import CompressedBackend
from ds_lioncub.comm.quantize import tie_sign
from ds_lioncub.comm.transport import CommStats, LevelledSum, Summing, Transport, make_transport
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.config.clip_rule import refuse_clip_without_norm
from ds_lioncub.errors import LionCubError, LionCubSetupError
from ds_lioncub.planner.auto import AutoResolution
from ds_lioncub.step.bucket_work import check_param_group
from ds_lioncub.step.clipping import ClipControls, clip_shard_of
from ds_lioncub.step.local_state import (
    CheckpointedState,
)
from ds_lioncub.step.noise_scale import NoiseScale, NoiseScaleState
from ds_lioncub.step.overlap import OverlapController, OverlapControls
from ds_lioncub.step.param_selection import names_by_position
from ds_lioncub.step.parts import StepInParts, SteppedInParts
from ds_lioncub.step.paths import StepContext, participants, run_step_path, runs_finite_check
from ds_lioncub.step.post_step import MomentumSync, PostStepHook, ReplicaCheck, StepDone
from ds_lioncub.step.setup import check_same_set_up, log_setting, resolve_auto_at_construction
from ds_lioncub.telemetry import StepRecord, StepTelemetry, TelemetryTotals


class LionCub(SteppedInParts, OverlapControls, CheckpointedState, ClipControls, torch.optim.Optimizer):
    """Lion with local momentum and a 1-bit / k-bit vote over the data-parallel ranks.

    Args:
        params: parameters, ``model.named_parameters()`` (names are needed to select layers for
            momentum sync), or param groups (dicts with "params" and optionally their own "lr",
            "betas", "weight_decay").
        lr, betas, weight_decay: Lion's hyper-parameters, the defaults of every group.
        process_group: the data-parallel group (default: the global torch.distributed group, or a
            world of one when torch.distributed is not initialised).
        module: the model; gives parameter names and lets ``momentum_sync.layers="auto"`` find the
            embeddings and output head.
        **options: see :class:`ds_lioncub.config.LionCubConfig` (compression, bits, quantizer,
            aggregation, kbit_algorithm, tie_break, l1_clip, comm_dtype, bucket_size, check_finite,
            momentum_sync, comm_backend_name, cuda_aware, overlap). :meth:`from_config` takes them
            validated already, as a :class:`~ds_lioncub.config.LionCubConfig`.

    A parameter whose gradient is None on a rank counts as a zero gradient there when the world has
    more than one rank (so every rank runs the same collectives, as DDP does); alone, it is skipped.

    ``options`` holds the options as constructed; the live hyper-parameters are in
    ``param_groups`` (a learning-rate scheduler changes those, not ``options.lr``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        process_group: dist.ProcessGroup | None = None,
        module: nn.Module | None = None,
        _config: LionCubConfig | None = None,
        _bound_later: bool = False,
        **options: Any,
    ) -> None:
        # torch.optim.Optimizer.__init__ calls add_param_group, which must know whether set-up is done.
        self._ready = False
        # _config, _bound_later: from_config's (options parsed once, by the caller; the aggregation built by bind()).
        if _config is not None and options:
            raise TypeError(f"LionCub: options {sorted(options)} given beside options already parsed")
        self.options: LionCubConfig = (
            _config
            if _config is not None
            else parse_config({"lr": lr, "betas": betas, "weight_decay": weight_decay, **options})
        )
        refuse_clip_without_norm(self.options)
        self.module = module
        self.process_group = process_group
        self.transport: Transport = self._make_transport(process_group)
        # The ranks whose finite checks must agree: the voters, unless bind() says more. Their per-step sums (the
        # finite check, option clip's sketch) go through _agreement_sum, which bind() may split into levels.
        self._agreement_transport: Transport = self.transport
        self._agreement_sum: Summing = self.transport
        # Whether the caller (DeepSpeed's engine) hands over gradients it has already averaged.
        self.gradients_are_averaged = False
        # Whether every rank of the group holds the same parameters (the replica check compares them).
        self._params_are_replicas = True
        # Names are kept by flat position (group order, then parameter order): DeepSpeed's
        # mixed-precision wrapper swaps the parameters for fp32 copies in place, which keeps positions
        # but not identities.
        self.param_names: list[str] | None = None
        self._states_only = False
        # Inside optimizer_step_in_parts(): the step every step() call is a part of (None outside).
        self._parts: StepInParts | None = None
        # Inside bucket_keys_from(): the number the first tensor of a step() call has in bucket keys.
        self._first_key_tensor = 0
        # The bucket schedule of compressed steps (step.paths.compressed_step); False runs buckets one by one.
        self._pipelined_buckets = True
        # Option clip: which shard's signs this rank's sketch draws (the voters of one shard share it; bind sets it),
        # the coefficient a caller that steps in parts computed for the whole step, and the last one applied.
        self._clip_shard = clip_shard_of(process_group)
        self._given_clip_coefficient: float | None = None
        # The traffic of collectives a caller issued for the next step before calling it.
        self._traffic_before_step = CommStats()
        #: The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip.
        self.last_clip_coefficient: float | None = None
        # Whether a caller stepping in parts took this step's sketch already (clip_coefficient_given).
        self._sketch_given = False
        # The gradient noise scale's moving averages (option telemetry.noise_scale), fed by the step's sketch.
        self._noise_scale_state = NoiseScaleState(self.options.telemetry.noise_scale_beta)
        # Per-step records (docs/design.md, section 15).
        self.telemetry = StepTelemetry(vote_stats=self.options.telemetry.vote_stats)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults)
        # Before anything that could issue collectives of option-dependent sizes: every rank the same set-up,
        # "auto" included as written (a rank that plans alone would wait in the planner's node-size agreement).
        check_same_set_up(self.transport, self.options, self.param_groups, self.parameter_layout())
        # compression="auto": the planner's mode for this world, the same on every rank (the inputs are);
        # checked again as resolved.
        self.auto_resolution: AutoResolution | None = None
        if self.options.compression == "auto":
            self.auto_resolution = resolve_auto_at_construction(self.options, self.transport, self._flat_params())
            self.options = self.auto_resolution.options
            # The resolution may have turned vote_stats off (exact Lion takes no vote): record what runs.
            self.telemetry = StepTelemetry(vote_stats=self.options.telemetry.vote_stats)
            check_same_set_up(self.transport, self.options, self.param_groups, self.parameter_layout())
        # The aggregation is built once: here, or by bind() when bind() is to follow (from_config's bound_later).
        self._built_aggregator: Aggregator | None = None
        self._aggregation_pending = True
        if not _bound_later:
            self._build_aggregation()
        # What runs after every step, in order (post_step.StepDone): a new per-step duty is a new hook.
        self._momentum_sync = MomentumSync(self.options.momentum_sync)
        self.post_step_hooks: list[PostStepHook] = [self._momentum_sync, ReplicaCheck(self.options.consistency_check)]
        # overlap=True: the vote over a second group that armed backwards launch on, and their state.
        self._overlap = OverlapController()
        self._set_up_overlap()
        self._ready = True
        self._resolve_names()
        # The options as the step runs them, on rank 0, once per (world, aggregation); bind() says it when it builds.
        self._logged_setting: tuple[int, str] | None = None
        if not _bound_later:
            self._logged_setting = log_setting(self.transport, self.options, self._built_aggregator, None)

    @classmethod
    def from_config(
        cls,
        params: Iterable[Any],
        config: LionCubConfig,
        *,
        process_group: dist.ProcessGroup | None = None,
        module: nn.Module | None = None,
        bound_later: bool = False,
    ) -> LionCub:
        """LionCub from options already validated (:func:`~ds_lioncub.config.parse_config`), which are not parsed
        again; lr, betas and weight_decay, the param groups' defaults, are the config's.

        ``bound_later``: :meth:`bind` follows before the first step (the DeepSpeed wiring, which may move the
        votes to another group), so the aggregation is built there, once, for the ranks that vote (a step
        before any bind builds it over ``process_group``).
        """
        return cls(
            params,
            config.lr,
            config.betas,
            config.weight_decay,
            process_group=process_group,
            module=module,
            _config=config,
            _bound_later=bound_later,
        )

    # ------------------------------------------------------------------ set-up

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        current_step = self.param_groups[0]["step"] if self.param_groups else 0
        param_group.setdefault("step", current_step)
        super().add_param_group(param_group)
        try:
            check_param_group(self.param_groups[-1])
        except LionCubError:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        if self._ready:
            self._resolve_names()

    def bind(
        self,
        process_group: dist.ProcessGroup | None,
        module: nn.Module | None,
        *,
        gradients_averaged: bool,
        agreement_group: dist.ProcessGroup | None = None,
        agreement_levels: Sequence[dist.ProcessGroup | None] | None = None,
        params_are_replicas: bool = True,
    ) -> None:
        """Communicate over ``process_group``, take names from ``module``, and say who averages gradients.

        ``gradients_averaged``: the caller averages the gradients before ``step`` (DeepSpeed's engine
        with compression "none"), so exact Lion must not average them again. ``agreement_group``:
        the ranks that must all skip a step together when one has a non-finite gradient, when they
        are more than ``process_group`` (under ZeRO hybrid: the whole world, not just the voters).
        ``agreement_levels``: the same ranks as a grid of groups, this rank's group at each level (``None``: a
        group of one rank), e.g. its node, then its vote group across the nodes: the per-step sums (the finite
        check, option clip's sketch) then run one all-reduce per level (:mod:`ds_lioncub.comm.transport.levels`).
        ``params_are_replicas``: whether the ranks of ``process_group`` hold the same parameters (not so
        when ZeRO hands each rank its own partition of them); the replica check runs only if they do.
        Used by the DeepSpeed wiring; must run while the optimizer still holds the module's own
        parameters, so names resolve. The transport is rebuilt only for a different group (an MPI
        transport's construction is itself a collective).
        """
        self._clip_shard = clip_shard_of(process_group)
        if process_group is not self.process_group:
            self.process_group = process_group
            self.transport = self._make_transport(process_group)
            self._set_up_overlap()
        # The agreement group holds more ranks than the voters (the whole world under the ZeRO hybrid); an MPI
        # transport spans the MPI world, which is the voters' group, so torch.distributed carries the agreement.
        self._agreement_transport = (
            self.transport if agreement_group is None else make_transport(agreement_group, comm_backend_name="torch")
        )
        self._agreement_sum = self._agreement_transport
        if agreement_levels is not None:
            groups = [group for group in agreement_levels if group is not None]
            self._agreement_sum = LevelledSum([make_transport(group, comm_backend_name="torch") for group in groups])
            if self._agreement_sum.world_size != self._agreement_transport.world_size:
                raise LionCubSetupError(
                    f"LionCub: the agreement levels span {self._agreement_sum.world_size} ranks, the agreement group "
                    f"{self._agreement_transport.world_size}; pass levels that tile the agreement group."
                )
        if module is not None:
            self.module = module
        self.gradients_are_averaged = gradients_averaged
        self._params_are_replicas = params_are_replicas
        self._build_aggregation()
        self._resolve_names()
        self._logged_setting = log_setting(self.transport, self.options, self._aggregator, self._logged_setting)

    def attach(self, process_group: dist.ProcessGroup | None, module: nn.Module | None) -> None:
        """Deprecated (removed in 0.3.0): use :meth:`bind`."""
        warnings.warn(
            "LionCub.attach() is deprecated and will be removed in 0.3.0; use LionCub.bind(process_group, module, "
            "gradients_averaged=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        self.bind(process_group, module, gradients_averaged=self.gradients_are_averaged)

    @property
    def backend(self) -> CompressedBackend:
        """Deprecated (removed in 0.3.0): the collectives over :attr:`transport`; use ``transport``."""
        warnings.warn(
            "LionCub.backend is deprecated and will be removed in 0.3.0; use LionCub.transport",
            DeprecationWarning,
            stacklevel=2,
        )
        return CompressedBackend.from_transport(self.transport)

    @property
    def _aggregator(self) -> Aggregator | None:
        """The aggregation the step runs (None: the gradients as they are), built once (:meth:`_build_aggregation`)."""
        if self._aggregation_pending:  # from_config(bound_later=True) and stepped before any bind()
            self._build_aggregation()
        return self._built_aggregator

    @_aggregator.setter
    def _aggregator(self, aggregator: Aggregator | None) -> None:
        self._built_aggregator, self._aggregation_pending = aggregator, False

    def _build_aggregation(self) -> None:
        """The aggregation over the voters' transport, for gradients the caller averages or not: at construction,
        and again by each :meth:`bind`, which may change either."""
        self._aggregator = build_aggregation(self.options, self.transport, self.gradients_are_averaged)

    def _make_transport(self, process_group: dist.ProcessGroup | None) -> Transport:
        return make_transport(process_group, self.options.comm_backend_name, self.options.cuda_aware)

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _resolve_names(self) -> None:
        """Name every parameter (from named params or the module) and select momentum-sync layers."""
        self.param_names = names_by_position(self.param_groups, self.module)
        self._momentum_sync.select(self._flat_params(), self.param_names, self.module)

    # ------------------------------------------------------------------ public helpers

    def comm_stats(self) -> CommStats:
        """Collectives issued and bytes sent / received by this rank's LionCub steps so far (not the set-up check)."""
        stats = self.transport.stats + CommStats()  # a copy: the transport keeps counting
        if self._agreement_transport is not self.transport:  # the world-wide replica verdicts under ZeRO hybrid
            stats = stats + self._agreement_transport.stats
        if self._agreement_sum is not self._agreement_transport:  # the finite check and clip's sketch, in levels
            stats = stats + self._agreement_sum.stats
        return stats + self._overlap.traffic()  # votes started during backward, and those voted again

    @property
    def last_step_telemetry(self) -> StepRecord | None:
        """What the last step did (bytes, collectives, seconds, vote rates); None before the first step."""
        return self.telemetry.last

    @property
    def telemetry_totals(self) -> TelemetryTotals:
        """Sums over every step recorded so far (skipped DeepSpeed steps included)."""
        return self.telemetry.totals

    @property
    def noise_scale(self) -> NoiseScale | None:
        """The job's gradient noise scale so far (option ``telemetry.noise_scale``; docs/user-guide.md, "The gradient
        noise scale"): B_simple in samples and in voter batches, the smoothed |G|^2 and tr(Sigma), the steps
        measured. None before the first measured step, and always with compression "none" or a single voter."""
        return self._noise_scale_state.record()

    def set_noise_scale_batch(self, samples: int | None) -> None:
        """Say how many samples one voter's gradient averages each step (its micro-batch x its accumulation steps;
        x the ranks of a node under the ZeRO hybrid), so that :attr:`noise_scale` gives B_simple in samples. The
        DeepSpeed wiring sets it from the engine; in plain Python it is unknown until set (None: voter batches)."""
        self._noise_scale_state.set_batch_samples(samples)

    @property
    def momentum_synced_parameters(self) -> list[torch.Tensor]:
        """The parameters whose ``exp_avg`` momentum sync averages."""
        return [p for position, p in enumerate(self._flat_params()) if position in self._momentum_sync.positions]

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Lion Cub step: the step path for the aggregation (step.paths), then the post-step hooks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = participants(self.param_groups, self.state, alone=self.transport.world_size == 1)
        if self._states_only:
            return loss
        parts = self._parts
        step = parts.step if parts is not None else self.param_groups[0]["step"] + 1
        positive_ties = tie_sign(step, self.options.tie_break) > 0
        armed = self._overlap.armed
        baseline = self.comm_stats()
        if armed is not None:  # the votes launched during backward are this step's traffic
            baseline = baseline - armed.traffic_since_armed()
        # Option clip's all-reduce, when a caller stepping in parts issued it first, is this step's (first part's).
        baseline, self._traffic_before_step = baseline - self._traffic_before_step, CommStats()
        self.telemetry.begin_step(baseline)
        # Option clip and the noise scale share one sketch, taken before any path reads the gradients (and before
        # the finite check, which may then refuse the step: the noise scale leaves non-finite steps out). Its
        # all-reduce carries the finite check's verdict where the path runs that check (one collective, not two).
        ranks_not_finite = None
        if self.sketches_each_step:
            carry = runs_finite_check(self._aggregator, self._overlap, self.options.check_finite)
            ranks_not_finite = self._clip_gradients(entries, step, carry)
        context = StepContext(
            self.options.bucket_size,
            self._pipelined_buckets,
            self.telemetry,
            self._agreement_sum,
            self.options.check_finite,
            self._flat_params(),
            self.param_names,
            self._first_key_tensor,
            ranks_not_finite,
        )
        run_step_path(entries, step, positive_ties, self._aggregator, self.transport, self._overlap, context)
        if parts is None:
            for group in self.param_groups:
                group["step"] = step
        else:
            parts.taken += 1  # the count advances when the block ends
        done = StepDone(
            step,
            self._flat_params(),
            self.param_names,
            self.state,
            self.transport,
            self._agreement_transport,
            self._params_are_replicas,
            self.options.bucket_size,
        )
        for hook in self.post_step_hooks:
            hook(done)
        aggregation = self._aggregator
        if aggregation is not None:  # error feedback's ratio (one host sync), None without
            self.telemetry.note_feedback(aggregation.state.feedback_kind, aggregation.state.take_feedback_ratio())
        if self.measures_noise_scale:
            self.telemetry.note_noise_scale(self.noise_scale)
        self.telemetry.close_step(step, self.transport, self.comm_stats)
        return loss

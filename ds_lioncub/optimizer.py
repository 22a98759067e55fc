"""LionCub: Lion whose update direction is agreed on by a compressed vote of the workers.

Each rank keeps its own momentum and computes its own pre-sign update ``c``; the ranks then vote on
(or average) ``sign(c)`` through an aggregation (:mod:`ds_lioncub.aggregation`), sending 1-8 bits
per parameter, and every rank applies the same update, so parameters stay bitwise identical. With
``compression="none"`` it is exact Lion on the mean gradient. Lion's equations are in
:mod:`ds_lioncub.lion`.

This module is the ``torch.optim`` front: set-up, the parameters and their state, and the methods callers use.
The step itself is the rank's :class:`~ds_lioncub.step.rank_step.RankStep` (:attr:`LionCub.rank_step`), composed
of the aggregation, option ``clip`` and the noise scale, option ``overlap`` and the post-step hooks; telemetry
observes it (:mod:`ds_lioncub.step.events`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_lioncub.comm.backend import CompressedBackend
from ds_lioncub.comm.transport import CommStats, Transport, make_transport
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.config.clip_rule import refuse_clip_without_norm
from ds_lioncub.errors import LionCubError
from ds_lioncub.modes import mode_of
from ds_lioncub.planner.auto import AutoResolution
from ds_lioncub.step.bucket_work import check_param_group
from ds_lioncub.step.clipping import clip_shard_of
from ds_lioncub.step.engine_side import MOVED_TO_ENGINE_SIDE, EngineSide
from ds_lioncub.step.finite_check import ParameterLabel
from ds_lioncub.step.local_state import NOISE_SCALE_KEY, parameter_layout
from ds_lioncub.step.noise_scale import NoiseScale
from ds_lioncub.step.overlap import overlap_transport
from ds_lioncub.step.param_selection import names_by_position
from ds_lioncub.step.parts import StepCalls
from ds_lioncub.step.paths import participants
from ds_lioncub.step.post_step import StepDone
from ds_lioncub.step.rank_step import RankStep
from ds_lioncub.step.rounds import run_rounds
from ds_lioncub.step.setup import check_same_set_up, log_setting, resolve_auto_at_construction
from ds_lioncub.telemetry import StepRecord, StepTelemetry, TelemetryTotals


class LionCub(torch.optim.Optimizer):
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
        self.options = (
            _config
            if _config is not None
            else parse_config({"lr": lr, "betas": betas, "weight_decay": weight_decay, **options})
        )
        refuse_clip_without_norm(self.options)
        self.module = module
        self.process_group = process_group
        # Names are kept by flat position (group order, then parameter order): DeepSpeed's mixed-precision wrapper
        # swaps the parameters for fp32 copies in place, which keeps positions but not identities.
        self.param_names: list[str] | None = None
        #: What a step() call is now: state only, one part of a step, tensors numbered from elsewhere.
        self.calls = StepCalls()
        transport = self._make_transport(process_group)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})
        # Before anything that could issue collectives of option-dependent sizes: every rank the same set-up,
        # "auto" included as written (a rank that plans alone would wait in the planner's node-size agreement).
        layout = parameter_layout(self.param_groups, None, module)
        check_same_set_up(transport, self.options, self.param_groups, layout)
        # compression="auto": the planner's mode for this world, the same on every rank (the inputs are);
        # checked again as resolved.
        self.auto_resolution: AutoResolution | None = None
        if mode_of(self.options).chosen_by_planner:
            self.auto_resolution = resolve_auto_at_construction(self.options, transport, self._flat_params())
            self.options = self.auto_resolution.options
            check_same_set_up(transport, self.options, self.param_groups, layout)
        #: The rank's step (:mod:`ds_lioncub.step.rank_step`); the aggregation is built once: here, or by bind()
        #: when bind() is to follow (from_config's bound_later).
        self.rank_step = RankStep(
            self.options, transport, clip_shard=clip_shard_of(process_group), build_aggregation_now=not _bound_later
        )
        # Per-step records (docs/design.md, section 15): an observer of the step.
        self.telemetry = StepTelemetry(vote_stats=self.options.telemetry.vote_stats)
        self.rank_step.events = self.telemetry
        self._set_up_overlap()
        self._ready = True
        self._resolve_names()
        # The options as the step runs them, on rank 0, once per (world, aggregation); bind() says it when it builds.
        self._logged_setting: tuple[int, str] | None = None
        if not _bound_later:
            self._logged_setting = log_setting(transport, self.options, self.rank_step.aggregator, None)

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

        ``gradients_averaged``: the caller averages the gradients before ``step`` (DeepSpeed's engine with compression
        "none"), so exact Lion must not average them again. ``agreement_group`` / ``agreement_levels``: the ranks
        that must skip a step together, when they are more than the voters (under the ZeRO hybrid: the world), and
        the same ranks as a grid of groups (:meth:`~ds_lioncub.step.rank_step.RankStep.rewire`).
        ``params_are_replicas``: whether the voters hold the same parameters (not under ZeRO's partitions); the
        replica check runs only if they do. Used by the DeepSpeed wiring, while the optimizer still holds the
        module's own parameters, so names resolve. The transport is rebuilt only for a different group (an MPI
        transport's construction is itself a collective).
        """
        regrouped = process_group is not self.process_group
        if regrouped:
            self.process_group = process_group
        transport = self._make_transport(process_group) if regrouped else self.transport
        if module is not None:
            self.module = module
        shard, levels = clip_shard_of(process_group), agreement_levels
        self.rank_step.rewire(transport, shard, agreement_group, levels, gradients_averaged, params_are_replicas)
        if regrouped:
            self._set_up_overlap()
        self._resolve_names()
        self._logged_setting = log_setting(
            self.transport, self.options, self.rank_step.aggregator, self._logged_setting
        )

    @property
    def options(self) -> LionCubConfig:
        """The options as constructed (``compression="auto"`` resolved; the DeepSpeed wiring resolves ``clip``); the
        live hyper-parameters are in ``param_groups``. Set, the rank's step runs with them from then on."""
        return self._options

    @options.setter
    def options(self, options: LionCubConfig) -> None:
        self._options = options
        if "rank_step" in self.__dict__:
            self.rank_step.set_options(options)

    @property
    def engine_side(self) -> EngineSide:
        """What DeepSpeed's wiring asks of this optimizer beside torch.optim's (:mod:`ds_lioncub.step.engine_side`);
        made on each access, so that the optimizer and it hold no reference cycle (a dropped optimizer goes at once)."""
        return EngineSide(self)

    @property
    def transport(self) -> Transport:
        """The voters' group: the collectives of the step."""
        return self.rank_step.transport

    @property
    def gradients_are_averaged(self) -> bool:
        """Whether the caller (DeepSpeed's engine) hands over gradients it has already averaged."""
        return self.rank_step.wiring.gradients_are_averaged

    def _make_transport(self, process_group: dist.ProcessGroup | None) -> Transport:
        return make_transport(process_group, self.options.comm_backend_name, self.options.cuda_aware)

    def _set_up_overlap(self) -> None:
        """With ``overlap``: the vote over a group of its own and a gradient hook on every parameter (once)."""
        world_size = self.transport.world_size
        ranks = self._voter_ranks() if self.options.overlap and world_size > 1 else []
        overlap = self.rank_step.overlap
        overlap.set_up(self.options, world_size, ranks, self._make_overlap_transport, self._flat_params())

    def _voter_ranks(self) -> list[int]:  # the global ranks of the voters' group
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return list(dist.get_process_group_ranks(group))

    def _make_overlap_transport(self, ranks: list[int]) -> Transport:  # a new process group of the voters
        device = next((p.device for p in self._flat_params()), torch.device("cpu"))
        return overlap_transport(ranks, self._make_transport, device)

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _resolve_names(self) -> None:
        """Name every parameter (from named params or the module) and select momentum-sync layers."""
        self.param_names = names_by_position(self.param_groups, self.module)
        self.rank_step.momentum_sync.select(self._flat_params(), self.param_names, self.module)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Lion Cub step: the rank's step (:meth:`~ds_lioncub.step.rank_step.RankStep.rounds`), round by round."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = participants(self.param_groups, self.state, alone=self.transport.world_size == 1)
        calls = self.calls
        if calls.states_only:
            return loss
        parts = calls.parts
        step = parts.step if parts is not None else self.param_groups[0]["step"] + 1

        def finish() -> StepDone:
            if parts is None:
                for group in self.param_groups:
                    group["step"] = step
            else:
                parts.taken += 1  # the count advances when the block ends
            params = self._flat_params()
            # Read, never create: a frozen parameter gets no state entry (the state dict would carry it).
            momenta = [self.state[param].get("exp_avg") if param in self.state else None for param in params]
            return self.rank_step.done(step, params, self.param_names, momenta)

        label = ParameterLabel(self._flat_params(), self.param_names)
        in_parts, first_key = calls.in_parts, calls.first_key_tensor
        run_rounds(
            self.rank_step.rounds(entries, step, label, in_parts=in_parts, first_key_tensor=first_key, finish=finish)
        )
        return loss

    # ------------------------------------------------------------------ traffic, telemetry, the noise scale

    def comm_stats(self) -> CommStats:
        """Collectives issued and bytes sent / received by this rank's LionCub steps so far (not the set-up check)."""
        return self.rank_step.comm_stats()

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
        return self.rank_step.clip.noise_scale.record()

    def set_noise_scale_batch(self, samples: int | None) -> None:
        """Say how many samples one voter's gradient averages each step (its micro-batch x its accumulation steps;
        x the ranks of a node under the ZeRO hybrid), so that :attr:`noise_scale` gives B_simple in samples. The
        DeepSpeed wiring sets it from the engine; in plain Python it is unknown until set (None: voter batches)."""
        self.rank_step.clip.noise_scale.set_batch_samples(samples)

    @property
    def momentum_synced_parameters(self) -> list[torch.Tensor]:
        """The parameters whose ``exp_avg`` momentum sync averages."""
        positions = self.rank_step.momentum_sync.positions
        return [p for position, p in enumerate(self._flat_params()) if position in positions]

    # ------------------------------------------------------------------ option overlap (step/overlap.py)

    def overlap_next_backward(self) -> None:
        """Start the bucket votes of the next backward from its gradient hooks (option ``overlap``): call it on every
        rank before the last micro-step's backward (:meth:`~ds_lioncub.step.overlap.OverlapController.arm`)."""
        self.rank_step.overlap.arm_next_backward(self.options, self.param_groups, self.state)

    def discard_overlapped_votes(self) -> None:
        """Wait for and drop the votes of an armed backward whose step will not come (collective, as arming was)."""
        self.rank_step.overlap.discard()

    @property
    def votes_in_flight(self) -> bool:
        """Whether a backward was armed (``overlap_next_backward``) and its step has not run yet."""
        return self.rank_step.overlap.armed is not None

    @property
    def buckets_launched_in_backward(self) -> int:
        """Buckets of armed backwards launched before ``step()``, from gradient hooks (overlap=True)."""
        return self.rank_step.overlap.buckets_launched_in_backward

    @property
    def revoted_buckets(self) -> int:
        """Buckets voted again at ``step()`` because some rank's final message differed (overlap=True)."""
        return self.rank_step.overlap.revoted_buckets

    @property
    def last_clip_coefficient(self) -> float | None:
        """The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip."""
        return self.rank_step.clip.last_coefficient

    # ------------------------------------------------------------------ the state a checkpoint keeps

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict (this rank's momenta, the param groups), with the gradient noise scale's moving
        averages under :data:`~ds_lioncub.step.local_state.NOISE_SCALE_KEY`."""
        state = super().state_dict()
        state[NOISE_SCALE_KEY] = self.rank_step.clip.noise_scale.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's :meth:`load_state_dict`; the noise scale's averages too where saved (a state dict of
        0.2.0 or older, or of another optimizer, leaves them as they are)."""
        saved = state_dict.get(NOISE_SCALE_KEY)
        super().load_state_dict({key: value for key, value in state_dict.items() if key != NOISE_SCALE_KEY})
        if saved is not None:
            self.rank_step.clip.noise_scale.load_state_dict(saved)

    def __getattr__(self, name: str) -> Any:
        """The deprecated names (removed in 0.3.0), with a DeprecationWarning: ``attach`` (use :meth:`bind`),
        ``backend`` (use :attr:`transport`) and DeepSpeed's wiring's calls, now on :attr:`engine_side`. Python comes
        here only for a name not found otherwise."""
        if "rank_step" not in self.__dict__ or (name not in MOVED_TO_ENGINE_SIDE and name not in _RENAMED):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        use = _RENAMED.get(name, f"LionCub.engine_side.{name}")
        warnings.warn(f"LionCub.{name} is deprecated and will be removed in 0.3.0; use {use}", DeprecationWarning, 2)
        if name == "attach":
            return lambda group, module: self.bind(group, module, gradients_averaged=self.gradients_are_averaged)
        if name == "backend":
            return CompressedBackend.from_transport(self.transport)
        return getattr(self.engine_side, name)


#: Deprecated names of LionCub and what replaces them (:meth:`LionCub.__getattr__`).
_RENAMED = {"attach": "LionCub.bind(process_group, module, gradients_averaged=...)", "backend": "LionCub.transport"}

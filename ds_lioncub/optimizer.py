"""LionCub: Lion whose update direction is agreed on by a compressed vote of the workers.

Each rank keeps its own momentum and computes its own pre-sign update ``c``; the ranks then vote on
(or average) ``sign(c)`` through an aggregation (:mod:`ds_lioncub.aggregation`), sending 1-8 bits
per parameter, and every rank applies the same update, so parameters stay bitwise identical. With
``compression="none"`` it is exact Lion on the mean gradient. Lion's equations are in
:mod:`ds_lioncub.lion`; this module orchestrates: parameter groups, state, buckets, the step.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ds_lioncub._logging import get_logger
from ds_lioncub._version import __version__
from ds_lioncub.aggregation import (
    COMM_DTYPES,
    Aggregator,
    Bucket,
    ExactMean,
    build_aggregation,
)
from ds_lioncub.bucket_work import (
    BucketBuffers,
    Entry,
    apply_bucket,
    apply_voted_signs,
    bucket_directions,
    check_param_group,
    exact_lion_bucket,
    grad_piece,
    mean_abs_direction,
    mean_of_bucket,
    non_finite_parameters,
    piece_of,
    prepare_bucket,
    prepare_sign_message,
    update_bucket_momenta,
    whole_tensor_mean_abs,
)
from ds_lioncub.buckets import Piece, plan_buckets
from ds_lioncub.comm.backend import CompressedBackend
from ds_lioncub.comm.packing import (
    pack_fields,
    packed_length,
    unpack_fields,
    unpack_signs,
)
from ds_lioncub.comm.quantize import tie_sign
from ds_lioncub.comm.schedule import run_three_stages
from ds_lioncub.comm.transport import CommStats, Transport, make_transport
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.errors import (
    LionCubConfigError,
    LionCubError,
    LionCubSetupError,
    NonFiniteGradientError,
    UnsupportedParameterError,
)
from ds_lioncub.fingerprint import agreed_text, check_same_on_every_rank, describe_parameters
from ds_lioncub.overlap import ArmedBackward
from ds_lioncub.param_selection import names_by_position, select_parameters
from ds_lioncub.planner.auto import (
    AUTO_NODE_SIZE_LABEL,
    AutoResolution,
    auto_node_size,
    log_auto_resolution,
    resolve_auto,
)
from ds_lioncub.planner.devices import device_of
from ds_lioncub.replica_check import check_replicas
from ds_lioncub.telemetry import StepRecord, StepTelemetry, TelemetryTotals, pack_local_signs


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
            momentum_sync, comm_backend_name, cuda_aware, overlap).

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
        **options: Any,
    ) -> None:
        # torch.optim.Optimizer.__init__ calls add_param_group, which must know whether set-up is done.
        self._ready = False
        self.options: LionCubConfig = parse_config({"lr": lr, "betas": betas, "weight_decay": weight_decay, **options})
        self.module = module
        self.process_group = process_group
        self.transport: Transport = self._make_transport(process_group)
        # The ranks whose finite checks must agree: the voters, unless bind() says more.
        self._agreement_transport: Transport = self.transport
        # Whether the caller (DeepSpeed's engine) hands over gradients it has already averaged.
        self.gradients_are_averaged = False
        # Whether every rank of the group holds the same parameters (the replica check compares them).
        self._params_are_replicas = True
        # Names and the momentum-sync selection are kept by flat position (group order, then
        # parameter order): DeepSpeed's mixed-precision wrapper swaps the parameters for fp32
        # copies in place, which keeps positions but not identities.
        self.param_names: list[str] | None = None
        self._momentum_synced: set[int] = set()
        self._states_only = False
        # Inside optimizer_step_in_parts(): the step every step() call is a part of (None outside).
        self._parts: StepInParts | None = None
        # The bucket schedule of compressed steps (see _compressed_step); False runs buckets one by one.
        self._pipelined_buckets = True
        #: Buckets of armed backwards launched before step() (from gradient hooks), and those voted again
        #: at step() because some rank's final message differed (overlap=True; counts, for diagnosis).
        self.buckets_launched_in_backward = 0
        self.revoted_buckets = 0
        # Per-step records (docs/design.md, section 15); a mode that re-votes a bucket calls
        # telemetry.note_revoted_bucket().
        self.telemetry = StepTelemetry(vote_stats=self.options.telemetry.vote_stats)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults)
        # Before anything that could issue collectives of option-dependent sizes: every rank the same set-up,
        # "auto" included as written (a rank that plans alone would wait in the planner's node-size agreement).
        self._check_same_set_up_on_every_rank()
        # compression="auto": the planner's mode for this world, the same on every rank (the inputs are);
        # checked again as resolved.
        self.auto_resolution: AutoResolution | None = None
        if self.options.compression == "auto":
            self._resolve_auto()
            self._check_same_set_up_on_every_rank()
        self._aggregator: Aggregator | None = build_aggregation(self.options, self.transport, False)
        # overlap=True: the vote over a second group that armed backwards launch on, and their state.
        self._overlap_vote: Aggregator | None = None
        self._overlap_ranks: list[int] = []  # the global ranks of the overlap vote's group
        self._armed: ArmedBackward | None = None
        self._set_up_overlap()
        self._ready = True
        self._resolve_names()
        self._logged_setting: tuple[int, str] | None = None
        self._log_setting()

    # ------------------------------------------------------------------ set-up and validation

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
        params_are_replicas: bool = True,
    ) -> None:
        """Communicate over ``process_group``, take names from ``module``, and say who averages gradients.

        ``gradients_averaged``: the caller averages the gradients before ``step`` (DeepSpeed's engine
        with compression "none"), so exact Lion must not average them again. ``agreement_group``:
        the ranks that must all skip a step together when one has a non-finite gradient, when they
        are more than ``process_group`` (under ZeRO hybrid: the whole world, not just the voters).
        ``params_are_replicas``: whether the ranks of ``process_group`` hold the same parameters (not so
        when ZeRO hands each rank its own partition of them); the replica check runs only if they do.
        Used by the DeepSpeed wiring; must run while the optimizer still holds the module's own
        parameters, so names resolve. The transport is rebuilt only for a different group (an MPI
        transport's construction is itself a collective).
        """
        if process_group is not self.process_group:
            self.process_group = process_group
            self.transport = self._make_transport(process_group)
            self._set_up_overlap()
        # The agreement group holds more ranks than the voters (the whole world under the ZeRO hybrid); an MPI
        # transport spans the MPI world, which is the voters' group, so torch.distributed carries the agreement.
        self._agreement_transport = (
            self.transport if agreement_group is None else make_transport(agreement_group, comm_backend_name="torch")
        )
        if module is not None:
            self.module = module
        self.gradients_are_averaged = gradients_averaged
        self._params_are_replicas = params_are_replicas
        self._aggregator = build_aggregation(self.options, self.transport, gradients_averaged)
        self._resolve_names()
        self._log_setting()

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

    def _log_setting(self) -> None:
        """Log the resolved options once per (world, aggregation), on rank 0, as the step will run them."""
        aggregation = type(self._aggregator).__name__ if self._aggregator is not None else "none (local gradients)"
        setting = (self.transport.world_size, aggregation)
        if self.transport.rank != 0 or setting == self._logged_setting:
            return
        self._logged_setting = setting
        get_logger().info(
            f"LionCub: {self.transport.world_size} rank(s) over {self.transport.name}, aggregation {aggregation}; "
            f"{self.options.summary()}"
        )

    def _resolve_auto(self) -> None:
        """Replace ``options`` by the planner's choice at ZeRO stage 0 and say so on rank 0 (planner.auto).

        Nodes of G ranks: G from ``hybrid.node_size`` or the launcher's variables, else one rank per node.
        """
        num_params = sum(p.numel() for p in self._flat_params() if p.requires_grad)
        # Each rank reads G from its own environment; they must agree before each resolves alone.
        with self.transport.uncounted():  # set-up traffic, left out of comm_stats()
            node_size = int(
                agreed_text(self.transport, AUTO_NODE_SIZE_LABEL, lambda: str(auto_node_size(self.options, os.environ)))
            )
        # The parameters' device is where the step's local work runs: it picks the planner's cost table.
        params = self._flat_params()
        device = device_of(params[0].device.type) if params else "cpu"
        resolution = resolve_auto(self.options, num_params, self.transport.world_size, node_size, device=device)
        self.auto_resolution = resolution
        self.options = resolution.options
        # The resolution may have turned vote_stats off (exact Lion takes no vote): record what runs.
        self.telemetry = StepTelemetry(vote_stats=self.options.telemetry.vote_stats)
        log_auto_resolution(resolution, self.transport.rank)

    def _check_same_set_up_on_every_rank(self) -> None:
        """Raise the same error on every rank if the ranks were built with different options or models."""
        groups = [
            (len(group["params"]), group["lr"], tuple(group["betas"]), group["weight_decay"])
            for group in self.param_groups
        ]
        components = [
            ("ds_lioncub version", __version__),
            ("world size", str(self.transport.world_size)),
            ("transport", self.transport.name),
            *((f"option {name}", repr(value)) for name, value in self.options.model_dump().items()),
            ("param groups (size, lr, betas, weight_decay)", repr(groups)),
        ]
        # comm_stats() counts the steps' traffic only: the check's all-gather is left out.
        with self.transport.uncounted():
            check_same_on_every_rank(self.transport, components, self.parameter_layout())

    def _make_transport(self, process_group: dist.ProcessGroup | None) -> Transport:
        return make_transport(process_group, self.options.comm_backend_name, self.options.cuda_aware)

    def _voter_ranks(self) -> list[int]:
        """The global ranks of the voters' group."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return list(dist.get_process_group_ranks(group))

    def _make_overlap_transport(self, ranks: list[int]) -> Transport:
        """A transport over a new process group of the voters (global ``ranks``): launches from gradient
        hooks may come before or after other collectives of the voters' group (DeepSpeed's, the finite
        check), in an order that differs between ranks, so they get a group of their own. Only the
        voters call this."""
        # The same kind of transport as the votes' (the config admits overlap with comm_backend_name "torch" only).
        transport = self._make_transport(dist.new_group(ranks=ranks, use_local_synchronization=True))
        # One tiny collective now, while every voter is here: NCCL creates a group's communicator at its
        # first collective and blocks the host until all ranks join, which inside a gradient hook could
        # wait on a rank that is itself waiting in another group's collective.
        params = self._flat_params()
        device = params[0].device if params else torch.device("cpu")
        with transport.uncounted():  # set-up traffic, left out of comm_stats()
            transport.all_reduce_sum(torch.zeros(1, dtype=torch.int32, device=device))
        return transport

    def _set_up_overlap(self) -> None:
        """With ``overlap``: the vote over the overlap transport, and a gradient hook on every parameter (once)."""
        self._armed = None
        if not self.options.overlap or self.transport.world_size == 1:
            self._overlap_vote = None  # alone there is nothing to hide: steps run as without overlap
            return
        ranks = self._voter_ranks()
        if self._overlap_vote is None or self._overlap_ranks != ranks:
            # bind() to a group of the same ranks (DeepSpeed's data-parallel group over the whole world)
            # keeps the group made at construction: a second one would only cost a communicator.
            vote = build_aggregation(self.options, self._make_overlap_transport(ranks), False)
            # The config admits overlap with compression only: every vote serves it.
            assert vote is not None and vote.votes_during_backward, f"overlap needs a vote, not {vote!r}"
            self._overlap_vote = vote
            self._overlap_ranks = ranks
        if not getattr(self, "_gradient_hooks", None):
            # The parameters backward accumulates into, by flat position: a mixed-precision wrapper later
            # puts fp32 copies in their place here, but backward keeps filling these.
            self._hooked_params = self._flat_params()
            # The hooks hold the optimizer weakly (a model must not keep a dropped optimizer's momenta
            # and process groups alive) and are removed when it is collected.
            owner = weakref.ref(self)
            self._gradient_hooks = [
                param.register_post_accumulate_grad_hook(functools.partial(_gradient_ready, owner))
                for param in self._hooked_params
                if param.requires_grad
            ]
            weakref.finalize(self, _remove_hooks, list(self._gradient_hooks))

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _resolve_names(self) -> None:
        """Name every parameter (from named params or the module) and select momentum-sync layers."""
        names = self._names_by_position()
        self.param_names = names
        sync = self.options.momentum_sync
        if sync.interval == 0:
            return
        selected = select_parameters(self._flat_params(), names, sync.layers, self.module)
        self._momentum_synced = {position for position, chosen in enumerate(selected) if chosen}

    def _names_by_position(self) -> list[str] | None:
        """Every parameter's name (from named params or the module), by flat position; None if one has none."""
        return names_by_position(self.param_groups, self.module)

    @contextmanager
    def initialising_states(self) -> Iterator[None]:
        """Within this block ``step()`` only creates optimizer state and changes nothing.

        DeepSpeed's fp16/bf16 wrapper calls ``step()`` once on zero gradients to create the state;
        for Lion Cub a real step would move every parameter by lr (a zero vote is a tie).
        """
        self._states_only = True
        try:
            yield
        finally:
            self._states_only = False

    @contextmanager
    def optimizer_step_in_parts(self) -> Iterator[None]:
        """Within this block every ``step()`` call is one part of a single optimizer step.

        For callers that step the parameters in several calls, each with only some of them in
        ``param_groups`` (DeepSpeed's ZeRO-3 steps one flat sub-group per call). Every part runs with
        the same step number, so the tie rule is the step's; each part does its own tensors' work (the
        vote, momentum sync and replica check when due, one telemetry record). The step count
        advances once, when the block ends after at least one part; a block in which no part ran (a
        skipped step) or that raised leaves it as it was.
        """
        if self._parts is not None:
            raise LionCubSetupError("LionCub: optimizer_step_in_parts() blocks do not nest; end the first one.")
        parts = StepInParts(self.param_groups[0]["step"] + 1 if self.param_groups else 1)
        self._parts = parts
        try:
            yield
        finally:
            self._parts = None
        if parts.taken:
            for group in self.param_groups:
                group["step"] = parts.step

    # ------------------------------------------------------------------ public helpers

    def comm_stats(self) -> CommStats:
        """Collectives issued and bytes sent / received by this rank's LionCub steps so far (not the set-up check)."""
        stats = self.transport.stats + CommStats()  # a copy: the transport keeps counting
        if self._agreement_transport is not self.transport:  # the world-wide finite check under ZeRO hybrid
            stats = stats + self._agreement_transport.stats
        if self._overlap_vote is not None:  # votes started during backward, and those voted again
            stats = stats + self._overlap_vote.transport.stats
        return stats

    # ------------------------------------------------------------------ overlap with backward

    def overlap_next_backward(self) -> None:
        """Start the bucket votes of the next backward from its gradient hooks (option ``overlap``).

        Call it on every rank before ``loss.backward()`` of the last micro-step before ``step()``
        (DeepSpeed's ``engine.backward`` does it on the accumulation boundary). Buckets leave, in
        reverse parameter order, as soon as their gradients are accumulated; ``step()`` checks them
        against the final gradients and votes again where needed (see :meth:`step`). Votes from an
        earlier armed backward that ``step()`` never used are waited for and dropped first, so a
        skipped step costs no exactness, only the wasted bytes. A world of one arms nothing.
        """
        if not self.options.overlap:
            raise LionCubConfigError(
                "LionCub: overlap_next_backward() starts votes during backward, which needs the option overlap=True; "
                "construct LionCub with overlap=True or drop the call."
            )
        self.discard_overlapped_votes()
        vote = self._overlap_vote
        if vote is None:
            return
        flat = [(group, param) for group in self.param_groups for param in group["params"]]
        if len(flat) != len(self._hooked_params):
            raise LionCubSetupError(
                f"LionCub: overlap=True hooked {len(self._hooked_params)} parameters at construction, but the "
                f"optimizer now holds {len(flat)}; parameter groups cannot change when overlap is on."
            )
        # (group, the parameter stepped, the parameter backward fills) of each taking part
        taking_part = [(*flat[i], self._hooked_params[i]) for i in range(len(flat)) if _takes_part(flat[i][1])]
        params = [param for _, param, _ in taking_part]
        # Reverse parameter order: backward finishes the last layers' gradients first.
        last = len(params) - 1
        reverse_plan = plan_buckets([param.numel() for param in reversed(params)], self.options.bucket_size)
        plan = [
            [Piece(last - piece.tensor_index, piece.start, piece.length) for piece in bucket] for bucket in reverse_plan
        ]
        positive_ties = tie_sign(self.param_groups[0]["step"] + 1, self.options.tie_break) > 0
        whole_mean_abs: dict[int, torch.Tensor] = {}

        def bucket_now(k: int) -> Bucket:
            # The gradients as they are now (None: zeros, as at step) and the momentum before this step's update.
            entries = {piece.tensor_index: self._entry_now(*taking_part[piece.tensor_index]) for piece in plan[k]}
            if vote.needs_whole_tensor_mean_abs:
                for piece in plan[k]:
                    entry = entries[piece.tensor_index]
                    if entry.param.numel() > self.options.bucket_size and piece.tensor_index not in whole_mean_abs:
                        whole_mean_abs[piece.tensor_index] = mean_abs_direction(entry, self.options.bucket_size)
            values = torch.empty(sum(piece.length for piece in plan[k]), dtype=torch.float32, device=params[0].device)
            return bucket_directions(entries, plan[k], values, whole_mean_abs, vote)

        filled = [hooked for _, _, hooked in taking_part]
        self._armed = ArmedBackward(plan, filled, params, vote, positive_ties, bucket_now)

    def discard_overlapped_votes(self) -> None:
        """Wait for and drop the votes of an armed backward whose step will not come (a skipped step).

        Collective: every rank must call it, as every rank armed. ``overlap_next_backward`` calls it.
        """
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.drain()

    @property
    def votes_in_flight(self) -> bool:
        """Whether a backward was armed (``overlap_next_backward``) and its step has not run yet."""
        return self._armed is not None

    def _entry_now(self, group: dict[str, Any], param: torch.Tensor, filled: torch.Tensor) -> Entry:
        """``param`` with the gradient backward accumulated into ``filled`` (``param`` itself, or the
        low-precision parameter it is a copy of: converted exactly) and its momentum, creating neither
        (zeros stand in for both)."""
        grad = filled.grad
        grad = torch.zeros_like(param) if grad is None else grad.to(param.dtype)
        exp_avg = self.state[param].get("exp_avg") if param in self.state else None
        return Entry(group, param, grad, exp_avg if exp_avg is not None else torch.zeros_like(param))

    @property
    def last_step_telemetry(self) -> StepRecord | None:
        """What the last step did (bytes, collectives, seconds, vote rates); None before the first step."""
        return self.telemetry.last

    @property
    def telemetry_totals(self) -> TelemetryTotals:
        """Sums over every step recorded so far (skipped DeepSpeed steps included)."""
        return self.telemetry.totals

    @property
    def momentum_synced_parameters(self) -> list[torch.Tensor]:
        """The parameters whose ``exp_avg`` momentum sync averages."""
        return [p for position, p in enumerate(self._flat_params()) if position in self._momentum_synced]

    def parameter_layout(self) -> list[str]:
        """One line per parameter in flat position order: name (or ``#position``), shape, dtype.

        What the ranks compare at set-up and what a checkpoint's momenta must match on load.
        """
        names = self.param_names if self.param_names is not None else self._names_by_position()
        params = self._flat_params()
        return describe_parameters(list(names) if names is not None else [None] * len(params), params)

    def local_momentum_state(self) -> list[torch.Tensor | None]:
        """This rank's ``exp_avg`` by flat parameter position (None: no state yet), for checkpoints."""
        return [self.state[p].get("exp_avg") for p in self._flat_params()]

    def load_local_momentum(self, momenta: list[torch.Tensor | None]) -> None:
        """Set ``exp_avg`` by flat parameter position (``None`` leaves a parameter's state as it is).

        Raises :class:`~ds_lioncub.errors.LionCubSetupError` when the count does not match.
        """
        params = self._flat_params()
        if len(momenta) != len(params):
            raise LionCubSetupError(
                f"LionCub: the checkpoint's per-rank momentum files hold {len(momenta)} tensors but the optimizer "
                f"has {len(params)} parameters; the model or its parameter groups changed since saving."
            )
        for param, momentum in zip(params, momenta, strict=True):
            if momentum is None:
                continue
            state = self.state[param]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg"].copy_(momentum.view(param.shape))

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._participants()
        if self._states_only:
            return loss
        parts = self._parts
        step = parts.step if parts is not None else self.param_groups[0]["step"] + 1
        baseline = self.comm_stats()
        if self._armed is not None:  # the votes launched during backward are this step's traffic
            baseline = baseline - self._armed.traffic_since_armed()
        self.telemetry.begin_step(baseline)
        aggregator = self._aggregator
        if aggregator is None or aggregator.reduces_gradients:
            self._exact_lion_step(entries, aggregator)
        elif self._armed is not None:
            self._overlapped_step(entries, step, positive_ties=tie_sign(step, self.options.tie_break) > 0)
        else:
            if self.options.check_finite:
                self._require_finite_gradients(entries, step)
            self._compressed_step(entries, aggregator, positive_ties=tie_sign(step, self.options.tie_break) > 0)
        if parts is None:
            for group in self.param_groups:
                group["step"] = step
        else:
            parts.taken += 1  # the count advances when the block ends
        interval = self.options.momentum_sync.interval
        if interval and step % interval == 0:
            self._sync_momentum()
        check_interval = self.options.consistency_check.interval
        if check_interval and step % check_interval == 0 and self._params_are_replicas:
            params = self._flat_params()
            names = self.param_names or [f"parameter #{i} of shape {tuple(p.shape)}" for i, p in enumerate(params)]
            labels = [repr(name) for name in names] if self.param_names else names
            check_replicas(self.transport, params, labels, step, agreement=self._agreement_transport)
        self._end_telemetry_step(step)
        return loss

    def _end_telemetry_step(self, step: int) -> None:
        """Sum the chunk owners' tie counts over the group (vote_stats only) and close the step's record."""
        owner_ties = self.telemetry.owner_tie_counts()
        if owner_ties is not None:
            # The telemetry's own 8-byte all-reduce is left out of comm_stats(), like the set-up check:
            # the counters describe the training's traffic.
            with self.transport.uncounted():
                self.transport.all_reduce_sum(owner_ties)
        self.telemetry.end_step(step, self.comm_stats())

    def _participants(self) -> list[Entry]:
        """The parameters that take part in this step.

        Two side effects: a parameter's ``exp_avg`` state is created (zeros) on its first step, and
        a parameter without a gradient gets a zero gradient when the world has more than one rank
        (every rank must run the same collectives); alone, it is skipped.
        """
        alone = self.transport.world_size == 1
        entries = []
        for group in self.param_groups:
            for param in group["params"]:
                if not param.requires_grad or param.numel() == 0:
                    continue
                grad = param.grad
                if grad is None:
                    if alone:
                        continue
                    grad = torch.zeros_like(param)
                if grad.is_sparse:
                    raise UnsupportedParameterError(
                        "LionCub does not support sparse gradients; use a dense nn.Embedding (sparse=False)."
                    )
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                entries.append(Entry(group, param, grad, state["exp_avg"]))
        return entries

    def _require_finite_gradients(self, entries: list[Entry], step: int) -> None:
        """Raise on every rank, before any state changes, if any rank has a NaN or inf gradient.

        A vote would silently turn a NaN into a -1 (or an L1 scale into garbage); exact Lion at least
        propagates it. One 4-byte all-reduce per step makes every rank reach the same verdict.
        """
        bad = non_finite_parameters(entries)
        device = entries[0].grad.device if entries else torch.device("cpu")
        ranks_with_bad = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
        self._agreement_transport.all_reduce_sum(ranks_with_bad)
        self._raise_if_non_finite(int(ranks_with_bad.item()), bad, step)

    def _raise_if_non_finite(self, count: int, bad: list[torch.Tensor], step: int) -> None:
        """Raise the same error on every rank when ``count`` ranks (agreed) have non-finite gradients."""
        if count == 0:
            return
        here = ", ".join(self._label(param) for param in bad[:5]) or "none"
        raise NonFiniteGradientError(
            f"LionCub: non-finite (NaN/inf) gradients on {count} of {self._agreement_transport.world_size} ranks at "
            f"step {step}; the step was not applied on any rank (this rank's offending parameters: {here}). "
            f"Lower the learning rate, enable gradient clipping or loss scaling; check_finite=False turns "
            f"this check off."
        )

    def _label(self, param: torch.Tensor) -> str:
        position = next(i for i, p in enumerate(self._flat_params()) if p is param)
        if self.param_names:
            return repr(self.param_names[position])
        return f"parameter #{position} of shape {tuple(param.shape)}"

    def _exact_lion_step(self, entries: list[Entry], mean: Aggregator | None) -> None:
        """Exact Lion on each bucket's gradients, averaged over the ranks by ``mean`` unless it is None."""
        clock = _AggregationClock(self.transport)
        for k, bucket in enumerate(plan_buckets([entry.param.numel() for entry in entries], self.options.bucket_size)):
            grads = [grad_piece(entries[piece.tensor_index].grad, piece) for piece in bucket]
            if mean is not None:
                sizes = [piece.length for piece in bucket]
                averaged = clock.run(k, mean_of_bucket, mean, grads, sizes)
                self.telemetry.add_bucket(clock.take(k), 0)
                grads = list(averaged.split(sizes))
            exact_lion_bucket(entries, bucket, grads)

    def _compressed_step(self, entries: list[Entry], aggregator: Aggregator, positive_ties: bool) -> None:
        """Every bucket through prepare, the aggregation's three stages, and apply, in the bucket schedule.

        The schedule is the same on every rank, so every rank issues the same collectives in the same
        order. Pipelined (the default), iteration k runs [prepare bucket k, issue its first collective]
        [bucket k-1: wait, reduce, issue its second] [bucket k-2: wait, apply]: while one bucket's
        messages travel, the next is prepared and an earlier one applied. Each bucket's result is a
        function of the ranks' packed messages and the step's tie rule only, so the schedule changes
        when work happens, never a bit of its result. Serial, each bucket runs to the end before the
        next starts. Between stages only packed messages are kept: in the L1 and "mean" modes one
        bucket-sized fp32 buffer holds the update being prepared, then the result being applied.

        Sign votes (1-bit, k-bit of signs) keep no fp32 bucket at all: prepare is
        :func:`prepare_sign_message` (Lion's direction, the momentum update and the packing, one pass
        where compiled) and apply is :func:`apply_voted_signs` on the voted signs as they arrive,
        packed (unpack and update, one pass). The other modes build the fp32 bucket of ``c``. Both
        give the same bits (tests/unit/test_fused_step.py, tests/kernels/test_fused_step.py).
        """
        capacity = self.options.bucket_size
        whole_mean_abs = whole_tensor_mean_abs(entries, capacity) if aggregator.needs_whole_tensor_mean_abs else {}
        plan = plan_buckets([entry.param.numel() for entry in entries], capacity)
        scratch = BucketBuffers(plan)
        clock = _AggregationClock(aggregator.transport)
        local_signs: dict[int, torch.Tensor] = {}
        packed_signs = aggregator.votes_packed_signs

        def start(k: int) -> object:
            if packed_signs:
                numel = sum(piece.length for piece in plan[k])
                bits, nbytes = aggregator.sign_message_layout(numel)
                # Telemetry's local seconds: the packing shares its pass with Lion's direction and the
                # momentum update, so the pass counts whole (as the unpacking with the update, below).
                message = clock.run(k, prepare_sign_message, entries, plan[k], positive_ties, bits, nbytes)
                if self.telemetry.vote_stats:
                    local_signs[k] = sign_bits_of_message(message, bits, numel)
                return clock.run(k, aggregator.issue, message, numel, positive_ties)
            prepared = prepare_bucket(entries, plan[k], scratch, whole_mean_abs, aggregator)
            if self.telemetry.vote_stats:  # taken before the buffer is reused
                local_signs[k] = pack_local_signs(prepared.values, positive_ties)
            return clock.run(k, aggregator.start, prepared, positive_ties)

        self._run_bucket_schedule(entries, plan, aggregator, start, scratch, clock, local_signs)

    def _run_bucket_schedule(
        self,
        entries: list[Entry],
        plan: list[list[Piece]],
        aggregator: Aggregator,
        start: Callable[[int], object],
        scratch: BucketBuffers,
        clock: _AggregationClock,
        local_signs: dict[int, torch.Tensor],
    ) -> None:
        """``start(k)`` (bucket k's first collective, issued), then reduce, complete and apply, per bucket,
        pipelined or serially (see :meth:`_compressed_step`).

        A sign vote's result is applied packed (:func:`apply_voted_signs`), any other unpacked into
        ``scratch`` (:meth:`_apply_bucket`).

        Telemetry: each bucket's aggregation stages (and a sign vote's fused apply) are timed by
        ``clock``; with ``vote_stats``, ``local_signs[k]`` (filled by ``start``) is counted against the
        applied direction.
        """
        packed_signs = aggregator.votes_packed_signs
        counted: dict[int, object] = {}  # vote_stats counts a bucket's received rows when it completes

        def issue(k: int) -> object:
            pending = start(k)
            if k in local_signs:
                counted[k] = pending
            return pending

        def complete(done: int, result: object) -> None:
            signs = local_signs.pop(done, None)
            received = counted.pop(done, None)
            if packed_signs:
                voted = clock.run(done, aggregator.complete_packed, result)
                numel = sum(piece.length for piece in plan[done])
                if signs is not None:
                    self.telemetry.count_vote(aggregator, received, signs, unpack_signs(voted, numel))
                del received  # the received messages are released before the update is applied
                clock.run(done, apply_voted_signs, entries, plan[done], voted)
                self.telemetry.add_bucket(clock.take(done), numel)
            else:
                out = scratch.for_bucket(entries, plan[done])
                delta = clock.run(done, aggregator.complete, result, out)
                self.telemetry.add_bucket(clock.take(done), delta.numel())
                if signs is not None:
                    self.telemetry.count_vote(aggregator, received, signs, delta)
                del received
                apply_bucket(entries, plan[done], delta)

        run_three_stages(
            len(plan),
            issue,
            lambda k, pending: clock.run(k, aggregator.reduce, pending),
            complete,
            pipelined=self._pipelined_buckets,
        )

    def _overlapped_step(self, entries: list[Entry], step: int, positive_ties: bool) -> None:
        """The step of an armed backward: check its votes against the final gradients, vote again where needed.

        Every bucket is packed again from the final gradients (after whatever clipping, unscaling or
        user code changed them since the hooks ran) and compared with what this rank sent. One int32
        all-reduce of [ranks with non-finite gradients, per bucket: ranks whose message changed]
        makes the verdict collective. A bucket no rank changed keeps its vote: its result is a
        function of the messages and the tie rule only, which are then the serial step's. A bucket
        some rank changed is voted again from every rank's final message (the guess is waited for
        and dropped). So the result is bit-identical to the step without overlap, whatever happened
        to the gradients. The momentum is updated after the verdict, so a refused step changes nothing.
        """
        armed, self._armed = self._armed, None
        assert armed is not None and self._overlap_vote is not None
        vote = self._overlap_vote
        self.buckets_launched_in_backward += len(armed.launched)
        armed.flush()
        # The same tie rule and parameters as when armed (else no message is kept: every bucket is voted again).
        same_setting = (
            armed.positive_ties == positive_ties
            and len(entries) == len(armed.stepped)
            and all(entry.param is param for entry, param in zip(entries, armed.stepped, strict=False))
        )
        capacity = self.options.bucket_size
        whole_mean_abs = whole_tensor_mean_abs(entries, capacity) if vote.needs_whole_tensor_mean_abs else {}
        scratch = BucketBuffers(armed.plan)
        clock = _AggregationClock(vote.transport)
        local_signs: dict[int, torch.Tensor] = {}
        changed = []
        for k, (bucket, launched) in enumerate(zip(armed.plan, armed.launched, strict=True)):
            values = bucket_directions(entries, bucket, scratch.for_bucket(entries, bucket), whole_mean_abs, vote)
            if self.telemetry.vote_stats:
                local_signs[k] = pack_local_signs(values.values, positive_ties)
            final = clock.run(k, vote.pack, values, positive_ties)
            same = same_setting and torch.equal(final, launched.message)
            if not same:
                launched.message = final  # what a vote again sends
            changed.append(0 if same else 1)
        bad = non_finite_parameters(entries) if self.options.check_finite else []
        device = entries[0].grad.device if entries else torch.device("cpu")
        verdict = torch.tensor([1 if bad else 0, *changed], dtype=torch.int32, device=device)
        self._agreement_transport.all_reduce_sum(verdict)
        counts = verdict.tolist()
        if counts[0]:
            armed.drain()
        self._raise_if_non_finite(counts[0], bad, step)
        for count in counts[1:]:
            if count:
                self.revoted_buckets += 1
                self.telemetry.note_revoted_bucket()
        for bucket in armed.plan:
            update_bucket_momenta(entries, bucket)

        def start(k: int) -> object:
            launched = armed.launched[k]
            if not counts[1 + k]:
                return launched.pending
            vote.transport.wait(launched.pending.received)
            numel = sum(piece.length for piece in armed.plan[k])
            return clock.run(k, vote.issue, launched.message, numel, positive_ties)

        self._run_bucket_schedule(entries, armed.plan, vote, start, scratch, clock, local_signs)

    def _sync_momentum(self) -> None:
        """Average ``exp_avg`` of the selected parameters over the ranks (every ``momentum_sync.interval`` steps)."""
        if self.transport.world_size == 1:
            return
        momenta = [
            self.state[p]["exp_avg"]
            for position, p in enumerate(self._flat_params())
            if position in self._momentum_synced and "exp_avg" in self.state[p]
        ]
        mean = ExactMean(self.transport, COMM_DTYPES[self.options.momentum_sync.dtype])
        for bucket in plan_buckets([m.numel() for m in momenta], self.options.bucket_size):
            slices = [piece_of(momenta[piece.tensor_index], piece) for piece in bucket]
            sizes = [piece.length for piece in bucket]
            averaged = mean.finish(mean.start(Bucket(torch.cat(slices), sizes, [])))
            for target, value in zip(slices, averaged.split(sizes), strict=True):
                target.copy_(value)


def sign_bits_of_message(message: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` sign fields of a ``bits``-wide sign message as 1-bit signs, unpadded: what
    :func:`~ds_lioncub.telemetry.pack_local_signs` gives for the direction the message was packed from."""
    if bits == 1:
        return message[: packed_length(numel)]  # padding bits are 0, as pack_local_signs leaves them
    return pack_fields(unpack_fields(message, bits, numel), 1)


@dataclass
class StepInParts:
    """The optimizer step that ``step()`` calls are parts of (:meth:`LionCub.optimizer_step_in_parts`)."""

    step: int
    taken: int = 0


class _AggregationClock:
    """Seconds in each bucket's aggregation stages with the transport's collectives taken out (telemetry)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._seconds: dict[int, float] = {}

    def run(self, k: int, stage: Callable[..., _Result], *args: Any) -> _Result:
        """``stage(*args)``, its local seconds added to bucket ``k``'s."""
        started, in_collectives = time.perf_counter(), self.transport.stats.seconds
        try:
            return stage(*args)
        finally:
            elapsed = time.perf_counter() - started - (self.transport.stats.seconds - in_collectives)
            self._seconds[k] = self._seconds.get(k, 0.0) + elapsed

    def take(self, k: int) -> float:
        """Bucket ``k``'s local seconds, forgotten here."""
        return self._seconds.pop(k, 0.0)


_Result = TypeVar("_Result")


def _takes_part(param: torch.Tensor) -> bool:
    """Whether ``param`` takes part in steps (with a gradient, or as zeros on a rank without one)."""
    return param.requires_grad and param.numel() > 0


def _gradient_ready(owner: weakref.ref[LionCub], param: torch.Tensor) -> None:
    """A parameter's gradient hook: hand the accumulated gradient to the owner's armed backward, if any."""
    optimizer = owner()
    if optimizer is not None and optimizer._armed is not None:
        optimizer._armed.gradient_ready(param)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()

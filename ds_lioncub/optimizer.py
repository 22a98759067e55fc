"""LionCub: Lion whose update direction is agreed on by a compressed vote of the workers.

Each rank keeps its own momentum and computes its own pre-sign update ``c``; the ranks then vote on
(or average) ``sign(c)`` through the compressed backend, sending 1-8 bits per parameter, and every
rank applies the same update, so parameters stay bitwise identical (DESIGN §2.1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_lioncub.buckets import Piece, plan_buckets
from ds_lioncub.comm.backend import CompressedBackend
from ds_lioncub.comm.quantize import check_kbit_world_size
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.config import LionCubConfig, LionCubConfigError, parse_config
from ds_lioncub.param_selection import select_parameters

_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lion_direction(
    exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Lion's pre-sign update ``c = beta1 * m + (1 - beta1) * g`` in fp32 (into ``out`` if given)."""
    if out is None:
        out = torch.empty(exp_avg.shape, dtype=torch.float32, device=exp_avg.device)
    return out.copy_(exp_avg).mul_(beta1).add_(grad, alpha=1 - beta1)


def apply_update(param: torch.Tensor, direction: torch.Tensor, lr: float, weight_decay: float) -> None:
    """``param = param * (1 - lr * wd) - lr * direction`` (decoupled weight decay), in place."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-lr)


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
            aggregation, kbit_algorithm, tie_break, l1_clip, comm_dtype, bucket_size, momentum_sync,
            comm_backend_name, cuda_aware).

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
        **options: Any,
    ) -> None:
        self.options: LionCubConfig = parse_config({"lr": lr, "betas": betas, "weight_decay": weight_decay, **options})
        self.module = module
        self.backend = self._make_backend(process_group)
        # DeepSpeed's integration sets this when the engine has already averaged the gradients.
        self.gradients_are_averaged = False
        # Names and the momentum-sync selection are kept by flat position (group order, then
        # parameter order): DeepSpeed's mixed-precision wrapper swaps the parameters for fp32
        # copies in place, which keeps positions but not identities.
        self.param_names: list[str] | None = None
        self._momentum_synced: set[int] = set()
        self._states_only = False
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._check_world_size()
        self._resolve_names()

    # ------------------------------------------------------------------ set-up and validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        hyper = {key: param_group[key] for key in ("lr", "betas", "weight_decay") if key in param_group}
        parse_config({**self.defaults, **hyper})
        current_step = self.param_groups[0]["step"] if self.param_groups else 0
        param_group.setdefault("step", current_step)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, param in zip(names, group["params"]):
            label = f"parameter {name!r}" if name else f"a parameter of shape {tuple(param.shape)}"
            if not param.is_floating_point():
                raise TypeError(
                    f"LionCub: {label} has dtype {param.dtype}; only floating-point parameters can be "
                    f"optimized. Leave it out of the optimizer or set requires_grad=False."
                )
            if param.is_sparse:
                raise TypeError(f"LionCub: {label} is a sparse tensor; LionCub needs dense parameters.")
            if not param.is_contiguous():
                raise ValueError(
                    f"LionCub: {label} is not contiguous; LionCub updates flat views. "
                    f"Make it contiguous (param.data = param.data.contiguous()) before building the optimizer."
                )
        if hasattr(self, "backend"):
            self._resolve_names()

    def attach(self, process_group: dist.ProcessGroup | None, module: nn.Module | None) -> None:
        """Communicate over ``process_group`` and take names from ``module`` (used by the DeepSpeed wiring).

        Must run while the optimizer still holds the module's own parameters, so names resolve.
        """
        self.backend = self._make_backend(process_group)
        if module is not None:
            self.module = module
        self._check_world_size()
        self._resolve_names()

    def _make_backend(self, process_group: dist.ProcessGroup | None) -> CompressedBackend:
        return CompressedBackend(process_group, self.options.comm_backend_name, self.options.cuda_aware)

    def _check_world_size(self) -> None:
        if self.options.compression == "kbit":
            check_kbit_world_size(
                self.backend.world_size, self.options.bits, self.options.quantizer, self.options.kbit_algorithm
            )

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _resolve_names(self) -> None:
        """Name every parameter (from named params or the module) and select momentum-sync layers."""
        from_module = {}
        if self.module is not None:
            from_module = {id(p): name for name, p in self.module.named_parameters()}
        names: list[str] | None = []
        for group in self.param_groups:
            given = group.get("param_names")
            for position, param in enumerate(group["params"]):
                name = given[position] if given else from_module.get(id(param))
                if name is None:
                    names = None
                    break
                names.append(name)
            if names is None:
                break
        self.param_names = names
        sync = self.options.momentum_sync
        if sync.interval == 0:
            return
        params = self._flat_params()
        try:
            selected = select_parameters(params, names, sync.layers, self.module)
        except ValueError as error:
            raise LionCubConfigError(str(error)) from None
        self._momentum_synced = {position for position, chosen in enumerate(selected) if chosen}

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

    # ------------------------------------------------------------------ public helpers

    def comm_stats(self) -> CommStats:
        """Collectives issued and bytes sent / received by this rank's LionCub so far."""
        return self.backend.comm_stats()

    @property
    def momentum_synced_parameters(self) -> list[torch.Tensor]:
        """The parameters whose ``exp_avg`` momentum sync averages."""
        return [p for position, p in enumerate(self._flat_params()) if position in self._momentum_synced]

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._entries_with_gradients()
        if self._states_only:
            return loss
        step = self.param_groups[0]["step"] + 1
        if self.options.compression == "none":
            self._exact_lion_step(entries)
        else:
            if self.options.check_finite:
                self._require_finite_gradients(entries, step)
            self._compressed_step(entries, step)
        for group in self.param_groups:
            group["step"] = step
        interval = self.options.momentum_sync.interval
        if interval and step % interval == 0:
            self._sync_momentum()
        return loss

    def _entries_with_gradients(self) -> list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(group, param, grad, exp_avg) for every parameter that takes part in this step."""
        alone = self.backend.world_size == 1
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
                    raise TypeError("LionCub does not support sparse gradients; use a dense nn.Embedding (sparse=False).")
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                entries.append((group, param, grad, state["exp_avg"]))
        return entries

    def _require_finite_gradients(
        self, entries: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]], step: int
    ) -> None:
        """Raise on every rank, before any state changes, if any rank has a NaN or inf gradient.

        A vote would silently turn a NaN into a -1 (or an L1 scale into garbage); exact Lion at least
        propagates it. One 4-byte all-reduce per step makes every rank reach the same verdict.
        """
        # A sum is NaN/inf exactly when some element is (short of an fp32 overflow of the sum, itself a
        # broken gradient): one read pass per tensor, no per-element temporary, one host sync.
        sums = [grad.sum(dtype=torch.float32) for _, _, grad, _ in entries]
        locally_finite = bool(torch.isfinite(torch.stack(sums)).all()) if sums else True
        bad = [] if locally_finite else [entry[1] for entry, total in zip(entries, sums) if not torch.isfinite(total)]
        device = entries[0][2].device if entries else torch.device("cpu")
        ranks_with_bad = torch.tensor([0 if locally_finite else 1], dtype=torch.int32, device=device)
        self.backend.transport.all_reduce_sum(ranks_with_bad)
        count = int(ranks_with_bad.item())
        if count == 0:
            return
        here = ", ".join(self._label(param) for param in bad[:5]) or "none"
        raise FloatingPointError(
            f"LionCub: non-finite (NaN/inf) gradients on {count} of {self.backend.world_size} ranks at "
            f"step {step}; the step was not applied on any rank (this rank's offending parameters: {here}). "
            f"Lower the learning rate, enable gradient clipping or loss scaling; check_finite=False turns "
            f"this check off."
        )

    def _label(self, param: torch.Tensor) -> str:
        position = next(i for i, p in enumerate(self._flat_params()) if p is param)
        if self.param_names:
            return repr(self.param_names[position])
        return f"parameter #{position} of shape {tuple(param.shape)}"

    def _exact_lion_step(self, entries: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        world = self.backend.world_size
        average = world > 1 and not self.gradients_are_averaged
        comm_dtype = _COMM_DTYPES[self.options.comm_dtype]
        for bucket in plan_buckets([e[1].numel() for e in entries], self.options.bucket_size):
            grads = [entries[piece.index][2].reshape(-1)[piece.start : piece.start + piece.length] for piece in bucket]
            if average:
                summed = self.backend.transport.all_reduce_sum(torch.cat(grads).to(comm_dtype))
                averaged = summed.float().div_(world)
                grads = list(averaged.split([piece.length for piece in bucket]))
            for piece, grad in zip(bucket, grads):
                group, param, _, exp_avg = entries[piece.index]
                param_slice, exp_avg_slice = self._slices(param, exp_avg, piece)
                beta1, beta2 = group["betas"]
                direction = torch.sign(lion_direction(exp_avg_slice, grad, beta1))
                apply_update(param_slice, direction, group["lr"], group["weight_decay"])
                exp_avg_slice.mul_(beta2).add_(grad, alpha=1 - beta2)

    def _compressed_step(
        self, entries: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]], step: int
    ) -> None:
        options = self.options
        use_l1 = options.compression == "kbit" and options.quantizer == "l1"
        capacity = options.bucket_size
        whole_means: dict[int, torch.Tensor] = {}
        if use_l1:
            # mu is the mean |c| of the whole tensor; tensors cut across buckets need it up front.
            for index, (group, param, grad, exp_avg) in enumerate(entries):
                if param.numel() > capacity:
                    whole_means[index] = self._mean_abs_direction(exp_avg, grad, group["betas"][0], capacity)
        for bucket in plan_buckets([e[1].numel() for e in entries], capacity):
            lengths = [piece.length for piece in bucket]
            update = torch.empty(sum(lengths), dtype=torch.float32, device=entries[bucket[0].index][1].device)
            means = []
            for piece, direction in zip(bucket, update.split(lengths)):
                group, param, grad, exp_avg = entries[piece.index]
                beta1, beta2 = group["betas"]
                _, exp_avg_slice = self._slices(param, exp_avg, piece)
                grad_slice = grad.reshape(-1)[piece.start : piece.start + piece.length]
                lion_direction(exp_avg_slice, grad_slice, beta1, out=direction)
                exp_avg_slice.mul_(beta2).add_(grad_slice, alpha=1 - beta2)
                if use_l1:
                    means.append(whole_means.get(piece.index, direction.abs().mean()))
            if options.compression == "1bit":
                # The vote overwrites the directions it was packed from: one bucket-sized buffer, not two.
                delta = self.backend.vote_1bit(update, step, options.tie_break, out=update)
            else:
                delta = self.backend.vote_kbit(
                    update,
                    step,
                    options.bits,
                    quantizer=options.quantizer,
                    aggregation=options.aggregation,
                    algorithm=options.kbit_algorithm,
                    tie_break=options.tie_break,
                    l1_clip=options.l1_clip,
                    segment_sizes=lengths,
                    segment_means=torch.stack(means) if use_l1 else None,
                )
            for piece, piece_delta in zip(bucket, delta.split(lengths)):
                group, param, _, exp_avg = entries[piece.index]
                param_slice, _ = self._slices(param, exp_avg, piece)
                apply_update(param_slice, piece_delta, group["lr"], group["weight_decay"])
            # Drop this bucket's buffers (and the loop variables viewing them; buckets are never
            # empty) before the next bucket allocates its own: a step holds one bucket's temporaries.
            del update, delta, direction, piece_delta

    @staticmethod
    def _mean_abs_direction(exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=exp_avg.device)
        flat_m, flat_g = exp_avg.reshape(-1), grad.reshape(-1)
        for start in range(0, flat_m.numel(), chunk):
            total += lion_direction(flat_m[start : start + chunk], flat_g[start : start + chunk], beta1).abs().sum()
        return total / flat_m.numel()

    @staticmethod
    def _slices(param: torch.Tensor, exp_avg: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        end = piece.start + piece.length
        return param.view(-1)[piece.start : end], exp_avg.view(-1)[piece.start : end]

    def _sync_momentum(self) -> None:
        """Average ``exp_avg`` of the selected parameters over the ranks (DESIGN §2.6)."""
        world = self.backend.world_size
        if world == 1:
            return
        momenta = [
            self.state[p]["exp_avg"]
            for position, p in enumerate(self._flat_params())
            if position in self._momentum_synced and "exp_avg" in self.state[p]
        ]
        comm_dtype = _COMM_DTYPES[self.options.momentum_sync.dtype]
        for bucket in plan_buckets([m.numel() for m in momenta], self.options.bucket_size):
            slices = [momenta[piece.index].view(-1)[piece.start : piece.start + piece.length] for piece in bucket]
            summed = self.backend.transport.all_reduce_sum(torch.cat(slices).to(comm_dtype))
            averaged = summed.float().div_(world)
            for target, value in zip(slices, averaged.split([piece.length for piece in bucket])):
                target.copy_(value)

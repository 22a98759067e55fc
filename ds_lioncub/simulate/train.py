"""Training in the virtual world: a :class:`Task` trained by :class:`VirtualLionCub` over N workers.

The global batch of step t is the task's, identical for every worker count and mode: N workers split
it into N equal micro-batches (:mod:`ds_lioncub.simulate.gradients`), so two runs with the same seed
differ only in how the workers' updates are aggregated. Exact Lion is ``compression="none"``: the fp32
mean of the N workers' gradients, through the same world.

Learning rate: DeepSpeed's ``WarmupCosineLR`` as the examples configure it (linear warmup from
``warmup_min_ratio`` x lr to lr over ``warmup_steps``, then cosine decay to ``cos_min_ratio`` x lr at
the last step), except that the first step runs at the warmup's start, not at lr 0 (DeepSpeed's
scheduler starts at 0 before its first step, which only moves the momentum).

Gradient clipping (``grad_clip``, the examples' 1.0; 0 disables it) follows ``clip_rule``:

- ``"mean"`` (default, what a DeepSpeed job does since 0.2.0, :mod:`ds_lioncub.config.clip_rule`): a compressed
  mode clips the workers' mean gradient by its sketched norm, LionCub's option ``clip`` at ``max_norm = grad_clip``
  (added to the options unless they set ``clip`` themselves); exact Lion clips its mean gradient by its norm.
- ``"deepspeed"``: DeepSpeed's own rule (``"clip": {"rule": "deepspeed"}``, the default before 0.2.0) at ZeRO
  stage 0 in fp32 (``clip_grad_norm_`` averages the ranks' gradient norms and every rank scales its gradient by
  one common factor ``min(1, grad_clip / (norm + 1e-6))``). With compression every rank holds its own gradient,
  so the norm is the mean over the workers of their own norms; with ``compression="none"`` the engine averages
  the gradients first, so it is the norm of the mean gradient (and exact Lion's trajectory does not depend on
  N). Lion is invariant to a constant gradient scale; a common factor that changes from step to step reweighs
  the momentum's history, the same for every worker.
- ``"per_worker"``: DeepSpeed's rule under its bf16/fp16 wrappers: each worker clips its own gradient by its own
  norm. With ``compression="none"`` the engine averages before any clipping, so exact Lion clips the mean
  gradient by its norm under every rule.

Seed statistics (:func:`seed_summary`): over S seeds, a quantity's mean and the half-width of the
mean's two-sided 95% Student-t interval, t(S - 1) x the per-seed values' sample standard deviation
(ddof 1) / sqrt(S) (:mod:`ds_lioncub.quantities.student_t`, the statistic the planner and the convergence study
use); a gap is called real only when the interval excludes 0, ``|mean| > half_width`` (never with one
seed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.quantities.student_t import MeanInterval, mean_interval
from ds_lioncub.simulate.agreement import AgreementStats
from ds_lioncub.simulate.drift import TensorDrift
from ds_lioncub.simulate.gradients import Batch, GradientBuffers, Method, worker_gradients
from ds_lioncub.simulate.noise_terms import exact_noise_terms
from ds_lioncub.simulate.world import VirtualLionCub

ClipRule = Literal["mean", "deepspeed", "per_worker"]


class Task(Protocol):
    """What :func:`train_virtual` trains: a model, its data and its validation loss.

    Attributes:
        name: a short label for tables and result files.
        global_batch_size: samples per step (the batch dimension of :meth:`batch`); every worker count
            used with the task must divide it.
    """

    name: str
    global_batch_size: int

    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model, the same for every call with the same seed."""
        ...

    def batch(self, step: int, seed: int) -> Batch:
        """The global batch of optimizer step ``step`` (0-based); a function of (step, seed) only."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss over ``batch`` (every sample weighed equally)."""
        ...

    def validation_loss(self, model: nn.Module) -> float:
        """The loss on a fixed validation set."""
        ...


@dataclass
class TrainResult:
    """What :func:`train_virtual` returns.

    Fields:
        train_losses: the global batch's mean loss at each step, before that step's update.
        val_loss: the task's validation loss after the last step.
        agreement: the agreement with exact Lion, averaged over steps (None for exact Lion or when not recorded).
        gradient_method: "fused" or "loop" (:func:`~ds_lioncub.simulate.gradients.worker_gradients`).
        gradient_seconds, optimizer_seconds: wall time of the per-worker gradients and of the optimizer
            steps (clipping included), summed over the steps.
        lrs: the learning rate each step applied.
        model: the trained model, for evaluations beyond the task's own (``keep_model=True``), else None.
        drift: per tensor, how the compressed steps' sign errors added up over windows of steps
            (:mod:`ds_lioncub.simulate.drift`); None unless asked for (``drift_stats``) and compressed.
        noise_terms: per step, the noise scale's exact terms ``(|G|^2, tr(Sigma) per worker batch)`` of the
            workers' gradients before clipping (:func:`~ds_lioncub.simulate.noise_terms.exact_noise_terms`; None
            for a step whose gradient was not finite); None unless asked for (``noise_terms``).
    """

    train_losses: list[float]
    val_loss: float
    agreement: AgreementStats | None
    gradient_method: str
    gradient_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    lrs: list[float] = field(default_factory=list)
    model: nn.Module | None = None
    drift: list[TensorDrift] | None = None
    noise_terms: list[tuple[float, float] | None] | None = None


#: A quantity over seeds (:func:`seed_summary`): :class:`ds_lioncub.quantities.student_t.MeanInterval`, i.e. ``values``
#: (per seed, in seed order), ``mean``, ``half_width`` (of the 95% Student-t interval; None with one seed),
#: ``real`` (the interval excludes 0) and ``text(digits)``.
SeedSummary = MeanInterval


def seed_summary(values: list[float]) -> SeedSummary:
    """Mean and 95% Student-t half-width of per-seed values (:func:`ds_lioncub.quantities.student_t.mean_interval`)."""
    return mean_interval(values)


def gap_percent(mode_val: float, exact_val: float) -> float:
    """The mode's validation loss relative to exact Lion's of the same seed and worker count, in %."""
    return 100.0 * (mode_val - exact_val) / exact_val


def lr_ratio(step: int, total_steps: int, warmup_steps: int, warmup_min_ratio: float, cos_min_ratio: float) -> float:
    """The lr multiplier of 0-based ``step``: DeepSpeed's WarmupCosineLR (linear warmup) formula."""
    if step < warmup_steps:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def clip_worker_gradients(grads: list[list[torch.Tensor]], max_norm: float, rule: ClipRule, exact: bool) -> None:
    """Scale ``grads[i][j]`` in place as ``rule`` says (module docstring); ``exact``: compression "none". Rule
    ``"mean"`` scales every worker by the exact norm of the workers' mean gradient (the reference; on a compressed
    mode :func:`train_virtual` lets LionCub's option ``clip`` do it from its sketch, as the job does)."""
    if rule not in ("mean", "deepspeed", "per_worker"):
        raise LionCubConfigError(f"LionCub: clip_rule must be 'mean', 'deepspeed' or 'per_worker', got {rule!r}")
    if max_norm <= 0:
        return
    if exact or rule == "mean":  # the norm of the mean gradient (exact Lion's engine averages first)
        total = [g.clone() for g in grads[0]]
        for worker in grads[1:]:
            torch._foreach_add_(total, worker)
        torch._foreach_div_(total, len(grads))
        coefs = [min(1.0, max_norm / (_norm(total) + 1e-6))] * len(grads)
    else:
        norms = [_norm(worker) for worker in grads]
        if rule == "per_worker":
            coefs = [min(1.0, max_norm / (norm + 1e-6)) for norm in norms]
        else:
            coefs = [min(1.0, max_norm / (sum(norms) / len(norms) + 1e-6))] * len(grads)
    for worker, coef in zip(grads, coefs, strict=True):
        if coef < 1.0:
            torch._foreach_mul_(worker, coef)


def _norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together, in fp32 (as DeepSpeed's clip_grad_norm_)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


def train_virtual(
    task: Task,
    options: dict[str, Any],
    workers: int,
    steps: int,
    seed: int,
    *,
    warmup_steps: int = 10,
    warmup_min_ratio: float = 0.1,
    cos_min_ratio: float = 0.1,
    grad_clip: float = 1.0,
    clip_rule: ClipRule = "mean",
    gradient_method: Method = "auto",
    agreement_stats: bool = True,
    drift_stats: bool = False,
    noise_terms: bool = False,
    keep_model: bool = False,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train ``task`` for ``steps`` steps with ``VirtualLionCub(workers=workers, **options)``.

    Args:
        task: the model, data and validation loss.
        options: LionCub's options (lr is the schedule's peak; betas, weight_decay, compression, ...).
        workers: N; must divide ``task.global_batch_size``.
        steps: optimizer steps (also the cosine schedule's length).
        seed: model initialisation and data order (``task.build_model(seed)``, ``task.batch(t, seed)``).
        warmup_steps, warmup_min_ratio, cos_min_ratio: the lr schedule (module docstring).
        grad_clip, clip_rule: gradient clipping (module docstring).
        gradient_method: how the per-worker gradients are computed ("auto": the fused pass where it can).
        agreement_stats: record the compressed steps' agreement with exact Lion.
        drift_stats: record how their sign errors add up over steps (``TrainResult.drift``).
        noise_terms: record the noise scale's exact terms each step (``TrainResult.noise_terms``).
        keep_model: return the trained model (``TrainResult.model``); off, so that runs kept in a list
            do not keep their models alive.
        device: where the model, the workers' momenta and the aggregation run ("cuda" for a GPU). The
            model is initialised and the batches are drawn on the CPU, as on any device, then moved, so
            runs on two devices start alike and differ only by their devices' rounding.
        on_step: called after each step with (step, its training loss), e.g. to show progress.
    """
    if steps < 1:
        raise LionCubConfigError(f"LionCub: steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = task.build_model(seed).to(device)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    exact = options.get("compression", "1bit") == "none"
    if clip_rule == "mean" and not exact and grad_clip > 0:
        if "clip" not in options:
            options = {**options, "clip": {"max_norm": grad_clip}}
        grad_clip = 0.0  # option clip clips (at the options' own max_norm when they set one)
    optimizer = VirtualLionCub(
        named,
        workers=workers,
        module=model,
        agreement_stats=agreement_stats and not exact,
        drift_stats=drift_stats and not exact,
        **options,
    )
    peak = float(optimizer.param_groups[0]["lr"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_ratio(s, steps, warmup_steps, warmup_min_ratio, cos_min_ratio)
    )
    result = TrainResult(train_losses=[], val_loss=math.nan, agreement=None, gradient_method="")
    if noise_terms:
        result.noise_terms = []
    tallies: list[tuple[float, float, float, float]] = []
    buffers = GradientBuffers()  # one set of (N, *shape) gradient tensors for every step
    model.train()
    for step in range(steps):
        t0 = time.perf_counter()
        batch = tuple(tensor.to(device) for tensor in task.batch(step, seed))
        computed = worker_gradients(model, task.loss, batch, workers, params, gradient_method, buffers)
        if result.noise_terms is not None:  # timed with the gradients: it is not part of the optimizer's step
            result.noise_terms.append(exact_noise_terms(computed.grads))
        t1 = time.perf_counter()
        clip_worker_gradients(computed.grads, grad_clip, clip_rule, exact)
        result.lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step(computed.grads)
        schedule.step()
        result.optimizer_seconds += time.perf_counter() - t1
        result.gradient_seconds += t1 - t0
        result.gradient_method = computed.method
        result.train_losses.append(computed.loss)
        if not math.isfinite(computed.loss):
            raise LionCubConfigError(
                f"LionCub: the training loss is {computed.loss} at step {step} (peak lr {peak}); lower the lr"
            )
        stats = optimizer.last_agreement
        if stats is not None and not exact:
            tallies.append((stats.match, stats.flip, stats.zero, stats.tie))
        if on_step is not None:
            on_step(step, computed.loss)
    model.eval()
    with torch.no_grad():
        result.val_loss = float(task.validation_loss(model))
    result.model = model if keep_model else None
    if optimizer.drift is not None:
        result.drift = optimizer.drift.stats()
    if tallies:
        means = torch.tensor(tallies, dtype=torch.float64).mean(dim=0).tolist()
        result.agreement = AgreementStats(match=means[0], flip=means[1], zero=means[2], tie=means[3])
    return result

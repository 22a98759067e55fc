"""Per-worker gradients of a global batch split over N virtual data-parallel workers.

The global batch (a tuple of tensors whose first dimension is the batch) is cut into N equal,
contiguous micro-batches; worker i's loss is ``loss_fn(model, micro_batch_i)``, the mean loss over
its own micro-batch, and its gradient is what a real rank holding that micro-batch would compute.

Two ways to get them:

- ``"loop"``: one forward and backward per worker. Works for any model.
- ``"fused"``: ONE forward and backward of the whole global batch. Hooks on every parameterised
  module keep the module's input and catch the gradient of its output; each worker's weight gradient
  is then a reduction over that worker's rows only (a ``bmm`` over the N groups for ``nn.Linear``, one
  ``index_add_`` for ``nn.Embedding``, grouped sums for ``nn.RMSNorm`` / ``nn.LayerNorm``), times N,
  because the global loss is the mean of the N worker losses. During the pass every parameter has
  ``requires_grad=False``, so autograd never computes the (wasted) global weight gradients; the
  output of the first module is made a leaf that requires grad instead, so the activations' graph
  is still built. Only models whose parameters all belong to those four module types qualify, and
  the loss must weigh every sample of the batch equally (a mean over samples, e.g. a mean token
  cross-entropy with equal-length sequences), so that the global loss is the mean of the worker
  losses. No dropout or other randomness: the loop and the fused pass must see the same function.

The fused pass backpropagates N x the global loss, so every output gradient arrives already scaled
for a worker's own mean loss. It agrees with the loop to float rounding, not bitwise: it sums a
worker's rows inside a larger kernel (another summation order), its loss gradient is N x 1/(B...)
rather than 1/(B/N...), and it recomputes a norm layer's normalised input outside autograd.

``"auto"`` runs ``"fused"`` where the model qualifies and ``"loop"`` otherwise, and says which ran
and why (:class:`WorkerGradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from ds_lioncub.errors import LionCubConfigError

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
Method = Literal["loop", "fused", "auto"]

# Exact types only: a subclass may override forward (or, like MultiheadAttention's out_proj, never
# call it), and then the hooks would see nothing or the wrong thing.
FUSED_MODULE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.RMSNorm, nn.LayerNorm)


@dataclass
class WorkerGradients:
    """The result of :func:`worker_gradients`.

    Fields:
        grads: ``grads[i][j]`` is worker i's gradient of parameter j (the order of ``params``); a
            parameter the loss does not reach gets zeros.
        loss: the mean of the N worker losses (= the mean loss of the global batch).
        method: what ran, ``"loop"`` or ``"fused"``.
        reason: with ``method="auto"`` and ``"loop"`` run, why the fused pass could not; else "".
    """

    grads: list[list[torch.Tensor]]
    loss: float
    method: str
    reason: str = ""


def split_batch(batch: Batch, workers: int) -> list[Batch]:
    """The N equal contiguous micro-batches of ``batch`` (views, worker order)."""
    if workers < 1:
        raise LionCubConfigError(f"LionCub: workers must be >= 1, got {workers}")
    size = batch[0].shape[0]
    for tensor in batch:
        if tensor.shape[0] != size:
            raise LionCubConfigError(
                f"LionCub: every tensor of the batch needs the same first (batch) dimension; got "
                f"{[tuple(t.shape) for t in batch]}. Put the batch dimension first."
            )
    if size % workers != 0:
        raise LionCubConfigError(
            f"LionCub: a global batch of {size} samples cannot be split into {workers} equal micro-batches; "
            f"choose a worker count that divides {size} or a global batch that is a multiple of {workers}"
        )
    return [tuple(t.chunk(workers, dim=0)[i] for t in batch) for i in range(workers)]


def fused_unsupported_reason(model: nn.Module, params: Sequence[torch.Tensor]) -> str:
    """Why the fused pass cannot serve ``params`` of ``model`` ("" when it can)."""
    owned: set[int] = set()
    for name, module in model.named_modules():
        direct = list(module.parameters(recurse=False))
        if not direct:
            continue
        if type(module) not in FUSED_MODULE_TYPES:
            if any(p.requires_grad for p in direct):
                kind = type(module).__name__
                where = name or "<root>"
                return f"module {where} ({kind}) owns parameters and is not Linear, Embedding, RMSNorm or LayerNorm"
            continue
        if isinstance(module, nn.Embedding) and (
            module.max_norm is not None or module.scale_grad_by_freq or module.sparse
        ):
            return f"embedding {name} uses max_norm, scale_grad_by_freq or sparse gradients"
        if isinstance(module, nn.RMSNorm | nn.LayerNorm) and not module.elementwise_affine:
            continue
        owned.update(id(p) for p in direct)
    for j, param in enumerate(params):
        if id(param) not in owned:
            return f"parameter {j} (shape {tuple(param.shape)}) does not belong to a supported module of the model"
    return ""


def worker_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    workers: int,
    params: Sequence[torch.Tensor] | None = None,
    method: Method = "auto",
    buffers: GradientBuffers | None = None,
) -> WorkerGradients:
    """Each worker's gradient of ``params`` for the global ``batch`` split over ``workers``.

    Args:
        model: the model; its parameters' ``.grad`` are left as they were.
        loss_fn: ``loss_fn(model, micro_batch) -> scalar``, the mean loss over the micro-batch.
        batch: the global batch; every tensor's first dimension is the batch, divisible by ``workers``.
        workers: N.
        params: the parameters to differentiate, in the optimizer's order (default: every
            parameter of ``model`` that requires grad).
        method: "loop", "fused" (raises where the model does not qualify) or "auto".
        buffers: where the fused pass writes (:class:`GradientBuffers`); pass the same object every
            step to reuse the memory. The returned gradients are then views of it, valid until the next
            call with it. None: fresh tensors.
    """
    chosen: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    split_batch(batch, workers)  # validates the split before any work
    if method == "loop":
        return _loop(model, loss_fn, batch, workers, chosen)
    if method not in ("fused", "auto"):
        raise LionCubConfigError(f"LionCub: gradient method must be 'loop', 'fused' or 'auto', got {method!r}")
    reason = fused_unsupported_reason(model, chosen)
    if reason:
        if method == "fused":
            raise LionCubConfigError(
                f"LionCub: the fused per-worker gradient pass cannot serve this model: {reason}. "
                f"Use method='loop' (any model, one pass per worker) or method='auto'."
            )
        result = _loop(model, loss_fn, batch, workers, chosen)
        result.reason = reason
        return result
    return _fused(model, loss_fn, batch, workers, chosen, buffers)


def _loop(model: nn.Module, loss_fn: LossFn, batch: Batch, workers: int, params: list[torch.Tensor]) -> WorkerGradients:
    saved = [p.grad for p in params]
    grads: list[list[torch.Tensor]] = []
    total = 0.0
    try:
        for micro in split_batch(batch, workers):
            for p in params:
                p.grad = None
            loss = loss_fn(model, micro)
            loss.backward()
            total += float(loss.detach())
            # Take each .grad tensor itself (no copy); the next backward allocates fresh ones.
            grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return WorkerGradients(grads=grads, loss=total / workers, method="loop")


class GradientBuffers:
    """Storage the fused pass writes the workers' gradients into, kept from one call to the next.

    A new ``(N, *shape)`` tensor per parameter and step is a fresh large allocation each time (page
    faults, zeroing); handing the same buffers to every call avoids that. The gradients a call
    returns are views of these buffers, overwritten by the next call that gets them.
    """

    def __init__(self) -> None:
        self._store: dict[int, torch.Tensor] = {}

    def get(self, param: torch.Tensor, workers: int) -> torch.Tensor:
        """An uninitialised ``(workers, *param.shape)`` tensor for ``param`` (the same one each call)."""
        shape = (workers, *param.shape)
        kept = self._store.get(id(param))
        if kept is None or kept.shape != shape or kept.dtype != param.dtype or kept.device != param.device:
            kept = torch.empty(shape, dtype=param.dtype, device=param.device)
            self._store[id(param)] = kept
        return kept


@dataclass
class _Capture:
    """Per-worker gradient accumulators of the fused pass, keyed by parameter identity."""

    workers: int
    batch_size: int
    buffers: GradientBuffers
    written: set[int] = field(default_factory=set)  # parameters that have a first contribution this call
    forward_calls: int = 0
    backward_calls: int = 0

    def slot(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``param``'s (N, *shape) gradient buffer, and whether this is its first contribution this call
        (then it must be overwritten, else added to: a module called twice, or a weight two modules share)."""
        first = id(param) not in self.written
        self.written.add(id(param))
        return self.buffers.get(param, self.workers), first

    def groups(self, tensor: torch.Tensor, module_name: str) -> torch.Tensor:
        """``tensor`` (B, ...) viewed as (N, rows of one worker, ...) with the trailing dims kept."""
        if tensor.dim() == 0 or tensor.shape[0] != self.batch_size:
            raise LionCubConfigError(
                f"LionCub: the fused gradient pass needs every supported module to see the batch as its first "
                f"dimension; module {module_name} got a tensor of shape {tuple(tensor.shape)} (batch "
                f"{self.batch_size}). Use method='loop' for this model."
            )
        return (
            tensor.reshape(self.workers, -1, *tensor.shape[2:])
            if tensor.dim() > 1
            else tensor.reshape(self.workers, -1)
        )


# The output gradients arrive already scaled by N (the pass backpropagates N x the global loss), so
# each worker's sum over its own rows is its gradient as it stands.


def _linear_grads(cap: _Capture, module: nn.Linear, name: str, x: torch.Tensor, gout: torch.Tensor) -> None:
    n = cap.workers
    xs = cap.groups(x, name).reshape(n, -1, module.in_features)
    gs = cap.groups(gout, name).reshape(n, -1, module.out_features).transpose(1, 2)
    dest, first = cap.slot(module.weight)
    if first:
        torch.bmm(gs, xs, out=dest)
    else:
        dest.baddbmm_(gs, xs)
    if module.bias is not None:
        _sum_into(cap, module.bias, gs, dim=2)


def _embedding_grads(cap: _Capture, module: nn.Embedding, name: str, idx: torch.Tensor, gout: torch.Tensor) -> None:
    n, vocab, dim = cap.workers, module.num_embeddings, module.embedding_dim
    rows = cap.groups(idx, name).reshape(n, -1)
    # Row r of worker i goes to slot i * vocab + r: one index_add_ fills all N tables at once.
    flat = (rows + torch.arange(n, device=idx.device).unsqueeze(1) * vocab).reshape(-1)
    values = cap.groups(gout, name).reshape(-1, dim)
    if module.padding_idx is not None:  # nn.Embedding never updates its padding row
        keep = rows.reshape(-1) != module.padding_idx
        flat, values = flat[keep], values[keep]
    dest, first = cap.slot(module.weight)
    if first:
        dest.zero_()
    dest.view(n * vocab, dim).index_add_(0, flat, values)


def _norm_grads(
    cap: _Capture, module: nn.RMSNorm | nn.LayerNorm, name: str, x: torch.Tensor, gout: torch.Tensor
) -> None:
    n = cap.workers
    shape = tuple(module.normalized_shape)
    dims = tuple(range(-len(shape), 0))
    if isinstance(module, nn.RMSNorm):
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
        x_hat = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    else:
        x_hat = F.layer_norm(x, shape, eps=module.eps)  # no weight or bias: the normalised input
    _sum_into(cap, module.weight, cap.groups(gout * x_hat, name).reshape(n, -1, *shape), dim=1)
    bias = getattr(module, "bias", None)
    if bias is not None:
        _sum_into(cap, bias, cap.groups(gout, name).reshape(n, -1, *shape), dim=1)


def _sum_into(cap: _Capture, param: torch.Tensor, grouped: torch.Tensor, dim: int) -> None:
    """Each worker's sum of ``grouped`` over ``dim`` into ``param``'s gradient buffer."""
    dest, first = cap.slot(param)
    if first:
        torch.sum(grouped, dim=dim, out=dest)
    else:
        dest += grouped.sum(dim=dim)


def _fused(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    workers: int,
    params: list[torch.Tensor],
    buffers: GradientBuffers | None,
) -> WorkerGradients:
    cap = _Capture(workers=workers, batch_size=batch[0].shape[0], buffers=buffers or GradientBuffers())
    handles: list[Any] = []

    def make_hook(name: str, module: nn.Module) -> Callable[..., torch.Tensor]:
        def forward_hook(mod: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0].detach()
            if not output.requires_grad:
                # Parameters are frozen and nothing before this module needs a gradient: start the
                # graph here, at the activations, so no weight gradient is ever computed.
                output = output.detach().requires_grad_()
            cap.forward_calls += 1

            def backward_hook(gout: torch.Tensor) -> None:
                cap.backward_calls += 1
                if isinstance(module, nn.Linear):
                    _linear_grads(cap, module, name, x, gout)
                elif isinstance(module, nn.Embedding):
                    _embedding_grads(cap, module, name, x, gout)
                else:
                    assert isinstance(module, nn.RMSNorm | nn.LayerNorm)
                    _norm_grads(cap, module, name, x, gout)

            output.register_hook(backward_hook)
            return output

        return forward_hook

    wanted = {id(p) for p in params}
    for name, module in model.named_modules():
        if type(module) in FUSED_MODULE_TYPES and any(id(p) in wanted for p in module.parameters(recurse=False)):
            handles.append(module.register_forward_hook(make_hook(name, module)))
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        loss = loss_fn(model, batch)
        if not loss.requires_grad:
            raise LionCubConfigError(
                "LionCub: the loss of the fused gradient pass does not depend on any supported module's output; "
                "use method='loop'"
            )
        # N x the global loss: the mean of the N worker losses times N, so every output gradient arrives
        # scaled for a worker's own mean loss, and the grouped sums need no further pass.
        (loss * workers).backward()
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    if cap.backward_calls != cap.forward_calls:
        raise LionCubConfigError(
            f"LionCub: the fused gradient pass caught {cap.backward_calls} output gradients for "
            f"{cap.forward_calls} module calls (an output modified in place, or one the loss does not reach?); "
            f"use method='loop' for this model"
        )
    columns = []
    for param in params:
        reached = id(param) in cap.written
        dest, _ = cap.slot(param)
        columns.append(dest if reached else dest.zero_())  # a parameter the loss does not reach: zeros
    grads = [[column[i] for column in columns] for i in range(workers)]
    return WorkerGradients(grads=grads, loss=float(loss.detach()), method="fused")

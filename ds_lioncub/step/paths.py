"""The step paths of :class:`~ds_lioncub.optimizer.LionCub`: how one optimizer step runs over its buckets.

``LionCub.step`` runs one path per step (:func:`run_step_path` picks it); every path cuts the
participating parameters into buckets (:mod:`ds_lioncub.step.bucket_plan`) and runs each bucket's local halves
(:mod:`ds_lioncub.step.bucket_work`) around its aggregation (:mod:`ds_lioncub.aggregation`):

- :func:`exact_lion_step`: exact Lion on each bucket's gradients, averaged over the ranks unless the
  caller already did (compression "none", or a world of one);
- :func:`compressed_step`: every bucket through prepare, the aggregation's three stages and apply, in
  the bucket schedule (:func:`run_bucket_schedule`);
- :func:`overlapped_step`: the step of an armed backward (option ``overlap``), whose votes left during
  backward: checked against the final gradients and voted again where a message changed.

Telemetry observes each path through one :class:`~ds_lioncub.telemetry.BucketWatch`; the non-finite
check (:func:`require_finite_gradients`) makes every rank raise together before any state changes; when the step's
sketch runs (option ``clip``, the noise scale), the sketch's all-reduce carries the check's verdict instead
(:func:`runs_finite_check`), one collective round where there were two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.packing import pack_fields, packed_length, unpack_fields, unpack_signs
from ds_lioncub.comm.schedule import run_three_stages
from ds_lioncub.comm.transport import Summing, Transport
from ds_lioncub.errors import NonFiniteGradientError, UnsupportedParameterError
from ds_lioncub.step.bucket_plan import Piece, plan_buckets
from ds_lioncub.step.bucket_work import (
    BucketBuffers,
    Entry,
    apply_bucket,
    apply_voted_signs,
    bucket_directions,
    exact_lion_bucket,
    grad_piece,
    mean_of_bucket,
    non_finite_parameters,
    prepare_bucket,
    prepare_sign_message,
    update_bucket_momenta,
    whole_tensor_mean_abs,
)
from ds_lioncub.step.overlap import ArmedBackward, OverlapController
from ds_lioncub.telemetry import BucketWatch, StepTelemetry, pack_local_signs


@dataclass(frozen=True)
class StepContext:
    """What a step path needs from the optimizer, besides the parameters and the aggregation.

    Attributes:
        bucket_size: elements per bucket (option ``bucket_size``).
        pipelined: run the bucket schedule pipelined (the default) or bucket by bucket.
        telemetry: the optimizer's per-step records; the paths report to it through a BucketWatch.
        agreement: the ranks whose non-finite verdicts must agree (the voters, or the whole world under
            the ZeRO hybrid, summed inside each node and then across the nodes).
        check_finite: option ``check_finite``.
        params: every parameter of the optimizer by flat position (group order, then parameter order).
        names: their names by flat position (None: some has none); both name parameters in errors.
        first_key_tensor: the number of this call's first tensor in bucket keys
            (:meth:`~ds_lioncub.optimizer.LionCub.bucket_keys_from`).
        ranks_not_finite: the non-finite check's verdict when the step's sketch carried it (how many ranks have a
            non-finite gradient, agreed by the sketch's all-reduce; :func:`runs_finite_check`); None: the path
            agrees on it by its own all-reduce.
    """

    bucket_size: int
    pipelined: bool
    telemetry: StepTelemetry
    agreement: Summing
    check_finite: bool
    params: list[torch.Tensor]
    names: list[str] | None
    first_key_tensor: int = 0
    ranks_not_finite: int | None = None

    def label(self, param: torch.Tensor) -> str:
        """``param`` as an error message names it: its name, else its flat position and shape."""
        position = next(i for i, p in enumerate(self.params) if p is param)
        if self.names:
            return repr(self.names[position])
        return f"parameter #{position} of shape {tuple(param.shape)}"


def participants(
    param_groups: list[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]], alone: bool
) -> list[Entry]:
    """The parameters that take part in this step.

    Two side effects: a parameter's ``exp_avg`` state is created (zeros) on its first step, and a
    parameter without a gradient gets a zero gradient when the world has more than one rank (every
    rank must run the same collectives); ``alone``, it is skipped.
    """
    entries = []
    for group in param_groups:
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
            param_state = state[param]
            if "exp_avg" not in param_state:
                param_state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            entries.append(Entry(group, param, grad, param_state["exp_avg"]))
    return entries


def require_finite_gradients(entries: list[Entry], step: int, context: StepContext) -> None:
    """Raise on every rank, before any state changes, if any rank has a NaN or inf gradient.

    A vote would silently turn a NaN into a -1 (or an L1 scale into garbage); exact Lion at least
    propagates it. One 4-byte all-reduce per step makes every rank reach the same verdict.
    """
    bad = non_finite_parameters(entries)
    device = entries[0].grad.device if entries else torch.device("cpu")
    ranks_with_bad = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
    context.agreement.all_reduce_sum(ranks_with_bad)
    raise_if_non_finite(int(ranks_with_bad.item()), bad, step, context)


def runs_finite_check(aggregator: Aggregator | None, overlap: OverlapController, check_finite: bool) -> bool:
    """Whether this step's path (:func:`run_step_path`) runs :func:`require_finite_gradients`: the compressed step
    without an armed backward, with option ``check_finite``. The step's sketch, when one runs, then carries the
    check's verdict in its all-reduce instead, which saves the step one collective round."""
    return check_finite and aggregator is not None and not aggregator.reduces_gradients and overlap.armed is None


def raise_if_non_finite(count: int, bad: list[torch.Tensor], step: int, context: StepContext) -> None:
    """Raise the same error on every rank when ``count`` ranks (agreed) have non-finite gradients."""
    if count == 0:
        return
    here = ", ".join(context.label(param) for param in bad[:5]) or "none"
    raise NonFiniteGradientError(
        f"LionCub: non-finite (NaN/inf) gradients on {count} of {context.agreement.world_size} ranks at "
        f"step {step}; the step was not applied on any rank (this rank's offending parameters: {here}). "
        f"Lower the learning rate, enable gradient clipping or loss scaling; check_finite=False turns "
        f"this check off."
    )


def exact_lion_step(entries: list[Entry], mean: Aggregator | None, transport: Transport, context: StepContext) -> None:
    """Exact Lion on each bucket's gradients, averaged over the ranks of ``transport`` by ``mean`` unless
    it is None."""
    watch = context.telemetry.watch(transport)
    for k, bucket in enumerate(plan_buckets([entry.param.numel() for entry in entries], context.bucket_size)):
        grads = [grad_piece(entries[piece.tensor_index].grad, piece) for piece in bucket]
        if mean is not None:
            sizes = [piece.length for piece in bucket]
            averaged = watch.timed(k, mean_of_bucket, mean, grads, sizes)
            watch.bucket_done(k, 0)
            grads = list(averaged.split(sizes))
        exact_lion_bucket(entries, bucket, grads)


def compressed_step(entries: list[Entry], aggregator: Aggregator, positive_ties: bool, context: StepContext) -> None:
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
    :func:`~ds_lioncub.step.bucket_work.prepare_sign_message` (Lion's direction, the momentum update and
    the packing, one pass where compiled) and apply is :func:`~ds_lioncub.step.bucket_work.apply_voted_signs`
    on the voted signs as they arrive, packed (unpack and update, one pass). The other modes build the
    fp32 bucket of ``c``. Both give the same bits (tests/unit/test_fused_step.py,
    tests/kernels/test_fused_step.py).
    """
    capacity = context.bucket_size
    whole_mean_abs = whole_tensor_mean_abs(entries, capacity) if aggregator.needs_whole_tensor_mean_abs else {}
    plan = plan_buckets([entry.param.numel() for entry in entries], capacity)
    scratch = BucketBuffers(plan)
    watch = context.telemetry.watch(aggregator.transport)

    def start(k: int) -> object:
        if aggregator.votes_packed_signs:
            numel = sum(piece.length for piece in plan[k])
            bits, nbytes = aggregator.sign_message_layout(numel)
            # Telemetry's local seconds: the packing shares its pass with Lion's direction and the
            # momentum update, so the pass counts whole (as the unpacking with the update, below).
            message = watch.timed(k, prepare_sign_message, entries, plan[k], positive_ties, bits, nbytes)
            if watch.wants_signs:
                watch.local_signs(k, sign_bits_of_message(message, bits, numel))
            return watch.timed(k, aggregator.issue, message, numel, positive_ties)
        prepared = prepare_bucket(entries, plan[k], scratch, whole_mean_abs, aggregator, context.first_key_tensor)
        if watch.wants_signs:  # taken before the buffer is reused
            watch.local_signs(k, pack_local_signs(prepared.values, positive_ties))
        return watch.timed(k, aggregator.start, prepared, positive_ties)

    run_bucket_schedule(entries, plan, aggregator, start, scratch, watch, context.pipelined)


def run_bucket_schedule(
    entries: list[Entry],
    plan: list[list[Piece]],
    aggregator: Aggregator,
    start: Callable[[int], object],
    scratch: BucketBuffers,
    watch: BucketWatch,
    pipelined: bool,
) -> None:
    """``start(k)`` (bucket k's first collective, issued), then reduce, complete and apply, per bucket,
    pipelined or serially (see :func:`compressed_step`).

    A sign vote's result is applied packed (:func:`~ds_lioncub.step.bucket_work.apply_voted_signs`), any
    other unpacked into ``scratch`` (:func:`~ds_lioncub.step.bucket_work.apply_bucket`). ``watch`` times
    each bucket's aggregation stages (and a sign vote's fused apply) and, where ``start`` gave it this
    rank's signs, counts them against the applied direction.
    """
    packed_signs = aggregator.votes_packed_signs

    def issue(k: int) -> object:
        pending = start(k)
        watch.issued(k, pending)
        return pending

    def complete(done: int, result: object) -> None:
        if packed_signs:
            voted = watch.timed(done, aggregator.complete_packed, result)
            numel = sum(piece.length for piece in plan[done])
            if watch.counts(done):
                watch.voted(done, aggregator, unpack_signs(voted, numel))
            # The received messages are released (by voted) before the update is applied.
            watch.timed(done, apply_voted_signs, entries, plan[done], voted)
            watch.bucket_done(done, numel)
        else:
            out = scratch.for_bucket(entries, plan[done])
            delta = watch.timed(done, aggregator.complete, result, out)
            watch.bucket_done(done, delta.numel())
            if watch.counts(done):
                watch.voted(done, aggregator, delta)
            apply_bucket(entries, plan[done], delta)

    run_three_stages(
        len(plan),
        issue,
        lambda k, pending: watch.timed(k, aggregator.reduce, pending),
        complete,
        pipelined=pipelined,
    )


def overlapped_step(
    entries: list[Entry], armed: ArmedBackward, step: int, positive_ties: bool, context: StepContext
) -> int:
    """The step of an armed backward: check its votes against the final gradients, vote again where
    needed. Returns how many buckets were voted again.

    Every bucket is packed again from the final gradients (after whatever clipping, unscaling or
    user code changed them since the hooks ran) and compared with what this rank sent. One int32
    all-reduce of [ranks with non-finite gradients, per bucket: ranks whose message changed]
    makes the verdict collective. A bucket no rank changed keeps its vote: its result is a
    function of the messages and the tie rule only, which are then the serial step's. A bucket
    some rank changed is voted again from every rank's final message (the guess is waited for
    and dropped). So the result is bit-identical to the step without overlap, whatever happened
    to the gradients. The momentum is updated after the verdict, so a refused step changes nothing.
    """
    vote = armed.vote
    armed.flush()
    # The same tie rule and parameters as when armed (else no message is kept: every bucket is voted again).
    same_setting = (
        armed.positive_ties == positive_ties
        and len(entries) == len(armed.stepped)
        and all(entry.param is param for entry, param in zip(entries, armed.stepped, strict=False))
    )
    capacity = context.bucket_size
    whole_mean_abs = whole_tensor_mean_abs(entries, capacity) if vote.needs_whole_tensor_mean_abs else {}
    scratch = BucketBuffers(armed.plan)
    watch = context.telemetry.watch(vote.transport)
    changed = []
    for k, (bucket, launched) in enumerate(zip(armed.plan, armed.launched, strict=True)):
        values = bucket_directions(entries, bucket, scratch.for_bucket(entries, bucket), whole_mean_abs, vote)
        if watch.wants_signs:
            watch.local_signs(k, pack_local_signs(values.values, positive_ties))
        final = watch.timed(k, vote.pack, values, positive_ties)
        same = same_setting and torch.equal(final, launched.message)
        if not same:
            launched.message = final  # what a vote again sends
        changed.append(0 if same else 1)
    bad = non_finite_parameters(entries) if context.check_finite else []
    device = entries[0].grad.device if entries else torch.device("cpu")
    verdict = torch.tensor([1 if bad else 0, *changed], dtype=torch.int32, device=device)
    context.agreement.all_reduce_sum(verdict)
    counts = verdict.tolist()
    if counts[0]:
        armed.drain()
    raise_if_non_finite(counts[0], bad, step, context)
    revoted = 0
    for count in counts[1:]:
        if count:
            revoted += 1
            watch.revoted_bucket()
    for bucket in armed.plan:
        update_bucket_momenta(entries, bucket)

    def start(k: int) -> object:
        launched = armed.launched[k]
        if not counts[1 + k]:
            return launched.pending
        vote.transport.wait(launched.pending.received)
        numel = sum(piece.length for piece in armed.plan[k])
        return watch.timed(k, vote.issue, launched.message, numel, positive_ties)

    run_bucket_schedule(entries, armed.plan, vote, start, scratch, watch, context.pipelined)
    return revoted


def run_step_path(
    entries: list[Entry],
    step: int,
    positive_ties: bool,
    aggregator: Aggregator | None,
    transport: Transport,
    overlap: OverlapController,
    context: StepContext,
) -> None:
    """Step ``entries`` by the path that fits: exact Lion when ``aggregator`` is None or averages gradients
    (over ``transport``), the armed backward's votes when ``overlap`` holds one (counting the buckets voted
    again), else the compressed step after the agreed non-finite check (``context.check_finite``; its verdict
    ``context.ranks_not_finite`` where the step's sketch carried it)."""
    if aggregator is None or aggregator.reduces_gradients:
        exact_lion_step(entries, aggregator, transport, context)
        return
    armed = overlap.take_armed()
    if armed is not None:
        overlap.revoted_buckets += overlapped_step(entries, armed, step, positive_ties, context)
        return
    if context.check_finite:
        if context.ranks_not_finite is None:
            require_finite_gradients(entries, step, context)
        elif context.ranks_not_finite:
            raise_if_non_finite(context.ranks_not_finite, non_finite_parameters(entries), step, context)
    compressed_step(entries, aggregator, positive_ties, context)


def sign_bits_of_message(message: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` sign fields of a ``bits``-wide sign message as 1-bit signs, unpadded: what
    :func:`~ds_lioncub.telemetry.pack_local_signs` gives for the direction the message was packed from."""
    if bits == 1:
        return message[: packed_length(numel)]  # padding bits are 0, as pack_local_signs leaves them
    return pack_fields(unpack_fields(message, bits, numel), 1)


__all__ = [
    "StepContext",
    "compressed_step",
    "exact_lion_step",
    "overlapped_step",
    "participants",
    "raise_if_non_finite",
    "require_finite_gradients",
    "run_bucket_schedule",
    "run_step_path",
    "runs_finite_check",
    "sign_bits_of_message",
]

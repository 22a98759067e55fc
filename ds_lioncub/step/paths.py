"""The step paths of a rank's step (:class:`~ds_lioncub.step.rank_step.RankStep`): how one optimizer step runs over
its buckets, as explicit stages in rounds.

Every path cuts the participating parameters into buckets (:mod:`ds_lioncub.step.bucket_plan`) and runs each
bucket's local halves (:mod:`ds_lioncub.step.bucket_work`) around its aggregation (:mod:`ds_lioncub.aggregation`):

- :func:`exact_lion_rounds`: exact Lion on each bucket's gradients, averaged over the ranks unless the caller
  already did (compression "none", or a world of one);
- :func:`compressed_rounds`: every bucket through :class:`CompressedBuckets`' stages (prepare and issue, reduce,
  complete and apply) in the bucket schedule (:func:`~ds_lioncub.comm.schedule.staged_rounds`);
- :func:`overlapped_rounds`: the step of an armed backward (option ``overlap``), whose votes left during
  backward: checked against the final gradients and voted again where a message changed.

Each path is a generator that yields after every round: a round issues collectives and reads only results of
collectives issued in earlier rounds. A rank of a real job runs the rounds one after the other; the virtual world
runs each round on every one of its workers before the next (:mod:`ds_lioncub.simulate.world`). The stages report
to an observer (:mod:`ds_lioncub.step.events`), never to telemetry itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_lioncub.aggregation import Aggregator, Bucket
from ds_lioncub.comm.packing import pack_fields, pack_signs, packed_length, unpack_fields, unpack_signs
from ds_lioncub.comm.schedule import staged_rounds
from ds_lioncub.comm.transport import Summing, Transport
from ds_lioncub.errors import UnsupportedParameterError
from ds_lioncub.step.bucket_plan import Piece, plan_buckets
from ds_lioncub.step.bucket_work import (
    BucketBuffers,
    Entry,
    apply_bucket,
    apply_voted_signs,
    bucket_directions,
    exact_lion_bucket,
    grad_piece,
    non_finite_parameters,
    prepare_bucket,
    prepare_sign_message,
    update_bucket_momenta,
    whole_tensor_mean_abs,
)
from ds_lioncub.step.events import StageClock, StepEvents
from ds_lioncub.step.finite_check import ParameterLabel, finite_check_rounds, raise_if_non_finite
from ds_lioncub.step.overlap import ArmedBackward, OverlapController


@dataclass(frozen=True)
class StepContext:
    """What a step path needs besides the parameters and the aggregation.

    Attributes:
        bucket_size: elements per bucket (option ``bucket_size``).
        pipelined: run the bucket schedule pipelined (the default) or bucket by bucket.
        events: the observer the stages report to (:mod:`ds_lioncub.step.events`).
        agreement: the ranks whose non-finite verdicts must agree (the voters, or the whole world under
            the ZeRO hybrid, summed inside each node and then across the nodes).
        check_finite: option ``check_finite``.
        label: how errors name a parameter.
        first_key_tensor: the number of this call's first tensor in bucket keys
            (:meth:`~ds_lioncub.step.engine_side.EngineSide.bucket_keys_from`).
        ranks_not_finite: the non-finite check's verdict when the step's sketch carried it (how many ranks have a
            non-finite gradient, agreed by the sketch's all-reduce); None: the path agrees on it by its own
            all-reduce.
        applies: whether this rank applies the result to the parameters. Every rank of a real job does; the
            virtual world's workers share one copy of the parameters, which its worker 0 updates.
        buffers: the fp32 scratch the buckets take turns in (None: the path makes its own); the virtual world's
            workers share one.
    """

    bucket_size: int
    pipelined: bool
    events: StepEvents
    agreement: Summing
    check_finite: bool
    label: ParameterLabel
    first_key_tensor: int = 0
    ranks_not_finite: int | None = None
    applies: bool = True
    buffers: BucketBuffers | None = None


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


def exact_lion_rounds(
    entries: list[Entry], mean: Aggregator | None, transport: Transport, context: StepContext
) -> Iterator[None]:
    """Exact Lion on each bucket's gradients, averaged over the ranks of ``transport`` by ``mean`` unless it is
    None: per bucket, the mean's collective issued (a round), then the average taken and Lion applied."""
    clock = StageClock(transport)
    plan = plan_buckets([entry.param.numel() for entry in entries], context.bucket_size)
    for k, bucket in enumerate(plan):
        grads = [grad_piece(entries[piece.tensor_index].grad, piece) for piece in bucket]
        if mean is not None:
            sizes = [piece.length for piece in bucket]
            with clock.timing(k):
                pending = mean.start(Bucket(torch.cat(grads), sizes, []), True)
            yield
            if context.applies:
                with clock.timing(k):
                    grads = list(mean.finish(pending).split(sizes))
            context.events.bucket_done(k, 0, clock.take(k))
        if context.applies:
            exact_lion_bucket(entries, bucket, grads)


class CompressedBuckets:
    """A compressed step's buckets as explicit stages, each callable on its own: :meth:`prepare` (Lion's
    direction and the momentum update, into a message or the scratch), :meth:`issue` (the first collective),
    :meth:`reduce`, and :meth:`finish` (complete, then apply). :meth:`stages` lists them for the schedule.

    Sign votes (1-bit, k-bit of signs) keep no fp32 bucket at all: prepare is
    :func:`~ds_lioncub.step.bucket_work.prepare_sign_message` (one pass where compiled) and finish applies the voted
    signs packed (:func:`~ds_lioncub.step.bucket_work.apply_voted_signs`). The other modes build the fp32 bucket of
    ``c``. Both give the same bits (tests/unit/test_fused_step.py). An aggregation that agrees on something before
    it can start (EF21's shared scale) issues that collective at prepare, so its start waits a round later.
    """

    def __init__(
        self,
        entries: list[Entry],
        aggregator: Aggregator,
        positive_ties: bool,
        context: StepContext,
        plan: list[list[Piece]] | None = None,
    ) -> None:
        self.entries = entries
        self.aggregator = aggregator
        self.positive_ties = positive_ties
        self.context = context
        capacity = context.bucket_size
        self.plan = plan if plan is not None else plan_buckets([entry.param.numel() for entry in entries], capacity)
        self.scratch = context.buffers if context.buffers is not None else BucketBuffers(self.plan)
        self.whole_mean_abs = whole_tensor_mean_abs(entries, capacity) if aggregator.needs_whole_tensor_mean_abs else {}
        self.clock = StageClock(aggregator.transport)
        #: Each bucket's elements, counted once.
        self.numels = [sum(piece.length for piece in bucket) for bucket in self.plan]

    def stages(self) -> list[Callable[[int, Any], Any]]:
        """The stages in schedule order: ``stage(k, what the stage before returned)``."""
        if self.aggregator.agrees_before_start:
            return [lambda k, _: self.prepare(k), self.issue, self.reduce, self.finish]
        return [lambda k, _: self.issue(k, self.prepare(k)), self.reduce, self.finish]

    def prepare(self, k: int) -> Any:
        """Bucket ``k``'s local work before the vote: a sign vote's packed message, else the bucket of ``c``."""
        events, aggregator, bucket = self.context.events, self.aggregator, self.plan[k]
        events.bucket_starting(k)
        if aggregator.votes_packed_signs:
            bits, nbytes = aggregator.sign_message_layout(self.numels[k])
            # The packing shares its pass with Lion's direction and the momentum update: the pass counts whole.
            with self.clock.timing(k):
                message = prepare_sign_message(self.entries, bucket, self.positive_ties, bits, nbytes)
            if events.wants_signs:
                events.local_signs(k, sign_bits_of_message(message, bits, self.numels[k]))
            return message
        first_key = self.context.first_key_tensor
        prepared = prepare_bucket(self.entries, bucket, self.scratch, self.whole_mean_abs, aggregator, first_key)
        if events.wants_signs:  # taken before the buffer is reused
            events.local_signs(k, pack_signs(prepared.values, self.positive_ties))
        if aggregator.agrees_before_start:
            with self.clock.timing(k):
                aggregator.agree(prepared)  # takes what start needs: the scratch is free again
        return prepared

    def issue(self, k: int, prepared: Any) -> object:
        """Bucket ``k``'s first collective."""
        pending: object
        with self.clock.timing(k):
            if self.aggregator.votes_packed_signs:
                pending = self.aggregator.issue(prepared, self.numels[k], self.positive_ties)
            else:
                pending = self.aggregator.start(prepared, self.positive_ties)
        self.context.events.issued(k, pending)
        return pending

    def reduce(self, k: int, pending: object) -> object:
        with self.clock.timing(k):
            return self.aggregator.reduce(pending)

    def finish(self, k: int, result: object) -> None:
        """Bucket ``k``'s result completed and applied (where this rank applies); its local seconds reported."""
        events, aggregator, bucket = self.context.events, self.aggregator, self.plan[k]
        if not self.context.applies:
            events.bucket_done(k, self.numels[k], self.clock.take(k))
            return
        if aggregator.votes_packed_signs:
            with self.clock.timing(k):
                voted = aggregator.complete_packed(result)
            if events.wants_applied(k):
                events.applied(k, aggregator, unpack_signs(voted, self.numels[k]))
            # The received messages are released (by voted) before the update is applied.
            with self.clock.timing(k):
                apply_voted_signs(self.entries, bucket, voted)
            events.bucket_done(k, self.numels[k], self.clock.take(k))
        else:
            with self.clock.timing(k):
                delta = aggregator.complete(result, self.scratch.for_bucket(self.entries, bucket))
            events.bucket_done(k, delta.numel(), self.clock.take(k))
            if events.wants_applied(k):
                events.applied(k, aggregator, delta)
            apply_bucket(self.entries, bucket, delta)


def compressed_rounds(
    entries: list[Entry], aggregator: Aggregator, positive_ties: bool, context: StepContext
) -> Iterator[None]:
    """Every bucket through :class:`CompressedBuckets`' stages in the bucket schedule.

    The schedule is the same on every rank, so every rank issues the same collectives in the same order.
    Pipelined (the default), round k runs [prepare and issue bucket k] [bucket k-1: wait, reduce, issue its
    second] [bucket k-2: wait, complete, apply]: while one bucket's messages travel, the next is prepared and an
    earlier one applied. Each bucket's result is a function of the ranks' packed messages and the step's tie rule
    only, so the schedule changes when work happens, never a bit of its result. Serial, each bucket runs to the
    end before the next starts. Between stages only packed messages are kept: in the L1 and "mean" modes one
    bucket-sized fp32 buffer holds the update being prepared, then the result being applied.
    """
    buckets = CompressedBuckets(entries, aggregator, positive_ties, context)
    yield from staged_rounds(len(buckets.plan), buckets.stages(), context.pipelined)


def overlapped_rounds(
    entries: list[Entry],
    armed: ArmedBackward,
    overlap: OverlapController,
    step: int,
    positive_ties: bool,
    context: StepContext,
) -> Iterator[None]:
    """The step of an armed backward: check its votes against the final gradients, vote again where needed
    (counted in ``overlap.revoted_buckets`` and by :meth:`~ds_lioncub.step.events.StepEvents.revoted_bucket`).

    Every bucket is packed again from the final gradients (after whatever clipping, unscaling or user code changed
    them since the hooks ran) and compared with what this rank sent. One int32 all-reduce of [ranks with
    non-finite gradients, per bucket: ranks whose message changed] makes the verdict collective. A bucket no rank
    changed keeps its vote: its result is a function of the messages and the tie rule only, which are then the
    serial step's. A bucket some rank changed is voted again from every rank's final message (the guess is waited
    for and dropped). So the result is bit-identical to the step without overlap, whatever happened to the
    gradients. The momentum is updated after the verdict, so a refused step changes nothing.
    """
    vote = armed.vote
    armed.flush()
    # The same tie rule and parameters as when armed (else no message is kept: every bucket is voted again).
    same_setting = (
        armed.positive_ties == positive_ties
        and len(entries) == len(armed.stepped)
        and all(entry.param is param for entry, param in zip(entries, armed.stepped, strict=False))
    )
    buckets = CompressedBuckets(entries, vote, positive_ties, context, armed.plan)
    events, clock = context.events, buckets.clock
    changed = []
    for k, (bucket, launched) in enumerate(zip(armed.plan, armed.launched, strict=True)):
        out = buckets.scratch.for_bucket(entries, bucket)
        values = bucket_directions(entries, bucket, out, buckets.whole_mean_abs, vote)
        if events.wants_signs:
            events.local_signs(k, pack_signs(values.values, positive_ties))
        with clock.timing(k):
            final = vote.pack(values, positive_ties)
        same = same_setting and torch.equal(final, launched.message)
        if not same:
            launched.message = final  # what a vote again sends
        changed.append(0 if same else 1)
    bad = non_finite_parameters(entries) if context.check_finite else []
    device = entries[0].grad.device if entries else torch.device("cpu")
    verdict = torch.tensor([1 if bad else 0, *changed], dtype=torch.int32, device=device)
    context.agreement.all_reduce_sum(verdict)
    yield
    counts = verdict.tolist()
    if counts[0]:
        armed.drain()
    raise_if_non_finite(counts[0], bad, step, context.agreement.world_size, context.label)
    for count in counts[1:]:
        if count:
            overlap.revoted_buckets += 1
            events.revoted_bucket()
    for bucket in armed.plan:
        update_bucket_momenta(entries, bucket)

    def start(k: int, _: object) -> object:
        launched = armed.launched[k]
        if not counts[1 + k]:
            events.issued(k, launched.pending)
            return launched.pending
        vote.transport.wait(launched.pending.received)
        with clock.timing(k):
            pending = vote.issue(launched.message, buckets.numels[k], positive_ties)
        events.issued(k, pending)
        return pending

    yield from staged_rounds(len(armed.plan), [start, buckets.reduce, buckets.finish], context.pipelined)


def step_path_rounds(
    entries: list[Entry],
    step: int,
    positive_ties: bool,
    aggregator: Aggregator | None,
    transport: Transport,
    overlap: OverlapController,
    context: StepContext,
) -> Iterator[None]:
    """Step ``entries`` by the path that fits: exact Lion when ``aggregator`` is None or averages gradients
    (over ``transport``), the armed backward's votes when ``overlap`` holds one, else the compressed step after
    the agreed non-finite check (``context.check_finite``; its verdict ``context.ranks_not_finite`` where the
    step's sketch carried it)."""
    if aggregator is None or aggregator.reduces_gradients:
        yield from exact_lion_rounds(entries, aggregator, transport, context)
        return
    armed = overlap.take_armed()
    if armed is not None:
        yield from overlapped_rounds(entries, armed, overlap, step, positive_ties, context)
        return
    if context.check_finite:
        if context.ranks_not_finite is None:
            yield from finite_check_rounds(entries, step, context.agreement, context.label)
        elif context.ranks_not_finite:
            count = context.ranks_not_finite
            raise_if_non_finite(
                count, non_finite_parameters(entries), step, context.agreement.world_size, context.label
            )
    yield from compressed_rounds(entries, aggregator, positive_ties, context)


def sign_bits_of_message(message: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` sign fields of a ``bits``-wide sign message as 1-bit signs, unpadded: what
    :func:`~ds_lioncub.comm.packing.pack_signs` gives for the direction the message was packed from."""
    if bits == 1:
        return message[: packed_length(numel)]  # padding bits are 0, as pack_signs leaves them
    return pack_fields(unpack_fields(message, bits, numel), 1)


__all__ = [
    "CompressedBuckets",
    "StepContext",
    "compressed_rounds",
    "exact_lion_rounds",
    "overlapped_rounds",
    "participants",
    "sign_bits_of_message",
    "step_path_rounds",
]

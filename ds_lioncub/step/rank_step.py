"""One rank's Lion Cub step: the object that :class:`~ds_lioncub.LionCub` owns on each rank, and of which the virtual
world drives N (:class:`~ds_lioncub.simulate.VirtualLionCub`).

It is composed of what a step needs on a rank: who it talks to (:class:`~ds_lioncub.step.wiring.Wiring`: the
voters' transport, the agreement group and its sums), the aggregation (built once, :mod:`ds_lioncub.aggregation`),
option ``clip`` and the noise scale (:class:`~ds_lioncub.step.clipping.ClipState`), option ``overlap``
(:class:`~ds_lioncub.step.overlap.OverlapController`) and the post-step hooks (momentum sync, the replica check).
An observer (:mod:`ds_lioncub.step.events`) hears what the stages do: telemetry on LionCub's ranks.

:meth:`RankStep.rounds` is the step as explicit stages, in rounds (:mod:`ds_lioncub.step.rounds`): the sketch (when
option ``clip`` or the noise scale wants it), the path for the aggregation (:mod:`ds_lioncub.step.paths`: the
agreed non-finite check, then every bucket through prepare, issue, reduce, complete and apply), then the post-step
hooks. A rank of a real job runs the rounds one after the other; the virtual world runs each on all its workers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
import torch.distributed as dist

from ds_lioncub.aggregation import Aggregator, build_aggregation
from ds_lioncub.comm.quantize import tie_sign
from ds_lioncub.comm.transport import CommStats, LevelledSum, Transport, make_transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.bucket_work import BucketBuffers, Entry
from ds_lioncub.step.clipping import ClipState
from ds_lioncub.step.events import NO_EVENTS, StepEnded, StepEvents
from ds_lioncub.step.finite_check import ParameterLabel, runs_finite_check
from ds_lioncub.step.overlap import OverlapController
from ds_lioncub.step.paths import StepContext, step_path_rounds
from ds_lioncub.step.post_step import MomentumSync, PostStepHook, ReplicaCheck, StepDone
from ds_lioncub.step.wiring import Wiring


class RankStep:
    """One rank's step and everything it keeps between steps.

    Args:
        options: the validated options (``compression`` resolved: not ``"auto"``).
        transport: the voters' group; the agreement group too until :class:`Wiring` says otherwise.
        clip_shard: which shard's signs this rank's sketch draws (:func:`~ds_lioncub.step.clipping.clip_shard_of`).
        build_aggregation_now: build the aggregation here, else at the first use or :meth:`build_aggregation`.

    Attributes:
        wiring: who the step communicates with (:meth:`~ds_lioncub.LionCub.bind` changes it).
        clip: option ``clip`` and the noise scale.
        overlap: option ``overlap``'s vote and armed backward.
        momentum_sync: option ``momentum_sync``'s selection.
        post_step_hooks: what runs after every step, in order (:mod:`ds_lioncub.step.post_step`).
        events: the observer of the stages (:data:`~ds_lioncub.step.events.NO_EVENTS`: none).
        pipelined: the compressed buckets' schedule: pipelined (the default) or one bucket after another.
        applies: whether this rank applies the result (the virtual world's workers 1..N-1 share worker 0's
            parameters, so only worker 0 does).
        buffers: the fp32 bucket scratch, when shared (the virtual world's workers share one); None: per step.
    """

    def __init__(
        self, options: LionCubConfig, transport: Transport, *, clip_shard: int = 0, build_aggregation_now: bool = True
    ) -> None:
        self.options = options
        self.wiring = Wiring(transport, transport, transport, clip_shard=clip_shard)
        self.clip = ClipState(options, self.wiring)
        self.overlap = OverlapController()
        self.momentum_sync = MomentumSync(options.momentum_sync)
        self.post_step_hooks: list[PostStepHook] = [self.momentum_sync, ReplicaCheck(options.consistency_check)]
        self.events: StepEvents = NO_EVENTS
        self.pipelined = True
        self.applies = True
        self.buffers: BucketBuffers | None = None
        self._aggregator: Aggregator | None = None
        self._aggregation_pending = True
        if build_aggregation_now:
            self.build_aggregation()

    def set_options(self, options: LionCubConfig) -> None:
        """Run with ``options`` from now on (the DeepSpeed wiring resolves option ``clip`` after construction): the
        clip, momentum sync and the replica check read them; the aggregation, built for the same compression, stays."""
        self.options = options
        self.clip.options = options
        self.momentum_sync.options = options.momentum_sync
        for hook in self.post_step_hooks:
            if isinstance(hook, ReplicaCheck):
                hook.options = options.consistency_check

    @property
    def transport(self) -> Transport:
        """The voters' group."""
        return self.wiring.transport

    @property
    def aggregator(self) -> Aggregator | None:
        """The aggregation the step runs (None: the gradients as they are, a world of one), built once."""
        if self._aggregation_pending:  # built later (LionCub.from_config's bound_later) and stepped before that
            self.build_aggregation()
        return self._aggregator

    def build_aggregation(self) -> None:
        """The aggregation over the voters' transport, for gradients the caller averages or not: at construction,
        and again by each re-binding, which may change either."""
        self._aggregator = build_aggregation(self.options, self.transport, self.wiring.gradients_are_averaged)
        self._aggregation_pending = False

    def rewire(
        self,
        transport: Transport,
        clip_shard: int,
        agreement_group: dist.ProcessGroup | None,
        agreement_levels: Sequence[dist.ProcessGroup | None] | None,
        gradients_averaged: bool,
        params_are_replicas: bool,
    ) -> None:
        """Communicate over ``transport`` (:meth:`ds_lioncub.LionCub.bind`); the aggregation is built again at the
        end, for the voters and gradients as they are now.

        ``agreement_group``: the ranks that must all skip a step together when one has a non-finite gradient, when
        they are more than the voters (under the ZeRO hybrid: the whole world). ``agreement_levels``: the same ranks
        as a grid of groups, this rank's group at each level (None: a group of one rank), e.g. its node, then its
        vote group across the nodes: the per-step sums (the finite check, option clip's sketch) then run one
        all-reduce per level (:mod:`ds_lioncub.comm.transport.levels`).
        """
        wiring = self.wiring
        wiring.transport, wiring.clip_shard = transport, clip_shard
        # The agreement group holds more ranks than the voters (the whole world under the ZeRO hybrid); an MPI
        # transport spans the MPI world, which is the voters' group, so torch.distributed carries the agreement.
        wiring.agreement_transport = (
            transport if agreement_group is None else make_transport(agreement_group, comm_backend_name="torch")
        )
        wiring.agreement_sum = wiring.agreement_transport
        if agreement_levels is not None:
            groups = [group for group in agreement_levels if group is not None]
            wiring.agreement_sum = LevelledSum([make_transport(group, comm_backend_name="torch") for group in groups])
            if wiring.agreement_sum.world_size != wiring.agreement_transport.world_size:
                raise LionCubSetupError(
                    f"LionCub: the agreement levels span {wiring.agreement_sum.world_size} ranks, the agreement group "
                    f"{wiring.agreement_transport.world_size}; pass levels that tile the agreement group."
                )
        wiring.gradients_are_averaged = gradients_averaged
        wiring.params_are_replicas = params_are_replicas
        self.build_aggregation()

    def comm_stats(self) -> CommStats:
        """Collectives issued and bytes sent / received by this rank's steps so far (not the set-up check)."""
        wiring = self.wiring
        stats = wiring.transport.stats + CommStats()  # a copy: the transport keeps counting
        if wiring.agreement_transport is not wiring.transport:  # the world-wide replica verdicts under ZeRO hybrid
            stats = stats + wiring.agreement_transport.stats
        if wiring.agreement_sum is not wiring.agreement_transport:  # the finite check and clip's sketch, in levels
            stats = stats + wiring.agreement_sum.stats
        return stats + self.overlap.traffic()  # votes started during backward, and those voted again

    def rounds(
        self,
        entries: list[Entry],
        step: int,
        label: ParameterLabel,
        *,
        in_parts: bool = False,
        first_key_tensor: int = 0,
        finish: Callable[[], StepDone],
    ) -> Generator[None, None, None]:
        """Step ``step`` of ``entries`` as its stages, in rounds (:mod:`ds_lioncub.step.rounds`).

        ``label`` names parameters in errors; ``in_parts``: this is one part of a step (DeepSpeed's ZeRO), whose
        tensors are numbered from ``first_key_tensor`` in bucket keys. ``finish`` is called once the update is
        applied, before the post-step hooks: the caller advances its step count there and says what the hooks see.
        """
        positive_ties = tie_sign(step, self.options.tie_break) > 0
        self.events.step_started(self._traffic_not_this_steps())
        # Option clip and the noise scale share one sketch, taken before any path reads the gradients (and before
        # the finite check, which may then refuse the step: the noise scale leaves non-finite steps out). Its
        # all-reduce carries the finite check's verdict where the path runs that check (one collective, not two).
        ranks_not_finite = None
        if self.clip.sketches_each_step:
            carry = runs_finite_check(self.aggregator, self.overlap, self.options.check_finite)
            ranks_not_finite = yield from self.clip.step_sketch_rounds(entries, step, in_parts, carry)
            # A round of its own: every rank's gradients are scaled before any rank's first bucket starts (the
            # virtual world's observers read every worker's gradients when worker 0 starts a bucket).
            yield
        context = StepContext(
            self.options.bucket_size,
            self.pipelined,
            self.events,
            self.wiring.agreement_sum,
            self.options.check_finite,
            label,
            first_key_tensor,
            ranks_not_finite,
            self.applies,
            self.buffers,
        )
        yield from step_path_rounds(
            entries, step, positive_ties, self.aggregator, self.transport, self.overlap, context
        )
        done = finish()
        for hook in self.post_step_hooks:
            yield from hook(done)
        noise_scale = self.clip.noise_scale.record() if self.clip.measures_noise_scale else None
        self.events.step_ended(StepEnded(step, self.transport, self.comm_stats, self.aggregator, noise_scale))

    def done(
        self, step: int, params: list[torch.Tensor], names: list[str] | None, momenta: list[torch.Tensor | None]
    ) -> StepDone:
        """What the post-step hooks see after step ``step``: ``params`` and their ``names`` and this rank's
        ``momenta`` by flat position, with this rank's groups."""
        wiring = self.wiring
        return StepDone(
            step,
            params,
            names,
            momenta,
            wiring.transport,
            wiring.agreement_transport,
            wiring.params_are_replicas,
            self.options.bucket_size,
        )

    def _traffic_not_this_steps(self) -> CommStats:
        """The traffic so far, less what a caller sent for this step before it (option clip's sketch, taken first by
        a caller that steps in parts) and the votes an armed backward launched for it."""
        traffic = self.comm_stats()
        armed = self.overlap.armed
        if armed is not None:
            traffic = traffic - armed.traffic_since_armed()
        return traffic - self.clip.take_traffic_before_step()


__all__ = ["RankStep"]

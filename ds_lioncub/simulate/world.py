"""VirtualLionCub: N data-parallel Lion Cub workers in one process, through the library's own aggregations.

In Lion Cub every replica applies the same update, so N workers need one copy of the parameters and
N momenta. Each step, every worker computes its pre-sign update from its own gradient and momentum,
the aggregation combines the N messages as the collectives would, and the shared parameters take
the result. Nothing here re-implements the step: each worker runs the rank's step that :class:`~ds_lioncub.LionCub`
runs on each rank (:class:`~ds_lioncub.step.rank_step.RankStep`: the sketch and option ``clip``, the non-finite
check, the bucket stages, the aggregation :func:`~ds_lioncub.aggregation.build_aggregation` builds for a real rank,
momentum sync), over a :class:`VirtualTransport` whose network moves the bytes in memory. A collective completes
when the last worker issues it, so the world runs each round of the step (:mod:`ds_lioncub.step.rounds`) on every
worker before the next. Worker 0 applies the update to the one copy of the parameters. So at p = 2-4 the
parameters and every worker's momentum equal real LionCub's on p gloo ranks bit for bit (tests/distributed), which
is what makes a loss curve at 16-64 workers evidence.

Memory: the parameters once, plus one momentum per worker (``(N, *shape)`` per parameter; exact Lion
keeps one, since every worker's is the same), plus one bucket of fp32 scratch and the messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ds_lioncub.aggregation import AggregationState
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.errors import LionCubError, NonFiniteGradientError
from ds_lioncub.simulate.agreement import AgreementStats, AgreementTally
from ds_lioncub.simulate.drift import DriftTally
from ds_lioncub.simulate.inputs import NETWORK_OPTIONS, checked_gradients, or_zeros, refuse_options
from ds_lioncub.simulate.observers import StepComparison, WorkerEvents
from ds_lioncub.simulate.transport import VirtualNetwork
from ds_lioncub.step.bucket_plan import Piece, plan_buckets
from ds_lioncub.step.bucket_work import BucketBuffers, Entry, check_param_group, non_finite_parameters
from ds_lioncub.step.finite_check import ParameterLabel
from ds_lioncub.step.noise_scale import NoiseScale
from ds_lioncub.step.param_selection import names_by_position
from ds_lioncub.step.post_step import StepDone
from ds_lioncub.step.rank_step import RankStep
from ds_lioncub.step.rounds import run_in_lockstep


class VirtualLionCub(torch.optim.Optimizer):
    """Lion Cub over ``workers`` virtual data-parallel workers in one process.

    Args:
        params: as for :class:`~ds_lioncub.LionCub`: tensors, ``(name, tensor)`` pairs (names select
            momentum-sync layers), or param groups with their own lr, betas, weight_decay.
        workers: N, the virtual data-parallel world size.
        lr, betas, weight_decay: Lion's hyper-parameters (a learning-rate scheduler changes the groups').
        module: the model, for ``momentum_sync.layers="auto"`` and names.
        agreement_stats: record :attr:`last_agreement` each compressed step (one more pass over every
            worker's ``c`` and one over the result).
        drift_stats: record how the compressed steps' sign errors add up over steps in :attr:`drift`
            (:mod:`ds_lioncub.simulate.drift`; the same pass over ``c``, three int32 tensors per parameter).
        **options: LionCub's options (compression, bits, quantizer, aggregation, kbit_algorithm,
            tie_break, l1_clip, comm_dtype, bucket_size, check_finite, momentum_sync, clip), validated as
            LionCub validates them (a k-bit all-reduce too narrow for N workers raises LionCub's error).
            Options that need a real network or job (:data:`NETWORK_OPTIONS`, ``compression="auto"``,
            ``telemetry.vote_stats``) are refused; ``telemetry.noise_scale`` (on by default) measures the gradient
            noise scale as LionCub's ranks do (:attr:`noise_scale`).

    ``step(worker_grads)`` takes ``worker_grads[i][j]``, worker i's gradient of parameter j in the
    order of ``params`` (``None``: zeros, as on a real rank whose parameter got no gradient).
    """

    def __init__(
        self,
        params: Iterable[Any],
        workers: int,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        module: nn.Module | None = None,
        agreement_stats: bool = False,
        drift_stats: bool = False,
        **options: Any,
    ) -> None:
        refuse_options(workers, options)
        self.options: LionCubConfig = parse_config({"lr": lr, "betas": betas, "weight_decay": weight_decay, **options})
        self.workers = workers
        self.module = module
        self.agreement_stats = agreement_stats
        #: What the last compressed step's update agreed with exact Lion (``agreement_stats=True``), else None.
        self.last_agreement: AgreementStats | None = None
        #: How the compressed steps' sign errors add up over steps, per tensor (``drift_stats=True``), else None.
        self.drift: DriftTally | None = DriftTally() if drift_stats else None
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        self._ready = False
        super().__init__(params, defaults)
        self.network = VirtualNetwork(workers)
        #: One rank's step per worker, each over its own rank of the network, as LionCub builds it on a real rank;
        #: worker 0 applies the update to the parameters all of them share.
        self.ranks = [RankStep(self.options, transport) for transport in self.network.transports]
        self._events = [WorkerEvents(worker) for worker in range(workers)]
        for worker, rank in enumerate(self.ranks):
            rank.applies = worker == 0
            rank.events = self._events[worker]
            # Exact Lion keeps one momentum, every worker's: nothing to average (and no replicas to compare).
            rank.post_step_hooks = [] if self.exact else [rank.momentum_sync]
        self._select_synced()
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, with LionCub's checks (valid lr / betas / weight decay, steppable parameters); a
        group added later joins the momentum-sync selection as in LionCub."""
        param_group.setdefault("step", self.param_groups[0]["step"] if self.param_groups else 0)
        super().add_param_group(param_group)
        try:
            check_param_group(self.param_groups[-1])
        except LionCubError:
            self.param_groups.pop()
            raise
        if self._ready:
            self._select_synced()

    def _select_synced(self) -> None:
        """The parameters' names by flat position, and the positions whose momenta momentum sync averages (chosen once,
        shared by every worker)."""
        self._names = names_by_position(self.param_groups, self.module)
        first = self.ranks[0].momentum_sync
        first.select(self._flat_params(), self._names, self.module)
        for rank in self.ranks[1:]:
            rank.momentum_sync.positions = first.positions

    # ------------------------------------------------------------------ inspection

    @property
    def exact(self) -> bool:
        """Whether this is exact Lion (every worker's momentum the same, kept once)."""
        aggregator = self.ranks[0].aggregator
        return aggregator is None or aggregator.reduces_gradients

    def worker_momentum(self, worker: int) -> list[torch.Tensor]:
        """Worker ``worker``'s ``exp_avg`` tensors in the order of ``params`` (views; zeros before the first step)."""
        if not 0 <= worker < self.workers:
            raise IndexError(
                f"LionCub: worker {worker} is not in a world of {self.workers}; ask for 0..{self.workers - 1}."
            )
        index = 0 if self.exact else worker
        # Read, never create: a parameter's momenta come into being at its first step, as LionCub's exp_avg.
        return [
            self.state[param]["worker_exp_avg"][index]
            if "worker_exp_avg" in self.state[param]
            else torch.zeros_like(param)
            for param in self._flat_params()
        ]

    def worker_aggregation_state(self, worker: int) -> AggregationState | None:
        """Worker ``worker``'s aggregation state (error feedback's residuals or estimates live there, per bucket
        key); None for exact Lion."""
        if not 0 <= worker < self.workers:
            raise IndexError(
                f"LionCub: worker {worker} is not in a world of {self.workers}; ask for 0..{self.workers - 1}."
            )
        aggregator = self.ranks[worker].aggregator
        return None if aggregator is None else aggregator.state

    @property
    def noise_scale(self) -> NoiseScale | None:
        """The gradient noise scale so far, as :attr:`ds_lioncub.LionCub.noise_scale` on the ranks of a real job
        (the same summed bits, so the same value); None before the first measured step, with compression "none",
        or one worker."""
        return self.ranks[0].clip.noise_scale.record()

    @property
    def last_clip_coefficient(self) -> float | None:
        """The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip."""
        return self.ranks[0].clip.last_coefficient

    def set_noise_scale_batch(self, samples: int | None) -> None:
        """The samples in one worker's gradient each step, for :attr:`noise_scale` in samples (None: voter
        batches), as :meth:`ds_lioncub.LionCub.set_noise_scale_batch`."""
        for rank in self.ranks:
            rank.clip.noise_scale.set_batch_samples(samples)

    def worker_comm_stats(self, worker: int) -> CommStats:
        """The collectives and bytes worker ``worker`` would have sent so far, counted as LionCub counts them."""
        return self.network.transports[worker].stats + CommStats()

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, worker_grads: Sequence[Sequence[torch.Tensor | None]]) -> None:  # type: ignore[override]
        """One step of every worker: ``worker_grads[i][j]`` is worker i's gradient of parameter j. Each worker runs
        its rank's step, round by round in lockstep with the others (:mod:`ds_lioncub.step.rounds`)."""
        params = self._flat_params()
        grads = checked_gradients(worker_grads, params, self.workers)
        groups = [group for group in self.param_groups for _ in group["params"]]
        taking_part = [j for j, param in enumerate(params) if param.requires_grad and param.numel() > 0]
        if self.workers == 1:  # alone, LionCub skips a parameter without a gradient
            taking_part = [j for j in taking_part if grads[0][j] is not None]
        step = self.param_groups[0]["step"] + 1
        momenta = [self._momenta(params[j]) for j in taking_part]
        entries = [
            [
                Entry(groups[j], params[j], or_zeros(grads[i][j], params[j]), momenta[n][0 if self.exact else i])
                for n, j in enumerate(taking_part)
            ]
            for i in range(self.workers)
        ]
        plan = plan_buckets([params[j].numel() for j in taking_part], self.options.bucket_size)
        buffers = BucketBuffers(plan)  # one scratch for all: a worker's stage leaves nothing in it for the next
        comparison = self._comparison(entries, plan, taking_part)
        for rank, events in zip(self.ranks, self._events, strict=True):
            rank.buffers = buffers
            events.compare(comparison)
        names = self._names
        label = ParameterLabel(params, names)
        rounds = [
            rank.rounds(mine, step, label, finish=self._finisher(worker, step, params, names))
            for worker, (rank, mine) in enumerate(zip(self.ranks, entries, strict=True))
        ]
        try:
            run_in_lockstep(rounds)
        except NonFiniteGradientError:
            workers = [i for i, mine in enumerate(entries) if non_finite_parameters(mine)]
            raise NonFiniteGradientError(
                f"LionCub: non-finite (NaN/inf) gradients on {len(workers)} of {self.workers} virtual workers at step "
                f"{step} (workers {workers[:5]}); the step was not applied. Lower the learning rate or clip "
                f"gradients; check_finite=False turns this check off."
            ) from None
        for group in self.param_groups:
            group["step"] = step
        if comparison is not None:
            if comparison.tally is not None:
                self.last_agreement = comparison.tally.stats()
            if self.drift is not None:
                self.drift.end_step()
        assert self.network.idle, "virtual world: a collective was left incomplete"

    def _comparison(
        self, entries: list[list[Entry]], plan: list[list[Piece]], taking_part: list[int]
    ) -> StepComparison | None:
        """The step's comparison with exact Lion (agreement, drift), None when neither is kept or for exact Lion."""
        if self.exact or (not self.agreement_stats and self.drift is None):
            return None
        labels = None
        if self.drift is not None:
            names = self._names
            labels = [names[j] if names else f"param{j}" for j in taking_part]
        aggregators = [rank.aggregator for rank in self.ranks]
        assert all(aggregator is not None for aggregator in aggregators)
        tally = AgreementTally() if self.agreement_stats else None
        return StepComparison(entries, plan, aggregators, tally, self.drift, labels)  # type: ignore[arg-type]

    def _finisher(
        self, worker: int, step: int, params: list[torch.Tensor], names: list[str] | None
    ) -> Callable[[], StepDone]:
        """What worker ``worker``'s post-step hooks see: its own momenta, by flat position."""
        index = 0 if self.exact else worker

        def finish() -> StepDone:
            # Read, never create: a frozen parameter gets no state entry.
            kept = [self.state[param].get("worker_exp_avg") if param in self.state else None for param in params]
            momenta = [None if momentum is None else momentum[index] for momentum in kept]
            return self.ranks[worker].done(step, params, names, momenta)

        return finish

    # ------------------------------------------------------------------ helpers

    def _flat_params(self) -> list[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _momenta(self, param: torch.Tensor) -> torch.Tensor:
        """``(N, *shape)`` momenta of ``param`` (``(1, *shape)`` for exact Lion), created as zeros."""
        state = self.state[param]
        if "worker_exp_avg" not in state:
            copies = 1 if self.exact else self.workers
            state["worker_exp_avg"] = torch.zeros((copies, *param.shape), dtype=param.dtype, device=param.device)
        momenta: torch.Tensor = state["worker_exp_avg"]
        return momenta


__all__ = ["NETWORK_OPTIONS", "AgreementStats", "VirtualLionCub"]

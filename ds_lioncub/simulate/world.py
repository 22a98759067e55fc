"""VirtualLionCub: N data-parallel Lion Cub workers in one process, through the library's own aggregations.

In Lion Cub every replica applies the same update, so N workers need one copy of the parameters and
N momenta. Each step, every worker computes its pre-sign update from its own gradient and momentum,
the aggregation combines the N messages as the collectives would, and the shared parameters take
the result. Nothing here re-implements the math: the workers' local work is
:mod:`ds_lioncub.step.bucket_work` (what :class:`~ds_lioncub.LionCub` runs on each rank), each worker's
aggregation is the one :func:`~ds_lioncub.aggregation.build_aggregation` builds for a real rank (the
same codecs, quantizers, tie rule, world-size limits), over a :class:`VirtualTransport` whose
network moves the bytes in memory. The bucket plan, the tie rule of each step and momentum sync are
LionCub's. So at p = 2-4 the parameters and every worker's momentum equal real LionCub's on p gloo
ranks bit for bit (tests/distributed), which is what makes a loss curve at 16-64 workers evidence.

Memory: the parameters once, plus one momentum per worker (``(N, *shape)`` per parameter; exact Lion
keeps one, since every worker's is the same), plus one bucket of fp32 scratch and the messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ds_lioncub.aggregation import COMM_DTYPES, AggregationState, Aggregator, Bucket, ExactMean, build_aggregation
from ds_lioncub.comm.packing import unpack_signs
from ds_lioncub.comm.quantize import tie_sign
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.config.clip_rule import measures_noise_scale, sketch_bins_of
from ds_lioncub.errors import LionCubError, NonFiniteGradientError
from ds_lioncub.simulate.agreement import AgreementStats, AgreementTally, summed_directions
from ds_lioncub.simulate.drift import DriftTally
from ds_lioncub.simulate.inputs import NETWORK_OPTIONS, checked_gradients, or_zeros, refuse_options
from ds_lioncub.simulate.transport import VirtualNetwork
from ds_lioncub.step.bucket_plan import Piece, plan_buckets
from ds_lioncub.step.bucket_work import (
    BucketBuffers,
    Entry,
    apply_bucket,
    apply_voted_signs,
    check_param_group,
    exact_lion_bucket,
    grad_piece,
    non_finite_parameters,
    piece_of,
    prepare_bucket,
    prepare_sign_message,
    whole_tensor_mean_abs,
)
from ds_lioncub.step.clipping import clip_coefficient, gradient_sketch, sketch_and_square_norm
from ds_lioncub.step.noise_scale import NoiseScale, NoiseScaleState
from ds_lioncub.step.param_selection import names_by_position, select_parameters


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
        #: The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip.
        self.last_clip_coefficient: float | None = None
        #: How the compressed steps' sign errors add up over steps, per tensor (``drift_stats=True``), else None.
        self.drift: DriftTally | None = DriftTally() if drift_stats else None
        # The gradient noise scale, fed by the same sketch and all-reduce as on LionCub's ranks.
        self._noise_scale_state = NoiseScaleState(self.options.telemetry.noise_scale_beta)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        self._ready = False
        super().__init__(params, defaults)
        self.network = VirtualNetwork(workers)
        # One aggregation per worker, each over its own rank of the network, built as LionCub builds it.
        self._aggregators: list[Aggregator] | None = None
        built = [build_aggregation(self.options, transport, False) for transport in self.network.transports]
        if all(aggregator is not None for aggregator in built):
            self._aggregators = [aggregator for aggregator in built if aggregator is not None]
        self._momentum_synced: set[int] = set()
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
        """The flat positions whose momenta momentum sync averages."""
        sync = self.options.momentum_sync
        if sync.interval:
            names = names_by_position(self.param_groups, self.module)
            selected = select_parameters(self._flat_params(), names, sync.layers, self.module)
            self._momentum_synced = {position for position, chosen in enumerate(selected) if chosen}

    # ------------------------------------------------------------------ inspection

    @property
    def exact(self) -> bool:
        """Whether this is exact Lion (every worker's momentum the same, kept once)."""
        return self._aggregators is None or self._aggregators[0].reduces_gradients

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
        return None if self._aggregators is None else self._aggregators[worker].state

    @property
    def noise_scale(self) -> NoiseScale | None:
        """The gradient noise scale so far, as :attr:`ds_lioncub.LionCub.noise_scale` on the ranks of a real job
        (the same summed bits, so the same value); None before the first measured step, with compression "none",
        or one worker."""
        return self._noise_scale_state.record()

    def set_noise_scale_batch(self, samples: int | None) -> None:
        """The samples in one worker's gradient each step, for :attr:`noise_scale` in samples (None: voter
        batches), as :meth:`ds_lioncub.LionCub.set_noise_scale_batch`."""
        self._noise_scale_state.set_batch_samples(samples)

    @property
    def _measures_noise_scale(self) -> bool:
        return measures_noise_scale(self.options, self.workers, False)

    def worker_comm_stats(self, worker: int) -> CommStats:
        """The collectives and bytes worker ``worker`` would have sent so far, counted as LionCub counts them."""
        return self.network.transports[worker].stats + CommStats()

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, worker_grads: Sequence[Sequence[torch.Tensor | None]]) -> None:  # type: ignore[override]
        """One step of every worker: ``worker_grads[i][j]`` is worker i's gradient of parameter j."""
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
        ranks_not_finite = None
        if self.options.mean_clip is not None or self._measures_noise_scale:  # one sketch serves both
            # Its all-reduce carries the finite check's verdict where the step checks, as on real ranks.
            ranks_not_finite = self._clip_gradients(entries, step, self.options.check_finite and not self.exact)
        plan = plan_buckets([params[j].numel() for j in taking_part], self.options.bucket_size)
        if self.exact:
            self._exact_step(entries, plan)
        else:
            if self.options.check_finite:
                self._require_finite_gradients(entries, step, ranks_not_finite)
            labels = None
            if self.drift is not None:
                names = names_by_position(self.param_groups, self.module)
                labels = [names[j] if names else f"param{j}" for j in taking_part]
            self._compressed_step(entries, plan, tie_sign(step, self.options.tie_break) > 0, labels)
        for group in self.param_groups:
            group["step"] = step
        interval = self.options.momentum_sync.interval
        if interval and step % interval == 0 and not self.exact:
            self._sync_momentum()
        assert self.network.idle, "virtual world: a collective was left incomplete"

    def _exact_step(self, entries: list[list[Entry]], plan: list[list[Piece]]) -> None:
        """Exact Lion: each bucket's gradients averaged over the workers (rank-order fp32/bf16 sum), one update."""
        for bucket in plan:
            sizes = [piece.length for piece in bucket]
            if self._aggregators is None:  # a world of one: the gradient as it is
                grads = [grad_piece(entries[0][piece.tensor_index].grad, piece) for piece in bucket]
            else:
                pending = [
                    aggregator.start(
                        Bucket(torch.cat([grad_piece(e[p.tensor_index].grad, p) for p in bucket]), sizes, []), True
                    )
                    for aggregator, e in zip(self._aggregators, entries, strict=True)
                ]
                grads = list(self._aggregators[0].finish(pending[0]).split(sizes))
            exact_lion_bucket(entries[0], bucket, grads)

    def _compressed_step(
        self, entries: list[list[Entry]], plan: list[list[Piece]], positive_ties: bool, labels: list[str] | None
    ) -> None:
        """Every bucket through each worker's local work and aggregation stages, stage by stage across workers.

        ``labels[n]`` names the tensor of ``entries[i][n]`` in :attr:`drift` (None without drift).

        The same work per worker as LionCub's serial bucket schedule (the schedule never changes a bit);
        the update is applied once, to the shared parameters, from worker 0's copy of the result.
        """
        aggregators = self._aggregators
        assert aggregators is not None
        capacity = self.options.bucket_size
        needs_mean_abs = aggregators[0].needs_whole_tensor_mean_abs
        whole_mean_abs = [whole_tensor_mean_abs(mine, capacity) if needs_mean_abs else {} for mine in entries]
        scratch = BucketBuffers(plan)
        packed_signs = aggregators[0].votes_packed_signs  # every worker's aggregation is built alike
        tally = AgreementTally() if self.agreement_stats else None
        compared = tally is not None or self.drift is not None  # exact Lion's direction is needed
        for bucket in plan:
            numel = sum(piece.length for piece in bucket)
            exact_c = summed_directions(entries, bucket) if compared else None
            pending: list[object] = []
            prepared_buckets = []
            for i, aggregator in enumerate(aggregators):
                if aggregator.agrees_before_start:
                    # A collective before the message (EF21's shared scale): every worker agrees, then every
                    # worker starts. agree takes what start needs of the values, so the workers share the scratch.
                    prepared = prepare_bucket(entries[i], bucket, scratch, whole_mean_abs[i], aggregator)
                    aggregator.agree(prepared)
                    prepared_buckets.append(prepared)
                elif packed_signs:
                    bits, nbytes = aggregator.sign_message_layout(numel)
                    message = prepare_sign_message(entries[i], bucket, positive_ties, bits, nbytes)
                    pending.append(aggregator.issue(message, numel, positive_ties))
                else:
                    prepared = prepare_bucket(entries[i], bucket, scratch, whole_mean_abs[i], aggregator)
                    pending.append(aggregator.start(prepared, positive_ties))
            if prepared_buckets:
                pending = [
                    aggregator.start(prepared, positive_ties)
                    for aggregator, prepared in zip(aggregators, prepared_buckets, strict=True)
                ]
            results = [aggregator.reduce(mine) for aggregator, mine in zip(aggregators, pending, strict=True)]
            voted = aggregators[0].complete_packed(results[0]) if packed_signs else None
            if voted is None:
                applied = aggregators[0].complete(results[0], scratch.for_bucket(entries[0], bucket))
            if exact_c is not None:
                # Recorded before the update is applied, from the update's signs as applied.
                if voted is not None:
                    applied = unpack_signs(voted, numel)
                if tally is not None:
                    tally.add(exact_c, applied, aggregators, pending)
                if self.drift is not None and labels is not None:
                    numels = [entries[0][piece.tensor_index].param.numel() for piece in bucket]
                    names = [labels[piece.tensor_index] for piece in bucket]
                    self.drift.add_bucket(bucket, names, numels, exact_c, applied)
            if voted is not None:
                apply_voted_signs(entries[0], bucket, voted)
            else:
                apply_bucket(entries[0], bucket, applied)
        if tally is not None:
            self.last_agreement = tally.stats()
        if self.drift is not None:
            self.drift.end_step()

    def _clip_gradients(self, entries: list[list[Entry]], step: int, carry_finite_check: bool) -> int | None:
        """The step's sketch, as LionCub takes it on every rank: each worker's sketch (with its squared norm when the
        noise scale is measured; with ``carry_finite_check``, and 1 where its gradient is not finite) through its own
        all-reduce; the noise scale's update, and option ``clip``'s common factor scaling every worker's gradients
        in place (:mod:`ds_lioncub.step.clipping`). Returns how many workers' gradients are not finite (None: not
        carried)."""
        clip = self.options.mean_clip
        bins = sketch_bins_of(self.options)
        noise = self._measures_noise_scale
        make = sketch_and_square_norm if noise else gradient_sketch
        sketches = [make([[entry.grad] for entry in mine], bins, step, 0) for mine in entries]
        if carry_finite_check:
            flags = [1.0 if non_finite_parameters(mine) else 0.0 for mine in entries]
            sketches = [torch.cat([s, s.new_full((1,), flag)]) for s, flag in zip(sketches, flags, strict=True)]
        for transport, sketch in zip(self.network.transports, sketches, strict=True):
            transport.all_reduce_sum(sketch)
        ranks_not_finite = None
        if carry_finite_check:
            ranks_not_finite, sketches = int(sketches[0][-1].item()), [s[:-1] for s in sketches]
        if noise:
            self._noise_scale_state.update(sketches[0], self.workers)
        if clip is not None:
            coefficient = clip_coefficient(sketches[0][:bins], self.workers, clip.max_norm)
            if coefficient < 1.0:
                torch._foreach_mul_([entry.grad for mine in entries for entry in mine], coefficient)
            self.last_clip_coefficient = coefficient
        return ranks_not_finite

    def _sync_momentum(self) -> None:
        """Average the selected parameters' momenta over the workers, as LionCub's momentum sync does: every
        selected parameter that has momenta, whether or not it took part in this step."""
        params = self._flat_params()
        selected = [
            self.state[param]["worker_exp_avg"]
            for position, param in enumerate(params)
            if position in self._momentum_synced and "worker_exp_avg" in self.state[param]
        ]
        if not selected or self.workers == 1:
            return
        assert self._aggregators is not None
        dtype = COMM_DTYPES[self.options.momentum_sync.dtype]
        means = [ExactMean(aggregator.transport, dtype) for aggregator in self._aggregators]
        for bucket in plan_buckets([m[0].numel() for m in selected], self.options.bucket_size):
            sizes = [piece.length for piece in bucket]
            slices = [[piece_of(selected[p.tensor_index][i], p) for p in bucket] for i in range(self.workers)]
            pending = [mean.start(Bucket(torch.cat(mine), sizes, [])) for mean, mine in zip(means, slices, strict=True)]
            for mean, started, mine in zip(means, pending, slices, strict=True):
                for target, value in zip(mine, mean.finish(started).split(sizes), strict=True):
                    target.copy_(value)

    def _require_finite_gradients(self, entries: list[list[Entry]], step: int, count: int | None) -> None:
        """Raise before any state changes if a worker has a NaN or inf gradient (a vote would hide it).

        ``count``: the workers with one, as the step's sketch carried it; None: the verdict goes through each
        worker's 4-byte all-reduce, as on real ranks, so the bytes counted match.
        """
        if count is None:
            flags = [torch.tensor([1 if non_finite_parameters(mine) else 0], dtype=torch.int32) for mine in entries]
            for transport, flag in zip(self.network.transports, flags, strict=True):
                transport.all_reduce_sum(flag)
            count = int(flags[0].item())
        if count:
            workers = [i for i, mine in enumerate(entries) if non_finite_parameters(mine)]
            raise NonFiniteGradientError(
                f"LionCub: non-finite (NaN/inf) gradients on {count} of {self.workers} virtual workers at step "
                f"{step} (workers {workers[:5]}); the step was not applied. Lower the learning rate or clip "
                f"gradients; check_finite=False turns this check off."
            )

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

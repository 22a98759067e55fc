"""The emulated cluster's job (benchmarks/time_to_loss_cluster.py) as a task for the virtual world.

bench_train's GPT (benchmarks/train_methods.py ``TrainSettings``: 4 layers, d_model 512, 8 heads, 12,915,200
parameters, initialised from ``torch.manual_seed(seed)``) on the same corpus, global batch 16 windows of 32 bytes
(4 ranks x micro-batch 4), scored on the same 256 evenly spaced validation windows, and trained on the windows the
cluster's ranks draw: rank i's from its own generator, seeded ``seed * 1,000,003 + i + 1``
(benchmarks/train_worker.py), in step order, so that worker i of the virtual world sees rank i's batch. Seed 0 is
the cluster run's data and weights. So ``python -m ds_lioncub.simulate`` can measure r, the steps the planner's
pick needs to reach exact Lion's loss, on this job without the cluster, and the planner can predict the cluster's
ratio from it (``--job-evidence``)::

    python -m ds_lioncub.simulate benchmarks/cluster_job_ds_config.json \\
        --task benchmarks.cluster_job_task:cluster_job --workers 4 --steps 80 --seeds 0 1 2 3 \\
        --time-to-loss 0.6 0.75 1.25 --evidence-out cluster_job_evidence.json
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks.train_methods import TrainSettings
from ds_lioncub.simulate.tasks import GPTTask
from ds_lioncub.simulate.tasks.gpt import GPTConfig

#: Ranks of the emulated cluster (one per node).
RANKS = 4
#: The cluster run's validation windows (time_to_loss_cluster's ``--eval-windows`` default).
EVAL_WINDOWS = 256


@dataclass
class ClusterJobTask(GPTTask):
    """:class:`GPTTask` with the cluster's ranks' draws of training windows (module docstring)."""

    micro_batch: int = 4
    _starts: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def batch(self, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.corpus().train
        drawn = self._starts.setdefault(seed, [])
        if len(drawn) <= step:  # replay every rank's generator up to the step (each draws micro_batch a step)
            generators = [torch.Generator().manual_seed(seed * 1_000_003 + rank + 1) for rank in range(RANKS)]
            drawn.clear()
            for _ in range(step + 1):
                draws = [
                    torch.randint(0, len(data) - self.seq_len - 1, (self.micro_batch,), generator=generator)
                    for generator in generators
                ]
                drawn.append(torch.cat(draws))
        windows = data[drawn[step][:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def cluster_job() -> ClusterJobTask:
    """The cluster's GPT, data and validation set as a :class:`~ds_lioncub.simulate.train.Task`."""
    settings = TrainSettings()
    config = GPTConfig(
        max_seq_len=settings.seq_len, n_layer=settings.n_layer, n_head=settings.n_head, d_model=settings.d_model
    )
    return ClusterJobTask(
        name="gpt-cluster-job",
        config=config,
        global_batch_size=settings.micro_batch * RANKS,
        seq_len=settings.seq_len,
        eval_windows=EVAL_WINDOWS,
        eval_batch=settings.micro_batch * RANKS,
        micro_batch=settings.micro_batch,
    )


__all__ = ["EVAL_WINDOWS", "RANKS", "ClusterJobTask", "cluster_job"]

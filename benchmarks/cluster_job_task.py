"""The emulated cluster's job (benchmarks/time_to_loss_cluster.py) as a task for the virtual world.

bench_train's GPT (benchmarks/train_methods.py ``TrainSettings``: 4 layers, d_model 512, 8 heads, 12,915,200
parameters) on the same corpus, global batch 16 windows of 32 bytes (4 ranks x micro-batch 4), scored on the same
256 evenly spaced validation windows. Only the draw of the training windows differs from the cluster's ranks
(:class:`~ds_lioncub.simulate.tasks.GPTTask` draws step t's from (seed, t) alone). So that ``python -m
ds_lioncub.simulate`` can measure r, the steps the planner's pick needs to reach exact Lion's loss, on this job
before the cluster runs, and the planner can predict the cluster's ratio from it (``--job-evidence``)::

    python -m ds_lioncub.simulate benchmarks/cluster_job_ds_config.json \\
        --task benchmarks.cluster_job_task:cluster_job --workers 4 --steps 80 --seeds 0 1 2 3 \\
        --time-to-loss 0.6 0.75 1.25 --evidence-out cluster_job_evidence.json
"""

from __future__ import annotations

from benchmarks.train_methods import TrainSettings
from ds_lioncub.simulate.tasks import GPTTask
from ds_lioncub.simulate.tasks.gpt import GPTConfig

#: Ranks of the emulated cluster (one per node).
RANKS = 4
#: The cluster run's validation windows (time_to_loss_cluster's ``--eval-windows`` default).
EVAL_WINDOWS = 256


def cluster_job() -> GPTTask:
    """The cluster's GPT, batch and validation set as a :class:`~ds_lioncub.simulate.train.Task`."""
    settings = TrainSettings()
    config = GPTConfig(
        max_seq_len=settings.seq_len, n_layer=settings.n_layer, n_head=settings.n_head, d_model=settings.d_model
    )
    return GPTTask(
        name="gpt-cluster-job",
        config=config,
        global_batch_size=settings.micro_batch * RANKS,
        seq_len=settings.seq_len,
        eval_windows=EVAL_WINDOWS,
        eval_batch=settings.micro_batch * RANKS,
    )


__all__ = ["EVAL_WINDOWS", "RANKS", "cluster_job"]

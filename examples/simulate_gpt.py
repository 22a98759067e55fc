"""The example GPT as a task for the virtual world: :mod:`ds_lioncub.simulate.tasks.gpt_task`, re-exported.

    python -m ds_lioncub.simulate configs/lioncub_1bit.json --workers 8 16 32      # this task by default
    python -m ds_lioncub.simulate configs/lioncub_1bit.json --task examples.simulate_gpt:large_gpt

The task ships inside the package so that the command's default works wherever ds_lioncub is installed;
``examples.simulate_gpt`` keeps naming it for the benchmarks and for ``--task`` in a checkout.
"""

from ds_lioncub.simulate.tasks.gpt_task import CONFIGS, TASKS, GPTTask, large_gpt, small_gpt, task_by_name

__all__ = ["CONFIGS", "TASKS", "GPTTask", "large_gpt", "small_gpt", "task_by_name"]

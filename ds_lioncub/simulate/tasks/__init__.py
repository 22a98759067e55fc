"""Tasks for the virtual world that ship with the package: ``python -m ds_lioncub.simulate``'s default.

``small_gpt`` (the default task) and ``large_gpt`` are the example byte-level GPT
(:mod:`ds_lioncub.simulate.tasks.gpt`) on DeepSpeed 0.19.8's pinned sources
(:mod:`ds_lioncub.simulate.tasks.corpus`), as :mod:`ds_lioncub.simulate.tasks.gpt_task` sets them up.
They live in the package, not in the repository's examples/, so that the command's default works
wherever ds_lioncub is installed; examples/gpt.py, examples/corpus.py and examples/simulate_gpt.py
re-export these modules for the repository's training scripts and benchmarks.
"""

from ds_lioncub.simulate.tasks.gpt_task import CONFIGS, TASKS, GPTTask, large_gpt, small_gpt, task_by_name

__all__ = ["CONFIGS", "TASKS", "GPTTask", "large_gpt", "small_gpt", "task_by_name"]

"""The numbers the package reads from users and reports to them.

- :mod:`.units` the network quantities users type (rates and latencies with units) and their printed forms;
- :mod:`.student_t` a mean over seeds and its two-sided 95% Student-t interval (the convergence study's
  report, the planner's convergence rule and ``python -m ds_lioncub.simulate``'s tables).

Both are plain Python, import nothing else of ds_lioncub, and sit below everything that uses them.
"""

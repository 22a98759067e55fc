"""The machinery of one optimizer step, behind :class:`~ds_lioncub.optimizer.LionCub`.

- :mod:`~ds_lioncub.step.paths`: the step paths (exact Lion, the compressed step and its bucket schedule,
  the overlapped step), the participants and the non-finite check; :func:`~ds_lioncub.step.paths.run_step_path`
  picks one per step;
- :mod:`~ds_lioncub.step.bucket_plan`: which parameter pieces go into which communication bucket;
- :mod:`~ds_lioncub.step.bucket_work`: a bucket's local work around its aggregation (Lion's ``c`` and
  momenta before, the update after), shared with the virtual world;
- :mod:`~ds_lioncub.step.overlap`: votes started during backward (option ``overlap``);
- :mod:`~ds_lioncub.step.post_step`: what runs after every step, as hooks (momentum sync, the replica check);
- :mod:`~ds_lioncub.step.local_state`: the per-rank state a checkpoint keeps (momenta, aggregation state);
- :mod:`~ds_lioncub.step.param_selection`: the parameters' names by position, the layers momentum sync selects;
- :mod:`~ds_lioncub.step.parts`: a step taken in several ``step()`` calls, and calls that only create state;
- :mod:`~ds_lioncub.step.setup`: the set-up before the first step (the same on every rank,
  ``compression="auto"`` resolved, the setting logged);
- :mod:`~ds_lioncub.step.clipping`: option ``clip``, the norm of the ranks' mean gradient from their summed sketches
  (:mod:`~ds_lioncub.step.sketch`, a rank's sketch); :mod:`~ds_lioncub.step.noise_scale`: the gradient noise scale
  measured from that sketch.

A new step path goes in ``paths.py`` (and its choice in ``run_step_path``); a new per-step duty is a new
hook in ``post_step.py``. What crosses the network for a bucket is the aggregation's job
(:mod:`ds_lioncub.aggregation`), not the step's.
"""

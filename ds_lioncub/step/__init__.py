"""The machinery of one optimizer step, behind :class:`~ds_lioncub.optimizer.LionCub`.

- :mod:`~ds_lioncub.step.rank_step`: :class:`~ds_lioncub.step.rank_step.RankStep`, one rank's step and what it
  keeps between steps, run as explicit stages in rounds; LionCub owns one, the virtual world drives N;
- :mod:`~ds_lioncub.step.rounds`: how the rounds are driven (one after the other on a rank of a real job, in
  lockstep over the virtual world's workers);
- :mod:`~ds_lioncub.step.events`: what the stages tell an observer (telemetry, the virtual world's tallies);
- :mod:`~ds_lioncub.step.paths`: the step paths as rounds (exact Lion, the compressed step's bucket stages in the
  bucket schedule, the overlapped step) and the participants; :mod:`~ds_lioncub.step.finite_check`: the agreed
  non-finite check;
- :mod:`~ds_lioncub.step.bucket_plan`: which parameter pieces go into which communication bucket;
- :mod:`~ds_lioncub.step.bucket_work`: a bucket's local work around its aggregation (Lion's ``c`` and
  momenta before, the update after);
- :mod:`~ds_lioncub.step.overlap`: votes started during backward (option ``overlap``);
- :mod:`~ds_lioncub.step.post_step`: what runs after every step, as hooks (momentum sync, the replica check);
- :mod:`~ds_lioncub.step.local_state`: the per-rank state a checkpoint keeps (momenta, aggregation state);
- :mod:`~ds_lioncub.step.engine_side`: what DeepSpeed's wiring asks of LionCub beside torch.optim's surface;
- :mod:`~ds_lioncub.step.param_selection`: the parameters' names by position, the layers momentum sync selects;
- :mod:`~ds_lioncub.step.parts`: a step taken in several ``step()`` calls, and calls that only create state;
- :mod:`~ds_lioncub.step.setup`: the set-up before the first step (the same on every rank,
  ``compression="auto"`` resolved, the setting logged);
- :mod:`~ds_lioncub.step.wiring`: who a rank's step talks to;
- :mod:`~ds_lioncub.step.clipping`: option ``clip``, the norm of the ranks' mean gradient from their summed sketches
  (:mod:`~ds_lioncub.step.sketch`, a rank's sketch);
  :mod:`~ds_lioncub.step.noise_scale`: the gradient noise scale measured from that sketch.

A new step path goes in ``paths.py`` (and its choice in ``step_path_rounds``); a new per-step duty is a new
hook in ``post_step.py``; a new observer implements :class:`~ds_lioncub.step.events.StepEvents`. What crosses the
network for a bucket is the aggregation's job (:mod:`ds_lioncub.aggregation`), not the step's.
"""

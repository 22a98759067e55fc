"""The guards that every rank runs the same thing: the set-up fingerprint and the replica checksums.

- :mod:`~ds_lioncub.consistency.fingerprint`: at set-up, one small all-gather compares what each rank was
  built with (options, world, parameters, version) and names the first difference (docs/design.md section 13);
- :mod:`~ds_lioncub.consistency.replica_check`: every few steps (option ``consistency_check``), all ranks
  hold bitwise identical parameters.
"""

"""Who communicates under each LionCub mode inside a DeepSpeed engine, and what is refused.

- ``compression="none"``: the engine (or ZeRO) averages the gradients as it always does; LionCub
  applies exact Lion to the mean and communicates nothing itself.
- compressed modes: LionCub's votes replace the engine's gradient all-reduce, which is switched
  off; ZeRO is refused (its partitions hold no rank's full update), before training starts.
"""

from __future__ import annotations

from typing import Any

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.optimizer import LionCub


def wire_engine(engine: Any, optimizer: LionCub) -> None:
    """Decide who communicates, and refuse what LionCub cannot do under this engine config."""
    compression = optimizer.options.compression
    stage = int(engine.zero_optimization_stage())
    if optimizer.options.hybrid is not None and stage == 0:
        raise LionCubConfigError(
            "LionCub: hybrid applies under ZeRO stage 1 or 2 (shard inside a node, vote across nodes); at stage 0 "
            "every rank is a voter already. Drop hybrid, or set zero_optimization.stage to 1 or 2."
        )
    if compression != "none" and stage >= 1:
        raise LionCubConfigError(
            f"LionCub: compression={compression!r} does not run under ZeRO stage {stage} yet (LionCub's "
            f"votes need every rank's full update, which ZeRO partitions away). Set "
            f"zero_optimization.stage to 0, or use compression='none' (exact Lion, sharded by ZeRO)."
        )
    averaged_by_engine = compression == "none"
    optimizer.bind(engine.seq_data_parallel_group, engine.module, gradients_averaged=averaged_by_engine)
    if not averaged_by_engine:
        engine.enable_backward_allreduce = False

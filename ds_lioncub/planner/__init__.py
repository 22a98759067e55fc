"""Which LionCub mode pays on a network: an α-β model of every mode's step (``python -m ds_lioncub.planner``).

Compression costs local work and saves bytes; on a fast network the bytes saved may be worth less
than the work. :func:`plan` predicts the seconds and bytes of a step for every candidate mode on a
cluster (:class:`Cluster`) and network (:class:`Network`), fastest first;
:func:`predict_aggregation_seconds` predicts one aggregation, to check the model against
``benchmarks/bench_comm.py``. The model is :mod:`ds_lioncub.planner.model` (bytes from
:mod:`ds_lioncub.comm.wire`), the local costs :mod:`ds_lioncub.planner.local_costs`, the command line
:mod:`ds_lioncub.planner.cli`, and ``compression="auto"`` :mod:`ds_lioncub.planner.auto`.
"""

from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LocalCosts, aggregation_key
from ds_lioncub.planner.model import (
    GLOO_LINK_EFFICIENCY,
    IDEAL_LINK_EFFICIENCY,
    Candidate,
    Cluster,
    LinkEfficiency,
    Network,
    plan,
    predict_aggregation_seconds,
)
from ds_lioncub.quantities.units import format_rate, format_seconds, parse_duration, parse_rate

__all__ = [
    "DEFAULT_LOCAL_COSTS",
    "GLOO_LINK_EFFICIENCY",
    "IDEAL_LINK_EFFICIENCY",
    "Candidate",
    "Cluster",
    "LinkEfficiency",
    "LocalCosts",
    "Network",
    "aggregation_key",
    "format_rate",
    "format_seconds",
    "parse_duration",
    "parse_rate",
    "plan",
    "predict_aggregation_seconds",
]

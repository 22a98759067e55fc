"""The planner's configs that the 2-rank DeepSpeed job trains (tests/workers/ds_engine_scenarios.py), written once.

- ``lioncub_planner``: the block ``python -m ds_lioncub.planner`` recommends for the job's model on 2 one-rank
  nodes at 1 Gbit/s, pasted into the job's base config;
- ``lioncub_auto``: ``compression="auto"`` with a network block; the launcher runs both ranks on one
  machine (2 ranks per node), so the block says the ranks talk at 1 Gbit/s inside the node too.
"""

from __future__ import annotations

import copy
from typing import Any

from ds_lioncub.planner import Candidate, Cluster, Network, parse_rate, plan

PLANNED_CLUSTER = Cluster(nodes=2, gpus_per_node=1)
PLANNED_BANDWIDTH = "1gbit"
AUTO_NETWORK = {"bandwidth": "1gbit", "intra_node_bandwidth": "1gbit"}
LAUNCHED_WORLD = 2
LAUNCHED_NODE_SIZE = 2  # the deepspeed launcher's ranks on this machine (LOCAL_SIZE)
HYPER = ("lr", "betas", "weight_decay")
# What the command line plans by default: the mean gradient clipped at DeepSpeed's default gradient_clipping, 1.0,
# which the job's base config (configs/lioncub_1bit.json) also writes.
PLANNED_CLIP = {"max_norm": 1.0}


def recommended(num_params: int) -> Candidate:
    return plan(num_params, PLANNED_CLUSTER, Network(parse_rate(PLANNED_BANDWIDTH)), clip=PLANNED_CLIP)[0]


def planned_configs(base: dict[str, Any], num_params: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, ds_config) of both variants, built on ``base`` (its batch, schedule and hyper-parameters)."""
    hyper = {key: value for key, value in base["optimizer"]["params"].items() if key in HYPER}
    best = recommended(num_params)
    planned = copy.deepcopy(base)
    planned["optimizer"]["params"] = {**hyper, **best.params}
    planned["zero_optimization"] = {"stage": best.zero_stage}
    auto = copy.deepcopy(base)
    auto["optimizer"]["params"] = {**hyper, "compression": "auto", "network": AUTO_NETWORK}
    return [("lioncub_planner", planned), ("lioncub_auto", auto)]

"""``compression="auto"``: a placeholder the planner resolves into a concrete mode once the world is known
(:mod:`ds_lioncub.planner.auto`, at construction or by the DeepSpeed wiring).

Until then it is neither exact Lion nor a vote: it takes the votes' options (kept if a vote is chosen) and
``network``, the links it plans for, which it requires; it chooses ``comm_dtype`` itself. Whatever is built,
priced or studied is the resolved mode, so its hooks refuse to answer.
"""

from __future__ import annotations

from typing import NoReturn

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes.record import VOTE_OPTIONS, VOTE_SHOWN, ModeRecord, ModeRefusal


def _unresolved(*args: object) -> NoReturn:
    raise LionCubConfigError(
        "LionCub: compression='auto' has no aggregation, wire or study cell of its own: it is resolved into a "
        "concrete mode first (ds_lioncub.planner.auto.resolve_auto)."
    )


AUTO = ModeRecord(
    name="auto",
    exact=False,
    votes=False,
    chosen_by_planner=True,
    takes=VOTE_OPTIONS | {"network", "job"},
    shown_options=lambda options: VOTE_SHOWN,
    build_aggregation=_unresolved,
    collectives=_unresolved,
    message_bytes=_unresolved,
    local_cost_key=_unresolved,
    study_key=_unresolved,
    refusals=(
        ModeRefusal(
            "network",
            lambda options, given: options.network is None,
            lambda options: (
                "compression='auto' needs the network to plan for: add "
                '"network": {"bandwidth": "1gbit", "latency": "50us"} with your links\' figures '
                "(python -m ds_lioncub.planner shows what each mode would cost), or choose the compression yourself"
            ),
        ),
        ModeRefusal(
            "comm_dtype",
            lambda options, given: "comm_dtype" in given,
            lambda options: (
                "comm_dtype is chosen by compression='auto' (exact Lion in fp32 or bf16); drop comm_dtype, "
                "or choose the compression yourself"
            ),
        ),
    ),
)

__all__ = ["AUTO"]

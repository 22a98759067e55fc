"""The rules across options (``LionCubConfig.CROSS_OPTION_RULES``): each refuses its combination with its message.

The expected messages are written out here in full, as users read them from ``parse_config``; they are
not computed from the table. One config per rule breaks that rule alone; configs that break several
are refused with the message of the rule checked first, in the order the rules have always been checked.
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_lioncub import LionCubConfigError, parse_config
from ds_lioncub.config import (
    ErrorFeedbackConfig,
    HybridConfig,
    LionCubConfig,
    MomentumSyncConfig,
    NetworkConfig,
    TelemetryConfig,
)

PREFIX = "LionCub: invalid options: "
NETWORK = {"bandwidth": "1gbit"}
NEEDS_NETWORK = (
    "compression='auto' needs the network to plan for: add "
    '"network": {"bandwidth": "1gbit", "latency": "50us"} with your links\' figures '
    "(python -m ds_lioncub.planner shows what each mode would cost), or choose the compression yourself"
)

# (case id, options that break exactly one rule, the message parse_config gives, without PREFIX and the period)
ONE_RULE_BROKEN: list[tuple[str, dict[str, Any], str]] = [
    ("auto-without-network", {"compression": "auto"}, NEEDS_NETWORK),
    (
        "network-without-auto",
        {"compression": "1bit", "network": NETWORK},
        "network only applies to compression='auto' (compression is '1bit'); set compression='auto' or drop network",
    ),
    (
        "job-without-auto",
        {"compression": "1bit", "job": {"global_batch": 1024, "noise_scale": 512}},
        "job only applies to compression='auto' (compression is '1bit'); set compression='auto' or drop job",
    ),
    (
        "auto-with-comm_dtype",
        {"compression": "auto", "network": NETWORK, "comm_dtype": "fp32"},
        "comm_dtype is chosen by compression='auto' (exact Lion in fp32 or bf16); drop comm_dtype, "
        "or choose the compression yourself",
    ),
    (
        "bits-without-kbit",
        {"compression": "1bit", "bits": 4},
        "bits=4 only applies to compression='kbit' (compression is '1bit'); set compression='kbit' or drop bits",
    ),
    (
        "quantizer-without-kbit",
        {"compression": "none", "quantizer": "sign"},
        "quantizer='sign' only applies to compression='kbit' (compression is 'none'); set compression='kbit' "
        "or drop quantizer",
    ),
    (
        "aggregation-without-kbit",
        {"compression": "1bit", "aggregation": "mean"},
        "aggregation='mean' only applies to compression='kbit' (compression is '1bit'); set compression='kbit' "
        "or drop aggregation",
    ),
    (
        "kbit_algorithm-without-kbit",
        {"kbit_algorithm": "alltoall"},
        "kbit_algorithm='alltoall' only applies to compression='kbit' (compression is '1bit'); "
        "set compression='kbit' or drop kbit_algorithm",
    ),
    (
        "l1_clip-without-kbit",
        {"compression": "auto", "network": NETWORK, "l1_clip": 3.0},
        "l1_clip=3.0 only applies to compression='kbit' (compression is 'auto'); set compression='kbit' "
        "or drop l1_clip",
    ),
    (
        "bf16-comm_dtype-with-compression",
        {"compression": "kbit", "comm_dtype": "bf16"},
        "comm_dtype='bf16' applies to compression='none' (the uncompressed gradient all-reduce); compressed "
        "modes send bits, so drop comm_dtype",
    ),
    (
        "momentum_sync-without-compression",
        {"compression": "none", "momentum_sync": {"interval": 10}},
        "momentum_sync only applies to compressed modes: with compression='none' every rank's momentum is "
        "already identical; drop momentum_sync or choose compression='1bit' or 'kbit'",
    ),
    (
        "vote_stats-without-compression",
        {"compression": "none", "telemetry": {"vote_stats": True}},
        "telemetry.vote_stats only applies to compressed modes (compression='none' takes no vote); drop "
        "telemetry.vote_stats or choose compression='1bit' or 'kbit'",
    ),
    (
        "hybrid-without-compression",
        {"compression": "none", "hybrid": {"node_size": 2}},
        "hybrid only applies to compressed modes under ZeRO stage 1, 2 or 3 (with compression='none' ZeRO shards "
        "exact Lion over the whole world); drop hybrid or choose compression='1bit' or 'kbit'",
    ),
    (
        "overlap-without-compression",
        {"compression": "none", "overlap": True},
        "overlap=True starts compressed votes during backward; with compression='none' the gradients are "
        "averaged instead (DDP or DeepSpeed overlap that themselves). Drop overlap or choose compression='1bit' "
        "or 'kbit'",
    ),
    (
        "overlap-over-mpi",
        {"overlap": True, "comm_backend_name": "mpi"},
        "overlap=True needs collectives that run while backward goes on, which comm_backend_name='mpi' does "
        "not offer yet; use comm_backend_name='torch' or drop overlap",
    ),
    (
        "cuda_aware-over-torch",
        {"cuda_aware": True},
        "cuda_aware=True only applies to comm_backend_name='mpi' (comm_backend_name is 'torch', whose "
        "torch.distributed backend reads device memory itself); set comm_backend_name='mpi' or drop cuda_aware",
    ),
    (
        "l1_clip-with-the-sign-quantizer",
        {"compression": "kbit", "l1_clip": 2.0},
        "l1_clip only applies to quantizer='l1'; set quantizer='l1' or drop l1_clip",
    ),
    (
        "error_feedback-with-the-1bit-vote",
        {"compression": "1bit", "error_feedback": {"kind": "residual"}},
        "error_feedback only applies to compression='kbit' with quantizer='l1' (compression is '1bit': a sign "
        "vote or an exact mean rounds nothing off that it could feed back); set compression='kbit', "
        "quantizer='l1' or drop error_feedback",
    ),
    (
        "error_feedback-with-sign-fields",
        {"compression": "kbit", "error_feedback": {"kind": "residual"}},
        "error_feedback only applies to quantizer='l1' (quantizer is 'sign': a sign field has no rounding "
        "error to feed back); set quantizer='l1' or drop error_feedback",
    ),
    (
        "error_feedback-with-overlap",
        {"compression": "kbit", "quantizer": "l1", "overlap": True, "error_feedback": {"kind": "residual"}},
        "error_feedback does not support overlap=True yet (a vote started during backward would update the "
        "feedback state before the final gradients are known); drop overlap or error_feedback",
    ),
    (
        "ef21-over-the-allreduce",
        {"compression": "kbit", "quantizer": "l1", "error_feedback": {"kind": "ef21"}},
        "error_feedback kind 'ef21' needs kbit_algorithm='alltoall' and aggregation='vote' (got 'allreduce' and "
        "'vote': each chunk's owner keeps the shared estimate and applies its sign); set them or use kind "
        "'residual'",
    ),
]
CASE_IDS = [case for case, _, _ in ONE_RULE_BROKEN]


BLOCKS: dict[str, Any] = {
    "network": NetworkConfig,
    "momentum_sync": MomentumSyncConfig,
    "telemetry": TelemetryConfig,
    "hybrid": HybridConfig,
    "error_feedback": ErrorFeedbackConfig,
}


def _unchecked_config(options: dict[str, Any]) -> LionCubConfig:
    """``options`` as a LionCubConfig built without its validators (the rules would refuse it): each nested
    block parsed by its own model, every option not given at its default, ``options`` as the ones given."""
    values = {name: BLOCKS[name](**value) if name in BLOCKS else value for name, value in options.items()}
    return LionCubConfig.model_construct(_fields_set=set(options), **values)


def _refusal(options: dict[str, Any]) -> str:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config(options)
    return str(raised.value)


@pytest.mark.parametrize(("case", "options", "message"), ONE_RULE_BROKEN, ids=CASE_IDS)
def test_each_rule_refuses_its_combination_with_its_message(case: str, options: dict[str, Any], message: str) -> None:
    assert _refusal(options) == f"{PREFIX}{message}."


@pytest.mark.parametrize(("case", "options", "message"), ONE_RULE_BROKEN, ids=CASE_IDS)
def test_each_case_breaks_exactly_one_rule_of_the_table(case: str, options: dict[str, Any], message: str) -> None:
    config = _unchecked_config(options)
    refusing = [rule for rule in LionCubConfig.CROSS_OPTION_RULES if rule.refuses(config, set(options))]
    assert len(refusing) == 1, [rule.option for rule in refusing]
    assert refusing[0].message(config) == message


def test_the_cases_cover_every_rule_of_the_table_once() -> None:
    """Together with the test above: every rule has its own case here, so each rule's message is checked."""
    hit = []
    for _, options, _ in ONE_RULE_BROKEN:
        config = _unchecked_config(options)
        hit += [
            index for index, rule in enumerate(LionCubConfig.CROSS_OPTION_RULES) if rule.refuses(config, set(options))
        ]
    assert sorted(hit) == list(range(len(LionCubConfig.CROSS_OPTION_RULES)))
    assert len(LionCubConfig.CROSS_OPTION_RULES) == 21


def test_every_rule_governs_an_existing_option() -> None:
    options = {rule.option for rule in LionCubConfig.CROSS_OPTION_RULES}
    assert options <= set(LionCubConfig.model_fields)
    assert options == {
        "network",
        "job",
        "comm_dtype",
        "bits",
        "quantizer",
        "aggregation",
        "kbit_algorithm",
        "l1_clip",
        "momentum_sync",
        "telemetry",
        "hybrid",
        "overlap",
        "cuda_aware",
        "error_feedback",
    }


# ---------------------------------------------------------------------------------------------- several at once

# (options breaking several rules, the message of the one checked first)
SEVERAL_BROKEN: list[tuple[dict[str, Any], str]] = [
    # no network for auto comes before the comm_dtype auto chooses itself and the kbit-only l1_clip
    ({"compression": "auto", "comm_dtype": "bf16", "l1_clip": 3.0}, NEEDS_NETWORK),
    # the kbit-only options in field order: bits before quantizer, before the momentum_sync, hybrid and overlap
    # rules of compression "none"
    (
        {"compression": "none", "quantizer": "l1", "bits": 2, "momentum_sync": {"interval": 5}, "overlap": True},
        "bits=2 only applies to compression='kbit' (compression is 'none'); set compression='kbit' or drop bits",
    ),
    # comm_dtype for a compressed mode before overlap over MPI and cuda_aware
    (
        {"comm_dtype": "bf16", "overlap": True, "comm_backend_name": "mpi", "cuda_aware": True},
        "comm_dtype='bf16' applies to compression='none' (the uncompressed gradient all-reduce); compressed "
        "modes send bits, so drop comm_dtype",
    ),
    # momentum_sync before telemetry before hybrid before overlap
    (
        {
            "compression": "none",
            "overlap": True,
            "hybrid": {},
            "telemetry": {"vote_stats": True},
            "momentum_sync": {"interval": 3},
        },
        "momentum_sync only applies to compressed modes: with compression='none' every rank's momentum is "
        "already identical; drop momentum_sync or choose compression='1bit' or 'kbit'",
    ),
    (
        {"compression": "none", "overlap": True, "hybrid": {}, "telemetry": {"vote_stats": True}},
        "telemetry.vote_stats only applies to compressed modes (compression='none' takes no vote); drop "
        "telemetry.vote_stats or choose compression='1bit' or 'kbit'",
    ),
    # overlap without compression before overlap over MPI; overlap before cuda_aware
    (
        {"compression": "none", "overlap": True, "comm_backend_name": "mpi"},
        "overlap=True starts compressed votes during backward; with compression='none' the gradients are "
        "averaged instead (DDP or DeepSpeed overlap that themselves). Drop overlap or choose compression='1bit' "
        "or 'kbit'",
    ),
    # cuda_aware before l1_clip with the sign quantizer
    (
        {"compression": "kbit", "l1_clip": 1.0, "cuda_aware": True},
        "cuda_aware=True only applies to comm_backend_name='mpi' (comm_backend_name is 'torch', whose "
        "torch.distributed backend reads device memory itself); set comm_backend_name='mpi' or drop cuda_aware",
    ),
]


@pytest.mark.parametrize(("options", "message"), SEVERAL_BROKEN)
def test_with_several_rules_broken_the_first_in_order_is_reported(options: dict[str, Any], message: str) -> None:
    assert _refusal(options) == f"{PREFIX}{message}."


# ---------------------------------------------------------------------------------------------- controls


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "auto", "network": NETWORK},
        {"compression": "none", "comm_dtype": "bf16"},
        {"compression": "1bit", "comm_dtype": "fp32"},  # the default, written out, is no conflict
        {"compression": "kbit", "bits": 2, "quantizer": "l1", "l1_clip": 3.0, "aggregation": "mean"},
        {"compression": "kbit", "kbit_algorithm": "alltoall", "quantizer": "sign"},
        {"compression": "none", "momentum_sync": {"interval": 0}},
        {"compression": "1bit", "momentum_sync": {"interval": 10}, "telemetry": {"vote_stats": True}},
        {"compression": "1bit", "hybrid": {"node_size": 2}, "overlap": True},
        {"compression": "none", "overlap": False, "cuda_aware": False},
        {"comm_backend_name": "mpi", "cuda_aware": True},
    ],
)
def test_combinations_next_to_a_rule_are_accepted(options: dict[str, Any]) -> None:
    """A control for each rule's condition: one option changed from a refused config, and it parses."""
    config = parse_config(options)
    given = config.model_fields_set
    assert not [rule.option for rule in LionCubConfig.CROSS_OPTION_RULES if rule.refuses(config, given)]

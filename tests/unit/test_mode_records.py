"""The compression modes' records (ds_lioncub.modes): one record per mode the config accepts, each answering what
the code asked of the mode's name before, checked against references that do not come from the records.

- the names: the values option ``compression`` accepts, written out here;
- the wire: each record's collectives, added up, against what the transports count when the aggregation the record
  builds really runs one bucket on 1-4 thread ranks (tests/support/thread_world.py);
- the planner: each record's pricing (collectives, message bits, local cost key, study key) against the branches
  that priced the modes before the records, written out here as they were;
- the source: outside ds_lioncub/modes at most 5 branches on ``.compression`` remain, counted with ``ast``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_lioncub import LionCubConfigError, parse_config
from ds_lioncub.aggregation import Bucket, build_aggregation
from ds_lioncub.aggregation.error_feedback import KbitVoteEf21, KbitVoteResidual
from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.rules import CROSS_OPTION_RULES, MODE_REFUSAL_PLACES
from ds_lioncub.modes import MODE_NAMES, MODES, REGISTERED, mode_named, mode_of
from ds_lioncub.planner.bits import bits_per_element
from ds_lioncub.planner.convergence import study_mode
from ds_lioncub.planner.local_costs import aggregation_key
from ds_lioncub.planner.pricing import aggregation_collectives
from tests.support.thread_world import on_every_rank

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ds_lioncub"
REGISTRY = PACKAGE / "modes"

# ---------------------------------------------------------------------------------------------- the names


def test_every_mode_the_config_accepts_has_a_record_and_no_other() -> None:
    accepted = ("none", "1bit", "kbit", "auto")  # as docs/options.md and the users' configs write them
    assert set(MODES) == set(accepted)
    assert MODE_NAMES == accepted  # the order pydantic's message lists them in
    for name in accepted:
        options = parse_config({"compression": name, **({"network": {"bandwidth": "1gbit"}} if name == "auto" else {})})
        assert mode_of(options) is MODES[name] and mode_of(options).name == name
    with pytest.raises(LionCubConfigError, match="Input should be 'none', '1bit', 'kbit' or 'auto'"):
        parse_config({"compression": "2bit"})


def test_a_name_no_mode_answers_to_is_refused_with_the_modes_named() -> None:
    with pytest.raises(LionCubConfigError, match=r"^LionCub: no compression mode is named '2bit' \(the modes: 'none'"):
        mode_named("2bit")


def test_records_are_frozen_and_registered_once() -> None:
    assert len({record.name for record in REGISTERED}) == len(REGISTERED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODES["1bit"].exact = True  # type: ignore[misc]


def test_what_each_record_says_of_itself() -> None:
    """Exact Lion averages, the votes vote, "auto" is neither until the planner resolves it."""
    facts = {name: (r.exact, r.votes, r.chosen_by_planner) for name, r in MODES.items()}
    assert facts == {
        "none": (True, False, False),
        "1bit": (False, True, False),
        "kbit": (False, True, False),
        "auto": (False, False, True),
    }


def test_every_refusal_a_record_declares_has_a_place_in_the_rule_table() -> None:
    """A refusal of an option without a place would never be checked."""
    assert MODE_REFUSAL_PLACES == {"network", "comm_dtype", "error_feedback", "l1_clip"}
    assert len(CROSS_OPTION_RULES) == 21
    for record in REGISTERED:
        for refusal in record.refusals:
            assert refusal.option in MODE_REFUSAL_PLACES, (record.name, refusal.option)


# ---------------------------------------------------------------------------------------------- the wire

# (options, world sizes) the aggregations run on: every k-bit codec on the worlds it holds.
WIRE_CASES: list[tuple[dict[str, Any], int]] = [
    *[({"compression": "none", "comm_dtype": dtype}, p) for dtype in ("fp32", "bf16") for p in (2, 3, 4)],
    *[({"compression": "1bit"}, p) for p in (1, 2, 3, 4)],
    *[
        (
            {
                "compression": "kbit",
                "bits": bits,
                "quantizer": quantizer,
                "kbit_algorithm": algorithm,
                "aggregation": aggregation,
            },
            p,
        )
        for bits in (2, 4, 8)
        for quantizer in ("sign", "l1")
        for algorithm in ("allreduce", "alltoall")
        for aggregation in ("vote", "mean")
        for p in (1, 2, 3, 4)
        if algorithm == "alltoall" or p * (1 if quantizer == "sign" else 2) <= 2**bits - 1
    ],
]
PIECES = [300, 700, 29]  # 1029 elements: no world here divides them, so the votes pad


def _run_one_bucket(options: LionCubConfig, p: int) -> list[tuple[int, int]]:
    """(bytes counted, collectives counted) by each of p thread ranks' transports for one bucket."""
    numel = sum(PIECES)

    def rank_main(transport: Any) -> tuple[int, int]:
        aggregator = build_aggregation(options, transport, gradients_averaged=False)
        assert aggregator is not None
        generator = torch.Generator().manual_seed(transport.rank)
        values = torch.randn(numel, generator=generator)
        mean_abs: list[torch.Tensor | None] = [None] * len(PIECES) if options.quantizer == "l1" else []
        bucket = Bucket(values, list(PIECES), mean_abs, key=(0, 0))
        aggregator.finish(aggregator.start(bucket, True), out=torch.empty(numel))
        return transport.stats.bytes_sent, transport.stats.collectives

    return on_every_rank(p, rank_main)


@pytest.mark.parametrize(("params", "p"), WIRE_CASES, ids=[f"{sorted(c.items())}-p{p}" for c, p in WIRE_CASES])
def test_a_records_wire_is_what_the_transports_count_for_one_bucket(params: dict[str, Any], p: int) -> None:
    options = parse_config(params)
    record = mode_of(options)
    collectives = record.collectives(options, sum(PIECES), p)
    counted = _run_one_bucket(options, p)
    expected = wire.total_bytes_sent(collectives)
    assert [bytes_sent for bytes_sent, _ in counted] == [expected] * p
    assert [issued for _, issued in counted] == [0 if p == 1 else len(collectives)] * p


def test_the_wire_check_sees_a_wrong_count() -> None:
    """A control: the 1-bit vote's transports do not count what the 2-bit all-to-all vote would send."""
    two_bit = parse_config({"compression": "kbit", "bits": 2, "kbit_algorithm": "alltoall"})
    counted = _run_one_bucket(parse_config({"compression": "1bit"}), 4)
    assert counted[0][0] != wire.total_bytes_sent(mode_of(two_bit).collectives(two_bit, sum(PIECES), 4))


@pytest.mark.parametrize("kind", ["residual", "ef21"])
def test_error_feedback_is_layered_on_the_kbit_fields_the_record_builds(kind: str) -> None:
    options = parse_config(
        {"compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall", "error_feedback": {"kind": kind}}
    )

    def build(transport: Any) -> Any:
        return build_aggregation(options, transport, gradients_averaged=False)

    built = on_every_rank(2, build)
    assert all(isinstance(a, KbitVoteResidual if kind == "residual" else KbitVoteEf21) for a in built)
    assert built[0].codec == KbitCodec.build(2, 4, "l1", "alltoall")


def test_exact_lion_builds_nothing_where_the_gradients_are_averaged_or_alone() -> None:
    options = parse_config({"compression": "none"})
    assert on_every_rank(1, lambda t: build_aggregation(options, t, gradients_averaged=False)) == [None]
    assert on_every_rank(2, lambda t: build_aggregation(options, t, gradients_averaged=True)) == [None, None]


# ---------------------------------------------------------------------------------------------- the planner


def _previous_collectives(options: LionCubConfig, numel: int, world_size: int) -> list[wire.Collective]:
    """pricing.aggregation_collectives as it branched on the mode's name before the records."""
    if options.compression == "none":
        return wire.dense_all_reduce_collectives(numel, world_size, {"fp32": 4, "bf16": 2}[options.comm_dtype])
    if options.compression == "1bit":
        return wire.vote_1bit_collectives(numel, world_size)
    codec = KbitCodec.build(world_size, options.bits, options.quantizer, options.kbit_algorithm)
    collectives = wire.kbit_collectives(numel, codec, options.aggregation)
    if options.error_feedback is not None and options.error_feedback.kind == "ef21":
        collectives.insert(0, wire.Collective("all_gather", 4, world_size))
    return collectives


def _previous_bits(options: LionCubConfig, workers: int) -> int:
    """bits.bits_per_element as it branched on the mode's name before the records."""
    if options.compression == "none":
        return {"fp32": 32, "bf16": 16}[options.comm_dtype]
    numel = wire.vote_padded_numel(1, workers)
    if options.compression == "1bit":
        return 8 * wire.sign_vote_message_bytes(numel, workers) // numel
    codec = KbitCodec.build(workers, options.bits, options.quantizer, options.kbit_algorithm)
    return 8 * wire.kbit_message_bytes(codec, numel) // numel


def _previous_key(options: LionCubConfig) -> str:
    """local_costs.aggregation_key as it branched on the mode's name before the records."""
    if options.compression == "none":
        return f"none/{options.comm_dtype}"
    if options.compression == "1bit":
        return "1bit"
    return f"kbit/{options.quantizer}/{options.bits}/{options.kbit_algorithm}/{options.aggregation}"


PRICED = [
    {"compression": "none"},
    {"compression": "none", "comm_dtype": "bf16"},
    {"compression": "1bit"},
    *[
        {"compression": "kbit", "bits": b, "quantizer": q, "kbit_algorithm": a, "aggregation": g}
        for b in (2, 4, 8)
        for q in ("sign", "l1")
        for a in ("allreduce", "alltoall")
        for g in ("vote", "mean")
    ],
    {"compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall", "error_feedback": {"kind": "ef21"}},
    {"compression": "kbit", "quantizer": "l1", "error_feedback": {"kind": "residual"}},
]


@pytest.mark.parametrize("params", PRICED, ids=[str(sorted(p.items())) for p in PRICED])
def test_the_planners_pricing_per_record_is_the_previous_pricing(params: dict[str, Any]) -> None:
    options = parse_config(params)
    assert aggregation_key(options) == _previous_key(options)
    for world_size in (1, 2, 3, 4, 7, 16, 64):
        try:
            expected = _previous_collectives(options, 12_345, world_size)
        except LionCubConfigError:  # the fields cannot hold the world: refused alike
            with pytest.raises(LionCubConfigError):
                aggregation_collectives(options, 12_345, world_size)
            continue
        assert aggregation_collectives(options, 12_345, world_size) == expected
        assert bits_per_element(params, world_size) == _previous_bits(options, world_size)


def _previous_study_mode(params: dict[str, Any]) -> str | None:
    """convergence.study_mode as it branched on the mode's name before the records."""
    compression = params.get("compression", "1bit")
    if compression == "none":
        return None
    if params.get("error_feedback"):
        return "unmeasured"
    sync = params.get("momentum_sync") or {}
    synced = bool(sync.get("interval")) and sync.get("layers", "auto") == "auto" and int(sync["interval"]) <= 10
    voted = params.get("aggregation", "vote") == "vote"
    clip = params.get("clip")
    clipped = "+clip" if clip and clip.get("rule", "mean") == "mean" else ""
    if compression == "1bit" or (params.get("quantizer", "sign") == "sign" and voted):
        return ("1bit+sync" if synced else "1bit") + clipped
    if params.get("quantizer") == "l1" and voted:
        return f"{params.get('bits', 4)}bit-l1-{params.get('kbit_algorithm', 'allreduce')}{clipped}"
    return "unmeasured"


STUDIED = [
    {**params, **more}
    for params in PRICED
    for more in (
        {},
        {"clip": {"max_norm": 1.0}},
        {"clip": {"rule": "deepspeed"}},
        {"momentum_sync": {"interval": 10}},
        {"momentum_sync": {"interval": 50, "layers": "auto"}},
    )
]


@pytest.mark.parametrize("params", STUDIED, ids=[str(sorted(p.items())) for p in STUDIED])
def test_each_records_study_key_is_the_previous_one(params: dict[str, Any]) -> None:
    assert study_mode(params) == _previous_study_mode(params)
    try:
        dumped = parse_config(params).model_dump()  # every option written out, as the planner's tests read them
    except LionCubConfigError:  # momentum_sync with exact Lion: refused, no options to dump
        return
    assert study_mode(dumped) == _previous_study_mode(dumped)


# ---------------------------------------------------------------------------------------------- the source

BRANCH_LIMIT = 5


def _compression_branches(source: str) -> list[int]:
    """Lines that branch on ``X.compression``: a comparison (==, !=, in, not in, ...) with it on either side, or a
    ``match`` on it. Reading it to print or to pass it on is no branch."""

    def is_compression(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "compression"

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(is_compression, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.Match) and is_compression(node.subject):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_branch_scan_counts_comparisons_and_matches_not_reads() -> None:
    """A control: four branches (==, not in, a match, a comparison on the right), beside two reads."""
    source = (
        "if options.compression == 'none':\n    pass\n"
        "x = options.compression not in ('none', 'auto')\n"
        "match self.options.compression:\n    case 'kbit':\n        pass\n"
        "y = 'auto' != config.compression\n"
        "print(f'{options.compression!r}')\n"
        "mode = MODES[options.compression]\n"
    )
    assert _compression_branches(source) == [1, 3, 4, 7]


def test_outside_the_registry_at_most_five_branches_on_compression_remain() -> None:
    found = {
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if REGISTRY not in path.parents
        for line in _compression_branches(path.read_text())
    }
    assert len(found) <= BRANCH_LIMIT, sorted(found)

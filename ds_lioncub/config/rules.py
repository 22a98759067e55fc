"""The rules across LionCub's options: combinations that cannot work together, one table entry each.

:data:`CROSS_OPTION_RULES` is checked in order by :class:`~ds_lioncub.config.LionCubConfig`'s validator after
every option is valid on its own; a config with several problems is refused with the first rule's message
(:func:`~ds_lioncub.config.parse_config` puts "LionCub: invalid options: " before it). A new option that
depends on another adds one entry here, not a branch. What depends on the mode is asked of its record
(:mod:`ds_lioncub.modes`): whether the mode takes an option (:attr:`~ds_lioncub.modes.ModeRecord.takes`), and the
refusals only it has, checked at their option's place in the table. :func:`hybrid_refusal` is the message for an
option the ZeRO hybrid refuses (a rule of the options and ZeRO's stage), which the DeepSpeed wiring and the
simulator both raise.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from ds_lioncub.comm.transport import cuda_aware_conflict
from ds_lioncub.config.sections import (
    ErrorFeedbackConfig,
    HybridConfig,
    JobConfig,
    MomentumSyncConfig,
    NetworkConfig,
    TelemetryConfig,
)
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import ModeOptions, ModeRefusal, mode_of


class OptionValues(ModeOptions, Protocol):
    """The options a rule reads: :class:`~ds_lioncub.config.LionCubConfig` is one. The rules are written
    against this view so that this table does not import the model that checks it (the model imports the
    table). What a mode's record reads (:class:`~ds_lioncub.modes.ModeOptions`) is part of it."""

    @property
    def network(self) -> NetworkConfig | None: ...
    @property
    def job(self) -> JobConfig | None: ...
    @property
    def model_fields_set(self) -> set[str]: ...
    @property
    def momentum_sync(self) -> MomentumSyncConfig: ...
    @property
    def telemetry(self) -> TelemetryConfig: ...
    @property
    def hybrid(self) -> HybridConfig | None: ...
    @property
    def overlap(self) -> bool: ...
    @property
    def comm_backend_name(self) -> str: ...
    @property
    def cuda_aware(self) -> bool: ...
    @property
    def error_feedback(self) -> ErrorFeedbackConfig | None: ...


@dataclass(frozen=True)
class CrossOptionRule:
    """A combination of LionCub options that cannot work together.

    ``option`` is the option the rule governs (the one its message tells to drop or change first);
    ``refuses(config, given)`` is true for a config the rule refuses, where ``given`` holds the options the
    user set (to any value, the default included); ``message(config)`` says why and how to fix it
    (:func:`parse_config` puts "LionCub: invalid options: " before it and a period after).
    """

    option: str
    refuses: Callable[[OptionValues, AbstractSet[str]], bool]
    message: Callable[[OptionValues], str]


def _not_taken(
    name: str, refuses: Callable[[OptionValues], bool], message: Callable[[OptionValues], str]
) -> CrossOptionRule:
    """Option ``name`` where the mode does not take it (its record's ``takes``) and ``refuses`` holds."""
    return CrossOptionRule(
        name.split(".")[0], lambda config, given: name not in mode_of(config).takes and refuses(config), message
    )


def _kbit_only(name: str) -> CrossOptionRule:
    """``name`` set with a mode that does not read the k-bit fields, where it would silently do nothing."""
    return CrossOptionRule(
        name,
        lambda config, given: name not in mode_of(config).takes and name in given,
        lambda config: (
            f"{name}={getattr(config, name)!r} only applies to compression='kbit' "
            f"(compression is {config.compression!r}); set compression='kbit' or drop {name}"
        ),
    )


class ModesOwnRefusals(CrossOptionRule):
    """The place in the table where the refusals of one option that only the config's mode has (its record's
    ``refusals``) are checked."""


def _refused_by_the_mode(option: str) -> CrossOptionRule:
    """:class:`ModesOwnRefusals` of ``option``: the first of the mode's refusals of it that refuses gives the
    message."""

    def refusing(config: OptionValues, given: AbstractSet[str]) -> ModeRefusal | None:
        refusals = (refusal for refusal in mode_of(config).refusals if refusal.option == option)
        return next((refusal for refusal in refusals if refusal.refuses(config, given)), None)

    def message(config: OptionValues) -> str:
        refusal = refusing(config, config.model_fields_set)
        return "" if refusal is None else refusal.message(config)

    return ModesOwnRefusals(option, lambda config, given: refusing(config, given) is not None, message)


def _cuda_aware_conflict_of(config: OptionValues) -> str:
    """Why the config's cuda_aware cannot go with its comm_backend_name ("": it can); make_transport says the same."""
    return cuda_aware_conflict(config.comm_backend_name, config.cuda_aware) or ""


# Every rule across options, in the order they are checked: a config with several problems is refused with the
# first rule's message. A new option that depends on another adds its rule here (one entry); a refusal only one
# mode has goes in its record, at an option that has a place here (_refused_by_the_mode).
CROSS_OPTION_RULES: tuple[CrossOptionRule, ...] = (
    _refused_by_the_mode("network"),
    _not_taken(
        "network",
        lambda config: config.network is not None,
        lambda config: (
            f"network only applies to compression='auto' (compression is {config.compression!r}); "
            f"set compression='auto' or drop network"
        ),
    ),
    _not_taken(
        "job",
        lambda config: config.job is not None,
        lambda config: (
            f"job only applies to compression='auto' (compression is {config.compression!r}); "
            f"set compression='auto' or drop job"
        ),
    ),
    _refused_by_the_mode("comm_dtype"),
    _kbit_only("bits"),
    _kbit_only("quantizer"),
    _kbit_only("aggregation"),
    _kbit_only("kbit_algorithm"),
    _kbit_only("l1_clip"),
    CrossOptionRule(
        "comm_dtype",
        lambda config, given: (
            "comm_dtype" not in mode_of(config).takes and "comm_dtype" in given and config.comm_dtype != "fp32"
        ),
        lambda config: (
            f"comm_dtype={config.comm_dtype!r} applies to compression='none' (the uncompressed gradient "
            f"all-reduce); compressed modes send bits, so drop comm_dtype"
        ),
    ),
    _not_taken(
        "momentum_sync",
        lambda config: config.momentum_sync.interval > 0,
        lambda config: (
            "momentum_sync only applies to compressed modes: with compression='none' every rank's momentum "
            "is already identical; drop momentum_sync or choose compression='1bit' or 'kbit'"
        ),
    ),
    _not_taken(
        "telemetry.vote_stats",
        lambda config: config.telemetry.vote_stats,
        lambda config: (
            "telemetry.vote_stats only applies to compressed modes (compression='none' takes no vote); drop "
            "telemetry.vote_stats or choose compression='1bit' or 'kbit'"
        ),
    ),
    _not_taken(
        "hybrid",
        lambda config: config.hybrid is not None,
        lambda config: (
            "hybrid only applies to compressed modes under ZeRO stage 1, 2 or 3 (with compression='none' ZeRO "
            "shards exact Lion over the whole world); drop hybrid or choose compression='1bit' or 'kbit'"
        ),
    ),
    _not_taken(
        "overlap",
        lambda config: config.overlap,
        lambda config: (
            "overlap=True starts compressed votes during backward; with compression='none' the gradients "
            "are averaged instead (DDP or DeepSpeed overlap that themselves). Drop overlap or choose "
            "compression='1bit' or 'kbit'"
        ),
    ),
    CrossOptionRule(
        "overlap",
        lambda config, given: config.overlap and config.comm_backend_name != "torch",
        lambda config: (
            f"overlap=True needs collectives that run while backward goes on, which "
            f"comm_backend_name={config.comm_backend_name!r} does not offer yet; use comm_backend_name='torch' "
            f"or drop overlap"
        ),
    ),
    CrossOptionRule("cuda_aware", lambda config, given: bool(_cuda_aware_conflict_of(config)), _cuda_aware_conflict_of),
    _not_taken(
        "error_feedback",
        lambda config: config.error_feedback is not None,
        lambda config: (
            f"error_feedback only applies to compression='kbit' with quantizer='l1' (compression is "
            f"{config.compression!r}: a sign vote or an exact mean rounds nothing off that it could feed back); "
            f"set compression='kbit', quantizer='l1' or drop error_feedback"
        ),
    ),
    _refused_by_the_mode("error_feedback"),
    CrossOptionRule(
        "error_feedback",
        lambda config, given: config.error_feedback is not None and config.overlap,
        lambda config: (
            "error_feedback does not support overlap=True yet (a vote started during backward would update "
            "the feedback state before the final gradients are known); drop overlap or error_feedback"
        ),
    ),
    CrossOptionRule(
        "error_feedback",
        lambda config, given: (
            config.error_feedback is not None
            and config.error_feedback.kind == "ef21"
            and (config.kbit_algorithm != "alltoall" or config.aggregation != "vote")
        ),
        lambda config: (
            f"error_feedback kind 'ef21' needs kbit_algorithm='alltoall' and aggregation='vote' (got "
            f"{config.kbit_algorithm!r} and {config.aggregation!r}: each chunk's owner keeps the shared "
            f"estimate and applies its sign); set them or use kind 'residual'"
        ),
    ),
    _refused_by_the_mode("l1_clip"),
)

#: The options a mode's own refusals may govern: those with a place in the table (a refusal of another would
#: never be checked; tests/unit/test_mode_records.py holds every record to it).
MODE_REFUSAL_PLACES: frozenset[str] = frozenset(
    rule.option for rule in CROSS_OPTION_RULES if isinstance(rule, ModesOwnRefusals)
)


def hybrid_refusal(options: OptionValues, stage: int, what: str, fix: str) -> LionCubConfigError:
    """The error for an option the ZeRO hybrid does not support: what the DeepSpeed wiring raises, and what
    ``python -m ds_lioncub.simulate`` says for the same ds_config (a rule of the options and ZeRO's stage)."""
    return LionCubConfigError(
        f"LionCub: compression={options.compression!r} under ZeRO stage {stage} (the hybrid: ZeRO inside each node, "
        f"Lion Cub's vote across nodes) does not support {what}. To use it, {fix}; or use compression='none' "
        f"(exact Lion under ZeRO)."
    )


__all__ = [
    "CROSS_OPTION_RULES",
    "MODE_REFUSAL_PLACES",
    "CrossOptionRule",
    "ModesOwnRefusals",
    "OptionValues",
    "hybrid_refusal",
]

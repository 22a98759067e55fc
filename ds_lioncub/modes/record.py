"""What one compression mode is, declared in one place: :class:`ModeRecord`.

Why: what a mode means used to be spread over the config's rules, the aggregation's builder, the wire's
pricing, the planner's tables and the study's keys, each a branch on ``compression``. A record holds all of
it, so the call sites ask the record a question (``mode_of(options).exact``) instead of testing the mode's
name, and a new mode is one file declaring its record plus one line registering it
(:mod:`ds_lioncub.modes`).

A record reads the options through :class:`ModeOptions`, the few fields a mode looks at, so that this
package does not import :mod:`ds_lioncub.config` (the config's rules ask the records, so the records sit below
the config).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from ds_lioncub.aggregation.base import Aggregator
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.vocabulary import Aggregation, KbitAlgorithm, KbitWidth, Quantizer
from ds_lioncub.comm.wire import Collective


class FeedbackChoice(Protocol):
    """The part of option ``error_feedback`` a record reads."""

    @property
    def kind(self) -> str: ...


class ModeOptions(Protocol):
    """The options a record reads: :class:`~ds_lioncub.config.LionCubConfig` is one."""

    @property
    def compression(self) -> str: ...
    @property
    def comm_dtype(self) -> str: ...
    @property
    def bits(self) -> KbitWidth: ...
    @property
    def quantizer(self) -> Quantizer: ...
    @property
    def aggregation(self) -> Aggregation: ...
    @property
    def kbit_algorithm(self) -> KbitAlgorithm: ...
    @property
    def l1_clip(self) -> float: ...
    @property
    def error_feedback(self) -> FeedbackChoice | None: ...
    @property
    def network(self) -> object | None: ...


@dataclass(frozen=True)
class ModeRefusal:
    """A combination of options that only this mode refuses.

    ``option`` is the option the refusal governs: the config's table of rules
    (:data:`ds_lioncub.config.rules.CROSS_OPTION_RULES`) checks a mode's refusals of an option at that option's
    place, so that a config with several problems keeps being refused with the same first message.
    ``refuses(options, given)`` and ``message(options)`` are as for the table's rules.
    """

    option: str
    refuses: Callable[[ModeOptions, AbstractSet[str]], bool]
    message: Callable[[ModeOptions], str]


#: The options that apply to every mode that votes (a mode's :attr:`ModeRecord.takes`); exact Lion refuses them.
VOTE_OPTIONS = frozenset({"momentum_sync", "telemetry.vote_stats", "hybrid", "overlap"})
#: What the set-up log line shows of a voting mode, after the options every mode shows.
VOTE_SHOWN: tuple[str, ...] = ("tie_break", "check_finite", "overlap")
#: The study key of a mode it has no cell for.
UNMEASURED = "unmeasured"
#: What a mode's study key adds with option clip (``"1bit+clip"``).
CLIP_SUFFIX = "+clip"


def clip_suffix(params: Mapping[str, Any]) -> str:
    """:data:`CLIP_SUFFIX` where option clip clips the mean gradient (rule "mean", its default), else ""; option clip
    changes what the workers' updates are made of, so the study gave it cells of its own."""
    clip = params.get("clip")
    return CLIP_SUFFIX if clip and clip.get("rule", "mean") == "mean" else ""


def sign_vote_study_key(params: Mapping[str, Any]) -> str:
    """The study key of a vote of the workers' signs: ``"1bit"``, ``"1bit+sync"`` with momentum sync of the default
    layers every 10 steps or fewer (the study's setting), and :data:`CLIP_SUFFIX` with option clip."""
    sync = params.get("momentum_sync") or {}
    synced = bool(sync.get("interval")) and sync.get("layers", "auto") == "auto" and int(sync["interval"]) <= 10
    return ("1bit+sync" if synced else "1bit") + clip_suffix(params)


@dataclass(frozen=True)
class ModeRecord:
    """One compression mode: what the config, the aggregation, the wire, the planner and the study know of it.

    Attributes:
        name: the value of option ``compression`` it answers to.
        exact: exact Lion: the ranks average their gradients and keep identical momenta (no vote).
        votes: the ranks keep their own gradients and vote on (or average) their updates.
        chosen_by_planner: a placeholder the planner resolves into a concrete mode once the world is known
            (``"auto"``); neither exact nor a vote until then.
        takes: the options that apply only to some modes and apply to this one (``"bits"``, ``"comm_dtype"``,
            ``"telemetry.vote_stats"``, ...); the config refuses the others when given.
        refusals: the combinations of options this mode alone refuses.
        shown_options: the options the set-up log line shows for this mode, after those every mode shows.
        build_aggregation: ``(options, transport, gradients_averaged) -> Aggregator | None``, the aggregation a
            step runs every bucket through (None: the gradients as they are). Error feedback is an option
            layered on the aggregation built here (:func:`ds_lioncub.aggregation.build_aggregation`).
        collectives: ``(options, numel, world_size) -> [Collective]``, what one aggregation of ``numel``
            elements issues, as the transports count it (:mod:`ds_lioncub.comm.wire`).
        message_bytes: ``(options, numel, world_size) -> int``, the bytes of each rank's message for ``numel``
            elements (bits per element: ``8 * message_bytes / numel``).
        local_cost_key: ``options -> str``, the planner's local cost table key of its aggregation.
        study_key: ``params -> str | None``, how the convergence study names the cells of these LionCub
            params (None: exact Lion, which the study compares with; :data:`UNMEASURED`: no cell).
        scales_by_tensor_mean_abs: ``options -> bool``, whether each rank's message is scaled by the mean |c| of
            each tensor (the L1 quantizer).
    """

    name: str
    exact: bool
    votes: bool
    takes: frozenset[str]
    shown_options: Callable[[ModeOptions], tuple[str, ...]]
    build_aggregation: Callable[[ModeOptions, Transport, bool], Aggregator | None]
    collectives: Callable[[ModeOptions, int, int], list[Collective]]
    message_bytes: Callable[[ModeOptions, int, int], int]
    local_cost_key: Callable[[ModeOptions], str]
    study_key: Callable[[Mapping[str, Any]], str | None]
    chosen_by_planner: bool = False
    refusals: tuple[ModeRefusal, ...] = ()
    scales_by_tensor_mean_abs: Callable[[ModeOptions], bool] = lambda options: False


__all__ = [
    "CLIP_SUFFIX",
    "UNMEASURED",
    "VOTE_OPTIONS",
    "VOTE_SHOWN",
    "FeedbackChoice",
    "ModeOptions",
    "ModeRecord",
    "ModeRefusal",
    "clip_suffix",
    "sign_vote_study_key",
]

"""Which clipping runs (ds_lioncub/config/clip_rule.py), case by case, against the rules as docs/options.md states
them: a compressed mode clips the mean gradient at gradient_clipping unless ``{"rule": "deepspeed"}``; exact Lion
keeps DeepSpeed's clipping; two explicit different norms are refused; a defaulted gradient_clipping gives way."""

from __future__ import annotations

from typing import Any

import pytest

from ds_lioncub.config import parse_config
from ds_lioncub.config.clip_rule import resolve_clipping
from ds_lioncub.errors import LionCubConfigError

ONE_BIT = {"compression": "1bit"}
EXACT = {"compression": "none"}


@pytest.mark.parametrize(
    ("options", "clipping", "written", "stage", "lioncub_clips_at", "engine_clipping"),
    [
        # A compressed mode, clip not given: the mean at gradient_clipping, written or DeepSpeed's default 1.0.
        (ONE_BIT, 1.0, False, 0, 1.0, 0.0),
        (ONE_BIT, 0.5, True, 0, 0.5, 0.0),
        (ONE_BIT, 0.5, True, 2, 0.5, 0.0),  # the ZeRO hybrid
        ({"compression": "kbit", "bits": 4, "quantizer": "l1"}, 2.0, True, 3, 2.0, 0.0),
        (ONE_BIT, 0.0, True, 0, None, 0.0),  # nothing clips
        # DeepSpeed's rule, named: DeepSpeed keeps clipping, LionCub does not.
        ({**ONE_BIT, "clip": {"rule": "deepspeed"}}, 1.0, False, 0, None, 1.0),
        ({**ONE_BIT, "clip": {"rule": "deepspeed"}}, 0.3, True, 2, None, 0.3),
        # A norm given once: in the clip block (gradient_clipping 0, the same value, or defaulted), or a number.
        ({**ONE_BIT, "clip": {"max_norm": 0.7}}, 0.0, True, 0, 0.7, 0.0),
        ({**ONE_BIT, "clip": {"max_norm": 0.7}}, 0.7, True, 0, 0.7, 0.0),
        ({**ONE_BIT, "clip": {"max_norm": 0.7}}, 1.0, False, 0, 0.7, 0.0),
        ({**ONE_BIT, "clip": 0.7}, 1.0, False, 2, 0.7, 0.0),
        ({**ONE_BIT, "clip": {"sketch_bins": 8191}}, 0.4, True, 0, 0.4, 0.0),  # the norm from gradient_clipping
        # Exact Lion: the engine averages first, so DeepSpeed's clipping is the mean's already.
        (EXACT, 1.0, False, 0, None, 1.0),
        (EXACT, 1.0, False, 3, None, 1.0),
        ({**EXACT, "clip": {"max_norm": 0.7}}, 0.0, True, 0, 0.7, 0.0),  # option clip at stage 0, as before 0.2.0
    ],
)
def test_which_clipping_runs(
    options: dict[str, Any],
    clipping: float,
    written: bool,
    stage: int,
    lioncub_clips_at: float | None,
    engine_clipping: float,
) -> None:
    resolution = resolve_clipping(parse_config(options), clipping, written, stage)
    mean = resolution.options.mean_clip
    assert (None if mean is None else mean.max_norm) == lioncub_clips_at
    assert resolution.engine_clipping == engine_clipping
    # Never both, and the log line names what runs.
    assert mean is None or resolution.engine_clipping == 0.0
    if mean is not None:
        assert f"mean gradient at max_norm {lioncub_clips_at:g}" in resolution.description
    elif engine_clipping > 0:
        assert "DeepSpeed" in resolution.description and f"{engine_clipping:g}" in resolution.description
    else:
        assert "no gradient clipping" in resolution.description
    # Idempotent: the wiring resolves again what the engine hook resolved before building LionCub.
    again = resolve_clipping(resolution.options, clipping, written, stage)
    assert again.options.mean_clip == mean


def test_the_sketch_width_is_kept_and_the_default_is_4093() -> None:
    mean = resolve_clipping(parse_config({**ONE_BIT, "clip": {"sketch_bins": 8191}}), 1.0, False, 0).options.mean_clip
    assert mean is not None and mean.sketch_bins == 8191
    default = resolve_clipping(parse_config(ONE_BIT), 1.0, False, 0).options.mean_clip
    assert default is not None and default.sketch_bins == 4093


@pytest.mark.parametrize(
    ("options", "clipping", "written", "stage", "message"),
    [
        ({**ONE_BIT, "clip": {"max_norm": 0.7}}, 1.0, True, 0, "ask for two different clippings"),
        ({**ONE_BIT, "clip": 0.7}, 0.5, True, 2, "set gradient_clipping to 0.7 (or 0)"),
        ({**ONE_BIT, "clip": {"sketch_bins": 8191}}, 0.0, True, 0, "gives no max_norm"),
        ({**EXACT, "clip": {"max_norm": 0.7}}, 0.0, True, 2, "under ZeRO stage 2 needs a compressed mode"),
    ],
)
def test_two_different_requests_are_refused_naming_the_fix(
    options: dict[str, Any], clipping: float, written: bool, stage: int, message: str
) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: ") as raised:
        resolve_clipping(parse_config(options), clipping, written, stage)
    assert message in str(raised.value)

"""What ``python -m ds_lioncub.simulate`` makes of a ds_config, option by option, before any training.

The expectations are the documented behaviour written out here: a compressed mode at ZeRO stage 1-3 is the
hybrid (docs/options.md, hybrid: "used there even when not given"), whose voters are the nodes; a compressed mode
clips the mean gradient by its sketched norm at gradient_clipping unless the config keeps DeepSpeed's rule
(docs/options.md, clip), which clips per node under the hybrid (docs/user-guide.md, the ZeRO hybrid); what the
DeepSpeed job refuses (ds_lioncub/integration/wiring.py) is refused; options that do not change a step's math are
dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.simulate.ds_config import read_ds_config

MODE = {"lr": 1e-3, "compression": "1bit"}
DEEPSPEED_RULE = {"rule": "deepspeed"}


def mean_clip(max_norm: float, sketch_bins: int = 4093) -> dict[str, Any]:
    """Option clip as the job resolves it when it clips the mean gradient (docs/options.md, clip)."""
    return {"rule": "mean", "max_norm": max_norm, "sketch_bins": sketch_bins}


def write(tmp_path: Path, params: dict[str, Any], **extra: Any) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "LionCub", "params": params}, **extra}))
    return path


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("block", [None, {}, {"node_size": 4}])
def test_a_compressed_mode_under_zero_is_the_hybrid(tmp_path: Path, stage: int, block: dict | None) -> None:
    params = MODE if block is None else {**MODE, "hybrid": block}
    config = read_ds_config(write(tmp_path, params, zero_optimization={"stage": stage}))
    assert config.hybrid and config.zero_stage == stage
    assert config.options == {**MODE, "clip": mean_clip(1.0)}  # hybrid is not an option of the virtual world
    assert config.settings.clip_rule == "mean" and config.settings.grad_clip == 0.0
    assert config.node_size == (None if not block else block.get("node_size"))
    [note] = [n for n in config.notes if n.startswith("hybrid config")]
    assert "each simulated worker is one node" in note and "--workers counts nodes" in note
    assert ("G = 4 ranks" in note) == (config.node_size == 4)
    # DeepSpeed's rule, kept by name: each node clipped by its own norm, at gradient_clipping.
    kept = read_ds_config(write(tmp_path, {**params, "clip": DEEPSPEED_RULE}, zero_optimization={"stage": stage}))
    assert kept.settings.clip_rule == "per_worker" and kept.settings.grad_clip == 1.0
    assert "DeepSpeed's own clipping rule" in kept.settings.clipping


def test_exact_lion_under_zero_and_any_mode_at_stage_0_are_not_the_hybrid(tmp_path: Path) -> None:
    exact = read_ds_config(write(tmp_path, {"compression": "none"}, zero_optimization={"stage": 2}))
    assert not exact.hybrid and exact.settings.clip_rule == "deepspeed"
    stage0 = read_ds_config(write(tmp_path, MODE, gradient_clipping=0.5))
    assert not stage0.hybrid and stage0.zero_stage == 0 and stage0.options == {**MODE, "clip": mean_clip(0.5)}
    assert (stage0.settings.grad_clip, stage0.settings.clip_rule) == (0.0, "mean")
    assert "mean gradient at max_norm 0.5" in stage0.settings.clipping
    bf16 = read_ds_config(write(tmp_path, {**MODE, "clip": DEEPSPEED_RULE}, bf16={"enabled": True}))
    assert bf16.settings.clip_rule == "per_worker"  # DeepSpeed's bf16 wrapper clips each rank by its own norm
    off = read_ds_config(write(tmp_path, MODE, gradient_clipping=0))
    assert off.options == MODE and off.settings.grad_clip == 0.0 and "no gradient clipping" in off.settings.clipping


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({**MODE, "overlap": True}, "does not support overlap"),
        ({**MODE, "comm_backend_name": "mpi"}, "does not support comm_backend_name='mpi'"),
        ({**MODE, "momentum_sync": {"interval": 10, "layers": "auto"}}, "use momentum_sync.layers='all'"),
    ],
)
def test_what_the_hybrid_refuses_is_refused(tmp_path: Path, params: dict[str, Any], expected: str) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: ") as error:
        read_ds_config(write(tmp_path, params, zero_optimization={"stage": 2}))
    assert expected in str(error.value) and "under ZeRO stage 2" in str(error.value)


def test_momentum_sync_of_every_layer_is_the_hybrids(tmp_path: Path) -> None:
    params = {**MODE, "momentum_sync": {"interval": 10, "layers": "all"}}
    config = read_ds_config(write(tmp_path, params, zero_optimization={"stage": 1}))
    assert config.hybrid and config.options == {**params, "clip": mean_clip(1.0)}


@pytest.mark.parametrize(
    ("params", "extra", "expected"),
    [
        ({**MODE, "hybrid": {}}, {}, "hybrid applies under ZeRO stage 1, 2 or 3"),
        ({**MODE, "hybrid": {}}, {"zero_optimization": {"stage": 0}}, "hybrid applies under ZeRO stage 1, 2 or 3"),
        ({"compression": "auto", "network": {"bandwidth": "1gbit"}}, {}, "python -m ds_lioncub.planner"),
        (MODE, {"zero_optimization": {"stage": "2"}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        (MODE, {"zero_optimization": 2}, "'zero_optimization' must be a JSON object"),
        ({**MODE, "overlap": True, "comm_backend_name": "mpi"}, {}, "overlap=True needs collectives"),
    ],
)
def test_configs_no_real_job_would_run_are_refused(
    tmp_path: Path, params: dict[str, Any], extra: dict[str, Any], expected: str
) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: ") as error:
        read_ds_config(write(tmp_path, params, **extra))
    assert expected in str(error.value)


def test_options_that_do_not_change_the_math_are_dropped_each_with_its_reason(tmp_path: Path) -> None:
    dropped = {
        "comm_backend_name": "mpi",
        "cuda_aware": True,
        "consistency_check": {"interval": 0},
        "telemetry": {"vote_stats": True},
    }
    config = read_ds_config(write(tmp_path, {**MODE, **dropped}, gradient_clipping=0))
    assert config.options == MODE
    notes = {note.split(" dropped: ")[0]: note for note in config.notes if " dropped: " in note}
    assert set(notes) == set(dropped)
    assert "bit-identical" in read_ds_config(write(tmp_path, {**MODE, "overlap": True})).notes[0]


CLIP = {"max_norm": 1.0, "sketch_bins": 613}


@pytest.mark.parametrize(
    ("params", "extra", "expected"),
    [
        # Two explicit, different norms; a gradient_clipping left to DeepSpeed's default gives way instead.
        ({**MODE, "clip": CLIP}, {"gradient_clipping": 0.5}, "ask for two different clippings"),
        ({"compression": "none", "clip": CLIP}, {"gradient_clipping": 0, "zero_optimization": {"stage": 2}}, "stage 2"),
        ({**MODE, "clip": {"sketch_bins": 613}}, {"gradient_clipping": 0}, "gives no max_norm"),
    ],
)
def test_option_clip_is_refused_where_the_deepspeed_job_refuses_it(
    tmp_path: Path, params: dict[str, Any], extra: dict[str, Any], expected: str
) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: option clip") as error:
        read_ds_config(write(tmp_path, params, **extra))
    assert expected in str(error.value)


@pytest.mark.parametrize("stage", [0, 2])
def test_option_clip_with_deepspeeds_clipping_off_is_the_virtual_worlds(tmp_path: Path, stage: int) -> None:
    params = {**MODE, "clip": CLIP}
    for extra in ({"gradient_clipping": 0}, {"gradient_clipping": 1.0}, {}):  # off, the same norm, defaulted
        config = read_ds_config(write(tmp_path, params, zero_optimization={"stage": stage}, **extra))
        assert config.options == {**MODE, "clip": mean_clip(1.0, 613)} and config.settings.grad_clip == 0.0

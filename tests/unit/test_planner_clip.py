"""Option clip in the planner and ``compression="auto"``: its own study cells, and its sketch priced on every
compressed candidate (one fp64 all-reduce of the sketch over the world, and its local passes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import ds_lioncub.planner.convergence as convergence
from ds_lioncub import parse_config
from ds_lioncub.comm import wire
from ds_lioncub.planner import DEFAULT_LOCAL_COSTS, Cluster, Network, parse_rate, plan
from ds_lioncub.planner.auto import resolve_auto
from ds_lioncub.planner.cli import main
from ds_lioncub.planner.convergence import StudyCell, assess, study_mode
from ds_lioncub.planner.devices import measured_gpu_costs
from ds_lioncub.planner.local_costs import LION_UPDATE
from ds_lioncub.planner.pricing import CLIP_LOCAL_PASSES
from ds_lioncub.planner.time_to_loss import Kappa

CLIP: dict[str, Any] = {"max_norm": 1.0, "sketch_bins": 4093}


def test_a_mode_with_clip_has_cells_of_its_own() -> None:
    assert study_mode({"compression": "1bit", "clip": CLIP}) == "1bit+clip"
    assert study_mode({"compression": "kbit", "bits": 4, "clip": CLIP}) == "1bit+clip"  # sign fields: the 1-bit vote
    l1 = {"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "alltoall", "clip": CLIP}
    assert study_mode(l1) == "8bit-l1-alltoall+clip"
    assert study_mode({"compression": "none", "clip": CLIP}) is None


#: The numbers the noise scale's sketch all-reduces without option clip (telemetry.noise_scale, on by default, with
#: 2+ voters): the default 4093 bins and the rank's squared norm.
NOISE_SCALE_VALUES = 4093 + 1


@pytest.mark.parametrize("bins", [4093, 8191])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(("nodes", "gpus"), [(4, 8), (16, 1)])
def test_every_compressed_candidate_runs_with_clip_and_pays_its_sketch(
    nodes: int, gpus: int, device: str, bins: int
) -> None:
    """Against the same candidate without clip, which already pays the noise scale's sketch (its default bins + 1)
    and its CLIP_LOCAL_PASSES: clip adds the difference of the two sketches' all-reduces (clip's bins + 1, the same
    sketch serving the noise scale), and no second local pass."""
    n, cluster, network = 300_000_000, Cluster(nodes, gpus), Network(parse_rate("10gbit"))
    stages = (0, 2, 3) if nodes > 1 and gpus > 1 else (0,)
    costs = DEFAULT_LOCAL_COSTS if device == "cpu" else measured_gpu_costs("H200")
    assert costs is not None and costs.device == device
    clip = {**CLIP, "sketch_bins": bins}
    plain = {(c.label, c.zero_stage): c for c in plan(n, cluster, network, costs, zero_stages=stages)}
    clipped = plan(n, cluster, network, costs, zero_stages=stages, clip=clip)
    assert len(clipped) == len(plain)
    world = nodes * gpus
    for candidate in clipped:
        if candidate.compression == "none":
            assert "clip" not in candidate.params and (candidate.label, candidate.zero_stage) in plain
            continue
        assert candidate.params["clip"] == clip and " + clip" in candidate.label
        base = plain[(candidate.label.replace(" + clip", ""), candidate.zero_stage)]
        added_bytes = candidate.bytes_per_step_per_rank - base.bytes_per_step_per_rank
        sketch, noise_only = 8 * (bins + 1), 8 * NOISE_SCALE_VALUES
        if candidate.zero_stage == 0:  # one all-reduce over the world
            added = wire.all_reduce_bytes(sketch, world) - wire.all_reduce_bytes(noise_only, world)
        else:  # the hybrid's: inside the node, then across the nodes
            with_clip = wire.all_reduce_bytes(sketch, gpus) + wire.all_reduce_bytes(sketch, nodes)
            added = with_clip - wire.all_reduce_bytes(noise_only, gpus) - wire.all_reduce_bytes(noise_only, nodes)
        assert added_bytes == added, candidate.label
        assert (added_bytes > 0) == (bins > 4093), candidate.label  # at the default width clip's sketch is free
        # One sketch pass serves the clip and the noise scale: the baseline's is already priced.
        assert candidate.local_seconds == pytest.approx(base.local_seconds, rel=1e-12), candidate.label
        assert candidate.seconds_per_step >= base.seconds_per_step


def test_the_baseline_without_clip_pays_the_noise_scales_sketch_pass() -> None:
    """The local pass CLIP_LOCAL_PASSES prices lands on every compressed candidate with 2+ voters, clip or not: the
    1-bit vote over 2 ranks steps its n elements with Lion's update, the vote, and the sketch's pass."""
    n, costs = 10**6, DEFAULT_LOCAL_COSTS
    [vote] = [
        c for c in plan(n, Cluster(2, 1), Network(parse_rate("10gbit")), costs) if c.params == {"compression": "1bit"}
    ]
    expected = (costs.cost(LION_UPDATE) * (1 + CLIP_LOCAL_PASSES["cpu"]) + costs.cost("1bit")) * n
    assert vote.local_seconds == pytest.approx(expected, rel=1e-12)


def test_auto_picks_the_vote_with_clip_where_only_the_plain_vote_loses(monkeypatch: pytest.MonkeyPatch) -> None:
    def cell(mode: str, gap: float, kappa: float) -> StudyCell:
        worth = Kappa(kappa, kappa - 0.05, min(1.0, kappa + 0.05))
        return StudyCell(mode, 64, 0.99, gap, half_width_percent=1.0, seeds=8, kappa=worth)

    # The plain vote worth a fifth of the batch (r = 5 in the worst case), with clip 0.95 (r = 1.05).
    monkeypatch.setattr(convergence, "load_evidence", lambda: (cell("1bit", 8.0, 0.2), cell("1bit+clip", 0.5, 0.95)))
    slow = {"compression": "auto", "network": {"bandwidth": "1gbit"}, "betas": (0.9, 0.99)}
    resolved = resolve_auto(parse_config({**slow, "clip": CLIP}), 1_500_000_000, 64, 1, 0)
    assert resolved.options.compression != "none" and resolved.options.clip is not None
    assert resolved.options.clip.model_dump() == {"rule": "mean", **CLIP}
    # Without clip (LionCub in Python: nothing clips) every sign vote takes the plain vote's r, 5: an L1 mode (no cell:
    # ranked by its step alone) reaches Lion's loss first, so auto passes over every sign vote.
    plain = resolve_auto(parse_config(slow), 1_500_000_000, 64, 1, 0)
    assert study_mode(plain.options.model_dump()) != "1bit"
    # Under DeepSpeed a compressed mode clips the mean at gradient_clipping unless told otherwise: the clip cells.
    engine_default = resolve_auto(parse_config(slow), 1_500_000_000, 64, 1, 0, default_clip=1.0)
    assert study_mode(engine_default.options.model_dump()) == "1bit+clip"
    kept = resolve_auto(
        parse_config({**slow, "clip": {"rule": "deepspeed"}}), 1_500_000_000, 64, 1, 0, default_clip=1.0
    )
    assert study_mode(kept.options.model_dump()) not in ("1bit", "1bit+clip")


def test_the_command_line_plans_with_clip_and_its_blocks_turn_deepspeeds_clipping_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(convergence, "load_evidence", lambda: ())
    cluster = ["--params", "1.5e9", "--nodes", "64", "--gpus-per-node", "8", "--inter-node-bandwidth", "10gbit"]
    assert main([*cluster, "--clip", "0.5", "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    compressed = [c for c in output["candidates"] if c["params"]["compression"] != "none"]
    assert compressed and all(c["params"]["clip"] == {"max_norm": 0.5} for c in compressed)
    assert main([*cluster, "--clip", "0.5"]) == 0
    table = capsys.readouterr().out
    blocks = json.loads(table[table.index("{") :])
    assert blocks["optimizer"]["params"]["clip"] == {"max_norm": 0.5} and blocks["gradient_clipping"] == 0
    # The default plans DeepSpeed's default gradient_clipping, 1.0, as LionCub runs it; 0 clips nothing.
    assert main([*cluster, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["candidates"]
    assert all(c["params"]["clip"] == {"max_norm": 1.0} for c in default if c["params"]["compression"] != "none")
    assert main([*cluster, "--clip", "0", "--json"]) == 0
    assert all("clip" not in c["params"] for c in json.loads(capsys.readouterr().out)["candidates"])
    # DeepSpeed's own rule, named in the params to paste, whose blocks then leave gradient_clipping alone.
    assert main([*cluster, "--clip-rule", "deepspeed", "--json"]) == 0
    kept = [c for c in json.loads(capsys.readouterr().out)["candidates"] if c["params"]["compression"] != "none"]
    assert kept and all(c["params"]["clip"] == {"rule": "deepspeed"} for c in kept)
    with pytest.raises(SystemExit):
        main([*cluster, "--clip", "-1"])


def test_a_mode_not_measured_with_clip_is_judged_by_its_cells_without_it() -> None:
    """2-bit L1's tied votes are not a clipping matter: with clip and no cell of its own it takes its cell
    without clip (and loses by it), saying so; a mode with a clip cell takes that one."""
    cells = (
        StudyCell(mode="2bit-l1-alltoall", workers=64, beta2=0.99, gap_percent=26.0, half_width_percent=1.0, seeds=3),
        StudyCell(mode="1bit", workers=64, beta2=0.99, gap_percent=8.0, half_width_percent=1.0, seeds=8),
        StudyCell(mode="1bit+clip", workers=64, beta2=0.99, gap_percent=0.5, half_width_percent=1.0, seeds=8),
    )
    two_bit = {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall", "clip": CLIP}
    verdict = assess(two_bit, 64, 0.99, cells)
    assert verdict.cell == cells[0] and verdict.loses and "measured without option clip" in verdict.note
    one_bit = assess({"compression": "1bit", "clip": CLIP}, 64, 0.99, cells)
    assert one_bit.cell == cells[2] and not one_bit.loses and "without" not in one_bit.note
    assert assess({"compression": "kbit", "bits": 8, "quantizer": "l1", "clip": CLIP}, 64, 0.99, cells).cell is None

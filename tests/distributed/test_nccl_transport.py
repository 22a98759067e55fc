"""LionCub over NCCL on CUDA devices against the virtual world on the same device, bit for bit.

The virtual world equals LionCub on real gloo ranks bit for bit (test_virtual_world_vs_ranks.py), and
runs its collectives in-process: the same aggregation code on the same device, without a transport.
So NCCL ranks that equal it in every mode (parameters, every step's momenta, bytes) carry exactly what
gloo carries. The overlap cases run the collectives from the backward pass on NCCL: with overlap they
must equal the same steps without it. One rank per device (NCCL refuses two ranks on one device). A
single GPU runs a world of one: its steps take the transport's world-of-one shortcut (no collective),
so there the modes check every step's CUDA work against the virtual world, and the transport's own
calls into NCCL (what the votes put on the wire) are checked directly against their exact results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_virtual_world_vs_ranks import PARAM_NAMES, virtual_run
from tests.support import scenarios as sc
from tests.support.launch import REPO, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

MAX_RANKS = 4


@pytest.fixture(scope="module")
def nccl_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        pytest.skip("NCCL needs a CUDA device (CI and this CPU machine have none)")
    world_size = min(torch.cuda.device_count(), MAX_RANKS)
    work_dir = tmp_path_factory.mktemp("nccl")
    return run_ranks(REPO / "tests" / "workers" / "nccl_scenarios.py", world_size, work_dir)


def test_the_transports_own_nccl_collectives_give_the_exact_results(nccl_ranks: list[dict[str, Any]]) -> None:
    """Byte all-to-all and all-gather, int32 sums, blocking and issued: what every vote puts on the wire."""
    for rank, results in enumerate(nccl_ranks):
        raw = results["raw"]
        assert isinstance(raw, dict), raw
        assert raw and all(raw.values()), (rank, [key for key, ok in raw.items() if not ok])


def test_every_mode_over_nccl_matches_the_virtual_world_bit_for_bit(nccl_ranks: list[dict[str, Any]]) -> None:
    p = len(nccl_ranks)
    assert all(rank["backend"] == "nccl" for rank in nccl_ranks)
    failed = {mode: nccl_ranks[0][mode] for mode in sc.training_modes(p) if isinstance(nccl_ranks[0][mode], str)}
    assert not failed, failed
    for mode, options in sc.training_modes(p).items():
        virtual = virtual_run(p, options, device="cuda")
        for rank, results in enumerate(nccl_ranks):
            got = results[mode]
            for name in PARAM_NAMES:
                assert torch.equal(got[f"param/{name}"], virtual[f"param/{name}"]), (mode, rank, name)
                assert not torch.equal(got[f"param/{name}"], sc.init_params()[name]), f"{mode}: {name} never moved"
            for step in range(1, sc.TRAIN_STEPS + 1):
                for name in PARAM_NAMES:
                    expected = virtual[f"exp-avg/{rank}/{step}/{name}"]
                    assert torch.equal(got[f"exp-avg/{step}/{name}"], expected), (mode, rank, step, name)
                sent, counted = got[f"stats/{step}"], virtual[f"stats/{rank}/{step}"]
                assert (sent.bytes_sent, sent.bytes_received) == (counted.bytes_sent, counted.bytes_received), (
                    mode,
                    rank,
                    step,
                )
                if p > 1 and options.get("compression", "none") != "none":
                    assert sent.bytes_sent > 0, (mode, step)  # the step really went through the transport


def test_overlap_over_nccl_equals_the_same_steps_without_it(nccl_ranks: list[dict[str, Any]]) -> None:
    if len(nccl_ranks) == 1:
        pytest.skip("a world of one runs its steps as without overlap (nothing to hide): needs 2 or more GPUs")
    failed = {key: value for key, value in nccl_ranks[0].items() if key.endswith("/failed")}
    assert not failed, failed
    for results in nccl_ranks:
        for case in sc.OVERLAP_CASES:
            on, off = f"overlap-on/{case}", f"overlap-off/{case}"
            for name in PARAM_NAMES:
                assert torch.equal(results[f"{on}/param/{name}"], results[f"{off}/param/{name}"]), (case, name)
                momentum_on, momentum_off = results[f"{on}/exp-avg/{name}"], results[f"{off}/exp-avg/{name}"]
                assert (momentum_on is None) == (momentum_off is None), (case, name)
                if momentum_on is not None:
                    assert torch.equal(momentum_on, momentum_off), (case, name)
            assert results[f"{on}/launched-in-backward"] > 0, case  # the collectives really ran in backward
            assert results[f"{off}/launched-in-backward"] == 0, case

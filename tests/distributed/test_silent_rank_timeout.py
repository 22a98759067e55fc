"""A rank that goes silent (SIGSTOP: its sockets stay open, nothing answers) ends its peer's LionCub
collectives with gloo's timeout error, on every group LionCub uses: the default group its steps vote on,
the overlap vote's own group and the ZeRO hybrid's vote group, the last two created by LionCub with the
timeout the job gave ``init_process_group`` (torch's ``new_group`` would otherwise give them 30 minutes).

Two gloo ranks on loopback; the test's hard limit turns a hang into a failure. No timing is asserted
beyond that limit: gloo's message names the timeout it waited, which is the independent reference.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.launch import worker_environment

pytestmark = pytest.mark.distributed

TIMEOUT_S = 5
HARD_LIMIT_S = 150.0  # start-up of two ranks on a loaded machine plus the timeout, many times over

WORKER = textwrap.dedent("""
    import datetime, os, signal, sys
    import torch, torch.distributed as dist
    from ds_lioncub import LionCub
    from ds_lioncub.comm.topology import create_groups, plan_hybrid
    from ds_lioncub.comm.transport import TorchTransport

    rank, store, where, timeout_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout_s)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = LionCub(model.parameters(), lr=1e-3, compression="1bit", overlap=where == "overlap")
    hybrid_vote_group = create_groups(plan_hybrid(2, 1), rank).vote_group if where == "hybrid" else None

    def go_silent_or_step(step):
        if rank == 1 and step == 3:
            print("rank 1 goes silent", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        model(torch.randn(4, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for step in range(3):
        go_silent_or_step(step)
    if where == "steps":
        for step in range(3, 1000):
            go_silent_or_step(step)
    else:
        if rank == 1:
            go_silent_or_step(3)
        # rank 0: one all-to-all on a group LionCub made, while rank 1 is stopped
        overlap_vote = optimizer.rank_step.overlap.vote
        transport = overlap_vote.transport if where == "overlap" else TorchTransport(hybrid_vote_group)
        print(f"rank 0 waits on the {where} group", flush=True)
        transport.all_to_all(torch.zeros(64, dtype=torch.uint8))
    print("no error", flush=True)
""")


@pytest.mark.parametrize("where", ["steps", "overlap", "hybrid"])
def test_a_silent_rank_ends_its_peer_with_the_group_timeout(where: str, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(store), where, str(TIMEOUT_S)],
            env=worker_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        try:
            output, _ = ranks[0].communicate(timeout=HARD_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still waiting {HARD_LIMIT_S:.0f} s after start: the {where} group ignores the timeout")
    finally:
        for process in ranks:
            process.kill()  # SIGKILL also ends the stopped rank
            process.communicate()
    assert ranks[0].returncode != 0, output[-3000:]
    assert "no error" not in output
    if where != "steps":
        assert f"rank 0 waits on the {where} group" in output, output[-3000:]
    # gloo's own words: it gave up after exactly the timeout init_process_group was given.
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in output, output[-3000:]

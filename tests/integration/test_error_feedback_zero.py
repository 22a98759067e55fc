"""Error feedback under ZeRO stage 3: refused before LionCub is built, with the fix named (a real
``deepspeed.initialize`` on one rank, in a fresh interpreter: it initialises torch.distributed, which the
in-process tests must not see). ZeRO-3 steps its sub-groups in separate calls, and the feedback state is
kept per bucket of one call (docs/design.md, section 4.8); stages 1 and 2 run it
(tests/integration/test_zero_hybrid.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.deepspeed

REPO = Path(__file__).resolve().parents[2]

ZERO3_WITH_EF = textwrap.dedent(
    """
    import os, socket
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import ds_lioncub
    params = {"lr": 1e-3, "compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall",
              "error_feedback": {"kind": "residual"}}
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "LionCub", "params": params}}
    net = torch.nn.Linear(8, 4)
    try:
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        print("REFUSED-WITH none")
    except Exception as error:
        print("REFUSED-WITH", type(error).__name__, str(error).replace("\\n", " "))
    """
)


def test_error_feedback_under_zero_stage_3_is_refused_before_training() -> None:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", ZERO3_WITH_EF], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFUSED-WITH ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    assert lines[-1] == (
        "REFUSED-WITH LionCubConfigError LionCub: compression='kbit' under ZeRO stage 3 (the hybrid: ZeRO inside "
        "each node, Lion Cub's vote across nodes) does not support error_feedback yet (ZeRO-3 steps its sub-groups "
        "in separate calls, and the feedback state is kept per bucket of one call). To use it, drop error_feedback, "
        "or run at zero_optimization.stage 0, 1 or 2; or use compression='none' (exact Lion under ZeRO)."
    )

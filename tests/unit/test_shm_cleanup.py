"""The launch helpers remove the shared-memory buffers DeepSpeed's CPU jobs leave in /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from examples.compare import free_port, remove_deepspeed_shm_buffers

SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")
def test_only_the_finished_jobs_buffers_are_removed() -> None:
    port = free_port()
    uid = os.getuid()
    ours = [SHM / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}" for rank in range(2)]
    # Another job's port that shares a prefix or suffix with ours, and another user's buffer.
    others = [
        SHM / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}1_0",
        SHM / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_1{port}_0",
        SHM / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_{port}_0",
    ]
    for path in ours + others:
        path.write_bytes(b"x")
    try:
        remove_deepspeed_shm_buffers(port)
        assert [path.exists() for path in ours] == [False, False]
        assert [path.exists() for path in others] == [True, True, True]
    finally:
        for path in ours + others:
            path.unlink(missing_ok=True)

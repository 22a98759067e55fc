"""The example's torch threads per rank do not follow the machine's core count: MKL splits a
weight gradient's sum over the batch by thread count, so a count derived from the cores made `make train`'s
losses differ from machine to machine (benchmarks/RESULTS.md, "make train across thread counts")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("cores", [2, 16, 64])
def test_the_example_runs_one_thread_per_rank_whatever_the_cores(
    cores: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples import train_gpt

    config = tmp_path / "ds_config.json"
    config.write_text("{}")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's ranks on this machine
    before = torch.get_num_threads()
    try:
        args = train_gpt.parse_args(["--deepspeed_config", str(config)])
        assert train_gpt.set_threads(args.threads) == 1 and torch.get_num_threads() == 1
        # --threads 0 still asks for the machine's share: cores / local ranks, so it does depend on the cores.
        assert train_gpt.set_threads(0) == cores // 2 and torch.get_num_threads() == cores // 2
    finally:
        torch.set_num_threads(before)

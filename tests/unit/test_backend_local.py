"""CompressedBackend in one process (torch.distributed not initialised: a world of one).

The legacy error-compensated compressed_allreduce (DeepSpeed <= 0.19.7's signature and semantics): its
padding rule, its argument checks, and hand-worked values at p = 1, where the one worker's compressed
buffer is also the server's. The multi-rank cases are in tests/distributed/test_backend_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_lioncub import CompressedBackend
from ds_lioncub.comm import legacy_padded_numel


def test_legacy_padded_numel_hand_values() -> None:
    # numel rounded up to p * lcm(p, 8)
    assert legacy_padded_numel(6, 1) == 8
    assert legacy_padded_numel(8, 1) == 8
    assert legacy_padded_numel(10, 3) == 72
    assert legacy_padded_numel(33, 4) == 64
    assert legacy_padded_numel(1, 8) == 64


@pytest.mark.parametrize("worker_numel", [12, 8, 4])
def test_legacy_bad_worker_error_size(worker_numel: int) -> None:
    # 12 is not a multiple of 8; 8 and 4 are smaller than the 10-element buffer.
    with pytest.raises(ValueError) as raised:
        CompressedBackend().compressed_allreduce(
            torch.ones(10), torch.zeros(worker_numel), torch.zeros(worker_numel), 0
        )
    message = str(raised.value)
    assert str(worker_numel) in message and "10" in message, message


def test_legacy_bad_server_error_size() -> None:
    with pytest.raises(ValueError) as raised:
        CompressedBackend().compressed_allreduce(torch.ones(10), torch.zeros(16), torch.zeros(8), 0)
    message = str(raised.value)
    assert "16" in message and "8" in message, message


def test_legacy_world_of_one_hand_worked() -> None:
    # buffer (6 values, shape 2x3) padded to 8: x = [3, -1, 0, 2, -4, 1, 0, 0]; |x|^2 = 31.
    buffer = torch.tensor([[3.0, -1.0, 0.0], [2.0, -4.0, 1.0]])
    worker_error, server_error = torch.zeros(8), torch.zeros(8)
    x = [3.0, -1.0, 0.0, 2.0, -4.0, 1.0, 0.0, 0.0]
    scale = math.sqrt(31 / 8)
    signs = [1.0 if v >= 0 else -1.0 for v in x]  # sgn(0) = +1
    out = CompressedBackend().compressed_allreduce(buffer, worker_error, server_error, 0)
    assert out is buffer and out.shape == (2, 3)
    # One worker: y = scale * signs, whose own scale is `scale` again, so the server error is 0.
    torch.testing.assert_close(out.view(-1), torch.tensor([scale * s for s in signs[:6]]))
    torch.testing.assert_close(worker_error, torch.tensor([v - scale * s for v, s in zip(x, signs, strict=True)]))
    torch.testing.assert_close(server_error, torch.zeros(8), atol=1e-6, rtol=0)


def test_legacy_world_of_one_with_carried_errors() -> None:
    buffer = torch.tensor([1.0, -2.0, 0.5, 0.0, 4.0, -1.0, 2.0, -3.0, 0.25, 1.0])  # padded to 16
    worker_error = torch.linspace(-1.0, 1.0, 16)
    server_error = torch.linspace(0.5, -0.5, 16)
    x = [b + e for b, e in zip(buffer.tolist() + [0.0] * 6, worker_error.tolist(), strict=True)]
    w_scale = math.sqrt(sum(v * v for v in x) / 16)
    w_signs = [1.0 if v >= 0 else -1.0 for v in x]
    y = [w_scale * s + e for s, e in zip(w_signs, server_error.tolist(), strict=True)]
    s_scale = math.sqrt(sum(v * v for v in y) / 16)
    s_signs = [1.0 if v >= 0 else -1.0 for v in y]

    CompressedBackend().compressed_allreduce(buffer, worker_error, server_error, 0)
    torch.testing.assert_close(buffer, torch.tensor([s_scale * s for s in s_signs[:10]]))
    torch.testing.assert_close(worker_error, torch.tensor([v - w_scale * s for v, s in zip(x, w_signs, strict=True)]))
    torch.testing.assert_close(server_error, torch.tensor([v - s_scale * s for v, s in zip(y, s_signs, strict=True)]))

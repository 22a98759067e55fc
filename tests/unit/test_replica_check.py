"""The replica checksum: the sum of a parameter's bit patterns, for every floating dtype, checked with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_lioncub.comm.transport import TorchTransport
from ds_lioncub.consistency.replica_check import check_replicas, parameter_checksums

NUMPY_INTS = {torch.float64: np.int64, torch.float32: np.int32, torch.float16: np.int16}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_checksum_is_the_wrapping_sum_of_the_bit_patterns(dtype: torch.dtype) -> None:
    values = torch.randn(1001, generator=torch.Generator().manual_seed(1)).to(dtype)
    if dtype is torch.bfloat16:  # numpy has no bfloat16: its bits are the top half of float32's
        ints = (values.float().numpy().view(np.int32) >> 16).astype(np.int16)
    else:
        ints = values.numpy().view(NUMPY_INTS[dtype])
    expected = int(ints.astype(np.int64).sum(dtype=np.int64))  # int64 wraps like torch's int64 sum
    assert parameter_checksums([values]).tolist() == [expected]


def test_one_ulp_in_one_element_changes_the_checksum() -> None:
    values = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    changed = values.clone()
    changed[1234] = torch.nextafter(changed[1234], torch.tensor(float("inf")))
    assert not torch.equal(parameter_checksums([values]), parameter_checksums([changed]))


def test_alone_there_is_nothing_to_compare() -> None:
    check_replicas(TorchTransport(), [torch.zeros(3)], ["'w'"], step=100)

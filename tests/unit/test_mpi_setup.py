"""The MPI transport's set-up checks that need no MPI job: the rank-layout check and a missing mpi4py.

The jobs themselves (mpirun, the deepspeed launcher's MPI mode) are in tests/integration/test_mpi.py.
"""

from __future__ import annotations

import sys

import pytest
import torch


def test_rank_layout_check() -> None:
    from ds_lioncub.comm.transport import MpiSetupError, check_rank_layout

    check_rank_layout([None, None, None])  # torch.distributed off everywhere
    check_rank_layout([(0, 3, 0), (1, 3, 1), (2, 3, 2)])
    check_rank_layout([(0, 2, 4), (1, 2, 5)])  # a torch group of other global ranks, in MPI's order
    with pytest.raises(MpiSetupError, match=r"same order.*0->1 \(global 1\), 1->0 \(global 0\).*PMI_RANK"):
        check_rank_layout([(1, 2, 1), (0, 2, 0)])
    with pytest.raises(MpiSetupError, match=r"MPI sees a world of 1 .* group has 4 ranks.*not started by mpirun"):
        check_rank_layout([(2, 4, 2)])
    with pytest.raises(MpiSetupError, match=r"MPI world has 4 ranks and the data-parallel torch group 2"):
        check_rank_layout([(0, 2, 0), (1, 2, 1), (0, 2, 2), (1, 2, 3)])
    with pytest.raises(MpiSetupError, match=r"not on MPI ranks \[1\]"):
        check_rank_layout([(0, 2, 0), None])


@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)


def test_missing_mpi4py_names_the_fix(no_mpi4py: None) -> None:
    from ds_lioncub import CompressedBackend, LionCub
    from ds_lioncub.comm import MpiTransport

    for build in (
        lambda: MpiTransport(),
        lambda: CompressedBackend(comm_backend_name="mpi"),
        lambda: LionCub([torch.nn.Parameter(torch.zeros(3))], comm_backend_name="mpi"),
    ):
        with pytest.raises(ImportError, match=r'needs mpi4py.*pip install "ds_lioncub\[mpi\]"'):
            build()
    # The default transport never touches mpi4py.
    assert CompressedBackend().comm_backend_name == "torch"

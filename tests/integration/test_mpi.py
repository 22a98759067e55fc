"""The MPI transport: comm_backend_name="mpi" against the torch transport and the references.

Three launches: `mpirun -np 2` and `mpirun -np 3` each run tests/workers/mpi_scenarios.py, where
torch.distributed (gloo, set up by deepspeed.init_distributed() from MPI) and MPI carry the same
operations on the same inputs in one job; a 2-rank job started by the deepspeed launcher in MPI
mode (`--launcher mpich --force_multi`) trains a DeepSpeed engine over MPI. The MPI set-up checks
that need no job are in tests/unit/test_mpi_setup.py.

Float sums: both transports sum in rank order (an all-to-all, a per-chunk sum on its owner, an
all-gather), so every operation must agree bit for bit between them; float sums are also checked to lie
within the rounding bound of the exact sum, and the MPI results bit for bit against the rank-order sum
(and so the brute-force simulation).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import checks
from tests.support import mpi_cases as mc
from tests.support import scenarios as sc
from tests.support.launch import REPO, free_port, remove_deepspeed_shm_buffers, worker_environment

WORKER = REPO / "tests" / "workers" / "mpi_scenarios.py"
INSTALL = 'pip install -e ".[mpi]" (`make test` installs the extra)'


def _mpirun() -> str | None:
    beside_python = Path(sys.executable).parent / "mpirun"
    return str(beside_python) if beside_python.exists() else shutil.which("mpirun")


MPIRUN = _mpirun()
HAVE_MPI = MPIRUN is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason=f"mpi4py or mpirun is not installed: {INSTALL}")
pytestmark = pytest.mark.mpi
TRANSPORTS = ("torch", "mpi")


def _environment() -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return worker_environment(DS_ACCELERATOR="cpu", PATH=path)


def _run(command: list[str], result_files: list[Path], timeout_s: float, ok_codes: tuple[int, ...] = (0,)) -> None:
    """Run a launcher in its own session (a hang kills every rank) and require every rank's results."""
    proc = subprocess.Popen(
        command,
        env=_environment(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{' '.join(command[:4])} ... did not finish in {timeout_s} s (hang?)") from None
    missing = [path for path in result_files if not path.exists()]
    if proc.returncode not in ok_codes or missing:
        raise AssertionError(f"{' '.join(command)} exited with {proc.returncode}, missing {missing}:\n{output[-6000:]}")


@pytest.fixture(scope="module", params=(2, 3), ids=lambda p: f"mpirun-np{p}")
def mpi_ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]
) -> list[dict[str, Any]]:
    if not HAVE_MPI:
        pytest.skip(f"mpi4py or mpirun is not installed: {INSTALL}")
    p = request.param
    out = tmp_path_factory.mktemp(f"mpi-np{p}")
    files = [out / f"full-rank{rank}.pt" for rank in range(p)]
    command = [MPIRUN, "-np", str(p), sys.executable, str(WORKER), str(out), "full", str(free_port())]
    _run(command, files, timeout_s=600)
    return [torch.load(path, weights_only=False) for path in files]


def _transport(results: dict[str, Any], name: str) -> dict[str, Any]:
    prefix = f"{name}:"
    return {key.removeprefix(prefix): value for key, value in results.items() if key.startswith(prefix)}


def _is_float_reduce(key: str) -> bool:
    """A result of a floating-point all-reduce scenario."""
    return key.startswith("reduce/") and torch.empty(0, dtype=mc.DTYPES[key.split("/")[1]]).is_floating_point()


def _check_within_rounding(key: str, p: int, sums: list[torch.Tensor]) -> None:
    """Each float sum lies within the rounding-error bound of the exact sum, whatever its order:
    |s - exact| <= ((p - 1) * eps + eps) * sum |x_r|  (p - 1 roundings of partial sums, one final)."""
    _, dtype_name, size = key.split("/")
    inputs = [mc.transport_input(3, dtype_name, int(size), r).double() for r in range(p)]
    exact = torch.stack(inputs).sum(dim=0)
    eps = torch.finfo(mc.DTYPES[dtype_name]).eps
    bound = p * eps * torch.stack(inputs).abs().sum(dim=0)
    for got in sums:
        assert torch.all((got.double() - exact).abs() <= bound), key


# ------------------------------------------------------------------------------------------ same job, two transports


@needs_mpi
def test_every_operation_bit_identical_to_torch_transport(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    compared = 0
    for rank, results in enumerate(mpi_ranks):
        over_torch, over_mpi = _transport(results, "torch"), _transport(results, "mpi")
        assert over_mpi["backend-name"] == "mpi" and over_torch["backend-name"] == "torch"
        assert over_mpi["rank"] == over_torch["rank"] == (rank, p)
        for key, expected in over_torch.items():
            if key in ("backend-name", "rank") or key.startswith("train-transport/"):
                continue
            got = over_mpi[key]
            if isinstance(expected, torch.Tensor):
                assert got.dtype == expected.dtype and got.shape == expected.shape, key
                if _is_float_reduce(key):
                    # Both transports sum floats in rank order: equal bits, and within rounding of the exact sum.
                    _check_within_rounding(key, p, [got, expected])
                assert torch.equal(got, expected), f"rank {rank}: {key}"
            else:  # CommStats (same byte accounting), flags, error messages
                assert got == expected, f"rank {rank}: {key}: {got!r} != {expected!r}"
            compared += 1
        for mode in sc.training_modes(p):
            assert over_mpi[f"train-transport/{mode}"] == "mpi"
    assert compared > 400 * p


@needs_mpi
def test_data_movement_matches_its_definition(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    for rank, results in enumerate(mpi_ranks):
        over_mpi = _transport(results, "mpi")
        for dtype_name in mc.DTYPES:
            for chunk in mc.ALL_TO_ALL_CHUNKS:
                sent = [mc.transport_input(1, dtype_name, chunk * p, r) for r in range(p)]
                expected = torch.cat([s[rank * chunk : (rank + 1) * chunk] for s in sent])
                assert torch.equal(over_mpi[f"a2a/{dtype_name}/{chunk}"], expected)
                assert over_mpi[f"a2a-unchanged/{dtype_name}/{chunk}"] is True
            for size in mc.ALL_GATHER_SIZES:
                expected = torch.cat([mc.transport_input(2, dtype_name, size, r) for r in range(p)])
                assert torch.equal(over_mpi[f"gather/{dtype_name}/{size}"], expected)


@needs_mpi
def test_sums_are_rank_order_sums_identical_on_every_rank(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    for rank, results in enumerate(mpi_ranks):
        over_mpi = _transport(results, "mpi")
        for dtype_name in mc.DTYPES:
            for size in mc.ALL_REDUCE_SIZES:
                expected = mc.rank_order_sum([mc.transport_input(3, dtype_name, size, r) for r in range(p)])
                got = over_mpi[f"reduce/{dtype_name}/{size}"]
                assert got.dtype == expected.dtype and torch.equal(got, expected), f"rank {rank}: {dtype_name}/{size}"
                assert over_mpi[f"reduce-in-place/{dtype_name}/{size}"] is True
        strided = mc.rank_order_sum([mc.transport_input(3, "float32", 64, r).view(8, 8).t() for r in range(p)])
        assert torch.equal(over_mpi["reduce-strided"], strided)


@needs_mpi
def test_host_staging_path_gives_the_same_results(mpi_ranks: list[dict[str, Any]]) -> None:
    """The copy-through-staging-buffers path (device tensors without cuda_aware), forced on CPU tensors."""
    for results in mpi_ranks:
        staged, direct = _transport(results, "staged"), _transport(results, "mpi")
        keys = [key for key in staged if key not in ("rank",)]
        assert len(keys) > 80
        for key in keys:
            if isinstance(direct[key], torch.Tensor):
                assert torch.equal(staged[key], direct[key]) and staged[key].dtype == direct[key].dtype, key
            else:
                assert staged[key] == direct[key], key


@needs_mpi
def test_byte_accounting_is_the_torch_transports(mpi_ranks: list[dict[str, Any]]) -> None:
    for results in mpi_ranks:
        assert results["mpi:stats"] == results["torch:stats"]
        assert results["mpi:stats"].bytes_sent > 0


# ---------------------------------------------------------------------------------------------- against the references


@needs_mpi
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backend_equals_brute_force(mpi_ranks: list[dict[str, Any]], transport: str) -> None:
    """tests/distributed/test_backend_distributed.py's checks, on what each transport computed in this job."""
    over_transport = [_transport(results, transport) for results in mpi_ranks]
    for check in checks.BACKEND_CHECKS:
        check(over_transport)


@needs_mpi
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_training_identical_on_ranks_and_equal_to_simulation(mpi_ranks: list[dict[str, Any]], transport: str) -> None:
    over_transport = [_transport(results, transport) for results in mpi_ranks]
    checks.parameters_identical_on_every_rank(over_transport)
    # Exact in every mode: both transports sum floats in the simulation's (rank) order. bf16 averaging is
    # compared between the transports above.
    checks.training_matches_brute_force_simulation(over_transport, exact_modes=None)


@needs_mpi
def test_nan_on_one_rank_stops_every_rank_over_mpi(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    for results in mpi_ranks:
        assert f"on 1 of {p} ranks at step 1" in results["mpi:nan-error"]
        assert results["mpi:nan-unchanged"] is True


def _check_engine(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    expected, _ = sc.simulate_training(p, mc.ENGINE_STEPS, compression="1bit")
    for rank, results in enumerate(ranks):
        assert results["engine/transport"] == "mpi"
        assert results["engine/enable_backward_allreduce"] is False  # LionCub's MPI votes replace it
        assert results["engine/collectives"] > 0
        for index, name in enumerate(sc.PARAM_SHAPES):
            assert torch.equal(results["engine/params"][name], expected[index]), f"rank {rank}: {name}"


@needs_mpi
def test_deepspeed_engine_under_mpirun_votes_over_mpi(mpi_ranks: list[dict[str, Any]]) -> None:
    _check_engine(mpi_ranks)


# ---------------------------------------------------------------------------------------------- setup errors in a job


@needs_mpi
def test_data_parallel_group_smaller_than_mpi_world_fails_on_every_rank(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    for key in ("error/subgroup", "error/subgroup-lioncub"):
        messages = {results[key] for results in mpi_ranks}
        assert len(messages) == 1, f"{key}: ranks disagree: {messages}"
        message = messages.pop()
        assert message.startswith("MpiSetupError")
        assert f"MPI world has {p} ranks and the data-parallel torch group {p - 1}" in message
        assert f"{p - 1}->not in group" in message and "comm_backend_name='torch'" in message


@needs_mpi
def test_cuda_aware_on_mpi_without_cuda_is_refused(mpi_ranks: list[dict[str, Any]]) -> None:
    results = mpi_ranks[0]
    message = results["error/cuda-aware"]
    if "MPICH" in results["mpi-library"]:  # the pip-installed MPICH answers MPIX_Query_cuda_support with 0
        assert message is not None and "reports no CUDA support" in message and "cuda_aware=false" in message
    else:  # another MPI may be CUDA-aware, or unable to tell (then it warns)
        assert message is None or "cuda_aware=false" in message


# ---------------------------------------------------------------------------------------------- the deepspeed launcher


@pytest.fixture(scope="module")
def launcher_ranks(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> list[dict[str, Any]]:
    if not HAVE_MPI:
        pytest.skip(f"mpi4py or mpirun is not installed: {INSTALL}")
    out = tmp_path_factory.mktemp("deepspeed-mpich")
    hostfile = out / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    files = [out / f"engine-rank{rank}.pt" for rank in range(2)]
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--launcher",
        "mpich",
        "--force_multi",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port := free_port()),
        str(WORKER),
        str(out),
        "engine",
    ]
    # The launcher may abort with 250 at exit after the work is done ("terminate called without an active
    # exception", see tests/support/launch.run_deepspeed); the results decide.
    try:
        _run(command, files, timeout_s=600, ok_codes=(0, 250))
    finally:
        remove_deepspeed_shm_buffers(port)
    return [torch.load(path, weights_only=False) for path in files]


@needs_mpi
@pytest.mark.deepspeed
def test_deepspeed_launcher_in_mpi_mode(launcher_ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(launcher_ranks):
        env = results["engine/env"]
        assert env["PMI_RANK"] == str(rank) and env["RANK"] == str(rank), env  # an MPI job, ranks mapped by DeepSpeed
    _check_engine(launcher_ranks)

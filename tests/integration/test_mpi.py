"""The MPI transport (issue 5): comm_backend_name="mpi" against the torch transport and the references.

Three launches: `mpirun -np 2` and `mpirun -np 3` each run tests/workers/mpi_scenarios.py, where
torch.distributed (gloo, set up by deepspeed.init_distributed() from MPI) and MPI carry the same
operations on the same inputs in one job; a 2-rank job started by the deepspeed launcher in MPI
mode (`--launcher mpich --force_multi`) trains a DeepSpeed engine over MPI. The rest runs in this
process without initialising MPI.

Float sums are the one place the transports may differ: the MPI transport sums in rank order, gloo
around its ring. With 2 ranks both are a0 + a1; with 3 they are compared with a tolerance, and the
MPI result is checked bit for bit against the rank-order sum (and so the brute-force simulation).
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

import mpi_cases as mc
import scenarios as sc
import test_backend_distributed as backend_checks
import test_optimizer_distributed as optimizer_checks
from launch import REPO, free_port

WORKER = REPO / "tests" / "workers" / "mpi_scenarios.py"
INSTALL = 'pip install -e ".[mpi]" (`make test` installs the extra)'


def _mpirun() -> str | None:
    beside_python = Path(sys.executable).parent / "mpirun"
    return str(beside_python) if beside_python.exists() else shutil.which("mpirun")


MPIRUN = _mpirun()
HAVE_MPI = MPIRUN is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason=f"mpi4py or mpirun is not installed: {INSTALL}")


def _environment() -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": path}


def _run(command: list[str], result_files: list[Path], timeout_s: float, ok_codes: tuple[int, ...] = (0,)) -> None:
    """Run a launcher in its own session (a hang kills every rank) and require every rank's results."""
    proc = subprocess.Popen(
        command, env=_environment(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
def mpi_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
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
                assert got.dtype == expected.dtype and torch.equal(got, expected), f"{dtype_name}/{size}"
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
def test_mpi_backend_equals_brute_force(mpi_ranks: list[dict[str, Any]]) -> None:
    """tests/test_backend_distributed.py's checks, on what the MPI transport computed."""
    over_mpi = [_transport(results, "mpi") for results in mpi_ranks]
    backend_checks.test_vote_1bit_equals_brute_force(over_mpi)
    backend_checks.test_vote_1bit_ties_do_occur_and_follow_the_step(over_mpi)
    backend_checks.test_vote_1bit_bf16_keeps_dtype(over_mpi)
    backend_checks.test_vote_1bit_sends_two_phases_of_packed_bits(over_mpi)
    backend_checks.test_vote_kbit_equals_brute_force_or_refuses_before_communicating(over_mpi)
    backend_checks.test_vote_kbit_allreduce_sends_one_packed_sum(over_mpi)
    backend_checks.test_compressed_allreduce_matches_reference_simulation(over_mpi)


@needs_mpi
def test_mpi_training_identical_on_ranks_and_equal_to_simulation(mpi_ranks: list[dict[str, Any]]) -> None:
    p = len(mpi_ranks)
    over_mpi = [_transport(results, "mpi") for results in mpi_ranks]
    init = sc.init_params()
    for mode, options in sc.training_modes(p).items():
        for name in sc.PARAM_SHAPES:
            key = f"train-param/{mode}/{name}"
            for rank in range(1, p):
                assert torch.equal(over_mpi[rank][key], over_mpi[0][key]), f"{key}: rank {rank} differs"
        if mode == "none-bf16":
            continue  # the simulation averages in fp32; bf16 is compared with the torch transport above
        expected_params, expected_momenta = optimizer_checks._simulate(p, options)
        for index, name in enumerate(sc.PARAM_SHAPES):
            got = over_mpi[0][f"train-param/{mode}/{name}"]
            assert not torch.equal(got, init[name]), f"{mode}: {name} never moved"
            # Exact in every mode: MPI sums floats in the simulation's (rank) order.
            assert torch.equal(got, expected_params[index]), f"{mode}: {name}"
            for rank in range(p):
                assert torch.equal(over_mpi[rank][f"train-exp-avg/{mode}/{name}"], expected_momenta[rank][index])


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
def launcher_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not HAVE_MPI:
        pytest.skip(f"mpi4py or mpirun is not installed: {INSTALL}")
    out = tmp_path_factory.mktemp("deepspeed-mpich")
    hostfile = out / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    files = [out / f"engine-rank{rank}.pt" for rank in range(2)]
    command = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--launcher", "mpich",
        "--force_multi", "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(WORKER), str(out), "engine",
    ]
    # The launcher may abort with 250 at exit after the work is done (DESIGN.md §3); results decide.
    _run(command, files, timeout_s=600, ok_codes=(0, 250))
    return [torch.load(path, weights_only=False) for path in files]


@needs_mpi
def test_deepspeed_launcher_in_mpi_mode(launcher_ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(launcher_ranks):
        env = results["engine/env"]
        assert env["PMI_RANK"] == str(rank) and env["RANK"] == str(rank), env  # an MPI job, ranks mapped by DeepSpeed
    _check_engine(launcher_ranks)


# ---------------------------------------------------------------------------------------------- in this process


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


def test_config_options() -> None:
    from ds_lioncub import LionCubConfigError, parse_config
    from ds_lioncub.comm import make_transport

    assert parse_config({}).comm_backend_name == "torch" and parse_config({}).cuda_aware is False
    config = parse_config({"comm_backend_name": "mpi", "cuda_aware": True})
    assert config.comm_backend_name == "mpi" and config.cuda_aware is True
    with pytest.raises(LionCubConfigError, match=r"comm_backend_name='openmpi': Input should be 'torch' or 'mpi'"):
        parse_config({"comm_backend_name": "openmpi"})
    with pytest.raises(LionCubConfigError, match=r"comm_backend_name='nccl': must be 'torch' or 'mpi'.*'torch' uses"):
        parse_config({"comm_backend_name": "nccl"})
    with pytest.raises(LionCubConfigError, match=r"cuda_aware=True only applies to comm_backend_name='mpi'"):
        parse_config({"cuda_aware": True})
    with pytest.raises(ValueError, match=r"cuda_aware=True only applies"):
        make_transport(None, "torch", cuda_aware=True)
    with pytest.raises(ValueError, match=r"comm_backend_name must be one of \['torch', 'mpi'\]"):
        make_transport(None, "nccl")

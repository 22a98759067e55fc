"""The convergence study: Lion Cub's modes against exact Lion at 4-64 virtual workers.

    python -m benchmarks.study_convergence --jobs 2                  # run (or resume) the whole grid
    python -m benchmarks.study_convergence --report                  # table, plot: report.md, gap_vs_workers.png
    python -m benchmarks.study_convergence --workers 32 --modes exact 1bit --beta2 0.99 --seeds 0   # a pilot
    python -m benchmarks.study_convergence --dry-run                 # list what is still to run

Grid: workers {4, 8, 16, 32, 64} x modes (:data:`MODES`) x beta2 {0.95, 0.99} x seeds {0, 1, 2}, the
example GPT (``--task small``, or ``large``) on the pinned corpus (DeepSpeed 0.19.8's sources) trained
for ``--steps`` steps in the virtual world (:func:`ds_lioncub.simulate.train.train_virtual`), the same
batches for every worker count and mode. The design (``--design``, :data:`DESIGNS`) sets the regime;
``base`` is the examples' settings: global batch 64 x 64 bytes, lr 1e-3 peak (WarmupCosineLR, 10 warmup
steps, ratios 0.1), gradient clipping 1.0 by DeepSpeed's fp32 rule; beta1 0.9 and weight decay 0.1 in
every design. Each run also records its validation loss on 2,048 windows (``val_loss_wide``) and, for
a compressed mode, its agreement with exact Lion and the drift of its sign errors
(:mod:`ds_lioncub.simulate.drift`).

Resumable: every finished run writes one JSON under
``benchmarks/results/convergence_pinned/gpt-<task>_<steps>steps[_<design>]/`` and a run whose JSON exists
is skipped. The first study's runs, on Python 3.11's standard library, stay in
``benchmarks/results/convergence_study/`` (``--results`` reads them).
Runs go seed-major (every cell's seed 0 before any seed 1), so a grid stopped part-way is complete
for its first seeds. ``--jobs J`` runs J processes of one torch thread each; ``--device cuda`` trains on
the GPU (all J processes share it; the model and batches start on the CPU as always, so a CUDA run
differs from a CPU run of the same cell and seed only by the devices' rounding).

Error feedback: :data:`EF_MODES`, the two forms on the 2- and 4-bit L1 all-to-all (the residual form with
``feed_back: "all"``, as the grid measured it), :data:`EF_ROUNDING_MODES` (the residual form feeding back only
the rounding, the default) and :data:`EF_STORAGE_MODES` (``"all"`` with a bf16 residual) are not in the
default grid; ``benchmarks/gpu/ef_study.sh`` runs EF_MODES at 32 and 64 workers.

The 4-bit sign vote is the 1-bit majority vote carried in wider fields: same sums, same sign, same
tie rule, so it trains bit for bit like ``1bit`` (checked: identical losses at 4, 8 and 16 workers,
all-reduce and all-to-all). It stays in the grid for completeness but is best run last:

    python -m benchmarks.study_convergence --jobs 2 --modes exact 1bit 1bit_sync 2bit_l1_a2a 4bit_l1_a2a 8bit_l1
    python -m benchmarks.study_convergence --jobs 2                  # then the 4-bit sign runs left

Report (``--report``, from whatever JSONs exist): per beta2, worker count and mode, the validation
loss relative to exact Lion's at the same worker count and seed, in % (mean ± the 95% Student-t
half-width over the seeds that both have; "real" only where the interval excludes 0),
exact Lion's own seed-to-seed spread (2 x std of its val loss, in % of its mean), and the applied
update's sign agreement with exact Lion's (match / flip / tie, averaged over steps and seeds).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from benchmarks.study_evidence import evidence, merge_evidence
from benchmarks.study_grid import (
    BETA2,
    DESIGNS,
    EF_MODES,
    EF_ROUNDING_MODES,
    EF_STORAGE_MODES,
    EXTRA_MODES,
    MODES,
    RESULTS,
    SEEDS,
    STUDY_CLIP_RULE,
    SYNC_ALL_MODES,
    WIDE_EVAL_WINDOWS,
    WORKERS,
    Run,
    clip_of_run,
    config_dir,
)
from benchmarks.study_report import write_report


def plan(args: argparse.Namespace) -> list[Run]:
    """Every run the filters select, seed-major (then beta2, workers, mode)."""
    runs = [
        Run(args.task, args.steps, n, mode, beta2, seed, design)
        for seed in args.seeds
        for design in args.design
        for beta2 in args.beta2
        for n in args.workers
        for mode in args.modes
    ]
    if args.only:
        runs = [r for r in runs if any(fnmatch.fnmatch(r.name, pattern) for pattern in args.only)]
    return runs


def write_record(path: Path, record: dict[str, Any]) -> None:
    """One run's JSON, written whole or not at all: a run killed mid-write leaves no JSON, so it runs again
    on resume (a grid's runs each have their own file, so one writer per path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def noise_terms_record(terms: list[tuple[float, float] | None] | None, worker_windows: int) -> dict[str, Any] | None:
    """The run's exact noise-scale terms for its JSON: per step |G|^2 and tr(Sigma) per worker batch (null for a
    step whose gradient was not finite), and b, the windows in one worker's batch (B_simple in windows is
    ``b * trace / |G|^2``, over the steps' means: benchmarks/study_noise_scale.py)."""
    if terms is None:
        return None
    return {
        "worker_windows": worker_windows,
        "gradient_square": [None if t is None else t[0] for t in terms],
        "trace_per_worker_batch": [None if t is None else t[1] for t in terms],
    }


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


#: Files whose code decides a run's numbers, fingerprinted in each run's JSON (read when a pool process
#: first imports them: a process keeps the code it imported, whatever changes on disk later).
CODE_FILES = (
    "ds_lioncub/simulate/world.py",
    "ds_lioncub/simulate/transport.py",
    "ds_lioncub/step/bucket_work.py",
    "ds_lioncub/aggregation/__init__.py",
    "ds_lioncub/aggregation/base.py",
    "ds_lioncub/aggregation/kbit_vote.py",
    "ds_lioncub/aggregation/one_bit_vote.py",
    "ds_lioncub/aggregation/exact_mean.py",
    "ds_lioncub/aggregation/state.py",
    "ds_lioncub/simulate/gradients.py",
    "ds_lioncub/simulate/train.py",
    "ds_lioncub/aggregation/error_feedback.py",
    "ds_lioncub/simulate/drift.py",
    "ds_lioncub/simulate/tasks/corpus.py",
    "ds_lioncub/simulate/tasks/gpt_task.py",
)
_CODE: dict[str, str] = {}


def code_fingerprint() -> dict[str, str]:
    """git HEAD and the sha256 (first 12 hex digits) of :data:`CODE_FILES`, computed once per process."""
    if not _CODE:
        repo = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=False)
        _CODE["git_head"] = head.stdout.strip()
        for name in CODE_FILES:
            path = repo / name
            _CODE[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else "missing"
    return _CODE


def execute(run: Run, root: Path, device: str = "cpu", claim: bool = False) -> str:
    """Train one run and write its JSON (atomically); returns a log line. Runs in a pool process.

    ``claim``: first create ``<run>.claim`` beside the JSON, and skip the run if another process (a pool on
    another device, sharing the grid) already did; the claim goes when the JSON is written.
    """
    claim_path = run.path(root).with_suffix(".claim")
    if claim:
        claim_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(claim_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return f"{run.name}: claimed by another process, skipped"
    from ds_lioncub.simulate.train import train_virtual
    from examples.simulate_gpt import task_by_name

    design = DESIGNS[run.design]
    task = replace(task_by_name(run.task), global_batch_size=design.global_batch)
    code = code_fingerprint()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    result = train_virtual(
        task,
        run.options(),
        run.workers,
        run.steps,
        run.seed,
        grad_clip=clip_of_run(run.options(), design.grad_clip),
        clip_rule=STUDY_CLIP_RULE,
        drift_stats=True,
        noise_terms=True,
        keep_model=True,
        device=device,
    )
    wall = time.perf_counter() - t0
    assert result.model is not None
    with torch.no_grad():
        val_wide = replace(task, eval_windows=WIDE_EVAL_WINDOWS).validation_loss(result.model)
    record = {
        **asdict(run),
        "name": run.name,
        "task_name": task.name,
        "options": run.options(),
        "val_loss": result.val_loss,
        "val_loss_wide": val_wide,
        "wide_eval_windows": WIDE_EVAL_WINDOWS,
        "final_train_loss": sum(result.train_losses[-10:]) / len(result.train_losses[-10:]),
        "train_losses": result.train_losses,
        "agreement": None if result.agreement is None else asdict(result.agreement),
        "drift": None if result.drift is None else [asdict(tensor) for tensor in result.drift],
        "noise_terms": noise_terms_record(result.noise_terms, design.global_batch // run.workers),
        "gradient_method": result.gradient_method,
        "wall_s": wall,
        "seconds_per_step": wall / run.steps,
        "gradient_s": result.gradient_seconds,
        "optimizer_s": result.optimizer_seconds,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        # Two machines round differently (another CPU, torch or Python): a run pairs bit-exactly only with runs of
        # its own machine (benchmarks/RESULTS.md, "Every mode at beta2 0.95, and a lent machine's cores").
        "machine": machine_description(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "code": code,
        "settings": design.settings(),
        "corpus": task.corpus().source,
    }
    write_record(run.path(root), record)
    if claim:
        claim_path.unlink(missing_ok=True)
    return f"{run.name}: val {result.val_loss:.4f} in {wall:.0f} s ({wall / run.steps:.2f} s/step)"


def machine_description() -> str:
    """The CPU's model name, the Python and the torch that trained a run."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}; Python {platform.python_version()}; torch {torch.__version__}"


def run_grid(
    runs: list[Run],
    root: Path,
    jobs: int,
    threads: int,
    max_pool_restarts: int = 5,
    device: str = "cpu",
    claim: bool = False,
) -> int:
    """Run every run without a JSON; returns how many still have none (failed: they rerun on the next resume).

    A pool process that dies (killed, or a crash in native code) breaks the whole pool; then a fresh
    pool takes what is left, up to ``max_pool_restarts`` times.
    """
    pending = [r for r in runs if not r.path(root).exists()]
    print(f"[study] {len(runs)} runs selected, {len(runs) - len(pending)} done, {len(pending)} to run", flush=True)
    total, done = len(pending), 0
    for _ in range(max_pool_restarts + 1):
        broken = False
        context = get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker, initargs=(threads,)) as pool:
            futures: dict[Future[str], Run] = {pool.submit(execute, r, root, device, claim): r for r in pending}
            for future in as_completed(futures):
                run = futures[future]
                try:
                    line = future.result()
                    done += 1
                except BrokenProcessPool:
                    broken = True
                    continue  # the run has no JSON: the next pool takes it
                except Exception as error:  # one bad run must not stop the grid; it reruns on resume
                    done += 1
                    line = f"{run.name}: FAILED: {type(error).__name__}: {error}"
                print(f"[study] {done}/{total} {time.strftime('%H:%M:%S')} {line}", flush=True)
        pending = [r for r in pending if not r.path(root).exists()]
        if not broken or not pending:
            break
        print(f"[study] a pool process died; a fresh pool takes the {len(pending)} runs left", flush=True)
    return len([r for r in pending if not r.path(root).exists()])


def reader_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser for a script that reads the study's runs: ``--results``, ``--task``, ``--steps``, ``--workers``
    (one count, default 64) and ``--mode`` (default the 1-bit vote), as this module's runs are filed."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default: %(default)s)")
    p.add_argument("--task", choices=("small", "large"), default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--mode", default="1bit")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("small", "large"), default="small", help="examples.simulate_gpt configuration")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES + EF_MODES + EF_STORAGE_MODES + EF_ROUNDING_MODES + SYNC_ALL_MODES + EXTRA_MODES,
        default=list(MODES),
    )
    p.add_argument("--beta2", type=float, nargs="+", default=list(BETA2))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--design", nargs="+", choices=sorted(DESIGNS), default=["base"], help="training regimes (DESIGNS)")
    p.add_argument("--only", nargs="+", default=[], help="run names to keep (globs, e.g. 'N32_*_seed0')")
    p.add_argument("--jobs", type=int, default=1, help="processes (one torch thread each by default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--device",
        default="cpu",
        help="where each run trains: cpu, or cuda (every process on the same GPU; the device is in each JSON)",
    )
    p.add_argument(
        "--claim",
        action="store_true",
        help="share the grid with other processes (say, a CPU pool and a GPU pool): each run is claimed by a "
        "<run>.claim file first and skipped where another process claimed it (remove stale claims before a rerun)",
    )
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="list the runs still to do and exit")
    p.add_argument("--report", action="store_true", help="write the report and plot from the JSONs present")
    p.add_argument(
        "--evidence",
        type=Path,
        help="write the planner's summary there (ship it as ds_lioncub/planner/convergence_evidence.json); without "
        "--report the results directory's report is left as it is",
    )
    p.add_argument(
        "--evidence-base",
        type=Path,
        help="with --evidence: this summary's cells, with each (workers, beta2) point of these runs in place of its "
        "own (every mode of the point needed; each cell names its study)",
    )
    p.add_argument(
        "--noise-scale-from",
        type=Path,
        help="with --evidence: a results root whose exact Lion runs of the design recorded their noise terms (the "
        "batch sweep's): each measured r is written with the noise scale it was measured at, so that the planner "
        "can place it against a job's B / B_noise",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evidence is not None and len(args.design) > 1:
        raise SystemExit(f"--evidence summarises one design; got {args.design}: name one with --design")
    if args.evidence_base is not None and args.evidence is None:
        raise SystemExit("--evidence-base needs --evidence (the file to write the merged summary to)")
    if args.noise_scale_from is not None and args.evidence is None:
        raise SystemExit("--noise-scale-from needs --evidence (it adds the noise scale to the summary's r)")
    directory = config_dir(args.results, args.task, args.steps, args.design[0])
    if args.report or args.evidence is not None:
        modes = [m for m in args.modes if m != "exact"]
        # The EF section reads every EF run present; the main table shows EF rows only when asked (--modes).
        for design in args.design if args.report else []:
            design_dir = config_dir(args.results, args.task, args.steps, design)
            print(write_report(design_dir, args.workers, modes, args.beta2))
        if args.evidence is not None:
            summary = evidence(directory, args.workers, modes, args.beta2, args.noise_scale_from)
            if args.evidence_base is not None:
                summary = merge_evidence(json.loads(args.evidence_base.read_text()), summary)
            args.evidence.write_text(json.dumps(summary, indent=1) + "\n")
            print(f"[study] {len(summary['cells'])} cells -> {args.evidence}")
        return 0
    runs = plan(args)
    if args.dry_run:
        for run in runs:
            print(("done  " if run.path(args.results).exists() else "to do ") + run.name)
        return 0
    print(f"[study] results in {directory}; $ {' '.join([sys.executable, *sys.argv])}", flush=True)
    return 1 if run_grid(runs, args.results, args.jobs, args.threads, device=args.device, claim=args.claim) else 0


if __name__ == "__main__":
    sys.exit(main())

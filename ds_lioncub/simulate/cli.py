"""``python -m ds_lioncub.simulate``: will my Lion Cub mode keep Lion's loss at N workers?

    python -m ds_lioncub.simulate ds_config.json --workers 8 16 32 --steps 300 --seeds 0 1 2 --plot gap.png
    python -m ds_lioncub.simulate ds_config.json --task mypackage.mytask:build_task

Reads the ds_config's ``"optimizer"`` block (``"type": "LionCub"`` and its ``"params"``) and its
``"gradient_clipping"`` (DeepSpeed's default 1.0 when absent), and decides the clipping as the job does
(:mod:`ds_lioncub.config.clip_rule`, printed in one line): a compressed mode clips the workers' mean gradient by
its sketched norm, and exact Lion its mean gradient by its norm, at the same max_norm; with
``"clip": {"rule": "deepspeed"}`` DeepSpeed's rule clips, per worker when ``bf16`` or ``fp16`` is enabled, as
DeepSpeed's wrappers do, else by the mean of the workers' norms. Then for
each worker count trains the task twice per seed in the virtual world
(:class:`~ds_lioncub.simulate.VirtualLionCub`): with the config's mode, and as exact Lion (the same
options with ``compression="none"``: the fp32 mean of the workers' gradients). Every run sees the
same global batches, so the two differ only in the aggregation. It prints, per worker count, both
validation losses, the gap (the mode's val loss relative to exact Lion's of the same seed, in %,
mean ± the half-width of the mean's two-sided 95% Student-t interval over the n seeds: t(n - 1) x the
per-seed gaps' sample std / sqrt(n), t(2) = 4.303 for 3 seeds, the statistic of the planner and the
convergence study, :mod:`ds_lioncub.quantities.student_t`; "real" when the interval excludes 0) and how often the
applied update's sign matched, flipped against or tied exact Lion's. ``--plot PATH`` also draws the
gap and its interval against the worker count (needs matplotlib); a bar on stderr shows the steps done
and the time left (``--no-progress`` hides it). Before the first run it prints the plan: the runs, their steps
and about how long they take here, timed on a few steps of the mode at the largest count. The defaults are
8, 16 and 32 workers, 300 steps and 3 seeds: 18 runs of 300 steps, 5,400 steps in all (hours on a laptop's
CPU); ``--workers``, ``--steps`` and ``--seeds`` trim them.

``--time-to-loss M [M ...]`` also trains the mode for ``--steps`` x each M (each run with its cosine schedule
fitted to its length) and prints r, the steps it needs to reach exact Lion's loss after ``--steps``, per worker
count, with the task's gradient noise scale from exact Lion's runs (:mod:`ds_lioncub.simulate.time_to_loss`);
``--evidence-out PATH`` writes the gap and r as the planner's evidence (``python -m ds_lioncub.planner
--job-evidence PATH``).

Everything is checked before the first run trains: the ds_config, every option, the task, and every
run's optimizer (the mode's and exact Lion's at every worker count are built, so a k-bit all-reduce too
narrow for a count, or a count that does not divide the global batch, is refused up front).

Options that need a real network are decided per option (:mod:`ds_lioncub.simulate.ds_config`):
``comm_backend_name``, ``cuda_aware``, ``overlap`` (bit-identical by design), ``consistency_check`` and
``telemetry`` do not change a step's math and are dropped with a printed note; ``compression="auto"``
is refused (it plans for a real network: run the planner and pass the mode). A ZeRO hybrid config
(a compressed mode at zero_optimization.stage 1, 2 or 3) is simulated as its voters, the nodes: each
simulated worker is one node with its node's batch (its G ranks' micro-batches, which ZeRO averages in
full precision), ``--workers`` counts nodes; the LionCub options
the real hybrid refuses (overlap, MPI, momentum_sync by layer) are refused here too.

The task: ``--task module:function``, a function taking no arguments that returns a
:class:`ds_lioncub.simulate.train.Task` (build a model from a seed, the global batch of step t, the
mean loss of a batch, a validation loss). The default, ``ds_lioncub.simulate.tasks:small_gpt`` (the
example byte-level GPT on DeepSpeed 0.19.8's pinned sources, global batch 64 x 64), ships with the
package. The learning rate follows DeepSpeed's WarmupCosineLR over ``--steps`` (``--warmup-steps``,
ratios 0.1), peaking at the config's lr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError, LionCubError
from ds_lioncub.simulate.agreement import AgreementStats
from ds_lioncub.simulate.ds_config import RunSettings, SimulationConfig, read_ds_config
from ds_lioncub.simulate.gradients import split_batch
from ds_lioncub.simulate.plan import estimate_seconds, plan_text, run_steps
from ds_lioncub.simulate.plot import check_plot_path, write_gap_plot
from ds_lioncub.simulate.progress import Progress
from ds_lioncub.simulate.table import Row, format_table, rows_as_json
from ds_lioncub.simulate.time_to_loss import (
    RatioRow,
    SeedRatio,
    b_simple,
    evidence_summary,
    format_ratios,
    ratio_row,
    seed_ratio,
    study_key,
    time_to_loss_lengths,
    trained_options,
)
from ds_lioncub.simulate.train import Task, TrainResult, gap_percent, seed_summary, train_virtual
from ds_lioncub.simulate.world import VirtualLionCub

DEFAULT_TASK = "ds_lioncub.simulate.tasks:small_gpt"
DEFAULT_WORKERS = [8, 16, 32]
DEFAULT_STEPS = 300
DEFAULT_SEEDS = [0, 1, 2]
#: The options exact Lion keeps from the mode's: Lion's own and the bucket plan.
EXACT_KEEPS = ("lr", "betas", "weight_decay", "bucket_size")

__all__ = [
    "DEFAULT_TASK",
    "Row",
    "RunSettings",
    "check_runs",
    "compare",
    "exact_grad_clip",
    "exact_options",
    "load_task",
    "main",
]


def exact_options(options: dict[str, Any]) -> dict[str, Any]:
    """Exact Lion with the mode's hyper-parameters: ``compression="none"``, fp32 mean."""
    return {"compression": "none", **{key: options[key] for key in EXACT_KEEPS if key in options}}


def exact_grad_clip(options: dict[str, Any], settings: RunSettings) -> float:
    """How exact Lion beside the mode clips: as the ds_config says, or, where the mode clips with option clip
    (the ds_config's gradient_clipping then 0), by clip.max_norm, which exact Lion applies to the mean gradient."""
    clip = parse_config(options).mean_clip
    return settings.grad_clip if clip is None else clip.max_norm


def load_task(spec: str) -> Task:
    """Call ``function`` of ``module`` for ``"module:function"``."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise LionCubConfigError(f"LionCub: --task must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise LionCubConfigError(
            f"LionCub: cannot import the task module {module_name!r}: {error}. Put it on PYTHONPATH."
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise LionCubConfigError(f"LionCub: {module_name} has no function {function_name!r} for --task")
    task: Task = factory()
    return task


def check_runs(
    task: Task, options: dict[str, Any], workers: list[int], seeds: list[int], steps: int, warmup_steps: int
) -> None:
    """Refuse, before any training, what any run of the comparison would refuse.

    Builds the mode's and exact Lion's optimizer at every worker count on the task's model (LionCub's
    validation, the aggregation's world-size limits, momentum sync's layer selection) and splits the
    first global batch over every count.
    """
    if steps < 1:
        raise LionCubConfigError(f"LionCub: --steps must be >= 1, got {steps}.")
    if warmup_steps < 0:
        raise LionCubConfigError(f"LionCub: --warmup-steps must be >= 0, got {warmup_steps}.")
    model = task.build_model(seeds[0])
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    batch = task.batch(0, seeds[0])
    for n in workers:
        for opts in (options, exact_options(options)):
            VirtualLionCub(named, workers=n, module=model, **opts)
        split_batch(batch, n)


def compare(
    task: Task,
    options: dict[str, Any],
    settings: RunSettings,
    workers: list[int],
    steps: int,
    seeds: list[int],
    warmup_steps: int = 10,
    progress: Progress | None = None,
    unit: str = "workers",
    longer: Sequence[int] = (),
) -> list[Row]:
    """Train the mode and exact Lion for every (worker count, seed); one :class:`Row` per worker count.

    ``progress`` shows each step and prints each run's validation loss; ``unit`` names a worker in those lines.
    ``longer``: more run lengths of the mode (``--time-to-loss``), each with its own schedule; then exact Lion's
    runs record the noise terms, and each row carries r (:mod:`ds_lioncub.simulate.time_to_loss`).
    """
    rows = []
    lengths = sorted({steps, *longer})
    for n in workers:
        exact_runs: list[TrainResult] = []
        mode_runs: list[TrainResult] = []
        seed_ratios: list[SeedRatio] = []
        for seed in seeds:
            points = []
            runs_of_seed: list[tuple[str, dict[str, Any], int, list[TrainResult] | None]]
            runs_of_seed = [("exact Lion", exact_options(options), steps, exact_runs)]
            runs_of_seed += [("mode", options, length, mode_runs if length == steps else None) for length in lengths]
            for label, opts, length, runs in runs_of_seed:
                run = f"{unit} {n} seed {seed} {label}" + (f", {length} steps" if length != steps else "")
                result = train_virtual(
                    task,
                    opts,
                    n,
                    length,
                    seed,
                    warmup_steps=warmup_steps,
                    grad_clip=exact_grad_clip(options, settings) if label == "exact Lion" else settings.grad_clip,
                    clip_rule=settings.clip_rule,
                    noise_terms=bool(longer) and label == "exact Lion",
                    on_step=None if progress is None else progress.start_run(run),
                )
                if runs is not None:
                    runs.append(result)
                if label == "mode":
                    points.append((length, result.val_loss))
                if progress is not None:
                    progress.write(f"[simulate] {run}: val loss {result.val_loss:.4f}")
            if longer:
                seed_ratios.append(seed_ratio(seed, points, exact_runs[-1].val_loss, steps))
        time_to_loss = None
        if longer:
            worker_samples = task.global_batch_size // n
            noise = [b_simple(r.noise_terms or [], worker_samples, min(warmup_steps, steps - 1)) for r in exact_runs]
            time_to_loss = ratio_row(n, seed_ratios, noise, task.global_batch_size, lengths)
        gaps = [gap_percent(m.val_loss, e.val_loss) for m, e in zip(mode_runs, exact_runs, strict=True)]
        agreements = [r.agreement for r in mode_runs if r.agreement is not None]
        mean_agreement = None
        if agreements:
            mean_agreement = AgreementStats(
                *(sum(getattr(a, f) for a in agreements) / len(agreements) for f in ("match", "flip", "zero", "tie"))
            )
        rows.append(
            Row(
                workers=n,
                exact_val=seed_summary([r.val_loss for r in exact_runs]),
                mode_val=seed_summary([r.val_loss for r in mode_runs]),
                gap=seed_summary(gaps),
                agreement=mean_agreement,
                time_to_loss=time_to_loss,
            )
        )
    return rows


def check_output_path(path: Path, flag: str) -> None:
    """Refuse a folder, create the file's folder: an output that cannot be written fails before the runs."""
    if path.is_dir():
        raise LionCubConfigError(f"LionCub: {flag} {path} is a folder; name a file in it.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LionCubConfigError(f"LionCub: {flag} {path}: cannot create its folder: {error}.") from None


def plot_title(config: SimulationConfig, task: Task, steps: int, seeds: list[int]) -> str:
    """What the plot shows: the mode, the task, the run length and the seeds."""
    shown = {"compression": "1bit", **config.options}  # LionCub's default mode when the config names none
    hidden = ("lr", "weight_decay", "bucket_size")
    mode = ", ".join(f"{key}={value}" for key, value in shown.items() if key not in hidden)
    hybrid = f" (ZeRO stage {config.zero_stage} hybrid)" if config.hybrid else ""
    return f"{mode}{hybrid} vs exact Lion: {task.name}, {steps} steps, seeds {seeds}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ds_lioncub.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("ds_config", type=Path, help='a ds_config.json with "optimizer": {"type": "LionCub", ...}')
    workers, seeds = " ".join(map(str, DEFAULT_WORKERS)), " ".join(map(str, DEFAULT_SEEDS))
    p.add_argument(
        "--workers", type=int, nargs="+", default=DEFAULT_WORKERS, help=f"virtual worker counts (default: {workers})"
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps per run (default: %(default)s)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=DEFAULT_SEEDS, help=f"seeds, init and data order (default: {seeds})"
    )
    p.add_argument("--task", default=DEFAULT_TASK, help="module:function returning a Task (default: %(default)s)")
    p.add_argument(
        "--warmup-steps", type=int, default=10, help="linear warmup steps of the lr schedule (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="also draw the gap against workers here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--time-to-loss",
        type=float,
        nargs="+",
        metavar="M",
        default=[],
        help="also train the mode for --steps x each M steps (its schedule fitted to each length) and report r, the "
        "steps it needs to reach exact Lion's loss after --steps, and the noise scale (e.g. 1.25 1.5; 0.75 where "
        "the mode may beat exact Lion)",
    )
    p.add_argument(
        "--evidence-out",
        type=Path,
        default=None,
        help="also write the gap and r as the planner's evidence here (python -m ds_lioncub.planner --job-evidence)",
    )
    return p.parse_args(argv)


def write_evidence(args: argparse.Namespace, config: SimulationConfig, rows: list[Row], ratios: list[RatioRow]) -> None:
    """``--evidence-out``: the rows as the planner's evidence, and the planner command that reads it."""
    options = trained_options(config.options, config.settings)
    beta2 = float(parse_config(options).betas[1])
    seeds = " ".join(map(str, args.seeds))
    source = f"python -m ds_lioncub.simulate {args.ds_config} --task {args.task} --steps {args.steps} --seeds {seeds}"
    gaps = [(row.workers, row.gap) for row in rows]
    args.evidence_out.write_text(json.dumps(evidence_summary(ratios, gaps, options, beta2, source), indent=1) + "\n")
    print(f"[simulate] evidence for the planner: {args.evidence_out}")
    scales = [row.noise_scale.mean for row in ratios if row.noise_scale is not None]
    batch = f" --global-batch {ratios[0].batch_samples} --noise-scale {sum(scales) / len(scales):.4g}" if scales else ""
    print(f"[simulate]   python -m ds_lioncub.planner ... --beta2 {beta2:g} --job-evidence {args.evidence_out}{batch}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        config = read_ds_config(args.ds_config)
        for note in config.notes:
            print(f"[simulate] note: {note}", flush=True)
        if args.plot is not None:
            check_plot_path(args.plot)
        if args.json_out is not None:
            check_output_path(args.json_out, "--json-out")
        task = load_task(args.task)
        check_runs(task, config.options, args.workers, args.seeds, args.steps, args.warmup_steps)
        longer = time_to_loss_lengths(args.steps, args.time_to_loss)
        if args.evidence_out is not None:
            check_output_path(args.evidence_out, "--evidence-out")
            study_key(trained_options(config.options, config.settings))  # refused before the runs, not after
        per_step, total = estimate_seconds(
            task, config.options, config.settings, args.workers, args.steps, args.seeds, longer
        )
        print(plan_text(args.workers, args.seeds, args.steps, per_step, total, longer), flush=True)
        print(
            f"[simulate] task {task.name}, {args.steps} steps, seeds {args.seeds}, options {config.options}, "
            f"{config.settings.clipping}",
            flush=True,
        )
        unit = "nodes" if config.hybrid else "workers"
        steps_in_all = run_steps(args.steps, longer) * len(args.workers) * len(args.seeds)
        progress = Progress(steps_in_all, enabled=not args.no_progress)
        try:
            rows = compare(
                task,
                config.options,
                config.settings,
                args.workers,
                args.steps,
                args.seeds,
                args.warmup_steps,
                progress,
                unit,
                longer,
            )
        finally:
            progress.close()
    except LionCubError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print()
    if config.hybrid:
        print("(ZeRO hybrid: workers are nodes, the voters)")
    print(format_table(rows))
    ratios = [row.time_to_loss for row in rows if row.time_to_loss is not None]
    if ratios:
        print()
        print(format_ratios(ratios, args.steps))
    if args.evidence_out is not None:
        write_evidence(args, config, rows, ratios)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows_as_json(rows), indent=2) + "\n")
    if args.plot is not None:
        write_gap_plot(rows, args.plot, plot_title(config, task, args.steps, args.seeds), f"{unit} (voters)")
        print(f"[simulate] plot: {args.plot}")
    return 0

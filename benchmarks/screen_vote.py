"""Screening candidates for the 1-bit vote in plain torch, before any is built as an aggregation.

    python -m benchmarks.screen_vote --workers 64 --beta2 0.99 --seeds 0 1 2 --candidates vote ef_scaled_sign:256
    python -m benchmarks.screen_vote --report                 # gaps to exact Lion, from the study's exact runs

Each candidate maps the N workers' pre-sign updates ``c_i`` of one tensor (an ``(N, numel)`` tensor) to
the direction every worker applies. Everything else is the convergence study's run
(:mod:`benchmarks.study_convergence`, same task, design, per-worker gradients, clipping and lr
schedule) and the package's own Lion arithmetic (``lion_direction``, ``update_momentum``,
``apply_update``, ``sign_with_tie``), so the ``vote`` candidate trains bit for bit like
``VirtualLionCub(compression="1bit")`` (benchmarks/tests/test_screen_vote.py checks it). The settings
are read from where the study keeps them, never copied: beta1 and weight decay from
:meth:`benchmarks.study_grid.Run.options` (the lr from the design, as there), the lr schedule's
warm-up and floor and the clipping rule from the defaults of
:func:`ds_lioncub.simulate.train.train_virtual`, which the study's runs use. Candidates work per tensor
in blocks of ``B`` elements; the study's exact-Lion runs of the same design, worker count, beta2 and
seed are the reference (run them first with the study).

Candidates (``name`` or ``name:B``):

- ``vote``: the majority vote of the signs (the 1-bit vote); it has no blocks, so ``vote:B`` is refused.
- ``mean``: ``sign(sum_i c_i)``, exact Lion's direction, from the workers' own momenta and gradients
  clipped as a compressed mode's are (one coefficient from the workers' mean norm, where exact Lion's
  comes from the norm of their mean: :func:`ds_lioncub.simulate.train.clip_worker_gradients`): what is
  left of the vote's gap once the vote is out of it. No blocks either.
- ``scaled_sign:B``: each worker sends ``sign(c_i)`` and one scale per block, ``s_i = mean |c_i|``;
  the direction is ``sign(sum_i s_i sign(c_i))``. 1 + 32/B bits per element.
- ``ef_scaled_sign:B``: the same on ``x_i = c_i + e_i``, each worker keeping ``e_i <- x_i - s_i sign(x_i)``
  (error feedback on what is summed, never around the final sign). 1 + 32/B bits per element.
- ``dither_max:B``: each worker votes ``sign(c_i + D u_i)``, ``u_i`` uniform in [-1, 1], ``D`` the block's
  largest ``|c_i|`` over every worker (one max all-reduce of a scale per block), so that
  ``E[vote_i] = c_i / D`` and the vote tends to ``sign(mean c_i)``. 1 bit per element plus the shared
  scale. The noise of one tensor at one step is one ``(N, numel)`` draw from one generator seeded by
  (seed, step, tensor) (:func:`dither_seed`; no worker in the seed): worker i's ``u_i`` is row i of that
  draw, so every worker's noise differs from every other's, as independent generators per worker would
  make it, but from one stream.
- ``dither_mean:B``: as ``dither_max`` with ``D`` the workers' mean of ``mean |c_i|`` (a smaller dither:
  biased where ``|c_i| > D``, less noisy).
- ``sparse_tail:B``: the scaled sign with the tails sent exactly. In each block of ``B`` elements each worker
  sends ``sign(c_i)``, its ``K = max(1, B // 128)`` largest ``|c_i|`` as values with their in-block
  indices, and one scale ``s_i``, the mean ``|c_i|`` over the block's other elements; the direction is
  ``sign(sum_i t_i)`` with ``t_i = c_i`` on the worker's ``K`` and ``s_i sign(c_i)`` elsewhere. It keeps
  the magnitudes that a sum is most sensitive to (one worker's rare large value, which the vote counts
  as one voice). At ``B = 1024``: 1 + 8 x (10 + 16) / 1024 + 32 / 1024 = 1.23 bits per element with
  bf16 values (the screen keeps them in fp32).

A candidate written ``name+exactclip`` (say ``vote+exactclip``) clips the workers' gradients as exact Lion's
engine does, by one coefficient from the norm of their mean gradient: an oracle no compressed mode has
(it needs every gradient), which tells how much of a gap is the clipping's. ``mean+exactclip`` is exact
Lion up to the order of its sums. ``name+sketchclipK`` (say ``vote+sketchclip4096``) clips by an estimate
of that norm that a compressed mode can afford: each worker adds its gradient into a CountSketch of ``K``
floats (every element into one of ``K`` bins, with a sign; bins and signs drawn once from a generator
every worker seeds alike), the workers average their sketches (an all-reduce of ``K`` floats per step),
and the norm of the mean sketch, whose square is an unbiased estimate of ``|mean_i g_i|^2`` (relative sd
about ``sqrt(2 / K)``), sets the common coefficient (:class:`benchmarks.screen_clipping.SketchClip`).

Each run writes ``benchmarks/results/vote_screen/<design dir>/N<workers>_<candidate>_b2-<beta2>_seed<seed>.json``
(resumable: a run whose JSON exists is skipped) with its validation losses and its flip rate against
``sign(mean_i c_i)``. The dither runs written before :func:`dither_seed` lost a trailing ``* 7`` drew
their noise from generators seeded 7 times larger: the same kind of draw, other numbers.

The report pairs each run with the study's exact-Lion run of its worker count, beta2 and seed by
:func:`benchmarks.study_report.pair_with_exact`, which leaves out a pair on other data (their first
training losses differ) with a warning on stderr.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from benchmarks.screen_clipping import SketchClip, clip_of
from benchmarks.study_convergence import write_record
from benchmarks.study_grid import DESIGNS, RESULTS, STUDY_CLIP_RULE, WIDE_EVAL_WINDOWS, Design, Run, config_dir
from benchmarks.study_report import pair_with_exact
from ds_lioncub.comm.quantize import sign_with_tie
from ds_lioncub.lion import apply_update, lion_direction, update_momentum
from ds_lioncub.quantities.student_t import mean_interval
from ds_lioncub.simulate.gradients import GradientBuffers, worker_gradients
from ds_lioncub.simulate.tasks.gpt_task import GPTTask, small_gpt
from ds_lioncub.simulate.train import ClipRule, clip_worker_gradients, lr_ratio, train_virtual

SCREEN_RESULTS = Path(__file__).resolve().parent / "results" / "vote_screen"


@dataclass(frozen=True)
class StudySettings:
    """What the study's runs train with besides the design: Lion's beta1 and weight decay, the lr
    schedule's warm-up steps, warm-up start ratio and cosine floor ratio, and the clipping rule."""

    beta1: float
    weight_decay: float
    warmup_steps: int
    warmup_min_ratio: float
    cos_min_ratio: float
    clip_rule: ClipRule


def study_settings(beta2: float) -> StudySettings:
    """The study's settings, read where the study takes them: beta1 and weight decay from
    :meth:`benchmarks.study_grid.Run.options` (exact Lion's run: these two do not depend on the mode),
    the schedule from :func:`ds_lioncub.simulate.train.train_virtual`'s defaults, which the study's runs do not
    override, and the study's clipping rule (:data:`benchmarks.study_grid.STUDY_CLIP_RULE`)."""
    options = Run("small", 1, 1, "exact", beta2, 0).options()
    defaults = inspect.signature(train_virtual).parameters
    return StudySettings(
        beta1=float(options["betas"][0]),
        weight_decay=float(options["weight_decay"]),
        warmup_steps=int(defaults["warmup_steps"].default),
        warmup_min_ratio=float(defaults["warmup_min_ratio"].default),
        cos_min_ratio=float(defaults["cos_min_ratio"].default),
        clip_rule=STUDY_CLIP_RULE,
    )


def dither_seed(seed: int, step: int, tensor: int) -> int:
    """The seed of the dither's generator of tensor ``tensor`` at 0-based ``step`` of a run of ``seed``."""
    return (seed * 100_003 + step) * 1_009 + tensor


@dataclass
class TensorState:
    """A candidate's per-tensor memory: the workers' error-feedback residuals, ``(N, numel)``."""

    residual: torch.Tensor | None = None


def block_mean_abs(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(N, numel)`` -> ``(N, numel)``: each element replaced by its block's mean |x| (last block shorter)."""
    n, numel = x.shape
    padded = torch.nn.functional.pad(x.abs(), (0, (-numel) % block))
    sums = padded.view(n, -1, block).sum(dim=2)
    counts = torch.full((sums.shape[1],), float(block), dtype=x.dtype)
    counts[-1] = numel - block * (sums.shape[1] - 1)
    return (sums / counts).repeat_interleave(block, dim=1)[:, :numel]


def block_max_abs(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(N, numel)`` -> ``(numel,)``: each element replaced by its block's largest |x| over every worker."""
    numel = x.shape[1]
    padded = torch.nn.functional.pad(x.abs().amax(dim=0), (0, (-numel) % block))
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:numel]


def tail_kept(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(N, numel)`` -> ``(N, numel)``: in each block, each worker's ``max(1, block // 128)`` largest ``|x|`` kept
    (ties: the lower index) and every other element replaced by ``sign(x)`` times the mean ``|x|`` of those others
    (a last block shorter than that keeps all its elements)."""
    numel = x.shape[1]
    keep = max(1, block // 128)
    out = torch.empty_like(x)
    for start in range(0, numel, block):
        part = x[:, start : start + block]
        if part.shape[1] <= keep:
            out[:, start : start + block] = part
            continue
        # A stable sort of -|x| puts the largest first and, among equals, the lower index first.
        order = torch.sort(-part.abs(), dim=1, stable=True).indices
        kept = torch.zeros_like(part, dtype=torch.bool).scatter_(1, order[:, :keep], True)
        scale = (part.abs() * ~kept).sum(dim=1, keepdim=True) / (part.shape[1] - keep)
        out[:, start : start + block] = torch.where(kept, part, scale * torch.sign(part))
    return out


Candidate = Callable[[torch.Tensor, TensorState, int, torch.Generator], torch.Tensor]


def make_candidate(spec: str) -> Candidate:
    """The direction function of ``spec`` (``name`` or ``name:B``, either with a clipping suffix: module docstring)."""
    name, _, size = clip_of(spec)[0].partition(":")
    if name in ("vote", "mean") and size:
        raise ValueError(f"candidate {spec!r}: it has no blocks; write {name!r}")
    block = int(size) if size else 256
    if block < 1:
        raise ValueError(f"candidate {spec!r}: the block size must be >= 1")

    def vote(c: torch.Tensor, state: TensorState, step: int, gen: torch.Generator) -> torch.Tensor:
        return sign_with_tie(sign_with_tie(c, step, "alternate").sum(dim=0), step, "alternate")

    def mean(c: torch.Tensor, state: TensorState, step: int, gen: torch.Generator) -> torch.Tensor:
        return sign_with_tie(c.sum(dim=0), step, "alternate")

    def scaled(c: torch.Tensor, state: TensorState, step: int, gen: torch.Generator, feedback: bool) -> torch.Tensor:
        x = c if not feedback or state.residual is None else c + state.residual
        sent = block_mean_abs(x, block) * sign_with_tie(x, step, "alternate")
        if feedback:
            state.residual = x - sent
        return sign_with_tie(sent.sum(dim=0), step, "alternate")

    def dither(c: torch.Tensor, state: TensorState, step: int, gen: torch.Generator, widest: bool) -> torch.Tensor:
        scale = block_max_abs(c, block) if widest else block_mean_abs(c, block).mean(dim=0)
        noise = torch.rand(c.shape, generator=gen).mul_(2).sub_(1)
        return sign_with_tie(sign_with_tie(c + scale * noise, step, "alternate").sum(dim=0), step, "alternate")

    def sparse_tail(c: torch.Tensor, state: TensorState, step: int, gen: torch.Generator) -> torch.Tensor:
        return sign_with_tie(tail_kept(c, block).sum(dim=0), step, "alternate")

    candidates: dict[str, Candidate] = {
        "vote": vote,
        "mean": mean,
        "scaled_sign": lambda c, s, t, g: scaled(c, s, t, g, feedback=False),
        "ef_scaled_sign": lambda c, s, t, g: scaled(c, s, t, g, feedback=True),
        "dither_max": lambda c, s, t, g: dither(c, s, t, g, widest=True),
        "dither_mean": lambda c, s, t, g: dither(c, s, t, g, widest=False),
        "sparse_tail": sparse_tail,
    }
    if name not in candidates:
        raise ValueError(
            f"unknown candidate {spec!r}; choose from {sorted(candidates)} (optionally :B, +exactclip or +sketchclipK)"
        )
    return candidates[name]


def train_candidate(
    spec: str, task: GPTTask, design: Design, workers: int, beta2: float, seed: int, steps: int
) -> dict[str, object]:
    """One run of a candidate on ``task`` (its global batch as it is; the study sets it from the design)."""
    candidate = make_candidate(spec)
    settings = study_settings(beta2)
    torch.manual_seed(seed)
    model = task.build_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    momenta = [torch.zeros((workers, p.numel()), dtype=torch.float32) for p in params]
    states = [TensorState() for _ in params]
    width = clip_of(spec)[1]
    sketch = SketchClip(params, width) if width > 0 else None
    buffers = GradientBuffers()
    flips = elements = 0
    losses: list[float] = []
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        computed = worker_gradients(model, task.loss, task.batch(step, seed), workers, params, "auto", buffers)
        if sketch is not None:
            sketch.clip(computed.grads, design.grad_clip)
        else:
            clip_worker_gradients(computed.grads, design.grad_clip, settings.clip_rule, exact=width < 0)
        lr = design.lr * lr_ratio(step, steps, settings.warmup_steps, settings.warmup_min_ratio, settings.cos_min_ratio)
        losses.append(computed.loss)
        with torch.no_grad():
            for j, param in enumerate(params):
                grads = torch.stack([computed.grads[i][j].reshape(-1) for i in range(workers)])
                c = lion_direction(momenta[j], grads, settings.beta1)
                update_momentum(momenta[j], grads, beta2)
                gen = torch.Generator().manual_seed(dither_seed(seed, step, j))
                direction = candidate(c, states[j], step + 1, gen)
                exact_sign = torch.sign(c.sum(dim=0))
                flips += int((direction == -exact_sign).sum())
                elements += c.shape[1]
                apply_update(param.view(-1), direction, lr, settings.weight_decay)
        if not math.isfinite(computed.loss):
            raise FloatingPointError(f"{spec}: loss {computed.loss} at step {step}")
    model.eval()
    with torch.no_grad():
        val = task.validation_loss(model)
        val_wide = replace(task, eval_windows=WIDE_EVAL_WINDOWS).validation_loss(model)
    return {
        "candidate": spec,
        "workers": workers,
        "beta2": beta2,
        "seed": seed,
        "steps": steps,
        "settings": design.settings(),
        "val_loss": val,
        "val_loss_wide": val_wide,
        "train_losses": losses,
        "flip_rate": flips / max(1, elements),
        "wall_s": time.perf_counter() - t0,
        "load_average": os.getloadavg()[0],
    }


def run_path(root: Path, design: str, steps: int, workers: int, spec: str, beta2: float, seed: int) -> Path:
    name = f"N{workers:02d}_{spec.replace(':', '-')}_b2-{beta2}_seed{seed}.json"
    return config_dir(root, "small", steps, design) / name


def _execute(spec: str, workers: int, beta2: float, seed: int, steps: int, design: str, root: str) -> str:
    torch.set_num_threads(1)
    task = replace(small_gpt(), global_batch_size=DESIGNS[design].global_batch)
    record = {"design": design, **train_candidate(spec, task, DESIGNS[design], workers, beta2, seed, steps)}
    path = run_path(Path(root), design, steps, workers, spec, beta2, seed)
    write_record(path, record)
    return f"{path.name}: val {record['val_loss']:.4f} flip {record['flip_rate']:.3f} in {record['wall_s']:.0f} s"


def report(root: Path, study_root: Path, steps: int, design: str) -> str:
    """Per worker count, beta2 and candidate: the gap to exact Lion in % (mean and 95% t half-width), over the
    runs paired with the study's exact-Lion run of the same data (:func:`benchmarks.study_report.pair_with_exact`)."""
    folder = config_dir(root, "small", steps, design)
    exact_dir = config_dir(study_root, "small", steps, design)
    rows: dict[tuple[int, float, str], list[float]] = {}
    flips: dict[tuple[int, float, str], list[float]] = {}
    for path in sorted(folder.glob("N*_seed*.json")):
        record = json.loads(path.read_text())
        pair = pair_with_exact(exact_dir, record)
        if pair is None:
            continue
        key = (record["workers"], record["beta2"], record["candidate"])
        rows.setdefault(key, []).append(pair[1])
        flips.setdefault(key, []).append(record["flip_rate"])
    lines = [
        f"Screen ({design}, {steps} steps): validation loss vs exact Lion's (same seed), %, mean ± 95% t half-width",
        "",
        "| workers | beta2 | candidate | gap % | seeds | flip rate |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for (workers, beta2, spec), gaps in sorted(rows.items()):
        rate = sum(flips[(workers, beta2, spec)]) / len(gaps)
        lines.append(f"| {workers} | {beta2} | {spec} | {mean_interval(gaps).text(1)} | {len(gaps)} | {rate:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidates", nargs="+", default=["vote", "ef_scaled_sign:256"])
    p.add_argument("--workers", type=int, nargs="+", default=[64])
    p.add_argument("--beta2", type=float, nargs="+", default=[0.99])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--design", choices=sorted(DESIGNS), default="base")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--results", type=Path, default=SCREEN_RESULTS)
    p.add_argument("--study-results", type=Path, default=RESULTS, help="where the exact-Lion runs are")
    p.add_argument("--report", action="store_true")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.results, args.study_results, args.steps, args.design))
        return 0
    for spec in args.candidates:
        make_candidate(spec)  # every name checked before anything trains
    runs = [
        (spec, n, beta2, seed)
        for seed in args.seeds
        for beta2 in args.beta2
        for n in args.workers
        for spec in args.candidates
        if not run_path(args.results, args.design, args.steps, n, spec, beta2, seed).exists()
    ]
    print(f"[screen] {len(runs)} runs to do", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [
            pool.submit(_execute, spec, n, beta2, seed, args.steps, args.design, str(args.results))
            for spec, n, beta2, seed in runs
        ]
        for done, future in enumerate(as_completed(futures), start=1):
            try:
                line = future.result()
            except Exception as error:  # one failed run must not stop the screen; it reruns on resume
                line = f"FAILED: {type(error).__name__}: {error}"
            print(f"[screen] {done}/{len(runs)} {time.strftime('%H:%M:%S')} {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m ds_lioncub.simulate``: will my Lion Cub mode keep Lion's loss at N workers?

    python -m ds_lioncub.simulate ds_config.json --workers 8 16 32 --steps 300 --seeds 0 1 2
    python -m ds_lioncub.simulate ds_config.json --task mypackage.mytask:build_task

Reads the ds_config's ``"optimizer"`` block (``"type": "LionCub"`` and its ``"params"``) and its
``"gradient_clipping"`` (DeepSpeed's default 1.0 when absent; clipped per worker when ``bf16`` or
``fp16`` is enabled, as DeepSpeed's wrappers do, else by the mean of the workers' norms), then for
each worker count trains the task twice per seed in the virtual world
(:class:`~ds_lioncub.simulate.VirtualLionCub`): with the config's mode, and as exact Lion (the same
options with ``compression="none"``: the fp32 mean of the workers' gradients). Every run sees the
same global batches, so the two differ only in the aggregation. It prints, per worker count, both
validation losses, the gap (the mode's val loss relative to exact Lion's of the same seed, in %,
mean ± spread over seeds, where spread is 2 x the sample std; "real" when |mean| > spread) and how
often the applied update's sign matched, flipped against or tied exact Lion's.

The task: ``--task module:function``, a function taking no arguments that returns a
:class:`ds_lioncub.simulate.train.Task` (build a model from a seed, the global batch of step t, the
mean loss of a batch, a validation loss). The default, ``examples.simulate_gpt:small_gpt`` (the example
byte-level GPT, global batch 64 x 64), is importable from a repository checkout (run from its root).
The learning rate follows DeepSpeed's WarmupCosineLR over ``--steps`` (``--warmup-steps``, ratios 0.1),
peaking at the config's lr. Options that need a real network (transport, overlap, hybrid, consistency
checks) are refused, with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError, LionCubError
from ds_lioncub.simulate.agreement import AgreementStats
from ds_lioncub.simulate.train import (
    ClipRule,
    SeedSummary,
    Task,
    TrainResult,
    gap_percent,
    seed_summary,
    train_virtual,
)

DEFAULT_TASK = "examples.simulate_gpt:small_gpt"
#: The options exact Lion keeps from the mode's: Lion's own and the bucket plan.
EXACT_KEEPS = ("lr", "betas", "weight_decay", "bucket_size")


@dataclass(frozen=True)
class RunSettings:
    """What the ds_config says about a run besides the optimizer's options.

    Fields:
        grad_clip: DeepSpeed's gradient_clipping (0 disables).
        clip_rule: "per_worker" under bf16/fp16, else "deepspeed" (see ds_lioncub.simulate.train).
    """

    grad_clip: float
    clip_rule: ClipRule


@dataclass(frozen=True)
class Row:
    """One worker count of the table.

    Fields:
        workers: N.
        exact_val, mode_val: the validation losses over seeds.
        gap: the per-seed gap in % (:func:`~ds_lioncub.simulate.train.gap_percent`) over seeds.
        agreement: the mode's agreement with exact Lion, averaged over steps and seeds (None for exact Lion).
    """

    workers: int
    exact_val: SeedSummary
    mode_val: SeedSummary
    gap: SeedSummary
    agreement: AgreementStats | None


def read_ds_config(path: Path) -> tuple[dict[str, Any], RunSettings]:
    """The LionCub options and run settings of a ds_config.json; refuses any other optimizer."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LionCubConfigError(f"LionCub: cannot read the ds_config {path}: {error}. Pass a JSON file.") from None
    block = config.get("optimizer") if isinstance(config, dict) else None
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind.lower() != "lioncub":
        raise LionCubConfigError(
            f'LionCub: {path} has optimizer type {kind!r}; the simulator trains "type": "LionCub" only. '
            f'Set "optimizer": {{"type": "LionCub", "params": {{...}}}} in the ds_config.'
        )
    assert isinstance(block, dict)
    options = dict(block.get("params", {}))
    parse_config(options)  # LionCub's own validation and messages, before any training
    mixed = any(config.get(key, {}).get("enabled", False) for key in ("bf16", "fp16"))
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        print(
            f"[simulate] note: the ds_config's scheduler ({scheduler.get('type')}) is not used; the lr follows "
            f"WarmupCosineLR over --steps, peaking at the optimizer's lr",
            flush=True,
        )
    settings = RunSettings(
        grad_clip=float(config.get("gradient_clipping", 1.0)), clip_rule="per_worker" if mixed else "deepspeed"
    )
    return options, settings


def exact_options(options: dict[str, Any]) -> dict[str, Any]:
    """Exact Lion with the mode's hyper-parameters: ``compression="none"``, fp32 mean."""
    return {"compression": "none", **{key: options[key] for key in EXACT_KEEPS if key in options}}


def load_task(spec: str) -> Task:
    """Call ``function`` of ``module`` for ``"module:function"``."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise LionCubConfigError(f"LionCub: --task must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        hint = " (the default task lives in the repository's examples/: run from a checkout's root)"
        raise LionCubConfigError(
            f"LionCub: cannot import the task module {module_name!r}: {error}"
            f"{hint if spec == DEFAULT_TASK else ''}. Put it on PYTHONPATH."
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise LionCubConfigError(f"LionCub: {module_name} has no function {function_name!r} for --task")
    task: Task = factory()
    return task


def compare(
    task: Task,
    options: dict[str, Any],
    settings: RunSettings,
    workers: list[int],
    steps: int,
    seeds: list[int],
    warmup_steps: int = 10,
    log: Any = None,
) -> list[Row]:
    """Train the mode and exact Lion for every (worker count, seed); one :class:`Row` per worker count."""
    rows = []
    for n in workers:
        exact_runs: list[TrainResult] = []
        mode_runs: list[TrainResult] = []
        for seed in seeds:
            for label, opts, runs in (("exact Lion", exact_options(options), exact_runs), ("mode", options, mode_runs)):
                result = train_virtual(
                    task,
                    opts,
                    n,
                    steps,
                    seed,
                    warmup_steps=warmup_steps,
                    grad_clip=settings.grad_clip,
                    clip_rule=settings.clip_rule,
                )
                runs.append(result)
                if log is not None:
                    print(
                        f"[simulate] workers {n} seed {seed} {label}: val loss {result.val_loss:.4f}",
                        file=log,
                        flush=True,
                    )
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
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    """The table: one line per worker count, gap with 3 decimals (mean ± spread, in %)."""
    header = (
        f"{'workers':>7}  {'exact Lion val':>14}  {'mode val':>8}  {'gap % (mean ± spread)':>22}  {'real':>4}  "
        f"{'match':>6}  {'flip':>6}  {'tie':>6}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        a = row.agreement
        rates = f"{a.match:>6.3f}  {a.flip:>6.3f}  {a.tie:>6.3f}" if a is not None else f"{'-':>6}  {'-':>6}  {'-':>6}"
        lines.append(
            f"{row.workers:>7}  {row.exact_val.mean:>14.4f}  {row.mode_val.mean:>8.4f}  {row.gap.text(3):>22}  "
            f"{'yes' if row.gap.real else 'no':>4}  {rates}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ds_lioncub.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("ds_config", type=Path, help='a ds_config.json with "optimizer": {"type": "LionCub", ...}')
    p.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32], help="virtual worker counts")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (init and data order)")
    p.add_argument("--task", default=DEFAULT_TASK, help="module:function returning a Task (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps of the lr schedule")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        options, settings = read_ds_config(args.ds_config)
        task = load_task(args.task)
        print(
            f"[simulate] task {task.name}, {args.steps} steps, seeds {args.seeds}, options {options}, "
            f"gradient clipping {settings.grad_clip} ({settings.clip_rule})",
            flush=True,
        )
        rows = compare(task, options, settings, args.workers, args.steps, args.seeds, args.warmup_steps, sys.stdout)
    except LionCubError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print()
    print(format_table(rows))
    if args.json_out is not None:
        rows_json = [
            {
                "workers": r.workers,
                "exact_val": list(r.exact_val.values),
                "mode_val": list(r.mode_val.values),
                "gap_percent": list(r.gap.values),
                "agreement": None if r.agreement is None else asdict(r.agreement),
            }
            for r in rows
        ]
        args.json_out.write_text(json.dumps(rows_json, indent=2) + "\n")
    return 0

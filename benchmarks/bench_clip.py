"""Option clip's local cost: the sketch of a bucket's gradient and the scaling of it, in units of Lion's update.

    python -m benchmarks.bench_clip [--numel 8388608 ...] [--repeats 7] [--bins 4093] [--device cpu|cuda] [--tensors T]
    python -m benchmarks.bench_clip --gpt-step [--repeats 301] [--threads 1]

On one bucket of ``--numel`` fp32 elements (each size in turn), one torch thread, the median of ``--repeats``
rounds (each: one call of Lion's update, of the sketch and of the scaling, each after a warm-up call, so that
load falls on all alike), in ns per element and in units of Lion's own update (direction, momentum, update:
the planner table's ``lion_update``, timed here as ``benchmarks/bench_error_feedback.py`` times it): the
sketch (:func:`ds_lioncub.step.clipping.sketch_and_square_norm`, what a step calls: the sketch's bins and the
rank's squared norm; on a CPU one pass of the compiled kernel, or of its torch reference under
``DS_LIONCUB_PACKING=torch``) and the scaling of the gradient by the factor (one read and write). Their sum,
in Lion updates, is what the planner adds per stepped element (``CLIP_LOCAL_PASSES``, by device); the
all-reduce of the sketch is priced as a collective. The last two columns, on a CPU, are the sketch as a CPU
took it before its kernel (until 2026-11-28; :func:`torch_passes`), timed in the same rounds: its bins alone
(then ``gradient_sketch``), and with the squared norm (then ``sketch_and_square_norm``). On ``--device cuda``
the bucket lives on the GPU and each call is timed from an idle device to the end of its kernels; the
sketch's table of signs is made once, before the timing; the last two columns are then the sketch as a GPU
took it before v2 (the same passes, which ``DS_LIONCUB_CUDA_KERNELS=v1`` also gives the sketch column), and the
sketch column is the CUDA op's one kernel (or the torch scan without it, ``DS_LIONCUB_PACKING=torch``).
``--tensors T`` hands the bucket to the sketch as T tensors of equal size (a step sketches every gradient of
the model in one call: the passes before v2 issued kernels per tensor and per pass, the kernel one launch).

``--gpt-step`` times instead what the clip adds to a whole step at the main job's size (:func:`gpt_step_rows`):
``LionCub.step()`` with 1-bit compression, alone (a world of one, no process group), on the example GPT's 17
gradients (``ds_lioncub/simulate/tasks/gpt_task.py``, "small": 467,584 parameters), without and with
``clip={"max_norm": 1.0}``, on the CPU with ``--threads`` torch threads; and a third copy with clip whose sketch
is the one a CPU took before its kernel (:func:`ds_lioncub.step.clipping.sketch_in_passes` in place of
``gradient_sketch`` during its steps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from benchmarks.timing import lion_update_unit, median_seconds
from ds_lioncub import LionCub
from ds_lioncub.simulate.tasks.gpt import GPT
from ds_lioncub.simulate.tasks.gpt_task import CONFIGS
from ds_lioncub.step import clipping
from ds_lioncub.step.clipping import sketch_and_square_norm, sketch_in_passes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 23])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bins", type=int, default=4093)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU")
    parser.add_argument("--tensors", type=int, default=1, help="the bucket as this many tensors of equal size")
    parser.add_argument("--gpt-step", action="store_true", help="time LionCub.step() of the example GPT instead")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of --gpt-step")
    args = parser.parse_args(argv)
    if args.gpt_step:
        torch.set_num_threads(args.threads)
        print(f"LionCub.step(), 1-bit, a world of one, the example GPT's gradients; cpu, {args.threads} thread(s)")
        print(
            "| gradient norm | step without clip, µs | with clip, µs | added, median of rounds "
            "| with clip, the sketch before its kernel, µs | added |"
        )
        print("|---|---|---|---|---|---|")
        for row in gpt_step_rows(args.repeats):
            print(row)
        return
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu, one thread'}")
    print(
        "| elements | lion_update, ns/element | in lion_updates: sketch | scaling | clip (both) "
        "| clip / lion_update, median of rounds | before the kernel: bins | bins and squared norm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.numel:
        print(bucket_row(n, args.bins, args.repeats, device, args.tensors))


def bucket_row(n: int, bins: int, repeats: int, device: torch.device, tensors: int = 1) -> str:
    """One table row: the three parts' costs on an ``n``-element bucket (as ``tensors`` tensors), the sketch's and
    the scaling's also in units of Lion's update."""
    lion, _, grad = lion_update_unit(n, device)
    pieces = [[part] for part in grad.split(-(-n // tensors))]
    step = iter(range(1, 1 << 30))
    parts = {
        "lion": lion,
        "sketch": lambda: sketch_and_square_norm(pieces, bins, next(step), 0),
        "scaling": lambda: torch._foreach_mul_([grad], 1.0 - 1e-7),
        "bins before": lambda: torch_passes(pieces, bins, next(step), squares=False),
        "both before": lambda: torch_passes(pieces, bins, next(step), squares=True),
    }
    # Interleaved, one call of each per round, so that a shared machine's load falls on all alike.
    rounds = [{name: median_seconds(run, 1, device) / n for name, run in parts.items()} for _ in range(repeats)]
    lion_update, sketch, scale = (statistics.median(r[name] for r in rounds) for name in ("lion", "sketch", "scaling"))
    ratio = statistics.median((r["sketch"] + r["scaling"]) / r["lion"] for r in rounds)
    costs = " | ".join(f"{cost / lion_update:.2f}" for cost in (sketch, scale, sketch + scale))
    before = " | ".join(
        f"{statistics.median(r[name] for r in rounds) / lion_update:.2f}" if name in parts else "-"
        for name in ("bins before", "both before")
    )
    return f"| {n:,} | {lion_update * 1e9:.3f} | {costs} | {ratio:.2f} | {before} |"


def gpt_step_rows(repeats: int) -> list[str]:
    """Rows for two gradients of the example GPT (random, seed 0; its norm 6.8, which clip scales to 1.0 at every
    step, and 0.068, which clip leaves alone): the median over ``repeats`` rounds of one ``step()`` of each of three
    optimizers (without clip, with clip, with clip and the sketch before its kernel), in a rotating order, each after
    the same gradient is copied in (not timed)."""
    rows = []
    for scale in (1e-2, 1e-4):
        models = [GPT(CONFIGS["small"]) for _ in range(3)]
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
        clip: list[dict[str, object]] = [{}, {"clip": {"max_norm": 1.0}}, {"clip": {"max_norm": 1.0}}]
        optimizers = [
            LionCub(model.named_parameters(), lr=1e-4, weight_decay=0.1, compression="1bit", **extra)
            for model, extra in zip(models, clip, strict=True)
        ]
        generator = torch.Generator().manual_seed(0)
        grads = [torch.randn(p.shape, generator=generator) * scale for p in models[0].parameters()]
        times: list[list[float]] = [[], [], []]
        for round_ in range(repeats + 1):
            for which in (round_ % 3, (round_ + 1) % 3, (round_ + 2) % 3):
                for p, g in zip(models[which].parameters(), grads, strict=True):
                    p.grad = g.clone()
                sketch = clipping.sketch_in_passes if which == 2 else clipping.gradient_sketch
                with mock.patch.object(clipping, "gradient_sketch", sketch):
                    start = time.perf_counter()
                    optimizers[which].step()
                    times[which].append(time.perf_counter() - start)
        plain, clipped, before = (t[1:] for t in times)  # the first round builds and checks the kernels
        norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
        added, added_before = (
            statistics.median(c / p - 1 for c, p in zip(variant, plain, strict=True)) for variant in (clipped, before)
        )
        rows.append(
            f"| {norm:.3g} | {statistics.median(plain) * 1e6:.0f} | {statistics.median(clipped) * 1e6:.0f} "
            f"| {added:+.1%} | {statistics.median(before) * 1e6:.0f} | {added_before:+.1%} |"
        )
    return rows


def torch_passes(tensors: list[list[torch.Tensor]], bins: int, step: int, squares: bool) -> torch.Tensor:
    """What a CPU computed for ``gradient_sketch`` and, with ``squares``, :func:`sketch_and_square_norm` until
    2026-11-28, and a GPU until v2, for comparison (:func:`~ds_lioncub.step.clipping.sketch_in_passes`): passes of
    ``chunk_for(device)`` elements, each a product with the fp32 table of signs and a column sum of its rows into
    fp64 (a partial row added alone), then the squared norm by torch's ``sum`` of each piece in fp64 (a second read,
    and an fp64 copy)."""
    sketch = sketch_in_passes(tensors, bins, step, 0)
    if not squares:
        return sketch
    total = torch.zeros(1, dtype=torch.float64, device=sketch.device)
    for pieces in tensors:
        for piece in pieces:
            total += piece.double().square().sum()
    return torch.cat([sketch, total])


if __name__ == "__main__":
    main()

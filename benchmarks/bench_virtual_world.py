"""How much a virtual-world step costs next to one forward and backward of the same global batch.

    python -m benchmarks.bench_virtual_world                      # the example GPT, 32 workers, 64 x 64 bytes
    python -m benchmarks.bench_virtual_world --workers 64 --task large --repeats 7

Issue #22's target: a 32-worker virtual step (per-worker gradients + aggregation) of the example GPT
at global batch 64 x 64 costs at most 1.5x one forward+backward of the global batch in one process.
Timed, interleaved in each repeat so that the machine's load hits all alike (medians reported):

- ``fwd+bwd``: one forward and backward of the global batch (``loss.backward()``, weight gradients
  included), the reference;
- ``grads fused`` / ``grads loop``: the N workers' gradients by the fused pass and by a loop of N
  passes (:mod:`ds_lioncub.simulate.gradients`);
- ``step <mode>``: ``VirtualLionCub.step`` alone, for exact Lion and the 1-bit vote;
- ``virtual step <mode>``: fused gradients + step, the figure the target is about.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from ds_lioncub.simulate import VirtualLionCub
from ds_lioncub.simulate.gradients import GradientBuffers, worker_gradients
from examples.simulate_gpt import task_by_name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("small", "large"), default="small")
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--skip-loop", action="store_true", help="leave out the loop of N passes")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    task = task_by_name(args.task)
    model = task.build_model(0)
    named = [(name, param) for name, param in model.named_parameters()]
    params = [param for _, param in named]
    batch = task.batch(0, 0)
    n = args.workers
    optimizers = {
        mode: VirtualLionCub(named, workers=n, lr=1e-4, module=model, compression=mode) for mode in ("none", "1bit")
    }
    grads = worker_gradients(model, task.loss, batch, n, params, method="fused").grads
    buffers = GradientBuffers()  # as train_virtual: the same gradient storage every step

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        model.zero_grad(set_to_none=True)

    def virtual_step(mode: str) -> Callable[[], None]:
        def run() -> None:
            computed = worker_gradients(model, task.loss, batch, n, params, method="fused", buffers=buffers)
            optimizers[mode].step(computed.grads)

        return run

    timed: dict[str, Callable[[], None]] = {
        "fwd+bwd (global batch)": fwd_bwd,
        "grads fused": lambda: worker_gradients(model, task.loss, batch, n, params, "fused", buffers) and None,
        "step exact (none)": lambda: optimizers["none"].step(grads),
        "step 1bit": lambda: optimizers["1bit"].step(grads),
        "virtual step exact (none)": virtual_step("none"),
        "virtual step 1bit": virtual_step("1bit"),
    }
    if not args.skip_loop:
        timed["grads loop"] = lambda: worker_gradients(model, task.loss, batch, n, params, method="loop") and None
    for fn in timed.values():  # warm-up: allocator, lazy state, the packing op's first load
        fn()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.repeats):
        for name, fn in timed.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    reference = statistics.median(times["fwd+bwd (global batch)"])
    n_params = sum(param.numel() for param in params)
    print(f"$ {' '.join([sys.executable, '-m', 'benchmarks.bench_virtual_world', *(argv or sys.argv[1:])])}")
    print(
        f"{task.name}: {n_params:,} params, global batch {task.global_batch_size} x {task.seq_len}, {n} workers, "
        f"{torch.get_num_threads()} torch threads, {args.repeats} repeats (median; min in brackets)"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<28} {median * 1e3:8.1f} ms  [{min(values) * 1e3:7.1f}]  {median / reference:5.2f}x fwd+bwd")
    return 0


if __name__ == "__main__":
    sys.exit(main())

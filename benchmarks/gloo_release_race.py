"""How often a gloo collective returns before gloo's worker thread has let go of its tensor, and whether that
late release needs the GIL (the cause of ranks dying at exit; ds_lioncub/comm/transport/released.py).

    python -m benchmarks.gloo_release_race [--ranks 2] [--calls 600]

Each rank runs ``--calls`` plain ``dist.all_reduce(x, async_op=True)`` + ``wait()`` on 1 KiB. When the call
returns with ``x`` still referenced by the worker, the rank drops its own reference (keeping a weak one),
then runs Python for 50 ms with the GIL held (switch interval 1 s) and looks whether the tensor's Python
object is gone; then it sleeps 1 ms (GIL released) and looks again. A release that needs the GIL shows as
"alive after 50 ms holding the GIL" followed by "gone once the GIL was let go".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import weakref

from benchmarks.ranks import add_rank_options, run_module_ranks

BUSY_S = 0.05


def rank_main(rank: int, world_size: int, store: str, calls: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    sys.setswitchinterval(1.0)  # this thread keeps the GIL while it runs Python
    returned_held = alive_after_busy = gone_after_sleep = 0
    for _ in range(calls):
        x = torch.ones(256, dtype=torch.int32)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        del work
        if x._use_count() == 1:  # type: ignore[attr-defined]
            continue
        returned_held += 1
        ref = weakref.ref(x)
        del x
        start = time.perf_counter()
        while time.perf_counter() - start < BUSY_S:
            pass
        if ref() is not None:
            alive_after_busy += 1
            time.sleep(0.001)
            gone_after_sleep += ref() is None
    print(
        f"rank {rank}: returned while gloo held the tensor {returned_held}/{calls}; its Python object alive after "
        f"{BUSY_S * 1000:.0f} ms holding the GIL: {alive_after_busy}; gone within 1 ms of letting the GIL go: "
        f"{gone_after_sleep}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=600)
    add_rank_options(parser)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.store, args.calls)
        return 0
    argv_of_ranks = ["--ranks", str(args.ranks), "--calls", str(args.calls)]
    codes = run_module_ranks("benchmarks.gloo_release_race", args.ranks, argv_of_ranks)
    print(f"load average {os.getloadavg()[0]:.1f}; rank exit codes {codes}")
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())

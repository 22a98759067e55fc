"""One rank of bench_train.py: train the example GPT with one or more methods and time every step.

Started once per rank with the torch.distributed environment set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: netcluster sets them, see benchmarks/netcluster/README.md)::

    PYTHONPATH=. python benchmarks/train_worker.py --methods lion_fp32,lioncub_1bit --steps 50 --out-dir runs/

bench_train.py starts it by path, with this checkout first on PYTHONPATH (benchmarks.repo_environment).

Rank 0 writes ``<out-dir>/<method>.json`` per method. Each step is split like the paper's
Table A.1:

- forward: the model's forward pass and the loss;
- backward: the backward pass, without the time spent inside collectives;
- update: the optimizer step (Lion Cub: momentum, signs, packing, voting, applying), without the
  time inside collectives;
- communication: the time inside collectives (DeepSpeed's gradient all-reduce through
  deepspeed.comm, LionCub's all-to-all / all-gather / all-reduce). It includes waiting for a slower
  rank at the collective, as a real cluster's profile would;
- total: the step's wall time, which the four add up to.

Under torch DDP the hooks' all-reduces run asynchronously, overlapped with the backward pass, and
there is no call to time. There *communication* is the backward time the all-reduces add: each
DDP run first times a few backward passes under ``no_sync()`` (no communication) and the median
of those is the backward compute. Per-step wire bytes come from this rank's interface counters
(inside a netcluster), so they include everything on the link; with several ranks per node
(``LOCAL_WORLD_SIZE`` > 1) the ranks of a node share one link, and each reports the link's bytes
divided by the ranks on it. Traffic between ranks of one node stays on the node's loopback and is in
no link counter: the bytes are the ones that crossed between nodes.

Under ZeRO the engine's collectives are deepspeed.comm's reduce and all-gathers besides its
all-reduce; they are timed too, and so is the ZeRO hybrid's agreement on skipping a step. Each result
also records the optimizer state a rank holds (the bytes of its ``exp_avg`` tensors: the full model
at stage 0, the rank's shard under ZeRO).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import deepspeed
import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import ds_lioncub  # noqa: F401  (registers "type": "LionCub")
from benchmarks.collective_clock import CollectiveClock
from benchmarks.netcluster.counters import read_sysfs
from benchmarks.plain_lion import PlainLion
from benchmarks.train_methods import Method, TrainSettings, ds_config, method_from_json, select_methods
from ds_lioncub.comm.transport import COMMUNICATING_METHODS
from ds_lioncub.integration import find_lioncub, hybrid_zero, hybrid_zero3
from examples.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus
from examples.gpt import GPT, GPTConfig
from examples.train_gpt import checked_parameters, evaluate, fp32_loss, get_batch, params_in_sync

COLUMNS = ("forward_s", "backward_s", "update_s", "comm_s", "total_s", "loss", "tx_bytes", "rx_bytes")
DDP_CALIBRATION_STEPS = 5


class LinkCounter:
    """This rank's interface counters (``NETCLUSTER_IFNAME``); zeros outside a netcluster."""

    def __init__(self) -> None:
        self.ifname = os.environ.get("NETCLUSTER_IFNAME")

    def read(self) -> tuple[int, int]:
        if self.ifname is None:
            return 0, 0
        counters = read_sysfs(self.ifname)
        return counters.tx_bytes, counters.rx_bytes


def bf16_compress_hook_any_backend(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own ``bf16_compress_hook``, under another name.

    DDP refuses to register a hook *named* bf16_compress_hook unless the backend is NCCL or XCCL
    (a check on the function's name); the hook itself only needs a backend whose all-reduce takes
    bf16, which gloo's does. The work is still DDP's hook: cast to bf16, all-reduce, divide, cast back.
    """
    return default_hooks.bf16_compress_hook(state, bucket)


# DDP checks the hook's annotations, which `from __future__ import annotations` turns into strings.
bf16_compress_hook_any_backend.__signature__ = inspect.signature(default_hooks.bf16_compress_hook)  # type: ignore[attr-defined]


def powersgd_hook_in_bucket_order(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's ``powerSGD_hook``, finished before the next bucket's hook starts.

    The hook chains collectives: it all-reduces the uncompressed tensors, and the completion
    callback of that all-reduce issues the all-reduce of P, whose callback issues Q's. Callbacks run
    on gloo's threads, so with several buckets in flight a rank can issue bucket 1's P all-reduce
    before or after bucket 2's first all-reduce, differently on different ranks; gloo then aborts
    ("Received data size doesn't match expected size ... collective mismatch"), seen here at 4
    ranks. Waiting keeps one order on every rank; it gives up overlapping the PowerSGD all-reduces
    with the rest of the backward pass (their bytes are few).
    """
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


powersgd_hook_in_bucket_order.__signature__ = inspect.signature(powerSGD_hook.powerSGD_hook)  # type: ignore[attr-defined]


def model_config(settings: TrainSettings) -> GPTConfig:
    return GPTConfig(
        max_seq_len=settings.seq_len, n_layer=settings.n_layer, n_head=settings.n_head, d_model=settings.d_model
    )


def ranks_per_link() -> int:
    """How many ranks share this rank's link: its node's ranks inside a netcluster, else 1."""
    if not os.environ.get("NETCLUSTER_IFNAME"):
        return 1
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def gathered_module_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The whole parameters of a ZeRO-3 module (each gathered from its partition group), copied."""
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the ``exp_avg`` tensors in ``optimizer.state`` (Lion's only state: its momentum)."""
    return sum(
        state["exp_avg"].nbytes
        for state in optimizer.state.values()
        if isinstance(state, dict) and torch.is_tensor(state.get("exp_avg"))
    )


def gathered(value: int) -> list[int]:
    """``value`` from every rank, in rank order."""
    tensor = torch.tensor([value], dtype=torch.int64)
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [int(item.item()) for item in out]


# deepspeed.comm functions through which ZeRO-1/2 communicate (besides all_reduce); timed when present.
ZERO_COLLECTIVES = ("reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def train(
    method: Method, settings: TrainSettings, steps: int, corpus: Corpus, eval_windows: int, node_size: int = 1
) -> dict[str, Any]:
    """Train ``method`` for ``steps`` steps on every rank; per-step columns are means over ranks.

    ``node_size`` is the ranks per node, passed to the ZeRO hybrid as ``hybrid.node_size``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(settings.seed)  # same initial weights on every rank and for every method
    model = GPT(model_config(settings))
    n_params = model.num_parameters()
    data_gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + rank + 1)
    clock = CollectiveClock()
    link = LinkCounter()
    sharers = ranks_per_link()
    state_holder: Any = None
    backward_compute_s: float | None = None

    if method.runtime == "deepspeed":
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(method, settings, node_size, steps)
        )
        module: torch.nn.Module = engine.module
        clock.wrap(ds_comm, "all_reduce")  # the engine looks it up on the module at call time
        if method.zero_stage:
            for name in ZERO_COLLECTIVES:
                if hasattr(ds_comm, name):
                    clock.wrap(ds_comm, name)
        if method.hybrid:
            # The hybrid's world-wide skip agreement (a one-byte all-reduce over the vote group, through
            # torch.distributed): it waits for the other nodes, which is communication, not update.
            clock.wrap(hybrid_zero, "any_rank")
            clock.wrap(hybrid_zero3, "any_rank")
        lioncub = find_lioncub(engine.optimizer)
        state_holder = lioncub
        if lioncub is not None:
            for name in COMMUNICATING_METHODS:
                clock.wrap(lioncub.transport, name)

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return fp32_loss(engine(x)[0], y)

        backward: Callable[[torch.Tensor], None] = engine.backward
        update: Callable[[], None] = engine.step
        if method.zero_stage == 3:
            # ZeRO-3 keeps each rank's slice of the weights: gathered, they must agree.
            synced = lambda: gathered_module_parameters(engine.module)  # noqa: E731
        elif method.zero_stage:
            # Under ZeRO each rank's optimizer holds its own shard: only the module's weights can agree.
            synced = lambda: list(engine.module.parameters())  # noqa: E731
        else:
            synced = lambda: checked_parameters(engine)  # noqa: E731
    else:
        ddp = DistributedDataParallel(model)
        if method.ddp_hook == "bf16":
            ddp.register_comm_hook(None, bf16_compress_hook_any_backend)
        else:
            # start_powerSGD_iter must be > 1 with error feedback; 2 makes the first step a plain
            # all-reduce (PowerSGD's own warm-up) and every later one low-rank.
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=settings.powersgd_rank, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powersgd_hook_in_bucket_order)
        module = ddp.module
        optimizer = PlainLion(
            ddp.parameters(), lr=settings.lr, betas=(settings.beta1, method.beta2), weight_decay=settings.weight_decay
        )
        state_holder = optimizer

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return fp32_loss(ddp(x)[0], y)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        synced = lambda: list(ddp.parameters())  # noqa: E731
        backward_compute_s = _ddp_backward_compute(ddp, corpus, settings, rank)

    rows: list[list[float]] = []
    dist.barrier()
    for _ in range(steps):
        x, y = get_batch(corpus.train, settings.micro_batch, settings.seq_len, data_gen)
        tx0, rx0 = link.read()
        comm0 = clock.seconds
        t0 = time.perf_counter()
        loss = forward(x, y)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        comm_backward = clock.seconds - comm0
        update()
        t3 = time.perf_counter()
        comm = clock.seconds - comm0
        tx1, rx1 = link.read()
        backward_s, comm_s = t2 - t1 - comm_backward, comm
        if backward_compute_s is not None:  # DDP: the all-reduce time hides inside backward
            comm_s = max(0.0, (t2 - t1) - backward_compute_s)
            backward_s = (t2 - t1) - comm_s
        update_s = (t3 - t2) - (comm - comm_backward)
        rows.append(
            [t1 - t0, backward_s, update_s, comm_s, t3 - t0, loss.item(), (tx1 - tx0) / sharers, (rx1 - rx0) / sharers]
        )
    clock.restore()
    # B_simple as LionCub measured it (compressed modes with two voters or more; None otherwise): what a user gives
    # the planner as --noise-scale.
    noise = getattr(state_holder, "noise_scale", None) if method.runtime == "deepspeed" else None
    noise_scale = None if noise is None else {**asdict(noise), "b_simple": noise.b_simple}
    state_bytes = gathered(optimizer_state_bytes(state_holder) if state_holder is not None else 0)

    val_loss = evaluate(
        module,
        corpus.val,
        settings.micro_batch,
        SimpleNamespace(seq_len=settings.seq_len, eval_windows=eval_windows),
        next(module.parameters()).device,
        rank,
        world,
    )
    in_sync = params_in_sync(synced(), world)
    table = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(table)
    table /= world
    result = {
        "method": asdict(method),
        "settings": asdict(settings),
        "world_size": world,
        "node_size": node_size,
        "ranks_per_link": sharers,
        "optimizer_state_bytes": state_bytes,
        "steps": steps,
        "n_params": n_params,
        "threads_per_rank": torch.get_num_threads(),
        "ddp_backward_compute_s": backward_compute_s,
        "link_rate_bps": int(os.environ["NETCLUSTER_RATE_BPS"]) if os.environ.get("NETCLUSTER_RATE_BPS") else None,
        "val_loss": val_loss,
        "params_in_sync": in_sync,
        "noise_scale": noise_scale,
        "columns": list(COLUMNS),
        "per_step": {name: table[:, i].tolist() for i, name in enumerate(COLUMNS)},
    }
    if method.runtime == "deepspeed":
        engine.destroy()
    gc.collect()
    return result


def _ddp_backward_compute(ddp: DistributedDataParallel, corpus: Corpus, settings: TrainSettings, rank: int) -> float:
    """Median backward time with DDP's communication off (``no_sync``); gradients are discarded."""
    gen = torch.Generator().manual_seed(settings.seed + 7919 * (rank + 1))  # not the training data stream
    times = []
    for _ in range(DDP_CALIBRATION_STEPS):
        x, y = get_batch(corpus.train, settings.micro_batch, settings.seq_len, gen)
        with ddp.no_sync():
            loss = fp32_loss(ddp(x)[0], y)
            start = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - start)
        ddp.zero_grad(set_to_none=True)
    # Every rank must use the same figure for the same meaning; the mean of the ranks' medians.
    value = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        default="all",
        help="comma-separated names from benchmarks/train_methods.py, all, or '' (only --method-json)",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--corpus-cache", type=Path, default=None, help="where the default corpus is cached")
    p.add_argument("--settings", type=str, default="{}", help="JSON object of TrainSettings fields")
    p.add_argument("--node-size", type=int, default=1, help="ranks per node (the ZeRO hybrid's hybrid.node_size)")
    p.add_argument(
        "--method-json",
        action="append",
        default=[],
        help="a method not in train_methods.py, as a JSON object of Method's fields, run after --methods (repeatable)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.node_size < 1:
        p.error("--steps and --node-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    methods = (select_methods(args.methods) if args.methods else []) + [method_from_json(m) for m in args.method_json]
    settings = TrainSettings(**json.loads(args.settings))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")  # also the default group DDP uses
    corpus = load_corpus(None, max_bytes=args.corpus_bytes, cache_dir=args.corpus_cache)
    for method in methods:
        result = train(method, settings, args.steps, corpus, args.eval_windows, args.node_size)
        if dist.get_rank() == 0:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"{method.name}.json").write_text(json.dumps(result) + "\n")
            mean_total = statistics.fmean(result["per_step"]["total_s"][min(3, args.steps - 1) :])
            print(
                f"[train_worker] {method.name}: val loss {result['val_loss']:.4f}, "
                f"{1e3 * mean_total:.0f} ms/step, params in sync: {result['params_in_sync']}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

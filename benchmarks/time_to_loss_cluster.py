"""Time to exact Lion's loss on the emulated cluster, the way MLPerf measures: wall clock to a target loss.

The planner (:mod:`ds_lioncub.planner`) claims a compressed mode reaches exact Lion's loss sooner than exact Lion,
by its step time x r (r: the steps the mode needs, in units of exact Lion's). This measures that claim end to end
on bench_train's job (the example GPT, 4 ranks, one per node, 1 Gbit/s links of benchmarks/netcluster, the real
DeepSpeed engine through benchmarks/train_worker.py):

1. the planner is asked for its pick for this job (its parameters, 4 x 1 ranks, the link, the global batch, a local
   cost table calibrated on this machine, 2 ranks per core), and what it predicts for exact fp32 Lion and the pick;
2. exact Lion with an fp32 all-reduce runs T steps (cosine schedule fitted to T, as the convergence study trains):
   its validation loss is the target L*; exact Lion with a bf16 all-reduce runs the same T steps;
3. the planner's pick runs with its cosine schedule fitted to each length L in T x ``--multiples``; L*, the length
   at which its validation loss reaches the target, is read between them exactly as benchmarks/study_time_to_loss.py
   does (:func:`ds_lioncub.simulate.time_to_loss.crossing`), and r = L* / T;
4. time to L* = steps to L* x the run's measured seconds per step (the mean step wall time of its runs); the ratio
   is exact fp32 Lion's time over the pick's, set beside the planner's predicted ratio.

Every run starts from the same weights and sees the same batches (seed, data order). The runs go in both orders
(exact first, then the pick's lengths; and the reverse), in one cluster, so that a drift of the machine's load
shows as a difference between the orders rather than as a bias for one mode::

    sudo python -m benchmarks.time_to_loss_cluster --steps 80 --out-dir benchmarks/results/time_to_loss_cluster
    python -m benchmarks.time_to_loss_cluster --report-only --out-dir benchmarks/results/time_to_loss_cluster

(from the repository root, ``.venv`` active, ``DS_ACCELERATOR=cpu``). Writes ``time_to_loss_cluster.json`` and
``report.md`` under ``--out-dir``, each run's record under ``records/<order>/`` (not ``runs/``, which git
ignores) and its logs under ``logs/``.

The planner prices only communication and the optimizer ("the forward and backward passes are the same in every
mode"): its ratio is of those parts. The ratio a user sees also pays the forward and backward passes, which the
planner does not know; the report therefore also prints the planner's figures with this run's measured forward
and backward time added to every mode's step (that compute is paid r times by the pick, too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import REPO, repo_environment
from benchmarks.train_methods import METHODS_BY_NAME, Method, TrainSettings
from ds_lioncub.planner.convergence import study_mode
from ds_lioncub.simulate.time_to_loss import crossing

WORKER = REPO / "benchmarks" / "train_worker.py"
RESULT_NAME = "time_to_loss_cluster.json"
ORDERS = ("exact_first", "pick_first")
EXACT_FP32, EXACT_BF16, PICK = "lion_fp32", "lion_bf16", "pick"
SPEEDUP_TARGET = 3.0  # the pick reaches L* at least this many times sooner than exact fp32 Lion
PREDICTION_TOLERANCE = 0.25  # the planner's ratio within this fraction of the measured one
SKIP_STEPS = 0  # every step counts: time to a loss is the whole training's wall clock


# ------------------------------------------------------------------------------------------------ the planner


@dataclass(frozen=True)
class PlannerView:
    """What the planner predicts for the pick and for exact Lion (seconds: communication and optimizer only).

    ``pick_params``/``pick_zero_stage``: the recommended mode as the planner writes it (LionCub options).
    ``r``/``r_low``/``r_high``/``r_basis``: its steps to exact Lion's loss in units of exact Lion's.
    ``pick_step_s``, ``exact_fp32_step_s``, ``exact_bf16_step_s``: predicted seconds per step (None where the
    planner lists no such candidate). ``pick_to_loss_s``: its seconds_to_lions_loss (step x r).
    """

    pick_params: dict[str, Any]
    pick_zero_stage: int
    r: float
    r_low: float | None
    r_high: float | None
    r_basis: str
    pick_step_s: float
    pick_to_loss_s: float
    exact_fp32_step_s: float
    exact_bf16_step_s: float | None
    noise_scale: float | None
    local_costs: str

    def predicted_ratio(self, compute_s: float = 0.0) -> float:
        """Exact fp32 Lion's time to its loss over the pick's: (c + fp32 step) / ((c + pick step) x r), with
        ``compute_s`` (forward and backward, the same in every mode) added to both steps; 0: the planner's own."""
        return (compute_s + self.exact_fp32_step_s) / ((compute_s + self.pick_step_s) * self.r)


def _stage0_exact(candidates: Sequence[dict[str, Any]], dtype: str) -> dict[str, Any] | None:
    for candidate in candidates:
        params = candidate["params"]
        if candidate["zero_stage"] == 0 and params.get("compression") == "none":
            if params.get("comm_dtype", "fp32") == dtype:
                return candidate
    return None


def planner_view(answer: dict[str, Any]) -> PlannerView:
    """The planner's ``--json`` answer, read: its recommendation and exact Lion's stage-0 candidates."""
    recommended = answer["recommended"]
    pick = next(
        c
        for c in answer["candidates"]
        if c["params"] == recommended["params"] and c["zero_stage"] == recommended["zero_stage"]
    )
    fp32 = _stage0_exact(answer["candidates"], "fp32")
    bf16 = _stage0_exact(answer["candidates"], "bf16")
    if fp32 is None:
        raise ValueError("the planner's answer lists no stage-0 exact Lion with an fp32 all-reduce")
    return PlannerView(
        pick_params=dict(recommended["params"]),
        pick_zero_stage=int(recommended["zero_stage"]),
        r=float(recommended["r"]),
        r_low=recommended.get("r_low"),
        r_high=recommended.get("r_high"),
        r_basis=str(recommended.get("r_basis", "")),
        pick_step_s=float(pick["seconds_per_step"]),
        pick_to_loss_s=float(recommended["seconds_to_lions_loss"]),
        exact_fp32_step_s=float(fp32["seconds_per_step"]),
        exact_bf16_step_s=None if bf16 is None else float(bf16["seconds_per_step"]),
        noise_scale=answer.get("time_to_loss", {}).get("noise_scale"),
        local_costs=str(answer.get("local_costs", {}).get("measured_on", "")),
    )


def planner_command(
    params: int,
    nodes: int,
    bandwidth: str,
    ranks_per_core: float,
    global_batch: int,
    beta2: float,
    local_costs: Path | None,
    noise_scale: float | None = None,
    job_evidence: Path | None = None,
) -> list[str]:
    """The planner's command line for this job; ``--clip 0``: bench_train's jobs clip nothing. ``job_evidence``:
    cells measured on this job in the virtual world (``python -m ds_lioncub.simulate --evidence-out``)."""
    command = [
        sys.executable,
        *("-m", "ds_lioncub.planner", "--json", "--device", "cpu"),
        *("--params", str(params), "--nodes", str(nodes), "--gpus-per-node", "1"),
        *("--inter-node-bandwidth", bandwidth, "--ranks-per-core", f"{ranks_per_core:g}"),
        *("--global-batch", str(global_batch), "--beta2", f"{beta2:g}", "--clip", "0"),
    ]
    if local_costs is not None:
        command += ["--local-costs", str(local_costs)]
    if noise_scale is not None:
        command += ["--noise-scale", f"{noise_scale:.6g}"]
    if job_evidence is not None:
        command += ["--job-evidence", str(job_evidence)]
    return command


def simulated_answer(summary: dict[str, Any], out: Path, evidence: Path) -> dict[str, Any]:
    """The planner asked again, before any cluster run could tell it r: with ``evidence``, the pick's cell measured
    on this job in the virtual world (benchmarks/cluster_job_task.py), and the noise scale that simulation measured
    (so r is the simulated one at the job's batch). The table is the summary's (the calibrated one where it was)."""
    key = study_mode(planner_view(summary["planner"]["worst_case"]["answer"]).pick_params)
    cells = json.loads(evidence.read_text())["cells"]
    cell = next(c for c in cells if c["workers"] == summary["ranks"] and c["mode"] == key)
    table = out / "local_costs.json" if summary["planner"]["table"] == "calibrated" else None
    command = planner_command(
        int(summary["params"]),
        int(summary["ranks"]),
        str(summary["bandwidth"]),
        float(summary["ranks_per_core"]),
        int(summary["global_batch"]),
        0.99,
        table,
        cell.get("r_noise_scale_samples"),
        evidence,
    )
    return {"command": command[1:], "answer": ask_planner(command)}


def ask_planner(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, env=repo_environment(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the planner failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def calibrate(path: Path) -> None:
    """The planner's own calibration of this machine's local costs, one torch thread (one rank per core)."""
    env = {**repo_environment(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "ds_lioncub.planner", "--calibrate", "--device", "cpu", "--threads", "1"]
    subprocess.run([*command, "--save", str(path)], env=env, check=True, stdout=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class RunSpec:
    """One training run: ``mode`` (lion_fp32, lion_bf16 or pick) for ``steps`` steps, its schedule fitted to them."""

    mode: str
    steps: int

    @property
    def name(self) -> str:
        return f"{self.mode}_{self.steps}steps"


def lengths(steps: int, multiples: Sequence[float]) -> list[int]:
    """The pick's run lengths: T x each multiple, rounded, without repeats, shortest first."""
    return sorted({round(steps * multiple) for multiple in multiples})


def run_order(order: str, steps: int, multiples: Sequence[float]) -> list[RunSpec]:
    """``exact_first``: fp32, bf16, then the pick's lengths, shortest first; ``pick_first``: the exact reverse."""
    runs = [RunSpec(EXACT_FP32, steps), RunSpec(EXACT_BF16, steps)]
    runs += [RunSpec(PICK, length) for length in lengths(steps, multiples)]
    if order == "exact_first":
        return runs
    if order == "pick_first":
        return runs[::-1]
    raise ValueError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")


def pick_method(view: PlannerView) -> Method:
    """The planner's pick as a bench_train method: its LionCub options exactly as the planner writes them."""
    if view.pick_zero_stage != 0:
        raise SystemExit(
            f"time_to_loss_cluster: the planner picked ZeRO stage {view.pick_zero_stage}; only stage 0 is measured here"
        )
    label = "planner's pick: " + ", ".join(f"{key} {value}" for key, value in view.pick_params.items())
    return Method(PICK, label, "deepspeed", lioncub=dict(view.pick_params))


def run_method(run: RunSpec, pick: Method) -> Method:
    base = pick if run.mode == PICK else METHODS_BY_NAME[run.mode]
    return replace(base, name=run.name)


def worker_command(
    run: RunSpec, method: Method, settings: TrainSettings, out: Path, corpus_cache: Path, eval_windows: int
) -> list[str]:
    return [
        sys.executable,
        str(WORKER),
        *("--methods", "", "--method-json", json.dumps(asdict(method))),
        *("--steps", str(run.steps), "--eval-windows", str(eval_windows)),
        *("--out-dir", str(out.resolve()), "--corpus-cache", str(corpus_cache.resolve())),
        *("--settings", json.dumps(asdict(settings))),
    ]


# ------------------------------------------------------------------------------------------------ the arithmetic


def seconds_per_step(records: Sequence[dict[str, Any]]) -> float:
    """The mean wall time of one step over every step of ``records`` (the runs of one mode in one order)."""
    total = sum(sum(record["per_step"]["total_s"][SKIP_STEPS:]) for record in records)
    steps = sum(len(record["per_step"]["total_s"][SKIP_STEPS:]) for record in records)
    return total / steps


def compute_seconds(records: Sequence[dict[str, Any]]) -> float:
    """The mean forward + backward time of one step (without time inside collectives) over ``records``."""
    total = sum(sum(r["per_step"]["forward_s"]) + sum(r["per_step"]["backward_s"]) for r in records)
    return total / sum(len(r["per_step"]["forward_s"]) for r in records)


@dataclass(frozen=True)
class ModeTime:
    """One mode in one order: its runs' (length, validation loss), seconds per step, steps to L*, r and time.

    ``steps_to_target`` is None where the runs do not reach L* (``bound`` then says where it lies); ``extrapolated``:
    L* lies below the shortest run (the mode beats exact Lion at T), on the line through its two shortest runs.
    """

    mode: str
    points: tuple[tuple[int, float], ...]
    seconds_per_step: float
    compute_per_step: float
    steps_to_target: float | None
    r: float | None
    extrapolated: bool = False
    bound: str = ""
    loss_only: tuple[int, ...] = ()  # lengths of runs whose losses joined the crossing but not the timing

    @property
    def time_to_target(self) -> float | None:
        return None if self.steps_to_target is None else self.steps_to_target * self.seconds_per_step


def mode_time(
    mode: str,
    records: Sequence[dict[str, Any]],
    steps: int,
    target: float,
    loss_only: Sequence[dict[str, Any]] = (),
) -> ModeTime:
    """The mode's steps to ``target``: exact Lion's runs are T steps long (r = 1 by definition for fp32, whose loss
    is the target; bf16 is timed over the same T steps, its loss printed beside the target); the pick's runs are
    interpolated as benchmarks/study_time_to_loss.py interpolates a study's. ``loss_only``: the pick's runs of other
    lengths from another session of the same job, whose losses join the crossing (the losses do not depend on the
    session) but whose step times do not join this order's."""
    own = {int(r["steps"]): float(r["val_loss"]) for r in records}
    extra = {int(r["steps"]): float(r["val_loss"]) for r in loss_only if int(r["steps"]) not in own}
    points = tuple(sorted({**own, **extra}.items()))
    per_step, compute = seconds_per_step(records), compute_seconds(records)
    if mode != PICK:
        return ModeTime(mode, points, per_step, compute, float(steps), 1.0)
    found = ModeTime(mode, points, per_step, compute, None, None, loss_only=tuple(sorted(extra)))
    at, side, limit = crossing(list(points), target) if len(points) >= 2 else (None, ">", points[-1][0])
    if at is None:
        return replace(found, bound=f"{side} {limit / steps:.2f}")
    return replace(found, steps_to_target=at, r=at / steps, extrapolated=side == "<=")


@dataclass(frozen=True)
class OrderResult:
    order: str
    target: float
    modes: dict[str, ModeTime]

    def ratio(self, mode: str) -> float | None:
        """Exact fp32 Lion's time to L* over ``mode``'s."""
        mine = self.modes[mode].time_to_target
        exact = self.modes[EXACT_FP32].time_to_target
        return None if mine is None or exact is None else exact / mine


def analyse(
    order: str, records: dict[str, dict[str, Any]], steps: int, loss_only: Sequence[dict[str, Any]] = ()
) -> OrderResult:
    """``records``: run name -> train_worker's record, for one order's runs. ``loss_only``: more runs of the pick
    (:func:`mode_time`); one whose first training loss is not exact Lion's (other data or weights) is left out."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for record in records.values():
        by_mode.setdefault(str(record["run_mode"]), []).append(record)
    exact = [r for r in by_mode[EXACT_FP32] if int(r["steps"]) == steps]
    target = float(exact[0]["val_loss"])
    first_loss = exact[0]["per_step"]["loss"][0]
    paired = []
    for record in loss_only:
        if record.get("run_mode") != PICK:
            continue
        if record["per_step"]["loss"][0] != first_loss:
            print(f"warning: left out a {record['steps']}-step run: trained on other data or weights", file=sys.stderr)
            continue
        paired.append(record)
    modes = {
        mode: mode_time(mode, runs, steps, target, paired if mode == PICK else ()) for mode, runs in by_mode.items()
    }
    return OrderResult(order, target, modes)


def within(predicted: float, measured: float, tolerance: float = PREDICTION_TOLERANCE) -> bool:
    """Whether ``predicted`` is within ``tolerance`` (a fraction) of ``measured``."""
    return abs(predicted / measured - 1.0) <= tolerance


def _f(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _r_text(view: PlannerView) -> str:
    interval = "" if view.r_low is None or view.r_high is None else f" [{view.r_low:.2f}, {view.r_high:.2f}]"
    return f"{view.r:.2f}{interval} ({view.r_basis})"


LABELS = {EXACT_FP32: "exact Lion, fp32 all-reduce", EXACT_BF16: "exact Lion, bf16 all-reduce"}


def table_lines(results: Sequence[OrderResult], pick_label: str) -> list[str]:
    """One row per (order, mode): ms/step, its runs' validation losses, steps to L*, r, time to L*, ratio."""
    lines = [
        "| order | mode | ms/step | val loss by run length | steps to L* | r (measured) | time to L* (s) "
        "| vs exact fp32 |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for result in results:
        for mode in (EXACT_FP32, EXACT_BF16, PICK):
            if mode not in result.modes:
                continue
            found = result.modes[mode]
            losses = ", ".join(
                f"{length}: {loss:.4f}" + ("†" if length in found.loss_only else "") for length, loss in found.points
            )
            if mode == EXACT_BF16:
                r = f"1 (T steps; {100 * (found.points[-1][1] / result.target - 1):+.2f}% vs L*)"
            elif found.r is not None:
                r = f"{found.r:.3f}" + ("*" if found.extrapolated else "")
            else:
                r = found.bound
            steps_to = _f(found.steps_to_target, ".1f")
            ratio = result.ratio(mode)
            lines.append(
                f"| {result.order} | {LABELS.get(mode, pick_label)} | {1e3 * found.seconds_per_step:.0f} | {losses} "
                f"| {steps_to} | {r} | {_f(found.time_to_target, '.1f')} | {_f(ratio, '.2f')}x |"
            )
    return lines


def prediction_lines(results: Sequence[OrderResult], views: dict[str, PlannerView], compute_s: float) -> list[str]:
    """The planner's predicted ratio (its own, and with the measured forward + backward added to every step) beside
    each order's measured one, with predicted / measured and whether that is within 25%."""
    orders = " | ".join(f"measured, {r.order} | predicted / measured | within 25%" for r in results)
    lines = [
        f"| planner answer | r (planner) | pick ms/step | fp32 ms/step | predicted ratio | {orders} |",
        "|---|---|---:|---:|---:|" + "---:|---:|---|" * len(results),
    ]
    for name, view in views.items():
        for compute, how in ((0.0, "planner alone"), (compute_s, f"+ measured fwd/bwd {1e3 * compute_s:.0f} ms")):
            predicted = view.predicted_ratio(compute)
            cells = []
            for result in results:
                measured = result.ratio(PICK)
                if measured is None:
                    cells.append("n/a | n/a | n/a")
                    continue
                ok = "yes" if within(predicted, measured) else "**no**"
                cells.append(f"{measured:.2f}x | {predicted / measured:.2f} | {ok}")
            lines.append(
                f"| {name}, {how} | {_r_text(view)} | {1e3 * (compute + view.pick_step_s):.0f} "
                f"| {1e3 * (compute + view.exact_fp32_step_s):.0f} | {predicted:.2f}x | {' | '.join(cells)} |"
            )
    return lines


def parts_lines(results: Sequence[OrderResult], view: PlannerView) -> list[str]:
    """What the planner prices (communication and the optimizer) against the same parts measured, and the forward
    and backward passes it leaves out, per mode and order (ms per step)."""
    predicted = {EXACT_FP32: view.exact_fp32_step_s, EXACT_BF16: view.exact_bf16_step_s, PICK: view.pick_step_s}
    lines = [
        "| order | mode | planner: comm + optimizer | measured: comm + optimizer | planner / measured "
        "| measured: forward + backward | measured step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for mode in (EXACT_FP32, EXACT_BF16, PICK):
            found = result.modes.get(mode)
            if found is None:
                continue
            priced = found.seconds_per_step - found.compute_per_step
            planned = predicted[mode]
            share = "n/a" if planned is None else f"{planned / priced:.2f}"
            planned_ms = _f(None if planned is None else 1e3 * planned, ".0f")
            compute_ms, step_ms = 1e3 * found.compute_per_step, 1e3 * found.seconds_per_step
            lines.append(
                f"| {result.order} | {LABELS.get(mode, 'the pick')} | {planned_ms} | {1e3 * priced:.0f} | {share} "
                f"| {compute_ms:.0f} | {step_ms:.0f} |"
            )
    return lines


def target_lines(results: Sequence[OrderResult]) -> list[str]:
    """Whether the pick reached L* at least 3x sooner than exact fp32 Lion, per order."""
    lines = []
    for result in results:
        ratio = result.ratio(PICK)
        verdict = "n/a (L* not reached)" if ratio is None else ("met" if ratio >= SPEEDUP_TARGET else "**not met**")
        lines.append(
            f"- {result.order}: the pick reaches L* {_f(ratio, '.2f')}x sooner than exact fp32 Lion: "
            f">= {SPEEDUP_TARGET:g}x {verdict}."
        )
    return lines


# ------------------------------------------------------------------------------------------------ driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=80, help="T: exact Lion's run length, whose loss is the target")
    p.add_argument(
        "--multiples",
        type=float,
        nargs="+",
        default=[1.0, 1.25, 1.5],
        help="the pick's run lengths in units of T (default: %(default)s)",
    )
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit", help="per-link rate (tc syntax)")
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before its ranks are stopped")
    p.add_argument(
        "--local-costs",
        default="calibrate",
        help="the planner's local cost table: 'calibrate' (measure this machine first, the default), 'builtin', "
        "or a file saved by python -m ds_lioncub.planner --calibrate --save",
    )
    p.add_argument(
        "--settings",
        default="{}",
        help="JSON object of TrainSettings fields besides the schedule (default: bench_train's model and batch)",
    )
    p.add_argument(
        "--loss-runs",
        type=Path,
        nargs="+",
        help="with --report-only: directories of the pick's records from other runs of this job (other lengths), "
        "whose validation losses join the crossing but not the timing",
    )
    p.add_argument(
        "--job-evidence",
        type=Path,
        help="with --report-only: the pick's cells measured on this job in the virtual world (python -m "
        "ds_lioncub.simulate ... --task benchmarks.cluster_job_task:cluster_job --evidence-out FILE): the planner "
        "is asked again with them, a prediction no cluster run informed",
    )
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from --out-dir")
    args = p.parse_args(argv)
    if args.steps <= TrainSettings().warmup_steps or args.ranks < 2:
        p.error(f"--steps must exceed the {TrainSettings().warmup_steps} warmup steps and --ranks be >= 2")
    return args


def _cores() -> int:
    return os.cpu_count() or 1


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.netcluster import Cluster, ClusterSpec, LinkSpec, run_command
    from benchmarks.netcluster.signals import signals_as_exceptions
    from benchmarks.netcluster.system import unavailable_reason
    from benchmarks.netcluster.units import parse_rate
    from benchmarks.train_worker import model_config
    from examples.compare import remove_deepspeed_shm_buffers
    from examples.corpus import DEFAULT_MAX_BYTES, build_corpus
    from examples.gpt import GPT

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"time_to_loss_cluster: cannot build the emulated cluster: {reason} (run as root)")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    settings = TrainSettings(**{**json.loads(args.settings), "schedule": "cosine"})
    params = GPT(model_config(settings)).num_parameters()
    global_batch = settings.micro_batch * args.ranks
    ranks_per_core = max(1.0, args.ranks / _cores())

    if args.local_costs == "calibrate":
        costs: Path | None = out / "local_costs.json"
        started = time.monotonic()
        calibrate(costs)
        print(f"[ttl] calibrated the planner's local costs in {time.monotonic() - started:.0f} s: {costs}", flush=True)
    else:
        costs = None if args.local_costs == "builtin" else Path(args.local_costs)

    def planner(noise: float | None, table: Path | None) -> dict[str, Any]:
        command = planner_command(params, args.ranks, args.bandwidth, ranks_per_core, global_batch, 0.99, table, noise)
        return {"command": command[1:], "answer": ask_planner(command)}

    table = "builtin" if costs is None else ("calibrated" if args.local_costs == "calibrate" else str(costs))
    before = planner(None, costs)
    builtin = before if costs is None else planner(None, None)
    view = planner_view(before["answer"])
    pick = pick_method(view)
    print(f"[ttl] the planner picks {pick.label}: r {_r_text(view)}", flush=True)

    build_corpus(None, DEFAULT_MAX_BYTES, cache_dir=out / "corpus_cache")
    spec = ClusterSpec(nodes=args.ranks, link=LinkSpec(rate_bps=parse_rate(args.bandwidth)))
    walls: dict[str, dict[str, float]] = {}
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with signals_as_exceptions(), Cluster(spec) as cluster:
        index = 0
        for order in args.orders:
            for run in run_order(order, args.steps, args.multiples):
                method = run_method(run, pick)
                run_dir = out / "records" / order
                port = 29500 + index
                index += 1
                print(f"[ttl] {order}: {run.name}", flush=True)
                start = time.monotonic()
                result = run_command(
                    cluster,
                    worker_command(run, method, settings, run_dir, out / "corpus_cache", args.eval_windows),
                    master_port=port,
                    timeout_s=args.timeout,
                    echo_ranks={0},
                    log_dir=out / "logs" / order / run.name,
                )
                walls.setdefault(order, {})[run.name] = time.monotonic() - start
                remove_deepspeed_shm_buffers(port)
                if not result.ok:
                    raise SystemExit(
                        f"time_to_loss_cluster: {order} {run.name} failed (exit code {result.exit_code}); see "
                        f"{out / 'logs' / order / run.name}"
                    )
                record_path = run_dir / f"{run.name}.json"
                record = json.loads(record_path.read_text())
                record["run_mode"] = run.mode
                record_path.write_text(json.dumps(record) + "\n")
    finished_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    # The planner again, now with the noise scale LionCub measured in the pick's run closest to T (the first order's):
    # what a user would give it after a first run.
    closest = min(lengths(args.steps, args.multiples), key=lambda length: abs(length - args.steps))
    first = json.loads((out / "records" / args.orders[0] / f"{RunSpec(PICK, closest).name}.json").read_text())
    noise = (first.get("noise_scale") or {}).get("b_simple")
    after = planner(noise, costs) if noise else None
    summary = {
        "steps": args.steps,
        "multiples": args.multiples,
        "orders": args.orders,
        "ranks": args.ranks,
        "bandwidth": args.bandwidth,
        "params": params,
        "global_batch": global_batch,
        "ranks_per_core": ranks_per_core,
        "settings": asdict(settings),
        "pick": asdict(pick),
        "planner": {"table": table, "worst_case": before, "builtin": builtin, "with_noise_scale": after},
        "run_wall_s": walls,
        "started": started_at,
        "finished": finished_at,
        "load_average_after": os.getloadavg(),
    }
    (out / RESULT_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_orders(out: Path, summary: dict[str, Any]) -> list[OrderResult]:
    loss_only = [
        json.loads(path.read_text())
        for where in summary.get("loss_runs", [])
        for path in sorted((out / where).glob("*.json"))
    ]
    results = []
    for order in summary["orders"]:
        records = {path.stem: json.loads(path.read_text()) for path in sorted((out / "records" / order).glob("*.json"))}
        results.append(analyse(order, records, int(summary["steps"]), loss_only))
    return results


def planner_views(summary: dict[str, Any]) -> dict[str, PlannerView]:
    """The planner's answers, named: its pick (r the worst case) on the table used, the same on the built-in table,
    and with the noise scale the pick's T-step run measured."""
    planner = summary["planner"]
    table = planner["table"]
    entries = {
        f"{table} table, r worst case": planner["worst_case"],
        "built-in table, r worst case": planner["builtin"] if table != "builtin" else None,
        f"{table} table, r from the measured noise scale": planner.get("with_noise_scale"),
        f"{table} table, r from the virtual world's simulation of this job": planner.get("with_job_evidence"),
    }
    return {name: planner_view(entry["answer"]) for name, entry in entries.items() if entry}


def report(out: Path, loss_runs: Sequence[Path] | None = None, job_evidence: Path | None = None) -> str:
    """The tables from ``out``; ``loss_runs`` (directories of the pick's records, saved in the summary for the next
    report): runs whose validation losses join the crossing, not the timing; ``job_evidence``: the virtual world's
    cells for this job, whose planner answer is saved in the summary (:func:`simulated_answer`)."""
    summary = json.loads((out / RESULT_NAME).read_text())
    if loss_runs is not None:
        summary["loss_runs"] = [os.path.relpath(path, out) for path in loss_runs]
    if job_evidence is not None:
        summary["planner"]["with_job_evidence"] = simulated_answer(summary, out, job_evidence)
    if loss_runs is not None or job_evidence is not None:
        (out / RESULT_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    results = load_orders(out, summary)
    pick_label = str(summary["pick"]["label"])
    compute = sum(r.modes[PICK].compute_per_step for r in results) / len(results)
    views = planner_views(summary)
    main_view = next(iter(views.values()))
    measured_r = results[0].modes[PICK].r
    if measured_r is not None:
        # Not a prediction: the planner's step times with the r measured here, to show which factor misses.
        name = f"{summary['planner']['table']} table, r measured here (diagnostic, not a prediction)"
        views[name] = replace(main_view, r=measured_r, r_low=None, r_high=None, r_basis="measured")
    lines = [
        f"{summary['params']:,}-parameter GPT, {summary['ranks']} ranks x 1 per node, {summary['bandwidth']} links "
        f"(netcluster), global batch {summary['global_batch']} sequences, cosine schedule fitted to each run's length; "
        f"T = {summary['steps']}, L* = exact fp32 Lion's validation loss after T "
        + ", ".join(f"{r.order} {r.target:.4f}" for r in results)
        + f". Runs {summary['started']} to {summary['finished']}.",
        "",
        *table_lines(results, pick_label),
        "",
        "*: the pick is already below L* at its shortest run; L* on the line through its two shortest runs. "
        "†: a run of another session (" + ", ".join(summary.get("loss_runs", [])) + "): its loss joins the "
        "crossing, its step time does not.",
        "",
        *prediction_lines(results, views, compute),
        "",
        *target_lines(results),
        "",
        "The planner's parts against the measured ones (ms per step; "
        f"{next(iter(planner_views(summary)))}; measured comm + optimizer = step - forward - backward):",
        "",
        *parts_lines(results, main_view),
    ]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.report_only:
        run_all(args)
    print(report(args.out_dir, args.loss_runs, args.job_evidence))
    return 0


if __name__ == "__main__":
    sys.exit(main())

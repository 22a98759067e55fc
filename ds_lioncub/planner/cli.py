"""The planner's command line.

::

    python -m ds_lioncub.planner --params N --nodes M --gpus-per-node G --inter-node-bandwidth RATE
           [--device cpu|cuda] [--gpu NAME | --device-bandwidth RATE]
           [--intra-node-bandwidth RATE] [--latency T] [--json] [--local-costs FILE]
           [--ring-efficiency E] [--all-to-all-efficiency E] [--ranks-per-core R] [--beta2 B]
           [--global-batch SAMPLES [--noise-scale SAMPLES]] [--compute-per-step SECONDS]
           [--zero-stage 0|2|3] [--clip MAX_NORM] [--clip-rule mean|deepspeed]
    python -m ds_lioncub.planner --calibrate [--device cpu|cuda] [--save FILE]

The default output is a table of every feasible candidate, first to exact Lion's loss first: its step time, its
bits per element, r (the steps it needs to reach exact Lion's loss, in units of exact Lion's, with its 95%
interval), the time to that loss (step x r) and the convergence study's gap to Lion's loss after its steps
at the mode's worker count and ``--beta2`` (:mod:`ds_lioncub.planner.convergence`), then the recommended one,
the faster-per-step ones it was chosen over (one line each, with why), and its ds_config blocks. r
(:mod:`ds_lioncub.planner.time_to_loss`) comes from the share of the batch the mode is worth (kappa, from the
study) and the job's batch over its noise scale, ``--global-batch`` and ``--noise-scale`` (samples; LionCub
measures B_simple as it trains); without the noise scale, the worst case, 1/kappa, which the output says. The time
to the loss counts the job's forward and backward passes per step, ``--compute-per-step`` (a mode needing r times
exact Lion's steps pays them r times; without it, communication and the optimizer only). A mode is passed over only
for one that reaches the loss sooner, never for its gap alone.

``--json`` prints ``{"recommended": {"params", "zero_stage", "r", "r_low", "r_high", "r_basis",
"seconds_to_lions_loss", "seconds_to_lions_loss_low", "seconds_to_lions_loss_high", "why"}, "local_costs":
{"device", "measured_on"}, "time_to_loss": {"global_batch", "noise_scale", "compute_per_step", "basis", "evidence",
"notes"},
"candidates": [{"params", "zero_stage", "seconds_per_step", "bytes_per_step_per_rank", "bits_per_element",
the r fields, "gap_percent", "half_width_percent", "seeds"}, ...]}``, plus ``"passed_over": [{"params",
"zero_stage", "gap_percent", "half_width_percent", "seeds", the r fields, "why"}, ...]`` when faster candidates
were passed over (they reach exact Lion's loss later), and ``"uncertain_loss": {"gap_percent",
"half_width_percent", "seeds", "why"}`` in ``"recommended"`` when the study cannot tell whether the recommended
mode's gap is within 2% (``half_width_percent``: the interval's half-width in points of %, null with one seed;
an r unknown is null). The candidates are in step order, fastest first. Bad arguments exit with status 2 and
argparse's message. Nothing but the output goes to stdout (DeepSpeed's import-time messages go to stderr:
:mod:`ds_lioncub._deepspeed_import`).

The candidates are those of ZeRO stages 0 and 2 (stage 2 with more than one node); ``--zero-stage S``
lists one stage's alone, for a job whose stage is fixed: 0, 2, or 3 (exact Lion under ZeRO-3 over the
world, and the ZeRO-3 hybrid with more than one node; :mod:`ds_lioncub.planner.zero3`). Every compressed candidate
clips the ranks' mean gradient by its sketched norm at ``--clip MAX_NORM`` (default 1.0, DeepSpeed's default
gradient_clipping, at which LionCub clips by default under DeepSpeed; 0: no clipping; docs/design.md, section
17.5): priced with its sketch, judged by the study's cells of the mode with clip, and its ds_config blocks write
``"clip": {"max_norm": ...}`` and ``"gradient_clipping": 0``. ``--clip-rule deepspeed`` plans DeepSpeed's own
rule instead (``"clip": {"rule": "deepspeed"}``), judged by the cells without clip.

The device (:mod:`ds_lioncub.planner.devices`) picks the local cost table and the link efficiencies
(the fraction of the link rate each kind of collective reaches,
:class:`~ds_lioncub.planner.model.LinkEfficiency`): CPU ranks the built-in measured table and gloo's
efficiencies on the emulated network; CUDA ranks a table derived from each pass's bytes over the
GPU's memory bandwidth and NCCL's (1 on both). It defaults to what ``compression="auto"`` would run on
here (CUDA where torch sees a CUDA device), to CUDA when a GPU or its bandwidth is given, and to the
device of a ``--local-costs`` table. The table says which it used.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.arguments import (
    MAX_PARAMS,
    ZERO_STAGES,
    argument,
    beta,
    fraction,
    nodes_count,
    non_negative_number,
    params_count,
    positive_number,
    ranks_count,
    samples,
    threads_count,
)
from ds_lioncub.planner.convergence import (
    SHIPPED_STUDY,
    choose,
    load_evidence,
    read_evidence,
)
from ds_lioncub.planner.devices import (
    DEFAULT_GPU,
    DEVICES,
    GPU_MEMORY_BANDWIDTH,
    NCCL_LINK_EFFICIENCY,
    Device,
    link_efficiency_for,
    local_costs_for,
    this_machines_device,
)
from ds_lioncub.planner.evidence import StudyCell, with_job_cells
from ds_lioncub.planner.local_costs import LocalCosts
from ds_lioncub.planner.model import (
    DEFAULT_LATENCY,
    GLOO_LINK_EFFICIENCY,
    Cluster,
    LinkEfficiency,
    Network,
    plan,
)
from ds_lioncub.planner.output import as_json, as_table
from ds_lioncub.planner.time_to_loss import JobBatch
from ds_lioncub.quantities.units import parse_duration, parse_rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ds_lioncub.planner",
        description="Predict which LionCub mode reaches exact Lion's loss first on a cluster: each mode's step time "
        "(an alpha-beta model of its collectives plus measured local costs) x r, the steps it needs in units of "
        "exact Lion's (the convergence study's batch share and the job's noise scale), and print the ds_config to use.",
    )
    parser.add_argument(
        "--params",
        type=argument(params_count),
        metavar="N",
        help=f"parameters in the model (e.g. 1.5e9; at most {MAX_PARAMS:,})",
    )
    parser.add_argument("--nodes", type=argument(nodes_count), metavar="M", help="machines, M")
    parser.add_argument("--gpus-per-node", type=argument(ranks_count), metavar="G", help="ranks per machine, G")
    parser.add_argument(
        "--inter-node-bandwidth",
        type=argument(parse_rate),
        metavar="RATE",
        help="each machine's link to the network, e.g. 1gbit, 100gbit, 10GB/s",
    )
    parser.add_argument(
        "--intra-node-bandwidth",
        type=argument(parse_rate),
        metavar="RATE",
        help="between two ranks of one machine (default: no bottleneck, e.g. NVLink beside Ethernet)",
    )
    parser.add_argument(
        "--latency",
        type=argument(parse_duration),
        default=DEFAULT_LATENCY,
        metavar="T",
        help=f"per message round, e.g. 5us, 50us, 1ms (default {DEFAULT_LATENCY * 1e6:g}us)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="the ranks' device: its local cost table and its transport's link efficiencies (cpu: the built-in "
        "measured table and gloo's; cuda: a table derived from the GPU's memory bandwidth and NCCL's). Default: "
        "cuda with --gpu or --device-bandwidth, else that of --local-costs, else what compression='auto' runs on "
        "here (cuda where torch sees a CUDA device)",
    )
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"with --device cuda: the GPU whose memory bandwidth prices the local work, one of "
        f"{', '.join(GPU_MEMORY_BANDWIDTH)} (default {DEFAULT_GPU})",
    )
    gpu.add_argument(
        "--device-bandwidth",
        type=argument(parse_rate),
        metavar="RATE",
        help="with --device cuda: the GPU's memory bandwidth instead of a named GPU's, e.g. 3.35TB/s",
    )
    parser.add_argument(
        "--ring-efficiency",
        type=argument(fraction),
        metavar="E",
        help="fraction of the link rate ring all-reduces and all-gathers reach "
        f"(default: gloo's {GLOO_LINK_EFFICIENCY.ring:g} for cpu, NCCL's {NCCL_LINK_EFFICIENCY.ring:g} for cuda)",
    )
    parser.add_argument(
        "--all-to-all-efficiency",
        type=argument(fraction),
        metavar="E",
        help="fraction of the link rate all-to-alls reach (default: gloo's "
        f"{GLOO_LINK_EFFICIENCY.all_to_all:g} for cpu, NCCL's {NCCL_LINK_EFFICIENCY.all_to_all:g} for cuda)",
    )
    parser.add_argument(
        "--ranks-per-core",
        type=argument(positive_number),
        default=1.0,
        metavar="R",
        help="CPU ranks sharing each core of a machine (e.g. 2 for 4 ranks on 2 cores): the local cost table, "
        "one rank's alone on a core, is multiplied by R when above 1 (default 1)",
    )
    parser.add_argument(
        "--beta2",
        type=argument(beta),
        default=0.99,
        metavar="B",
        help="Lion's beta2, for the convergence study's verdict on each mode (default 0.99, LionCub's)",
    )
    parser.add_argument(
        "--global-batch",
        type=argument(samples),
        metavar="SAMPLES",
        help="the job's global batch per optimizer step, in samples (micro-batch x accumulation x data-parallel "
        "ranks): with --noise-scale, r from the model at B/B_noise",
    )
    parser.add_argument(
        "--noise-scale",
        type=argument(samples),
        metavar="SAMPLES",
        help="the job's gradient noise scale B_simple in samples, as LionCub reports it (LionCub.noise_scale, the "
        "monitor's LionCub/noise_scale); needs --global-batch. Without it r is the worst case, 1/kappa",
    )
    parser.add_argument(
        "--compute-per-step",
        type=argument(parse_duration),
        default=0.0,
        metavar="SECONDS",
        help="the job's forward and backward passes per optimizer step (e.g. 280ms), the same in every mode: a mode "
        "that needs r times exact Lion's steps pays them r times, so the time to exact Lion's loss counts them "
        "(default 0: communication and optimizer only)",
    )
    parser.add_argument(
        "--convergence-evidence",
        metavar="FILE",
        help="a convergence study summary (python -m benchmarks.study_convergence --evidence writes one; default: "
        "the study shipped with ds_lioncub, the example GPT at 4-64 workers)",
    )
    parser.add_argument(
        "--job-evidence",
        metavar="FILE",
        help="cells measured on your own task (python -m ds_lioncub.simulate ... --time-to-loss 1.25 1.5 "
        "--evidence-out FILE): they take the place of the study's cells of the same mode, worker count and beta2",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=ZERO_STAGES,
        metavar="S",
        help="only the candidates of ZeRO stage S, for a job whose stage is fixed: 0, 2 or 3 (3: exact Lion under "
        "ZeRO-3 and the ZeRO-3 hybrid; default: stages 0 and 2)",
    )
    parser.add_argument(
        "--clip",
        type=argument(non_negative_number),
        default=1.0,
        metavar="MAX_NORM",
        help="the max_norm every compressed mode clips the ranks' mean gradient at, by its sketched norm, as LionCub "
        "does by default under DeepSpeed (at gradient_clipping): priced with its sketch and judged by the study's "
        "cells with clip (default 1.0, DeepSpeed's gradient_clipping default; 0: no clipping)",
    )
    parser.add_argument(
        "--clip-rule",
        choices=("mean", "deepspeed"),
        default="mean",
        help='\'deepspeed\': plan the compressed modes with DeepSpeed\'s own clipping rule ("clip": {"rule": '
        '"deepspeed"}, the default before 0.2.0), judged by the study\'s cells without clip (default: mean)',
    )
    parser.add_argument("--json", action="store_true", help="print the recommendation and candidates as JSON")
    parser.add_argument(
        "--local-costs", metavar="FILE", help="a local cost table saved by --calibrate --save (default: the built-in)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's local cost table and print it (on the CUDA device where there is one, "
        "unless --device cpu)",
    )
    parser.add_argument("--save", metavar="FILE", help="with --calibrate: write the table there as JSON")
    parser.add_argument(
        "--threads",
        type=argument(threads_count),
        metavar="N",
        help="with --calibrate: torch threads per rank (default: torch's)",
    )
    return parser


def _device(args: argparse.Namespace, parser: argparse.ArgumentParser, file_costs: LocalCosts | None) -> Device:
    """``--device``, else cuda for a GPU or its bandwidth, else the ``--local-costs`` table's, else this machine's."""
    if args.device is not None:
        device: Device = args.device
    elif args.gpu is not None or args.device_bandwidth is not None:
        device = "cuda"
    elif file_costs is not None:
        device = "cuda" if file_costs.device == "cuda" else "cpu"
    else:
        device = this_machines_device()
    if file_costs is not None and file_costs.device != device:
        parser.error(f"--local-costs {args.local_costs} is a {file_costs.device} table, but --device is {device}")
    if file_costs is not None and (args.gpu is not None or args.device_bandwidth is not None):
        parser.error("--gpu and --device-bandwidth derive a table; --local-costs gives one: use one or the other")
    if device == "cuda" and args.ranks_per_core != 1.0:
        parser.error("--ranks-per-core counts CPU ranks taking turns on a core; it does not apply to --device cuda")
    return device


def _calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ds_lioncub.planner.calibrate import as_python_table, measure_local_costs

    device = args.device or this_machines_device()
    try:
        costs = measure_local_costs(threads=args.threads, device=device)
    except LionCubConfigError as error:
        parser.error(str(error).removeprefix("LionCub: "))
    if args.save:
        with open(args.save, "w") as file:
            file.write(costs.to_json() + "\n")
    threads = "" if args.threads is None else f" --threads {args.threads}"
    command = f"python -m ds_lioncub.planner --calibrate --device {device}{threads}"
    print(as_python_table(costs, command))
    return 0


def _stages(args: argparse.Namespace) -> dict[str, Any]:
    """``plan``'s stage arguments: stages 0 and 2 by default; one fixed stage with ``--zero-stage``."""
    if args.zero_stage is None:
        return {}
    # A job fixed at a ZeRO stage runs the hybrid even with one rank per node (as compression="auto" plans).
    return {"zero_stages": (args.zero_stage,), "hybrid_with_one_rank_per_node": args.zero_stage != 0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Options of --calibrate given without it would be ignored: the run would exit 0 and, for --save, write nothing.
    ignored = [flag for flag, value in (("--save", args.save), ("--threads", args.threads)) if value is not None]
    if ignored and not args.calibrate:
        flags = " and ".join(ignored)
        verb = "apply" if len(ignored) > 1 else "applies"
        parser.error(f"{flags} only {verb} with --calibrate (measuring this machine): add --calibrate, or drop {flags}")
    if args.calibrate:
        return _calibrate(args, parser)
    missing = [
        flag
        for flag, value in (
            ("--params", args.params),
            ("--nodes", args.nodes),
            ("--gpus-per-node", args.gpus_per_node),
            ("--inter-node-bandwidth", args.inter_node_bandwidth),
        )
        if value is None
    ]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    file_costs = None
    try:
        file_costs = None if args.local_costs is None else LocalCosts.load(args.local_costs)
    except (OSError, ValueError) as error:
        parser.error(f"--local-costs: {error}")
    device = _device(args, parser, file_costs)
    try:
        costs = file_costs or local_costs_for(device, args.device_bandwidth, args.gpu)
    except LionCubConfigError as error:
        parser.error(str(error).removeprefix("LionCub: "))
    cluster = Cluster(args.nodes, args.gpus_per_node)
    default = link_efficiency_for(device)
    efficiency = LinkEfficiency(
        default.ring if args.ring_efficiency is None else args.ring_efficiency,
        default.all_to_all if args.all_to_all_efficiency is None else args.all_to_all_efficiency,
    )
    network = Network(args.inter_node_bandwidth, args.intra_node_bandwidth, args.latency, efficiency)
    clip: dict[str, Any] | None = {"max_norm": args.clip} if args.clip > 0 else None
    if args.clip_rule == "deepspeed":
        clip = {"rule": "deepspeed"}
    candidates = plan(
        args.params, cluster, network, costs, ranks_per_core=args.ranks_per_core, clip=clip, **_stages(args)
    )
    if not candidates:  # --zero-stage 2 on one node: the stage-2 candidates vote or shard across nodes
        parser.error(f"--zero-stage {args.zero_stage}: the planner's stage-2 candidates need more than one node")
    try:
        evidence = load_evidence() if args.convergence_evidence is None else read_evidence(args.convergence_evidence)
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--convergence-evidence: {error}")
    job_cells: tuple[StudyCell, ...] = ()
    if args.job_evidence is not None:
        try:
            job_cells = read_evidence(args.job_evidence)
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--job-evidence: {error}")
        evidence = with_job_cells(evidence, job_cells)
    if args.noise_scale is not None and args.global_batch is None:
        parser.error("--noise-scale needs --global-batch (r depends on the batch over the noise scale, B/B_noise)")
    study = (
        f"the convergence study shipped with ds_lioncub ({SHIPPED_STUDY})"
        if args.convergence_evidence is None
        else f"the convergence study in {args.convergence_evidence}"
    )
    if job_cells:
        measured = ", ".join(sorted({f"{cell.mode} at {cell.workers} workers" for cell in job_cells}))
        study += f", with your job's own cells from {args.job_evidence} ({measured})"
    job = JobBatch(args.global_batch, args.noise_scale, args.compute_per_step)
    choice = choose(candidates, cluster, args.beta2, evidence, job=job, study=study)
    if args.json:
        print(json.dumps(as_json(candidates, choice, costs), indent=2))
    else:
        print(as_table(candidates, args.params, cluster, network, choice, costs, args.local_costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

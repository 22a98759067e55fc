"""The planner's command line.

::

    python -m ds_lioncub.planner --params N --nodes M --gpus-per-node G --inter-node-bandwidth RATE
           [--device cpu|cuda] [--gpu NAME | --device-bandwidth RATE]
           [--intra-node-bandwidth RATE] [--latency T] [--json] [--local-costs FILE]
           [--ring-efficiency E] [--all-to-all-efficiency E] [--ranks-per-core R] [--beta2 B]
           [--zero-stage 0|2|3] [--clip MAX_NORM] [--clip-rule mean|deepspeed]
    python -m ds_lioncub.planner --calibrate [--device cpu|cuda] [--save FILE]

The default output is a table of every feasible candidate, fastest predicted step first, with what
the convergence study says of each at its worker count and ``--beta2``
(:mod:`ds_lioncub.planner.convergence`: the gap to Lion's loss and its 95% Student-t interval), and
the ds_config blocks of the recommended one: the fastest that the study does not show losing more
than 2% of Lion's loss (the interval above 2%; a faster one that does is named, with its gap), with
its interval beside it where that reaches 2%. ``--json`` prints ``{"recommended": {"params",
"zero_stage"}, "local_costs": {"device", "measured_on"}, "candidates": [{"params", "zero_stage",
"seconds_per_step", "bytes_per_step_per_rank"}, ...]}``, plus ``"passed_over": [{"params",
"zero_stage", "gap_percent", "half_width_percent", "seeds", "why"}, ...]`` when faster candidates
were passed over, and ``"uncertain_loss": {"gap_percent", "half_width_percent", "seeds", "why"}`` in
``"recommended"`` when the study cannot tell whether the recommended mode keeps within 2%
(``half_width_percent``: the interval's half-width in points of %, null with one seed). Bad
arguments exit with status 2 and argparse's message.

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
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.convergence import (
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
from ds_lioncub.units import parse_duration, parse_rate


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises LionCubConfigError (argparse then prints the message)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except LionCubConfigError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("LionCub: ")) from None

    convert.__name__ = parse.__name__
    return convert


# Upper bounds of the counts. Planning time grows with the model's buckets (about 20 s for 1e12 parameters on a
# 2-core machine, and the bucket list no longer fits in memory near 1e20), and a count beyond any machine is a typo.
MAX_PARAMS = 10**13
MAX_NODES = 10**6
MAX_RANKS_PER_NODE = 10**4
MAX_THREADS = 10**4
#: What ``--zero-stage`` takes (stage 1 communicates as stage 2 does: the stage-2 candidates cover it).
ZERO_STAGES = (0, 2, 3)


def _as_float(text: str, hint: str = "") -> float:
    """``text`` as a float, or the planner's "is not a number" error with ``hint`` (e.g. " (write 0.9)")."""
    try:
        return float(text)
    except ValueError:
        raise LionCubConfigError(f"LionCub: {text!r} is not a number{hint}") from None


def _count(limit: int, example: str) -> Callable[[str], int]:
    """A parser of a whole number in [1, ``limit``], written as an integer or as a float such as 1.5e9."""

    def count(text: str) -> int:
        value = _as_float(text, f" (write {example})")
        # Checked before int(): int(inf) raises OverflowError and int(nan) a ValueError argparse would report
        # under this function's name.
        if not math.isfinite(value) or value < 1 or value != int(value):
            raise LionCubConfigError(f"LionCub: {text!r} must be a whole number >= 1 (write {example})")
        if value > limit:
            raise LionCubConfigError(f"LionCub: {text!r} is more than the planner takes: at most {limit:,}")
        return int(value)

    return count


_params_count = _count(MAX_PARAMS, "1500000000 or 1.5e9")
_nodes_count = _count(MAX_NODES, "e.g. 4")
_ranks_count = _count(MAX_RANKS_PER_NODE, "e.g. 8")
_threads_count = _count(MAX_THREADS, "e.g. 4")


def _fraction(text: str) -> float:
    value = _as_float(text, " (write a fraction such as 0.9)")
    if not 0 < value <= 1:
        raise LionCubConfigError(f"LionCub: {text!r} must be a fraction of the link rate in (0, 1]")
    return value


def _beta(text: str) -> float:
    value = _as_float(text, " (write beta2 as e.g. 0.99)")
    if not 0 <= value < 1:
        raise LionCubConfigError(f"LionCub: beta2 {text!r} must be in [0, 1), e.g. 0.95 or 0.99")
    return value


def _non_negative_number(text: str) -> float:
    value = _as_float(text)
    if not (value >= 0 and value != float("inf")):
        raise LionCubConfigError(f"LionCub: {text!r} must be a number >= 0")
    return value


def _positive_number(text: str) -> float:
    value = _as_float(text)
    if not (value > 0 and value != float("inf")):
        raise LionCubConfigError(f"LionCub: {text!r} must be a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ds_lioncub.planner",
        description="Predict which LionCub mode gives the fastest step on a cluster (an alpha-beta model of every "
        "mode's collectives plus measured local costs), and print the ds_config to use.",
    )
    parser.add_argument(
        "--params",
        type=_argument(_params_count),
        metavar="N",
        help=f"parameters in the model (e.g. 1.5e9; at most {MAX_PARAMS:,})",
    )
    parser.add_argument("--nodes", type=_argument(_nodes_count), metavar="M", help="machines, M")
    parser.add_argument("--gpus-per-node", type=_argument(_ranks_count), metavar="G", help="ranks per machine, G")
    parser.add_argument(
        "--inter-node-bandwidth",
        type=_argument(parse_rate),
        metavar="RATE",
        help="each machine's link to the network, e.g. 1gbit, 100gbit, 10GB/s",
    )
    parser.add_argument(
        "--intra-node-bandwidth",
        type=_argument(parse_rate),
        metavar="RATE",
        help="between two ranks of one machine (default: no bottleneck, e.g. NVLink beside Ethernet)",
    )
    parser.add_argument(
        "--latency",
        type=_argument(parse_duration),
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
        type=_argument(parse_rate),
        metavar="RATE",
        help="with --device cuda: the GPU's memory bandwidth instead of a named GPU's, e.g. 3.35TB/s",
    )
    parser.add_argument(
        "--ring-efficiency",
        type=_argument(_fraction),
        metavar="E",
        help="fraction of the link rate ring all-reduces and all-gathers reach "
        f"(default: gloo's {GLOO_LINK_EFFICIENCY.ring:g} for cpu, NCCL's {NCCL_LINK_EFFICIENCY.ring:g} for cuda)",
    )
    parser.add_argument(
        "--all-to-all-efficiency",
        type=_argument(_fraction),
        metavar="E",
        help="fraction of the link rate all-to-alls reach (default: gloo's "
        f"{GLOO_LINK_EFFICIENCY.all_to_all:g} for cpu, NCCL's {NCCL_LINK_EFFICIENCY.all_to_all:g} for cuda)",
    )
    parser.add_argument(
        "--ranks-per-core",
        type=_argument(_positive_number),
        default=1.0,
        metavar="R",
        help="CPU ranks sharing each core of a machine (e.g. 2 for 4 ranks on 2 cores): the local cost table, "
        "one rank's alone on a core, is multiplied by R when above 1 (default 1)",
    )
    parser.add_argument(
        "--beta2",
        type=_argument(_beta),
        default=0.99,
        metavar="B",
        help="Lion's beta2, for the convergence study's verdict on each mode (default 0.99, LionCub's)",
    )
    parser.add_argument(
        "--convergence-evidence",
        metavar="FILE",
        help="a convergence study summary (python -m benchmarks.study_convergence --evidence writes one; default: "
        "the study shipped with ds_lioncub, the example GPT at 4-64 workers)",
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
        type=_argument(_non_negative_number),
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
        type=_argument(_threads_count),
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
    choice = choose(candidates, cluster, args.beta2, evidence)
    if args.json:
        print(json.dumps(as_json(candidates, choice, costs), indent=2))
    else:
        print(as_table(candidates, args.params, cluster, network, choice, costs, args.local_costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

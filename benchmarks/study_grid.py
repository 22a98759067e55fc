"""The convergence study's grid: what one run of benchmarks/study_convergence.py is, and where its JSON lives.

A run (:class:`Run`) is one cell of the grid (worker count, mode, beta2) and one seed, trained in one design
(:data:`DESIGNS`: lr, clipping, global batch) with LionCub's options for its mode (:func:`mode_options`);
its JSON is ``<results root>/gpt-<task>_<steps>steps[_<design>]/<run name>.json`` (:func:`config_dir`,
:meth:`Run.path`), under :data:`RESULTS` (the pinned corpus) or, for the first study, :data:`STDLIB_RESULTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_lioncub.simulate.train import ClipRule

#: Runs on the pinned corpus (DeepSpeed 0.19.8's sources: the same bytes on every machine and Python).
RESULTS = Path(__file__).resolve().parent / "results" / "convergence_pinned"
#: The first study's runs, on the running Python's standard library (3.11 here); the shipped
#: convergence evidence was computed from them.
STDLIB_RESULTS = Path(__file__).resolve().parent / "results" / "convergence_study"
#: Validation windows of the wide validation loss each run also records (``val_loss_wide``): 2,048 windows of
#: 64 bytes, a third of the validation split, against the task's 320.
WIDE_EVAL_WINDOWS = 2048
WORKERS = (4, 8, 16, 32, 64)
BETA2 = (0.95, 0.99)
SEEDS = (0, 1, 2)
#: The largest world a 4-bit sign all-reduce holds (fields sum to at most 2**4 - 1).
KBIT4_SIGN_ALLREDUCE_MAX = 15


def mode_options(mode: str, workers: int) -> dict[str, Any]:
    """LionCub's options for a mode of the study at ``workers`` workers."""
    if mode.endswith(SKETCH_CLIP_SUFFIX):  # LionCub's option clip in place of DeepSpeed's rule (the run's grad_clip)
        return {**mode_options(mode.removesuffix(SKETCH_CLIP_SUFFIX), workers), "clip": {"max_norm": 1.0}}
    if mode == "exact":
        return {"compression": "none"}
    if mode == "1bit":
        return {"compression": "1bit"}
    if mode == "1bit_sync":  # the paper's recipe: embedding and head momentum averaged every 10 steps
        return {"compression": "1bit", "momentum_sync": {"interval": 10, "layers": "auto"}}
    if mode == "4bit_sign":  # the all-reduce where it holds the workers, else all-to-all
        algorithm = "allreduce" if workers <= KBIT4_SIGN_ALLREDUCE_MAX else "alltoall"
        return {"compression": "kbit", "bits": 4, "quantizer": "sign", "kbit_algorithm": algorithm}
    if mode == "2bit_l1_a2a":
        return {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"}
    if mode == "4bit_l1_a2a":
        return {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"}
    for base in ("2bit_l1_a2a", "4bit_l1_a2a"):  # the two error-feedback forms on the k-bit L1 all-to-all
        if mode == f"{base}_ef_residual":
            return {**mode_options(base, workers), "error_feedback": {"kind": "residual", "feed_back": "all"}}
        if mode == f"{base}_ef_residual_bf16":  # what storing the residual in bf16 costs
            return {
                **mode_options(base, workers),
                "error_feedback": {"kind": "residual", "storage": "bf16", "feed_back": "all"},
            }
        if mode == f"{base}_ef_residual_rounding":  # only the rounding error fed back, not what is clipped
            return {**mode_options(base, workers), "error_feedback": {"kind": "residual", "feed_back": "rounding"}}
        if mode == f"{base}_ef21":
            return {**mode_options(base, workers), "error_feedback": {"kind": "ef21"}}
    if mode.startswith("1bit_syncall"):  # every layer's momentum averaged in bf16 every K steps: 1 + 32/K bits
        interval = int(mode.removeprefix("1bit_syncall"))
        return {"compression": "1bit", "momentum_sync": {"interval": interval, "layers": "all", "dtype": "bf16"}}
    if mode == "8bit_l1":
        return {"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "allreduce"}
    if mode == "8bit_l1_a2a":  # its levels stay 127 at any count (the all-reduce's shrink with the workers)
        return {"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "alltoall"}
    if mode == "8bit_l1_a2a_clip8":  # the same, saturating at 8 x mean |c| instead of 2 x: less of the tails cut
        return {**mode_options("8bit_l1_a2a", workers), "l1_clip": 8.0}
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


#: A mode with this suffix clips with LionCub's option ``clip`` (the mean gradient's sketched norm, max_norm 1.0)
#: instead of DeepSpeed's rule; its runs train with the design's grad_clip off (:func:`clip_of_run`).
SKETCH_CLIP_SUFFIX = "_sketchclip"


#: The clipping rule of the study's runs: DeepSpeed's (the default before 0.2.0), named so that the runs stay
#: reproducible now that the default clips the mean gradient; a ``_sketchclip`` mode clips by option clip instead.
STUDY_CLIP_RULE: ClipRule = "deepspeed"


def clip_of_run(options: dict[str, Any], design_clip: float) -> float:
    """The grad_clip a run trains with: 0 where LionCub's option ``clip`` clips, else the design's (DeepSpeed's rule).

    A design with its clipping off keeps it off: a ``_sketchclip`` mode is measured only in designs that clip at 1.0.
    """
    if "clip" in options:
        if design_clip != options["clip"]["max_norm"]:
            clip = options["clip"]["max_norm"]
            raise ValueError(f"a {SKETCH_CLIP_SUFFIX} mode clips at {clip}; the design at {design_clip}")
        return 0.0
    return design_clip


MODES = ("exact", "1bit", "1bit_sync", "4bit_sign", "2bit_l1_a2a", "4bit_l1_a2a", "8bit_l1")
#: The 1-bit vote with every layer's momentum averaged (bf16) every 32 or 128 steps (not in the default grid).
SYNC_ALL_MODES = ("1bit_syncall32", "1bit_syncall128")
#: 8-bit L1 all-to-all, the planner's pick where every other compressed mode loses (not in the default grid).
EXTRA_MODES = (
    "8bit_l1_a2a",
    "8bit_l1_a2a_clip8",
    "1bit_sketchclip",
    "1bit_syncall128_sketchclip",
    "4bit_l1_a2a_sketchclip",
    "8bit_l1_a2a_sketchclip",
)
#: The error-feedback variants (not in the default grid: run them with ``--modes``).
EF_MODES = ("2bit_l1_a2a_ef_residual", "2bit_l1_a2a_ef21", "4bit_l1_a2a_ef_residual", "4bit_l1_a2a_ef21")
#: The residual form with its residual stored in bf16 (against the fp32 default above).
EF_STORAGE_MODES = ("2bit_l1_a2a_ef_residual_bf16", "4bit_l1_a2a_ef_residual_bf16")
#: The residual form feeding back only the rounding error (``feed_back: "rounding"``).
EF_ROUNDING_MODES = ("2bit_l1_a2a_ef_residual_rounding", "4bit_l1_a2a_ef_residual_rounding")


@dataclass(frozen=True)
class Design:
    """The training regime of a study's runs: what the pilot varies to find the calmest instrument.

    Fields:
        lr: the schedule's peak (WarmupCosineLR, 10 warmup steps, ratios 0.1).
        grad_clip: the global gradient norm clip (DeepSpeed's fp32 rule); 0 disables it.
        global_batch: windows of 64 bytes per step, split over the workers (a multiple of 64 keeps
            every worker count of the grid dividing it).
    """

    lr: float = 1e-3
    grad_clip: float = 1.0
    global_batch: int = 64

    def settings(self) -> str:
        clip = f"clip {self.grad_clip} (deepspeed rule)" if self.grad_clip > 0 else "no clipping"
        return (
            f"lr {self.lr:g} WarmupCosineLR (10 warmup, ratios 0.1), beta1 0.9, wd 0.1, {clip}, "
            f"global batch {self.global_batch} x 64 bytes"
        )


#: The designs by name. ``base`` is the examples' settings (the first study's); the others change one thing.
DESIGNS: dict[str, Design] = {
    "base": Design(),
    "lr5e-4": Design(lr=5e-4),
    "noclip": Design(grad_clip=0.0),
    "batch128": Design(global_batch=128),
    # The calm design with 4 windows per voter at 64 voters: does the gap follow the voters or their batch?
    "lr5e-4_batch256": Design(lr=5e-4, global_batch=256),
    # Exact Lion on 2/pi of the calm design's batch (40 of 64 windows): a majority vote of N Gaussian signs
    # decides like a mean of 2N/pi of them, so if the vote's gap is that lost efficiency, this is its size.
    "lr5e-4_batch40": Design(lr=5e-4, global_batch=40),
    # ... and on 7/8 of it: about what 2 bits per element keep of a Gaussian mean (the optimal 4-level
    # quantizer's efficiency, 0.88), so the loss of a batch between 1 bit's share and all of it.
    "lr5e-4_batch56": Design(lr=5e-4, global_batch=56),
    # The calm design at a quarter of its batch (1 window per voter at 16 voters): with lr5e-4 and lr5e-4_batch256,
    # the batch against the noise scale over 1.0 decade, to test the model of steps to a loss.
    "lr5e-4_batch16": Design(lr=5e-4, global_batch=16),
    # ... and at 16 times it (64 windows per voter at 16 voters): with lr5e-4_batch16, B / B_noise over 1.6 decades.
    "lr5e-4_batch1024": Design(lr=5e-4, global_batch=1024),
}


@dataclass(frozen=True)
class Run:
    """One cell and seed of the grid.

    Fields:
        task: "small" or "large" (examples.simulate_gpt).
        steps: optimizer steps.
        workers, mode, beta2, seed: the cell and seed.
        design: a key of :data:`DESIGNS`.
    """

    task: str
    steps: int
    workers: int
    mode: str
    beta2: float
    seed: int
    design: str = "base"

    @property
    def name(self) -> str:
        return f"N{self.workers:02d}_{self.mode}_b2-{self.beta2}_seed{self.seed}"

    def path(self, root: Path) -> Path:
        return config_dir(root, self.task, self.steps, self.design) / f"{self.name}.json"

    def options(self) -> dict[str, Any]:
        lr = DESIGNS[self.design].lr
        return {"lr": lr, "betas": (0.9, self.beta2), "weight_decay": 0.1, **mode_options(self.mode, self.workers)}


def config_dir(root: Path, task: str, steps: int, design: str = "base") -> Path:
    """``gpt-<task>_<steps>steps``, with ``_<design>`` after it for a design other than ``base``."""
    return root / (f"gpt-{task}_{steps}steps" + ("" if design == "base" else f"_{design}"))

"""How far the same run moves between the CPU and a GPU: exact Lion's validation loss, per cell and seed.

    python -m benchmarks.ef_device_noise CPU_STUDY_DIR GPU_STUDY_DIR

Both directories hold run JSONs of benchmarks/study_convergence.py (the same task and steps). A run on
two devices starts from the same model and sees the same batches; only the devices' rounding differs,
and 300 chaotic steps turn that into a difference of validation loss. Its size is the noise that
comparing runs of one device with baselines of the other adds (benchmarks/gpu/ef_study.sh compares its
GPU error-feedback runs with the CPU grid's exact-Lion and no-EF runs).
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.study_report import load_runs
from ds_lioncub.simulate.train import gap_percent, seed_summary


def device_noise_table(cpu_dir: Path, gpu_dir: Path, mode: str = "exact") -> str:
    """Per (beta2, workers): the GPU run's val loss against the CPU run's of the same seed, in %."""
    cpu, gpu = load_runs(cpu_dir), load_runs(gpu_dir)
    lines = [
        "| beta2 | workers | mode | seeds | GPU vs CPU val, % per seed | mean ± 95% t half-width |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted(key for key in gpu if key[2] == mode):
        on_gpu, on_cpu = gpu[key], cpu.get(key, {})
        seeds = sorted(set(on_gpu) & set(on_cpu))
        if not seeds:
            continue
        gaps = [gap_percent(on_gpu[s]["val_loss"], on_cpu[s]["val_loss"]) for s in seeds]
        per_seed = ", ".join(f"{gap:+.2f}" for gap in gaps)
        beta2, workers, cell_mode = key
        summary = seed_summary(gaps).text(2)
        lines.append(f"| {beta2} | {workers} | {cell_mode} | {len(seeds)} | {per_seed} | {summary} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__)
        return 2
    print("## Device noise: exact Lion on the GPU against the same runs on the CPU\n")
    print(device_noise_table(Path(args[0]), Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

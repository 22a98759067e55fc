"""How far option clip's factor strays with few sketch bins: the measurement behind ``SKETCH_BINS_FLOOR``.

    python -m benchmarks.clip_bins_spread [--steps 200]

One fixed gradient the size of the example GPT (467,584 elements, uneven magnitudes), scaled so that its true
clipping factor at max_norm 1 is 0.196, sketched at each bin count with the signs of ``--steps`` steps (the sketch
draws new signs every step): the factor each step gives, as a ratio to the true factor (min, max, and twice the
standard deviation over the steps).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ds_lioncub.step.clipping import clip_coefficient, gradient_sketch

BIN_COUNTS = (1, 2, 16, 64, 128, 256, 512, 4093)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    n = 467_584
    gradient = torch.randn(n, generator=generator) * torch.rand(n, generator=generator).pow(3)
    gradient *= 5.1 / float(gradient.norm())
    truth = 1.0 / (float(gradient.norm()) + 1e-6)
    print("| bins | factor / true factor: min | max | 2 sigma |")
    print("|---|---|---|---|")
    for bins in BIN_COUNTS:
        ratios = [
            clip_coefficient(gradient_sketch([[gradient]], bins, step, 0), 1, 1.0) / truth
            for step in range(1, args.steps + 1)
        ]
        print(f"| {bins} | {min(ratios):.3f} | {max(ratios):.3f} | {2 * statistics.pstdev(ratios):.3f} |")


if __name__ == "__main__":
    main()

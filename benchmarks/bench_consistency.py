"""What the replica check (LionCub's ``consistency_check``) costs, next to a training step.

For the example GPT (``make train``'s model: 2 layers, d_model 128, sequence 64, batch 16) and the
12.9M-parameter GPT of bench_train (4 layers, d_model 512, sequence 32, batch 4), in one process:
the median time of a training step (forward, backward, a 1-bit LionCub step alone) and of the
check's local part (``parameter_checksums``: one integer read pass over the parameters). The check's
all-gather is 8 bytes per rank and not timed here. Overhead per step at interval K = checksum / (K x
step).

    python -m benchmarks.bench_consistency [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import median_seconds
from ds_lioncub import LionCub
from ds_lioncub.consistency.replica_check import parameter_checksums
from examples.gpt import GPT, GPTConfig

MODELS = {
    "example GPT": (GPTConfig(max_seq_len=64, n_layer=2, n_head=4, d_model=128), 16, 64),
    "12.9M GPT": (GPTConfig(max_seq_len=32, n_layer=4, n_head=8, d_model=512), 4, 32),
}
INTERVALS = (1, 10, 100)


def measure(config: GPTConfig, batch: int, seq_len: int, repeats: int) -> tuple[int, float, float]:
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = LionCub(model.named_parameters(), lr=1e-4, compression="1bit", consistency_check={"interval": 0})
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))

    def step() -> None:
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])[0]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    params = [p for p in model.parameters()]
    return (
        sum(p.numel() for p in params),
        median_seconds(step, repeats),
        median_seconds(lambda: parameter_checksums(params), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = (
        "| model | parameters | step ms | checksum ms | " + " | ".join(f"overhead at {k}" for k in INTERVALS) + " |"
    )
    print(header)
    print("|" + "---|" * (4 + len(INTERVALS)))
    for name, (config, batch, seq_len) in MODELS.items():
        numel, step_s, check_s = measure(config, batch, seq_len, args.repeats)
        overheads = " | ".join(f"{100 * check_s / (k * step_s):.3f}%" for k in INTERVALS)
        print(f"| {name} | {numel:,} | {1e3 * step_s:.1f} | {1e3 * check_s:.2f} | {overheads} |")


if __name__ == "__main__":
    main()

"""The example GPT as a task for the virtual world: ``python -m ds_lioncub.simulate``'s default.

    python -m ds_lioncub.simulate configs/lioncub_1bit.json --workers 8 16 32      # this task by default
    python -m ds_lioncub.simulate configs/lioncub_1bit.json --task ds_lioncub.simulate.tasks:large_gpt

Byte-level language modelling on the pinned DeepSpeed sources
(:mod:`ds_lioncub.simulate.tasks.corpus`): each step's global batch is 64 windows of 64 bytes, drawn at
random from the training split by a generator seeded with (seed, step) alone, so every worker count and
every mode sees the same bytes; validation is 320 evenly spaced windows of the validation split, the
same set for every run (as examples/train_gpt.py scores it).

Two configurations, by name (:data:`CONFIGS`): ``"small"``, the README's 467,584-parameter GPT (2
layers, d_model 128), and ``"large"`` (4 layers, d_model 192, 1.87 M parameters, about 3x the
small one's forward and backward). ``examples/simulate_gpt.py`` re-exports this module, so
``--task examples.simulate_gpt:small_gpt`` names the same task in a checkout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ds_lioncub.simulate.tasks.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus
from ds_lioncub.simulate.tasks.gpt import GPT, GPTConfig

CONFIGS: dict[str, GPTConfig] = {
    "small": GPTConfig(max_seq_len=64, n_layer=2, n_head=4, d_model=128),
    "large": GPTConfig(max_seq_len=64, n_layer=4, n_head=4, d_model=192),
}


@functools.lru_cache(maxsize=4)
def _corpus(max_bytes: int) -> Corpus:
    # Read once per process: every run of a study in this process shares it.
    return load_corpus(None, max_bytes=max_bytes)


@dataclass
class GPTTask:
    """The example GPT on the pinned corpus; a :class:`ds_lioncub.simulate.train.Task`.

    Fields:
        name: the label in tables and result files.
        config: the model.
        global_batch_size: windows per step (split over the workers).
        seq_len: bytes per window.
        eval_windows: validation windows (evenly spaced over the validation split).
        corpus_bytes: the corpus cap (the corpus module's default: 4 MB).
        eval_batch: windows per validation forward pass.
    """

    name: str = "gpt-small"
    config: GPTConfig = field(default_factory=lambda: CONFIGS["small"])
    global_batch_size: int = 64
    seq_len: int = 64
    eval_windows: int = 320
    corpus_bytes: int = DEFAULT_MAX_BYTES
    eval_batch: int = 64

    def corpus(self) -> Corpus:
        """The bytes this task trains and validates on (read once per process)."""
        return _corpus(self.corpus_bytes)

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.config)

    def batch(self, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.corpus().train
        # A generator per (seed, step): step t's batch does not depend on what ran before it.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.global_batch_size,), generator=gen)
        windows = data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        _, loss = model(batch[0], batch[1])
        assert loss is not None
        return loss

    @torch.no_grad()
    def validation_loss(self, model: nn.Module) -> float:
        val = self.corpus().val
        starts = torch.linspace(0, len(val) - self.seq_len - 1, self.eval_windows).long()
        offsets = torch.arange(self.seq_len + 1)
        total = 0.0
        device = next(model.parameters()).device
        for chunk in starts.split(self.eval_batch):
            windows = val[chunk[:, None] + offsets].long().to(device)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            assert loss is not None
            total += float(loss) * len(chunk)  # the mean over windows, whatever the chunking
        return total / self.eval_windows


def small_gpt() -> GPTTask:
    """The README's example GPT (467,584 parameters), global batch 64 x 64 bytes."""
    return GPTTask(name="gpt-small", config=CONFIGS["small"])


def large_gpt() -> GPTTask:
    """4 layers, d_model 192 (1.87 M parameters), global batch 64 x 64 bytes."""
    return GPTTask(name="gpt-large", config=CONFIGS["large"])


TASKS = {"small": small_gpt, "large": large_gpt}


def task_by_name(name: str) -> GPTTask:
    """``"small"`` or ``"large"``."""
    if name not in TASKS:
        raise ValueError(f"unknown GPT configuration {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]()

"""The scenarios of the Hugging Face Trainer test: compressed LionCub as the ds_config optimizer of a Trainer, under
the ZeRO-3 hybrid (and the ZeRO-2 hybrid), 4 ranks as 2 nodes x 2.

Shared by the deepspeed-launched worker (tests/workers/hf_trainer_scenarios.py), which trains with
``transformers.Trainer``, and by tests/integration/test_hf_trainer.py, which rebuilds the model here and reruns
every rank's recorded batches through the plain-torch ZeRO-3 simulation. Importing this module needs
``transformers``; the test skips before it when that is missing.

The model is a one-layer Llama built from a config (no download) with 920 parameters; the data a synthetic
"next token is this token + 1" language, so the loss has somewhere to go in a few steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

WORLD = 4
NODE_SIZE = 2
NODES = WORLD // NODE_SIZE
VOCAB = 16
SEQUENCE = 8
MICRO_BATCH = 4
STEPS = 8
LR = 2e-2
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
# The Trainer's data: one epoch of exactly STEPS optimizer steps over the world's micro-batches.
EXAMPLES = WORLD * MICRO_BATCH * STEPS
# Held-out sequences on which the test compares the loss before and after training.
HELD_OUT = 64


def model_config() -> LlamaConfig:
    """A one-layer Llama: hidden 8, 2 heads of 4, MLP 16, vocabulary 16; fp32 and no dropout (so a rank's
    gradient is a pure function of its parameters and batch), untied embeddings, eager attention."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
        dtype="float32",
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_model() -> LlamaForCausalLM:
    """The model from its config and a fixed seed: the same initial parameters in every process."""
    torch.manual_seed(0)
    return LlamaForCausalLM(model_config())


def sequences(count: int, seed: int) -> Tensor:
    """``count`` sequences of SEQUENCE tokens, each counting up by one (mod VOCAB) from a random start."""
    starts = torch.randint(0, VOCAB, (count, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(SEQUENCE)) % VOCAB


class CountingDataset(torch.utils.data.Dataset):
    """The training set: EXAMPLES counting sequences, each its own labels (the model shifts them)."""

    def __init__(self) -> None:
        self.tokens = sequences(EXAMPLES, seed=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


@dataclass(frozen=True)
class HfCase:
    """One Trainer run: the ZeRO stage inside the node and the LionCub compression across nodes."""

    name: str
    stage: int
    compression: str = "1bit"

    def ds_config(self) -> dict[str, Any]:
        """The ds_config the Trainer gets: "auto" where the Trainer fills in its own arguments (batch sizes,
        clipping, lr, betas, weight decay), LionCub's own options, and the hybrid's node size."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            # Every layer's parameters gathered inside the node in forward and backward.
            zero["stage3_param_persistence_threshold"] = 0
        return copy.deepcopy(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": zero,
                "optimizer": {
                    "type": "LionCub",
                    "params": {
                        "lr": "auto",
                        "betas": "auto",
                        "weight_decay": "auto",
                        "compression": self.compression,
                        "hybrid": {"node_size": NODE_SIZE},
                    },
                },
            }
        )


ZERO3 = HfCase("zero3_hybrid_1bit", stage=3)
ZERO2 = HfCase("zero2_hybrid_1bit", stage=2)
CASES = [ZERO3, ZERO2]


def linear_lr(step: int) -> float:
    """The lr of optimizer step ``step`` (1-based) under the Trainer's default schedule, linear decay to 0 over
    STEPS with no warm-up: the scheduler has stepped ``step - 1`` times when step ``step`` runs."""
    return LR * (STEPS - (step - 1)) / STEPS

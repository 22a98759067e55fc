"""The example GPT: :mod:`ds_lioncub.simulate.tasks.gpt`, re-exported under its old name.

The model ships inside the package (``python -m ds_lioncub.simulate`` trains it by default wherever
ds_lioncub is installed); the training scripts, benchmarks and tests keep importing ``examples.gpt``.
"""

from ds_lioncub.simulate.tasks.gpt import GPT, Block, CausalSelfAttention, GPTConfig, SwiGLU

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "SwiGLU"]

"""A small decoder-only transformer in the style the Lion Cub paper trains (also ``examples.gpt``).

Token embedding -> N pre-norm blocks (RMSNorm, causal self-attention with rotary position
embedding, RMSNorm, SwiGLU MLP) -> final RMSNorm -> untied output head ``lm_head``.
No biases anywhere, no dropout: the examples compare optimizers, and fewer moving parts make the
comparison cleaner. The embedding and the head are separate parameters on purpose: the paper
finds their momentum varies most across workers (momentum_sync "auto" selects exactly these two).

It lives in the package so that ``python -m ds_lioncub.simulate``'s default task runs wherever ds_lioncub
is installed; the repository's ``examples/gpt.py`` re-exports it for the training scripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    max_seq_len: int = 256  # longest context the rotary tables cover
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: float = 8.0 / 3.0  # SwiGLU hidden = ratio * d_model keeps params close to a 4x GELU MLP
    norm_eps: float = 1e-6
    rope_base: float = 10_000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        # Round up to a multiple of 32: matmul kernels prefer aligned sizes.
        return 32 * math.ceil(self.mlp_ratio * self.d_model / 32)


def _rotary_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)  # (T, half)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + half]) by a position-dependent angle; x is (B, H, T, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (B, T, D) -> (B, H, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Pre-norm: the residual stream itself is never normalised, which keeps deep stacks stable.
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    rope_cos: torch.Tensor  # buffers (registered in __init__), declared for the type checker
    rope_sin: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Rotary tables are buffers, not parameters: the optimizer must not see them, and
        # persistent=False keeps them out of checkpoints (they are recomputed from the config).
        cos, sin = _rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        # Each block adds two outputs to the residual stream; shrinking those projections keeps
        # the stream's variance roughly independent of depth at initialisation (GPT-2 practice).
        residual_std = std / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)  # a ModuleList yields plain Modules to the type checker
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64. Returns (logits (B, T, vocab), mean cross-entropy or None)."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(idx)
        # DeepSpeed's bf16/fp16 casts parameters, not these buffers: match the activations' dtype.
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.final_norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

"""A GPT-J-style decoder: parallel attention and MLP, partial rotary positions, untied head.

Sized by :class:`GPTJConfig`; GPT-J-6B is ``GPTJConfig(n_layer=28, d_model=4096,
n_head=16, rotary_dim=64, vocab_size=50400, seq_len=2048)``.

What sets it apart from GPT-2: each block computes attention and the MLP from the
same normalized input and adds both to the residual in one sum (one LayerNorm
per block, and the two branches could run concurrently); positions enter only
through rotary embeddings on the first ``rotary_dim`` dimensions of each query
and key head, with adjacent dimensions (2i, 2i + 1) forming a rotated pair; the
LM head is a separate matrix with a bias. Parameter names inside a block are
those of Hugging Face's ``GPTJForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.common.materialize import init_normal, materialize
from weightstream.models import _validate
from weightstream.models.llama import rotary_angles

_OWNER = "GPTJConfig"


@dataclass
class GPTJConfig:
    vocab_size: int = 4096
    seq_len: int = 256
    n_layer: int = 6
    d_model: int = 512
    n_head: int = 8
    rotary_dim: int = 32  # leading dimensions of each head that are rotated; the rest pass through
    d_ff: int | None = None  # MLP hidden width; None = 4 * d_model
    norm_eps: float = 1e-5
    dropout: float = 0.0  # on embeddings, attention probabilities and both branch outputs

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "rotary_dim"):
            _validate.positive_int(_OWNER, name, getattr(self, name))
        _validate.optional_positive_int(_OWNER, "d_ff", self.d_ff, "4 * d_model")
        _validate.positive_float(_OWNER, "norm_eps", self.norm_eps)
        _validate.probability(_OWNER, "dropout", self.dropout)
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTJConfig.d_model ({self.d_model}) must be divisible by n_head "
                f"({self.n_head}); change model.d_model or model.n_head."
            )
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"GPTJConfig.rotary_dim ({self.rotary_dim}) must be even (dimensions rotate in "
                f"pairs) and at most the head size d_model / n_head = {self.head_dim}; set "
                f"model.rotary_dim to an even number <= {self.head_dim}."
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


def rotary_tables(
    seq_len: int, rotary_dim: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq_len, rotary_dim] (float32), each angle repeated for its pair (2i, 2i + 1)."""
    angles = rotary_angles(seq_len, rotary_dim, 10000.0, device).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., T, rotary_dim]: (a, b) -> (a cos - b sin, b cos + a sin)."""
    a, b = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-b, a), dim=-1).flatten(-2)
    return x * cos + rotated * sin


class GPTJAttention(nn.Module):
    def __init__(self, cfg: GPTJConfig):
        super().__init__()
        self.n_head, self.head_dim, self.rotary_dim = cfg.n_head, cfg.head_dim, cfg.rotary_dim
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(t, cos, sin)
        return torch.cat((apply_rotary(t[..., :r], cos, sin), t[..., r:]), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, n_head, T, head_dim]
        q, k, v = (
            proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))


class GPTJMLP(nn.Module):
    def __init__(self, cfg: GPTJConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc_out = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-J's "gelu_new" is the tanh approximation of GELU.
        return self.drop(self.fc_out(F.gelu(self.fc_in(x), approximate="tanh")))


class GPTJBlock(nn.Module):
    def __init__(self, cfg: GPTJConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GPTJAttention(cfg)
        self.mlp = GPTJMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        # Parallel residual: both branches read h; the sum order is Hugging Face's.
        return self.attn(h, cos, sin) + self.mlp(h) + x


class GPTJ(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: GPTJConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTJBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        materialize(self)

    @staticmethod
    def init_module(name: str, m: nn.Module) -> None:
        """Initialize ``m``'s own parameters (see ``common.materialize``): N(0, 0.02)
        matrices and zero biases, as Hugging Face's GPT-J; LayerNorms start at (1, 0)."""
        init_normal(m)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}; "
                "raise model.seq_len or shorten the input sequences."
            )
        x = self.drop(self.wte(idx))
        cos, sin = rotary_tables(T, self.cfg.rotary_dim, idx.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Sized by :class:`LlamaConfig`; Llama-2-7B is ``LlamaConfig(n_layer=32, d_model=4096,
n_head=32, vocab_size=32000, seq_len=4096, norm_eps=1e-5)`` (``d_ff`` defaults to
11008 for that width).

Note [rotary layout]: rotary embeddings rotate pairs of head dimensions. Here
dimension ``i`` is paired with ``i + head_dim / 2`` (the "rotate half" layout of
Hugging Face's ``LlamaForCausalLM``), so its checkpoints load by renaming
parameters only (tests/test_zoo.py does exactly that). Meta's original
checkpoints pair adjacent dimensions instead; they need the row permutation of
q_proj/k_proj that Hugging Face's conversion script applies, not a rename.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.common.materialize import init_normal, materialize
from weightstream.models import _validate

_OWNER = "LlamaConfig"


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    seq_len: int = 256  # longest sequence accepted (rotary needs no table, but inputs are checked)
    n_layer: int = 6
    d_model: int = 512
    n_head: int = 8
    # Key/value heads; each is shared by n_head / n_kv_head query heads. None = n_head.
    n_kv_head: int | None = None
    # SwiGLU hidden width. None = 8/3 * d_model rounded up to a multiple of
    # multiple_of: the rule that keeps SwiGLU's three matrices at the parameter
    # count of a 4 * d_model GELU MLP (it gives 11008 for d_model 4096).
    d_ff: int | None = None
    multiple_of: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "multiple_of"):
            _validate.positive_int(_OWNER, name, getattr(self, name))
        _validate.optional_positive_int(_OWNER, "n_kv_head", self.n_kv_head, "= n_head")
        _validate.optional_positive_int(_OWNER, "d_ff", self.d_ff, "8/3 * d_model rounded up")
        _validate.positive_float(_OWNER, "rope_theta", self.rope_theta)
        _validate.positive_float(_OWNER, "norm_eps", self.norm_eps)
        _validate.boolean(_OWNER, "tie_embeddings", self.tie_embeddings)
        _validate.probability(_OWNER, "attention_dropout", self.attention_dropout)
        if self.d_model % self.n_head:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_head "
                f"({self.n_head}); change model.d_model or model.n_head."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: the head size d_model / n_head = {self.head_dim} must be even, "
                "since rotary embeddings rotate pairs of dimensions; change model.d_model or "
                "model.n_head."
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.kv_heads}): each key/value head serves a whole group of query heads. "
                "Pick model.n_kv_head among the divisors of n_head."
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        hidden = int(2 * 4 * self.d_model / 3)
        return -(-hidden // self.multiple_of) * self.multiple_of


def rotary_angles(
    seq_len: int, dim: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """The rotation angles [seq_len, dim / 2] (float32), one per rotated pair.

    Computed per forward rather than stored: a buffer would have to follow the
    model between devices and into checkpoints for a few kilobytes of values
    that cost microseconds to recompute. Same arithmetic as Hugging Face's
    default RoPE (float32 powers of ``theta``), so results match it bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    return torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotation angles, each [seq_len, head_dim], in float32."""
    angles = rotary_angles(seq_len, head_dim, theta, device)
    angles = torch.cat((angles, angles), dim=-1)  # see Note [rotary layout]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by the angles of cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 even for half inputs: the mean of squares of a
        # 4096-wide bf16 row loses most of its bits otherwise.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.dropout = cfg.attention_dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, heads, T, head_dim]
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_head != self.n_head:
            # Query head h reads key/value head h // group (consecutive query
            # heads share one), the grouping of the Llama 2 reference code.
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        materialize(self)

    @staticmethod
    def init_module(name: str, m: nn.Module) -> None:
        """Initialize ``m``'s own parameters (see ``common.materialize``): N(0, 0.02)
        for every matrix, as Hugging Face's initializer_range; norms start at 1."""
        init_normal(m)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}; "
                "raise model.seq_len or shorten the input sequences."
            )
        x = self.wte(idx)
        cos, sin = rotary_tables(T, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""Registers the larger decoders of the zoo: "llama", "gptj" and "gpt3_xl".

Importing this module adds them to :data:`weightstream.models.registry.MODELS`
(``weightstream.models`` imports it). A preset is a dict of config-field
overrides; the run command applies the preset first, then the keys written in
the ``model`` section, so ``{name: llama, preset: 7b, n_layer: 2}`` is a
two-layer model of Llama-2-7B's width.

The full-size presets describe models of billions of parameters: they are what
weight streaming is for (the store holds them on the host), not something to
build eagerly in a test. Their shapes are the published ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightstream.models.gpt import GPT, GPTConfig
from weightstream.models.gptj import GPTJ, GPTJConfig
from weightstream.models.llama import Llama, LlamaConfig
from weightstream.models.registry import ModelSpec, register_model

# Llama 2 shapes (Touvron et al. 2023, table 1 and the released configs).
LLAMA_PRESETS: dict[str, dict] = {
    # Byte vocabulary: trains on the TextCorpusProcessor's corpus in seconds.
    "tiny": dict(n_layer=2, d_model=128, n_head=4, n_kv_head=2, vocab_size=256, seq_len=256),
    "7b": dict(n_layer=32, d_model=4096, n_head=32, d_ff=11008, vocab_size=32000, seq_len=4096),
    "13b": dict(n_layer=40, d_model=5120, n_head=40, d_ff=13824, vocab_size=32000, seq_len=4096),
    # Not a released model: Llama 2's architecture at about 20B (20,228,933,120
    # parameters), between 13B and 70B; head size 128 as theirs, d_ff the 8/3 rule's.
    "20b": dict(n_layer=52, d_model=5632, n_head=44, d_ff=15104, vocab_size=32000, seq_len=4096),
    "70b": dict(
        n_layer=80,
        d_model=8192,
        n_head=64,
        n_kv_head=8,
        d_ff=28672,
        vocab_size=32000,
        seq_len=4096,
    ),
}

GPTJ_PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, d_model=128, n_head=4, rotary_dim=16, vocab_size=256, seq_len=256),
    "6b": dict(n_layer=28, d_model=4096, n_head=16, rotary_dim=64, vocab_size=50400, seq_len=2048),
}

_GPT3_XL = dict(n_layer=24, d_model=2048, n_head=16, vocab_size=50257, seq_len=2048)


@dataclass
class GPT3XLConfig(GPTConfig):
    """GPTConfig whose defaults are GPT-3 XL's shape (Brown et al. 2020, table 2.1).

    A separate model name should build that model when no preset is given, so
    the defaults, not only a preset, carry the shape. GPT-3 alternates dense
    and locally banded sparse attention layers; this model uses dense
    attention in every layer, as GPT-2 does.
    """

    vocab_size: int = _GPT3_XL["vocab_size"]
    seq_len: int = _GPT3_XL["seq_len"]
    n_layer: int = _GPT3_XL["n_layer"]
    d_model: int = _GPT3_XL["d_model"]
    n_head: int = _GPT3_XL["n_head"]


register_model(
    ModelSpec(
        "llama",
        LlamaConfig,
        Llama,
        "lm",
        presets=LLAMA_PRESETS,
        description=(
            "Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query "
            "attention (n_kv_head), untied embeddings unless tie_embeddings"
        ),
    )
)
register_model(
    ModelSpec(
        "gptj",
        GPTJConfig,
        GPTJ,
        "lm",
        presets=GPTJ_PRESETS,
        description=(
            "GPT-J-style decoder: parallel attention and MLP residual, rotary positions on "
            "rotary_dim dimensions per head, untied LM head with bias"
        ),
    )
)
register_model(
    ModelSpec(
        "gpt3_xl",
        GPT3XLConfig,
        GPT,
        "lm",
        presets={"xl": dict(_GPT3_XL)},
        description=(
            "GPT-3 XL (1.3B parameters): the GPT-2 style decoder at 24 layers, d_model 2048, "
            "16 heads, 2048 positions; dense attention in every layer"
        ),
    )
)

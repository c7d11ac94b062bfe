"""The zoo's Llama, GPT-J and GPT-3 XL: equal to Hugging Face's implementations, sized as published.

Equivalence: our model gets random weights at a scale that makes logits O(1)
(the default N(0, 0.02) init would make them ~0.01, where any tolerance
passes), the weights are copied by name into a transformers model built from
the equivalent config, and the logits of both are compared in fp32. The
arithmetic is the same, in a different order (fused scaled-dot-product
attention against an explicit softmax; float32 sums over 64-wide rows), so
the results agree to a few float32 ulps of the O(1) logits, not bit for bit:
we assert 1e-5 absolute and relative (measured differences are ~3e-6).
"""

from __future__ import annotations

import pytest
import torch

from weightstream.models import zoo
from weightstream.models.gpt import GPT, GPTConfig
from weightstream.models.gptj import GPTJ, GPTJConfig
from weightstream.models.llama import Llama, LlamaConfig, RMSNorm
from weightstream.models.registry import MODELS, get_model_spec

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 300, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _randomize(model: torch.nn.Module) -> None:
    """Weights at unit-variance scale: matrices N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2)."""
    norms = (RMSNorm, torch.nn.LayerNorm)
    scales = {id(m.weight) for m in model.modules() if isinstance(m, norms)}
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif id(p) in scales:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # biases, LayerNorm shifts
                p.normal_(0.0, 0.1)


def _compare(ours: torch.nn.Module, hf: torch.nn.Module, rename) -> None:
    ours.eval()
    hf.eval()
    mapped = {rename(k): v for k, v in ours.state_dict().items()}
    # The renaming must be one to one and cover every HF parameter: strict load.
    assert len(mapped) == len(ours.state_dict())
    assert set(mapped) == set(hf.state_dict())
    hf.load_state_dict(mapped, strict=True)
    ids = torch.randint(0, VOCAB, (3, SEQ))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
        got_short = ours(ids[:, :7])
    assert got.shape == (3, SEQ, VOCAB) and got.dtype == torch.float32
    assert got.std() > 0.3  # the tolerance below is small next to the logits
    torch.testing.assert_close(got, expected, **TOL)
    # Causal: a prefix gives the prefix's logits.
    torch.testing.assert_close(got_short, expected[:, :7], **TOL)


# -- Llama ------------------------------------------------------------------------------


def _hf_llama_config(cfg: LlamaConfig):
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",  # explicit softmax: an independent path from our SDPA
    )


_LLAMA_NAMES = [
    ("wte.", "model.embed_tokens."),
    ("blocks.", "model.layers."),
    ("norm_f.", "model.norm."),
    (".attn_norm.", ".input_layernorm."),
    (".mlp_norm.", ".post_attention_layernorm."),
    (".attn.", ".self_attn."),
]


def _llama_to_hf(name: str) -> str:
    for ours, theirs in _LLAMA_NAMES:
        name = name.replace(ours, theirs)
    return name


@pytest.mark.parametrize(
    "overrides",
    [
        dict(n_kv_head=2, d_ff=96),  # grouped-query attention: 2 query heads per kv head
        dict(n_kv_head=None, tie_embeddings=True, rope_theta=500000.0),  # MHA, tied, Llama-3 theta
    ],
    ids=["gqa_untied", "mha_tied"],
)
def test_llama_matches_transformers(overrides):
    cfg = LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, d_model=64, n_head=4, **overrides)
    ours = Llama(cfg)
    _randomize(ours)
    hf = transformers.LlamaForCausalLM(_hf_llama_config(cfg))
    _compare(ours, hf, _llama_to_hf)
    assert (ours.lm_head.weight is ours.wte.weight) == cfg.tie_embeddings


def test_llama_default_ffn_width_is_the_reference_rule():
    # Llama-2-7B's released intermediate_size comes out of 8/3 * d rounded up to 256.
    assert LlamaConfig(d_model=4096, n_head=32).ffn_dim == 11008
    assert LlamaConfig(d_model=128, n_head=4, multiple_of=32).ffn_dim == 352


# -- GPT-J ------------------------------------------------------------------------------


def _hf_gptj_config(cfg: GPTJConfig):
    return transformers.GPTJConfig(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        rotary_dim=cfg.rotary_dim,
        n_inner=cfg.d_ff,
        layer_norm_epsilon=cfg.norm_eps,
        bos_token_id=0,
        eos_token_id=0,
    )


def _gptj_to_hf(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    return "transformer." + name.replace("blocks.", "h.")


@pytest.mark.parametrize(
    "overrides",
    [dict(rotary_dim=8), dict(rotary_dim=16, d_ff=96)],
    ids=["rotary_half_of_head", "rotary_whole_head"],
)
def test_gptj_matches_transformers(overrides):
    cfg = GPTJConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, d_model=64, n_head=4, **overrides)
    ours = GPTJ(cfg)
    _randomize(ours)
    hf = transformers.GPTJForCausalLM(_hf_gptj_config(cfg))
    _compare(ours, hf, _gptj_to_hf)
    assert ours.lm_head.bias is not None and ours.lm_head.weight is not ours.wte.weight


# -- registry and presets ------------------------------------------------------------------


def test_zoo_models_are_registered():
    small = dict(n_layer=1, d_model=32, n_head=2, vocab_size=50)
    for name, cls, config_cls, extra in (
        ("llama", Llama, LlamaConfig, dict(n_kv_head=1)),
        ("gptj", GPTJ, GPTJConfig, dict(rotary_dim=8)),
        ("gpt3_xl", GPT, zoo.GPT3XLConfig, {}),
    ):
        spec = get_model_spec(name)
        assert spec is MODELS[name]
        assert spec.task == "lm" and spec.config_cls is config_cls and spec.description
        model = spec.build(config_cls(**small, **extra))
        assert isinstance(model, cls)
        assert model(torch.randint(0, 50, (2, 5))).shape == (2, 5, 50)


@pytest.mark.parametrize("name", ["llama", "gptj"])
def test_tiny_presets_build_and_run_on_bytes(name):
    spec = get_model_spec(name)
    cfg = spec.config_cls(**spec.presets["tiny"])
    assert cfg.vocab_size == 256  # fits the byte-level TextCorpusProcessor
    model = spec.build(cfg)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)


def test_every_preset_is_a_valid_config():
    for name in ("llama", "gptj", "gpt3_xl"):
        spec = get_model_spec(name)
        assert spec.presets
        for preset in spec.presets.values():
            spec.config_cls(**preset)


def _meta_count(build) -> int:
    with torch.device("meta"):  # shapes only: no memory for billions of parameters
        model = build()
    return sum(p.numel() for p in model.parameters())


def test_llama_presets_have_published_sizes_and_match_transformers():
    # Llama-2-7B's published parameter count (the released checkpoint's tensors).
    assert _meta_count(lambda: Llama(LlamaConfig(**zoo.LLAMA_PRESETS["7b"]))) == 6_738_415_616
    for preset in ("7b", "13b", "20b", "70b"):
        cfg = LlamaConfig(**zoo.LLAMA_PRESETS[preset])
        ours = _meta_count(lambda cfg=cfg: Llama(cfg))
        theirs = _meta_count(lambda cfg=cfg: transformers.LlamaForCausalLM(_hf_llama_config(cfg)))
        assert ours == theirs, preset
    assert LlamaConfig(**zoo.LLAMA_PRESETS["70b"]).kv_heads == 8


def test_gptj_6b_preset_matches_transformers_gptj_6b():
    cfg = GPTJConfig(**zoo.GPTJ_PRESETS["6b"])
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.rotary_dim) == (28, 4096, 16, 64)
    assert (cfg.vocab_size, cfg.seq_len) == (50400, 2048)
    # transformers' GPTJConfig defaults are GPT-J-6B.
    theirs = transformers.GPTJConfig(bos_token_id=0, eos_token_id=0)
    ours = _meta_count(lambda: GPTJ(cfg))
    assert ours == _meta_count(lambda: transformers.GPTJForCausalLM(theirs))


def test_gpt3_xl_defaults_and_size():
    cfg = zoo.GPT3XLConfig()
    assert cfg == zoo.GPT3XLConfig(**get_model_spec("gpt3_xl").presets["xl"])
    assert isinstance(cfg, GPTConfig)
    d, L, V, T = 2048, 24, 50257, 2048
    per_layer = (
        (3 * d * d + 3 * d)  # qkv
        + (d * d + d)  # attention projection
        + (4 * d * d + 4 * d)  # MLP up
        + (4 * d * d + d)  # MLP down
        + 2 * (2 * d)  # two LayerNorms
    )
    expected = V * d + T * d + L * per_layer + 2 * d  # tied head adds nothing; final LayerNorm
    assert _meta_count(lambda: GPT(cfg)) == expected == 1_315_723_264  # "1.3B" in the paper


# -- config errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, error, words",
    [
        (LlamaConfig, dict(d_model=100, n_head=8), ValueError, ["d_model", "n_head"]),
        (LlamaConfig, dict(n_head=8, n_kv_head=3), ValueError, ["n_kv_head", "divisors"]),
        (LlamaConfig, dict(d_model=24, n_head=8), ValueError, ["even", "d_model"]),
        (LlamaConfig, dict(vocab_size=0), ValueError, ["LlamaConfig.vocab_size", ">= 1"]),
        (LlamaConfig, dict(n_layer=True), ValueError, ["LlamaConfig.n_layer", "whole number"]),
        (LlamaConfig, dict(d_ff=-1), ValueError, ["LlamaConfig.d_ff", "remove it"]),
        (LlamaConfig, dict(tie_embeddings="yes"), TypeError, ["tie_embeddings", "true or false"]),
        (LlamaConfig, dict(rope_theta=0), ValueError, ["LlamaConfig.rope_theta", "positive"]),
        (LlamaConfig, dict(attention_dropout=1.0), ValueError, ["attention_dropout", "[0, 1)"]),
        (GPTJConfig, dict(d_model=64, n_head=4, rotary_dim=32), ValueError, ["rotary_dim", "16"]),
        (GPTJConfig, dict(rotary_dim=7), ValueError, ["rotary_dim", "even"]),
        (GPTJConfig, dict(d_model=100, n_head=8), ValueError, ["d_model", "n_head"]),
        (GPTJConfig, dict(dropout=-0.1), ValueError, ["GPTJConfig.dropout"]),
    ],
)
def test_config_errors_name_the_field_and_the_fix(cls, kwargs, error, words):
    with pytest.raises(error) as info:
        cls(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("cls, cfg_cls", [(Llama, LlamaConfig), (GPTJ, GPTJConfig)])
def test_too_long_input_is_refused(cls, cfg_cls):
    model = cls(
        cfg_cls(
            vocab_size=10,
            seq_len=4,
            n_layer=1,
            d_model=16,
            n_head=2,
            **({"rotary_dim": 8} if cfg_cls is GPTJConfig else {}),
        )
    )
    with pytest.raises(ValueError, match="seq_len 4"):
        model(torch.zeros(1, 5, dtype=torch.long))

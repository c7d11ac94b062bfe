"""Real models nobody here wrote: Hugging Face causal LMs built from a config
(random init, no download) train in weight-streaming mode with losses and final
weights equal to eager PyTorch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import weightstream as cstorch

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=300,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)  # tied input/output embeddings, dropout 0.1


def _llama():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)  # RMSNorm, rotary, SwiGLU, grouped-query attention


def _train_side_by_side(ref, model, runner, steps: int, **inputs) -> torch.Tensor:
    """``steps`` AdamW steps of the eager ``ref`` and of ``runner`` (compiled ``model``),
    each step's loss and the final weights bit for bit; the last batch."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randint(0, 300, (2, 16), generator=g)
        torch.manual_seed(step)  # dropout draws the same numbers in both
        expected = ref(input_ids=x, labels=x, **inputs).loss
        expected.backward()
        torch.manual_seed(step)
        loss = runner(input_ids=x, labels=x, **inputs).loss
        loss.backward()
        assert torch.equal(loss, expected), step
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    return x


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("granularity", ["module", "auto"])
def test_hf_causal_lm_trains_like_eager(make, granularity):
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(model, backend="ws", granularity=granularity, unit_size_target=100_000)
    _train_side_by_side(ref, model, runner, steps=8)
    assert runner.plan.traced
    assert len(runner.plan.units) > 4  # really streamed layer by layer
    assert runner.engine.streamer.resident_bytes() == 0


def test_a_llama_without_its_cache_is_traced():
    """Training runs a transformers Llama with ``use_cache=False``; its mask helper then
    checks the position ids for packed sequences, a data-dependent branch that it skips
    only while tracing (FakeTensors): the dry run must count as one, or the plan falls
    back to the module structure."""
    model = _llama()
    model.config.use_cache = False
    runner = cstorch.compile(model, backend="ws", granularity="module")
    x = torch.randint(0, 300, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not trace the model" would be one
        runner(input_ids=x, labels=x).loss.backward()
    assert runner.plan.traced and runner.plan.trace_error is None


def test_the_compile_costs_of_a_llama_without_its_cache_match_a_real_step():
    """The compile estimate's dry run (FakeTensors, as the trace's) prices a transformers
    Llama trained without its cache: the products' FLOPs it attributes to the units sum
    to what torch's FlopCounterMode counts on a real forward and backward (the CPU's
    flash attention, as in the dry run, with its formulas from torch), and no weight is
    counted as an activation (a saved view of a weight shares the weight's storage)."""
    from torch.utils.flop_counter import FlopCounterMode

    from weightstream.compiler.cost import EXTRA_FLOP_FORMULAS, unit_costs
    from weightstream.runtime.config import StreamingConfig
    from weightstream.runtime.partition import build_plan

    model = _llama()
    model.config.use_cache = False
    x = torch.randint(0, 300, (2, 16))
    costs = unit_costs(
        model, build_plan(model, StreamingConfig(granularity="module")), (), {"input_ids": x}
    )
    assert costs.backward_measured
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        model(input_ids=x).logits.sum().backward()
    assert costs.flops == counter.get_total_flops() > 0
    entries = [*costs.units, costs.outside]
    # Activations: the storages a real forward saves for backward, weights left out,
    # with the attention kernel the dry run takes.
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x).logits.sum()
    # Under FakeTensors transformers takes its tracing path: an explicit causal mask
    # ([2, 1, 16, 16]) and the key/value heads repeated for attention ([2, 4, 16, 16]
    # where the real run keeps [2, 2, 16, 16]): 20,480 bytes more of 307,072.
    counted, real = (
        sum(e.activation_bytes for e in entries),
        sum(s.nbytes() for s in saved.values()),
    )
    assert real <= counted <= 1.07 * real
    del loss


@pytest.mark.parametrize("arch", ["llama", "gemma", "opt", "falcon"])
def test_a_model_built_on_meta_gets_the_initialization_from_config_gives(arch):
    """A transformers model materialized from the meta device (the run command's
    ``model: {name: hf}``, the disk store) starts as transformers' own ``from_config``
    builds it: each tensor's spread is the library's (initializer_range normals, unit
    norms, each architecture's overrides), not torch's layer defaults (std 1
    embeddings: a first loss of 50 on a tied vocabulary of 256)."""
    transformers = pytest.importorskip("transformers")
    from weightstream.models import hf

    small = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    configs = {
        "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **small),
        "gemma": lambda: transformers.GemmaConfig(num_hidden_layers=2, head_dim=16, **small),
        "opt": lambda: transformers.OPTConfig(
            vocab_size=256, hidden_size=64, ffn_dim=128, num_attention_heads=4,
            num_hidden_layers=2, word_embed_proj_dim=64,
        ),
        "falcon": lambda: transformers.FalconConfig(
            vocab_size=256, hidden_size=64, num_attention_heads=4, num_hidden_layers=2
        ),
    }  # fmt: skip
    config = configs[arch]()
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    ours = hf.build(config, "cpu")
    mine = dict(ours.named_parameters())
    for name, want in theirs.named_parameters():
        got = mine[name]
        if want.numel() < 64 or want.std() == 0:  # constants (norms, biases) exactly
            assert torch.equal(got, want), name
        else:
            assert abs(got.std().item() / want.std().item() - 1) < 0.15, name
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = ours(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - math.log(256)) < 0.5, loss


def _falcon():
    cfg = transformers.FalconConfig(
        vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.FalconForCausalLM(cfg)  # parallel attention, one fused qkv


@pytest.mark.parametrize("make", [_llama, _falcon], ids=["llama", "falcon"])
@pytest.mark.parametrize("backend", ["wse_ws", "wse_lp"])
def test_activation_checkpointing_of_a_transformers_model_trains_like_eager(make, backend):
    """Checkpointed decoder layers recompute their forward; transformers' key/value
    cache (on by default) would take each position twice, so training calls run
    with use_cache=False (Note [activation checkpointing]), and a padded batch's
    mask trains bit for bit as eager."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    layer = type(model.model.layers[0] if hasattr(model, "model") else model.transformer.h[0])
    kwargs = {"unit_classes": [layer]} if backend == "wse_ws" else {}
    runner = cstorch.compile(model, backend=backend, activation_checkpointing=True, **kwargs)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row
    x = _train_side_by_side(ref, model, runner, steps=3, attention_mask=mask)
    assert runner.recomputed_modules if backend == "wse_lp" else runner.engine._recompute
    with pytest.warns(UserWarning, match="use_cache=True is ignored"):
        runner(input_ids=x, attention_mask=mask, labels=x, use_cache=True).loss.backward()


# Each architecture's own pieces (fused projections, sliding windows, soft-capping, query
# and key norms, attention sinks, latent attention, routed experts in one grouped product),
# at the size of the models above; AutoConfig fills the rest from its defaults.
_ARCHITECTURES = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {},
    "phi3": {},
    "gemma2": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16},
    "olmo2": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
    },
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16},
    "deepseek_v3": {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(_ARCHITECTURES))  # about 12 s for all, on 2 cores
def test_each_transformers_architecture_streams_like_eager(arch):
    """Streamed layer by layer, each trains as eager transformers does, bit for bit; the
    mixtures of experts trace on the meta device in float32 too (Note [fake kernels])."""

    def make():
        cfg = transformers.AutoConfig.for_model(
            arch, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            **_ARCHITECTURES[arch],
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(cfg)

    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "weightstream: could not trace")
        runner = cstorch.compile(model, backend="ws", unit_size_target=50_000)
        _train_side_by_side(ref, model, runner, steps=4)
    assert runner.plan.traced and len(runner.plan.units) > 4

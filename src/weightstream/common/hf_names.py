"""The zoo's models as Hugging Face models of the same architecture: names and configs.

A zoo model warm-starts from a Hugging Face folder of its architecture
(``runconfig.load_checkpoint_states: model``), and its checkpoints export to
one (``checkpoint convert --to hf``): each zoo parameter name maps to the
transformers name and whether the stored matrix is transposed. GPT-2's
transformers modules are ``Conv1D`` layers, which store ``[in, out]`` where
``nn.Linear`` stores ``[out, in]``. The zoo's Llama uses transformers' rotary
layout (Note [rotary layout] in models/llama.py) and the zoo's GPT-J its
adjacent-pair layout, so their matrices load as they are. A name the map does
not know is looked up as it is. :func:`hf_config_fields` gives the transformers
configuration that computes what the zoo model computes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# zoo pattern -> (transformers name, transposed); {i}: the layer number.
_GPT2 = {
    "wte.weight": ("transformer.wte.weight", False),
    "wpe.weight": ("transformer.wpe.weight", False),
    "blocks.{i}.ln1.weight": ("transformer.h.{i}.ln_1.weight", False),
    "blocks.{i}.ln1.bias": ("transformer.h.{i}.ln_1.bias", False),
    "blocks.{i}.attn.qkv.weight": ("transformer.h.{i}.attn.c_attn.weight", True),
    "blocks.{i}.attn.qkv.bias": ("transformer.h.{i}.attn.c_attn.bias", False),
    "blocks.{i}.attn.proj.weight": ("transformer.h.{i}.attn.c_proj.weight", True),
    "blocks.{i}.attn.proj.bias": ("transformer.h.{i}.attn.c_proj.bias", False),
    "blocks.{i}.ln2.weight": ("transformer.h.{i}.ln_2.weight", False),
    "blocks.{i}.ln2.bias": ("transformer.h.{i}.ln_2.bias", False),
    "blocks.{i}.mlp.fc.weight": ("transformer.h.{i}.mlp.c_fc.weight", True),
    "blocks.{i}.mlp.fc.bias": ("transformer.h.{i}.mlp.c_fc.bias", False),
    "blocks.{i}.mlp.proj.weight": ("transformer.h.{i}.mlp.c_proj.weight", True),
    "blocks.{i}.mlp.proj.bias": ("transformer.h.{i}.mlp.c_proj.bias", False),
    "ln_f.weight": ("transformer.ln_f.weight", False),
    "ln_f.bias": ("transformer.ln_f.bias", False),
    "lm_head.weight": ("lm_head.weight", False),
}

_LLAMA = {
    "wte.weight": ("model.embed_tokens.weight", False),
    "blocks.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", False),
    "blocks.{i}.attn.q_proj.weight": ("model.layers.{i}.self_attn.q_proj.weight", False),
    "blocks.{i}.attn.k_proj.weight": ("model.layers.{i}.self_attn.k_proj.weight", False),
    "blocks.{i}.attn.v_proj.weight": ("model.layers.{i}.self_attn.v_proj.weight", False),
    "blocks.{i}.attn.o_proj.weight": ("model.layers.{i}.self_attn.o_proj.weight", False),
    "blocks.{i}.mlp_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "blocks.{i}.mlp.gate_proj.weight": ("model.layers.{i}.mlp.gate_proj.weight", False),
    "blocks.{i}.mlp.up_proj.weight": ("model.layers.{i}.mlp.up_proj.weight", False),
    "blocks.{i}.mlp.down_proj.weight": ("model.layers.{i}.mlp.down_proj.weight", False),
    "norm_f.weight": ("model.norm.weight", False),
    "lm_head.weight": ("lm_head.weight", False),
}

_GPTJ = {
    "wte.weight": ("transformer.wte.weight", False),
    "blocks.{i}.ln_1.weight": ("transformer.h.{i}.ln_1.weight", False),
    "blocks.{i}.ln_1.bias": ("transformer.h.{i}.ln_1.bias", False),
    "blocks.{i}.attn.q_proj.weight": ("transformer.h.{i}.attn.q_proj.weight", False),
    "blocks.{i}.attn.k_proj.weight": ("transformer.h.{i}.attn.k_proj.weight", False),
    "blocks.{i}.attn.v_proj.weight": ("transformer.h.{i}.attn.v_proj.weight", False),
    "blocks.{i}.attn.out_proj.weight": ("transformer.h.{i}.attn.out_proj.weight", False),
    "blocks.{i}.mlp.fc_in.weight": ("transformer.h.{i}.mlp.fc_in.weight", False),
    "blocks.{i}.mlp.fc_in.bias": ("transformer.h.{i}.mlp.fc_in.bias", False),
    "blocks.{i}.mlp.fc_out.weight": ("transformer.h.{i}.mlp.fc_out.weight", False),
    "blocks.{i}.mlp.fc_out.bias": ("transformer.h.{i}.mlp.fc_out.bias", False),
    "ln_f.weight": ("transformer.ln_f.weight", False),
    "ln_f.bias": ("transformer.ln_f.bias", False),
    "lm_head.weight": ("lm_head.weight", False),
    "lm_head.bias": ("lm_head.bias", False),
}

NameMap = Callable[[str], tuple[str, bool]]


def _compile(table: dict[str, tuple[str, bool]]) -> NameMap:
    patterns = [
        (re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v)
        for k, v in table.items()
    ]

    def to_hf(name: str) -> tuple[str, bool]:
        for pattern, (target, transposed) in patterns:
            m = pattern.match(name)
            if m:
                return target.replace("{i}", m.group(1)) if m.groups() else target, transposed
        return name, False

    return to_hf


HF_NAMES: dict[str, NameMap] = {
    "gpt2": _compile(_GPT2),
    "llama": _compile(_LLAMA),
    "gptj": _compile(_GPTJ),
}


def hf_name_map(model_name: str) -> NameMap | None:
    """The map of a zoo model (its params-file name), or None for models without one."""
    return HF_NAMES.get(model_name)


def hf_config_fields(model: dict, shape_of: Callable[[str], tuple[int, ...]]) -> dict:
    """The transformers config (``model_type`` and its fields) of the zoo model whose
    params-file section, with every field (as a checkpoint records it), is ``model``;
    ``shape_of(zoo name)`` gives a stored tensor's shape (widths the section leaves to
    a rule). A zoo setting transformers' architecture lacks is a ValueError."""
    name = model.get("name")
    if name not in HF_NAMES:
        raise ValueError(f"no Hugging Face architecture for the zoo model {name!r}")
    common = {
        "vocab_size": model["vocab_size"],
        "tie_word_embeddings": bool(model.get("tie_embeddings", False)),
    }
    if name == "llama":
        heads = model["n_head"]
        return {
            "model_type": "llama",
            **common,
            "hidden_size": model["d_model"],
            "intermediate_size": shape_of("blocks.0.mlp.gate_proj.weight")[0],
            "num_hidden_layers": model["n_layer"],
            "num_attention_heads": heads,
            "num_key_value_heads": model.get("n_kv_head") or heads,
            "max_position_embeddings": model["seq_len"],
            "rms_norm_eps": model["norm_eps"],
            "rope_theta": model["rope_theta"],
            "attention_dropout": model.get("attention_dropout", 0.0),
        }
    dropout = model.get("dropout", 0.0)
    gpt = {
        **common,
        "n_positions": model["seq_len"],
        "n_embd": model["d_model"],
        "n_layer": model["n_layer"],
        "n_head": model["n_head"],
        "activation_function": "gelu_new",  # GELU's tanh approximation, as the zoo's
        **{f"{k}_pdrop": dropout for k in ("resid", "embd", "attn")},
    }
    if model["vocab_size"] <= 50256:  # their token 50256 is outside a smaller vocabulary
        gpt.update(bos_token_id=None, eos_token_id=None)
    if name == "gpt2":
        if not model.get("bias", True):
            raise ValueError(
                "transformers' GPT-2 has biases in every layer; a zoo GPT-2 with "
                "'bias: false' has no Hugging Face architecture to export to."
            )
        return {"model_type": "gpt2", **gpt, "layer_norm_epsilon": 1e-5}
    return {
        "model_type": "gptj",
        **gpt,
        "tie_word_embeddings": False,  # GPT-J's head has a bias of its own
        "rotary_dim": model["rotary_dim"],
        "n_inner": shape_of("blocks.0.mlp.fc_in.weight")[0],
        "layer_norm_epsilon": model["norm_eps"],
    }

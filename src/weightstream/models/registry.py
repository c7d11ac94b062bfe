"""Names of the zoo's models for the params file's ``model`` section.

Each entry says how to build the model from its config dataclass (whose fields
are the keys allowed in the ``model`` section besides ``name``,
``mixed_precision`` and ``fp16_type``), what task it solves (which fixes the
batch format and the loss), and named size presets.

Batch formats by task:
    "lm": dict with ``input_ids`` [B, T] (int64), ``labels`` [B, T] (int64) and
        optionally ``attention_mask`` [B, T] (1 = token counts in the loss);
        the model maps input_ids to logits [B, T, vocab].
    "classification": dict with ``inputs`` [B, ...] (float) and ``labels`` [B]
        (int64); the model maps inputs to logits [B, num_classes].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from weightstream.common.schema import did_you_mean
from weightstream.models.fc_mnist import FCMNIST, FCMNISTConfig
from weightstream.models.gpt import GPT, GPTConfig

TASKS = ("lm", "classification")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_cls: type
    build: Callable[[object], nn.Module]
    task: str
    presets: dict[str, dict] = field(default_factory=dict)
    description: str = ""


MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    if spec.task not in TASKS:
        raise ValueError(f"model {spec.name!r}: task must be one of {TASKS}, got {spec.task!r}.")
    if spec.name in MODELS:
        raise ValueError(f"a model named {spec.name!r} is already registered.")
    MODELS[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        hint = did_you_mean(str(name), MODELS)
        raise ValueError(
            f"unknown model name {name!r}.{hint} Known models: {', '.join(sorted(MODELS))}."
        )
    return MODELS[name]


register_model(
    ModelSpec(
        "fc_mnist",
        FCMNISTConfig,
        lambda cfg: FCMNIST(cfg.in_features, cfg.hidden, cfg.num_classes, cfg.dropout),
        "classification",
        description="the 3-layer fully connected network of the execution-modes description",
    )
)
register_model(
    ModelSpec(
        "gpt2",
        GPTConfig,
        GPT,
        "lm",
        presets={
            "small": dict(n_layer=12, d_model=768, n_head=12, vocab_size=50257, seq_len=1024),
            "medium": dict(n_layer=24, d_model=1024, n_head=16, vocab_size=50257, seq_len=1024),
            "large": dict(n_layer=36, d_model=1280, n_head=20, vocab_size=50257, seq_len=1024),
            "xl": dict(n_layer=48, d_model=1600, n_head=25, vocab_size=50257, seq_len=1024),
        },
        description="GPT-2 style decoder with tied input/output embeddings",
    )
)


def _build_hf(config):
    from weightstream.models import hf

    return hf.build(config, "meta")


register_model(
    ModelSpec(
        "hf",
        dict,  # not a dataclass: the section's keys override the transformers config
        _build_hf,
        "lm",
        description="any Hugging Face transformers causal LM from its config.json "
        "(hf_config: PATH; other keys override config fields)",
    )
)

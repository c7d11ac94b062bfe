"""LoRA adapters on a Hugging Face causal LM, through peft's own machinery.

Shared by the run command (the params file's ``peft`` section wraps the model
it trains) and the checkpoint converter (``--to peft`` and the merged ``--to
hf`` export build the same wrapper on the meta device). peft is imported only
through :func:`weightstream.common.hf_config.peft_module`.

Note [lora on meta]
-------------------
A LoRA run trains a pretrained model too large for host memory: its base is
built on the meta device and its weights come tensor by tensor from the
pretrained folder (the warm start). peft's ``get_peft_model`` puts each
adapter on its base layer's device, so on a meta base its draws would be
thrown away; :func:`wrap` asks peft for the adapters on meta
(``low_cpu_mem_usage=True``), gives them host memory and runs peft's own rule,
``reset_lora_parameters``: ``lora_A`` as ``nn.Linear`` draws it (or
N(0, 1/r) for ``init_lora_weights: gaussian``), ``lora_B`` zeros, layer by
layer in module order, from the run's seeded generator. The values are those
rules' draws in that order, not the draws of ``get_peft_model`` on a model in
host memory (which draws each adapter twice: in ``nn.Linear``'s constructor,
then by the rule). Initialisations that read the base weights (PiSSA, OLoRA,
LoftQ, EVA, CorDA, DoRA's magnitudes, trainable tokens) cannot run on a meta
base and are refused. ``modules_to_save`` copies are base tensors: the warm
start fills them from the base module's weights, as peft's deep copy does.

Every tensor of the wrapped model is either an adapter (peft's
``adapter_layer_names`` of a tuner layer) or a tensor of the base, whose name
in the transformers model :func:`base_names` gives (peft's ``base_layer``,
``original_module`` and ``modules_to_save.<adapter>`` levels dropped).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightstream.common.hf_config import peft_module

log = logging.getLogger("weightstream")

__all__ = [
    "ADAPTER",
    "LORA_INITS",
    "UNSUPPORTED",
    "base_fingerprint",
    "base_names",
    "config_fields",
    "lora_config",
    "peft_model",
    "wrap",
]

# The one adapter a run trains (peft's default name; ``save_pretrained`` writes it unnamed).
ADAPTER = "default"

# ``init_lora_weights`` values drawn without the base weights (Note [lora on meta]).
LORA_INITS = (True, False, "gaussian")

# LoraConfig fields whose setting needs the base weights at wrap time, or a
# layer the streaming engine has no rule for: the key -> why (its value is refused
# unless it is the field's default).
UNSUPPORTED = {
    "use_dora": "DoRA initialises its magnitudes from the base weights",
    "trainable_token_indices": "trainable tokens copy rows of the base embedding",
    "loftq_config": "LoftQ initialises from the base weights",
    "eva_config": "EVA initialises from activations of the base model",
    "corda_config": "CorDA initialises from the base weights",
    "lora_ga_config": "LoRA-GA initialises from gradients of the base model",
    "layer_replication": "layer replication copies base layers",
    "megatron_config": "Megatron layers are not streamed",
    "use_qalora": "QALoRA needs a quantized base",
    "use_bdlora": "block-diagonal LoRA is not supported yet",
    "target_parameters": "LoRA on bare parameters is not supported yet",
    "alora_invocation_tokens": "activated LoRA is not supported yet",
    "arrow_config": "Arrow routing is not supported yet",
    "monteclora_config": "MonteCLoRA is not supported yet",
    "velora_config": "VeLoRA is not supported yet",
    "kasa_config": "KaSA initialises from the base weights",
}


def config_fields() -> dict[str, dataclasses.Field]:
    """peft's ``LoraConfig`` fields a params file may set (its init fields, less
    ``peft_type``, which the section fixes)."""
    peft = peft_module()
    return {
        f.name: f for f in dataclasses.fields(peft.LoraConfig) if f.init and f.name != "peft_type"
    }


def lora_config(values: Mapping[str, Any]):
    """peft's ``LoraConfig`` of ``values`` (task type: a causal LM unless given)."""
    peft = peft_module()
    return peft.LoraConfig(**{"task_type": "CAUSAL_LM", **values})


def peft_model(model: nn.Module, config) -> nn.Module:
    """``peft.get_peft_model`` with this run's adapter name, its adapters left on meta."""
    with warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing while it wraps (a
        # FutureWarning in every run, from the libraries' versions, not the user's code).
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return peft_module().get_peft_model(
            model, config, adapter_name=ADAPTER, low_cpu_mem_usage=True
        )


def wrap(model: nn.Module, config) -> nn.Module:
    """``model`` (a transformers causal LM, on meta or in host memory) wrapped by
    ``peft.get_peft_model``, its adapters in host memory with peft's initial
    values (Note [lora on meta]); the base parameters are frozen by peft."""
    asked = config.target_modules  # as given: peft rewrites them for a mixture of experts
    asked = sorted(asked) if isinstance(asked, (list, set, tuple)) else asked
    try:
        wrapped = peft_model(model, config)
    except ValueError as exc:
        if "not found in the base model" not in str(exc):
            raise
        raise ValueError(
            f"peft.target_modules {config.target_modules!r} matched no module of the model "
            f"(peft: {exc}). Fix: name modules the model has, such as "
            f"{_adaptable_names(model)}."
        ) from None
    targets = getattr(wrapped.peft_config[ADAPTER], "target_parameters", None)
    if targets:
        # peft maps a mixture of experts' target_modules (gate_proj, up_proj, down_proj;
        # Mixtral's w1, w2, w3) onto the stacked experts' tensors, whose adapters it
        # applies as a parametrization during the forward: a base the streamer cannot place.
        raise ValueError(
            f"peft.target_modules {asked!r} make peft put LoRA on the bare parameters "
            f"{sorted(targets)} (a mixture of experts' stacked experts), and LoRA on bare "
            "parameters is not supported with a streamed base yet. Fix: target Linear "
            "modules only, such as "
            f"{[n for n in _adaptable_names(model) if n not in ('lm_head', 'gate')]}; or train "
            "the experts whole with modules_to_save: [experts]."
        )
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, layer in wrapped.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        for attr in layer.adapter_layer_names:
            holder = getattr(layer, attr, None)
            if not isinstance(holder, nn.Module) or ADAPTER not in holder:
                continue
            for owner in holder.modules():
                for key, p in owner._parameters.items():
                    if p is not None and p.is_meta:
                        owner._parameters[key] = nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                        )
        with torch.no_grad():
            layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)
        left = [n for n, p in _adapter_tensors(layer) if p.is_meta]
        assert not left, f"{name}: adapter tensors without values: {left}"
    _report(wrapped, config, BaseTunerLayer)
    return wrapped


def _report(wrapped: nn.Module, config, layer_class: type) -> None:
    """Log where the adapters went and what trains; warn of a ``target_modules`` entry that
    matched no module (peft refuses only a list that matches none)."""
    full = [name for name, m in wrapped.named_modules() if isinstance(m, layer_class) and name]
    adapted = collections.Counter(name.rsplit(".", 1)[-1] for name in full)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info(
        "LoRA adapters on %d modules (%s); %s of %s parameters train",
        sum(adapted.values()),
        ", ".join(f"{k} x{n}" for k, n in sorted(adapted.items())),
        f"{trainable:,}",
        f"{total:,}",
    )
    targets = config.target_modules
    if isinstance(targets, (list, set, tuple)):
        missed = sorted(t for t in targets if not any(n == t or n.endswith(f".{t}") for n in full))
        if missed:
            warnings.warn(
                f"peft.target_modules {missed} matched no module of the model, so they get no "
                f"adapters (adapted: {sorted(adapted)}). Fix: use the model's module names, "
                f"such as {_adaptable_names(wrapped)}.",
                stacklevel=3,
            )


def _adaptable_names(model: nn.Module) -> list[str]:
    """The last names of the modules with a matrix of weights (Linear, GPT-2's Conv1D,
    Embedding): what ``target_modules`` names. Inside a peft model, not the adapter
    layers' own parts (``base_layer``, ``lora_A``...)."""
    names = set()
    for name, m in model.named_modules():
        parts = name.split(".")
        if any(p == "base_layer" or p.startswith("lora_") for p in parts):
            continue
        weight = getattr(m, "weight", None)
        if name and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            names.add(parts[-1])
    return sorted(names)


def _adapter_tensors(layer) -> list[tuple[str, torch.Tensor]]:
    out = []
    for attr in layer.adapter_layer_names:
        holder = getattr(layer, attr, None)
        if isinstance(holder, nn.Module):
            out += [(f"{attr}.{n}", p) for n, p in holder.named_parameters()]
    return out


def base_names(wrapped: nn.Module) -> dict[str, str | None]:
    """Every parameter and persistent buffer of the peft model (all names of a tied
    one) -> its name in the base transformers model, or None for an adapter tensor
    (Note [lora on meta])."""
    peft_module()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    out: dict[str, str | None] = {}
    base = wrapped.get_base_model()
    prefix = next(n for n, m in wrapped.named_modules() if m is base)

    def join(a: str, b: str) -> str:
        return f"{a}.{b}" if a else b

    def visit(module: nn.Module, path: str, base_path: str | None) -> None:
        for key, p in module._parameters.items():
            if p is not None:
                out[join(path, key)] = None if base_path is None else join(base_path, key)
        for key, b in module._buffers.items():
            if b is not None and key not in module._non_persistent_buffers_set:
                out[join(path, key)] = None if base_path is None else join(base_path, key)
        for key, child in module._modules.items():
            if child is None:
                continue
            child_base = None if base_path is None else join(base_path, key)
            if isinstance(module, BaseTunerLayer) and base_path is not None:
                if key == "base_layer":
                    child_base = base_path
                elif key in module.adapter_layer_names:
                    child_base = None
            if isinstance(module, ModulesToSaveWrapper) and base_path is not None:
                if key == "original_module":
                    child_base = base_path
                elif key == "modules_to_save":  # {adapter: a copy of the base module}
                    for adapter, copy in child._modules.items():
                        visit(copy, join(join(path, key), adapter), base_path)
                    continue
            visit(child, join(path, key), child_base)

    visit(base, prefix, "")
    return out


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    patterns = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth", "*.mdl")
    return sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})


def base_fingerprint(path: str | os.PathLike) -> str:
    """A digest that tells one base model's weights from another's without reading
    them all: the weight files' names and sizes and their first and last MiB (a
    safetensors file's header: every name, shape and offset; and values at both
    ends). Cheap for a model of any size; not a checksum of every byte."""
    root = Path(os.fspath(path))
    digest = hashlib.sha256()
    for f in _weight_files(root):
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(2**20))
            if size > 2**20:
                fh.seek(max(2**20, size - 2**20))
                digest.update(fh.read(2**20))
    return digest.hexdigest()

"""Any Hugging Face ``transformers`` causal LM, built from its configuration.

``model: {name: hf, hf_config: PATH}`` in a params file names a
``config.json`` (or a folder holding one, as ``save_pretrained`` writes it);
the other keys of the section override the configuration's fields
(``num_hidden_layers: 2``). The model is built with
``AutoModelForCausalLM.from_config`` on the meta device, so a model of any
size costs nothing to build: the store gives it storage (host memory or the
disk store's files) and values (its initialization rule, or a checkpoint's
weights in a warm start). Buffers derived from the configuration (rotary
frequency tables) are computed on the host (``common.materialize``). The
model's decoder-layer class (``_no_split_modules``) is its default streaming
unit. Nothing is downloaded: configurations and weights are local files.
"""

from __future__ import annotations

import torch
from torch import nn

from weightstream.common.hf_config import load_config, transformers_module

__all__ = ["build", "is_hf_model", "load_config", "unit_classes"]


def build(config, device: torch.device | str = "meta") -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the meta device, then materialized
    on ``device`` with the library's initialization (``"meta"``: shapes only)."""
    from weightstream.common.materialize import materialize, materialize_buffers

    transformers = transformers_module()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    device = torch.device(device)
    if device.type != "meta":
        materialize_buffers(model, device)
        materialize(model, lambda p: torch.zeros(p.shape, dtype=p.dtype, device=device))
    return model


def unit_classes(model: nn.Module) -> list[str] | None:
    """The model's decoder-layer classes: its default streaming units."""
    names = getattr(model, "_no_split_modules", None)
    return list(names) if names else None


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "_no_split_modules")

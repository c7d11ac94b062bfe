"""A LoRA run's checkpoint out to Hugging Face: peft's adapter folder, or merged weights.

A LoRA checkpoint holds the trained tensors only (Note [lora checkpoints] in
cli/run_lora.py): the adapters under the peft model's names, and the metadata
``peft`` record (the base folder, its fingerprint, the LoraConfig values).
Both exports rebuild the run's peft model on the meta device from the base's
configuration (common/lora.py) and put the checkpoint's tensors into it
(``assign``: no copy), so peft's own code names, scales and merges them:

* ``--to peft``: ``save_pretrained`` writes ``adapter_config.json`` and
  ``adapter_model.safetensors`` (the names peft writes, the adapter name
  dropped), which ``PeftModel.from_pretrained(base, OUT)`` loads.
* ``--to hf``: the base's weights file by file, tensor by tensor, each under
  its own name; a LoRA layer's weight goes out as peft's ``merge`` of it (base
  + B @ A * scaling, what ``merge_and_unload`` gives), a ``modules_to_save``
  module's as its trained copy. Memory: one base tensor at a time and the
  adapters.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightstream.checkpoint.hf_layout import file_names
from weightstream.checkpoint.lazy import load
from weightstream.checkpoint.opener import open_source
from weightstream.checkpoint.source import LeafInfo, Source
from weightstream.common import lora
from weightstream.common.hf_config import peft_module, transformers_module


def lora_record(path: str | os.PathLike) -> dict | None:
    """The ``peft`` record of a LoRA run's checkpoint (None: not one)."""
    with load(path) as state:
        metadata = state.get("metadata") if isinstance(state, dict) else None
        record = metadata.get("peft") if isinstance(metadata, dict) else None
        if hasattr(record, "to_dict"):
            record = record.to_dict()
    return record if isinstance(record, dict) else None


def _peft_model(src: Path, record: dict, cfg) -> nn.Module:
    """The run's peft model on meta, its trained tensors from the checkpoint."""
    transformers = transformers_module()
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(cfg)
    wrapped = lora.peft_model(base, lora.lora_config(record["lora_config"]))
    trained = dict(load(src, map_location="cpu")["model"])  # the adapters: small
    expected = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    if set(trained) != expected:
        missing, unexpected = sorted(expected - set(trained)), sorted(set(trained) - expected)
        raise ValueError(
            f"convert(): {src} does not hold the adapters of its recorded LoraConfig on this "
            f"base configuration (missing {missing[:3]}, unexpected {unexpected[:3]}). Fix: "
            "pass --config with the config.json of the base the run trained on."
        )
    wrapped.load_state_dict(trained, strict=False, assign=True)
    return wrapped


def _base_folder(record: dict, base: str | os.PathLike | None) -> Path:
    path = Path(os.fspath(base)) if base is not None else Path(record["base"])
    if not path.exists():
        raise ValueError(
            f"convert(): the LoRA checkpoint's base model {path} does not exist (the run "
            f"trained on {record['base']}). Fix: pass --base with that base model's folder."
        )
    if lora.base_fingerprint(path) != record.get("base_fingerprint"):
        raise ValueError(
            f"convert(): {path} holds other weights than the base the adapters were trained "
            f"on ({record['base']}). Fix: pass --base with that base model's folder."
        )
    return path


def to_peft(src: Path, dst: Path, record: dict, cfg, base: str | os.PathLike | None) -> list[Path]:
    """peft's adapter folder of the LoRA checkpoint ``src`` (see the module doc)."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"convert(): --to peft writes a folder, but {dst} is a file.")
    wrapped = _peft_model(src, record, cfg)
    base_path = Path(os.fspath(base)) if base is not None else Path(record["base"])
    wrapped.peft_config[lora.ADAPTER].base_model_name_or_path = str(base_path)
    # No embedding layers beside the adapters: the run never resizes the vocabulary
    # (and "auto" would look the base up on the Hub).
    wrapped.save_pretrained(dst, save_embedding_layers=False)
    return [dst / "adapter_config.json", dst / "adapter_model.safetensors"]


class MergedSource(Source):
    """The base model's weights (a :class:`Source`) with the adapters merged in, read
    tensor by tensor (see the module doc)."""

    def __init__(self, base: Source, wrapped: nn.Module) -> None:
        peft_module()
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.base = base
        self.path, self.format, self.tree = base.path, base.format, base.tree
        names = lora.base_names(wrapped)
        trained = dict(wrapped.named_parameters())
        modules = dict(wrapped.named_modules())
        # The base model's name of each file key (transformers' renames, as a warm start).
        file_to_model = {v: k for k, v in file_names(wrapped.get_base_model(), base.keys()).items()}
        by_model_name: dict[str, Any] = {}
        for name, base_name in names.items():
            if base_name is None:
                continue
            module_name, _, attr = name.rpartition(".")
            owner_name = module_name.removesuffix(".base_layer")
            layer = modules.get(owner_name)
            if module_name.endswith(".base_layer") and isinstance(layer, BaseTunerLayer):
                by_model_name[base_name] = (layer, attr)
            elif name in trained and trained[name].requires_grad:
                by_model_name[base_name] = trained[name]  # a modules_to_save copy
        self._merge = {
            key: by_model_name[file_to_model.get(key, key)]
            for key in base.keys()
            if file_to_model.get(key, key) in by_model_name
        }
        unmerged = sorted(set(by_model_name) - {file_to_model.get(k, k) for k in base.keys()})
        if unmerged:
            # A tensor transformers makes of several of the file's (Note [converted
            # tensors] in checkpoint/hf_layout.py): no one file tensor to merge it into.
            raise ValueError(
                f"convert(): the trained {', '.join(map(repr, unmerged[:3]))}"
                f"{' ...' if len(unmerged) > 3 else ''} cannot be merged into the base's "
                "files, which hold it in another layout (transformers converts it on load). "
                "Fix: export the adapters with --to peft and merge them with peft's "
                "merge_and_unload()."
            )
        self._file_key = {(id(v[0]), v[1]): k for k, v in self._merge.items() if type(v) is tuple}

    def read(self, key: str) -> Any:
        value = self.base.read(key)
        how = self._merge.get(key)
        if how is None:
            return value
        if isinstance(how, torch.Tensor):
            return how.detach().to(value.dtype).clone()
        layer, attr = how
        return self._merged(layer, attr, key, value)

    def _merged(self, layer, attr: str, key: str, value: torch.Tensor) -> torch.Tensor:
        """peft's merge of ``layer`` on its base tensors from the file; ``attr`` of it."""
        base_layer = layer.get_base_layer()
        saved = dict(base_layer._parameters)
        try:
            for name, p in saved.items():
                if p is None:
                    continue
                other = self._file_key.get((id(layer), name))
                real = value if name == attr else self.base.read(other) if other else None
                if real is None:
                    raise ValueError(f"convert(): the base has no tensor for {key}'s {name}")
                base_layer._parameters[name] = nn.Parameter(real.clone(), requires_grad=False)
            with torch.no_grad():
                layer.merge(adapter_names=[lora.ADAPTER])
            return base_layer._parameters[attr].detach()
        finally:
            # Back to meta and unmerged: the next tensor of this layer merges afresh.
            base_layer._parameters.update(saved)
            layer.merged_adapters.clear()

    def describe(self, key: str) -> LeafInfo:
        return self.base.describe(key)

    def tie(self, key: str) -> Hashable | None:
        return self.base.tie(key)

    def properties(self) -> dict[str, Any]:
        return self.base.properties()

    def close(self) -> None:
        self.base.close()


def open_merged(src: Path, record: dict, cfg, base: str | os.PathLike | None) -> MergedSource:
    """The merged weights of the LoRA checkpoint ``src`` as a :class:`Source` (close it)."""
    wrapped = _peft_model(src, record, cfg)
    source = open_source(_base_folder(record, base))
    try:
        return MergedSource(source, wrapped)
    except BaseException:
        source.close()
        raise

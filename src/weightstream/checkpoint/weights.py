"""Warm start: a model's weights from a checkpoint, one tensor at a time.

``load_weights(model, path)`` fills every parameter and persistent buffer of
``model`` from a checkpoint: one of ours (a trainer checkpoint's ``model``
entry, or a saved state dict), a safetensors file, or a Hugging Face model
folder (``model.safetensors`` or a sharded index). The file is read lazily:
each tensor is read, checked and copied into the model (through
``model.load_state_dict``, so a streaming engine's store takes it where it
keeps that tensor: host memory, a disk-store file, only on the owning rank of
a sharded store), and then dropped, so the load holds one checkpoint tensor at
a time besides the model. A tied parameter is filled once, from whichever of
its names the checkpoint has (a Hugging Face GPT-2 file holds the embedding
and not the tied head). A transformers model reads the file's names as
``from_pretrained`` does, through the library's renames for its class (a
GPT-NeoX file's ``embed_out`` is the model's ``lm_head``; legacy ``gamma`` and
``beta``), and its conversions that make one tensor of several (Note [converted
tensors] in hf_layout.py). Every tensor the model needs must be there with its shape: a
missing or misshapen one is an error naming it, raised before anything is
copied.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

from weightstream.checkpoint.hf_layout import Converted, file_sources
from weightstream.checkpoint.lazy import load
from weightstream.common.pages import release_pages


def _weights_of(state) -> Mapping:
    """The name -> tensor mapping of a loaded checkpoint."""
    inner = state.get("model") if isinstance(state, Mapping) else None
    if isinstance(inner, Mapping):
        return inner  # a trainer checkpoint (or {"model": state_dict, ...})
    if not isinstance(state, Mapping):
        raise ValueError("the checkpoint holds no mapping of weights")
    return state


def _targets(model: nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's tensors to fill, each with all of its names (tied ones share one)."""
    by_tensor: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append((name, p))
    for mod_name, m in model.named_modules():
        for key, b in m._buffers.items():
            if b is not None and key not in m._non_persistent_buffers_set:
                name = f"{mod_name}.{key}" if mod_name else key
                by_tensor.setdefault(id(b), []).append((name, b))
    return list(by_tensor.values())


def load_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    name_map: Callable[[str], tuple[str, bool]] | None = None,
    only: Callable[[str], bool] | None = None,
    renames_of: nn.Module | None = None,
) -> list[str]:
    """Fill ``model``'s weights from the checkpoint at ``path`` (see the module doc).

    ``name_map(model_name) -> (checkpoint_name, transposed)`` translates names
    (a zoo model read from a Hugging Face file, common/hf_names.py; a LoRA
    model's base tensors, common/lora.py); a name is looked up as it is first.
    ``only(model_name)``: the tensors to fill (default: all); the others keep
    their values (a LoRA model's adapters). ``renames_of``: the transformers
    model whose renames apply to the file's names (default: ``model``; a LoRA
    model's base). Returns the checkpoint names read. Raises ValueError naming
    the tensors that are missing or of another shape.
    """
    with load(path) as state:
        weights = _weights_of(state)
        owner = model if renames_of is None else renames_of  # whose transformers names

        def candidates(name: str) -> list[tuple[str, bool]]:
            """(file name, stored transposed): the name itself, then the mapped one."""
            return [(name, False)] + ([name_map(name)] if name_map is not None else [])

        targets = _targets(model)
        wanted = {c for names in targets for n, _ in names for c, _ in candidates(n)}
        # The model's name -> the file's key, or the conversion that makes it.
        file_key = file_sources(owner, list(weights), wanted)
        for group in {id(v): v for v in file_key.values() if isinstance(v, Converted)}.values():
            group.dry_run(weights, owner, path)
            file_key.update(dict.fromkeys(group.shapes, group))
        available = set(file_key)

        # (model name, file name, stored transposed, the model's tensor)
        plan: list[tuple[str, str, bool, torch.Tensor]] = []
        missing: list[str] = []
        # A tied parameter's other names in the file: the same values stored again (a
        # file of a tied model) are used too; other values are not (an untied file).
        others: dict[str, list[tuple[str, bool]]] = {}
        for names in targets:
            if only is not None and not any(only(n) for n, _ in names):
                continue
            present = [
                (n, c, flip) for n, _ in names for c, flip in candidates(n) if c in available
            ]
            if not present:
                missing.append(candidates(names[0][0])[-1][0])
                continue
            found = present[0]
            others[found[1]] = [(c, flip) for _, c, flip in present[1:] if c != found[1]]
            plan.append((*found, names[0][1]))
        if missing:
            shown = ", ".join(map(repr, missing[:8]))
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"cannot warm-start from {path}: it has no tensor {shown}{more} that the model "
                f"needs ({len(available)} tensors in the file). Fix: give a checkpoint of this "
                "architecture (the same model config), or load only what it holds."
            )
        wrong = []
        for _, name, flip, target in plan:
            file_name = file_key[name]
            if isinstance(file_name, Converted):
                if file_name.shapes[name] != tuple(target.shape):
                    wrong.append(
                        f"{name!r} is {file_name.shapes[name]} as transformers makes it of the "
                        f"file's {file_name.sources[0][0]!r} ..., {tuple(target.shape)} here"
                    )
                continue
            info = weights.describe(file_name) if hasattr(weights, "describe") else None
            if info is not None and info.shape is None:
                wrong.append(f"{file_name!r} is a {info.kind} in the file, not a tensor")
                continue
            shape = tuple(info.shape) if info is not None else None
            if shape is not None and flip:
                shape = shape[::-1]
            if shape is not None and shape != tuple(target.shape):
                wrong.append(f"{file_name!r} is {shape} in the file, {tuple(target.shape)} here")
        if wrong:
            raise ValueError(
                f"cannot warm-start from {path}: {'; '.join(wrong[:5])}. Fix: give a checkpoint "
                "of the same model shape (hidden size, layers, vocabulary)."
            )
        used = set()
        # A conversion's targets still to copy (it runs once, at its first target).
        pending: dict[int, dict[str, torch.Tensor]] = {}
        needs: dict[int, set[str]] = {}
        for _, name, _, _ in plan:
            if isinstance(file_key[name], Converted):
                needs.setdefault(id(file_key[name]), set()).add(name)
        for model_name, name, flip, target in plan:
            file_name = file_key[name]
            if isinstance(file_name, Converted):
                group = file_name
                if id(group) not in pending:
                    made = group.convert(lambda key: weights[key], owner)  # reads its sources
                    pending[id(group)] = {k: made[k] for k in needs[id(group)]}
                    used.update(key for key, _ in group.sources)
                    del made
                value = pending[id(group)].pop(name)
                if not pending[id(group)]:
                    del pending[id(group)]
            else:
                value = weights[file_name]  # reads this one tensor
                if flip:
                    value = value.t()
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"cannot warm-start from {path}: {file_name!r} is {tuple(value.shape)} "
                        f"in the file, {tuple(target.shape)} here. Fix: give a checkpoint of the "
                        "same model shape."
                    )
                for other, other_flip in others.get(name, []):
                    if isinstance(file_key[other], Converted):
                        continue  # tied to a converted tensor: not read again to compare
                    again = weights[file_key[other]]
                    if torch.equal(again.t() if other_flip else again, value):
                        used.add(file_key[other])
                    del again
                used.add(file_name)
            result = model.load_state_dict({model_name: value}, strict=False)
            assert not result.unexpected_keys, result.unexpected_keys
            release_pages([target])  # a disk store's file: written, its pages go back
            del value
        unused = sorted(set(weights) - used)
        if unused:
            warnings.warn(
                f"warm start from {path}: {len(unused)} tensor(s) of the file are not used by "
                f"the model ({', '.join(map(repr, unused[:5]))}"
                f"{', ...' if len(unused) > 5 else ''}).",
                UserWarning,
                stacklevel=2,
            )
        return sorted(used)

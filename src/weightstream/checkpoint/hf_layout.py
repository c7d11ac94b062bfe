"""Hugging Face files' names and layout, both ways: transformers' own renames and
conversions of a model class, applied to a file's tensors for a warm start
(``file_sources``, :class:`Converted`) and reverted for an export
(:class:`SavedLayout`), a tensor (or one converted group) at a time.

Note [converted tensors]
------------------------
transformers 5 keeps a mixture-of-experts layer's experts as one stacked
parameter (``mlp.experts.gate_up_proj``: experts x 2·intermediate x hidden),
while the files on the Hub, and those ``save_pretrained`` writes, hold one
tensor per expert and projection (``mlp.experts.3.gate_proj.weight``).
``from_pretrained`` makes the one of the many with the class's
``WeightConverter`` (stack, then concatenate). A warm start applies the same
converters, through the library's own objects, a target at a time: the file's
tensors of one converted parameter are read, converted and copied into the
model, then dropped (memory: that parameter's sources and its result, e.g.
one layer's experts). Shapes are checked before anything is read: each
converter runs once on meta tensors of its sources' shapes, which gives its
targets' names and shapes.

An export reverts them (:class:`SavedLayout`, Note [export to hf] in
convert.py): ``revert_weight_conversion`` on meta placeholders names the file's
tensors and says which model tensor each comes from; the writer then reads one
stacked tensor, splits it with the same call on real values and writes its
parts one after another (memory: one stacked tensor and its parts).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from weightstream.checkpoint.source import LeafInfo
from weightstream.checkpoint.tree import Branch, Leaf, Subtree, TreeView
from weightstream.common.hf_config import transformers_module


def _transforms(model: nn.Module) -> tuple[list, list]:
    """transformers' renames and converters for ``model``'s class (those ``from_pretrained``
    applies), or two empty lists for a model that is not a transformers one."""
    if "transformers" not in sys.modules:
        return [], []  # not a transformers model (and no import of the library for it)
    transformers = transformers_module()  # transformers 5: its renames are in these modules
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    if not isinstance(model, transformers.PreTrainedModel):
        return [], []
    mapping = get_model_conversion_mapping(model)
    renames = [t for t in mapping if type(t) is WeightRenaming]
    return renames, [t for t in mapping if isinstance(t, WeightConverter)]


def _renamed(key: str, renames: list) -> str:
    for rename in renames:
        key, _ = rename.rename_source_key(key)
    return key


def file_names(model: nn.Module, keys) -> dict[str, str]:
    """The model's name of each file key -> that key: transformers' own renames for a
    transformers model (those ``from_pretrained`` applies; its tensor-merging
    conversions are not renames and are not applied), the keys themselves otherwise."""
    return _renamed_keys(keys, _transforms(model)[0])


def _renamed_keys(keys, renames: list) -> dict[str, str]:
    return {_renamed(key, renames): key for key in keys}


@dataclass
class Converted:
    """Model tensors transformers makes from several of the file's (Note [converted
    tensors]): a pristine copy of the class's converter, the file's keys in the order
    ``from_pretrained`` hands them to it, and (after :meth:`dry_run`) each target's shape."""

    converter: Any  # transformers.core_model_loading.WeightConverter
    layer: str  # the first target's name: convert() expands the others from it
    sources: list[tuple[str, str]] = field(default_factory=list)  # (file key, its pattern)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def convert(self, read: Callable[[str], torch.Tensor], model: nn.Module) -> dict:
        """Target name -> tensor, from the sources as ``read(key)`` gives them."""
        converter = copy.deepcopy(self.converter)  # convert() consumes what it collected
        for key, pattern in self.sources:
            converter.add_tensor(self.layer, key, pattern, lambda key=key: read(key))
        out = converter.convert(self.layer, model=model, config=getattr(model, "config", None))
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def dry_run(self, weights, model: nn.Module, path) -> None:
        """The targets' names and shapes, from meta tensors of the sources' shapes."""

        def meta(key: str) -> torch.Tensor:
            info = weights.describe(key) if hasattr(weights, "describe") else None
            if info is None or info.shape is None:
                value = weights[key]  # a source without a cheap description: read it
                return torch.empty(value.shape, dtype=value.dtype, device="meta")
            return torch.empty(info.shape, device="meta")

        try:
            out = self.convert(meta, model)
        except Exception as exc:
            keys = ", ".join(repr(k) for k, _ in self.sources[:3])
            raise ValueError(
                f"cannot warm-start from {path}: transformers' conversion of {keys}"
                f"{' ...' if len(self.sources) > 3 else ''} into {self.layer!r} failed "
                f"({type(exc).__name__}: {exc}). Fix: give a checkpoint of this architecture "
                "(the same model config)."
            ) from exc
        self.shapes = {k: tuple(v.shape) for k, v in out.items()}


def file_sources(model: nn.Module, keys, wanted: set[str]) -> dict[str, str | Converted]:
    """The model's name of each tensor the file gives -> the file key it is read from, or
    the :class:`Converted` that makes it (Note [converted tensors]). ``wanted``: the
    model's tensor names; a key that a converter would take for a tensor the model does
    not have keeps its own name, as ``from_pretrained`` does."""
    renames, converters = _transforms(model)
    if not converters:
        return _renamed_keys(keys, renames)
    from transformers.core_model_loading import dot_natural_key

    sources: dict[str, str | Converted] = {}
    groups: dict[str, Converted] = {}
    for key in sorted(keys, key=dot_natural_key):  # experts in their numeric order
        name, pattern = _renamed(key, renames), None
        for converter in converters:  # at most one converter takes a key
            converted, pattern = converter.rename_source_key(name)
            if pattern is not None:
                break
        if pattern is None or converted not in wanted:
            sources[name] = key
            continue
        group = groups.get(converted)
        if group is None:
            group = groups[converted] = Converted(copy.deepcopy(converter), converted)
        group.sources.append((key, pattern))
    for group in groups.values():
        sources[group.layer] = group  # its other targets are added after the dry run
    return sources


class SavedLayout(TreeView):
    """``subtree`` (a model's weights under its own names, a ``TreeView``'s
    ``_ws_subtree()``) under the names and in the layout ``save_pretrained`` writes for
    ``model``'s class (the module doc): renamed tensors are read as they are, a
    converted one is read once and split into the file's tensors, written in a row.
    Where transformers' revert cannot be planned tensor by tensor (a part made of
    several model tensors), the weights keep the model's names, which
    ``from_pretrained`` reads as well; :attr:`reverted` says which it is. A tied
    tensor is written once, under the name ``save_pretrained`` keeps."""

    def __init__(self, subtree: Subtree, model: nn.Module) -> None:
        self._subtree = subtree
        self._model = model
        # (file name, the model's name of its source, whether it is a part of it)
        self._entries: list[tuple[str, str, bool]] = []
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._leaf: dict[str, str] = {}  # the model's name -> its leaf key in the source
        self._split: tuple[str, dict[str, torch.Tensor]] | None = None  # the last one split
        self.reverted = self._plan()

    def _plan(self) -> bool:
        node, _, _, describe = self._subtree
        if not isinstance(node, Branch):
            return False
        placeholders = {}
        for key, child in zip(node.keys, node.children):
            info = describe(child.key) if isinstance(child, Leaf) else None
            if not isinstance(key, str) or info is None or info.kind != "tensor":
                return False
            placeholders[key] = torch.empty(info.shape, device="meta")
            self._leaf[key] = child.key
        for key in _tied_copies(self._model, set(placeholders)):
            del placeholders[key]
        renames, converters = _transforms(self._model)
        if not (renames or converters):
            self._entries = [(key, key, False) for key in placeholders]
            return True
        from transformers.core_model_loading import revert_weight_conversion

        name_of = {id(t): k for k, t in placeholders.items()}
        try:
            whole = revert_weight_conversion(self._model, dict(placeholders))
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            return False  # a conversion these placeholders cannot take
        renamed = {name_of[id(t)]: k for k, t in whole.items() if id(t) in name_of}
        parts = {k: tuple(t.shape) for k, t in whole.items() if id(t) not in name_of}
        for key, placeholder in placeholders.items():
            if key in renamed:
                self._entries.append((renamed[key], key, False))
                continue
            try:
                split = revert_weight_conversion(self._model, {key: placeholder})
            except (RuntimeError, ValueError, TypeError, NotImplementedError):
                return False
            for name, t in split.items():
                if parts.pop(name, None) != tuple(t.shape):
                    return False  # not the whole revert's part: made of several tensors
                self._entries.append((name, key, True))
                self._shapes[name] = tuple(t.shape)
        return not parts

    def _part(self, name: str, source: str) -> torch.Tensor:
        if self._split is None or self._split[0] != source:
            from transformers.core_model_loading import revert_weight_conversion

            self._split = None  # the previous tensor's parts go first
            value = self._subtree[1](self._leaf[source])
            self._split = (source, revert_weight_conversion(self._model, {source: value}))
        return self._split[1][name]

    def _ws_subtree(self) -> Subtree:
        if not self.reverted:
            return self._subtree
        _, read, tie, describe = self._subtree
        entries = {name: (source, part) for name, source, part in self._entries}

        def read_(name: str):
            source, part = entries[name]
            return self._part(name, source) if part else read(self._leaf[source])

        def tie_(name: str):
            source, part = entries[name]
            return None if part else tie(self._leaf[source])

        def describe_(name: str) -> LeafInfo:
            source, part = entries[name]
            info = describe(self._leaf[source])
            if not part:
                return info
            shape = self._shapes[name]
            itemsize = getattr(torch, info.dtype.removeprefix("torch.")).itemsize
            return LeafInfo(name, "tensor", shape, info.dtype, itemsize * math.prod(shape))

        names = [name for name, _, _ in self._entries]
        return Branch("dict", names, [Leaf(n) for n in names]), read_, tie_, describe_


def _tied_copies(model: nn.Module, names: set[str]) -> set[str]:
    """The names among ``names`` of tensors ``model`` ties to another one that is in
    ``names`` too (its head to its embedding): ``save_pretrained`` leaves them out, and
    ``from_pretrained`` ties them again."""
    tied_to = getattr(model, "_tied_weights_keys", None) or {}
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    copies: set[str] = set()
    for group in groups.values():
        present = [n for n in group if n in names]
        if len(present) > 1:
            kept = next((n for n in present if n not in tied_to), present[0])
            copies.update(n for n in present if n != kept)
    return copies

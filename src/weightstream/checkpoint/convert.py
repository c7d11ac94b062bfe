"""Converting between H5 checkpoints, safetensors (single or sharded) and torch files.

Every direction reads the source one leaf at a time through a
:class:`SourceView`; writing H5 and safetensors then streams tensor by tensor
(memory: the largest tensor, not the state). Writing a torch file needs the
whole state in memory (see :mod:`.torchfile`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import torch

from weightstream.checkpoint import lora_export
from weightstream.checkpoint.hf_layout import SavedLayout
from weightstream.checkpoint.lazy import load
from weightstream.checkpoint.opener import open_source
from weightstream.checkpoint.safetensors_io import write_safetensors
from weightstream.checkpoint.source import LeafInfo, Source
from weightstream.checkpoint.torchfile import write_torch
from weightstream.checkpoint.tree import Branch, Leaf, Node, Subtree, TreeView, find_subtree
from weightstream.checkpoint.writer import atomic_path, save
from weightstream.common.hf_config import load_config, transformers_module
from weightstream.common.hf_names import hf_config_fields, hf_name_map

FORMATS = ("h5", "safetensors", "torch", "hf", "peft")

_SUFFIXES = {
    ".safetensors": "safetensors",
    ".json": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".h5": "h5",
    ".hdf5": "h5",
    ".mdl": "h5",
}


class SourceView(TreeView):
    """A source (or the subtree at ``key``) as something :func:`save` can stream;
    ``names``: a top-level key -> the name to write it under; ``transposed``: the leaf
    keys of matrices written transposed."""

    def __init__(
        self,
        source: Source,
        key: str | None = None,
        names: dict[str, str] | None = None,
        transposed: frozenset[str] = frozenset(),
    ) -> None:
        self.source = source
        self.names = names or {}
        self.transposed = transposed
        node = source.tree if not key else find_subtree(source.tree, key)
        if node is None:
            top = getattr(source.tree, "keys", [])
            raise KeyError(
                f"{source.path} has no key {key!r}; its top-level keys are {list(top)[:20]}."
            )
        self.node: Node = node

    def _ws_subtree(self) -> Subtree:
        node = self.node
        if self.names and isinstance(node, Branch):
            keys = [self.names.get(k, k) if isinstance(k, str) else k for k in node.keys]
            node = Branch(node.kind, keys, node.children, node.metadata)
        if not self.transposed:
            return node, self.source.read, self.source.tie, self.source.describe
        flipped = self.transposed

        def read(key: str):
            value = self.source.read(key)
            return value.t() if key in flipped else value  # written in slabs (no copy)

        def describe(key: str) -> LeafInfo:
            info = self.source.describe(key)
            return dataclasses.replace(info, shape=info.shape[::-1]) if key in flipped else info

        return node, read, self.source.tie, describe


def _looks_like_a_directory(dst: str | os.PathLike) -> bool:
    """An existing directory, a path written with a trailing separator, or a new name
    without a suffix: never silently an H5 file named like a folder."""
    text = os.fspath(dst)
    path = Path(text)
    return path.is_dir() or text.endswith((os.sep, "/")) or (not path.exists() and not path.suffix)


def output_format(path: str | os.PathLike, to: str | None) -> str:
    """The format to write: ``to`` if given, else from the path's suffix: a directory-like
    destination is a safetensors folder; a suffix of none of the formats is an error
    (a misspelt ``.safetensor`` would otherwise get another format silently)."""
    if to is not None:
        aliases = {"pt": "torch", "pth": "torch", "hdf5": "h5", "mdl": "h5"}
        fmt = aliases.get(to.lower(), to.lower())
        if fmt not in FORMATS:
            raise ValueError(f"convert(): unknown format {to!r}; choose one of {FORMATS}.")
        if fmt in ("h5", "torch") and _looks_like_a_directory(path):
            raise ValueError(
                f"convert(): {os.fspath(path)} is (or is named like) a directory, but --to "
                f"{fmt} writes one file. Fix: give a file name ({'.mdl' if fmt == 'h5' else '.pt'}), "
                "or --to safetensors / --to hf for a folder."
            )
        return fmt
    if _looks_like_a_directory(path):
        return "safetensors"
    suffix = Path(os.fspath(path)).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"convert(): the format of {os.fspath(path)} is unknown: its suffix {suffix!r} is "
            f"none of {' '.join(sorted(_SUFFIXES))}. Fix: name the format with --to (one of "
            f"{', '.join(FORMATS)}), or give the file one of those suffixes."
        )
    return _SUFFIXES[suffix]


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str | None = None,
    key: str | None = None,
    allow_pickle: bool = False,
    max_shard_size: int | None = None,
    compression: str | None = None,
    fsync: bool = True,
    config: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
) -> list[Path]:
    """Convert the checkpoint ``src`` to ``dst``; returns the files written.

    Args:
        src: any checkpoint :func:`load` reads.
        dst: the output. Its format is ``to`` ("h5", "safetensors" or
            "torch") or follows the suffix: .safetensors, .index.json or an
            existing directory or a new name without a suffix -> safetensors;
            .pt/.pth/.bin -> torch; .mdl/.h5/.hdf5 -> H5; any other suffix is an
            error that asks for ``to``.
        key: convert only this subtree (e.g. "model" for the weights of a
            trainer checkpoint); its keys lose the prefix.
        allow_pickle: needed to read a torch file (or pickled values).
        max_shard_size: bytes per safetensors shard (Hugging Face layout).
        compression: for H5 output: None, "gzip" or "lz4".
        config: with ``to="hf"``, the ``config.json`` (or a folder holding one) to
            write beside the weights; default: the one the run recorded. With
            ``to="peft"``: the base model's configuration.
        base: with a LoRA run's checkpoint, the base model's folder (default: the
            one the run recorded).

    ``to="hf"`` writes a Hugging Face model folder (Note [export to hf]); of a
    LoRA run's checkpoint, the base with the adapters merged. ``to="peft"``
    writes a LoRA run's adapters as peft's ``save_pretrained`` does
    (checkpoint/lora_export.py).
    """
    dst_path = Path(os.fspath(dst))
    if to is None and max_shard_size is not None:
        to = "safetensors"  # sharding exists only for safetensors
    fmt = output_format(dst, to)
    if fmt == "hf":
        return _to_hf(src, dst_path, config, allow_pickle, max_shard_size, fsync, base)
    if fmt == "peft":
        return _to_peft(src, dst_path, config, base)
    if config is not None:
        raise ValueError("convert(): config applies only to --to hf and --to peft.")
    if base is not None:
        raise ValueError("convert(): base applies only to --to hf and --to peft.")
    if fmt != "safetensors" and max_shard_size is not None:
        raise ValueError("convert(): max_shard_size applies only to safetensors output.")
    if fmt != "h5" and compression is not None:
        raise ValueError("convert(): compression applies only to H5 output.")
    with open_source(src, allow_pickle=allow_pickle) as source:
        view = SourceView(source, key)
        if fmt == "h5":
            save(view, dst_path, compression=compression, fsync=fsync)
            return [dst_path]
        if fmt == "safetensors":
            return write_safetensors(view, dst_path, max_shard_size=max_shard_size, fsync=fsync)
        return [write_torch(view, dst_path, fsync=fsync)]


# Note [export to hf]
# -------------------
# ``convert(CKPT, OUT_DIR, to="hf")`` hands a run's weights back to the
# Hugging Face ecosystem: OUT_DIR gets ``model.safetensors`` (or shards and
# ``model.safetensors.index.json`` above ``max_shard_size``), written tensor by
# tensor from the checkpoint, and ``config.json``, so that
# ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` builds the model and loads
# every weight. The weights are the trainer checkpoint's ``model`` entry (or the
# whole file when it holds weights only), under the names they have: a model of
# ``name: hf`` has transformers' own names, written as ``save_pretrained``
# writes them (the library's renames for the class reverted, GPT-NeoX's
# ``lm_head`` as ``embed_out``, and a mixture of experts' stacked experts
# split into a tensor per expert, Note [converted tensors] in hf_layout.py:
# other readers, older transformers among them, know only those). The
# configuration is ``config`` when given, else the one the run recorded (the
# checkpoint's params: the ``hf_config`` file with the section's overrides
# applied); ``use_cache``, turned off for training, is turned on again, as
# transformers' default. A zoo model's checkpoint (``gpt2``, ``llama``, ``gptj``)
# exports to transformers' model of its architecture: its names and transposed
# matrices and a config from the run's model section (common/hf_names.py). An
# export whose names are not those of the configuration's model is refused,
# before anything is written: ``from_pretrained`` would start the missing weights
# at random and say so only in a log line.


def _to_hf(
    src, dst: Path, config, allow_pickle: bool, max_shard_size: int | None, fsync: bool, base
) -> list[Path]:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"convert(): --to hf writes a folder, but {dst} is a file.")
    with open_source(src, allow_pickle=allow_pickle) as source:
        record = _lora_record_of(source)
        if record is None and base is not None:
            raise ValueError("convert(): --base applies only to a LoRA run's checkpoint.")
        top = list(getattr(source.tree, "keys", []))
        key = "model" if "model" in top else None
        zoo = _recorded_model(source)
        zoo = zoo if zoo is not None and hf_name_map(zoo.get("name")) is not None else None
        if zoo is not None and record is None:
            view = _zoo_view(source, key, zoo["name"])
            cfg = load_config(config) if config is not None else _zoo_config(zoo, view)
        else:
            cfg = _hf_config(source, config)
        if record is not None:
            # The base's files, under their own names, with the adapters merged.
            with lora_export.open_merged(Path(src), record, cfg, base) as merged:
                dst.mkdir(parents=True, exist_ok=True)
                view = SourceView(merged)
                written = write_safetensors(view, dst, max_shard_size=max_shard_size, fsync=fsync)
        else:
            with torch.device("meta"):  # the configuration's model, for its names
                model = transformers_module().AutoModelForCausalLM.from_config(cfg)
            own = view if zoo is not None else SourceView(source, key)
            _check_names(model, own, source.path)
            if zoo is None:
                view = SavedLayout(own._ws_subtree(), model)
            dst.mkdir(parents=True, exist_ok=True)
            written = write_safetensors(view, dst, max_shard_size=max_shard_size, fsync=fsync)
        dtype = _written_dtype(written)
        if dtype not in (None, "float32"):
            # bf16 masters (runconfig.master_dtype) export as bf16: the config says so,
            # and from_pretrained builds the model in it (transformers >= 5 names it
            # ``dtype``; ``torch_dtype`` is deprecated there).
            cfg.dtype = dtype
        target = dst / "config.json"
        with atomic_path(target, fsync=fsync) as tmp:
            tmp.write_text(cfg.to_json_string(), encoding="utf-8")
        return [*written, target]


_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def _written_dtype(paths: list[Path]) -> str | None:
    """The one floating-point dtype of the tensors in the safetensors files ``paths``
    (read from their headers), or None if they hold several or none."""
    found: set[str] = set()
    for path in paths:
        if path.suffix != ".safetensors":
            continue
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        found.update(
            _SAFETENSORS_FLOATS[v["dtype"]]
            for k, v in header.items()
            if k != "__metadata__" and v["dtype"] in _SAFETENSORS_FLOATS
        )
    return found.pop() if len(found) == 1 else None


def _lora_record_of(source: Source) -> dict | None:
    if source.format != "h5":
        return None
    return lora_export.lora_record(source.path)


def _to_peft(src, dst: Path, config, base) -> list[Path]:
    with open_source(src) as source:
        record = _lora_record_of(source)
        if record is None:
            raise ValueError(
                f"convert(): --to peft needs a LoRA run's checkpoint (a params file with a "
                f"peft section), which records the adapters' settings; {source.path} has no "
                "such record (a checkpoint saved from Python holds the adapter tensors but "
                "not their LoraConfig). Fix: use --to hf for a full model; from Python, save "
                "the adapters with peft's own model.save_pretrained(folder)."
            )
        cfg = _hf_config(source, config)
    return lora_export.to_peft(Path(src), dst, record, cfg, base)


def _recorded_model(source: Source) -> dict | None:
    """The model section of the params a trainer checkpoint records, or None."""
    if source.format != "h5":
        return None
    with load(source.path) as state:
        metadata = state.get("metadata") if isinstance(state, dict) else None
        params = metadata.get("params") if isinstance(metadata, dict) else None
        model = params.get("model") if isinstance(params, dict) else None
        return dict(model) if isinstance(model, dict) else None


def _zoo_view(source: Source, key: str | None, name: str) -> SourceView:
    """The weights of a zoo model under transformers' names (common/hf_names.py)."""
    plain = SourceView(source, key)
    node, to_hf = plain.node, hf_name_map(name)
    if not isinstance(node, Branch):
        raise ValueError(f"convert(): {source.path} holds no model state to export.")
    names, transposed = {}, set()
    for k, child in zip(node.keys, node.children):
        names[k], flip = to_hf(k)
        if flip and isinstance(child, Leaf):
            transposed.add(child.key)
    return SourceView(source, key, names, frozenset(transposed))


def _zoo_config(zoo: dict, view: SourceView):
    """The transformers config that computes what the zoo model ``zoo`` computes."""
    leaf_of = dict(zip(view.node.keys, view.node.children))

    def shape_of(name: str) -> tuple[int, ...]:
        return tuple(view.source.describe(leaf_of[name].key).shape)

    fields = hf_config_fields(zoo, shape_of)
    return transformers_module().AutoConfig.for_model(**fields)


def _check_names(model, view: SourceView, path) -> None:
    """Refuse an export whose tensor names (under ``view``'s renames: the model's own
    names, before those ``save_pretrained`` reverts) are not those of ``model``, the
    configuration's (on meta): its ``from_pretrained`` would initialise the missing
    weights at random."""
    node = view.node
    if not isinstance(node, Branch) or not all(isinstance(k, str) for k in node.keys):
        return
    written = {view.names.get(k, k) for k in node.keys}
    groups: dict[int, list[str]] = {}  # tied weights: one tensor under several names
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    missing = [names[0] for names in groups.values() if not written & set(names)]
    if not missing:
        return
    known = {n for names in groups.values() for n in names}
    unexpected = sorted(written - known)
    raise ValueError(
        f"convert(): {path}'s weights are not those of the {type(model).__name__} its "
        f"configuration builds: {len(missing)} of its tensors are missing (e.g. "
        f"{missing[:3]}) and {len(unexpected)} names are unknown to it (e.g. "
        f"{unexpected[:3]}); from_pretrained would start those weights at random. Fix: "
        "give --config the configuration of the model that wrote the checkpoint."
    )


def _hf_config(source: Source, config):
    """The configuration to export (Note [export to hf])."""
    if config is not None:
        cfg = load_config(config)
    else:
        model = _recorded_model(source)
        if not isinstance(model, dict) or model.get("name") != "hf":
            raise ValueError(
                f"convert(): {source.path} does not record a Hugging Face configuration "
                "(it was not written by a run of 'model: {name: hf, ...}'). Fix: pass "
                "--config with the model's config.json (or its folder)."
            )
        overrides = {
            k: v
            for k, v in model.items()
            if k not in ("name", "hf_config", "mixed_precision", "fp16_type")
        }
        if not Path(model["hf_config"]).exists():
            raise ValueError(
                f"convert(): {source.path} records the model's configuration at "
                f"hf_config: {model['hf_config']}, which does not exist here (a relative "
                "path is from the directory the run started in). Fix: pass --config with "
                "that model's config.json (or its folder)."
            )
        cfg = load_config(model["hf_config"], overrides)
    cfg.use_cache = True  # off for training (models/hf.py); transformers' default
    return cfg

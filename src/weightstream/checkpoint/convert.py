"""Converting between H5 checkpoints, safetensors (single or sharded) and torch files.

Every direction reads the source one leaf at a time through a
:class:`SourceView`; writing H5 and safetensors then streams tensor by tensor
(memory: the largest tensor, not the state). Writing a torch file needs the
whole state in memory (see :mod:`.torchfile`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from weightstream.checkpoint.format import Node, TreeView, find_subtree
from weightstream.checkpoint.opener import open_source
from weightstream.checkpoint.source import Source

FORMATS = ("h5", "safetensors", "torch")

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
    """A source (or the subtree at ``key``) as something :func:`save` can stream."""

    def __init__(self, source: Source, key: str | None = None) -> None:
        self.source = source
        node = source.tree if not key else find_subtree(source.tree, key)
        if node is None:
            top = getattr(source.tree, "keys", [])
            raise KeyError(
                f"{source.path} has no key {key!r}; its top-level keys are {list(top)[:20]}."
            )
        self.node: Node = node

    def _ws_subtree(
        self,
    ) -> tuple[Node, Callable[[str], Any], Callable[[str], Hashable | None], Callable]:
        return self.node, self.source.read, self.source.tie, self.source.describe


def output_format(path: Path, to: str | None) -> str:
    """The format to write: ``to`` if given, else from the path's suffix (default H5)."""
    if to is not None:
        aliases = {"pt": "torch", "pth": "torch", "hdf5": "h5", "mdl": "h5"}
        fmt = aliases.get(to.lower(), to.lower())
        if fmt not in FORMATS:
            raise ValueError(f"convert(): unknown format {to!r}; choose one of {FORMATS}.")
        return fmt
    if path.is_dir() or path.suffix == "":
        return "safetensors" if path.is_dir() else "h5"
    return _SUFFIXES.get(path.suffix.lower(), "h5")


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
) -> list[Path]:
    """Convert the checkpoint ``src`` to ``dst``; returns the files written.

    Args:
        src: any checkpoint :func:`load` reads.
        dst: the output. Its format is ``to`` ("h5", "safetensors" or
            "torch") or follows the suffix: .safetensors, .index.json or an
            existing directory -> safetensors; .pt/.pth/.bin -> torch; anything
            else -> H5.
        key: convert only this subtree (e.g. "model" for the weights of a
            trainer checkpoint); its keys lose the prefix.
        allow_pickle: needed to read a torch file (or pickled values).
        max_shard_size: bytes per safetensors shard (Hugging Face layout).
        compression: for H5 output: None, "gzip" or "lz4".
    """
    dst_path = Path(os.fspath(dst))
    if to is None and max_shard_size is not None:
        to = "safetensors"  # sharding exists only for safetensors
    fmt = output_format(dst_path, to)
    if fmt != "safetensors" and max_shard_size is not None:
        raise ValueError("convert(): max_shard_size applies only to safetensors output.")
    if fmt != "h5" and compression is not None:
        raise ValueError("convert(): compression applies only to H5 output.")
    source = open_source(src, allow_pickle=allow_pickle)
    try:
        view = SourceView(source, key)
        if fmt == "h5":
            from weightstream.checkpoint.writer import save

            save(view, dst_path, compression=compression, fsync=fsync)
            return [dst_path]
        if fmt == "safetensors":
            from weightstream.checkpoint.safetensors_io import write_safetensors

            return write_safetensors(view, dst_path, max_shard_size=max_shard_size, fsync=fsync)
        from weightstream.checkpoint.torchfile import write_torch

        return [write_torch(view, dst_path, fsync=fsync)]
    finally:
        source.close()

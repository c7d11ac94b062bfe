"""A checkpoint file opened for reading, whatever its format, and format detection.

A :class:`Source` knows its tree (the nesting of the saved state) and reads
one leaf at a time; :func:`load`, the converters, ``info`` and ``diff`` are
written against it, so each works for H5 (ours and the reference system's),
safetensors (single file or Hugging Face sharded) and torch pickles alike.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from weightstream.checkpoint.errors import CheckpointError
from weightstream.checkpoint.tree import Node, iter_leaves

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

T = TypeVar("T")


@dataclass(frozen=True)
class LeafInfo:
    """What ``info`` shows for one leaf, known without reading its data.

    kind: "tensor", "numpy", "scalar", "string", "none", "bytes", "object", ...
    dtype: e.g. "torch.float32" for tensors, the Python type for others.
    storage: how the data is stored ("contiguous", "lz4", "gzip", "chunked", ...).
    linked_to: for a tied tensor, the first key stored with the same data.
    """

    key: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    storage: str = ""
    linked_to: str | None = None


class Source:
    """An open checkpoint. Subclasses set ``path``, ``format`` and ``tree``."""

    path: Path
    format: str
    tree: Node

    def _lookup(self, table: Mapping[str, T], key: str) -> T:
        """``table[key]``, or a KeyError naming the file."""
        try:
            return table[key]
        except KeyError:
            raise KeyError(f"{self.path} has no key {key!r}") from None

    def keys(self) -> list[str]:
        """Flattened keys of every leaf, in order."""
        return [leaf.key for leaf in iter_leaves(self.tree)]

    def read(self, key: str) -> Any:
        """The value of one leaf (tensors on the CPU)."""
        raise NotImplementedError

    def describe(self, key: str) -> LeafInfo:
        raise NotImplementedError

    def tie(self, key: str) -> Hashable | None:
        """Equal for keys stored as one object (tied weights), else None."""
        return None

    def properties(self) -> dict[str, Any]:
        """File-level facts for ``info``: format version, library version, ..."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sniff_format(path: Path) -> str:
    """ "h5", "safetensors", "safetensors-sharded" or "torch", from the bytes (not the name)."""
    if path.is_dir():
        if (path / SAFETENSORS_INDEX).is_file():
            return "safetensors-sharded"
        if (path / SAFETENSORS_SINGLE).is_file():
            return "safetensors"
        raise CheckpointError(
            f"{path} is a directory without {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE}; "
            "give the checkpoint file itself (or a Hugging Face model directory)."
        )
    if path.name.endswith(".index.json"):
        return "safetensors-sharded"
    with open(path, "rb") as fh:
        head = fh.read(16)
        size = os.fstat(fh.fileno()).st_size
    if head.startswith(HDF5_SIGNATURE):
        return "h5"
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 2 <= header_len <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    # HDF5 also allows a user block: the signature at 512, 1024, 2048, ...
    import h5py

    if h5py.is_hdf5(os.fspath(path)):
        return "h5"
    raise CheckpointError(
        f"{path} is not a checkpoint: it is neither HDF5 (weightstream or reference H5), "
        "safetensors, nor a torch.save file (its first bytes are "
        f"{head[:8]!r}). Check the path; if the file was copied, it may be damaged."
    )


def read_exact(fd: int, buffer: memoryview, offset: int) -> bool:
    """Fill ``buffer`` from ``fd`` at ``offset``; False if the file ends first."""
    done = 0
    while done < len(buffer):
        if hasattr(os, "preadv"):  # straight into the buffer
            n = os.preadv(fd, [buffer[done:]], offset + done)
        else:  # platforms without preadv: one extra copy
            chunk = os.pread(fd, len(buffer) - done, offset + done)
            n = len(chunk)
            buffer[done : done + n] = chunk
        if n == 0:
            return False
        done += n
    return True

"""torch.save (pickle) files: reading (only when the caller allows pickle) and writing.

Reading uses ``torch.load(mmap=True)`` for the zip format, so tensors are
mapped from the file rather than read whole before the first one is used.
Writing needs the whole state in memory: ``torch.save`` pickles one object
graph, so this direction cannot stream (the warning of seed 004).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightstream.checkpoint.errors import CorruptCheckpointError
from weightstream.checkpoint.source import LeafInfo, Source
from weightstream.checkpoint.tree import flatten, resolve_leaves, unflatten
from weightstream.checkpoint.writer import atomic_path, is_plain_tensor, storage_identity


class TorchSource(Source):
    """A torch.save file, unpickled (the caller has allowed pickle)."""

    format = "torch"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            state = torch.load(
                self.path,
                map_location="cpu",
                weights_only=False,
                mmap=zipfile.is_zipfile(self.path),
            )
        except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            raise CorruptCheckpointError(
                f"{self.path}: torch.load failed ({e}); the file is truncated or damaged. "
                "Copy it again from a good source."
            ) from e
        flat = flatten(state)
        self.tree = flat.tree
        self._values = dict(flat.leaves)

    def read(self, key: str) -> Any:
        return self._lookup(self._values, key)

    def tie(self, key: str) -> Hashable | None:
        value = self.read(key)
        return storage_identity(value) if is_plain_tensor(value) else None

    def describe(self, key: str) -> LeafInfo:
        value = self.read(key)
        if is_plain_tensor(value):
            return LeafInfo(
                key, "tensor", tuple(value.shape), str(value.dtype), value.nbytes, "pickle"
            )
        if isinstance(value, np.ndarray):
            return LeafInfo(key, "numpy", value.shape, f"numpy.{value.dtype}", value.nbytes)
        kind = {type(None): "none", str: "string"}.get(type(value), "scalar")
        if not isinstance(value, (bool, int, float, complex, str, type(None))):
            kind = "object"
        return LeafInfo(key, kind, None, type(value).__qualname__, 0, "pickle")

    def properties(self) -> dict[str, Any]:
        return {"format": "torch"}

    def close(self) -> None:
        self._values = {}


def write_torch(state: Any, path: str | os.PathLike, *, fsync: bool = True) -> Path:
    """``torch.save`` of ``state`` (lazy parts read first), written atomically."""
    target = Path(os.fspath(path))
    flat = flatten(state)
    value = unflatten(flat.tree, resolve_leaves(flat))
    with atomic_path(target, fsync=fsync) as tmp:
        torch.save(value, tmp)
    return target

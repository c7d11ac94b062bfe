"""safetensors, single file and Hugging Face sharded: a reader and a streaming writer.

Reading goes through the ``safetensors`` library (``safe_open``), one tensor
at a time, with its ``pread`` backend: each tensor is read into fresh memory
(one copy) and nothing else of the file stays mapped, so reading a checkpoint
tensor by tensor holds one tensor (Note [bounded loads]). Its default
``mmap`` backend maps the whole file writable and private: every page read
stays in the process until the file is closed, and the kernel refuses such a
mapping for a file larger than RAM. So ``load(mmap=True)`` copies here too.

Writing streams as well: the header (8-byte little-endian length, a JSON
header of name -> dtype, shape, byte range) is written from the shapes alone,
then each tensor's bytes as it is read from the source. The library's writers
(``save_file``, ``serialize_file``) need every tensor in memory at once.

safetensors holds only tensors, and no two names may share bytes. So the
writer duplicates tied tensors, and records in ``__metadata__["weightstream"]``
(JSON) the tree of the state, the tied keys and the non-tensor leaves that
JSON can carry (None, bool, int, float, str); the reader restores all three.
For a sharded checkpoint that record is in the index's ``metadata``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from weightstream.checkpoint.errors import CheckpointError, CorruptCheckpointError
from weightstream.checkpoint.format import torch_dtype_from_name
from weightstream.checkpoint.source import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    LeafInfo,
    Source,
)
from weightstream.checkpoint.tree import (
    Branch,
    Deferred,
    Leaf,
    flatten,
    iter_leaves,
    tree_from_json,
    tree_to_json,
)
from weightstream.checkpoint.writer import (
    SLAB_BYTES,
    atomic_path,
    is_plain_tensor,
    storage_identity,
)

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
CODES = {v: k for k, v in DTYPES.items()}
METADATA_KEY = "weightstream"
_JSON_SCALARS = (type(None), bool, int, float, str)


def _damaged(file: Path, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{file}: not a readable safetensors file ({e}); it is truncated or damaged. "
        "Download or copy it again."
    )


class SafetensorsSource(Source):
    """A safetensors file, or a sharded checkpoint through its index (or directory).

    Every file stays open (``safe_open``) until :meth:`close`. ``mmap`` is
    accepted for :func:`~weightstream.checkpoint.load` and ignored (see the
    module's docstring).
    """

    format = "safetensors"

    def __init__(self, path: Path, *, mmap: bool = False) -> None:
        self.path = Path(path)
        self._files = contextlib.ExitStack()
        self._entries: dict[str, tuple[Path, Any]] = {}  # name -> (file, its safe_open)
        try:
            record = self._open()
        except BaseException:
            self.close()
            raise
        self._values: dict[str, Any] = {}
        self._ties: dict[str, str] = {}
        self.tree = self._tree(record)

    def _open_file(self, file: Path) -> Any:
        try:
            handle = safe_open(file, framework="pt", backend="pread")
        except SafetensorError as e:
            raise _damaged(file, e) from e
        return self._files.enter_context(handle)

    def _open(self) -> Any:
        """Open the file(s); the weightstream record (or None)."""
        index = None
        if self.path.is_dir():
            if (self.path / SAFETENSORS_INDEX).is_file():
                index = self.path / SAFETENSORS_INDEX
            else:
                self.path = self.path / SAFETENSORS_SINGLE
        elif self.path.name.endswith(".index.json"):
            index = self.path
        if index is None:
            handle = self._open_file(self.path)
            self._entries = {name: (self.path, handle) for name in handle.offset_keys()}
            return (handle.metadata() or {}).get(METADATA_KEY)
        self.format = "safetensors-sharded"
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{index}: cannot read the sharded checkpoint index ({e})."
            ) from e
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map).")
        shards: dict[str, tuple[Path, Any, set[str]]] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                shard_path = index.parent / shard
                if not shard_path.is_file():
                    raise CorruptCheckpointError(
                        f"{index}: shard {shard} (holding {name!r}) is missing; copy "
                        "every shard listed in the index."
                    )
                handle = self._open_file(shard_path)
                shards[shard] = (shard_path, handle, set(handle.keys()))
            if name not in shards[shard][2]:
                raise CorruptCheckpointError(
                    f"{index}: {name!r} is not in its shard {shard}; the index and the "
                    "shards do not belong together."
                )
            self._entries[name] = shards[shard][:2]
        return (doc.get("metadata") or {}).get(METADATA_KEY)

    def _tree(self, record: Any) -> Any:
        if record is not None:
            try:
                doc = json.loads(record) if isinstance(record, str) else record
                tree = tree_from_json(doc["spec"])
                self._values = dict(doc.get("values", {}))
                self._ties = dict(doc.get("ties", {}))
                keys = {leaf.key for leaf in iter_leaves(tree)}
                if keys <= set(self._entries) | set(self._values):
                    return tree
            except (ValueError, KeyError, TypeError):
                pass  # not our record after all: plain flat tensors below
            self._values, self._ties = {}, {}
        # By file, and in a file by offset.
        files = sorted(dict(self._entries.values()).items(), key=lambda item: str(item[0]))
        names = [n for _, handle in files for n in handle.offset_keys() if n in self._entries]
        return Branch("dict", names, [Leaf(n) for n in names])

    def read(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        file, handle = self._lookup(self._entries, key)
        try:
            return handle.get_tensor(key)
        except SafetensorError as e:  # e.g. the file was truncated since it was opened
            raise _damaged(file, e) from e

    def tie(self, key: str) -> Hashable | None:
        return ("safetensors", id(self), self._ties.get(key, key))

    def describe(self, key: str) -> LeafInfo:
        if key in self._values:
            value = self._values[key]
            kind = {type(None): "none", str: "string"}.get(type(value), "scalar")
            return LeafInfo(key, kind, None, type(value).__name__, 0, "metadata")
        file, handle = self._lookup(self._entries, key)
        spec = handle.get_slice(key)  # the header's entry; reads no data
        shape, code = tuple(spec.get_shape()), spec.get_dtype()
        if code not in DTYPES:
            raise CheckpointError(
                f"{file}: tensor {key!r} has dtype {code!r}, which this reader does not "
                "know; upgrade weightstream or convert the file."
            )
        nbytes = _nbytes(shape, DTYPES[code])
        return LeafInfo(
            key, "tensor", shape, str(DTYPES[code]), nbytes, file.name, self._ties.get(key)
        )

    def properties(self) -> dict[str, Any]:
        return {"format": self.format, "files": len({f for f, _ in self._entries.values()})}

    def close(self) -> None:
        self._files.close()


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _plan(state: Any) -> tuple[Any, list, dict[str, Any], dict[str, str]]:
    """Tensors to write (key, shape, dtype, value), JSON leaves, and ties."""
    flat = flatten(state)
    tensors: list[tuple[str, tuple, torch.dtype, Any]] = []
    values: dict[str, Any] = {}
    ties: dict[str, str] = {}
    first: dict[Hashable, str] = {}
    for key, value in flat.leaves:
        info = value.info() if isinstance(value, Deferred) else None
        if info is not None and info.kind == "tensor":
            shape, dtype = tuple(info.shape), torch_dtype_from_name(info.dtype or "")
            assert dtype is not None, f"tensor leaf without a dtype: {info.dtype!r}"
            source_tie = value.tie()
            identity: Hashable = ("key", key) if source_tie is None else ("source", source_tie)
        else:
            if isinstance(value, Deferred):
                value = value.get()
            if is_plain_tensor(value):
                shape, dtype = tuple(value.shape), value.dtype
                identity = storage_identity(value) or ("key", key)
            elif type(value) in _JSON_SCALARS:
                values[key] = value
                continue
            else:
                raise TypeError(
                    f"safetensors holds only tensors (and here None, bools, numbers and "
                    f"strings); {key!r} is a {type(value).__qualname__}. Convert only the "
                    "tensors' part of the state (e.g. --key model), or save to H5."
                )
        if dtype not in CODES:
            raise TypeError(
                f"safetensors has no dtype for {dtype} (key {key!r}); save to H5 instead."
            )
        if identity in first:
            ties[key] = first[identity]
        else:
            first[identity] = key
        tensors.append((key, shape, dtype, value))
    return flat.tree, tensors, values, ties


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_safetensors(
    state: Any,
    path: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    fsync: bool = True,
) -> list[Path]:
    """Write ``state`` as safetensors, streaming; returns the files written.

    ``path`` ending in ``.safetensors``: one file. A directory (or a path
    ending in ``.index.json``): Hugging Face layout, ``model.safetensors`` if
    everything fits in ``max_shard_size`` bytes (or no limit is given), else
    ``model-00001-of-0000N.safetensors`` shards plus
    ``model.safetensors.index.json``. Each file is written atomically.
    """
    target = Path(os.fspath(path))
    tree, tensors, values, ties = _plan(state)
    record = json.dumps({"spec": tree_to_json(tree), "values": values, "ties": ties})
    single_file = target.suffix == ".safetensors"
    if single_file and max_shard_size is not None:
        raise ValueError(
            f"max_shard_size needs a directory (or an .index.json path) as output, not "
            f"{target}: a .safetensors path is one file."
        )
    shards = _shards(tensors, max_shard_size)
    index = target if target.name.endswith(".index.json") else target / SAFETENSORS_INDEX
    if single_file or len(shards) == 1:
        out = target if single_file else index.parent / SAFETENSORS_SINGLE
        _write_file(out, shards[0], {METADATA_KEY: record}, fsync)
        if not single_file:
            _remove_stale(index.parent, [out])
        return [out]
    written, weight_map = [], {}
    for i, shard in enumerate(shards):
        out = index.parent / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_file(out, shard, {}, fsync)
        written.append(out)
        weight_map.update({key: out.name for key, *_ in shard})
    total = sum(_nbytes(shape, dtype) for _, shape, dtype, _ in tensors)
    doc = {"metadata": {"total_size": total, METADATA_KEY: record}, "weight_map": weight_map}
    with atomic_path(index, fsync=fsync) as tmp:
        tmp.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    _remove_stale(index.parent, [*written, index])
    return [*written, index]


def _remove_stale(folder: Path, written: list[Path]) -> None:
    """Remove an earlier write's weights from ``folder`` (as ``save_pretrained`` does):
    left beside the new ones, transformers would read ``model.safetensors`` and this
    library the index, each a different state."""
    keep = {p.name for p in written}
    stale = [folder / SAFETENSORS_SINGLE, folder / SAFETENSORS_INDEX]
    stale += folder.glob("model-*-of-*.safetensors")
    for path in stale:
        if path.name not in keep:
            path.unlink(missing_ok=True)


def _shards(tensors: list, max_shard_size: int | None) -> list[list]:
    if max_shard_size is None:
        return [tensors]
    if max_shard_size <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes, not {max_shard_size}."
        )
    shards: list[list] = [[]]
    size = 0
    for item in tensors:
        n = _nbytes(item[1], item[2])
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def _write_file(target: Path, tensors: list, metadata: dict[str, str], fsync: bool) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for key, shape, dtype, _ in tensors:
        n = _nbytes(shape, dtype)
        header[key] = {
            "dtype": CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with atomic_path(target, fsync=fsync) as tmp, open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for key, shape, dtype, value in tensors:
            t = value.get() if isinstance(value, Deferred) else value
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CheckpointError(
                    f"{key!r} was described as {dtype} {list(shape)} but read as "
                    f"{t.dtype} {list(t.shape)}; the source changed while converting."
                )
            _write_tensor_bytes(fh, t)


def _write_tensor_bytes(fh: Any, t: torch.Tensor) -> None:
    """Write ``t``'s bytes in C order; a strided tensor in pieces of about SLAB_BYTES
    along dim 0, each copied contiguous in turn (never the whole tensor)."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if not t.is_contiguous():  # so not 0-d, not empty
        rows = max(1, SLAB_BYTES // max(1, t[0].numel() * t.element_size()))
        for piece in t.split(rows):
            _write_tensor_bytes(fh, piece.contiguous())
        return
    fh.write(t.reshape(-1).view(torch.uint8).numpy())

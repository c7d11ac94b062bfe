"""safetensors, single file and Hugging Face sharded: a reader and a streaming writer.

The format is simple enough to read and write directly (8-byte little-endian
header length, a JSON header of name -> dtype, shape, byte range, then the
data), which lets both directions stream tensor by tensor: the reader fills a
preallocated tensor from the byte range, the writer writes the header from
the shapes alone and then each tensor's bytes as it is read from the source.
The ``safetensors`` package is not needed at run time.

safetensors holds only tensors, and no two names may share bytes. So the
writer duplicates tied tensors, and records in ``__metadata__["weightstream"]``
(JSON) the tree of the state, the tied keys and the non-tensor leaves that
JSON can carry (None, bool, int, float, str); the reader restores all three.
For a sharded checkpoint that record is in the index's ``metadata``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightstream.checkpoint.errors import CheckpointError, CorruptCheckpointError
from weightstream.checkpoint.format import (
    Branch,
    Deferred,
    Leaf,
    flatten,
    iter_leaves,
    map_file_range,
    storage_array,
    torch_dtype_from_name,
    tree_from_json,
    tree_to_json,
)
from weightstream.checkpoint.source import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    LeafInfo,
    Source,
    read_exact,
    read_json,
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
_MAX_HEADER = 100 * 2**20
_JSON_SCALARS = (type(None), bool, int, float, str)


class _Entry:
    __slots__ = ("begin", "dtype", "end", "file", "shape")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple, begin: int, end: int):
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def read_header(file: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """The tensors of one safetensors file (name -> entry, absolute offsets) and its metadata."""
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {n} exceeds the file ({size} bytes)")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{file}: not a readable safetensors file ({e}); it is truncated or damaged. "
            "Download or copy it again."
        ) from e
    metadata = header.pop("__metadata__", None) or {}
    entries: dict[str, _Entry] = {}
    for name, spec in header.items():
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except KeyError as e:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {spec.get('dtype')!r} or a header this "
                f"reader does not know ({e}); upgrade weightstream or convert the file."
            ) from e
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or 8 + n + end > size:
            raise CorruptCheckpointError(
                f"{file}: tensor {name!r} needs bytes {begin}..{end} of the data but the file "
                f"has {size - 8 - n} bytes of data: the file is truncated or damaged. Download "
                "or copy it again."
            )
        entries[name] = _Entry(file, dtype, shape, 8 + n + begin, 8 + n + end)
    return entries, metadata


class SafetensorsSource(Source):
    """A safetensors file, or a sharded checkpoint through its index (or directory)."""

    format = "safetensors"

    def __init__(self, path: Path, *, mmap: bool = False) -> None:
        self.path = Path(path)
        self._use_mmap = mmap
        self._sizes: dict[Path, int] = {}  # for mapped reads
        self._fds: dict[Path, int] = {}
        record: Any = None
        index = None
        if self.path.is_dir():
            if (self.path / SAFETENSORS_INDEX).is_file():
                index = self.path / SAFETENSORS_INDEX
            else:
                self.path = self.path / SAFETENSORS_SINGLE
        elif self.path.name.endswith(".index.json"):
            index = self.path
        self._entries: dict[str, _Entry] = {}
        if index is not None:
            self.format = "safetensors-sharded"
            doc = read_json(index, "sharded checkpoint index")
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map).")
            shards: dict[str, dict[str, _Entry]] = {}
            for name, shard in weight_map.items():
                if shard not in shards:
                    shard_path = index.parent / shard
                    if not shard_path.is_file():
                        raise CorruptCheckpointError(
                            f"{index}: shard {shard} (holding {name!r}) is missing; copy "
                            "every shard listed in the index."
                        )
                    shards[shard] = read_header(shard_path)[0]
                if name not in shards[shard]:
                    raise CorruptCheckpointError(
                        f"{index}: {name!r} is not in its shard {shard}; the index and the "
                        "shards do not belong together."
                    )
                self._entries[name] = shards[shard][name]
            record = (doc.get("metadata") or {}).get(METADATA_KEY)
        else:
            self._entries, metadata = read_header(self.path)
            record = metadata.get(METADATA_KEY)
        self._values: dict[str, Any] = {}
        self._ties: dict[str, str] = {}
        self.tree = self._tree(record)

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
        names = sorted(
            self._entries, key=lambda k: (str(self._entries[k].file), self._entries[k].begin)
        )
        return Branch("dict", names, [Leaf(n) for n in names])

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def read(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        try:
            entry = self._entries[key]
        except KeyError:
            raise KeyError(f"{self.path} has no key {key!r}") from None
        if self._use_mmap:
            fd = self._fd(entry.file)
            if entry.file not in self._sizes:
                self._sizes[entry.file] = os.fstat(fd).st_size
            mapped = map_file_range(
                fd, entry.begin, entry.dtype, entry.shape, self._sizes[entry.file]
            )
            if mapped is not None:
                return mapped
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if out.numel() == 0:
            return out
        buffer = memoryview(storage_array(out).reshape(-1).view(np.uint8))
        if not read_exact(self._fd(entry.file), buffer, entry.begin):
            raise CorruptCheckpointError(
                f"{entry.file}: tensor {key!r} ends past the end of the file: the file "
                "is truncated. Download or copy it again."
            )
        return out

    def tie(self, key: str) -> Hashable | None:
        return ("safetensors", id(self), self._ties.get(key, key))

    def describe(self, key: str) -> LeafInfo:
        if key in self._values:
            value = self._values[key]
            kind = {type(None): "none", str: "string"}.get(type(value), "scalar")
            return LeafInfo(key, kind, None, type(value).__name__, 0, "metadata")
        entry = self._entries[key]
        return LeafInfo(
            key,
            "tensor",
            entry.shape,
            str(entry.dtype),
            entry.end - entry.begin,
            entry.file.name,
            self._ties.get(key),
        )

    def properties(self) -> dict[str, Any]:
        return {"format": self.format, "files": len({e.file for e in self._entries.values()})}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


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
            shape, dtype = tuple(info.shape), _dtype(info.dtype)
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


def _dtype(name: str | None) -> torch.dtype:
    dtype = torch_dtype_from_name(name or "")
    assert dtype is not None, f"tensor leaf without a dtype: {name!r}"
    return dtype


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
    if single_file:
        _write_file(target, shards[0], {METADATA_KEY: record}, fsync)
        return [target]
    index = target if target.name.endswith(".index.json") else target / SAFETENSORS_INDEX
    index.parent.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        out = index.parent / SAFETENSORS_SINGLE
        _write_file(out, shards[0], {METADATA_KEY: record}, fsync)
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
    return [*written, index]


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
    target.parent.mkdir(parents=True, exist_ok=True)
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
    """Write ``t``'s bytes in C order, strided tensors in pieces (no full copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    if t.is_contiguous() or t.dim() == 0:
        fh.write(memoryview(storage_array(t.contiguous()).reshape(-1).view(np.uint8)))
        return
    rows = max(1, SLAB_BYTES // max(1, t[0].numel() * t.element_size()))
    for start in range(0, t.shape[0], rows):
        piece = storage_array(t[start : start + rows].contiguous())
        fh.write(memoryview(piece.reshape(-1).view(np.uint8)))
        del piece  # before the next piece exists: one piece at a time

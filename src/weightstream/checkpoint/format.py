"""The checkpoint format: names, the tree spec, flattening, dtypes, checksums.

Pure functions and constants shared by the writer, the readers and the
converters; nothing here touches a file.

# Note [checkpoint layout]

An H5 checkpoint (format version 0.5) is one HDF5 file:

* one dataset per leaf of the (nested) state, all at the root group, named by
  the leaf's flattened key URL-quoted with ``urllib.parse.quote(key, safe="")``
  (so ``/`` becomes ``%2F``; the keys ``""``, ``"."`` and ``".."``, which HDF5
  cannot use as names, become ``__root__``, ``%2E`` and ``%2E%2E``). Keys are
  flattened by joining the path with ``"."``: dict keys as ``str(key)``, list
  and tuple positions as numbers (``{"a": {"b": x}, "d": [y]}`` gives ``a.b``
  and ``d.0``).
* every dataset carries ``__H5_TYPE__``, the type tag of the reference system
  (``TorchTensorH5Type``, ``NumpyArrayH5Type``, ``ScalarH5Type``,
  ``StringH5Type``, ``NoneH5Type``) or one of ours for the values it has no tag
  for (``BytesH5Type``, ``BigIntH5Type``, ``TorchDtypeH5Type``,
  ``TorchDeviceH5Type``, ``TorchSizeH5Type``, ``PickledObjectH5Type``).
* tensors: the data, contiguous and uncompressed by default, plus the
  attributes ``dtype`` (``"torch.float32"``), ``shape`` (int64 array),
  ``is_bfloat16`` and ``checksum_sum64`` (see :class:`Sum64`). bfloat16 is stored
  as uint16 bit patterns with ``is_bfloat16=True``; dtypes numpy lacks (float8,
  complex32, ...) are stored as their raw bytes, uint8 with one extra trailing
  axis of the element size, ``dtype`` saying what they are. ``nn.Parameter``
  adds ``is_parameter`` and ``requires_grad``.
* Python scalars: 0-d datasets (bool, int64, float64, complex128). Strings: an
  empty dataset with a ``string_value`` attribute (strings with NUL characters
  or over 16 KiB of UTF-8 are stored as UTF-8 bytes in the data instead).
  None: an empty dataset. Every dataset that has data has ``checksum_sum64``.
* string attributes are fixed-length UTF-8, so they live in the object header,
  which HDF5 checksums (variable-length strings live in the global heap,
  which it does not); the file is written with HDF5 1.8+ structures
  (``libver=("v108", "v110")``), whose metadata is checksummed. Data blocks of
  4 KiB or more are 4 KiB aligned (so ``load(mmap=True)`` maps them in place).
* tied tensors (the same tensor, or the same storage, offset, shape and stride,
  under several keys) are written once; every further key is an HDF5 **hard
  link** to the first dataset (``f[alias] = f[first]``, as the reference
  system's ``create_links`` does), so h5py shows both names as one object
  (``f[a].id == f[b].id``).
* the serialized fallback: anything else (sets, custom classes, namedtuples,
  sparse or quantized tensors, dicts with keys JSON cannot carry) is pickled:
  ``PickledObjectH5Type``, the pickle bytes as uint8 data, ``python_type``
  naming the class. Unpickling can run code, so reading such a value needs
  ``load(..., allow_pickle=True)``; the common safe types (bytes, big ints,
  dtypes, devices, torch.Size, numpy arrays) have tags of their own and never
  need it.
* root attributes: ``__spec__`` (the tree as JSON, see :func:`tree_to_json`),
  ``__spec_sum64__`` (its checksum), ``__version__`` (0.5, a float as the
  reference writes it: its reader compares floats), ``__weightstream_version__``
  (the library version) and, written last, ``__SUCCESS__ = True``.

Files written by the reference system differ in ways the reader handles:
``__spec__`` holds a hex-encoded (dill) pickle of a ``torch.utils._pytree``
TreeSpec, decoded by :mod:`.refspec` without running pickle code (a file whose
spec cannot be decoded safely loads as a flat dict of its dataset names);
tensor datasets may be LZ4 (HDF5 filter 32004, registered by hdf5plugin) or
gzip compressed; the ``dtype`` and ``shape`` attributes may be missing (the
dtype then comes from the data and ``is_bfloat16``, and bfloat16 may be
int16); strings are variable-length; the fallback is ``ObjectH5Type`` with a
hex dill pickle in ``object_value``; its newer storage layer tags datasets
with ``__TYPE__`` / ``__NUMPY__`` / ``__BYTES__`` and its oldest releases
used untagged datasets with ``is_none`` / ``is_string`` / ``is_scalar``.
"""

from __future__ import annotations

import json
import mmap
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np
import torch

from weightstream.common.pages import register_read_mapping

FORMAT_VERSION = 0.5

# Root attributes.
ATTR_SPEC = "__spec__"
ATTR_SPEC_CHECKSUM = "__spec_sum64__"
ATTR_VERSION = "__version__"
ATTR_LIBRARY_VERSION = "__weightstream_version__"
ATTR_REFERENCE_LIBRARY_VERSION = "__cstorch_version__"
ATTR_SUCCESS = "__SUCCESS__"

# Per-dataset attributes.
ATTR_TYPE = "__H5_TYPE__"
ATTR_DTYPE = "dtype"
ATTR_SHAPE = "shape"
ATTR_BFLOAT16 = "is_bfloat16"
ATTR_CHECKSUM = "checksum_sum64"
ATTR_STRING = "string_value"
ATTR_VALUE = "value"
ATTR_PYTHON_TYPE = "python_type"
ATTR_IS_PARAMETER = "is_parameter"
ATTR_REQUIRES_GRAD = "requires_grad"
ATTR_NUMPY_SCALAR = "is_numpy_scalar"

# Type tags (the first five are the reference system's own names).
TYPE_TENSOR = "TorchTensorH5Type"
TYPE_NUMPY = "NumpyArrayH5Type"
TYPE_SCALAR = "ScalarH5Type"
TYPE_STRING = "StringH5Type"
TYPE_NONE = "NoneH5Type"
TYPE_REFERENCE_OBJECT = "ObjectH5Type"  # reference: dill pickle, hex, in `object_value`
TYPE_BYTES = "BytesH5Type"
TYPE_BIGINT = "BigIntH5Type"
TYPE_TORCH_DTYPE = "TorchDtypeH5Type"
TYPE_TORCH_DEVICE = "TorchDeviceH5Type"
TYPE_TORCH_SIZE = "TorchSizeH5Type"
TYPE_PICKLE = "PickledObjectH5Type"

# Strings longer than this in UTF-8 (or with NUL characters) go to the data, not
# an attribute (an object header message holds at most 64 KiB).
MAX_STRING_ATTR_BYTES = 16 * 1024

_SPEC_FORMAT = "weightstream.tree"
_SPEC_VERSION = 1


# --------------------------------------------------------------------------
# The tree spec
# --------------------------------------------------------------------------


@dataclass
class Leaf:
    """A leaf of the state; ``key`` is its flattened key."""

    key: str


@dataclass
class Branch:
    """A container of the state.

    kind: "dict", "odict" (an OrderedDict, e.g. a module's state_dict),
    "list" or "tuple". ``keys`` are the dict keys (str, int, float, bool or
    None) or the positions for lists and tuples. ``metadata`` is an
    OrderedDict's ``_metadata`` (module versions) when it is JSON-serializable.
    """

    kind: str
    keys: list
    children: list
    metadata: Any = None


Node = Leaf | Branch

_SIMPLE_KEY_TYPES = (str, int, float, bool, type(None))


def join_key(prefix: str, key: Any) -> str:
    """Flattened key of ``key`` inside the container at ``prefix``."""
    return str(key) if prefix == "" else f"{prefix}.{key}"


def iter_leaves(node: Node):
    """Yield every Leaf of ``node`` in order."""
    if isinstance(node, Leaf):
        yield node
        return
    for child in node.children:
        yield from iter_leaves(child)


def rekey(node: Node, prefix: str) -> tuple[Node, list[tuple[str, str]]]:
    """Copy of ``node`` placed at ``prefix``; also returns (new key, old key) pairs."""
    pairs: list[tuple[str, str]] = []

    def visit(n: Node, key: str) -> Node:
        if isinstance(n, Leaf):
            pairs.append((key, n.key))
            return Leaf(key)
        children = [visit(c, join_key(key, k)) for k, c in zip(n.keys, n.children)]
        return Branch(n.kind, list(n.keys), children, n.metadata)

    return visit(node, prefix), pairs


def find_subtree(node: Node, key: str) -> Node | None:
    """The node whose flattened key is ``key`` ("" is the root), or None."""
    if key == "":
        return node
    if isinstance(node, Leaf):
        return None
    for k, child in zip(node.keys, node.children):
        name = str(k)
        if key == name:
            return child
        if key.startswith(name + "."):
            found = find_subtree(child, key[len(name) + 1 :])
            if found is not None:
                return found
    return None


def tree_to_json(node: Node) -> str:
    """The ``__spec__`` attribute: the tree as JSON.

    A leaf is ``null``; a container is ``{"dict": [[key, node], ...]}`` (also
    ``"odict"``, with ``"metadata"``), ``{"list": [node, ...]}`` or
    ``{"tuple": [...]}``. Dict keys keep their JSON type (string, number,
    true/false, null), so int keys (optimizer state) come back as ints.
    """

    def enc(n: Node) -> Any:
        if isinstance(n, Leaf):
            return None
        if n.kind in ("dict", "odict"):
            out: dict[str, Any] = {n.kind: [[k, enc(c)] for k, c in zip(n.keys, n.children)]}
            if n.metadata is not None:
                out["metadata"] = n.metadata
            return out
        return {n.kind: [enc(c) for c in n.children]}

    doc = {"format": _SPEC_FORMAT, "version": _SPEC_VERSION, "tree": enc(node)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=True)


def is_tree_json(text: str) -> bool:
    """True when ``text`` looks like our JSON spec (the reference's is hex)."""
    return text.lstrip().startswith("{")


def tree_from_json(text: str) -> Node:
    """Inverse of :func:`tree_to_json`; raises ValueError on a malformed spec."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != _SPEC_FORMAT:
        raise ValueError("not a weightstream tree spec")
    if doc.get("version") != _SPEC_VERSION:
        raise ValueError(f"unsupported tree spec version {doc.get('version')!r}")

    def dec(obj: Any, key: str) -> Node:
        if obj is None:
            return Leaf(key)
        if not isinstance(obj, dict):
            raise ValueError(f"bad node at {key!r}")
        for kind in ("dict", "odict"):
            if kind in obj:
                pairs = obj[kind]
                if not isinstance(pairs, list) or not all(
                    isinstance(p, list) and len(p) == 2 for p in pairs
                ):
                    raise ValueError(f"bad {kind} node at {key!r}")
                keys = [p[0] for p in pairs]
                if not all(isinstance(k, _SIMPLE_KEY_TYPES) for k in keys):
                    raise ValueError(f"bad dict key at {key!r}")
                children = [dec(p[1], join_key(key, p[0])) for p in pairs]
                return Branch(kind, keys, children, obj.get("metadata"))
        for kind in ("list", "tuple"):
            if kind in obj:
                items = obj[kind]
                if not isinstance(items, list):
                    raise ValueError(f"bad {kind} node at {key!r}")
                children = [dec(c, join_key(key, i)) for i, c in enumerate(items)]
                return Branch(kind, list(range(len(items))), children)
        raise ValueError(f"unknown node at {key!r}")

    return dec(doc.get("tree"), "")


def _json_metadata(metadata: Any) -> Any:
    """A state_dict's ``_metadata`` as JSON-able [[prefix, {...}], ...], or None."""
    if not isinstance(metadata, dict):
        return None
    pairs = [[k, v] for k, v in metadata.items()]
    try:
        if json.loads(json.dumps(pairs)) != pairs:
            return None
    except (TypeError, ValueError):
        return None
    return pairs


def restore_metadata(pairs: Any) -> Any:
    """Inverse of :func:`_json_metadata` (an OrderedDict, as torch builds it)."""
    if not isinstance(pairs, list):
        return None
    return OrderedDict((k, v) for k, v in pairs)


# --------------------------------------------------------------------------
# Deferred leaves: values read only when the writer needs them
# --------------------------------------------------------------------------


class Deferred:
    """A leaf whose value is read on demand (streaming a checkpoint into another).

    ``tie()`` gives a hashable identity of the stored object (equal for keys
    linked to one dataset) or None; ``info()`` describes the value without
    reading it (a :class:`~weightstream.checkpoint.source.LeafInfo`).
    """

    __slots__ = ("_info", "_read", "_tie")

    def __init__(
        self,
        read: Callable[[], Any],
        tie: Callable[[], Hashable | None] | None = None,
        info: Callable[[], Any] | None = None,
    ):
        self._read = read
        self._tie = tie
        self._info = info

    def get(self) -> Any:
        return self._read()

    def tie(self) -> Hashable | None:
        return None if self._tie is None else self._tie()

    def info(self) -> Any:
        return None if self._info is None else self._info()


class TreeView:
    """Mixin for objects that are a view of a stored tree (the lazy state dict).

    :func:`flatten` grafts such a view as :class:`Deferred` leaves instead of
    reading it, so ``save(load(path), other)`` streams tensor by tensor.
    ``_ws_subtree`` returns the node and, for a leaf key of that node, how to
    read it, its tie identity and its description.
    """

    def _ws_subtree(
        self,
    ) -> tuple[
        Node,
        Callable[[str], Any],
        Callable[[str], Hashable | None],
        Callable[[str], Any],
    ]:
        raise NotImplementedError


# --------------------------------------------------------------------------
# Flattening
# --------------------------------------------------------------------------


@dataclass
class Flattened:
    """A state split into its tree and its leaves, in order."""

    tree: Node
    leaves: list[tuple[str, Any]] = field(default_factory=list)


def flatten(state: Any) -> Flattened:
    """Split ``state`` into a tree spec and (flattened key, value) leaves.

    Containers: dict (and dict subclasses other than OrderedDict, stored as
    dict), OrderedDict, list, tuple. A dict whose keys are not all str, int,
    float, bool or None, and tuple subclasses (namedtuples, torch.Size) are
    leaves. Raises ValueError on a reference cycle.
    """
    out = Flattened(tree=Leaf(""))
    on_path: set[int] = set()

    def visit(x: Any, key: str) -> Node:
        if isinstance(x, TreeView):
            node, read, tie, info = x._ws_subtree()
            new_node, pairs = rekey(node, key)
            for new_key, old_key in pairs:
                deferred = Deferred(
                    lambda k=old_key: read(k),
                    lambda k=old_key: tie(k),
                    lambda k=old_key: info(k),
                )
                out.leaves.append((new_key, deferred))
            return new_node
        kind = _container_kind(x)
        if kind is None:
            out.leaves.append((key, x))
            return Leaf(key)
        if id(x) in on_path:
            raise ValueError(
                f"save(): the state contains a reference cycle at key {key!r}; "
                "a checkpoint must be a tree. Remove the back-reference."
            )
        on_path.add(id(x))
        try:
            if kind in ("dict", "odict"):
                keys = list(x.keys())
                children = [visit(x[k], join_key(key, k)) for k in keys]
                metadata = _json_metadata(getattr(x, "_metadata", None))
                return Branch(kind, keys, children, metadata)
            items = list(x)
            children = [visit(v, join_key(key, i)) for i, v in enumerate(items)]
            return Branch(kind, list(range(len(items))), children)
        finally:
            on_path.discard(id(x))

    out.tree = visit(state, "")
    return out


def _container_kind(x: Any) -> str | None:
    if isinstance(x, dict):
        if not all(type(k) in _SIMPLE_KEY_TYPES for k in x):
            return None  # keys JSON cannot carry: the dict is pickled whole
        return "odict" if isinstance(x, OrderedDict) else "dict"
    if isinstance(x, list):
        return "list"
    if type(x) is tuple:
        return "tuple"
    return None


def resolve_leaves(flat: Flattened) -> Callable[[str], Any]:
    """``value_of(key)`` for :func:`unflatten` of ``flat``: reads deferred leaves,
    tied ones once."""
    values = dict(flat.leaves)
    seen: dict[Hashable, Any] = {}

    def value_of(key: str) -> Any:
        value = values[key]
        if not isinstance(value, Deferred):
            return value
        tie = value.tie()
        if tie is None:
            return value.get()
        if tie not in seen:
            seen[tie] = value.get()
        return seen[tie]

    return value_of


def unflatten(node: Node, value_of: Callable[[str], Any]) -> Any:
    """Rebuild the nested state from ``node``; ``value_of(key)`` gives each leaf."""
    if isinstance(node, Leaf):
        return value_of(node.key)
    values = [unflatten(c, value_of) for c in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, values))
    if node.kind == "odict":
        result = OrderedDict(zip(node.keys, values))
        metadata = restore_metadata(node.metadata)
        if metadata is not None:
            result._metadata = metadata  # type: ignore[attr-defined]
        return result
    if node.kind == "list":
        return values
    return tuple(values)


_RESERVED_NAMES = {"": "__root__", ".": "%2E", "..": "%2E%2E"}


def dataset_name(key: str) -> str:
    """HDF5 dataset name of a flattened key (URL-quoted, so "/" becomes %2F)."""
    quoted = quote(key, safe="")
    return _RESERVED_NAMES.get(quoted, quoted)


# --------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------

_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.bool_),
}
_TORCH_OF_NUMPY = {v: k for k, v in _NUMPY_DTYPES.items()}

ENCODING_NATIVE = "native"  # numpy has the dtype
ENCODING_BFLOAT16 = "bfloat16"  # uint16 bit patterns, flagged
ENCODING_BYTES = "bytes"  # raw bytes, uint8 with a trailing axis of the element size


def dtype_name(dtype: torch.dtype) -> str:
    """``"torch.float32"`` for torch.float32."""
    return str(dtype)


def torch_dtype_from_name(name: str) -> torch.dtype | None:
    """Inverse of :func:`dtype_name` (also accepts "float32"); None if unknown."""
    short = name[len("torch.") :] if name.startswith("torch.") else name
    value = getattr(torch, short, None)
    return value if isinstance(value, torch.dtype) else None


def torch_dtype_of_numpy(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a numpy dtype (any byte order), or None."""
    return _TORCH_OF_NUMPY.get(np.dtype(dtype).newbyteorder("="))


def tensor_encoding(dtype: torch.dtype) -> tuple[str, np.dtype]:
    """How a tensor of ``dtype`` is stored: (encoding, numpy dtype of the data)."""
    if dtype in _NUMPY_DTYPES:
        return ENCODING_NATIVE, _NUMPY_DTYPES[dtype]
    if dtype == torch.bfloat16:
        return ENCODING_BFLOAT16, np.dtype(np.uint16)
    return ENCODING_BYTES, np.dtype(np.uint8)


def stored_shape(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """Shape of the dataset that holds a tensor of ``shape`` and ``dtype``."""
    encoding, _ = tensor_encoding(dtype)
    if encoding == ENCODING_BYTES:
        return (*shape, torch.empty((), dtype=dtype).element_size())
    return tuple(shape)


def storage_array(t: torch.Tensor) -> np.ndarray:
    """A numpy array aliasing the memory of CPU tensor ``t`` in its stored dtype.

    No copy. For the native and bfloat16 encodings ``t`` may be strided; for
    the bytes encoding it must be contiguous.
    """
    encoding, _ = tensor_encoding(t.dtype)
    if encoding == ENCODING_NATIVE:
        return t.numpy()
    if encoding == ENCODING_BFLOAT16:
        return t.view(torch.uint16).numpy()
    assert t.is_contiguous(), "bytes-encoded tensors are viewed only when contiguous"
    return t.reshape(-1).view(torch.uint8).numpy().reshape(stored_shape(tuple(t.shape), t.dtype))


def map_file_range(
    fd: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...], file_size: int
) -> torch.Tensor | None:
    """A tensor viewing bytes ``offset ..`` of the open file ``fd`` through a
    copy-on-write mapping of just those pages (Note [fast reads]).

    No copy: pages are read from the file when touched. One mapping per tensor,
    never the whole file: the kernel refuses a writable private mapping larger
    than the memory it could ever back (its overcommit heuristic), which a
    checkpoint of a model larger than RAM is. None when the data is empty, not
    64-byte aligned, or past the end of the file (the caller copies instead, and
    reports a truncation).
    """
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if numel == 0 or offset % 64 or offset + nbytes > file_size:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset - start + nbytes, offset=start, access=mmap.ACCESS_COPY)
    register_read_mapping(mapping)
    # The tensor holds the mapping: it is unmapped when the last view dies.
    flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset - start)
    return flat.view(shape)


# --------------------------------------------------------------------------
# Checksum
# --------------------------------------------------------------------------


class Sum64:
    """Sum of the data read as little-endian uint64 words, mod 2**64.

    Chosen over CRC32 for speed (about 4x faster here, close to memory
    bandwidth, so it does not slow saving or loading noticeably). It detects
    every change of a single word, so every random byte flip; it does not
    detect reordered words, which is not how files get damaged. The final
    partial word is zero-padded. Feed the bytes in order with :meth:`update`.
    """

    __slots__ = ("_pending", "_total")

    def __init__(self) -> None:
        self._total = 0
        self._pending = b""

    def update(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if self._pending:
            need = 8 - len(self._pending)
            self._pending += data[:need].tobytes()
            data = data[need:]
            if len(self._pending) < 8:
                return
            self._total += int.from_bytes(self._pending, "little")
            self._pending = b""
        whole = len(data) // 8 * 8
        if whole:
            words = data[:whole].view("<u8")
            self._total += int(words.sum(dtype=np.uint64))
        self._pending = data[whole:].tobytes()

    def digest(self) -> int:
        tail = int.from_bytes(self._pending.ljust(8, b"\0"), "little") if self._pending else 0
        return (self._total + tail) % (1 << 64)


def checksum(array: np.ndarray) -> int:
    """:class:`Sum64` of one array."""
    s = Sum64()
    s.update(array)
    return s.digest()

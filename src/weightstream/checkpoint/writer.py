"""Streaming, atomic writer of H5 checkpoints (layout: Note [checkpoint layout]).

# Note [atomic save]

A save writes a temporary file next to the target (same directory, so the
final rename never crosses file systems), leaf by leaf, then writes the root
attributes with ``__SUCCESS__`` last, closes it, fsyncs it, renames it over the
target and fsyncs the directory. Until that rename the target is untouched, so
a crash or a kill at any moment leaves the previous checkpoint intact; the
temporary file is hidden (``.{name}.{pid}-{token}.tmp``), never matches
``checkpoint_{step}.mdl`` and has no ``__SUCCESS__``. On any exception
(KeyboardInterrupt included) it is deleted before the exception propagates; the
run command of a single process turns SIGTERM (a job scheduler's stop) into such
an exception. Under data parallel, SIGTERM keeps its default (torchrun's agent
stops every rank), and, as with SIGKILL, a process that cannot clean up leaves
its temporary file behind, harmless, until the next run in that model_dir
deletes it (``remove_stale_temporaries``: the files of processes that are gone).

# Note [save memory]

Leaves are written one at a time, straight from the tensor's memory: the
bytes of a contiguous CPU tensor go to the file from numpy views of its
pieces, no copy (Note [direct data writes], Note [parallel pieces]; for
compressed datasets, HDF5 gets views of pieces of about ``SLAB_BYTES`` along
the first dimension). A strided tensor is written in pieces of about
``SLAB_BYTES`` along its first dimension, one at a time, each made contiguous,
then dropped. A tensor on another device is copied to the CPU one at a time,
and dtypes numpy lacks (float8, complex32) are made contiguous. So the extra
memory of a save is at most one tensor (the largest) plus a small constant,
never a copy of the state; for CPU tensors of the common dtypes it is at most
one piece (plus one row of dim 0, if a row is larger).
Values read for the save (a conversion, ``save(load(path), other)``) are
freed leaf by leaf, and the allocator is asked to give their pages back
(``common.pages.trim_heap``) once they add up to ``TRIM_BYTES``: glibc would
otherwise keep them in its heaps, and a conversion grew by the whole file
(tests/test_bounded_loads.py). Not after every leaf: a trim walks the whole
heap (13 ms in a run command's process), and a checkpoint of a small model
with its optimizer state, 336 leaves, took 4.8 s instead of 0.1.

# Note [direct data writes]

An uncompressed tensor is a contiguous dataset whose file space HDF5
allocates when the dataset is created (``alloc_time`` early; the bytes are
not filled, ``fill_time`` never). The writer asks HDF5 for that byte range
and writes the data there itself with ``os.pwrite`` (through the
:class:`WriteGuard`, so a failed write is kept, not seen by HDF5), as the
reader reads it with ``os.preadv`` (Note [fast reads]). HDF5 never sees the
data, so a piece costs one system call instead of an ``H5Dwrite`` with its
selections, type checks and a call back into Python through the file-object
driver (measured: about a sixth of the time of a 2 GiB save), and the pieces
of a contiguous tensor can be summed and written on several threads (Note
[parallel pieces]; HDF5 calls stay on the caller's thread). This is safe
because HDF5 keeps no copy of raw data of a contiguous dataset it did not
read or write itself, it seeks before each of its own writes (``pwrite``
moves no file position anyway), and the range belongs to this dataset alone.
The file is the same as when HDF5 writes the data, byte for byte in the
data; only the allocation time recorded in the dataset's fill-value message
differs. Compressed (chunked) and 0-d datasets go through ``write_direct``.
"""

from __future__ import annotations

import math
import os
import pickle
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.distributed as dist

from weightstream.checkpoint import format as fmt
from weightstream.checkpoint import pieces
from weightstream.checkpoint.errors import CheckpointWriteError
from weightstream.checkpoint.tree import Deferred, flatten, tree_to_json
from weightstream.checkpoint.write_guard import WriteGuard
from weightstream.common import files
from weightstream.common.pages import release_pages, trim_heap
from weightstream.common.version import __version__

# Tensors are written in pieces of about this many bytes (Note [save memory]):
# small enough to stay in the CPU cache between checksum and write, and the
# most a strided tensor's contiguous copy takes at a time.
SLAB_BYTES = 4 * 2**20
CHUNK_BYTES = 2**20  # a compressed dataset's chunks (_options_for)

# The heap is trimmed once the values this save allocated (reads, device copies)
# add up to this many bytes (Note [save memory]): a trim walks the whole heap.
TRIM_BYTES = 64 * 2**20

# HDF5 format bounds: 1.8 object headers (checksummed metadata, attributes
# larger than 64 KiB for big specs), nothing newer than 1.10 so that the
# reference system's HDF5 reads the file.
LIBVER = ("v108", "v110")

COMPRESSIONS = (None, "gzip", "lz4")

# Data blocks of 4 KiB or more are aligned (Note [checkpoint layout]): padding <= 4 KiB each.
ALIGNMENT = 4096


def save(
    state_dict: Any,
    path: str | os.PathLike,
    *,
    compression: str | None = None,
    compression_level: int | None = None,
    fsync: bool = True,
    every_rank: bool = False,
) -> None:
    """Save ``state_dict`` to an H5 checkpoint at ``path``, atomically.

    Under data parallel (torch.distributed with more than one rank) rank 0
    writes and the other ranks return at once: every rank holds the same state
    (a sharded store's ``state_dict()`` gathers the whole model on each), and
    the ranks of one script must not write one file together.

    Args:
        state_dict: nested dicts / OrderedDicts / lists / tuples of tensors
            (any dtype, any device, strided or not), Python scalars, strings,
            None, numpy arrays, and other picklable objects (pickled; loading
            those needs ``allow_pickle=True``). A lazy state dict returned by
            :func:`load` is streamed from its file tensor by tensor.
        path: the file to write. Its directory is created if missing. An
            existing file is replaced only once the new one is complete.
        compression: None (default, fastest), "gzip" or "lz4" (needs hdf5plugin).
        compression_level: gzip level 0-9 (default 4); ignored for lz4.
        fsync: flush the file and the directory to disk before returning
            (default). Turn off only for scratch files.
        every_rank: write on every rank (each to its own ``path``), not rank 0 only.

    Raises:
        CheckpointWriteError (an OSError) when the file cannot be written
        (full disk, file size limit, permissions); ``path`` is then untouched.
    """
    target = _target_path(path, "save")
    options = _compression_options(compression, compression_level)
    if not every_rank and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    flat = flatten(state_dict)
    names = _dataset_names([key for key, _ in flat.leaves])
    spec = tree_to_json(flat.tree)
    try:
        with (
            atomic_path(target, fsync=fsync) as tmp,
            open(tmp, "w+b", buffering=0) as raw,
        ):
            guard = WriteGuard(raw, durable=fsync)
            with h5py.File(
                guard,
                "w",
                libver=LIBVER,
                alignment_threshold=ALIGNMENT,
                alignment_interval=ALIGNMENT,
            ) as f:
                writer = LeafWriter(f, options, guard)
                for (key, value), name in zip(flat.leaves, names):
                    writer.write(key, name, value)
                    guard.check()  # stop at the first failed write
                f.attrs[fmt.ATTR_SPEC] = spec
                f.attrs[fmt.ATTR_SPEC_CHECKSUM] = np.uint64(
                    fmt.checksum(np.frombuffer(spec.encode(), np.uint8))
                )
                f.attrs[fmt.ATTR_VERSION] = fmt.FORMAT_VERSION
                writer._text(f, fmt.ATTR_LIBRARY_VERSION, __version__)
                f.attrs[fmt.ATTR_SUCCESS] = True  # last: Note [atomic save]
            guard.check()  # closing flushes the metadata: that may fail too
        if writer.pickled:
            # Written, but load() refuses to unpickle them by default (it can run code).
            shown = ", ".join(f"{k!r} ({t})" for k, t in writer.pickled[:4])
            more = f" and {len(writer.pickled) - 4} more" if len(writer.pickled) > 4 else ""
            warnings.warn(
                f"save(): {shown}{more} stored pickled: load() reads them back only with "
                "allow_pickle=True, since unpickling can run code. Fix: store them as "
                "tensors, numbers, strings, lists or dicts (a set as a sorted list), or load "
                "with allow_pickle=True.",
                stacklevel=2,
            )
    except (OSError, RuntimeError) as e:
        # A failed write (full disk, file size limit, read-only directory);
        # RuntimeError: what h5py raises for some other HDF5 failures.
        raise CheckpointWriteError(
            f"save(): could not write {target} ({type(e).__name__}: {e}). Nothing was "
            f"replaced: {target.name} is as it was before (if it existed) and the partial "
            "temporary file was deleted. Free disk space, raise the file size limit "
            f"(ulimit -f) or make {target.parent} writable, then save again."
        ) from e


def atomic_path(target: Path, *, fsync: bool = True):
    """Yield a temporary path beside ``target`` (its directory made), renamed over it on success.

    See Note [atomic save]; ``common.files.atomic_path``. Also used for
    safetensors and torch outputs.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    return files.atomic_path(target, fsync=fsync)


def _target_path(path: Any, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{what}(): path must be a str or os.PathLike, got {type(path).__name__}. "
            "H5 checkpoints are written to a named file (atomically, through a temporary "
            "file beside it), not to an open file object."
        )
    target = Path(os.fspath(path))
    if target.is_dir():
        raise IsADirectoryError(
            f"{what}(): {target} is a directory; give the checkpoint's file name, "
            f"e.g. {target / 'checkpoint.mdl'}."
        )
    return target


def _compression_options(compression: str | None, level: int | None) -> dict:
    if isinstance(compression, str):
        compression = None if compression.lower() == "none" else compression.lower()
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"save(): compression={compression!r} is not supported; use None (default, "
            "fastest), 'gzip' or 'lz4'."
        )
    if compression == "gzip":
        if level is None:
            level = 4
        if not (isinstance(level, int) and 0 <= level <= 9):
            raise ValueError(f"save(): compression_level={level!r}; gzip takes 0-9.")
        return {"compression": "gzip", "compression_opts": level}
    if compression == "lz4":
        import hdf5plugin  # registers HDF5 filter 32004

        return dict(hdf5plugin.LZ4())
    return {}


def _dataset_names(keys: list[str]) -> list[str]:
    names = [fmt.dataset_name(k) for k in keys]
    seen: dict[str, str] = {}
    for key, name in zip(keys, names):
        if name in seen:
            raise ValueError(
                f"save(): the keys {seen[name]!r} and {key!r} both flatten to the dataset "
                f"name {name!r} (nested keys are joined with '.'), so one would overwrite "
                "the other. Rename one of them."
            )
        seen[name] = key
    return names


def storage_identity(t: torch.Tensor) -> Hashable | None:
    """Equal for two tensors that are the same view of the same memory (tied weights)."""
    if t.numel() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (
        "memory",
        str(t.device),
        ptr,
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


def is_plain_tensor(value: Any) -> bool:
    """A dense tensor stored as data (others, e.g. sparse or quantized, are pickled)."""
    return (
        isinstance(value, torch.Tensor)
        and type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.is_nested
        and value.device.type != "meta"
    )


class LeafWriter:
    """Writes leaves into an open ``h5py.File`` as datasets (Note [checkpoint layout])."""

    def __init__(self, f: h5py.File, compression: dict, guard: WriteGuard) -> None:
        self._f = f
        self._compression = compression
        self._guard = guard  # the file under ``f``, for data written directly
        # First dataset written for each tie identity; later ones become hard links.
        self._first: dict[Hashable, str] = {}
        self._fresh = 0  # bytes this save allocated since the heap was last trimmed
        self._attribute_types: dict[tuple, h5py.h5t.TypeID] = {}
        self.pickled: list[tuple[str, str]] = []  # (key, its type): load needs allow_pickle

    def _put(self, obj: h5py.HLObject, name: str, value: np.ndarray | np.generic) -> None:
        """``obj.attrs[name] = value`` for a dataset (or file) this save just created.

        The same HDF5 attribute (type and space made as h5py makes them), minus
        what h5py redoes on every assignment: looking for an existing attribute
        to replace, converting the value, building its HDF5 types twice. The
        five attributes of a small tensor took a third of the time of saving it.
        """
        array = np.asarray(value)
        key = (array.dtype, repr(array.dtype.metadata))  # metadata: a string's encoding
        tid = self._attribute_types.get(key)
        if tid is None:
            tid = self._attribute_types[key] = h5py.h5t.py_create(array.dtype, logical=True)
        space = h5py.h5s.create_simple(array.shape)  # () gives a scalar space
        # The memory type is the file type: the bytes go in as they are, no conversion.
        h5py.h5a.create(obj.id, name.encode("utf-8"), tid, space).write(array, mtype=tid)

    def _text(self, obj: h5py.HLObject, name: str, value: str) -> None:
        """A string attribute, fixed-length UTF-8 in the object header (Note [checkpoint
        layout]: HDF5 checksums that, not the heap of variable-length strings)."""
        data = value.encode("utf-8")
        self._put(obj, name, np.array(data, dtype=h5py.string_dtype("utf-8", max(1, len(data)))))

    def write(self, key: str, name: str, value: Any) -> None:
        if self._fresh >= TRIM_BYTES:
            trim_heap()  # the earlier leaves' memory goes back (Note [save memory])
            self._fresh = 0
        tie: Hashable | None = None
        if isinstance(value, Deferred):
            # A deferred read allocates fresh memory, so only the source knows ties.
            source_tie = value.tie()
            tie = None if source_tie is None else ("source", source_tie)
            value = value.get()
            if isinstance(value, torch.Tensor):
                self._fresh += value.untyped_storage().nbytes()
        elif is_plain_tensor(value):
            tie = storage_identity(value)
        if tie is not None and tie in self._first:
            self._f[name] = self._f[self._first[tie]]  # HDF5 hard link
            return
        self._write_value(key, name, value)
        if tie is not None:
            self._first[tie] = name

    def _write_value(self, key: str, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise ValueError(
                f"cannot save {key!r}: it is a meta tensor, a shape without values (a model "
                "built on the meta device and never given its weights). Fix: save the model "
                "after its weights exist (loaded, or made by a store: cstorch.compile with "
                "init_weights), or save its shapes as plain values."
            )
        if is_plain_tensor(value):
            self._write_tensor(name, value)
        elif value is None:
            self._data(name, None, fmt.TYPE_NONE)
        elif type(value) in (bool, float, complex) or (
            type(value) is int and -(2**63) <= value < 2**63
        ):
            self._data(name, np.asarray(value), fmt.TYPE_SCALAR)
        elif type(value) is int:
            self._data(name, None, fmt.TYPE_BIGINT, {fmt.ATTR_VALUE: str(value)})
        elif type(value) is str:
            self._write_string(name, value)
        elif type(value) in (bytes, bytearray):
            array = np.frombuffer(bytes(value), dtype=np.uint8)
            self._data(name, array, fmt.TYPE_BYTES, {fmt.ATTR_PYTHON_TYPE: type(value).__name__})
        elif isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
            scalar = isinstance(value, np.generic)
            dset = self._data(name, np.asarray(value), fmt.TYPE_NUMPY, compress=not scalar)
            self._put(dset, fmt.ATTR_BFLOAT16, np.bool_(False))
            if scalar:
                self._put(dset, fmt.ATTR_NUMPY_SCALAR, np.bool_(True))
        elif isinstance(value, torch.dtype):
            self._data(name, None, fmt.TYPE_TORCH_DTYPE, {fmt.ATTR_VALUE: str(value)})
        elif isinstance(value, torch.device):
            self._data(name, None, fmt.TYPE_TORCH_DEVICE, {fmt.ATTR_VALUE: str(value)})
        elif type(value) is torch.Size:
            self._data(name, np.asarray(list(value), dtype=np.int64), fmt.TYPE_TORCH_SIZE)
        else:
            self._write_pickle(key, name, value)

    def _data(
        self,
        name: str,
        array: np.ndarray | None,
        tag: str,
        text: dict[str, str] | None = None,
        *,
        compress: bool = False,
    ) -> h5py.Dataset:
        """A dataset holding ``array``, with its checksum (any data can be damaged); for
        None, a dataset without data: the value lives in its (checksummed) attributes."""
        if array is None:
            dset = self._f.create_dataset(name, data=h5py.Empty("f"))
        else:
            options = self._options_for(array.shape, array.itemsize) if compress else {}
            if not array.flags.c_contiguous:
                array = array.copy(order="C")  # (np.ascontiguousarray would make 0-d 1-d)
            dset = self._f.create_dataset(name, data=array, **options)
        for attr, value in {fmt.ATTR_TYPE: tag, **(text or {})}.items():
            self._text(dset, attr, value)
        if array is not None:
            self._put(dset, fmt.ATTR_CHECKSUM, np.uint64(fmt.checksum(array)))
        return dset

    def _options_for(self, shape: tuple[int, ...], itemsize: int) -> dict:
        # HDF5 filters need chunked storage, which 0-d and empty datasets cannot have.
        if not self._compression or len(shape) == 0 or 0 in shape:
            return {}
        # Whole rows, about CHUNK_BYTES a chunk: h5py's own guess makes chunks of a few
        # KiB, and each compressed chunk is padded to ALIGNMENT (lz4 on fp32 weights:
        # 45% larger than no compression).
        row_bytes = max(1, math.prod(shape[1:]) * itemsize)
        rows = min(shape[0], max(1, CHUNK_BYTES // row_bytes))
        return {**self._compression, "chunks": (rows, *shape[1:])}

    def _write_tensor(self, name: str, value: torch.Tensor) -> None:
        is_parameter = isinstance(value, torch.nn.Parameter)
        requires_grad = bool(value.requires_grad)
        t = value.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # one tensor at a time (Note [save memory])
            self._fresh += t.untyped_storage().nbytes()
        t = t.resolve_conj().resolve_neg()  # no copy unless a lazy conj/neg bit is set
        encoding, np_dtype = fmt.tensor_encoding(t.dtype)
        if encoding == fmt.ENCODING_BYTES and not t.is_contiguous():
            t = t.contiguous()
        shape = fmt.stored_shape(tuple(t.shape), t.dtype)
        options = self._options_for(shape, np.dtype(np_dtype).itemsize)
        direct = not options and len(shape) > 0
        if not options:
            # Contiguous layout and no fill pass: the data is written exactly once.
            options = {"fillvalue": None, "fill_time": "never"}
        if direct:
            # File space now, so that its offset is known (Note [direct data writes]).
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            options["dcpl"] = dcpl
        dset = self._f.create_dataset(name, shape=shape, dtype=np_dtype, **options)
        offset = dset.id.get_offset() if direct and t.numel() > 0 else None
        if offset is not None and t.is_contiguous():
            total = self._write_flat_at(offset, fmt.storage_array(t))
        else:
            total = self._write_pieces(dset, offset, t) if t.numel() > 0 else 0
        # A tensor of the disk store: its pages go back once written, so a save
        # never holds more than one tensor of it (Note [disk tier]).
        release_pages([t])
        self._text(dset, fmt.ATTR_TYPE, fmt.TYPE_TENSOR)
        self._text(dset, fmt.ATTR_DTYPE, str(value.dtype))
        self._put(dset, fmt.ATTR_SHAPE, np.asarray(tuple(value.shape), dtype=np.int64))
        self._put(dset, fmt.ATTR_BFLOAT16, np.bool_(encoding == fmt.ENCODING_BFLOAT16))
        self._put(dset, fmt.ATTR_CHECKSUM, np.uint64(total))
        if is_parameter:
            self._put(dset, fmt.ATTR_IS_PARAMETER, np.bool_(True))
            self._put(dset, fmt.ATTR_REQUIRES_GRAD, np.bool_(requires_grad))

    def _write_pieces(self, dset: h5py.Dataset, offset: int | None, t: torch.Tensor) -> int:
        """Write ``t`` in pieces of about SLAB_BYTES along dim 0 (Note [save memory]),
        through HDF5 or straight to the file at ``offset`` (Note [direct data writes]);
        its Sum64. Each piece is summed, then written while it is in the CPU cache."""
        if t.dim() == 0:
            array = fmt.storage_array(t)
            dset.write_direct(array)
            return fmt.checksum(array)
        digest = fmt.Sum64()
        row_bytes = max(1, t[0].numel() * t.element_size())
        rows = max(1, SLAB_BYTES // row_bytes)
        if dset.chunks is not None:  # whole chunks a piece: none compressed twice
            rows = dset.chunks[0] * max(1, rows // dset.chunks[0])
        for start in range(0, t.shape[0], rows):
            stop = min(start + rows, t.shape[0])
            piece = t[start:stop]
            array = fmt.storage_array(piece if piece.is_contiguous() else piece.contiguous())
            digest.update(array)
            if offset is None:
                dset.write_direct(array, dest_sel=np.s_[start:stop])
            else:
                self._guard.pwrite(array.reshape(-1).view(np.uint8), offset + start * row_bytes)
            del piece, array  # before the next piece exists: one piece at a time
        return digest.digest()

    def _write_flat_at(self, offset: int, array: np.ndarray) -> int:
        """Write a C-contiguous array's bytes to the file at ``offset``, straight from its
        memory (Note [direct data writes]), in pieces (Note [parallel pieces]); its Sum64."""

        def write_piece(start: int, piece: np.ndarray) -> int:
            total = fmt.checksum(piece)  # then written while it is in the CPU cache
            self._guard.pwrite(piece, offset + start)
            return total

        return pieces.combine(pieces.map_pieces(array.reshape(-1).view(np.uint8), write_piece))

    def _write_string(self, name: str, value: str) -> None:
        try:
            encoded = value.encode("utf-8")
        except UnicodeEncodeError:
            encoded = None  # lone surrogates: kept, as bytes in the data
        if (
            encoded is not None
            and len(encoded) <= fmt.MAX_STRING_ATTR_BYTES
            and b"\0" not in encoded
        ):
            self._data(name, None, fmt.TYPE_STRING, {fmt.ATTR_STRING: value})
        else:
            data = value.encode("utf-8", errors="surrogatepass")
            self._data(name, np.frombuffer(data, dtype=np.uint8), fmt.TYPE_STRING)

    def _write_pickle(self, key: str, name: str, value: Any) -> None:
        try:
            data = pickle.dumps(value, protocol=pickle.DEFAULT_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"save(): cannot save key {key!r}: a {type(value).__qualname__} is not a "
                f"tensor, number, string, None or container, and pickling it failed ({e}). "
                "Convert it to one of those types or leave it out of the state."
            ) from e
        python_type = f"{type(value).__module__}.{type(value).__qualname__}"
        self.pickled.append((key, type(value).__qualname__))
        array = np.frombuffer(data, dtype=np.uint8)
        self._data(name, array, fmt.TYPE_PICKLE, {fmt.ATTR_PYTHON_TYPE: python_type})

"""Below the H5 reader: opening a file, reading attributes fast, a dataset's bytes in the file.

Helpers of :class:`~weightstream.checkpoint.reader.H5Source` (and of the
trainer's checkpoint listing) that deal with h5py, HDF5 and the file, not
with the checkpoint layout (Note [checkpoint layout]).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from typing import Any

import h5py
import numpy as np
import torch

from weightstream.checkpoint.errors import CorruptCheckpointError
from weightstream.common.pages import register_read_mapping

DAMAGED_FIX = (
    "The file is damaged (truncated, overwritten, or corrupted in a copy). Load an "
    "earlier checkpoint or copy the file again from a good source."
)


def as_text(value: Any) -> str | None:
    """An attribute value as a str (bytes decoded, a one-element array unwrapped), or None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.size == 1:
        return as_text(value.reshape(-1)[0])
    return str(value)


def open_h5(path: str | os.PathLike) -> h5py.File:
    """``path`` opened read-only with h5py, as plain ``h5py.File(path)`` would open it.

    HDF5 refuses a second open of a file in one process with other file-locking
    flags ("file locking flag values don't match"), so a checkpoint held by a
    lazy :func:`~weightstream.checkpoint.load` uses h5py's default flags, the
    ones a user's own ``h5py.File(path)`` uses; where the file system cannot
    lock (some network and read-only mounts) it opens without locking. A file
    that cannot be opened for a reason of its own (missing, no permission) is
    reported as such; only one that HDF5 cannot read is called damaged.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint file", path)
    if not os.access(path, os.R_OK):
        raise PermissionError(errno.EACCES, "the checkpoint file is not readable", path)
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if "lock" not in str(e).lower():
            raise CorruptCheckpointError(
                f"{path}: cannot open it as HDF5 ({e}). {DAMAGED_FIX}"
            ) from e
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot open it as HDF5 ({e}). {DAMAGED_FIX}") from e


# Attribute types read without h5py's high-level conversions (read_attributes).
_PLAIN_ATTRIBUTE_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.ENUM)


def read_attributes(dset: h5py.Dataset) -> dict[str, Any]:
    """``dict(dset.attrs)``, the same values and types, in 70% of the time.

    For numbers, booleans and fixed-length strings (every attribute we write)
    the value is read through HDF5's low-level calls with the stored type as
    the memory type (the bytes are copied, not converted); anything else
    (variable-length strings, empty attributes, compound types, as files of
    the reference system have) is read by h5py as usual. Attributes were
    half the time of loading a small tensor.
    """
    dsid = dset.id
    values: dict[str, Any] = {}
    for index in range(h5py.h5a.get_num_attrs(dsid)):
        attr = h5py.h5a.open(dsid, index=index)
        try:
            name = attr.name.decode("utf-8")
        except UnicodeDecodeError:  # a name h5py decodes its own way
            return dict(dset.attrs)
        tid = attr.get_type()
        kind = tid.get_class()
        space = attr.get_space()
        array = None
        plain = kind in _PLAIN_ATTRIBUTE_CLASSES or (
            kind == h5py.h5t.STRING and not tid.is_variable_str()
        )
        if plain and space.get_simple_extent_type() != h5py.h5s.NULL:  # NULL: h5py.Empty
            try:
                array = np.empty(space.shape, tid.dtype)
            except (TypeError, ValueError):  # no numpy dtype for it: h5py knows better
                array = None
        if array is None:
            values[name] = dset.attrs[name]
            continue
        attr.read(array, mtype=tid)
        values[name] = array[()] if array.ndim == 0 else array
    return values


def raw_offset(dset: h5py.Dataset) -> int | None:
    """File offset of the data if it is one plain byte range, else None."""
    plist = dset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() != 0:
        return None
    if plist.get_external_count() != 0:
        return None
    return dset.id.get_offset()


def map_file_range(
    fd: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...], file_size: int
) -> torch.Tensor | None:
    """A tensor viewing bytes ``offset ..`` of the open file ``fd`` through a
    copy-on-write mapping of just those pages (Note [fast reads]); None when the data
    is empty, not 64-byte aligned, or past the end of the file (the caller copies
    instead, and reports a truncation)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if numel == 0 or offset % 64 or offset + nbytes > file_size:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset - start + nbytes, offset=start, access=mmap.ACCESS_COPY)
    register_read_mapping(mapping)
    # The tensor holds the mapping: it is unmapped when the last view dies.
    flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset - start)
    return flat.view(shape)


def storage_kind(dset: h5py.Dataset) -> str:
    """How the data is stored, for ``info``: "contiguous", "lz4", "gzip+shuffle", "chunked", ..."""
    if dset.shape is None:
        return "attribute"
    plist = dset.id.get_create_plist()
    filters = []
    for i in range(plist.get_nfilters()):
        code = plist.get_filter(i)[0]
        filters.append(
            {1: "gzip", 2: "shuffle", 3: "fletcher32", 32004: "lz4"}.get(code, str(code))
        )
    if filters:
        return "+".join(filters)
    layout = plist.get_layout()
    return {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.COMPACT: "compact"}.get(layout, "chunked")

"""Reading H5 checkpoints: ours and the reference system's (Note [checkpoint layout]).

# Note [fast reads]

A tensor is read into a freshly allocated tensor (``torch.empty``) through
its numpy view, so loading costs one copy from the page cache and no more. For
a dataset that is contiguous, unfiltered and stored in the requested byte
order (everything we write without compression), the byte range is read with
``os.preadv`` at the offset HDF5 reports: no HDF5 call on the data path, and
the pieces of a large tensor are read and summed on a few threads (Note
[parallel pieces]). Other datasets (LZ4 or gzip compressed, chunked,
big-endian) go through ``Dataset.read_direct`` into the same preallocated
buffer. Every dataset with a ``checksum_sum64`` attribute is verified after
the read.

With ``mmap=True`` (the default of a lazy ``load``) such a plain byte range is
not copied at all: the tensor is a view of a copy-on-write mapping of its own
pages of the file (writable, changes stay in memory), as safetensors and
``torch.load(mmap=True)`` do. One mapping per tensor, not per file: the kernel
refuses a writable private mapping larger than the memory it could back (its
overcommit heuristic), as a checkpoint of a model larger than RAM is. The
checksum is still verified (reading the pages once through the page cache),
and the verified pages are given back at once
(``common.pages.release_pages``), so reading every tensor of a large
checkpoint costs address space until they are used (Note [bounded loads]). The
mapping lives as long as the tensor; a file replaced by a later save (a
rename) does not affect it, but a file truncated in place by another program
would (SIGBUS on access), which is why the eager modes copy.
"""

from __future__ import annotations

import itertools
import os
import pickle
import warnings
from collections.abc import Hashable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import h5py
import numpy as np
import torch

from weightstream.checkpoint import format as fmt
from weightstream.checkpoint import kernel, pieces
from weightstream.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
)
from weightstream.checkpoint.h5file import (
    DAMAGED_FIX,
    as_text,
    map_file_range,
    open_h5,
    raw_offset,
    read_attributes,
    storage_kind,
)
from weightstream.checkpoint.refspec import decode_reference_spec
from weightstream.checkpoint.source import LeafInfo, Source, read_exact
from weightstream.checkpoint.tree import (
    Branch,
    Leaf,
    Node,
    is_tree_json,
    iter_leaves,
    tree_from_json,
)
from weightstream.common.pages import release_pages

# Tags of the reference system's newer storage layer (`__TYPE__` attribute).
_TENSOR_TAGS = {fmt.TYPE_TENSOR, "TorchTensorSerializer"}
_REFERENCE_TYPE_ATTR = "__TYPE__"
_REFERENCE_NUMPY_ATTR = "__NUMPY__"
_REFERENCE_BYTES_ATTR = "__BYTES__"
_REFERENCE_OBJECT_ATTR = "object_value"

_source_ids = itertools.count()


def _version(value: Any) -> float | None:
    try:
        return None if value is None else float(as_text(value) or "")
    except ValueError:
        return None


class H5Source(Source):
    """An H5 checkpoint opened for reading (kept open until :meth:`close`)."""

    format = "h5"

    def __init__(
        self,
        path: Path,
        *,
        allow_pickle: bool = False,
        allow_incomplete: bool = False,
        verify: bool = True,
        mmap: bool = False,
    ) -> None:
        self.path = Path(path)
        self._allow_pickle = allow_pickle
        self._verify = verify
        self._use_mmap = mmap
        self._file_size: int | None = None  # for mapped reads
        self._uid = next(_source_ids)
        self._fd: int | None = None
        self._last: tuple[str, h5py.Dataset] | None = None  # see _dataset
        self._f = open_h5(self.path)
        try:
            self._open(allow_incomplete)
        except BaseException:
            self.close()
            raise

    # -- opening ----------------------------------------------------------

    def _open(self, allow_incomplete: bool) -> None:
        try:
            attrs = dict(self._f.attrs)
            names = set(self._f.keys())  # link names only: no object is opened
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise self._damaged(f"cannot read the file's index ({e}).") from e
        if not bool(attrs.get(fmt.ATTR_SUCCESS, False)) and not allow_incomplete:
            raise IncompleteCheckpointError(
                f"{self.path} is incomplete: it has no {fmt.ATTR_SUCCESS} marker, which a save "
                "writes last, so the save that wrote it was probably interrupted (crash, "
                "kill, full disk). Load the previous checkpoint instead "
                "(weightstream.checkpoint.find_latest_checkpoint skips incomplete files) "
                "and save again. Only if it comes from an old release that did not write "
                "the marker and you know it is whole, pass allow_incomplete=True."
            )
        self.version = _version(attrs.get(fmt.ATTR_VERSION))
        if self.version is not None and self.version > fmt.FORMAT_VERSION + 1e-9:
            raise CheckpointError(
                f"{self.path} has checkpoint format version {self.version}, newer than "
                f"{fmt.FORMAT_VERSION}, the newest this weightstream reads. Upgrade weightstream."
            )
        self._attrs = attrs
        self.tree, flat_names = self._decode_tree(attrs.get(fmt.ATTR_SPEC), names)
        self._names = flat_names or {
            leaf.key: fmt.dataset_name(leaf.key) for leaf in iter_leaves(self.tree)
        }
        missing = [k for k, n in self._names.items() if n not in names]
        if missing:
            shown = ", ".join(repr(k) for k in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise self._damaged(
                f"{len(missing)} value(s) listed in its spec have no dataset: {shown}{more}. "
                "Datasets were deleted or renamed after the save."
            )
        self._fd = os.open(self.path, os.O_RDONLY)

    def _decode_tree(self, spec: Any, names: set[str]) -> tuple[Node, dict[str, str] | None]:
        """The tree, and for a file without a usable spec the key -> dataset names."""
        text = as_text(spec)
        if text is None and fmt.ATTR_LIBRARY_VERSION in self._attrs:
            # Every file weightstream writes has a spec: without it the nesting of the
            # state is lost, and a flat dict of dataset names is not what was saved.
            raise self._damaged(
                f"its {fmt.ATTR_SPEC} attribute (the state's structure), which weightstream always "
                "writes, is missing."
            )
        stored = self._attrs.get(fmt.ATTR_SPEC_CHECKSUM)
        if text is not None and stored is not None and self._verify:
            actual = fmt.checksum(np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8))
            if actual != int(np.asarray(stored).reshape(-1)[0]):
                raise self._damaged(
                    f"its {fmt.ATTR_SPEC} attribute (the state's structure) does not match its "
                    "checksum."
                )
        if text is not None and is_tree_json(text):
            try:
                return tree_from_json(text), None
            except ValueError as e:
                raise self._damaged(
                    f"its {fmt.ATTR_SPEC} attribute (the state's structure) is unreadable ({e})."
                ) from e
        if text is not None:
            try:
                return decode_reference_spec(text), None
            except Exception as e:  # any failure: fall back to the flat keys below
                warnings.warn(
                    f"{self.path}: its {fmt.ATTR_SPEC} (a pickled pytree spec from the reference "
                    f"system) could not be decoded safely ({e}); the state is returned as a "
                    "flat dict keyed by the flattened names.",
                    stacklevel=4,
                )
        by_key = {unquote(n): n for n in sorted(names)}
        keys = list(by_key)
        return Branch("dict", keys, [Leaf(k) for k in keys]), by_key

    def _damaged(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {what} {DAMAGED_FIX}")

    # -- Source ------------------------------------------------------------

    @contextmanager
    def _reading(self, key: str) -> Iterator[tuple[str, h5py.Dataset]]:
        """The dataset name and dataset of ``key``; h5py's errors on a damaged file
        become one that names file, key and fix."""
        name = self._lookup(self._names, key)
        try:
            yield name, self._dataset(name)
        except CheckpointError:
            raise
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as e:
            raise self._damaged(f"cannot read key {key!r} (dataset {name!r}): {e}.") from e

    def _dataset(self, name: str) -> h5py.Dataset:
        """The dataset ``name``, opened once for the calls about one key in a row.

        A load asks for a key's tie, then reads it: opening the dataset once
        instead of twice saves a tenth of the time per small tensor.
        """
        if self._last is None or self._last[0] != name:
            self._last = (name, self._f[name])
        return self._last[1]

    def read(self, key: str) -> Any:
        with self._reading(key) as (name, dset):
            return self._read_dataset(key, name, dset)

    def tie(self, key: str) -> Hashable | None:
        with self._reading(key) as (_, dset):
            return ("h5", self._uid, h5py.h5o.get_info(dset.id).addr)

    def describe(self, key: str) -> LeafInfo:
        with self._reading(key) as (_, dset):
            attrs = read_attributes(dset)
            kind = self._kind(dset, attrs)
            shape = None if dset.shape is None else tuple(dset.shape)
            dtype: str | None = None
            if kind == "tensor":
                torch_dtype = self._tensor_dtype(key, dset, attrs)
                dtype = str(torch_dtype)
                if fmt.ATTR_SHAPE in attrs:
                    shape = tuple(int(d) for d in attrs[fmt.ATTR_SHAPE])
                elif fmt.tensor_encoding(torch_dtype)[0] == fmt.ENCODING_BYTES and shape:
                    shape = shape[:-1]
            elif kind == "numpy":
                dtype = f"numpy.{dset.dtype}"
            elif kind == "object":
                dtype = as_text(attrs.get(fmt.ATTR_PYTHON_TYPE))
            elif kind == "scalar" and dset.shape is not None:
                dtype = str(dset.dtype)
            nbytes = 0 if dset.shape is None else int(dset.size * dset.dtype.itemsize)
            return LeafInfo(key, kind, shape, dtype, nbytes, storage_kind(dset))

    def properties(self) -> dict[str, Any]:
        library = self._attrs.get(fmt.ATTR_LIBRARY_VERSION)
        writer = "weightstream"
        if library is None:
            library, writer = self._attrs.get(fmt.ATTR_REFERENCE_LIBRARY_VERSION), "reference"
        return {
            "format": "h5",
            "format_version": self.version,
            "writer": writer,
            "library_version": as_text(library),
            "complete": bool(self._attrs.get(fmt.ATTR_SUCCESS, False)),
        }

    def close(self) -> None:
        # Tensors mapped from the file keep the mapping alive; just drop ours.
        self._last = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        f, self._f = getattr(self, "_f", None), None
        if f is not None:
            with suppress(Exception):  # closing a damaged file must not mask the real error
                f.close()

    # -- values ------------------------------------------------------------

    def _kind(self, dset: h5py.Dataset, attrs: Any) -> str:
        tag = as_text(attrs.get(fmt.ATTR_TYPE)) or as_text(attrs.get(_REFERENCE_TYPE_ATTR))
        if _REFERENCE_BYTES_ATTR in attrs or tag in (fmt.TYPE_PICKLE, fmt.TYPE_REFERENCE_OBJECT):
            return "object"
        if tag in _TENSOR_TAGS:
            return "tensor"
        if tag == fmt.TYPE_NUMPY:
            # The reference saved tensors under this tag up to format 0.3.
            return "tensor" if self.version is not None and self.version <= 0.3 else "numpy"
        simple = {
            fmt.TYPE_SCALAR: "scalar",
            fmt.TYPE_STRING: "string",
            fmt.TYPE_NONE: "none",
            fmt.TYPE_BYTES: "bytes",
            fmt.TYPE_BIGINT: "scalar",
            fmt.TYPE_TORCH_DTYPE: "dtype",
            fmt.TYPE_TORCH_DEVICE: "device",
            fmt.TYPE_TORCH_SIZE: "size",
        }
        if tag in simple:
            return simple[tag]
        if tag is not None and not attrs.get(_REFERENCE_NUMPY_ATTR):
            return f"unknown:{tag}"
        # Untagged: the layouts of older reference releases.
        if attrs.get("is_none"):
            return "none"
        if attrs.get("is_string") or fmt.ATTR_STRING in attrs:
            return "string"
        if dset.shape is None:
            return "none"
        if attrs.get("is_scalar"):
            return "scalar"
        return "tensor"

    def _read_dataset(self, key: str, name: str, dset: h5py.Dataset) -> Any:
        attrs = read_attributes(dset)
        kind = self._kind(dset, attrs)
        if kind == "tensor":
            return self._read_tensor(key, name, dset, attrs)
        if kind == "none":
            return None
        if kind == "scalar":
            if as_text(attrs.get(fmt.ATTR_TYPE)) == fmt.TYPE_BIGINT:
                return int(as_text(attrs[fmt.ATTR_VALUE]) or "")
            return self._read_array(key, name, dset, attrs).item()
        if kind == "string":
            for attr in (fmt.ATTR_STRING, "string_val"):
                if attr in attrs:
                    return as_text(attrs[attr])
            data = self._read_array(key, name, dset, attrs)
            return data.tobytes().decode("utf-8", errors="surrogatepass")
        if kind == "numpy":
            array = self._read_array(key, name, dset, attrs)
            if attrs.get(fmt.ATTR_BFLOAT16):
                return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
            return array[()] if attrs.get(fmt.ATTR_NUMPY_SCALAR) else array
        if kind == "bytes":
            data = self._read_array(key, name, dset, attrs).tobytes()
            return (
                bytearray(data) if as_text(attrs.get(fmt.ATTR_PYTHON_TYPE)) == "bytearray" else data
            )
        if kind == "dtype":
            value = fmt.torch_dtype_from_name(as_text(attrs[fmt.ATTR_VALUE]) or "")
            if value is None:
                raise CorruptCheckpointError(
                    f"{self.path}: key {key!r} names an unknown torch dtype "
                    f"{attrs[fmt.ATTR_VALUE]!r}. It was saved by a newer torch; upgrade torch."
                )
            return value
        if kind == "device":
            return torch.device(as_text(attrs[fmt.ATTR_VALUE]) or "cpu")
        if kind == "size":
            return torch.Size(int(d) for d in self._read_array(key, name, dset, attrs))
        if kind == "object":
            return self._read_object(key, name, dset, attrs)
        raise CheckpointError(
            f"{self.path}: key {key!r} (dataset {name!r}) has the type tag "
            f"{kind.split(':', 1)[-1]!r}, which this weightstream does not know. It was "
            "probably written by a newer release; upgrade weightstream."
        )

    def _read_object(self, key: str, name: str, dset: h5py.Dataset, attrs: dict) -> Any:
        if _REFERENCE_BYTES_ATTR in attrs:
            data = np.asarray(attrs[_REFERENCE_BYTES_ATTR]).tobytes()
        elif _REFERENCE_OBJECT_ATTR in attrs:
            data = bytes.fromhex(as_text(attrs[_REFERENCE_OBJECT_ATTR]) or "")
        else:
            data = self._read_array(key, name, dset, attrs).tobytes()
        python_type = as_text(attrs.get(fmt.ATTR_PYTHON_TYPE)) or "Python object"
        if not self._allow_pickle:
            raise PickleNotAllowedError(
                f"{self.path}: key {key!r} holds a pickled {python_type}. Unpickling can run "
                "arbitrary code, so it is refused by default. If you trust this file, pass "
                "allow_pickle=True to load() (`weightstream checkpoint` commands: "
                "--allow-pickle). Otherwise load "
                "lazily (map_location=None) and leave this key alone."
            )
        try:
            import dill  # the reference pickles with dill; plain pickle reads most of it

            return dill.loads(data)
        except ImportError:
            return pickle.loads(data)

    def _tensor_dtype(self, key: str, dset: h5py.Dataset, attrs: Any) -> torch.dtype:
        name = as_text(attrs.get(fmt.ATTR_DTYPE))
        if name is None and "dtypes" in attrs:
            name = as_text(np.asarray(attrs["dtypes"]).reshape(-1)[0])
        if name is not None:
            dtype = fmt.torch_dtype_from_name(name)
            if dtype is None:
                raise CheckpointError(
                    f"{self.path}: key {key!r} has dtype {name!r}, unknown to this torch "
                    f"({torch.__version__}). Upgrade torch to read it."
                )
            return dtype
        if attrs.get(fmt.ATTR_BFLOAT16):
            return torch.bfloat16
        dtype = fmt.torch_dtype_of_numpy(dset.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{self.path}: key {key!r} has HDF5 data of numpy type {dset.dtype}, which "
                "has no torch dtype; read it with h5py directly."
            )
        return dtype

    def _read_tensor(self, key: str, name: str, dset: h5py.Dataset, attrs: dict) -> torch.Tensor:
        dtype = self._tensor_dtype(key, dset, attrs)
        encoding, np_dtype = fmt.tensor_encoding(dtype)
        on_disk = tuple(dset.shape or ())
        if fmt.ATTR_SHAPE in attrs:
            shape = tuple(int(d) for d in np.asarray(attrs[fmt.ATTR_SHAPE]).reshape(-1))
        else:
            shape = on_disk[:-1] if encoding == fmt.ENCODING_BYTES else on_disk
        stored_dtype = dset.dtype.newbyteorder("=")
        allowed = {np_dtype} | ({np.dtype(np.int16)} if dtype == torch.bfloat16 else set())
        if fmt.stored_shape(shape, dtype) != on_disk or stored_dtype not in allowed:
            raise self._damaged(
                f"key {key!r} (dataset {name!r}) says it is a {dtype} tensor of shape "
                f"{list(shape)} but holds {dset.dtype} data of shape {list(on_disk)}."
            )
        out = self._map(dset, dtype, shape, stored_dtype)
        if out is not None:
            expected = self._expected(attrs)
            if expected is not None:  # reads every mapped page, on threads
                actual = pieces.parallel_checksum(fmt.storage_array(out).view(stored_dtype))
                self._compare(key, name, actual, expected)
                release_pages([out])  # verified: touched again only when used
        else:
            out = torch.empty(shape, dtype=dtype)
            if out.numel() > 0:
                # bfloat16 may be stored as int16 (the reference allows it): same bits.
                target = fmt.storage_array(out).view(stored_dtype)
                self._read_into(key, name, dset, attrs, target)
        if attrs.get(fmt.ATTR_IS_PARAMETER):
            out = torch.nn.Parameter(out, requires_grad=bool(attrs.get(fmt.ATTR_REQUIRES_GRAD)))
        return out

    def _map(
        self, dset: h5py.Dataset, dtype: torch.dtype, shape: tuple, stored_dtype: np.dtype
    ) -> torch.Tensor | None:
        """The tensor as a view of the file mapping, or None to copy (Note [fast reads])."""
        if not self._use_mmap or self._fd is None or dset.dtype != stored_dtype:
            return None
        offset = raw_offset(dset)
        if offset is None:
            return None
        if self._file_size is None:
            self._file_size = os.fstat(self._fd).st_size
        return map_file_range(self._fd, offset, dtype, shape, self._file_size)

    def _read_array(self, key: str, name: str, dset: h5py.Dataset, attrs: dict) -> np.ndarray:
        array = np.empty(dset.shape, dtype=dset.dtype.newbyteorder("="))
        if array.size > 0:
            self._read_into(key, name, dset, attrs, array)
        return array

    def _expected(self, attrs: dict) -> int | None:
        """The stored checksum to verify against, or None (not stored, or verify=False)."""
        if not self._verify or fmt.ATTR_CHECKSUM not in attrs:
            return None
        return int(np.asarray(attrs[fmt.ATTR_CHECKSUM]).reshape(-1)[0])

    def _compare(self, key: str, name: str, actual: int, expected: int) -> None:
        if actual != expected:
            raise self._damaged(
                f"the data of key {key!r} (dataset {name!r}) does not match its checksum: its "
                "bytes changed after the save. The file cannot be trusted."
            )

    def _read_into(
        self, key: str, name: str, dset: h5py.Dataset, attrs: dict, target: np.ndarray
    ) -> None:
        """Fill ``target`` (C-contiguous, native order) and verify it (Note [fast reads]);
        a plain byte range in pieces, each summed as it arrives (Note [parallel pieces])."""
        expected = self._expected(attrs)
        offset = raw_offset(dset)
        if offset is None or dset.dtype != target.dtype or self._fd is None:
            import hdf5plugin  # noqa: F401  (importing registers its HDF5 filters: LZ4, ...)

            dset.read_direct(target)
            if expected is not None:
                self._compare(key, name, pieces.parallel_checksum(target), expected)
            return
        buffer = memoryview(target.reshape(-1).view(np.uint8))
        address = target.ctypes.data
        verify = expected is not None
        fd = self._fd

        def read_piece(start: int, piece: memoryview) -> int | None:
            kernel.populate(address + start, len(piece))  # Note [populate before read]
            if not read_exact(fd, piece, offset + start):
                return None  # past the end of the file
            return fmt.checksum(np.frombuffer(piece, dtype=np.uint8)) if verify else 0

        sums = pieces.map_pieces(buffer, read_piece)  # Note [parallel pieces]
        if any(s is None for s in sums):
            raise self._damaged(
                f"key {key!r} (dataset {name!r}) ends past the end of the file: the file is "
                "truncated."
            )
        if expected is not None:
            self._compare(key, name, pieces.combine(sums), expected)

"""Resident pages of file-mapped tensors: give them back, or ask for them early.

The disk store (``runtime/store.py``, Note [disk tier]) keeps tensors in files
mapped shared into memory. Code that only holds such a tensor (the checkpoint
writer, after writing it) gives its pages back with :func:`release_pages`,
without knowing which store owns it: a store file is recognised by its name's
suffix, ``STORE_SUFFIX``, which torch keeps on the storage (``filename``).
Only those files are advised: ``MADV_DONTNEED`` on a shared file mapping drops
clean pages and leaves dirty ones to the kernel's writeback, but on private
memory it would throw the data away.

The other kind is a checkpoint read lazily (``checkpoint.load``): its tensors
are copy-on-write views of the file (Note [fast reads]). Their pages count in
RSS from their first touch until the view dies, so a load that copies a whole
model out of them would hold the whole model. The reader registers each such
mapping (:func:`register_read_mapping`), and :func:`release_pages` asks the
kernel to reclaim a view's pages once it has been copied (``MADV_PAGEOUT``:
clean pages are dropped and read again from the file if touched; pages the
program wrote stay, so no data can be lost).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import weakref
from collections.abc import Iterable

import torch

# The name suffix of every disk-store file (the files are unlinked once mapped;
# torch keeps the name on the storage).
STORE_SUFFIX = ".wsstore"

MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)
_PAGE = mmap.PAGESIZE


@functools.cache
def libc_function(name: str, argtypes: tuple, restype=ctypes.c_int):
    """The C library's function ``name`` with its signature (``errno`` kept for
    ``ctypes.get_errno``), or None where there is none: not Linux, or a C library
    without it (``malloc_trim`` and ``mallopt`` are glibc's). Looked up in the C
    library the interpreter already runs on (``ctypes.CDLL(None)``: no library
    search), once per signature."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


# madvise(addr, length, advice), on the storages' own addresses: torch's mapping
# is page-aligned and has no Python object to call madvise on.
madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def is_store_mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a disk-store file (a shared mapping; see the module doc)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    name = t.untyped_storage().filename
    return name is not None and name.endswith(STORE_SUFFIX)


# Start address -> end of each live copy-on-write checkpoint mapping (reader side).
_read_mappings: dict[int, int] = {}


def register_read_mapping(mapping: mmap.mmap) -> None:
    """Record ``mapping`` (a copy-on-write mapping of a checkpoint file) so that
    :func:`release_pages` may reclaim the pages of tensors viewing it. The entry
    goes when the mapping object is garbage collected."""
    if len(mapping) == 0:
        return
    anchor = ctypes.c_char.from_buffer(mapping)  # an export of the buffer, dropped below
    start = ctypes.addressof(anchor)
    del anchor
    _read_mappings[start] = start + len(mapping)
    weakref.finalize(mapping, _read_mappings.pop, start, None)


def _in_read_mapping(start: int, end: int) -> bool:
    return any(lo <= start and end <= hi for lo, hi in _read_mappings.items())


def release_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Give back the resident pages of any of ``tensors`` that live in a disk store
    or view a lazily read checkpoint (see the module doc); others are left alone."""
    if madvise is None:
        return
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        if is_store_mapped(t):
            storage = t.untyped_storage()
            madvise(storage.data_ptr(), storage.nbytes(), mmap.MADV_DONTNEED)
        elif _read_mappings:
            storage = t.untyped_storage()
            start, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and _in_read_mapping(start, start + nbytes):
                # Whole pages inside the view only: the neighbours' pages are not ours.
                lo = -(-start // _PAGE) * _PAGE
                hi = (start + nbytes) // _PAGE * _PAGE
                if hi > lo:
                    madvise(lo, hi - lo, MADV_PAGEOUT)


_malloc_trim = libc_function("malloc_trim", (ctypes.c_size_t,))


def trim_heap() -> None:
    """Give the allocator's free pages back to the system (glibc's ``malloc_trim``).

    glibc raises its mmap threshold after a large block is freed, and later
    blocks of that size come from its heaps, which keep freed pages: a loop
    that reads one large tensor after another (a checkpoint conversion) would
    otherwise grow by every tensor it ever held. Cheap next to the I/O of a
    tensor; a no-op where the C library has no such call.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)

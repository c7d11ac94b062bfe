"""Resident pages of file-mapped tensors: give them back, or ask for them early.

The disk store (``runtime/store.py``, Note [disk tier]) keeps tensors in files
mapped shared into memory. Code that only holds such a tensor (the checkpoint
writer, after writing it) gives its pages back with :func:`release_pages`,
without knowing which store owns it: a store file is recognised by its name's
suffix, ``STORE_SUFFIX``, which torch keeps on the storage (``filename``).
Only those files are advised: ``MADV_DONTNEED`` on a shared file mapping drops
clean pages and leaves dirty ones to the kernel's writeback, but on private
memory it would throw the data away.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

import torch

# The name suffix of every disk-store file (the files are unlinked once mapped;
# torch keeps the name on the storage).
STORE_SUFFIX = ".wsstore"

MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)


def _libc_madvise():
    """``madvise(addr, length, advice)`` from the C library, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


# On the storages' own addresses: torch's mapping is page-aligned and has no
# Python object to call madvise on.
madvise = _libc_madvise()


def is_store_mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a disk-store file (a shared mapping; see the module doc)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    name = t.untyped_storage().filename
    return name is not None and name.endswith(STORE_SUFFIX)


def release_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Give back the resident pages of any of ``tensors`` that live in a disk store."""
    if madvise is None:
        return
    for t in tensors:
        if is_store_mapped(t):
            storage = t.untyped_storage()
            madvise(storage.data_ptr(), storage.nbytes(), mmap.MADV_DONTNEED)

"""Explicit I/O for the disk store's files: aligned buffers, reader and writer threads.

Note [explicit disk I/O]
------------------------
The disk store (Note [disk tier] in runtime/store.py) keeps each tensor of the
training state that the RAM tier does not hold in a file of its own, mapped
shared so that any code may read it as an ordinary tensor. The step's own
traffic does not go through those mappings: a page fault per 4 KiB is CPU
time on the compute thread, the kernel decides when to read ahead and when to
write back, and every page passes through the page cache, which then holds
gigabytes that the next cyclic pass evicts before reusing.

Instead the hot paths move whole tensors between the files and a pool of
page-aligned host buffers with ``pread``/``pwrite`` on descriptors opened with
``O_DIRECT`` (where the file system refuses it, buffered descriptors whose
pages are written out and dropped after each transfer):

* gradients: the store copies autograd's gradient into a pool buffer and a
  writer thread writes it behind the backward; the backward waits for those
  writes once, when it ends, so that ``p.grad`` read through the mapping
  (clipping, the scaler's check) sees the data (under update_in_backward they
  skip the files: Note [updates in backward] in runtime/updater.py);
* the update: a parameter's master, gradient and optimizer state, where they
  are in files, are read into buffers ahead of its turn (the next parameter's
  while this one is updated), the optimizer runs on the buffers, and the
  master and state are written back behind it;
* the forward's and backward's fetch of a master kept on disk reads it into a
  buffer on the prefetch thread.

Ordering is per file: a read waits for the file's pending write, and a write
for the one before it, so no reader ever sees a stale or torn tensor. Code
that reads the mappings waits for every pending write first (``settle``: the
updater's ``synchronize``, which every whole-model read goes through, and the
end of the backward). Transfers are split into chunks so that the reader and
writer threads keep several requests in flight on one large tensor.

The pool is bounded (the disk store's working set, set against
``host_memory_budget``): a taker waits for a writer to give a buffer back,
which it always does, so the traffic can never grow memory. Buffers of the
sizes a model uses are kept and reused, so their pages are faulted in once.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import threading
from collections.abc import Callable

import torch

from weightstream.common.pages import libc_function

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory (the page size)
_CHUNK = 32 * 2**20  # bytes per request: several in flight for one large tensor
_SYNC_FILE_RANGE_ALL = 7  # WAIT_BEFORE | WRITE | WAIT_AFTER


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to the I/O alignment: the size of a store file."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` (a multiple of ALIGN) of uninitialized uint8 host memory, ALIGN-aligned."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]  # the view keeps ``raw``'s storage alive


def as_view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of ``buf`` seen with ``like``'s dtype and shape."""
    numel = like.numel()
    return buf.view(like.dtype)[:numel].view(like.shape)


_sync_file_range = libc_function(
    "sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
)


def _buffer(t: torch.Tensor, start: int, length: int):
    """A writable buffer over bytes ``start:start+length`` of contiguous ``t`` (no copy)."""
    return (ctypes.c_char * length).from_address(t.data_ptr() + start)


class BufferPool:
    """Page-aligned host buffers for transfers, bounded by ``capacity`` bytes.

    Buffers are kept by size and reused. A request that does not fit waits
    until one is given back (writers always give theirs back); free buffers of
    other sizes are dropped first to make room. A request larger than the
    capacity on its own is served outside the pool (and not kept).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0  # bytes of the pool's buffers, free or taken
        # Owner: this pool. Why: buffers are taken on the compute and prefetch
        # threads and given back on the writer threads.
        self._cond = threading.Condition()
        self.peak = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; waits for room."""
        return self.take_many([nbytes])[0]

    def take_many(self, sizes: list[int], wait: bool = True) -> list[torch.Tensor] | None:
        """Buffers for ``sizes``, all at once (a taker never holds part of a set while
        it waits for the rest). A set larger than the capacity is served outside the
        pool. Without ``wait``, None where the set does not fit now."""
        sizes = [padded(n) for n in sizes]
        if sum(sizes) > self.capacity:
            out = [aligned_empty(n) for n in sizes]
            for b in out:
                b._unpooled = True  # give() drops it
            return out
        with self._cond:
            while True:
                out = self._try_take(sizes)
                if out is not None or not wait:
                    return out
                self._cond.wait()

    def _try_take(self, sizes: list[int]) -> list[torch.Tensor] | None:
        reuse: dict[int, int] = {}
        new = 0
        for n in sizes:
            if len(self._free.get(n, ())) > reuse.get(n, 0):
                reuse[n] = reuse.get(n, 0) + 1
            else:
                new += n
        if self._allocated + new > self.capacity:
            self._drop_free(new, keep=reuse)
            if self._allocated + new > self.capacity:
                return None
        self._allocated += new
        self.peak = max(self.peak, self._allocated)
        out = []
        for n in sizes:
            free = self._free.get(n)
            out.append(free.pop() if free else aligned_empty(n))
        return out

    def _drop_free(self, size: int, keep: dict[int, int]) -> None:
        """Drop free buffers (beyond ``keep`` of each size) until ``size`` more fit."""
        for other, bufs in self._free.items():
            while len(bufs) > keep.get(other, 0) and self._allocated + size > self.capacity:
                bufs.pop()
                self._allocated -= other

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        if getattr(buf, "_unpooled", False):
            return
        with self._cond:
            self._free.setdefault(size, []).append(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            for size, bufs in self._free.items():
                self._allocated -= size * len(bufs)
            self._free.clear()


class StoreFile:
    """One tensor's file, open for explicit I/O beside its mapping (the file is unlinked)."""

    __slots__ = ("direct", "fd", "kind", "nbytes", "pending")

    def __init__(self, fd: int, nbytes: int, direct: bool, kind: str):
        self.fd = fd
        self.nbytes = nbytes  # the tensor's bytes; the file holds padded(nbytes)
        self.direct = direct
        self.kind = kind
        self.pending: Transfer | None = None  # the last write, until it is waited for

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Transfer:
    """One whole-tensor read or write, as chunks in flight on the I/O threads."""

    def __init__(self, what: str, on_done: Callable[[], None] | None = None):
        self.what = what
        self._left = 0
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._on_done = on_done

    def _start(self, futures: list[concurrent.futures.Future]) -> None:
        self._left = len(futures)
        if not futures:
            self._finish()
        for f in futures:
            f.add_done_callback(self._chunk_done)

    def _chunk_done(self, f: concurrent.futures.Future) -> None:
        with self._lock:
            if f.exception() is not None and self._error is None:
                self._error = f.exception()
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        on_done, self._on_done = self._on_done, None  # holds the buffer: let it go
        if on_done is not None:
            on_done()
        self._done.set()

    def wait(self) -> None:
        """Block until every chunk is done; raise the first I/O error, saying what failed."""
        self._done.wait()
        if self._error is not None:
            e = self._error
            raise OSError(
                getattr(e, "errno", None) or errno.EIO,
                f"the disk store failed to {self.what}: {e}; check the disk under store_dir",
            ) from e


class DiskIO:
    """Reader and writer threads moving whole tensors between store files and buffers."""

    def __init__(self, pool: BufferPool, threads: int = 2):
        self.pool = pool
        # Owner: this object. Why: reads must overlap compute and writes, and
        # several requests in flight keep the device busy.
        self._readers = concurrent.futures.ThreadPoolExecutor(threads, "weightstream-read")
        self._writers = concurrent.futures.ThreadPoolExecutor(threads, "weightstream-write")
        self.bytes_read = 0
        self.bytes_written = 0

    def read(self, f: StoreFile, buf: torch.Tensor) -> Transfer:
        """Fill ``buf`` (from the pool, at least ``padded(f.nbytes)`` bytes) from ``f``,
        after ``f``'s pending write."""
        self.bytes_read += f.nbytes
        return self._submit(self._readers, _read_chunk, f, buf, Transfer(f"read {_what(f)}"))

    def write(self, f: StoreFile, buf: torch.Tensor, give_back: bool = True) -> Transfer:
        """Write ``buf`` to ``f`` after its previous write; give ``buf`` back to the pool
        when done (``give_back``)."""
        self.bytes_written += f.nbytes
        on_done = (lambda: self.pool.give(buf)) if give_back else None
        t = self._submit(
            self._writers, _write_chunk, f, buf, Transfer(f"write {_what(f)}", on_done)
        )
        f.pending = t
        return t

    @staticmethod
    def _submit(executor, chunk_fn, f: StoreFile, buf: torch.Tensor, t: Transfer) -> Transfer:
        """``t`` as chunks of ``f``'s padded size on ``executor``, each after ``f``'s
        pending write."""
        before, size = f.pending, padded(f.nbytes)
        t._start(
            [
                executor.submit(chunk_fn, f, buf, off, min(_CHUNK, size - off), before)
                for off in range(0, size, _CHUNK)
            ]
        )
        return t

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)


def _what(f: StoreFile) -> str:
    return f"a {f.kind} tensor of {f.nbytes:,} bytes"


def _after(before: Transfer | None) -> None:
    if before is not None:
        before._done.wait()  # its error is reported to whoever waits for it


def _read_chunk(f: StoreFile, buf: torch.Tensor, off: int, length: int, before) -> None:
    _after(before)
    done = 0
    while done < length:
        n = os.preadv(f.fd, [_buffer(buf, off + done, length - done)], off + done)
        if n == 0:
            raise OSError(errno.EIO, f"unexpected end of a store file at byte {off + done:,}")
        done += n
    if not f.direct:  # the pages need not stay in the page cache
        os.posix_fadvise(f.fd, off, length, os.POSIX_FADV_DONTNEED)


def _write_chunk(f: StoreFile, buf: torch.Tensor, off: int, length: int, before) -> None:
    _after(before)
    done = 0
    while done < length:
        done += os.pwritev(f.fd, [_buffer(buf, off + done, length - done)], off + done)
    if not f.direct:  # write the pages out now and drop them from the page cache
        if _sync_file_range is None or _sync_file_range(f.fd, off, length, _SYNC_FILE_RANGE_ALL):
            os.fdatasync(f.fd)
        os.posix_fadvise(f.fd, off, length, os.POSIX_FADV_DONTNEED)


def open_for_io(path: str | os.PathLike, direct: bool | None) -> tuple[int, bool]:
    """A read-write descriptor on ``path``: with ``O_DIRECT`` unless ``direct`` is False
    or the file system refuses it. Returns (fd, whether it is direct)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct is not False and o_direct:
        try:
            return os.open(path, os.O_RDWR | o_direct), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDWR), False


def direct_io_works(fd: int) -> bool:
    """Whether aligned O_DIRECT reads and writes succeed on ``fd`` (some file systems
    accept the flag at open and refuse the I/O)."""
    probe = aligned_empty(ALIGN)
    try:
        os.preadv(fd, [_buffer(probe, 0, ALIGN)], 0)
        os.pwritev(fd, [_buffer(probe, 0, ALIGN)], 0)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True

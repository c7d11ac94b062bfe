"""Arrow IPC stream files written and read a batch at a time, without keeping their pages.

The Hugging Face data processor (``hf_dataset/``) caches tokens in Arrow files of
any size. Two kinds of pages could pile up while it makes them (Note [arrow file
pages]): the page cache of what it writes, and the resident pages of what it reads
through a memory map. :class:`ArrowStreamWriter` writes a file under a temporary
name, gives its written pages back every :data:`SYNC_BYTES`, and renames it into
place when complete; :class:`MappedFile` reads one memory-mapped and gives back
the pages of the arrays read from it. :func:`content_digest` is a file's digest of
its bytes, kept beside it by the writer (a ``.blake2b`` file), so that what the data
*are* can be compared without reading them again.

Note [arrow file pages]
~~~~~~~~~~~~~~~~~~~~~~~
A page of a memory-mapped file counts in the process's resident set (RSS) from
its first touch until the mapping goes, although it is page cache the kernel
may reclaim: reading a file of N GB once through its mapping grows RSS by N GB.
The files are mapped read-only and shared (``pa.memory_map``), so their pages are
clean: ``madvise(MADV_DONTNEED)`` drops them from RSS and a later touch reads them
again from the page cache or the file. ``MappedFile.drop_pages`` does that for the
arrays a pass is done with. A touch maps more than its page: the kernel maps the cached
pages around it too (fault-around, 64 KiB by default), so reading one small thing per
record batch (a header, a length) costs RSS in proportion to the number of batches.

Written pages do not count in RSS, but they stay in the page cache, dirty until
writeback: a write of N GB can fill the machine's memory (and a cgroup's limit,
which counts the page cache). The writer syncs its file every
:data:`SYNC_BYTES` and tells the kernel it will not read those pages again
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so at most that many bytes wait.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from weightstream.common.files import atomic_path, remove_dead_temporaries
from weightstream.common.pages import madvise

__all__ = ["SYNC_BYTES", "ArrowStreamWriter", "MappedFile", "content_digest"]

SYNC_BYTES = 64 << 20  # written bytes between syncs (Note [arrow file pages])
_PAGE = mmap.PAGESIZE


class _SyncingFile:
    """A binary file that syncs and drops its written pages every ``SYNC_BYTES``.

    The file object pyarrow's writer writes through (``pa.PythonFile``)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "xb")  # closed by close(): the writer owns it
        self._pending = 0
        self.closed = False
        self.digest = _new_digest()  # of every byte written (content_digest)

    def write(self, data) -> int:
        self.digest.update(data)
        n = self._f.write(data)
        self._pending += n
        if self._pending >= SYNC_BYTES:
            self.sync()
        return n

    def sync(self) -> None:
        self._f.flush()
        fd = self._f.fileno()
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):  # not on macOS: the pages then stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._pending = 0

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        """Sync (the last pages dropped too) and close: pyarrow's sink calls it."""
        if not self.closed:
            self.sync()
            self.discard()

    def discard(self) -> None:
        """Close without syncing (the file is about to be removed)."""
        self._f.close()
        self.closed = True


class ArrowStreamWriter:
    """Record batches into the Arrow stream file ``path`` (the format ``datasets`` reads
    with ``Dataset.from_file``), written as ``<path>.<pid>-<random>.tmp`` and renamed to
    ``path`` by :meth:`close`: a reader never sees a partial file, and concurrent
    writers (ranks building the same file) each write their own and the last rename
    wins with the same content. A context manager: an exception removes the temporary
    file; one whose process was killed mid-write (a rank stopped by its launcher) is
    removed by the next writer of the same file."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = Path(path)
        stale = re.compile(rf"^{re.escape(self.path.name)}\.(\d+)-[0-9a-f]+\.tmp$")
        remove_dead_temporaries(self.path.parent, stale)
        token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._tmp = self.path.with_name(f"{self.path.name}.{token}.tmp")
        self._file = _SyncingFile(self._tmp)
        self._sink = pa.PythonFile(self._file, mode="w")
        self._writer = pa.ipc.new_stream(self._sink, schema)

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)

    def close(self) -> None:
        """Finish the file (synced, its pages dropped) and rename it into place."""
        self._writer.close()
        self._sink.close()  # closes the file it wraps: synced
        # The digest first: a reader that finds the file finds its digest beside it.
        _write_digest(self.path, self._file.digest.hexdigest())
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Remove the temporary file (what an exception leaves)."""
        self._file.discard()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ArrowStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _new_digest():
    return hashlib.blake2b(digest_size=16)


def _digest_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.blake2b")


def _write_digest(path: Path, hexdigest: str) -> None:
    with atomic_path(_digest_path(path), fsync=False) as tmp:
        tmp.write_text(hexdigest + "\n")


def content_digest(path: Path) -> str:
    """The blake2b digest of the bytes of ``path``, an Arrow file :class:`ArrowStreamWriter`
    wrote: read from the digest file it wrote beside it, or, for a file written before
    those existed, computed once (reading the whole file) and kept there."""
    path = Path(path)
    try:
        return _digest_path(path).read_text().strip()
    except FileNotFoundError:
        pass
    digest = _new_digest()
    with open(path, "rb") as f:
        while chunk := f.read(SYNC_BYTES):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    try:
        _write_digest(path, hexdigest)
    except OSError:  # a read-only cache: computed again next time
        pass
    return hexdigest


class MappedFile:
    """The Arrow stream file ``path`` as a table of zero-copy views of its memory map.

    Pages are read when touched; :meth:`drop_pages` gives back those of arrays done
    with (Note [arrow file pages]). The map lives while any of its arrays does."""

    def __init__(self, path: Path) -> None:
        with pa.memory_map(os.fspath(path)) as source:
            whole = source.read_buffer(source.size())  # a view: the map's address range
            source.seek(0)
            self.table: pa.Table = pa.ipc.open_stream(source).read_all()
        self._lo = whole.address // _PAGE * _PAGE
        self._hi = -(-(whole.address + whole.size) // _PAGE) * _PAGE
        self._whole = whole  # keeps the range ours for as long as this object lives
        # Reading the stream touched every record batch's header, and the kernel maps the
        # cached pages around each touched one too (fault-around, 64 KiB by default):
        # tens of MB for a file of a few GB, none of it needed until an array is read.
        if madvise is not None and self._hi > self._lo:
            madvise(self._lo, self._hi - self._lo, mmap.MADV_DONTNEED)

    def drop_pages(self, arrays: Iterable[pa.Array | pa.ChunkedArray]) -> None:
        """Drop from RSS the pages under ``arrays`` that lie in this file's map (clean
        pages, read again if touched). Buffers elsewhere (copies in the process's own
        memory, whose content ``MADV_DONTNEED`` would zero) are left alone."""
        if madvise is None:
            return
        for array in arrays:
            chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
            for chunk in chunks:
                for buf in chunk.buffers():  # the children's (a list's values) too
                    if buf is None or buf.size == 0:
                        continue
                    # Whole pages, rounded out but clipped to the map: a neighbour's
                    # page dropped too is only read again.
                    lo = max(self._lo, buf.address // _PAGE * _PAGE)
                    hi = min(self._hi, -(-(buf.address + buf.size) // _PAGE) * _PAGE)
                    if hi > lo:
                        madvise(lo, hi - lo, mmap.MADV_DONTNEED)

"""The file object HDF5 writes a checkpoint through, keeping the first failed write.

Used by the H5 writer (``writer.py``) with h5py's ``fileobj`` driver, and for
the data it writes itself (Note [direct data writes]).
"""

from __future__ import annotations

import os
import threading

from weightstream.checkpoint import kernel


class WriteGuard:
    """The file object HDF5 writes a checkpoint through (``driver="fileobj"``).

    Note [failed writes]: HDF5 does not survive write errors well. When a
    write fails (full disk, file size limit, quota), h5py raises on some later
    call, objects whose metadata cannot be flushed stay open, their
    deallocation raises again, and the process can crash with a segmentation
    fault (in the middle of the save, or at exit when HDF5 closes what is left).
    So HDF5 never sees a failed write: the guard keeps the first error and
    pretends later writes succeed (they are dropped; the file is deleted
    anyway), HDF5 closes cleanly, and :meth:`check` raises the kept error.
    Reads, seeks and the rest go straight to the file.
    """

    def __init__(self, raw, *, durable: bool = False) -> None:
        self._raw = raw  # an unbuffered binary file: every write reaches the OS now
        self.error: OSError | None = None
        self._lock = threading.Lock()
        self._durable = durable  # it will be fsynced: start writeback early
        self._unflushed = 0  # bytes of data written since writeback was last started

    def write(self, data) -> int:
        # HDF5 writes from one thread; the lock keeps its writes apart from pwrite's.
        return self._write_all(data, lambda view, done: self._raw.write(view[done:]))

    def pwrite(self, data, offset: int) -> int:
        """Write ``data`` at ``offset`` without moving the file position.

        For the data HDF5 does not see (Note [direct data writes]); called from
        several threads at once (Note [parallel pieces]). A failure is kept
        like one of :meth:`write`. Returns the number of bytes.
        """
        fd = self._raw.fileno()
        return self._write_all(data, lambda view, done: os.pwrite(fd, view[done:], offset + done))

    def _write_all(self, data, put) -> int:
        """Write all of ``data`` with ``put(view, bytes_done)`` (a write may be partial),
        unless a write failed before; keep the first failure. Returns the length.
        One writer at a time (Note [parallel pieces])."""
        view = memoryview(data).cast("B")
        with self._lock:
            if self.error is None:
                try:
                    done = 0
                    while done < len(view):
                        done += put(view, done)
                except OSError as e:
                    self.error = e  # the first failure: later writes are skipped
                else:  # start writeback every so often (Note [early writeback])
                    self._unflushed += len(view)
                    if self._durable and self._unflushed >= kernel.WRITEBACK_BYTES:
                        self._unflushed = 0
                        kernel.start_writeback(self._raw.fileno())
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._raw.truncate(size)
            except OSError as e:
                self.error = e
        return self._raw.tell() if size is None else size

    def flush(self) -> None:
        pass  # unbuffered: nothing is held back

    def read(self, size: int = -1) -> bytes:
        return self._raw.read(size)

    def readinto(self, buffer) -> int:
        return self._raw.readinto(buffer)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def check(self) -> None:
        """Raise the first failed write, if there was one."""
        if self.error is not None:
            raise self.error

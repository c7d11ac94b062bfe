"""The disk tier of the store: masters, gradients and optimizer state in mapped files.

Note [disk tier]
----------------
With ``StreamingConfig(store="disk")`` every host tensor of the training state
(the master weights, their gradients and the optimizer's state) that the RAM
tier does not keep (Note [hybrid placement] in runtime/placement.py) lives in
a file of its own under ``store_dir``, mapped into memory shared with the file
(``mmap``, MAP_SHARED). A tensor over such a mapping is an ordinary CPU tensor,
so the forward copy, autograd's gradient accumulation and the optimizer's
kernels run on it unchanged and give the same bits as the RAM store.

The step's own traffic does not go through the mappings: the store keeps a
descriptor on each file, and gradients, the update and the fetch of a master
kept on disk move whole tensors with explicit reads and writes on I/O threads,
through a bounded pool of buffers (Note [explicit disk I/O] in
runtime/diskio.py). Everything else (a checkpoint written or loaded, the
gradient clipping that reads ``p.grad``, autograd adding a later micro-batch's
gradient in place) uses the mappings, and what bounds its memory is when
pages are given back: a page of a mapped file is resident (and counts in the
process's RSS) from its first touch until the process drops the mapping's
pages with ``madvise(MADV_DONTNEED)``. Dirty pages are not lost by that: for
a shared file mapping the data stays in the page cache and the kernel writes
it back to the file behind us (``release`` also asks it to drop the clean
ones from the page cache). The mappings and the explicit I/O see the same
file: an O_DIRECT read writes dirty cached pages out first, an O_DIRECT write
drops them, and code that reads the mappings first waits for pending writes.

Resident store memory is then at most the pool plus the pages of the
mappings in use, set against ``host_memory_budget`` at compile time.

Freed host memory must also go back at once: glibc's allocator raises its
mmap threshold after large frees and then keeps freed device copies and
gradients in its heaps (measured: 100 MiB more peak RSS on a 96 MiB model), so
the disk store fixes the threshold at 128 KiB (``mallopt``, by the first store
of the process; for the rest of the process: it cannot be undone, Note
[process-wide settings] in weightstream/__init__.py), and large tensors are
unmapped when they die.

The files are unlinked as soon as they are mapped: the space is returned when
the process ends, however it ends, and nothing is left behind in ``store_dir``.
The durable copy of the training state is the checkpoint, which is written
tensor by tensor from the mappings (``release_pages`` after each tensor).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from weightstream.common.materialize import materialize
from weightstream.common.pages import MADV_REMOVE, STORE_SUFFIX, libc_function, madvise
from weightstream.runtime.diskio import (
    BufferPool,
    DiskIO,
    StoreFile,
    Transfer,
    as_view,
    direct_io_works,
    open_for_io,
    padded,
)
from weightstream.runtime.placement import Placement, PlacementPlan

# Free space kept beyond a discarded gradient's bytes before writing it again.
_DISK_MARGIN = 64 * 2**20


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 128 * 1024  # what a disk store fixes it at (Note [disk tier])


def _return_large_frees_to_the_os() -> None:
    """Fix glibc's mmap threshold for the rest of the process (Note [disk tier], Note
    [process-wide settings]; setting it again is a no-op); not glibc: its allocator
    makes its own choice."""
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def check_store_dir(directory: str | os.PathLike) -> None:
    """Raise, before anything is made, the error a disk store in ``directory`` would meet
    at its first file: a path through a file, or a directory it cannot write (a
    read-only file system, no permission). ``--validate_only`` checks it."""
    path = Path(directory)
    where = path
    while not where.exists() and where.parent != where:
        where = where.parent
    if not where.is_dir():
        raise ValueError(
            f"store_dir {path}: {where} is a file, so the disk store cannot make its "
            "directory there. Fix: give a store_dir that is a directory, or one to create."
        )
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(
            f"store_dir {path}: {where} cannot be written (a read-only file system, or no "
            "permission), so the disk store cannot make its files. Fix: give a writable "
            "store_dir."
        )


# In a store_dir that a store made: every store sharing it removes it when it is done
# with it and nothing else is left (DiskStore.close).
_MADE_MARK = ".weightstream-made"


class DiskStore:
    """Allocates host tensors in memory-mapped files under ``directory`` (Note [disk tier])."""

    # O_DIRECT for explicit I/O: None probes the file system on the first file, False
    # uses buffered descriptors (Note [explicit disk I/O]).
    direct_io: bool | None = None
    #: State lives in files: the update pages it in and out (Note [memoryx]).
    paged = True

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        ram_capacity: int = 0,
        io_capacity: int = 256 * 2**20,
        grads_to_update: bool = False,
    ):
        if directory is None:
            directory = tempfile.mkdtemp(prefix="weightstream-store-")
            made = True
        else:
            check_store_dir(directory)  # a file in the way, a read-only place: said plainly
            made = not Path(directory).exists()
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._made_directory = self._mark_made() if made else self._marker.exists()
            # Called once: by close(), or at exit for a store a script never closed.
            self._remove_made = weakref.finalize(self, _remove_made_directory, self.directory)
            if not self._made_directory:
                self._remove_made.detach()
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot create the disk store directory {self.directory} ({e.strerror}); "
                "give a writable store_dir",
            ) from e
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # data_ptr of a mapped storage -> a tensor over the whole mapping. Holding
        # it keeps the address from being reused by another allocation while this
        # store may still advise on it (DONTNEED on anonymous memory would zero it).
        self._maps: dict[int, torch.Tensor] = {}
        self._grads: dict[int, torch.Tensor] = {}  # id(master) -> its gradient in the store
        self._discarded: set[int] = set()  # data_ptr of storages whose blocks were freed
        # id(master) of the masters whose gradients come into the store (take_grad).
        self._taken: set[int] = set()
        # The RAM tier (Note [hybrid placement]): its size, each parameter's place
        # (decided when the model is taken), and its tensors by data_ptr (held,
        # like the mappings).
        self.ram_capacity = ram_capacity
        self.places: PlacementPlan | None = None
        self._ram: dict[int, torch.Tensor] = {}
        self._key: dict[int, str] = {}  # id(parameter) -> its name in the placement
        # Explicit I/O (Note [explicit disk I/O] in runtime/diskio.py): each training
        # state file's descriptor by its mapping's data_ptr, the buffers, the threads.
        self._files: dict[int, StoreFile] = {}
        self._direct = self.direct_io  # O_DIRECT works here (probed on the first file)
        self.io = DiskIO(BufferPool(io_capacity))
        # Gradients go to their files by explicit writes, waited for when the backward
        # ends; off under data parallel, whose reduction rewrites p.grad after the hook.
        self.explicit_grads = True
        self._grad_writes: list[Transfer] = []
        # Set by the engine under update_in_backward: whether a parameter's gradient of
        # this backward is taken by its update as soon as it is final (Note [updates in
        # backward] in runtime/updater.py). Such a gradient stays in memory: writing it
        # to its file only for the update to read it back would be half the disk traffic
        # of a step.
        self.hands_over: Callable[[torch.Tensor], bool] | None = None
        self.grads_to_update = grads_to_update  # expected so: the placement keeps no room
        _raise_open_file_limit()
        _return_large_frees_to_the_os()

    # ---- allocation ----------------------------------------------------------------

    def zeros(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        kind: str,
        owner: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A tensor of zeros of the training state: ``kind`` ("master", "state" or
        "grad") of parameter ``owner``. In the RAM tier if the placement put it
        there (Note [hybrid placement]), else in a new mapped file (``kind`` names
        the file, for errors)."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        key = None if owner is None else self._key.get(id(owner))
        if nbytes and key is not None and self.places is not None:
            if self.places.in_ram(key, kind, nbytes):
                out = torch.zeros(shape, dtype=dtype)
                with self._lock:
                    self._ram[out.untyped_storage().data_ptr()] = out
                return out
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        flat, file = self._new_file(nbytes, shape, kind, for_io=True)
        ptr = flat.untyped_storage().data_ptr()
        with self._lock:
            self._maps[ptr] = flat
            if file is not None:
                self._files[ptr] = file
        return flat.view(dtype).view(shape)

    def scratch(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, kind: str
    ) -> torch.Tensor:
        """Like :meth:`zeros`, but not part of the training state: the store keeps no
        reference, so the file's space is returned when the tensor dies (a whole
        sharded model gathered for a checkpoint). ``release_pages`` gives its pages
        back like any store file's."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self._new_file(nbytes, shape, kind)[0].view(dtype).view(shape)

    def _new_file(
        self, nbytes: int, shape: torch.Size, kind: str, for_io: bool = False
    ) -> tuple[torch.Tensor, StoreFile | None]:
        """``nbytes`` of zeros in a new file, mapped shared: the whole mapping as uint8,
        and (``for_io``) the file open for explicit I/O, or None where no descriptor
        can be had (the mapping then serves every access)."""
        # The suffix marks a store file for release_pages (common/pages.py).
        # The process id keeps the names of ranks sharing one store_dir apart.
        path = self.directory / f"{os.getpid()}-{next(self._ids):07d}.{kind}{STORE_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:  # another store sharing store_dir ended and removed it
            self.directory.mkdir(parents=True, exist_ok=True)
            self._made_directory = self._mark_made()
            if not self._remove_made.alive:  # detached: this store had not made it
                self._remove_made = weakref.finalize(self, _remove_made_directory, self.directory)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        file = None
        try:
            try:
                # Reserve the blocks now: a full disk is an error here, never a
                # SIGBUS on some later write through the mapping. Whole pages, for
                # O_DIRECT transfers of the whole file.
                os.posix_fallocate(fd, 0, padded(nbytes))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise OSError(
                        e.errno,
                        f"the disk store in {self.directory} has no room for "
                        f"{nbytes:,} bytes for a {kind} tensor of shape {tuple(shape)} "
                        f"({self.bytes_mapped:,} bytes already allocated); free space there "
                        "or give another store_dir",
                    ) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, padded(nbytes))  # no fallocate here: a sparse file
            os.close(fd)
            fd = -1
            # torch maps the file shared and closes its descriptor.
            flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            if for_io:
                file = self._open_for_io(path, nbytes, kind)
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(path)  # the mapping keeps the file; nothing is left behind
        return flat, file

    def _open_for_io(self, path: Path, nbytes: int, kind: str) -> StoreFile | None:
        try:
            fd, direct = open_for_io(path, self._direct)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                return None  # out of descriptors: this tensor goes through its mapping
            raise
        if direct and self._direct is None:
            self._direct = direct_io_works(fd)
            if not self._direct:
                os.close(fd)
                fd, direct = open_for_io(path, False)
        return StoreFile(fd, nbytes, direct, kind)

    @property
    def bytes_mapped(self) -> int:
        """Bytes of the training state's files (what this store keeps on its disk)."""
        with self._lock:
            return sum(flat.numel() for flat in self._maps.values())

    def holds(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        ptr = t.untyped_storage().data_ptr()
        return ptr in self._maps or ptr in self._ram

    def file_of(self, t: torch.Tensor | None) -> StoreFile | None:
        """The open file of store tensor ``t`` (a whole file's tensor), else None."""
        if t is None or t.device.type != "cpu" or t.storage_offset() != 0:
            return None
        f = self._files.get(t.untyped_storage().data_ptr())
        if f is None or f.fd < 0 or t.numel() * t.element_size() != f.nbytes:
            return None
        return f

    def page_in(self, tensors: Iterable[torch.Tensor], wait: bool = True) -> Paged:
        """Start reading the file-placed ones of ``tensors`` into buffers (see
        :class:`Paged`); without ``wait``, ``started`` is False where the pool has no
        room now."""
        return Paged(self, tensors, wait)

    def settle(self) -> None:
        """Wait for every pending write: the files' mappings then read current data."""
        self.wait_for_grads()
        for f in list(self._files.values()):
            pending = f.pending
            if pending is not None:
                pending.wait()
                f.pending = None

    def placement(self) -> Placement:
        """Bytes of the training state in RAM and in files, by kind (Note [hybrid placement])."""
        if self.places is None:
            return Placement(self.ram_capacity)
        return self.places.actual

    def zeros_like(
        self,
        p: torch.Tensor,
        kind: str = "state",
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A ``kind`` tensor for parameter ``p``, of ``p``'s shape and dtype unless given
        (compact optimizer state: Note [compact optimizer state])."""
        shape = p.shape if shape is None else shape
        return self.zeros(shape, p.dtype if dtype is None else dtype, kind, owner=p)

    def adopt(self, t: torch.Tensor, kind: str, owner: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of ``t`` (``kind`` of parameter ``owner``) in the store (``t`` itself
        if it is there already)."""
        if self.holds(t) or t.numel() == 0:
            return t
        out = self.zeros(t.shape, t.dtype, kind, owner)
        out.copy_(t)
        self.release([out])
        return out

    # ---- pages ------------------------------------------------------------------------

    def _ranges_of(self, tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
        out = []
        for t in tensors:
            if t is None or t.device.type != "cpu":
                continue
            start = t.untyped_storage().data_ptr()
            flat = self._maps.get(start)
            if flat is not None:
                out.append((start, flat.numel()))
        return out

    def _advise(self, tensors: Iterable[torch.Tensor], advice: int) -> None:
        if madvise is None:
            return
        for start, nbytes in self._ranges_of(tensors):
            madvise(start, nbytes, advice)

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop the resident pages of ``tensors`` (dirty data goes to the file, not away),
        and their clean pages from the page cache, where the file is open."""
        tensors = [t for t in tensors if t is not None]
        self._advise(tensors, mmap.MADV_DONTNEED)
        for t in tensors:
            f = self.file_of(t)
            if f is not None:
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def discard(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop ``tensors``' pages and their contents (consumed gradients).

        Their data is not written back: the file's blocks are freed
        (``MADV_REMOVE``) and read as zeros again. The next write through the
        mapping allocates them anew, so free space is checked first
        (``take_grad``), never left to a SIGBUS.
        """
        # An open file keeps its blocks: the next explicit write rewrites them in place.
        ranges = self._ranges_of(t for t in tensors if self.file_of(t) is None)
        if madvise is None or not ranges:
            return
        for start, nbytes in ranges:
            if madvise(start, nbytes, MADV_REMOVE) == 0:
                self._discarded.add(start)
            else:
                madvise(start, nbytes, mmap.MADV_DONTNEED)  # no hole punching here

    def _reclaim(self, t: torch.Tensor) -> None:
        """Before writing into a discarded tensor: its blocks must fit on the disk again."""
        start = t.untyped_storage().data_ptr()
        if start not in self._discarded:
            return
        nbytes = self._maps[start].numel()
        free = shutil.disk_usage(self.directory).free
        if free < nbytes + _DISK_MARGIN:
            raise OSError(
                errno.ENOSPC,
                f"the disk store in {self.directory} needs {nbytes:,} bytes for a gradient "
                f"but the disk has {free:,} bytes free; free space there or give another "
                "store_dir",
            )
        self._discarded.discard(start)

    def prefetch(self, tensors: Iterable[torch.Tensor], mapped_reads: bool = False) -> None:
        """Ask the kernel to start reading ``tensors``' pages now (read-ahead) where they
        will be read through their mappings: files without a descriptor, or all files
        (``mapped_reads``); the others are read explicitly (Note [explicit disk I/O])."""
        if not mapped_reads:
            tensors = [t for t in tensors if self.file_of(t) is None]
        self._advise(tensors, mmap.MADV_WILLNEED)

    # ---- the module's training state -------------------------------------------------------

    def take_module(self, module: nn.Module, init_weights: bool = True) -> list[str]:
        """Move every parameter of ``module`` into the store; materialize meta ones.

        A parameter on the meta device (a model built under ``torch.device("meta")``,
        larger than RAM) is allocated in the store and initialized by the model's
        rule (``common.materialize``), one module at a time, so the model is never
        whole in memory. With ``init_weights=False``, or for a module without a
        rule, it is left at zero for a load to fill. Returns the names of the
        parameters left so.
        """
        # Each parameter's place, decided once, in parameter order, by name: a
        # meta parameter is replaced by a new one when it is materialized.
        named = dict(module.named_parameters())
        self._key.update({id(p): name for name, p in named.items()})
        if self.places is None:
            self.places = PlacementPlan(
                {name: p.numel() * p.element_size() for name, p in named.items()},
                self.ram_capacity,
                grads=not self.grads_to_update,
            )
        for p in module.parameters():
            if not p.is_meta and not self.holds(p.data):
                with torch.no_grad():
                    p.data = self.adopt(p.data, "master", owner=p)
        left = materialize(
            module,
            lambda p: self.zeros(p.shape, p.dtype, "master", owner=p),
            self.release,
            skip=None if init_weights else lambda _name: True,
            without_rule="leave",
        )
        self._key.update({id(p): name for name, p in module.named_parameters()})
        for p in module.parameters():
            if p.requires_grad:
                self._taken.add(id(p))
        return left

    def plan_state(self, state_bytes: dict[torch.Tensor, list[int]]) -> None:
        """Place the optimizer state by the sizes its optimizer is about to create (compact
        state, a Kahan buffer), not AdamW's two moments: Note [hybrid placement]."""
        if self.places is not None:
            named = {self._key[id(p)]: n for p, n in state_bytes.items() if id(p) in self._key}
            self.places.plan_state(named)

    def forget(self, params: Iterable[torch.Tensor], old_data: Iterable[torch.Tensor]) -> None:
        """Stop keeping ``params`` (masters another rank owns, Note [sharded store]):
        no gradient of theirs comes into the store, and the files under their old
        data are given back to the disk as soon as nothing else holds them."""
        params = list(params)
        if self.places is not None:
            gone = {self._key.get(id(p)) for p in params}
            self.places.keep_only({k for k in self._key.values() if k not in gone})
        grads = []
        for p in params:
            self._taken.discard(id(p))
            grads.append(self._grads.pop(id(p), None))
        self.drop(old_data, "master")
        self.drop([g for g in grads if g is not None], "grad")

    def drop(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Stop keeping ``tensors`` (``kind`` of the training state, moved elsewhere): a
        file is given back to the disk as soon as nothing else holds it, and the
        placement stops counting them."""
        with self._lock:
            for t in tensors:
                if t.numel():
                    ptr = t.untyped_storage().data_ptr()
                    in_file = self._maps.pop(ptr, None) is not None
                    file = self._files.pop(ptr, None)
                    if file is not None:
                        if file.pending is not None:
                            file.pending.wait()
                        file.close()
                    in_ram = self._ram.pop(ptr, None) is not None
                    if (in_file or in_ram) and self.places is not None:
                        self.places.give_back(kind, t.numel() * t.element_size(), in_ram)

    def refill(
        self, held: Sequence[tuple[torch.Tensor, str, torch.Tensor]]
    ) -> list[torch.Tensor | None]:
        """Move into the RAM tier what of ``held`` ((tensor, kind, its master), in
        parameter order, every master this store keeps among them) its RAM given back
        since the placement now holds (Note [hybrid placement]): for each, its copy in
        RAM (its file given back) or None. The caller puts the copies where the tensors
        were. The masters' gradients in files, which the store references itself, are
        offered last and replaced here (in ``p.grad`` too, where it is one)."""
        out: list[torch.Tensor | None] = [None] * len(held)
        if self.places is None:
            return out
        grads = [
            (g, "grad", p)
            for _, kind, p in held
            if kind == "master" and (g := self._grads.get(id(p))) is not None
        ]
        offered = [*held, *grads]
        in_files = [
            i
            for i, (t, _, owner) in enumerate(offered)
            if t.numel() and id(owner) in self._key and self.file_of(t) is not None
        ]
        if not in_files:
            return out
        self.settle()  # the files' mappings read what was last written
        fits = self.places.refill(
            [(offered[i][1], self._key[id(offered[i][2])], offered[i][0].nbytes) for i in in_files]
        )
        for i, fit in zip(in_files, fits):
            if not fit:
                continue
            t, _, owner = offered[i]
            copy = torch.empty(t.shape, dtype=t.dtype)
            copy.copy_(t)
            self.release([t])  # its pages: the copy holds the values now
            ptr = t.untyped_storage().data_ptr()
            with self._lock:
                self._ram[copy.untyped_storage().data_ptr()] = copy
                del self._maps[ptr]
                self._files.pop(ptr).close()
                self._discarded.discard(ptr)  # a consumed gradient's freed blocks
            if i < len(held):
                out[i] = copy
            else:  # the store's gradient: its own reference, and the master's
                self._grads[id(owner)] = copy
                if owner.grad is t:
                    owner.grad = copy
        return out

    def take_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient was accumulated: keep it in the store (Note [disk tier]; the
        store's gradient hook calls it, Note [one gradient hook] in memoryx.py)."""
        if id(p) not in self._taken:
            return  # a master another rank owns (Note [sharded store])
        grad = p.grad
        if grad is None or grad.layout != torch.strided or grad.device.type != "cpu":
            return
        if not self.holds(grad):
            if self.hands_over is not None and self.hands_over(p):
                return  # autograd's gradient goes straight to the update, never to a file
            mine = self._grads.get(id(p))
            if mine is None or mine.shape != grad.shape or mine.dtype != grad.dtype:
                mine = self.zeros(grad.shape, grad.dtype, "grad", owner=p)
                self._grads[id(p)] = mine
            file = self.file_of(mine) if self.explicit_grads else None
            if file is not None:
                # Autograd's first gradient of this step, written behind the backward
                # (Note [explicit disk I/O]); p.grad reads it once the backward ends.
                buf = self.io.pool.take(file.nbytes)
                as_view(buf, grad).copy_(grad)
                self._grad_writes.append(self.io.write(file, buf))
                self._wait_for_grads_at_backward_end()
                p.grad = mine
                return
            self._reclaim(mine)
            # Autograd's first gradient of this step; later uses and micro-batches
            # are added in place into the store's tensor by autograd itself.
            mine.copy_(grad)
            p.grad = mine
            grad = mine
        self.release([grad])

    def _wait_for_grads_at_backward_end(self) -> None:
        # Once per gradient: a backward that raised runs no callback, so no flag
        # may outlive it; the first callback waits, the others find nothing.
        torch.autograd.Variable._execution_engine.queue_callback(self.wait_for_grads)

    def wait_for_grads(self) -> None:
        """Wait for the gradient writes of the backward (its end, or anything after)."""
        writes, self._grad_writes = self._grad_writes, []
        for w in writes:
            w.wait()

    def adopt_optimizer_state(self, optimizer, params: Iterable[torch.Tensor]) -> None:
        """Move the state tensors of ``params`` that are not in the store yet into it (not
        those of a master the store no longer keeps: another rank's, or the device tier's)."""
        for p in params:
            state = optimizer.state.get(p)
            if not state or id(p) not in self._taken:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not self.holds(value):
                    state[key] = self.adopt(value, "state", owner=p)

    def close(self) -> None:
        self._taken.clear()
        self._grads.clear()
        self.settle()
        self.io.close()
        self.io.pool.clear()
        with self._lock:
            # The mappings live on for as long as tensors over them do; explicit
            # I/O ends here (file_of no longer finds a file).
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._maps.clear()
            self._ram.clear()
        if self._made_directory:
            self._made_directory = False
            self._remove_made()  # now, rather than at the interpreter's exit

    @property
    def _marker(self) -> Path:
        return self.directory / _MADE_MARK

    def _mark_made(self) -> bool:
        """Mark the directory as made by a store, for every store sharing it; True."""
        self._marker.touch()
        return True


def _remove_made_directory(directory: Path) -> None:
    """Remove a store_dir a store made, if it holds its mark alone.

    The files are unlinked when made (nothing is left behind), so a directory a store
    made holds its mark alone once every store in it is done: it goes too, whichever of
    them ends last (ranks sharing store_dir end in any order, and one may hold a file
    for an instant as another ends). One holding anything else stays. Run by
    ``DiskStore.close``, or at the interpreter's exit for a store never closed."""
    with contextlib.suppress(OSError):  # gone already: another store removed it
        if all(e.name == _MADE_MARK for e in directory.iterdir()):
            (directory / _MADE_MARK).unlink(missing_ok=True)
            directory.rmdir()


class Paged:
    """Buffers standing in for the file-placed tensors of a set while they are in use.

    Made by :meth:`DiskStore.page_in`, which starts the reads at once (read-ahead).
    ``view(t)`` is what to compute on in place of ``t``: its buffer once read, or
    ``t`` itself where it is not in an open file. ``finish(write)`` writes the
    buffers of the tensors in ``write`` back behind the caller and gives every
    other buffer back to the pool (Note [explicit disk I/O]).
    """

    def __init__(self, store: DiskStore, tensors: Iterable[torch.Tensor], wait: bool = True):
        self._store = store
        self._entries: dict[int, tuple[StoreFile, torch.Tensor, Transfer]] = {}
        files: dict[int, StoreFile] = {}
        for t in tensors:
            f = store.file_of(t)
            if f is not None:
                files.setdefault(_key(t), f)
        self.started = True
        if not files:
            return
        bufs = store.io.pool.take_many([f.nbytes for f in files.values()], wait=wait)
        if bufs is None:
            self.started = False  # no room now: the caller tries again later
            return
        for (key, f), buf in zip(files.items(), bufs):
            self._entries[key] = (f, buf, store.io.read(f, buf))

    def __contains__(self, t: torch.Tensor) -> bool:
        return _key(t) in self._entries

    def __bool__(self) -> bool:
        return bool(self._entries)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        entry = self._entries.get(_key(t))
        if entry is None:
            return t
        _, buf, read = entry
        read.wait()
        return as_view(buf, t)

    def finish(self, write: Iterable[torch.Tensor] = ()) -> None:
        """Write back the buffers of ``write`` and give the others back to the pool."""
        dirty = {_key(t) for t in write}
        entries, self._entries = self._entries, {}
        error = None
        for key, (f, buf, read) in entries.items():
            try:
                read.wait()
            except OSError as e:
                error = error or e
                dirty.discard(key)
            if key in dirty:
                self._store.io.write(f, buf)
            else:
                self._store.io.pool.give(buf)
        if error is not None:
            raise error


def _key(t: torch.Tensor) -> int:
    """A whole-file store tensor by its storage (``p.data`` is a new object each time)."""
    return t.untyped_storage().data_ptr()


def _raise_open_file_limit() -> None:
    """Let the store keep a descriptor per file (a large model has thousands): raise
    the soft limit to the hard one. Where it stays short, the files past it go
    through their mappings (``_open_for_io``)."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass

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

What bounds memory is when pages are given back: a page of a mapped file is
resident (and counts in the process's RSS) from its first touch until the
process drops the mapping's pages with ``madvise(MADV_DONTNEED)``. Dirty pages
are not lost by that: for a shared file mapping the data stays in the page
cache and the kernel writes it back to the file behind us. The runtime drops
a unit's pages as soon as it is done with them:

* masters: right after a unit's device copy is made (forward and backward);
* gradients: right after each accumulation into the store's gradient file
  (a post-accumulate-grad hook moves autograd's first gradient there; later
  contributions are added in place by autograd itself, exactly as in eager);
* masters, gradients and optimizer state: right after the unit's share of the
  optimizer step (the step always runs unit by unit with a disk store).

Read-ahead: when a unit's fetch is issued the runtime advises the kernel that
its master pages are needed (``MADV_WILLNEED``), so disk reads start before
the copy runs. Resident store memory is then at most the units in flight plus
one unit's update, set against ``host_memory_budget`` at compile time.

Freed host memory must also go back at once: glibc's allocator raises its
mmap threshold after large frees and then keeps freed device copies and
gradients in its heaps (measured: 100 MiB more peak RSS on a 96 MiB model), so
the disk store fixes the threshold at 128 KiB (``mallopt``, once per process),
and large tensors are unmapped when they die.

The files are unlinked as soon as they are mapped: the space is returned when
the process ends, however it ends, and nothing is left behind in ``store_dir``.
The durable copy of the training state is the checkpoint, which is written
tensor by tensor from the mappings (``release_pages`` after each tensor).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from weightstream.common.materialize import materialize
from weightstream.common.pages import MADV_REMOVE, STORE_SUFFIX, madvise
from weightstream.runtime.placement import Placement, PlacementPlan

# Free space kept beyond a discarded gradient's bytes before writing it again.
_DISK_MARGIN = 64 * 2**20


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_malloc_fixed = False


def _return_large_frees_to_the_os() -> None:
    """Fix glibc's mmap threshold (Note [disk tier]); a no-op elsewhere."""
    global _malloc_fixed
    if _malloc_fixed or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        return  # not glibc: its allocator makes its own choice
    _malloc_fixed = True


class DiskStore:
    """Allocates host tensors in memory-mapped files under ``directory`` (Note [disk tier])."""

    def __init__(self, directory: str | os.PathLike | None = None, ram_capacity: int = 0):
        if directory is None:
            directory = tempfile.mkdtemp(prefix="weightstream-store-")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
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
        self._hooks: dict[int, object] = {}  # id(master) -> its gradient hook
        # The RAM tier (Note [hybrid placement]): its size, each parameter's place
        # (decided when the model is taken), and its tensors by data_ptr (held,
        # like the mappings).
        self.ram_capacity = ram_capacity
        self.places: PlacementPlan | None = None
        self._ram: dict[int, torch.Tensor] = {}
        self._key: dict[int, str] = {}  # id(parameter) -> its name in the placement
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
        flat = self._new_file(nbytes, shape, kind)
        with self._lock:
            self._maps[flat.untyped_storage().data_ptr()] = flat
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
        return self._new_file(nbytes, shape, kind).view(dtype).view(shape)

    def _new_file(self, nbytes: int, shape: torch.Size, kind: str) -> torch.Tensor:
        """``nbytes`` of zeros in a new file, mapped shared: the whole mapping as uint8."""
        # The suffix marks a store file for release_pages (common/pages.py).
        # The process id keeps the names of ranks sharing one store_dir apart.
        path = self.directory / f"{os.getpid()}-{next(self._ids):07d}.{kind}{STORE_SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve the blocks now: a full disk is an error here, never a
                # SIGBUS on some later write through the mapping.
                os.posix_fallocate(fd, 0, nbytes)
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
                os.ftruncate(fd, nbytes)  # file system without fallocate: sparse file
            os.close(fd)
            fd = -1
            # torch maps the file shared and closes its descriptor (a Python mmap
            # would keep one open per tensor, and a large model has thousands).
            flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(path)  # the mapping keeps the file; nothing is left behind
        return flat

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

    def placement(self) -> Placement:
        """Bytes of the training state in RAM and in files, by kind (Note [hybrid placement])."""
        if self.places is None:
            return Placement(self.ram_capacity)
        return self.places.actual

    def zeros_like(self, p: torch.Tensor, kind: str = "state") -> torch.Tensor:
        """A ``kind`` tensor of parameter ``p``'s shape and dtype, for ``p``."""
        return self.zeros(p.shape, p.dtype, kind, owner=p)

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
        """Drop the resident pages of ``tensors`` (dirty data goes to the file, not away)."""
        self._advise(tensors, mmap.MADV_DONTNEED)

    def discard(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop ``tensors``' pages and their contents (consumed gradients).

        Their data is not written back: the file's blocks are freed
        (``MADV_REMOVE``) and read as zeros again. The next write through the
        mapping allocates them anew, so free space is checked first
        (``_grad_into_store``), never left to a SIGBUS.
        """
        ranges = self._ranges_of(tensors)
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

    def prefetch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Ask the kernel to start reading ``tensors``' pages now (read-ahead)."""
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
            if p.requires_grad and id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._grad_into_store)
        return left

    def forget(self, params: Iterable[torch.Tensor], old_data: Iterable[torch.Tensor]) -> None:
        """Stop keeping ``params`` (masters another rank owns, Note [sharded store]):
        no gradient of theirs comes into the store, and the files under their old
        data are given back to the disk as soon as nothing else holds them."""
        params = list(params)
        if self.places is not None:
            gone = {self._key.get(id(p)) for p in params}
            self.places.keep_only({k for k in self._key.values() if k not in gone})
        for p in params:
            hook = self._hooks.pop(id(p), None)
            if hook is not None:
                hook.remove()
            self._grads.pop(id(p), None)
        with self._lock:
            for t in old_data:
                if t.numel():
                    ptr = t.untyped_storage().data_ptr()
                    in_file = self._maps.pop(ptr, None) is not None
                    in_ram = self._ram.pop(ptr, None) is not None
                    if (in_file or in_ram) and self.places is not None:
                        self.places.give_back("master", t.numel() * t.element_size(), in_ram)

    def _grad_into_store(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: keep ``p.grad`` in the store (Note [disk tier])."""
        grad = p.grad
        if grad is None or grad.layout != torch.strided or grad.device.type != "cpu":
            return
        if not self.holds(grad):
            mine = self._grads.get(id(p))
            if mine is None or mine.shape != grad.shape or mine.dtype != grad.dtype:
                mine = self.zeros(grad.shape, grad.dtype, "grad", owner=p)
                self._grads[id(p)] = mine
            self._reclaim(mine)
            # Autograd's first gradient of this step; later uses and micro-batches
            # are added in place into the store's tensor by autograd itself.
            mine.copy_(grad)
            p.grad = mine
            grad = mine
        self.release([grad])

    def adopt_optimizer_state(self, optimizer, params: Iterable[torch.Tensor]) -> None:
        """Move the state tensors of ``params`` that are not in the store yet into it."""
        for p in params:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not self.holds(value):
                    state[key] = self.adopt(value, "state", owner=p)

    def close(self) -> None:
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self._grads.clear()
        with self._lock:
            # The mappings live on for as long as tensors over them do.
            self._maps.clear()
            self._ram.clear()

"""All device-specific code of the streaming runtime lives here.

The rest of the runtime speaks only of "copy these host tensors to the compute
device" and "wait until that copy is usable"; this module decides how:

* CUDA (and other accelerators with streams): background copies are issued
  from the prefetch thread on a dedicated copy stream, from pinned host memory
  where the store keeps a mirror (Note [host mirror] in mirror.py), and
  readiness is a stream event that the compute stream waits on; the buffers
  are recorded on the compute stream so the allocator does not reuse them early.
* CPU as the compute device: there is no separate memory, but the streaming
  discipline is the same (a distinct device copy exists only while a unit
  runs). Prefetches run on one background thread so that the copy of the next
  unit overlaps the compute of the current one; readiness is a Future. The
  copies' buffers come from a pool that recycles them (Note [CPU copy buffers]).

Note [CPU copy buffers]
-----------------------
On the CPU a unit's "device copy" is a fresh host buffer of the unit's size,
made twice a step (forward and backward fetch). Allocations that large are
new mappings from the kernel (glibc serves everything over its mmap threshold,
at most 32 MiB, that way; the disk store lowers it to 128 KiB), so every copy
first faults in and zeroes its pages: measured here, a 100 MiB copy into a new
buffer ran at 3 GiB/s against 15 GiB/s into a reused one, and on 2 cores the
faults of the prefetch thread slow the compute beside it (a 4-block GPT of
d_model 2560, 100 MiB units, forward + backward taking turns with eager: 2.69 s
a step with new buffers, 1.40 s recycled, eager 0.87).

So the CPU path recycles them, as an accelerator's caching allocator does:
:class:`CopyBuffers` hands out a tensor over a storage it keeps, and takes
the storage back when that tensor dies. "Dies" is Python's weak reference to
the handed-out tensor: PyTorch keeps a tensor's Python object alive for as
long as any view of it is (the unit's parameter views, a view saved by
autograd for the backward, an activation that is a view of a weight), so
a storage is never handed out twice while anything can still read it. Every
pooled storage has the largest unit's size, so any copy fits any idle one, and
the pool keeps (prefetch_depth + 1) of them, the copies invariant 2 allows in
flight: the host memory it holds is the bound the plan already states (and
the disk store's working set counts, ``engine.disk_working_set``). Copies
under 1 MiB are left to the allocator, which reuses those by itself.

Note [helper threads and OpenMP]
--------------------------------
PyTorch's CPU operators run on an OpenMP team of the calling thread. An
operator run on one of the engine's helper threads (the prefetch thread's
flattening copy, the updater's optimizer kernels) gives that thread a team of
its own, and once the process has more OpenMP threads than CPUs, GNU OpenMP
stops letting idle workers spin: every parallel region of the compute thread
then wakes its workers through the kernel. Measured on 2 vCPUs: a GELU of 64
elements took 8 us, 21 us while a helper thread that had run one operator was
alive, and 76 us beside the engine's prefetch thread; a tiny eight-block chain's
forward + backward went from 1.1 ms to 3.7 ms.

So where the CPU is the compute device, the helper threads run their
operators on one thread each (:func:`single_threaded_operators`: the OpenMP
team size is a per-thread setting, unlike ``torch.set_num_threads``, which
would change it for the compute thread too). The compute keeps every CPU; the
helpers' copies and updates are memory-bound and overlap it. An accelerator's
helpers keep the full team: its host has the CPUs to itself.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightstream.common.flat import flatten, unflatten_views


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch's operators run on, if PyTorch already loaded one."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"):
        try:  # RTLD_NOLOAD: the library already in the process, never a new one
            return ctypes.CDLL(name, mode=noload | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def single_threaded_operators() -> None:
    """The PyTorch operators of the calling thread run on it alone; other threads keep
    their teams (Note [helper threads and OpenMP])."""
    runtime = _openmp_runtime()
    if runtime is not None:
        # PyTorch sizes a thread's team at its first call (a lazy per-thread init from
        # the process-wide torch.set_num_threads), over what was set before: first that.
        torch.get_num_threads()
        runtime.omp_set_num_threads(1)


@dataclass
class Transfer:
    """A copy to the device that may still be running; ``wait()`` makes it usable."""

    result: object  # the produced value, or a Future of it (background copies)
    event: torch.Event | None = None  # accelerator path: recorded on the copy stream
    recorded: bool = False  # the Future gives (value, event): an accelerator's background copy

    def wait(self):
        if isinstance(self.result, concurrent.futures.Future):
            # Host sync point: blocks until the background copy thread has issued
            # (accelerator) or done (CPU) the copy.
            self.result = self.result.result()
            if self.recorded:
                self.result, self.event = self.result
        if self.event is not None:
            # Device-side wait: the current (compute) stream waits for the copy
            # stream; the host does not block.
            compute = torch.accelerator.current_stream()
            compute.wait_event(self.event)
            self.event = None
            # The buffers were allocated on the copy stream: without this the
            # caching allocator could hand their memory to the next copy while
            # kernels of the compute stream still read it.
            for t in self.result if isinstance(self.result, list) else ():
                if isinstance(t, torch.Tensor):
                    t.record_stream(compute)
        return self.result


class CopyBuffers:
    """Recycled host buffers for the CPU's device copies (Note [CPU copy buffers]).

    Every pooled storage has the size of the largest unit, so any copy fits any
    idle storage and the pool owns at most ``count`` of them (more only while
    more copies than that are alive at once).
    """

    SMALL = 2**20  # bytes below which the allocator's own reuse serves well

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        # Owner: this pool. Why: buffers are taken on the prefetch thread and die
        # on whichever thread drops the last view of them (reentrant: a garbage
        # collection inside ``empty`` may run a dying buffer's callback).
        self._lock = threading.RLock()
        self._idle: list[torch.UntypedStorage] = []
        self._out: set[weakref.ref] = set()  # one per tensor handed out; keeps its callback
        self.allocated = 0  # storages made, for tests and benchmarks

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` uninitialized elements of ``dtype``, over a recycled storage."""
        nbytes = numel * dtype.itemsize
        if nbytes < self.SMALL or nbytes > self.nbytes:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            storage = self._idle.pop() if self._idle else None
        if storage is None:
            storage = torch.empty(self.nbytes, dtype=torch.uint8).untyped_storage()
            self.allocated += 1
        out = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))

        def back(ref, storage=storage):
            with self._lock:
                self._out.discard(ref)
                if (
                    storage.nbytes() == self.nbytes
                    and len(self._idle) + len(self._out) < self.count
                ):
                    self._idle.append(storage)

        with self._lock:
            self._out.add(weakref.ref(out, back))
        return out

    def keep(self, count: int, nbytes: int) -> None:
        with self._lock:
            if nbytes != self.nbytes:
                self._idle.clear()
            self.count, self.nbytes = count, nbytes
            del self._idle[max(0, count - len(self._out)) :]

    @property
    def idle_bytes(self) -> int:
        return len(self._idle) * self.nbytes


class DeviceOps:
    """Copies host tensors to one compute device, synchronously or in the background."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.is_cpu = self.device.type == "cpu"
        # The CPU's copies reuse their buffers; an accelerator's caching allocator
        # does that for its own (Note [CPU copy buffers]).
        self._buffers = CopyBuffers() if self.is_cpu else None
        # Owner: this object. Why: prefetching the next unit must not wait for
        # the current unit's compute, nor its host work (reading the masters,
        # writing a mirror) hold up the thread that issues the kernels. One
        # worker keeps copies in issue order.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Owner: this object. Why: host-to-device copies on their own stream
        # overlap with kernels on the compute stream.
        self._copy_stream = None
        if not self.is_cpu:
            self._copy_stream = torch.Stream(device=self.device)

    @property
    def helper_thread_init(self) -> Callable[[], None] | None:
        """What a helper thread of the engine runs first (Note [helper threads and OpenMP])."""
        return single_threaded_operators if self.is_cpu else None

    def submit(self, fn: Callable[[], object], background: bool) -> Transfer:
        """Run ``fn`` (which allocates on and copies to the device) now or in the background.

        ``fn`` must only read host tensors that nobody writes until the transfer
        is waited on: the host optimizer runs only between steps, after every
        transfer of the step was waited on or dropped.
        """
        if not background:
            return Transfer(fn())  # on the current stream: ordered with the compute
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="weightstream-prefetch",
                initializer=self.helper_thread_init,
            )
        if self.is_cpu:
            return Transfer(self._executor.submit(fn))
        stream = self._copy_stream
        # The copy stream must see everything the compute stream did so far (for
        # example an earlier in-place update of the host tensor's device twin);
        # recorded here, on the issuing thread, in issue order.
        stream.wait_stream(torch.accelerator.current_stream())

        def on_copy_stream():
            # The current stream is per thread: the worker sets its own.
            with _StreamContext(stream):
                value = fn()
                return value, stream.record_event()

        return Transfer(self._executor.submit(on_copy_stream), recorded=True)

    def copy_flat(
        self, masters: Sequence[torch.Tensor], dtype: torch.dtype, out_numel: int
    ) -> torch.Tensor:
        """One flat device buffer holding ``masters`` back to back, cast to ``dtype``."""
        flat = self.empty(out_numel, dtype)
        if self.is_cpu:
            flatten(masters, out=flat)
        else:
            for view, m in zip(unflatten_views(flat, masters), masters):
                view.copy_(m.detach(), non_blocking=True)
        return flat

    def keep(self, count: int, nbytes: int) -> None:
        """Recycle up to ``count`` copy buffers of ``nbytes`` (Note [CPU copy buffers])."""
        if self._buffers is not None:
            self._buffers.keep(count, nbytes)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat uninitialized device buffer for a unit's copy."""
        if self._buffers is not None:
            return self._buffers.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device can read asynchronously (pinned for accelerators)."""
        return torch.empty(numel, dtype=dtype, pin_memory=not self.is_cpu)

    def copy_buffer(self, src: torch.Tensor) -> torch.Tensor:
        """A device copy of the flat host buffer ``src`` (asynchronous from pinned memory
        on an accelerator's current stream; Note [host mirror] in runtime/mirror.py)."""
        out = self.empty(src.numel(), src.dtype)
        out.copy_(src, non_blocking=True)
        return out

    def close(self) -> None:
        if self._buffers is not None:
            self._buffers.keep(0, 0)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class _StreamContext:
    """``with`` support for a generic torch.Stream (sets it as the current stream)."""

    def __init__(self, stream):
        self.stream = stream
        self.prev = None

    def __enter__(self):
        self.prev = torch.accelerator.current_stream()
        torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        torch.accelerator.set_stream(self.prev)
        return False

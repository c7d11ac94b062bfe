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
:class:`CopyBuffers` hands out a tensor over a storage it keeps, and hands the
storage out again only once no tensor shares it (:class:`StoragePool`: the
storage's use count, which every tensor over it holds one of: the unit's
parameter views, a view saved by autograd for the backward, an activation that
is a view of a weight, a detached alias kept by a hook). The life of the
handed-out tensor is not enough: ``w.detach()`` shares the storage but keeps
no reference to ``w``, and a storage given back when ``w`` died was overwritten
under such an alias (a test keeps one from a forward hook). Every pooled
storage has the largest unit's size, so any copy fits any idle one, and the
pool keeps (prefetch_depth + 1) of them, the copies invariant 2 allows in
flight: the host memory it holds is the bound the plan already states (and
the disk store's working set counts, ``budgets.disk_working_set``). Copies
under 1 MiB are left to the allocator, which reuses those by itself.

Note [gradients out]
--------------------
On an accelerator a unit's weight gradients are computed on the device and the
masters they belong to are on the host. Handing them over with ``.to("cpu")``
inside autograd's device thread (as the CPU path's ``_StreamIn`` does) would
copy each tensor into new pageable memory, synchronously: measured on an H100
with a 1.1B Llama, the backward spent 1.2 s of a 2.0 s step there (2.6 GB/s,
the GPU idle meanwhile), and the new host memory's page faults came on top.

So on an accelerator the hand-over is split in two autograd nodes (streamer.py,
``_WeightsOut`` on the device side, ``_GradsIn`` on the host side):

* the device node's backward only issues the copies: on the gradient stream,
  after the compute stream's work so far, each gradient is cast on the device to
  its master's dtype and copied into page-locked host memory
  (:meth:`DeviceOps.grads_to_host`), with an event recorded after them; the
  device thread goes on with the backward of the units before it;
* the host node's backward runs on autograd's CPU thread once the device node
  is done: it waits for that event (a host sync point of that thread only) and
  returns the host tensors to autograd, which accumulates them into ``.grad``
  (taking the tensor itself where ``.grad`` was None) and runs the
  post-accumulate-grad hooks exactly as before (SwarmX, the disk store,
  updates in the backward).

The host memory is kept per unit (a :class:`StoragePool`) and handed out again
once no tensor shares it: new memory for 4 bytes a parameter every step would
be page-faulted in and unmapped by ``zero_grad`` (measured: ``zero_grad`` alone
took 207 ms of the step above), and memory that is not page-locked is copied
into synchronously. It is page-locked at its exact size (:func:`pinned_bytes`).

Why the cast is on the device: host memory bandwidth bounds a streamed step (the
optimizer alone reads and writes 28 bytes a parameter). The first version
copied bf16 into bounded staging buffers and cast on the host: 8 bytes a
parameter through host memory, on autograd's one CPU thread (measured on an
H100, 4.9B Llama, batch 8: that thread spent 1.15 s of a 2.05 s step casting,
and the device thread 0.88 s waiting for a staging buffer). The fp32 copy is 4
bytes a parameter, written by the copy engine; it doubles the link's
device-to-host bytes, which are far from the link's bound.

At most ``GRADS_IN_FLIGHT`` units' copies are queued: a link slower than the
backward then slows the backward (the device thread waits for the oldest
copy's event) instead of piling up gradients and their device temporaries.
The gradient tensors are recorded on the gradient stream, so the caching
allocator does not reuse their memory before the copy has read them. A
copy dropped by a failed backward still lands in its unit's memory, ordered
before any later copy on the same stream. The values are those of the
synchronous copy (a cast from bf16 to fp32 is exact), and the sums of a weight
used twice are made by autograd as before.

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
operators on one thread each (``common.threads.single_threaded_operators``: the OpenMP
team size is a per-thread setting, unlike ``torch.set_num_threads``, which
would change it for the compute thread too). The compute keeps every CPU; the
helpers' copies and updates are memory-bound and overlap it. An accelerator's
helpers keep the full team: its host has the CPUs to itself (the compact-state
kernels, whose operators are small, spread over single-threaded workers
instead: Note [compact kernels on many cores] in optim/compact.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightstream.common.flat import flatten, unflatten_views
from weightstream.common.threads import single_threaded_operators


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


class StoragePool:
    """Host storages handed out again once no tensor shares them (their use count).

    Kept by key, at most ``per_key`` for each; more alive at once are left to the
    allocator (they are freed when their last tensor dies). An idle storage too
    small for a request is replaced by a new one.
    """

    def __init__(self, per_key: int, alloc: Callable[[int], torch.Tensor] | None = None):
        self.per_key = per_key
        # Makes a uint8 tensor of so many bytes (page-locked for an accelerator's
        # gradients); by default the CPU allocator's.
        self._alloc = alloc or functools.partial(torch.empty, dtype=torch.uint8)
        # Owner: this pool. Why: taken on helper threads (the prefetch thread,
        # autograd's CPU thread), read by tests.
        self._lock = threading.Lock()
        self._kept: dict[object, list[torch.UntypedStorage]] = {}
        self.allocated = 0  # storages made, for tests and benchmarks

    def empty(self, key: object, numel: int, dtype: torch.dtype, size: int = 0) -> torch.Tensor:
        """``numel`` uninitialized elements of ``dtype`` over a storage kept for ``key``
        (a new one of ``size`` bytes, at least the request's, where none is idle)."""
        nbytes = numel * dtype.itemsize
        with self._lock:
            kept = self._kept.setdefault(key, [])
            storage = next((s for s in kept if s.nbytes() >= nbytes and _unshared(s)), None)
            if storage is None:
                idle = [i for i, s in enumerate(kept) if _unshared(s)]
                if idle:
                    del kept[idle[0]]  # too small: a larger one takes its place
                storage = self._alloc(max(size, nbytes)).untyped_storage()
                self.allocated += 1
                if len(kept) < self.per_key:
                    kept.append(storage)
            # Made under the lock: from here the tensor holds the storage out.
            return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def trim(self, per_key: int) -> None:
        """Keep at most ``per_key`` storages for each key from now on."""
        with self._lock:
            self.per_key = per_key
            for kept in self._kept.values():
                del kept[per_key:]

    def kept_bytes(self, idle_only: bool = False) -> int:
        with self._lock:
            return sum(
                s.nbytes()
                for kept in self._kept.values()
                for s in kept
                if not idle_only or _unshared(s)
            )


def _unshared(storage: torch.UntypedStorage) -> bool:
    """Nothing but the pool's own reference holds ``storage``: no tensor (nor view,
    nor detached alias) over it is alive."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


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
        self._pool = StoragePool(per_key=0)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` uninitialized elements of ``dtype``, over a recycled storage."""
        nbytes = numel * dtype.itemsize
        if nbytes < self.SMALL or nbytes > self.nbytes:
            return torch.empty(numel, dtype=dtype)
        return self._pool.empty(None, numel, dtype, size=self.nbytes)

    def keep(self, count: int, nbytes: int) -> None:
        if nbytes != self.nbytes:
            self._pool.clear()
        self.count, self.nbytes = count, nbytes
        self._pool.trim(count)

    @property
    def allocated(self) -> int:
        return self._pool.allocated

    @property
    def idle_bytes(self) -> int:
        return self._pool.kept_bytes(idle_only=True)


class HostGrads:
    """A unit's gradients on their way into host memory (Note [gradients out])."""

    def __init__(self, grads: list, event: torch.Event | None):
        self._grads = grads  # per gradient: the host tensor the copy writes, or None
        self._event = event  # recorded on the gradient stream after the copies

    def take(self) -> list:
        """The host gradients, once the copies into them are done."""
        if self._event is not None:
            # Host sync point of autograd's CPU thread; the device thread goes on.
            self._event.synchronize()
        grads, self._grads = self._grads, []
        return grads


class _Registered(mmap.mmap):
    """An anonymous mapping, registered with the CUDA driver (page-locked) while it
    lives; the tensors over it hold it through the buffer protocol."""

    _ptr: int | None = None

    def __new__(cls, nbytes: int):
        return super().__new__(cls, -1, nbytes)

    def register(self, ptr: int) -> None:
        check = torch.cuda.cudart().cudaHostRegister(ptr, len(self), 0)
        if int(check) != 0:
            raise RuntimeError(f"cudaHostRegister of {len(self)} bytes failed ({check})")
        self._ptr = ptr

    def __del__(self):
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)  # before the memory is unmapped
            except Exception:  # interpreter shutdown: the process's mappings go anyway
                pass


def pinned_bytes(nbytes: int, device_type: str) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` that ``device_type`` copies to and from
    asynchronously (page-locked).

    On CUDA it is a mapping of exactly that size registered with the driver: the
    caching host allocator behind ``pin_memory=True`` rounds each request up to a
    power of two (a 1.35 GB unit would take 2 GiB). Elsewhere, or where the
    registration fails, that allocator serves it.
    """
    if device_type == "cuda":
        mapping = _Registered(max(nbytes, 1))
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
        try:
            mapping.register(tensor.data_ptr())
            return tensor
        except (RuntimeError, AttributeError, TypeError):
            pass  # a runtime without registration: the allocator below serves it
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _aligned(nbytes: int, to: int = 64) -> int:
    return (nbytes + to - 1) // to * to


def _packed_bytes(like: Sequence[tuple[torch.Size, torch.dtype] | None]) -> int:
    """Bytes of tensors of these (shape, dtype) back to back, each 64-byte aligned."""
    return sum(0 if t is None else _aligned(t[0].numel() * t[1].itemsize) for t in like)


def _packed_views(buf, like: Sequence[tuple[torch.Size, torch.dtype] | None]) -> list:
    """Tensors over the uint8 tensor ``buf``'s memory laid out as ``_packed_bytes`` counts
    (None stays).

    Each is a tensor of its own over the shared storage, not a view of ``buf``: views
    share one version counter, so a write to one gradient would count as a write to
    every other gradient of the unit, and the sharded store's check of gradients
    changed after their reduction (Note [changed after the reduce] in
    runtime/swarm.py) would stop a correct step."""
    storage, views, offset = buf.untyped_storage(), [], buf.storage_offset()
    for t in like:
        if t is None:
            views.append(None)
            continue
        shape, dtype = t
        n = shape.numel() * dtype.itemsize
        # 64-byte aligned offsets: whole elements of every dtype.
        views.append(torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape))
        offset += _aligned(n)
    return views


class DeviceOps:
    """Copies host tensors to one compute device, synchronously or in the background."""

    def __init__(self, device: torch.device | str):
        # With its index ("cuda:0", not "cuda"): tensors report theirs, and a
        # device compared with a tensor's must match it.
        self.device = torch.empty(0, device=device).device
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
        # Owner: this object. Why: gradients leave the device on their own stream,
        # overlapping the rest of the backward (Note [gradients out]).
        self._grad_stream = None
        # Events of the gradient copies in flight, oldest first (their bound: the Note).
        self._grads_in_flight: collections.deque = collections.deque()
        # Host memory of the gradients an accelerator hands back, two per unit (one
        # in .grad, one arriving), page-locked: Note [gradients out].
        self.host_grads = StoragePool(per_key=2, alloc=None if self.is_cpu else self.pinned_bytes)
        # Owner: this object. Why: saved activations go to host memory and back while
        # the compute goes on (Note [activation offload] in runtime/offload.py).
        self._offload_stream = None
        if not self.is_cpu:
            self._copy_stream = torch.Stream(device=self.device)
            self._grad_stream = torch.Stream(device=self.device)
            self._offload_stream = torch.Stream(device=self.device)

    #: What the device tier leaves free of the device after a step, for fragmentation
    #: and the peaks of later steps (Note [device tier] in placement.py).
    TIER_MARGIN = 0.1

    def tier_room(self) -> int:
        """Bytes the device tier may take after a step ran: what the device has free,
        plus what its caching allocator keeps for reuse, less the step's peak and a
        margin (Note [device tier]); 0 on the CPU, whose device is host memory."""
        if self.is_cpu:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        reusable = torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, int(free + reusable - peak - self.TIER_MARGIN * total))

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

    # ---- a unit's copy through host collectives (Note [sharded store] in sharding.py) ----

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized flat host buffer for part of a unit's copy, which a host
        collective (gloo) sends or fills and :meth:`from_staging` puts on the device.

        On the CPU it is the copy itself (a recycled buffer: Note [CPU copy buffers]).
        On an accelerator it is page-locked memory of the caching host allocator: that
        allocator hands a block out again only once the device copies reading it are
        done, so the buffer may be dropped as soon as they are issued. It keeps the
        blocks (each rounded up to a power of two) for the next fetches: about the
        units in flight, (prefetch_depth + 1) of them.
        """
        if self.is_cpu:
            return self.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def staging_flat(
        self, masters: Sequence[torch.Tensor], dtype: torch.dtype, out_numel: int
    ) -> torch.Tensor:
        """``masters`` back to back in a :meth:`staging` buffer, cast to ``dtype`` on the
        host (on the CPU, :meth:`copy_flat`)."""
        return flatten(masters, out=self.staging(out_numel, dtype))

    def from_staging(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """One flat device buffer holding the :meth:`staging` buffers ``pieces`` back to
        back: on the CPU the pieces themselves (joined where there are several), on an
        accelerator copies issued on the current stream (the prefetch thread's copy
        stream, whose event the compute stream waits for: :class:`Transfer`)."""
        if self.is_cpu:
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        out = self.empty(sum(p.numel() for p in pieces), pieces[0].dtype)
        for view, piece in zip(unflatten_views(out, pieces), pieces):
            view.copy_(piece, non_blocking=True)
        return out

    GRADS_IN_FLIGHT = 2  # units whose gradient copies may be queued at once

    def grads_to_host(
        self, grads: Sequence[torch.Tensor | None], dtypes: Sequence[torch.dtype], key: object
    ) -> HostGrads:
        """Start copying one unit's device gradients, cast to ``dtypes``, into host
        memory kept for ``key``; the result's ``take`` gives them once they are there
        (Note [gradients out])."""
        assert self._grad_stream is not None, "the CPU has no gradients to move"
        like = [None if g is None else (g.shape, dt) for g, dt in zip(grads, dtypes)]
        if all(t is None for t in like):
            return HostGrads([None] * len(like), None)
        in_flight = self._grads_in_flight
        while len(in_flight) >= self.GRADS_IN_FLIGHT:
            # Host sync point of autograd's device thread, reached only when the link
            # is behind the backward: it waits instead of piling gradients up.
            in_flight.popleft().synchronize()
        host = _packed_views(self.host_grads.empty(key, _packed_bytes(like), torch.uint8), like)
        stream = self._grad_stream
        # The copies read what the compute stream wrote: they start after it.
        stream.wait_stream(torch.accelerator.current_stream())
        with _StreamContext(stream):
            for g, h in zip(grads, host):
                if g is not None:
                    # Cast on the device, on this stream (the temporary's memory is
                    # reused only by this stream's later work).
                    h.copy_(g if g.dtype == h.dtype else g.to(h.dtype), non_blocking=True)
                    # g dies with autograd's buffers: its memory must wait for the copy.
                    g.record_stream(stream)
            event = stream.record_event()
        in_flight.append(event)
        return HostGrads(host, event)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying device tensor ``t`` into new host memory (page-locked on an
        accelerator: the caching host allocator's, whose blocks the next step reuses),
        on the offload stream (Note [activation offload] in runtime/offload.py)."""
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=not self.is_cpu)
        if self.is_cpu:
            return host.copy_(t)
        stream = self._offload_stream
        stream.wait_stream(torch.accelerator.current_stream())  # after t was written
        with _StreamContext(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # t's memory waits for the copy to read it
        return host

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.Event | None]:
        """Start copying ``host`` back into a new device tensor, on the offload stream
        (after its copy out, which that stream ran first); the event follows the copy.
        The CPU gives ``host`` itself."""
        if self.is_cpu:
            return host, None
        out = torch.empty(host.size(), dtype=host.dtype, device=self.device)
        stream = self._offload_stream
        # The new memory may have been the compute stream's until now.
        stream.wait_stream(torch.accelerator.current_stream())
        with _StreamContext(stream):
            out.copy_(host, non_blocking=True)
            out.record_stream(stream)  # dropped unused, it still waits for the copy
            return out, stream.record_event()

    def wait_copy(self, event: torch.Event | None) -> None:
        """Make the current stream wait for a copy's event (no host sync)."""
        if event is not None:
            torch.accelerator.current_stream().wait_event(event)

    def pinned_bytes(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory this device copies to and from asynchronously."""
        return pinned_bytes(nbytes, self.device.type)

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
        if self.is_cpu:
            return torch.empty(numel, dtype=dtype)
        return self.pinned_bytes(numel * dtype.itemsize).view(dtype)

    def copy_buffer(self, src: torch.Tensor) -> torch.Tensor:
        """A device copy of the flat host buffer ``src`` (asynchronous from pinned memory
        on an accelerator's current stream; Note [host mirror] in runtime/mirror.py)."""
        out = self.empty(src.numel(), src.dtype)
        out.copy_(src, non_blocking=True)
        return out

    def close(self) -> None:
        if self._buffers is not None:
            self._buffers.keep(0, 0)
        while self._grads_in_flight:
            self._grads_in_flight.popleft().synchronize()
        self.host_grads.clear()
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

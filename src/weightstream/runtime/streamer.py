"""Moves streaming units between the host store and the device around each use.

Forward: a unit's forward pre-hook takes its device copy (prefetched, or
fetched now), swaps the copies into the unit's parameter slots and starts the
prefetch of the next units; its forward hook puts the masters back and drops
the copy. Backward: the weights are fetched again, in reverse order, when
autograd first needs them, and dropped as backward moves past them.

Note [streaming and autograd]
-----------------------------
Gradients: a unit's device tensors are the outputs of ``_StreamIn``, an autograd
function whose inputs are the host masters. Autograd therefore routes every
gradient of a device copy back to its master and sums the contributions of
several copies (a module called twice, a tied embedding) in the master's
``.grad`` exactly as eager PyTorch sums the uses of one tensor. The store never
has to know which copy produced which gradient.

Saved weights: operators save their weight operands for backward (``mm`` keeps
``weight.t()``). A saved-tensors pack hook recognises any view of a unit's flat
device buffer and replaces it by a ``_SavedWeight`` record (which copy, size,
stride, offset); nothing then holds the device buffer after the forward window
closes. The unpack hook rebuilds the exact view from a fresh backward fetch of
the same unit, whose buffer has the identical layout. Tensors derived from a
weight by a real computation (a dtype cast, ``.contiguous()``) are ordinary
activations and stay saved as they are.

On an accelerator the gradients' way back is two nodes instead of one, so that
their copy to the host overlaps the rest of the backward (``_WeightsOut`` and
``_GradsIn``: Note [gradients out] in device.py); autograd still routes and sums
them into the masters' ``.grad``.

A device copy whose gradient is undefined (a weight the loss does not depend on)
gives its master no gradient, as eager PyTorch leaves such a weight's ``.grad``
None; it is not made a tensor of zeros (``set_materialize_grads(False)``), which
an optimizer would step.

With activation checkpointing a unit's call saves nothing of its own: its forward
is recomputed in the backward inside a window of its own (Note [activation
checkpointing] in recompute.py).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream.runtime.device import DeviceOps
from weightstream.runtime.memoryx import MemoryX
from weightstream.runtime.mirror import HostMirror
from weightstream.runtime.offload import ActivationOffload, _Offloaded
from weightstream.runtime.partition import Plan
from weightstream.runtime.recompute import UnitForward, checkpointed
from weightstream.runtime.residency import ResidencyMeter
from weightstream.runtime.unit import StreamingUnit, UnitCopy


@dataclass(eq=False)
class _Sequence:
    """The units one forward pass entered, in order (positions index into it)."""

    id: int
    units: list[int] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)  # positions with saved weights
    recompute: set[int] = field(default_factory=set)  # positions recomputed in the backward
    adhoc: bool = False  # opened by a unit called outside the compiled forward


@dataclass(frozen=True)
class _SavedWeight:
    """Stands in for a saved view of a unit's device buffer (see the Note)."""

    seq: _Sequence
    pos: int
    group: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Link:
    """What ``_StreamIn`` needs: the device copies to hand out (forward only), and
    what to note when the unit's backward is done (``note(event, unit)``)."""

    __slots__ = ("name", "note", "ops", "tensors")

    def __init__(self, ops: DeviceOps, tensors: list[torch.Tensor], name: str, note=None):
        self.ops = ops
        self.tensors = tensors
        self.name = name
        self.note = note


class _StreamIn(torch.autograd.Function):
    """masters (host) -> device copies; backward returns gradients to the masters (the
    CPU as the compute device; accelerators hand over in two nodes, below)."""

    @staticmethod
    def forward(ctx, link: _Link, *masters: torch.Tensor):
        outs = tuple(link.tensors)
        link.tensors = []  # the graph must not keep the device buffers alive
        ctx.ops = link.ops
        ctx.name = link.name
        ctx.note = link.note
        ctx.masters = [(m.device, m.dtype) for m in masters]
        ctx.set_materialize_grads(False)  # no gradient stays None (see the Note)
        frozen = [o for o, m in zip(outs, masters) if not m.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        out = [None]
        for g, (device, dtype) in zip(grads, ctx.masters):
            if g is None:
                out.append(None)
            elif g.device == device and g.dtype == dtype:
                out.append(g)
            else:  # a compute dtype other than the master's (accelerators: _WeightsOut)
                out.append(g.to(device=device, dtype=dtype))
        if ctx.note is not None:
            # The unit's weight gradients are complete: its backward is done
            # (SwarmX reduces them once autograd accumulated them; Note [swarm reduce]).
            ctx.note("unit_backward_end", ctx.name)
        return tuple(out)


class _Handoff:
    """What a unit's ``_WeightsOut`` passes to its ``_GradsIn``: the gradients of each
    backward through them, on their way to the host, in order (Note [gradients out])."""

    __slots__ = ("dtypes", "key", "link", "pending")

    def __init__(self, link: _Link, masters: Sequence[torch.Tensor], key: int):
        self.link = link
        self.key = key  # the unit's index: its gradients' host memory is kept by it
        self.dtypes = [m.dtype for m in masters]
        self.pending: collections.deque = collections.deque()


class _GradsIn(torch.autograd.Function):
    """Host side of an accelerator's hand-over: masters -> an empty token; its backward
    waits for the unit's gradients to arrive and returns them to the masters."""

    @staticmethod
    def forward(ctx, handoff: _Handoff, *masters: torch.Tensor):
        ctx.handoff = handoff
        return torch.empty(0)

    @staticmethod
    def backward(ctx, _token):
        handoff = ctx.handoff
        link = handoff.link
        grads = handoff.pending.popleft().take()
        if link.note is not None:
            # The unit's weight gradients are on the host: its backward is done
            # (Note [swarm reduce]).
            link.note("unit_backward_end", link.name)
        return (None, *grads)


class _WeightsOut(torch.autograd.Function):
    """Device side of an accelerator's hand-over: the token -> the unit's device copies;
    its backward starts their gradients' copy to the host and returns at once."""

    @staticmethod
    def forward(ctx, handoff: _Handoff, requires: tuple[bool, ...], token: torch.Tensor):
        link = handoff.link
        outs = tuple(link.tensors)
        link.tensors = []  # the graph must not keep the device buffers alive
        ctx.handoff = handoff
        ctx.set_materialize_grads(False)  # no gradient stays None (Note [streaming and autograd])
        frozen = [o for o, r in zip(outs, requires) if not r]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        handoff = ctx.handoff
        ops = handoff.link.ops
        handoff.pending.append(ops.grads_to_host(grads, handoff.dtypes, handoff.key))
        return None, None, torch.empty(0)


@dataclass
class _Window:
    unit: StreamingUnit
    pos: int
    copy: UnitCopy
    previous: list[tuple[nn.Module, str, torch.Tensor]]


class _Region:
    """One checkpointed call of a unit: its first run opens a forward window and
    remembers where; each recompute opens a backward window at the same position
    (Note [activation checkpointing])."""

    __slots__ = ("inner", "pos", "seq", "streamer", "unit")

    def __init__(self, streamer: Streamer, unit: StreamingUnit, inner):
        self.streamer = streamer
        self.unit = unit
        self.inner = inner  # the module's own forward
        self.seq: _Sequence | None = None
        self.pos = -1

    def __call__(self, first: bool, *args, **kwargs):
        streamer = self.streamer
        if first:
            window = streamer._enter(self.unit)
            self.seq, self.pos = streamer._seq, window.pos
            self.seq.recompute.add(self.pos)
            try:
                return self.inner(*args, **kwargs)
            finally:
                streamer._exit(self.unit)
        assert self.seq is not None, "a recompute before the first run"
        window = streamer._enter_recompute(self.unit, self.seq, self.pos)
        try:
            return self.inner(*args, **kwargs)
        finally:
            streamer._close(window)  # also on the checkpoint's early stop


class Streamer:
    """Owns the units' device copies, the module hooks and the saved-tensor hooks."""

    def __init__(
        self,
        plan: Plan,
        ops: DeviceOps,
        prefetch_depth: int,
        compute_dtype_of,
        store: MemoryX,
        postprocess=None,
        before_fetch=None,
        note=None,
        recompute: set[int] | frozenset[int] = frozenset(),
        mirror: bool = False,
        mirror_by_update: bool = False,
        offload: ActivationOffload | None = None,
        resident: frozenset[int] = frozenset(),
    ):
        self.plan = plan
        # Units of the device tier: never fetched, their masters on the device (Note
        # [device tier] in placement.py); their forward only waits for their update.
        self.resident = frozenset(resident)
        # Indices of the units whose forward is recomputed in the backward
        # (Note [activation checkpointing] in recompute.py).
        self.recompute = frozenset(recompute)
        self._note = note  # records streaming events (the engine's EventLog)
        # MemoryX (Note [memoryx] in memoryx.py): fills a unit's buffer from the masters
        # (a disk tier reads them ahead when the fetch is issued and gives their pages
        # back once copied; a sharded store broadcasts each from its owner).
        self._store = store
        # Called with a unit index before its masters are read: waits for that
        # unit's share of an overlapped optimizer step.
        self._before_fetch = before_fetch
        self._postprocess = postprocess  # applied to each flat buffer after the copy
        # Fetches copy each unit's compute-dtype mirror, written once per forward
        # pass or by the update (Note [host mirror] in mirror.py); the engine asks
        # for it only where the masters are read directly and nothing is applied
        # to the copy.
        assert not mirror or (not store.on_disk and not store.sharded and postprocess is None)
        self._mirror = mirror
        self._mirror_by_update = mirror_by_update  # the updater calls mirror_updated
        # Saved activations go to host memory (Note [activation offload] in offload.py).
        self.offload = offload
        self._mirrors: dict[int, dict[torch.dtype, HostMirror]] = {}  # unit index -> groups
        # id(master) -> every (mirror, position in it) holding it (a tied weight: two).
        self._mirror_slots: dict[int, list[tuple[HostMirror, int]]] = {}
        self._generation = 0  # the forward pass in progress (mirrors written in it are fresh)
        self.ops = ops
        self.depth = prefetch_depth
        self.units = [StreamingUnit.from_spec(u, compute_dtype_of) for u in plan.units]
        self.meter = ResidencyMeter()
        # id(parameter) -> every (module, name) slot registering it, for foreign reads.
        self._slots_by_param: dict[int, list[tuple[nn.Module, str]]] = {}
        for u in self.units:
            for slot in u.spec.slots:
                self._slots_by_param.setdefault(id(slot.param), []).append((slot.module, slot.name))
        self._hooks: list = []
        self._ids = itertools.count()
        # Predicted forward order of units (positions): the last forward's, or the plan's.
        self._order_hint: list[int] = [u.index for u in self.units if u.index not in resident]
        # Forward state (one forward at a time).
        self._seq: _Sequence | None = None
        self._windows: list[_Window] = []
        # The device tier's open windows with casts: (unit, the slots' previous values).
        self._resident_windows: list[tuple[StreamingUnit, list]] = []
        self._prefetched: dict[int, UnitCopy] = {}  # position -> copy
        self._buffer_owner: dict[int, tuple[_Sequence, int, int]] = {}  # id(buf) -> ref
        # Backward state.
        self._bwd: dict[tuple[int, int], UnitCopy] = {}  # (seq id, position) -> copy
        self._bwd_callback_queued = False

    # ---- installation -------------------------------------------------------

    def install(self) -> None:
        for unit in self.units:
            m = unit.spec.module
            if unit.index in self.resident and unit.index in self.recompute:
                # Recomputed as the streamed units are: the room the device tier took
                # was measured with their activations recomputed.
                self._hooks.append(UnitForward(m, self._make_resident_run(unit)))
                continue
            if unit.index in self.resident:
                self._hooks.append(m.register_forward_pre_hook(self._make_resident_pre(unit)))
                self._hooks.append(
                    m.register_forward_hook(self._make_resident_post(unit), always_call=True)
                )
                continue
            if unit.index in self.recompute:
                # The window must sit inside the checkpointed call, which only a
                # forward of ours can arrange (Note [activation checkpointing]).
                self._hooks.append(UnitForward(m, self._make_run(unit)))
                continue
            self._hooks.append(m.register_forward_pre_hook(self._make_pre(unit)))
            self._hooks.append(m.register_forward_hook(self._make_post(unit), always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.ops.close()

    def _make_pre(self, unit: StreamingUnit):
        def pre(_module, _args):
            self._enter(unit)

        return pre

    def _make_resident_pre(self, unit: StreamingUnit):
        """A unit of the device tier computes on its masters; where its compute dtype is
        another, on casts of them made in its window (autograd's cast returns the
        gradient to the master in the master's dtype, as ``_StreamIn`` does)."""
        casts = {
            i: dt for dt, idx in unit.groups.items() for i in idx if dt != unit.params[i].dtype
        }

        def pre(_module, _args):
            if self._before_fetch is not None:
                self._before_fetch(unit.index)  # never compute on a master being updated
            if not casts:
                return
            tensors = [p.to(casts[i]) if i in casts else p for i, p in enumerate(unit.params)]
            self._resident_windows.append(self._swap(unit, tensors))

        return pre

    def _make_resident_post(self, unit: StreamingUnit):
        def post(_module, _args, _out):
            windows = self._resident_windows
            if windows and windows[-1][0] is unit:
                for owner, name, value in reversed(windows.pop()[1]):
                    owner._parameters[name] = value

        return post

    def _make_resident_run(self, unit: StreamingUnit):
        """A device-tier unit whose forward is recomputed in the backward: its window
        (the casts of its masters) inside the checkpointed call, so that the recompute
        casts again and nothing of the first run is kept."""
        module, pre, post = (
            unit.spec.module,
            self._make_resident_pre(unit),
            self._make_resident_post(unit),
        )

        def window(inner, args: tuple, kwargs: dict):
            pre(module, args)
            try:
                return inner(*args, **kwargs)
            finally:
                post(module, args, None)

        def run(inner, args: tuple, kwargs: dict):
            if not torch.is_grad_enabled():
                return window(inner, args, kwargs)
            return checkpointed(module, lambda _first, *a, **k: window(inner, a, k), args, kwargs)

        return run

    def _swap(self, unit: StreamingUnit, tensors) -> tuple[StreamingUnit, list]:
        """Put ``tensors`` (one a parameter of ``unit``) into the unit's slots, its own and
        foreign ones; returns what they held."""
        by_param = {id(p): t for p, t in zip(unit.params, tensors)}
        previous = []
        for slot in unit.spec.slots:
            try:
                previous.append((slot.module, slot.name, slot.module._parameters[slot.name]))
            except KeyError:
                raise _left_its_module(slot) from None
            slot.module._parameters[slot.name] = by_param[id(slot.param)]
        for p in unit.spec.foreign:
            for owner, name in self._slots_by_param.get(id(p), ()):
                previous.append((owner, name, owner._parameters[name]))
                owner._parameters[name] = by_param[id(p)]
        return unit, previous

    def _make_post(self, unit: StreamingUnit):
        def post(_module, _args, _out):
            self._exit(unit)

        return post

    def _make_run(self, unit: StreamingUnit):
        module = unit.spec.module

        def run(inner, args: tuple, kwargs: dict):
            if torch.is_grad_enabled():
                return checkpointed(module, _Region(self, unit, inner), args, kwargs)
            # Nothing is saved for a backward: the plain window.
            self._enter(unit)
            try:
                return inner(*args, **kwargs)
            finally:
                self._exit(unit)

        return run

    # ---- fetching -------------------------------------------------------------

    def _issue(self, unit: StreamingUnit, background: bool, forward: bool = False) -> UnitCopy:
        """Fetch ``unit`` (a forward fetch writes a stale mirror: Note [host mirror])."""
        copy = UnitCopy(unit)
        groups = [(dt, [unit.params[i] for i in idx]) for dt, idx in unit.groups.items()]
        ops, meter, post, before = self.ops, self.meter, self._postprocess, self._before_fetch
        store = self._store
        index = unit.index
        mirrors = self._mirrors_of(unit) if self._mirror else None
        generation = self._generation if forward else None

        def run():
            if before is not None:
                before(index)  # never copy a master whose update is still running
            buffers = []
            for dt, masters in groups:
                numel = sum(m.numel() for m in masters)
                if mirrors is not None:
                    buf = ops.copy_buffer(mirrors[dt].source(masters, generation))
                else:
                    buf = store.fetch_flat(masters, dt, numel, ops)
                if post is not None and buf.is_floating_point():
                    post(buf)
                meter.track(buf)
                buffers.append(buf)
            return buffers

        if background:
            store.prefetch(unit.params)
        # A sharded store's broadcasts must all run on the one worker thread, in
        # issue order, synchronous fetches too (Note [sharded store]).
        background = (background and self.depth > 0) or store.fetch_on_worker
        copy.fetch(ops.submit(run, background=background))
        return copy

    def _mirrors_of(self, unit: StreamingUnit) -> dict[torch.dtype, HostMirror]:
        mirrors = self._mirrors.get(unit.index)
        if mirrors is None:
            mirrors = {}
            for dt, idx in unit.groups.items():
                masters = [unit.params[i] for i in idx]
                numel = sum(m.numel() for m in masters)
                buf = self.ops.host_empty(numel, dt)
                # Masters of the compute dtype are the mirror (Note [host mirror]),
                # unless one is a tied weight already in another unit's mirror.
                aliased = all(
                    m.dtype == dt and m.is_contiguous() and id(m) not in self._mirror_slots
                    for m in masters
                )
                mirrors[dt] = mirror = HostMirror(buf, masters, self._mirror_by_update, aliased)
                for i, m in enumerate(masters):
                    self._mirror_slots.setdefault(id(m), []).append((mirror, i))
            self._mirrors[unit.index] = mirrors
        return mirrors

    def mirror_updated(self, params: Sequence[torch.Tensor]) -> None:
        """``params`` were just updated: write them into every mirror holding them
        (the updater calls this after each share; Note [host mirror])."""
        for p in params:
            for mirror, i in self._mirror_slots.get(id(p), ()):
                mirror.updated(i, p)

    def mirror_bytes(self) -> int:
        """Host bytes the mirrors hold (Note [host mirror])."""
        return sum(m.nbytes for group in self._mirrors.values() for m in group.values())

    # ---- forward ----------------------------------------------------------------

    def begin_forward(self) -> None:
        assert not self._windows, "a forward is already running"
        self._generation += 1
        self._seq = _Sequence(next(self._ids))
        if self.offload is not None:
            self.offload.begin_forward()
        if not self.ops.is_cpu:
            # The first unit's copy overlaps whatever runs before it. On the CPU the
            # first unit is entered at once and would only wait for the hand-off to
            # the prefetch thread (measured: 8% of a one-unit step of 2.6 ms).
            self._prefetch_forward(-1)

    def end_forward(self) -> None:
        seq = self._seq
        for copy in self._prefetched.values():
            copy.evict()
        self._prefetched.clear()
        if seq is not None and seq.units:
            self._order_hint = list(seq.units)
        self._seq = None

    def abort_forward(self) -> None:
        """Undo every open window after an exception inside the forward."""
        while self._windows:
            self._close(self._windows.pop())
        self.end_forward()

    def _enter(self, unit: StreamingUnit) -> _Window:
        if self._seq is None:
            # Called outside the compiled module's forward (the user called the
            # original module): stream anyway, in a one-off sequence.
            self._generation += 1
            self._seq = _Sequence(next(self._ids), adhoc=True)
        seq = self._seq
        pos = len(seq.units)
        seq.units.append(unit.index)
        copy = self._prefetched.pop(pos, None)
        if copy is not None and copy.unit is not unit:
            copy.evict()  # the prediction was wrong
            copy = None
        if copy is None:
            copy = self._issue(unit, background=False, forward=True)
        tensors = copy.wait()
        self._prefetch_forward(pos)

        for buf_i, buf in enumerate(copy.buffers or ()):
            self._buffer_owner[id(buf)] = (seq, pos, buf_i)
        window = self._open(unit, pos, copy, tensors, self._note)
        self._windows.append(window)
        return window

    def _open(self, unit: StreamingUnit, pos: int, copy: UnitCopy, tensors, note) -> _Window:
        """Swap the device copies into the unit's slots (its own and foreign ones)."""
        masters = unit.params
        if torch.is_grad_enabled() and any(p.requires_grad for p in masters):
            link = _Link(self.ops, list(tensors), unit.spec.display_name, note)
            if self.ops.is_cpu:
                tensors = list(_StreamIn.apply(link, *masters))
            else:  # Note [gradients out] in device.py
                handoff = _Handoff(link, masters, unit.index)
                token = _GradsIn.apply(handoff, *masters)
                requires = tuple(m.requires_grad for m in masters)
                tensors = list(_WeightsOut.apply(handoff, requires, token))
        return _Window(unit, pos, copy, self._swap(unit, tensors)[1])

    def _exit(self, unit: StreamingUnit) -> None:
        if not self._windows or self._windows[-1].unit is not unit:
            return  # the pre-hook failed before opening the window
        self._close(self._windows.pop())
        if not self._windows and self._seq is not None and self._seq.adhoc:
            self.end_forward()

    def _close(self, window: _Window) -> None:
        for owner, name, value in reversed(window.previous):
            owner._parameters[name] = value
        for buf in window.copy.buffers or ():
            self._buffer_owner.pop(id(buf), None)
        window.copy.evict()

    def _prefetch_forward(self, pos: int) -> None:
        """Keep positions pos+1 .. pos+depth in flight, following the order hint."""
        seq = self._seq
        if self.depth == 0 or seq is None:
            return
        if seq.units != self._order_hint[: len(seq.units)]:
            return  # this forward left the predicted path: fetch on demand only
        for p in range(pos + 1, min(pos + 1 + self.depth, len(self._order_hint))):
            if p not in self._prefetched:
                unit = self.units[self._order_hint[p]]
                self._prefetched[p] = self._issue(unit, background=True, forward=True)

    # ---- saved tensors (backward) -------------------------------------------------

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        owner = self._buffer_owner.get(id(base))
        if owner is None:
            offload = self.offload
            if (
                offload is not None
                and self._seq is not None  # a forward, not a recompute in the backward
                and not (t.is_leaf and t.requires_grad)  # a resident parameter stays
                and offload.wants(t)
            ):
                return offload.pack(t)
            return t
        if t.dtype != base.dtype:
            return t
        seq, pos, group = owner
        seq.saved.add(pos)
        return _SavedWeight(seq, pos, group, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        if isinstance(saved, _Offloaded):
            return self.offload.unpack(saved)
        if not isinstance(saved, _SavedWeight):
            return saved
        self._begin_backward_fetch(saved.seq, saved.pos)
        seq, pos = saved.seq, saved.pos
        key = (seq.id, pos)
        copy = self._bwd.get(key)
        if copy is None:
            copy = self._issue(self.units[seq.units[pos]], background=False)
            self._bwd[key] = copy
        copy.wait()
        self._prefetch_backward(seq, pos)
        buf = copy.buffers[saved.group]
        return buf.as_strided(saved.size, saved.stride, saved.offset)

    def _begin_backward_fetch(self, seq: _Sequence, pos: int) -> None:
        if not self._bwd_callback_queued:
            # Runs once the whole backward pass is done: drop every backward copy.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._bwd_callback_queued = True
        # Backward has moved past later positions of this sequence: drop them
        # before fetching, so they never count together with this one.
        for k in [k for k in self._bwd if k[0] == seq.id and k[1] > pos]:
            self._bwd.pop(k).evict()

    def _enter_recompute(self, unit: StreamingUnit, seq: _Sequence, pos: int) -> _Window:
        """The backward window of a recomputed call: the weights fetched again (or
        prefetched), swapped in; closed by ``_close`` (Note [activation checkpointing])."""
        self._begin_backward_fetch(seq, pos)
        # The recomputed views of the buffer are held by the checkpoint until the
        # backward consumes them; nobody needs this copy after the window.
        copy = self._bwd.pop((seq.id, pos), None)
        if copy is None:
            copy = self._issue(unit, background=False)
        tensors = copy.wait()
        self._prefetch_backward(seq, pos)
        # No note: the first run's _StreamIn notes the unit's backward end.
        return self._open(unit, pos, copy, tensors, None)

    def _prefetch_backward(self, seq: _Sequence, pos: int) -> None:
        needed = seq.saved | seq.recompute
        wanted = [p for p in sorted(needed, reverse=True) if p < pos][: self.depth]
        for p in wanted:
            key = (seq.id, p)
            if key not in self._bwd:
                self._bwd[key] = self._issue(self.units[seq.units[p]], background=True)

    def _end_backward(self) -> None:
        for copy in self._bwd.values():
            copy.evict()
        self._bwd.clear()
        self._bwd_callback_queued = False

    # ---- inspection -----------------------------------------------------------------

    def resident_bytes(self) -> int:
        return self.meter.current_bytes()


def _left_its_module(slot) -> ValueError:
    """The error of a parameter no longer in its module when its unit runs."""
    return ValueError(
        f"the parameter {slot.name!r} of a {type(slot.module).__name__} is no longer in its "
        "module when its unit runs: something replaced it during the forward (a torch "
        "parametrization, as peft's LoRA on bare parameters registers for a mixture of "
        "experts' stacked experts), and weight streaming has no place to put its values. "
        "Fix: leave that parameter as it is (with peft: adapters on Linear modules only, "
        "not target_parameters)."
    )

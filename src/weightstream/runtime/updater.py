"""The one update path of a streamed model: every optimizer step, at the step, behind the
next forward, or in the backward.

Note [overlapped updates]
-------------------------
``optimizer.step()`` on a weightstream optimizer bound to a streaming engine
(Note [engine binding] in optim/binding.py) always goes to the engine's updater,
which runs the optimizer's kernels (``optimizer._update``) on shares of the
masters, the gradients handed in the groups. Where it runs is the only choice:
at the step, in the caller's thread, as one share of every parameter (the
default: ``p.grad`` stays, as after torch.optim's ``step()``); unit by unit
behind the next forward (below); unit by unit in the backward (Note [updates in
backward]); unit by unit through a disk store's pager (below).

With ``StreamingConfig(overlap_updates=True)``, ``optimizer.step()`` on a
weightstream optimizer bound to a streaming engine (Note [engine binding] in
optim/binding.py) does not update the masters at once. Everything global was already decided by then
(the loss scaler's unscale and non-finite check, gradient clipping: they ran
before ``step()``), so the step only has to be applied. It is split by unit, in
the forward order of the plan, and run on a background thread; the next
forward's fetch of unit k waits for unit k's share only, so the first units
compute while the last ones are still being updated. No weight is ever fetched
stale.

At ``step()`` the update takes the hyperparameters of every group as they are
then (an LR scheduler stepping right after does not change this step) and takes
the gradients out of ``p.grad`` (which becomes None), so ``zero_grad()`` and the
next backward cannot race with it. Anything that reads the masters or the
optimizer state as a whole (``state_dict()`` of the model or the optimizer,
``load_state_dict()``) waits for the pending update first.

A parameter itself is not guarded: until the next forward has fetched its unit
(or ``optimizer.synchronize()`` returned), reading it may give its value before
the step (an EMA, a weight norm), and writing it races with the update, which
would then step the written value. So each share compares its parameters'
version counters with those at ``step()``: an in-place write in between (under
``torch.no_grad()``) stops the share before it updates anything, and the error
surfaces at the next wait, naming the parameter and the fix. A write through
``p.data`` does not count a version and is not seen, nor is a write made while
the share's update is under way (it races the update; measured by a new user:
11 of 14 tries stopped, the others ended within 5e-7 of the step). The check
catches the common mistake; ``synchronize()`` first is the rule.

A parameter shared by several units (a tied embedding) is updated with the
first unit that holds it; one worker runs the shares in order, so waiting for a
unit's share also waits for every earlier share.

With a disk store (Note [disk tier] in runtime/store.py) the step is split by
unit the same way even without overlap (it then runs in the caller's thread).
A parameter whose master, gradient or optimizer state is in a file is updated
alone, on buffers read two parameters ahead and written back behind it
(Note [explicit disk I/O] in runtime/diskio.py): the same kernels on the same
values, so the bits are those of the RAM store, and the update never holds
more than the pool's bounded buffers. ``step()`` without overlap returns once
the writes are done; with overlap, ``synchronize`` waits for them.

Note [updates in backward]
--------------------------
With ``StreamingConfig(update_in_backward=True)`` a unit's share of the step
starts during the backward, as soon as its gradients are final, on the update
worker, while autograd goes on with the units before it (the host optimizer
hidden behind the backward, not only behind the next forward).

Exactness is a question of order: ``step()`` normally comes after everything
global that reads or changes the gradients as a whole (the loss scaler's
unscale and non-finite check, clipping by norm or value), and none of it is
known before the last unit's gradient. So only the step code that knows the
whole sequence before the backward arms it: ``amp.optimizer_step`` and the run
command's trainer (``amp.step_helper.backward_context``), and only when nothing
global comes between (no clipping, no loss scaling) and the optimizer is a
weightstream optimizer bound to this engine; under data parallel (a gradient is
final only once SwarmX reduced it) it is not armed. Armed, the updater takes the
step's hyperparameters at the start of the backward (nothing may change them
before ``step()``, which the step code guarantees) and the engine's
post-accumulate-grad hook on each master hands over its gradient when autograd
accumulated it, which happens once per backward per leaf, after every use of it
(a tied or twice-called weight included). A share is submitted when each of its
parameters that takes part has handed its gradient over; ``step()`` then
submits what is left (parameters without a gradient in this backward but with
one from an earlier micro-batch, shares not complete). Each parameter is
updated once, by the same kernels on the same values as in the step after the
backward: the bits are the same. What changes is that the update has begun
before ``step()``: a backward that raises after a share started leaves those
units stepped, and the engine says so (a partial step is never silent).

With a disk store an armed gradient never goes to its file: the store's hook
leaves autograd's tensor where it is (``UnitUpdater.takes``) and the share
reads it from memory, so a step moves only the optimizer state (and masters)
that live in files, not the gradients twice (written by the backward, read
back by the update: half of the traffic of a model at 1.4x RAM). Such
gradients are memory until their share is done, so the hook that hands a
unit's gradients over first waits for the previous such share: at most two
units' gradients are held (``budgets.disk_working_set`` counts them), and a
host update slower than the backward holds the backward back instead of
piling gradients up. While it waits, the share it hands over starts reading
its first parameter's master and state from the files (``_Pager.start_early``),
so the disk does not sit idle between two shares; the disk store's I/O pool
has room for that set beside the running share's (``budgets.disk_io_set``), so
the running share never waits for buffers that only the waiting one could give
back. Gradients of an earlier micro-batch (not armed) are in the files
already; the armed backward adds to them there, as before.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import torch

from weightstream.optim._common import GRADS_KEY


class UnitUpdater:
    """Applies an optimizer step unit by unit: behind the next forward, or in place.

    Args:
        unit_params: each unit's master parameters, in forward order.
        background: run the shares on a worker thread (overlapped updates);
            otherwise ``step()`` applies them before it returns.
        in_backward: steps may be armed to start in the backward (Note [updates in
            backward]).
        tier: the store's tier (Note [memoryx] in runtime/memoryx.py); a disk tier's
            pages each share gives back when it is done.
        thread_init: what the worker thread runs first (the engine's
            ``DeviceOps.helper_thread_init``).
    """

    def __init__(
        self,
        unit_params: Sequence[Sequence[torch.nn.Parameter]],
        background: bool = True,
        tier=None,
        thread_init: Callable[[], None] | None = None,
        in_backward: bool = False,
    ):
        self._unit_params = [list(ps) for ps in unit_params]  # forward order
        self._background = background
        # The update may run apart from step()'s call (behind the next forward, or in
        # the backward): the mirrors are then written by the update (Note [host mirror]).
        self.apart = background or in_backward
        # A tier whose state lives in files (a disk store), else None: the update
        # pages the state in and out (_Pager).
        self._store = tier if tier is not None and tier.paged else None
        # Owner: this updater. Why: the host update of unit k must run while the
        # next forward computes units before k; one worker keeps the units in order.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread_init = thread_init  # Note [helper threads and OpenMP] in device.py
        self._lock = threading.Lock()
        self._unit_futures: list[list[concurrent.futures.Future]] = []  # per unit
        self._all: list[concurrent.futures.Future] = []
        self._early: _Early | None = (
            None  # a step armed for the backward (Note [updates in backward])
        )
        # Called with each share's parameters once they are updated, on the thread
        # that updated them (the streamer's mirrors: Note [host mirror] in mirror.py).
        self.on_updated: Callable[[list[torch.nn.Parameter]], None] | None = None
        self.name_of: Callable[[torch.Tensor], str] = lambda p: f"of shape {tuple(p.shape)}"

    def set_units(self, unit_params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        """The units of the traced plan, in its forward order (fixed at the first call)."""
        self.synchronize()
        self._unit_params = [list(ps) for ps in unit_params]

    # ---- scheduling ------------------------------------------------------------------

    def defer(self, optimizer) -> None:
        """Schedule ``optimizer``'s step by unit (see the Note)."""
        early, self._early = self._early, None
        if early is not None and early.optimizer is not optimizer:
            early = None  # armed for another optimizer: its shares are that one's
        if early is None:
            self.synchronize()  # a previous step must be complete before this one starts
            snapshot = [dict(g) for g in optimizer.param_groups]
        else:
            snapshot = early.snapshot  # the hyperparameters the early shares used
        taken: dict[int, torch.Tensor] = {}  # gradients of shares already submitted
        grads: dict[int, torch.Tensor] = {}
        if early is not None:
            for pid, g in early.grads.items():
                (taken if early.started[early.owner[pid]] else grads)[pid] = g
        # The update owns the gradients while it may run after step() returns; at the
        # step, in memory, p.grad stays (as after torch.optim's step()).
        at_step = not self._background and early is None and self._store is None
        for g in snapshot:
            for p in g["params"]:
                if p.grad is not None and id(p) not in taken:
                    grads[id(p)] = p.grad
                    if not at_step:
                        p.grad = None
        every = self._shares(snapshot, grads)
        if at_step:  # one share a device: the same kernels over its parameters at once
            by_device: dict[torch.device, list[torch.nn.Parameter]] = {}
            for p in (p for share in every for p in share):
                by_device.setdefault(p.device, []).append(p)
            every = list(by_device.values())
        grads.update(taken)
        pager = None
        if self._store is not None:
            pager = _Pager(self._store, optimizer, [p for share in every for p in share], grads)
        if not self._background and early is None:
            try:
                for share in every:
                    if share:
                        _apply(optimizer, snapshot, share, grads, pager, self.on_updated)
            finally:
                if pager is not None:
                    self._store.settle()  # step() returns with the masters current
            return
        # Behind step(): a parameter written in between must not be stepped (see the Note).
        check = None
        if self._background:
            check = ({id(p): p._version for share in every for p in share}, self.name_of)
        with self._lock:
            if early is None:
                self._unit_futures = [[] for _ in every]
                self._all = []
            for index, share in enumerate(every):
                if share:
                    self._submit(
                        index,
                        _apply,
                        optimizer,
                        snapshot,
                        share,
                        grads,
                        pager,
                        self.on_updated,
                        check,
                    )
        if not self._background:
            self.synchronize()  # step() returns with the step applied

    def _shares(self, snapshot, grads) -> list[list[torch.nn.Parameter]]:
        """The parameters with a gradient in ``grads``, by the first unit holding each (in
        forward order), then those of no unit."""
        claimed: set[int] = set()
        shares: list[list[torch.nn.Parameter]] = []
        for params in self._unit_params:
            mine = [p for p in params if id(p) in grads and id(p) not in claimed]
            claimed.update(id(p) for p in mine)
            shares.append(mine)
        rest = [p for g in snapshot for p in g["params"] if id(p) in grads and id(p) not in claimed]
        return [*shares, rest]

    def _submit(self, index: int, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the worker as part of unit ``index``'s share (lock held)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="weightstream-update",
                initializer=self._thread_init,
            )
        future = self._executor.submit(fn, *args)
        self._unit_futures[index].append(future)
        self._all.append(future)
        return future

    # ---- updates in the backward (Note [updates in backward]) -------------------------

    def arm(self, optimizer) -> None:
        """Let the coming backward start the shares of ``optimizer``'s next step."""
        self.synchronize()
        snapshot = [dict(g) for g in optimizer.param_groups]
        trainable = {id(p) for g in snapshot for p in g["params"] if p.requires_grad}
        owner: dict[int, int] = {}
        shares: list[list[torch.nn.Parameter]] = []
        for index, params in enumerate(self._unit_params):
            mine = [p for p in params if id(p) in trainable and id(p) not in owner]
            owner.update((id(p), index) for p in mine)
            shares.append(mine)
        with self._lock:
            self._unit_futures = [[] for _ in range(len(shares) + 1)]
            self._all = []
            self._early = _Early(optimizer, snapshot, owner, shares)

    def takes(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient of this backward goes to its update when final (an
        armed step whose share of ``p`` has not started): the disk store then leaves it
        where autograd put it (Note [updates in backward])."""
        early = self._early
        return early is not None and id(p) in early.owner and not early.started[early.owner[id(p)]]

    def gradient_final(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward is accumulated: take it, and submit its
        unit's share once every parameter of the share that has a gradient handed its
        over (called by the engine's post-accumulate-grad hook)."""
        early = self._early
        if early is None or id(p) not in early.owner or p.grad is None:
            return
        index = early.owner[id(p)]
        with self._lock:
            if early.started[index] or self._early is not early:
                return  # a second accumulation in one backward cannot happen; be safe
            early.grads[id(p)] = p.grad
            p.grad = None
            early.waiting[index].discard(id(p))
            if early.waiting[index]:
                return
            early.started[index] = True
            share = [q for q in early.shares[index] if id(q) in early.grads]
        pager = None
        in_memory = False
        if self._store is not None:
            pager = _Pager(self._store, early.optimizer, share, early.grads)
            in_memory = any(not self._store.holds(early.grads[id(q)]) for q in share)
        if in_memory and early.held is not None:
            pager.start_early()  # its first reads overlap the share still running
            # Host sync point: a disk store's gradients that skipped the files are
            # memory, so one share's at a time waits for its update (the bound).
            early.held.result()
        with self._lock:
            future = self._submit(
                index,
                _apply,
                early.optimizer,
                early.snapshot,
                share,
                early.grads,
                pager,
                self.on_updated,
            )
        if in_memory:
            early.held = future

    def disarm(self) -> bool:
        """Drop an armed step whose backward failed; True if some of its shares had
        started (they are waited for: the masters are then as they will stay)."""
        with self._lock:
            early, self._early = self._early, None
        started = early is not None and any(early.started)
        self.synchronize()
        return started

    # ---- waiting ----------------------------------------------------------------------

    def wait_unit(self, index: int) -> None:
        """Block until unit ``index``'s share of the pending step (and all before it) is done."""
        with self._lock:
            futures = [f for unit in self._unit_futures[: index + 1] for f in unit]
        for f in futures:
            f.result()  # host sync point; re-raises an error of the update

    def synchronize(self) -> None:
        """Block until the pending step is completely applied."""
        with self._lock:
            futures, self._all, self._unit_futures = self._all, [], []
        for f in futures:
            f.result()
        if self._store is not None:
            self._store.settle()  # the files' mappings read current data

    @property
    def pending(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._all)

    def close(self) -> None:
        self.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class _Early:
    """A step armed for the backward (Note [updates in backward])."""

    def __init__(self, optimizer, snapshot, owner, shares):
        self.optimizer = optimizer
        self.snapshot = snapshot  # the hyperparameters of the step
        self.owner = owner  # id(p) -> the unit whose share updates p
        self.shares = shares  # per unit, in forward order
        self.waiting = [{id(p) for p in share} for share in shares]  # gradients not handed over
        self.started = [False] * len(shares)
        self.grads: dict[int, torch.Tensor] = {}  # handed over, by id(p)
        self.held: concurrent.futures.Future | None = None  # the last share on in-memory grads


def _apply(
    optimizer, snapshot, share, grads, pager: _Pager | None = None, on_updated=None, check=None
) -> None:
    """Run the optimizer's update on ``share`` with the step's hyperparameters.

    The gradients travel in the groups (``GRADS_KEY``), never through ``p.grad``:
    the caller's thread owns ``p.grad`` again as soon as ``step()`` returns, and
    its ``zero_grad()`` must not race with this update. With a disk store the
    parameters whose master, gradient or state is in a file are updated one at a
    time on buffers read ahead by ``pager`` (Note [explicit disk I/O]); the
    others together, in place. ``on_updated(share)`` runs once they all are (the
    mirrors' write: Note [host mirror] in mirror.py). ``check``: the version counters
    at ``step()`` and a namer, for an update behind it (Note [overlapped updates]).
    """
    if pager is not None:
        pager.store.adopt_optimizer_state(optimizer, share)
    paged = pager.has if pager is not None else lambda _p: False
    in_files = [p for p in share if paged(p)]
    in_place = [p for p in share if not paged(p)]
    try:
        if check is not None:
            written = _written(share, *check)
            if written:
                if pager is not None:
                    pager.skip(in_files)
                raise written
        with torch.no_grad():
            if in_place:
                _update(optimizer, snapshot, in_place, grads)
            for p in in_files:
                pager.update(
                    p, lambda replaced, p=p: _update(optimizer, snapshot, [p], grads, replaced)
                )
            if on_updated is not None:
                on_updated(share)
    finally:
        if pager is not None:
            # Mapped files without a descriptor: pages back; consumed gradients dropped.
            pager.store.release([*in_place, *_state_tensors(optimizer, in_place)])
            pager.store.discard(grads[id(p)] for p in share)
        for p in share:
            grads[id(p)] = None  # consumed: a gradient in memory is freed now (the bound)


def _written(share, versions: dict[int, int], name_of) -> RuntimeError | None:
    """The error that stops an overlapped share whose parameters were written in place
    after ``step()``, before it updates any of them (Note [overlapped updates])."""
    written = [p for p in share if p._version != versions[id(p)]]
    if written:
        named = ", ".join(name_of(p) for p in written[:3]) + (" ..." if len(written) > 3 else "")
        return RuntimeError(
            f"weightstream: parameter(s) {named} were changed in place after "
            "optimizer.step() while overlap_updates was still applying that step to them; "
            "updating them now would step the written values, and eager PyTorch steps first. "
            "The step was not applied to their unit (the others were stepped): reload a "
            "checkpoint. Fix: call optimizer.synchronize() after optimizer.step() before "
            "reading or writing parameters, or compile with overlap_updates=False (Note "
            "[overlapped updates] in runtime/updater.py)."
        )
    return None


def _update(optimizer, snapshot, params, grads, replaced=None) -> None:
    """``optimizer._update`` on ``params`` alone, their gradients handed in the groups."""
    ids = {id(p) for p in params}
    mine = {id(p): grads[id(p)] for p in params}
    if replaced:
        mine.update(replaced)
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) in ids], GRADS_KEY: mine} for g in snapshot
    ]
    optimizer._update([g for g in groups if g["params"]])


class _Pager:
    """Reads each file-placed parameter's master, gradient and optimizer state into
    buffers ahead of its update, in update order, and writes the master and state
    back behind it (Note [explicit disk I/O] in runtime/diskio.py)."""

    AHEAD = 2  # parameters read ahead of the one being updated

    def __init__(self, store, optimizer, order, grads):
        self.store = store
        self._optimizer = optimizer
        self._grads = grads
        self._order = [p for p in order if self._files_of(p)]
        self._position = {id(p): i for i, p in enumerate(self._order)}
        self._next = 0  # index in _order of the next parameter to read
        self._started: dict[int, object] = {}  # id(p) -> its Paged
        self._skipped: set[int] = set()  # ids of parameters whose update does not run

    def _tensors(self, p) -> list[torch.Tensor]:
        return [p.data, self._grads[id(p)], *_state_tensors(self._optimizer, [p])]

    def _files_of(self, p) -> bool:
        return any(self.store.file_of(t) is not None for t in self._tensors(p))

    def has(self, p) -> bool:
        return id(p) in self._position

    def _start(self, wait: bool) -> bool:
        p = self._order[self._next]
        if id(p) in self._skipped:
            self._next += 1
            return True
        paged = self.store.page_in(self._tensors(p), wait=wait)
        if not paged.started:
            return False
        self._started[id(p)] = paged
        self._next += 1
        return True

    def start_early(self) -> None:
        """Start reading the first parameter's tensors now, before this pager's share
        runs, where the pool has room (Note [updates in backward]: one share at a
        time does this, one parameter's set, which the pool has room for beside the
        running share's)."""
        if self._next < len(self._order):
            self._start(wait=False)

    def skip(self, params) -> None:
        """Give back what was read for ``params``, whose update will not run, unwritten;
        those not read yet are passed over."""
        self._skipped.update(id(p) for p in params)
        for p in params:
            paged = self._started.pop(id(p), None)
            if paged is not None:
                paged.finish()

    def update(self, p, run) -> None:
        """Run ``p``'s update (``run(gradients by id)``) with its file-placed tensors
        replaced by their buffers, then write the master and state back."""
        while id(p) not in self._started:
            self._start(wait=True)  # in order: parameters before p were skipped
        paged = self._started.pop(id(p))
        limit = self._position[id(p)] + 1 + self.AHEAD
        while self._next < min(limit, len(self._order)) and self._start(wait=False):
            pass  # read ahead where the pool has room now
        state = self._optimizer.state.get(p, {})
        master = p.data
        swapped = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v in paged}
        written = [*swapped.values(), *([master] if master in paged else [])]
        ok = False
        try:
            if master in paged:
                p.data = paged.view(master)
            for k, v in swapped.items():
                state[k] = paged.view(v)
            run({id(p): paged.view(self._grads[id(p)])})
            ok = True
        finally:
            p.data = master
            state.update(swapped)
            paged.finish(written if ok else ())


def _state_tensors(optimizer, params) -> list[torch.Tensor]:
    return [
        v
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]

"""Overlapped host updates: an optimizer step run unit by unit behind the next forward.

Note [overlapped updates]
-------------------------
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

A parameter shared by several units (a tied embedding) is updated with the
first unit that holds it; one worker runs the shares in order, so waiting for a
unit's share also waits for every earlier share.

With a disk store (Note [disk tier] in runtime/store.py) the step is split by
unit the same way even without overlap (it then runs in the caller's thread),
and each unit's masters, gradients and optimizer state are given back to the
file right after its share, so an update never holds more than one unit's
state in memory.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence

import torch

from weightstream.optim._common import GRADS_KEY


class UnitUpdater:
    """Applies an optimizer step unit by unit: behind the next forward, or in place.

    Args:
        unit_params: each unit's master parameters, in forward order.
        background: run the shares on a worker thread (overlapped updates);
            otherwise ``step()`` applies them before it returns.
        store: a disk store whose pages each share gives back when it is done.
    """

    def __init__(
        self,
        unit_params: Sequence[Sequence[torch.nn.Parameter]],
        background: bool = True,
        store=None,
    ):
        self._unit_params = [list(ps) for ps in unit_params]  # forward order
        self._background = background
        self._store = store
        # Owner: this updater. Why: the host update of unit k must run while the
        # next forward computes units before k; one worker keeps the units in order.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._unit_futures: list[concurrent.futures.Future | None] = []
        self._all: list[concurrent.futures.Future] = []

    def set_units(self, unit_params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        """The units of the traced plan, in its forward order (fixed at the first call)."""
        self.synchronize()
        self._unit_params = [list(ps) for ps in unit_params]

    # ---- scheduling ------------------------------------------------------------------

    def defer(self, optimizer) -> None:
        """Schedule ``optimizer``'s step by unit (see the Note)."""
        self.synchronize()  # a previous step must be complete before this one starts
        snapshot = [dict(g) for g in optimizer.param_groups]
        grads: dict[int, torch.Tensor] = {}
        for g in snapshot:
            for p in g["params"]:
                if p.grad is not None:
                    grads[id(p)] = p.grad
                    p.grad = None
        claimed: set[int] = set()
        shares: list[list[torch.nn.Parameter]] = []
        for params in self._unit_params:
            mine = [p for p in params if id(p) in grads and id(p) not in claimed]
            claimed.update(id(p) for p in mine)
            shares.append(mine)
        rest = [p for g in snapshot for p in g["params"] if id(p) in grads and id(p) not in claimed]
        every = [*shares, rest]
        # The next non-empty share of each: read ahead while this one is updated.
        ahead: list[list[torch.nn.Parameter] | None] = [None] * len(every)
        following = None
        for i in reversed(range(len(every))):
            ahead[i] = following
            following = every[i] or following
        if not self._background:
            for share, nxt in zip(every, ahead):
                if share:
                    _apply(optimizer, snapshot, share, grads, self._store, nxt)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="weightstream-update"
            )
        with self._lock:
            self._unit_futures = []
            self._all = []
            for share, nxt in zip(every, ahead):
                future = (
                    self._executor.submit(
                        _apply, optimizer, snapshot, share, grads, self._store, nxt
                    )
                    if share
                    else None
                )
                self._unit_futures.append(future)
                if future is not None:
                    self._all.append(future)

    # ---- waiting ----------------------------------------------------------------------

    def wait_unit(self, index: int) -> None:
        """Block until unit ``index``'s share of the pending step (and all before it) is done."""
        with self._lock:
            futures = self._unit_futures[: index + 1]
        for f in reversed(futures):
            if f is not None:
                f.result()  # host sync point; re-raises an error of the update
                return

    def synchronize(self) -> None:
        """Block until the pending step is completely applied."""
        with self._lock:
            futures, self._all, self._unit_futures = self._all, [], []
        for f in futures:
            f.result()

    @property
    def pending(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._all)

    def close(self) -> None:
        self.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _apply(optimizer, snapshot, share, grads, store=None, ahead=None) -> None:
    """Run the optimizer's update on ``share`` with the step's hyperparameters.

    The gradients travel in the groups (``GRADS_KEY``), never through ``p.grad``:
    the caller's thread owns ``p.grad`` again as soon as ``step()`` returns, and
    its ``zero_grad()`` must not race with this update. With a disk store the
    next share's pages are read ahead while this one is updated, and this one's
    are given back after it (Note [disk tier]).
    """
    ids = {id(p) for p in share}
    mine = {id(p): grads[id(p)] for p in share}
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) in ids], GRADS_KEY: mine} for g in snapshot
    ]
    if store is not None:
        store.adopt_optimizer_state(optimizer, share)
        if ahead is not None:
            store.prefetch(_update_tensors(optimizer, ahead, grads))
    try:
        with torch.no_grad():
            optimizer._update([g for g in groups if g["params"]])
    finally:
        if store is not None:
            store.release([*share, *_state_tensors(optimizer, share)])
            # The gradients are consumed: their pages need never reach the disk.
            store.discard(mine.values())


def _state_tensors(optimizer, params) -> list[torch.Tensor]:
    return [
        v
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]


def _update_tensors(optimizer, params, grads) -> list[torch.Tensor]:
    """Everything an update of ``params`` reads: masters, gradients, optimizer state."""
    return [*params, *(grads[id(p)] for p in params), *_state_tensors(optimizer, params)]

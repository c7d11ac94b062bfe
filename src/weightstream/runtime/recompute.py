"""Activation checkpointing per streaming unit: a unit's forward recomputed in its backward.

Note [activation checkpointing]
-------------------------------
With ``activation_checkpointing``, each chosen unit's call runs under the
library's non-reentrant checkpoint, ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``, used as it is: the forward keeps only the call's
inputs; when autograd first needs a tensor the call saved, the checkpoint
re-runs the call and hands out the recomputed tensors. What makes it fit the
streamer (Note [streaming and autograd] in streamer.py):

* Where it wraps. The checkpointed function must hold the unit's whole window
  (fetch, the device copies swapped into the parameter slots, the module's own
  ``forward``, the masters swapped back), so that the recompute runs on a
  fresh device copy as the first run did. A forward pre-hook cannot do that: it
  returns before ``forward`` runs and cannot put the call inside a function of
  its own. So the unit's module gets, on the instance, a ``forward`` of ours
  (:class:`UnitForward`) that runs the module's own ``forward`` inside the
  checkpoint. Nothing of torch is patched: it is one attribute of the user's
  module instance, which ``nn.Module.__call__`` looks up anyway; ``remove()``
  puts the previous one back, and a deep copy of the module (the meta-device
  trace) gets the module's own ``forward``, not ours. The streamer installs no
  forward hooks on such a unit (the wrapper opens and closes its window), so the
  module's other forward hooks run outside the window, as its pre-hooks always
  did, and once per call: the recompute re-runs ``forward`` only.
* Saved tensors. Saved-tensors hooks do not nest: inside the checkpointed call
  only the checkpoint's hooks run, so the streamer's pack hook sees nothing and
  the checkpoint keeps no weight (it records metadata only). The call's inputs
  are saved by the checkpoint *outside* its own hooks, through the streamer's:
  an input that is a view of a streamed weight (a parameter passed as an
  argument) is rebuilt from a backward fetch like any saved weight. Every tensor
  in the arguments, keyword arguments and plain tuples, lists and dicts
  included, is handed to the checkpoint as a positional input, so every one is
  saved that way and the RNG state of its device is preserved.
* Gradients. The non-reentrant checkpoint backpropagates through the graph of
  the first run; the recompute only supplies saved tensors, its own graph is
  dropped. Gradients therefore reach the masters through the first run's
  ``_StreamIn`` exactly as without checkpointing, and the unit's backward end is
  noted there as before. The recompute goes through ``_StreamIn`` as well (with
  nothing to note), because which tensors an operator saves depends on which of
  its inputs require grad.
* Which window. Each checkpointed call remembers the (sequence, position) its
  first run entered (``_Region`` in streamer.py); the recompute fetches that
  position's backward copy (or takes the one the backward prefetched), swaps it
  in, and closes the window when the call ends, normally or by the checkpoint's
  early stop (an exception once every needed tensor is recomputed). The
  recomputed weight views are held by the checkpoint until the backward
  consumes them: one unit's weights, plus the prefetch of the next positions to
  recompute; design invariant 2 holds unchanged.
* RNG and buffers. The checkpoint restores the first run's CPU and device RNG
  state before recomputing and the surrounding state afterwards, so dropout
  draws the same numbers and later draws are unchanged. A forward's own state
  changes must happen once, as in eager PyTorch: the buffers of the unit's
  subtree that a recompute changes (BatchNorm's running statistics) are put back
  after it. A forward whose result depends on a buffer it changes recomputes
  from the changed value (BatchNorm in training mode normalizes by the batch's
  statistics, so its recompute is exact). Other side effects of a forward
  happen again in its recompute: a transformers layer appends to the key/value
  cache it is given, which then holds every position twice (the attention's
  shapes no longer match). So a call with grad enabled of a model with
  checkpointed units gets ``use_cache=False`` (:func:`without_cache`), as
  transformers' own gradient checkpointing sets it in training, with a warning
  where the caller asked for the cache.
* Which units. A unit whose window encloses other units (pinned) is not
  checkpointed: recomputing it would re-run every unit inside it, a second
  streaming forward inside the backward; the units inside are checkpointed
  themselves. Nor is a unit whose forward reads a weight it does not hold (one
  of an enclosing unit; the trace shows it): during its recompute the enclosing
  window is closed and it would read the host master. Without a trace every
  unit that is not pinned is checkpointed (such a read then gets the master: the
  same values in fp32 on the CPU; elsewhere the checkpoint's check of the
  recomputed tensors' dtype and device reports it). With grad disabled (eval,
  no_grad) a unit runs as without checkpointing.
* Cost: one more forward of the checkpointed units, one more fetch of each unit
  whose backward would not fetch it otherwise (an embedding saves no weight,
  but is fetched again to recompute its forward), and a copy of the unit's
  buffers while it is recomputed.

Layer pipelined (everything resident) checkpoints the same units of the plan
the same settings give, built from the module structure (:func:`checkpoint_units`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.partition import Plan, build_plan
from weightstream.runtime.trace import Trace

_ABSENT = object()

# One checkpointed call: ``call(first, *args, **kwargs)``, ``first`` False in a recompute.
Call = Callable[..., Any]
# What a UnitForward runs: ``run(inner_forward, args, kwargs)``.
Run = Callable[[Callable[..., Any], tuple, dict], Any]


class UnitForward:
    """Our ``forward`` on one module instance (Note [activation checkpointing]).

    Owner: the streamer, or layer pipelined's compiled module, whose ``remove()``
    undoes it. Once removed it only calls the module's own forward (a reference
    someone kept still works).
    """

    def __init__(self, module: nn.Module, run: Run):
        self.module = module
        self._previous = module.__dict__.get("forward", _ABSENT)
        self.inner = module.forward  # the module's own (bound), or one set before ours
        self.__wrapped__ = self.inner  # inspect.signature(module.forward) sees the real one
        self._run: Run | None = run
        module.forward = self

    def __call__(self, *args, **kwargs):
        if self._run is None:
            return self.inner(*args, **kwargs)
        return self._run(self.inner, args, kwargs)

    def remove(self) -> None:
        self._run = None
        if self.module.__dict__.get("forward") is self:
            if self._previous is _ABSENT:
                del self.module.forward
            else:
                self.module.forward = self._previous

    def __deepcopy__(self, memo: dict):
        # The copy of the module runs its own forward: the checkpointing (and the
        # streaming it drives) belongs to this module only.
        return copy.deepcopy(self.inner, memo)


def _is_leaf(x: Any) -> bool:
    # Plain containers only: a registered pytree class (a transformers Cache) must
    # reach the module as the very object the caller passed.
    return type(x) not in (tuple, list, dict)


def checkpointed(module: nn.Module, call: Call, args: tuple, kwargs: dict) -> Any:
    """``call(True, *args, **kwargs)`` under the non-reentrant checkpoint; each
    recompute runs ``call(False, ...)`` (Note [activation checkpointing])."""
    leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=_is_leaf)
    ran = False

    def run(*leaves):
        nonlocal ran
        a, k = pytree.tree_unflatten(list(leaves), spec)
        if not ran:
            ran = True
            return call(True, *a, **k)
        kept = _keep_buffers(module)
        try:
            return call(False, *a, **k)
        finally:
            _put_back(kept)

    return checkpoint(run, *leaves, use_reentrant=False)


def _keep_buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    """The buffers of ``module``'s subtree before a recompute, with a copy of their values."""
    return [
        (m, name, b, b.clone())
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]


def _put_back(kept) -> None:
    """Undo what a recompute did to the buffers (BatchNorm's running statistics): the
    first run changed them already. Only changed values are written, so a buffer
    saved for another unit's backward keeps its version (autograd checks it);
    batch_norm updates its statistics without bumping the version, so the values
    are compared, bit for bit."""
    with torch.no_grad():
        for m, name, buffer, value in kept:
            m._buffers[name] = buffer
            if not _same_bits(buffer, value):
                buffer.copy_(value)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes(a), _bytes(b))  # NaN equals NaN here


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def recomputed_units(plan: Plan, trace: Trace | None) -> set[int]:
    """Indices of the units whose forward is recomputed: those not pinned that read
    only weights they hold (Note [activation checkpointing])."""
    held = {id(u.module): u for u in plan.units if not u.pinned}
    own = {mid: {id(p) for p in u.params} for mid, u in held.items()}
    reads_outside: set[int] = set()
    if trace is not None:
        for pid, stacks in trace.uses.items():
            for stack in stacks:
                reads_outside.update(m for m in stack if m in own and pid not in own[m])
    return {u.index for mid, u in held.items() if mid not in reads_outside}


def without_cache(module: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` for a call with grad enabled of ``module`` whose units are recomputed:
    a transformers model's key/value cache off (Note [activation checkpointing])."""
    config = getattr(module, "config", None)
    asked = kwargs.get("use_cache")
    if not torch.is_grad_enabled() or not (asked or getattr(config, "use_cache", False)):
        return kwargs
    if asked:
        warnings.warn(
            "weightstream: use_cache=True is ignored while activation checkpointing "
            "recomputes the model's layers (a recompute would append to the key/value "
            "cache again); this call runs with use_cache=False, as transformers' gradient "
            "checkpointing does. Fix: leave use_cache out of training calls.",
            stacklevel=3,
        )
    return {**kwargs, "use_cache": False}


def checkpoint_units(module: nn.Module, config: StreamingConfig) -> list[UnitForward]:
    """Layer pipelined: checkpoint the units of ``module``'s structural plan (nothing
    streams; the weights stay resident). Returns the wrappers, for ``remove()``."""
    plan = build_plan(module, config)
    chosen = recomputed_units(plan, None)
    return [UnitForward(u.module, _resident_run(u.module)) for u in plan.units if u.index in chosen]


def _resident_run(module: nn.Module) -> Run:
    def run(inner, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpointed(module, lambda _first, *a, **k: inner(*a, **k), args, kwargs)

    return run

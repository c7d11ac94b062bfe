"""Loading a state dict into a model the engine holds, one tensor at a time.

Note [bounded loads]
--------------------
A model trained from a disk store can be larger than the host's memory, so
putting a checkpoint back (a resume, an evaluation, a warm start) must never
hold the whole model, neither the values read nor the store's pages written.
The seed's recipe is plain PyTorch::

    state = cstorch.load(path)                       # lazy
    model.load_state_dict(state["model"])            # torch's nn.Module method
    optimizer.load_state_dict(state["optimizer"])

Three pieces keep it bounded, with no change to what the caller sees:

* ``cstorch.load`` in lazy mode returns each tensor as a copy-on-write view of
  the file (Note [fast reads]), reading (and checksumming) it page by page
  and giving the pages back: torch's ``load_state_dict`` first copies the
  whole mapping into an ``OrderedDict``, which then costs address space, not
  memory.
* The engine registers :func:`copy_then_release` as a load pre-hook on every
  module that holds parameters or persistent buffers. torch calls it for each
  module in turn, just before that module's own copies: it copies each
  tensor, gives back the pages of both sides (``common.pages.release_pages``:
  a disk store's file writes back, the checkpoint view is reclaimed) and puts
  the destination itself in the entry, so that torch's own ``copy_`` is a
  copy onto itself, which ATen skips. Everything torch checks (missing and
  unexpected keys, shapes, ``strict``) is untouched: entries the hook does not
  handle (a wrong shape, ``assign=True``) are left for torch to copy or report.
* The optimizer's ``load_state_dict`` (``optim/optimizer.py``) reads shapes
  from the file's metadata, and copies and releases state tensor by tensor.

Peak memory of a load is then what the store holds resident under
``host_memory_budget`` plus about one tensor (tests/test_bounded_loads.py).
"""

from __future__ import annotations

import torch
from torch import nn

from weightstream.common.pages import release_pages
from weightstream.runtime.sharding import is_placeholder


def _own_tensors(module: nn.Module):
    """(name, tensor) of the parameters and persistent buffers ``module`` holds itself."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def holds_tensors(module: nn.Module) -> bool:
    return next(_own_tensors(module), None) is not None


def copy_then_release(
    module, state_dict, prefix, local_metadata, _strict, _missing, _unexpected, _errors
) -> None:
    """Load pre-hook: copy this module's own entries now, one at a time (Note [bounded loads])."""
    if local_metadata.get("assign_to_params_buffers"):
        return  # the caller asked for the checkpoint's tensors themselves
    if torch.__future__.get_swap_module_params_on_conversion():
        return  # torch swaps tensors instead of copying
    with torch.no_grad():
        for name, target in _own_tensors(module):
            key = prefix + name
            value = state_dict.get(key)
            if (
                not isinstance(value, torch.Tensor)
                or value is target
                or value.is_meta
                or target.is_meta
                or value.shape != target.shape
                or is_placeholder(target)
            ):
                continue  # torch copies it, or reports what is wrong
            target.copy_(value)
            release_pages([target, value])
            state_dict[key] = target  # torch's copy_ onto itself is skipped

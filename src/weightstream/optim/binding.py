"""How an optimizer reaches the engine that holds its parameters.

Note [engine binding]
---------------------
In weight streaming the parameters an optimizer updates are the masters of one
engine's store (``runtime.engine.StreamingEngine``): the engine decides where a
state tensor lives (host memory, a disk-store file, nowhere on a rank that
does not own the parameter), applies the update unit by unit, and knows whether
the gradients are spread over the ranks (a sharded store). Layers below the
runtime (this package, ``amp``) must not import it, so they speak to it
through :class:`ParameterHost`, a protocol the engine implements.

An optimizer is bound once: at construction, to the compiled engine holding
its parameters, or, for an optimizer built before ``cstorch.compile``, at its
first ``step()`` / ``state_dict()``. From then on every path goes through
``optimizer.engine``: the GradScaler and ``optimizer_step`` ask it for the
global gradient norm, the trainer and the checkpoint code for the state.
Finding the engine is the only search, and it asks each live engine (a short
list, one per compiled model) whether it holds a parameter; nothing global is
keyed by a parameter.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

import torch

from weightstream.common.hosts import hosts

__all__ = ["ParameterHost", "StateSizes", "hosts", "placing_state", "zeros_like"]


class ParameterHost(Protocol):
    """What an optimizer, a GradScaler and the step code need of a streaming engine."""

    #: The gradients of the whole model are spread over the ranks (a sharded
    #: store: each rank holds the gradients of the parameters it owns).
    grads_sharded: bool

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of this engine's parameters."""
        ...

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank adds ``p``'s gradient to a whole-model norm summed over the
        ranks (with ``grads_sharded``: each gradient on one rank)."""
        ...

    def state_zeros_like(
        self,
        p: torch.Tensor,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        """Zeros for ``p``'s optimizer state where the engine keeps it (``p``'s shape and
        dtype unless given: compact state, Note [compact optimizer state]), or None for
        an ordinary tensor."""
        ...

    def bind_optimizer(self, optimizer) -> None:
        """Take ``optimizer``'s state into the engine's placement (idempotent)."""
        ...

    def plan_state(self, state_bytes: dict[torch.Tensor, list[int]]) -> None:
        """The bytes of each parameter's state tensors, as the optimizer about to create
        them will: the engine places them by these sizes (Note [engine binding])."""
        ...

    def apply_step(self, optimizer) -> None:
        """Apply ``optimizer``'s update to the masters, now or unit by unit."""
        ...

    def synchronize(self) -> None:
        """Wait until an update still being applied is complete."""
        ...

    def update_in_backward(self, optimizer) -> contextlib.AbstractContextManager:
        """A context for the step's last backward in which each unit's share of
        ``optimizer``'s next step may start once its gradients are final (the caller
        guarantees ``step()`` follows with nothing global in between)."""
        ...

    def finish_gradients(self) -> None:
        """Wait until every gradient reduction of the step has landed."""
        ...

    def gradients_rewritten(self, params: list[torch.Tensor]) -> None:
        """The gradients of ``params`` were rewritten in place by an operation that saw
        the whole model's gradients (unscaling, clipping by the global norm or by value)."""
        ...

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the data-parallel ranks."""
        ...

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The elementwise largest value of ``value`` over the data-parallel ranks."""
        ...

    def gather_optimizer_state(self, optimizer, state: dict) -> dict:
        """``state`` (``optimizer.state_dict()``) with every rank's shard filled in."""
        ...

    def load_optimizer_state(self, optimizer, state: dict, load) -> None:
        """Run ``load(state, skip=...)``, the optimizer's loader, skipping the state of
        parameters owned elsewhere."""
        ...


# While an optimizer creates its state: the engine that places it (Note [engine binding]).
_placing: contextvars.ContextVar[ParameterHost | None] = contextvars.ContextVar(
    "weightstream_placing", default=None
)


@contextlib.contextmanager
def placing_state(host: ParameterHost | None) -> Iterator[None]:
    """State created inside this block (``zeros_like``) goes where ``host`` keeps it."""
    token = _placing.set(host)
    try:
        yield
    finally:
        _placing.reset(token)


class StateSizes:
    """Stands in for an engine while an optimizer's state is made on the meta device:
    places nothing, counts each state tensor's bytes by parameter."""

    def __init__(self) -> None:
        self.sizes: dict[int, list[int]] = {}  # id(parameter) -> bytes of each tensor

    def state_zeros_like(self, p, dtype=None, shape=None) -> torch.Tensor:
        t = torch.empty(p.shape if shape is None else shape, dtype=dtype or p.dtype, device="meta")
        self.sizes.setdefault(id(p), []).append(t.nbytes)
        return t


def zeros_like(
    p: torch.Tensor,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A zero state tensor for ``p``, placed by the engine creating state now, if any.

    ``dtype`` and ``shape`` default to ``p``'s; compact state (Note [compact
    optimizer state] in optim/compact.py) asks for others: int8 codes shaped like
    ``p``, one fp32 scale per block. A disk store gives a tensor in its files
    (Note [disk tier]); a sharded store gives a storage-free placeholder for a
    parameter another rank owns (Note [sharded store]); otherwise an ordinary
    tensor.
    """
    host = _placing.get()
    if host is not None:
        placed = host.state_zeros_like(p, dtype, shape)
        if placed is not None:
            return placed
    if shape is None:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return torch.zeros(shape, dtype=dtype or p.dtype, device=p.device)

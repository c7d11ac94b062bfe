"""One streaming unit at run time, and the device copies of its weights."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from weightstream.common.flat import unflatten_views
from weightstream.runtime.device import Transfer
from weightstream.runtime.partition import UnitSpec


class WeightState(enum.Enum):
    """Where one copy of a unit's weights is, and what it costs in device memory.

    IN_STORE: only the host master exists; 0 device bytes.
    IN_FLIGHT: a device buffer is allocated and a copy into it was issued; the
        unit's full device bytes are in use, the values are not yet usable.
    RESIDENT: the copy finished and the buffer is usable; full device bytes.

    Changed only by ``UnitCopy.fetch()`` (IN_STORE -> IN_FLIGHT),
    ``UnitCopy.wait()`` (IN_FLIGHT -> RESIDENT) and ``UnitCopy.evict()``
    (any -> IN_STORE).
    """

    IN_STORE = "in_store"
    IN_FLIGHT = "in_flight"
    RESIDENT = "resident"


@dataclass
class StreamingUnit:
    """A unit of the plan with the layout of its device copies.

    The parameters are grouped by their compute dtype; each group is copied into
    one flat device buffer, and each parameter's device tensor is a view of it.
    A saved tensor that is a view of such a buffer can therefore be rebuilt
    exactly from a fresh copy with ``as_strided`` (see Note [streaming and autograd]).
    """

    spec: UnitSpec
    # dtype -> indices into spec.params, in order
    groups: dict[torch.dtype, list[int]] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: UnitSpec, compute_dtype_of) -> StreamingUnit:
        unit = cls(spec)
        for i, p in enumerate(spec.params):
            unit.groups.setdefault(compute_dtype_of(p), []).append(i)
        return unit

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.spec.params

    def device_bytes(self) -> int:
        return sum(
            sum(self.spec.params[i].numel() for i in idx) * torch.empty((), dtype=dt).element_size()
            for dt, idx in self.groups.items()
        )


class UnitCopy:
    """One copy of a unit's weights on the device (a forward or a backward fetch)."""

    def __init__(self, unit: StreamingUnit):
        self.unit = unit
        self.state = WeightState.IN_STORE
        self._transfer: Transfer | None = None
        self.buffers: list[torch.Tensor] | None = None  # one flat buffer per dtype group
        self.tensors: list[torch.Tensor] | None = None  # per unit param, views of buffers

    def fetch(self, transfer: Transfer) -> None:
        assert self.state is WeightState.IN_STORE
        self._transfer = transfer
        self.state = WeightState.IN_FLIGHT

    def wait(self) -> list[torch.Tensor]:
        if self.state is WeightState.IN_FLIGHT:
            buffers = self._transfer.wait()
            self._transfer = None
            self.buffers = buffers
            self.tensors = [None] * len(self.unit.params)  # type: ignore[list-item]
            for buf, idx in zip(buffers, self.unit.groups.values()):
                views = unflatten_views(buf, [self.unit.params[i] for i in idx])
                for i, view in zip(idx, views):
                    self.tensors[i] = view
            self.state = WeightState.RESIDENT
        assert self.state is WeightState.RESIDENT, f"wait() on a copy in state {self.state}"
        return self.tensors  # type: ignore[return-value]

    def evict(self) -> None:
        """Drop this copy's device memory (the buffers die once nobody else holds them)."""
        self._transfer = None
        self.buffers = None
        self.tensors = None
        self.state = WeightState.IN_STORE

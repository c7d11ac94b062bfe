"""The live streaming engines of this process: the registry an optimizer finds its engine
in (Note [engine binding] in ``optim/binding.py``), and a step closure the engines whose
weights it is given.

In ``common`` so that every layer may ask it. It knows an engine only as a
:class:`Host`: an object that says whether it holds a tensor and waits for its updates.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import torch


class Host(Protocol):
    """What the registry needs of an engine (``optim.binding.ParameterHost`` is one)."""

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of this engine's parameters."""
        ...

    def synchronize(self) -> None:
        """Wait until an update still being applied is complete."""
        ...


class _Hosts:
    """The live engines, in creation order; held weakly (an engine dies with its model)."""

    def __init__(self) -> None:
        self._hosts: weakref.WeakSet = weakref.WeakSet()

    def add(self, host: Host) -> None:
        self._hosts.add(host)

    def discard(self, host: Host) -> None:
        self._hosts.discard(host)

    def holding(self, params: Iterable[torch.Tensor]) -> Host | None:
        """The engine holding any of ``params``; an error if they span two."""
        params = list(params)
        found = None
        for host in list(self._hosts):
            if any(host.holds(p) for p in params):
                if found is not None:
                    raise ValueError(
                        "an optimizer's parameters belong to two compiled models; build one "
                        "optimizer per compiled model."
                    )
                found = host
        return found

    def settle(self, tensors: Iterable[object]) -> None:
        """Wait for the updates of every engine holding one of ``tensors`` (other objects
        are passed over): its weights are then the step's, not being written by an
        overlapped update (Note [overlapped updates] in runtime/updater.py)."""
        found = [t for t in tensors if isinstance(t, torch.Tensor)]
        for host in list(self._hosts) if found else ():
            if any(host.holds(t) for t in found):
                host.synchronize()


#: Engines register here when they are built (runtime/engine.py) and leave when closed.
hosts = _Hosts()

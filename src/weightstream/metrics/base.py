"""``Metric``: the base of every evaluation metric.

Note [metric state]
-------------------
A metric's whole state is a handful of *accumulators*: tensors registered as
persistent buffers, each of which is a plain sum over the tokens seen by
``update()``. Three properties follow, and every metric in this package keeps
them:

* **Checkpointable.** The buffers are in ``state_dict()``, so an evaluation can
  be saved and resumed (``load_state_dict``) and continues exactly.
* **Data parallel.** A sum over all ranks' data is the sum of each rank's sum, so
  a trainer all-reduces (SUM) every tensor of :meth:`Metric.accumulators` and
  gets the state of one metric that saw the whole batch. No metric keeps a max,
  a count of updates or anything else that would not sum.
* **No precision loss.** Accumulators are float64: counts stay exact up to 2**53
  tokens, and weighted sums over millions of tokens do not drift the way a
  float32 running sum does.

``compute()`` turns the accumulators into the metric's value (a 0-d float64
tensor on the metric's device) without changing them; ``reset()`` zeroes them.
Before any token with positive weight has been seen, ``compute()`` returns nan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from weightstream.metrics.registry import default_registry


class Metric(torch.nn.Module, ABC):
    """Base class of the metrics: an ``nn.Module`` with ``reset`` / ``update`` / ``compute``.

    Calling the metric (``metric(labels=..., predictions=...)``) runs
    ``update`` then ``compute`` and returns the value accumulated since the last
    ``reset()`` (not the value of that batch alone). ``float(metric)`` returns the
    current value as a Python float (a host sync).

    To write a metric: create accumulators in ``__init__`` with
    :meth:`add_accumulator`, add to them in ``update``, and read them in
    ``compute`` (see Note [metric state] in this module).

    Args:
        name: Name under which the metric is logged; defaults to the class name.
            Need not be unique (see :class:`~weightstream.metrics.registry.MetricRegistry`).
        compute_on_system: Where the reference computes the metric: on the
            compute system (True; required there in weight-streaming mode) or on
            the host. Here ``update`` always runs on the device that holds the
            metric's buffers (move the metric with ``.to(device)`` next to the
            model; inputs on another device are copied there). The flag is kept
            as ``self.compute_on_system`` for the runtime, which decides placement.

    Every metric registers itself, weakly, in
    :data:`~weightstream.metrics.registry.default_registry`, so a trainer can list
    all live metrics with :func:`~weightstream.metrics.get_all_metrics`.
    """

    def __init__(self, name: str | None = None, compute_on_system: bool = True) -> None:
        super().__init__()
        cls = type(self).__name__
        if name is None:
            name = cls
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{cls}: name must be a non-empty string, got {name!r}; "
                f'pass e.g. {cls}("eval/{cls.lower()}").'
            )
        if not isinstance(compute_on_system, bool):
            raise TypeError(
                f"{cls}: compute_on_system must be True or False, got {compute_on_system!r}."
            )
        self.name = name
        self.compute_on_system = compute_on_system
        # Names of the accumulator buffers, in creation order (see accumulators()).
        self._accumulator_names: list[str] = []
        default_registry.add(self)

    # -- state -------------------------------------------------------------------------

    def add_accumulator(
        self, name: str, shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Create a zero accumulator: a persistent buffer that ``update`` adds to.

        It must only ever be *added to*, so that summing it across data-parallel
        ranks is correct (Note [metric state]).
        """
        assert name not in self._accumulator_names, f"accumulator {name!r} already exists"
        self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=True)
        self._accumulator_names.append(name)
        return getattr(self, name)

    def accumulators(self) -> list[torch.Tensor]:
        """The state tensors to all-reduce (SUM) across data-parallel ranks.

        After ``torch.distributed.all_reduce(t)`` on each of them (in place, same
        order on every rank), ``compute()`` on any rank gives the value over all
        ranks' data. The list is in a fixed order and holds the buffers
        themselves, not copies.
        """
        return [getattr(self, name) for name in self._accumulator_names]

    @property
    def device(self) -> torch.device:
        """The device that holds the metric's state (where ``update`` computes)."""
        accumulators = self.accumulators()
        return accumulators[0].device if accumulators else torch.device("cpu")

    # -- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything seen so far: zero every accumulator."""
        with torch.no_grad():
            for tensor in self.accumulators():
                tensor.zero_()

    @abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add one batch to the state."""

    @abstractmethod
    def compute(self) -> torch.Tensor:
        """The metric's value over everything since the last ``reset()`` (0-d tensor)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update(*args, **kwargs)``, then return ``compute()``."""
        self.update(*args, **kwargs)
        return self.compute()

    def __float__(self) -> float:
        # Host sync: the value is copied from the metric's device.
        return float(self.compute())

    def extra_repr(self) -> str:
        return f"name={self.name!r}"

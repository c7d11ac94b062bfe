"""The registry of live metrics, so a trainer can find every metric the user created.

The reference API lets a script create metrics anywhere (module level, inside the
model, in the evaluation loop) and then logs all of them at the end of an eval
run. The registry is what makes that possible without the user handing each
metric to the trainer.

It holds its metrics *weakly*: a metric the user no longer references is dropped
from the registry when it is garbage collected, so creating metrics in a loop
(or in many tests) never leaks them and never logs a stale one.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightstream.metrics.base import Metric


class MetricRegistry:
    """Weak, creation-ordered collection of :class:`Metric` objects.

    Names need not be unique; :meth:`items` disambiguates repeated names the way
    the reference does (``"accuracy.0"``, ``"accuracy.1"``).
    """

    def __init__(self) -> None:
        # Keys are a creation counter, so the dict's insertion order is creation
        # order; values are held weakly (see the module docstring).
        self._metrics: weakref.WeakValueDictionary[int, Metric] = weakref.WeakValueDictionary()
        self._counter = itertools.count()

    def add(self, metric: Metric) -> None:
        """Register ``metric`` (called by ``Metric.__init__``)."""
        self._metrics[next(self._counter)] = metric

    def metrics(self) -> list[Metric]:
        """The live metrics, oldest first."""
        return list(self._metrics.values())

    def items(self) -> list[tuple[str, Metric]]:
        """``(unique_name, metric)`` pairs, oldest first.

        A name used by one live metric is returned as is; a name shared by ``n``
        live metrics is suffixed ``.0`` ... ``.n-1`` in creation order.
        """
        live = self.metrics()
        counts = Counter(metric.name for metric in live)
        seen: Counter[str] = Counter()
        pairs = []
        for metric in live:
            if counts[metric.name] == 1:
                pairs.append((metric.name, metric))
            else:
                pairs.append((f"{metric.name}.{seen[metric.name]}", metric))
                seen[metric.name] += 1
        return pairs

    def __len__(self) -> int:
        return len(self._metrics)

    def __contains__(self, metric: object) -> bool:
        return any(m is metric for m in self._metrics.values())


# The one registry every Metric registers with. It is the only process-wide state
# of the metrics package, and it owns nothing: entries vanish with their metrics.
default_registry = MetricRegistry()


def get_all_metrics() -> list[tuple[str, Metric]]:
    """All live metrics as ``(unique_name, metric)`` pairs, oldest first.

    See :meth:`MetricRegistry.items` for how repeated names are made unique.
    """
    return default_registry.items()

"""The weighted mean of a stream of values (e.g. an eval loss)."""

from __future__ import annotations

from typing import Any

import torch

from weightstream.metrics._inputs import as_tensor, effective_weights
from weightstream.metrics.base import Metric


class MeanMetric(Metric):
    """``sum(w * values) / sum(w)`` over every value with weight ``w > 0``.

    Args: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(self, name: str | None = None, compute_on_system: bool = True) -> None:
        super().__init__(name, compute_on_system)
        self.add_accumulator("total_value")  # sum of w * value
        self.add_accumulator("total_weight")  # sum of w

    @torch.no_grad()
    def update(self, values: Any, weights: Any = None) -> None:
        """Add ``values`` (a number or a tensor of any shape ``S``), each with weight 1
        or with ``weights`` (broadcastable to ``S``)."""
        metric = type(self).__name__
        values = as_tensor(values, "values", metric, self.device).to(torch.float64)
        w = effective_weights(metric, weights, values.shape, self.device)
        self.total_value.add_((w * values).sum())
        self.total_weight.add_(w.sum())

    def compute(self) -> torch.Tensor:
        return self.total_value / self.total_weight  # 0/0 = nan before any value

"""Ranking metrics: precision and recall of the top-k predicted classes.

Shapes, for both metrics (``*B`` is any batch shape, usually ``(batch,)``):

* ``predictions``: ``[*B, num_classes]`` scores (logits or probabilities); the k
  highest of each row are the row's predicted classes.
* ``labels``: ``[*B, num_labels]`` relevant class ids per row, or ``[*B]`` for
  one relevant class per row. Ids outside ``[0, num_classes)`` (such as -1) are
  padding, for rows with fewer relevant classes: they are neither hits nor
  misses. A row's ids are assumed distinct.
* ``weights``: ``None`` (all 1), or broadcastable to ``[*B]``: one weight per
  row; rows with weight <= 0 do not count.

Precision@k = sum(w * hits) / sum(w * k); Recall@k = sum(w * hits) / sum(w *
relevant), where ``hits`` is the number of a row's relevant classes among its
top k and ``relevant`` the number of its (non-padding) labels.
"""

from __future__ import annotations

from typing import Any

import torch

from weightstream.metrics._inputs import as_tensor, check_positive_int, effective_weights
from weightstream.metrics.base import Metric


class _TopKMetric(Metric):
    """Shared state and update of Precision@k and Recall@k (module docstring)."""

    def __init__(self, k: int, name: str | None = None, compute_on_system: bool = True) -> None:
        self.k = check_positive_int(type(self).__name__, "k", k)
        super().__init__(name, compute_on_system)
        self.add_accumulator("total_hits")  # sum of w * hits
        self.add_accumulator("total_retrieved")  # sum of w * k
        self.add_accumulator("total_relevant")  # sum of w * relevant

    @torch.no_grad()
    def update(self, labels: Any, predictions: Any, weights: Any = None) -> None:
        """Add a batch (shapes in the module docstring)."""
        metric = type(self).__name__
        labels = as_tensor(labels, "labels", metric, self.device)
        predictions = as_tensor(predictions, "predictions", metric, self.device)
        if predictions.dim() == 0:
            raise ValueError(
                f"{metric}.update(): predictions must have a class dimension "
                "[..., num_classes], got a scalar."
            )
        num_classes = predictions.shape[-1]
        if self.k > num_classes:
            raise ValueError(
                f"{metric}.update(): k={self.k} is more than the {num_classes} classes of "
                "predictions (its last dimension); use k <= num_classes."
            )
        if labels.is_floating_point() or labels.is_complex():
            raise TypeError(
                f"{metric}.update(): labels must hold integer class ids, got dtype {labels.dtype}."
            )
        if labels.dim() == predictions.dim() - 1:
            labels = labels.unsqueeze(-1)  # one relevant class per row
        if labels.shape[:-1] != predictions.shape[:-1]:
            raise ValueError(
                f"{metric}.update(): labels has shape {tuple(labels.shape)} and predictions "
                f"{tuple(predictions.shape)}; labels must be [*B, num_labels] or [*B] for "
                "predictions [*B, num_classes] (the same batch shape *B)."
            )
        w = effective_weights(metric, weights, predictions.shape[:-1], self.device)

        top_k = torch.topk(predictions, self.k, dim=-1).indices  # [*B, k]
        valid = (labels >= 0) & (labels < num_classes)  # [*B, L], False for padding
        # match[..., l, j]: label l is the j-th top prediction. [*B, L, k]
        match = (labels.unsqueeze(-1) == top_k.unsqueeze(-2)) & valid.unsqueeze(-1)
        hits = match.any(dim=-1).sum(dim=-1).to(torch.float64)  # [*B]
        relevant = valid.sum(dim=-1).to(torch.float64)  # [*B]

        self.total_hits.add_((w * hits).sum())
        self.total_retrieved.add_(w.sum() * self.k)
        self.total_relevant.add_((w * relevant).sum())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}"


class PrecisionAtKMetric(_TopKMetric):
    """Fraction of the top-k predicted classes that are relevant, weighted by row.

    ``update(labels, predictions, weights=None)``; shapes in
    :mod:`weightstream.metrics.ranking`.

    Args:
        k: number of top predictions per row (1 <= k <= num_classes).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def compute(self) -> torch.Tensor:
        return self.total_hits / self.total_retrieved  # 0/0 = nan before any row


class RecallAtKMetric(_TopKMetric):
    """Fraction of the relevant classes found among the top-k predictions, weighted by row.

    ``update(labels, predictions, weights=None)``; shapes in
    :mod:`weightstream.metrics.ranking`.

    Args:
        k: number of top predictions per row (1 <= k <= num_classes).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def compute(self) -> torch.Tensor:
        return self.total_hits / self.total_relevant  # 0/0 = nan before any label

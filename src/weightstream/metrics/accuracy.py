"""Accuracy metrics: overall (``AccuracyMetric``) and averaged per class."""

from __future__ import annotations

from typing import Any

import torch

from weightstream.metrics._inputs import (
    ARGMAX_HINT,
    check_class_ids,
    check_num_classes,
    paired_inputs,
)
from weightstream.metrics.base import Metric


class AccuracyMetric(Metric):
    """Fraction of tokens whose prediction equals the label, weighted.

    ``value = sum(w * (labels == predictions)) / sum(w)`` over tokens with
    weight ``w > 0`` (tokens with weight <= 0 do not count). With 0/1 weights
    (a padding mask) this is the reference's ``correct / number of tokens with
    weight > 0``; with other weights it is the weighted mean, as
    ``sklearn.metrics.accuracy_score(sample_weight=...)``.

    Args: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(self, name: str | None = None, compute_on_system: bool = True) -> None:
        super().__init__(name, compute_on_system)
        self.add_accumulator("total_correct")  # sum of w over correct tokens
        self.add_accumulator("total_weight")  # sum of w

    @torch.no_grad()
    def update(self, labels: Any, predictions: Any, weights: Any = None) -> None:
        """Add a batch.

        Args:
            labels: class ids, any shape ``S``.
            predictions: predicted class ids, shape ``S``.
            weights: ``None`` (all 1), or a tensor broadcastable to ``S``.
        """
        metric = type(self).__name__
        labels, predictions, w = paired_inputs(
            metric, labels, predictions, weights, self.device, ARGMAX_HINT
        )
        self.total_correct.add_((w * (labels == predictions)).sum())
        self.total_weight.add_(w.sum())

    def compute(self) -> torch.Tensor:
        return self.total_correct / self.total_weight  # 0/0 = nan before any token


class MeanPerClassAccuracyMetric(Metric):
    """Accuracy of each class (its recall), averaged over the classes seen.

    ``acc_c = sum(w * correct, label == c) / sum(w, label == c)`` and the value
    is the mean of ``acc_c`` over the classes that occur among the weighted
    labels, which is ``sklearn.metrics.balanced_accuracy_score``.

    Note: the reference averages over all ``num_classes`` and counts a class
    never seen in the labels as accuracy 0; here such a class is left out of the
    mean (its accuracy is undefined, and counting it as 0 makes the value depend
    on which classes happen to occur in the eval set).

    Args:
        num_classes: number of classes (>= 2); labels must be in ``[0, num_classes)``.
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(
        self, num_classes: int, name: str | None = None, compute_on_system: bool = True
    ) -> None:
        self.num_classes = check_num_classes(type(self).__name__, num_classes)
        super().__init__(name, compute_on_system)
        self.add_accumulator("per_class_correct", (num_classes,))  # [C] sum of w, correct
        self.add_accumulator("per_class_weight", (num_classes,))  # [C] sum of w

    @torch.no_grad()
    def update(self, labels: Any, predictions: Any, weights: Any = None) -> None:
        """Add a batch: ``labels`` and ``predictions`` class ids of one shape ``S``,
        ``weights`` ``None`` or broadcastable to ``S``."""
        metric = type(self).__name__
        labels, predictions, w = paired_inputs(
            metric, labels, predictions, weights, self.device, ARGMAX_HINT
        )
        w = w.reshape(-1)
        ids = check_class_ids(metric, "labels", labels.reshape(-1), w, self.num_classes)
        correct = w * (labels.reshape(-1) == predictions.reshape(-1))
        self.per_class_correct.index_add_(0, ids, correct)
        self.per_class_weight.index_add_(0, ids, w)

    def compute(self) -> torch.Tensor:
        seen = self.per_class_weight > 0
        per_class = self.per_class_correct / torch.where(seen, self.per_class_weight, 1.0)
        # Masked mean without boolean indexing (which would sync with the host);
        # 0 classes seen gives 0/0 = nan.
        return per_class.sum() / seen.sum()

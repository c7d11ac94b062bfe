"""F-beta score of a multi-class classifier, micro or macro averaged."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightstream.metrics.confusion import ConfusionMatrixMetric, masked_mean, safe_divide

_AVERAGE_TYPES = ("micro", "macro")


class FBetaScoreMetric(ConfusionMatrixMetric):
    """``F_beta = (1 + beta^2) * P * R / (beta^2 * P + R)`` from a weighted confusion matrix.

    Equivalently ``(1 + beta^2) TP / ((1 + beta^2) TP + beta^2 FN + FP)``; a 0/0
    counts as 0 (sklearn's ``zero_division=0``).

    * ``average_type="micro"``: TP, FP and FN are summed over the classes not in
      ``ignore_labels`` first, then one score is computed.
    * ``average_type="macro"``: one score per class not in ``ignore_labels``
      (0 for a class never labelled nor predicted), then their plain mean.

    This is ``sklearn.metrics.fbeta_score(y, p, beta=beta, average=average_type,
    labels=<classes not ignored>, sample_weight=w, zero_division=0)``.

    ``update(labels, predictions, weights=None)``: see
    :class:`~weightstream.metrics.confusion.ConfusionMatrixMetric`.

    Args:
        num_classes: number of classes (>= 2).
        beta: weight of recall relative to precision (> 0).
        average_type: ``"micro"`` or ``"macro"``.
        ignore_labels: class ids left out of the average (e.g. a background class).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(
        self,
        num_classes: int,
        beta: float = 1.0,
        average_type: str = "micro",
        ignore_labels: Iterable[int] | int | None = None,
        name: str | None = None,
        compute_on_system: bool = True,
    ) -> None:
        metric = type(self).__name__
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"{metric}: beta must be a number, got {beta!r}.")
        if not beta > 0:
            raise ValueError(
                f"{metric}: beta must be > 0, got {beta}; use 1 for F1, 2 to favour recall, "
                "0.5 to favour precision."
            )
        if average_type not in _AVERAGE_TYPES:
            raise ValueError(
                f"{metric}: average_type must be one of {list(_AVERAGE_TYPES)}, got "
                f"{average_type!r}; 'micro' pools all tokens, 'macro' averages the classes."
            )
        self.beta = float(beta)
        self.average_type = average_type
        super().__init__(
            num_classes,
            ignore_labels,
            ignore_arg="ignore_labels",
            name=name,
            compute_on_system=compute_on_system,
        )

    def compute(self) -> torch.Tensor:
        b2 = self.beta**2
        tp, labelled, predicted = self._class_totals()
        mask = self.class_mask
        if self.average_type == "micro":
            tp, labelled, predicted = (
                torch.where(mask, t, 0.0).sum() for t in (tp, labelled, predicted)
            )
            score = safe_divide((1 + b2) * tp, b2 * labelled + predicted)
        else:
            per_class = safe_divide((1 + b2) * tp, b2 * labelled + predicted)
            score = masked_mean(per_class, mask)
        return self._nan_if_empty(score)

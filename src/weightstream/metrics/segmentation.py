"""Overlap metrics of semantic segmentation: mean IoU and the Dice coefficient.

Both are averaged over the classes that occur, among labels or predictions, and
are not ignored: a class absent from both has no defined overlap and is left out
(as in the reference). Before any token has been counted, or when no class
qualifies, the value is nan.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightstream.metrics.confusion import ConfusionMatrixMetric, masked_mean, safe_divide


class _ClassOverlapMetric(ConfusionMatrixMetric):
    """A per-class overlap score averaged over the classes not in ``ignore_classes``."""

    def __init__(
        self,
        num_classes: int,
        ignore_classes: Iterable[int] | int | None = None,
        name: str | None = None,
        compute_on_system: bool = True,
    ) -> None:
        super().__init__(
            num_classes,
            ignore_classes,
            ignore_arg="ignore_classes",
            name=name,
            compute_on_system=compute_on_system,
        )


class MeanIOUMetric(_ClassOverlapMetric):
    """Mean over classes of ``IoU_c = TP_c / (TP_c + FP_c + FN_c)``, weighted counts.

    Per class this is ``sklearn.metrics.jaccard_score(average=None, sample_weight=w)``.

    ``update(labels, predictions, weights=None)``: see
    :class:`~weightstream.metrics.confusion.ConfusionMatrixMetric`.

    Args:
        num_classes: number of classes (>= 2).
        ignore_classes: class ids left out of the mean (e.g. a background class).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def compute(self) -> torch.Tensor:
        tp, labelled, predicted = self._class_totals()
        union = labelled + predicted - tp  # TP + FN + FP
        iou = safe_divide(tp, union)
        return self._nan_if_empty(masked_mean(iou, self.class_mask & (union > 0)))


class DiceCoefficientMetric(_ClassOverlapMetric):
    """Mean over classes of ``Dice_c = 2 TP_c / (2 TP_c + FP_c + FN_c)``, weighted counts.

    Per class this is the F1 score, ``sklearn.metrics.f1_score(average=None)``.

    ``update(labels, predictions, weights=None)``: see
    :class:`~weightstream.metrics.confusion.ConfusionMatrixMetric`.

    Args:
        num_classes: number of classes (>= 2).
        ignore_classes: class ids left out of the mean (e.g. a background class).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def compute(self) -> torch.Tensor:
        tp, labelled, predicted = self._class_totals()
        total = labelled + predicted  # 2 TP + FN + FP
        dice = safe_divide(2 * tp, total)
        return self._nan_if_empty(masked_mean(dice, self.class_mask & (total > 0)))

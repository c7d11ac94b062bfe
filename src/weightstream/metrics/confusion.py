"""``ConfusionMatrixMetric``: the shared state of the metrics computed from a confusion matrix.

F-beta, mean IoU and the Dice coefficient all read the same accumulator, a
weighted confusion matrix; only ``compute`` differs (see their modules).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from weightstream.metrics._inputs import (
    ARGMAX_HINT,
    check_class_ids,
    check_num_classes,
    class_mask,
    paired_inputs,
)
from weightstream.metrics.base import Metric


class ConfusionMatrixMetric(Metric):
    """Base of the metrics computed from ``confusion_matrix[label, prediction]``.

    The accumulator ``confusion_matrix`` (float64 ``[num_classes, num_classes]``,
    rows = true class, columns = predicted class) holds the sum of the weights of
    the tokens with that (label, prediction) pair.

    ``update(labels, predictions, weights=None)``: ``labels`` and ``predictions``
    are class ids in ``[0, num_classes)`` of one shape ``S`` (any rank);
    ``weights`` is ``None`` (all 1) or broadcastable to ``S``. A token with
    weight <= 0 does not count and may hold any id (padding such as -100).

    Args:
        num_classes: number of classes (>= 2).
        ignore: class ids left out of the average (``ignore_labels`` /
            ``ignore_classes`` in the subclasses). Their tokens still count as
            wrong predictions of the other classes.
        ignore_arg: the subclass's name for ``ignore`` (for error messages).
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(
        self,
        num_classes: int,
        ignore: Iterable[int] | int | None = None,
        *,
        ignore_arg: str = "ignore_classes",
        name: str | None = None,
        compute_on_system: bool = True,
    ) -> None:
        metric = type(self).__name__
        self.num_classes = check_num_classes(metric, num_classes)
        mask = class_mask(metric, num_classes, ignore, ignore_arg)
        super().__init__(name, compute_on_system)
        # [C] bool, True for the classes averaged over. A constant, not state: not
        # saved in state_dict, not all-reduced.
        self.register_buffer("class_mask", mask, persistent=False)
        self.add_accumulator("confusion_matrix", (num_classes, num_classes))

    @torch.no_grad()
    def update(self, labels: Any, predictions: Any, weights: Any = None) -> None:
        """Add a batch (shapes in the class docstring)."""
        metric = type(self).__name__
        c = self.num_classes
        labels, predictions, w = paired_inputs(
            metric, labels, predictions, weights, self.device, ARGMAX_HINT
        )
        w = w.reshape(-1)
        true_ids = check_class_ids(metric, "labels", labels.reshape(-1), w, c)
        pred_ids = check_class_ids(metric, "predictions", predictions.reshape(-1), w, c)
        counts = torch.bincount(true_ids * c + pred_ids, weights=w, minlength=c * c)
        self.confusion_matrix.add_(counts.reshape(c, c))

    def _class_totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per class [C]: true positives, number labelled c, number predicted c (weighted)."""
        cm = self.confusion_matrix
        return torch.diagonal(cm), cm.sum(dim=1), cm.sum(dim=0)

    def _nan_if_empty(self, value: torch.Tensor) -> torch.Tensor:
        """``value``, or nan while no token has been counted (Note [metric state])."""
        return torch.where(self.confusion_matrix.sum() > 0, value, torch.nan)


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den != 0``, else 0 (sklearn's ``zero_division=0``)."""
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, 1.0), 0.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask``; nan if ``mask`` is all False. No host sync."""
    return torch.where(mask, values, 0.0).sum() / mask.sum()

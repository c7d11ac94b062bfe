"""Area under the ROC or precision-recall curve of a binary classifier, streamed.

Note [AUC by thresholds]
------------------------
An exact AUC needs every score kept until the end; a streamed metric instead
counts, per threshold, how many positives and negatives score above it (the
reference's scheme, after ``tf.metrics.auc``). The thresholds are

    t_0 = -1e-7,  t_i = i / (num_thresholds - 1) for 0 < i < num_thresholds - 1,
    t_last = 1 + 1e-7,

and the curve has one point per threshold: the tokens with score > t_i are
predicted positive. Rather than one counter per threshold, a token is added to
the bucket ``b`` = number of thresholds below its score (all thresholds below b
count it), and the per-threshold counts are suffix sums of the buckets. Both
are sums, so the state all-reduces (Note [metric state] in ``base``).

The result is *exactly* the AUC of the scores rounded up to their bucket: two
scores in one bucket are tied. Compared with the exact AUC of the raw scores,
only pairs within one bucket can differ; for ROC the error is at most half the
weighted fraction of (positive, negative) pairs that share a bucket.

The area is the trapezoidal sum over the points. For ROC the curve runs from
(0, 0) to (1, 1). For PR, the point where no token is predicted positive has
recall 0 and precision 1 (as in ``sklearn.metrics.precision_recall_curve``;
``tf.metrics.auc`` uses precision 0 there, which lowers the area).
"""

from __future__ import annotations

from typing import Any

import torch

from weightstream.metrics._inputs import check_positive_int, paired_inputs
from weightstream.metrics.base import Metric

_CURVES = ("ROC", "PR")
_EPSILON = 1e-7
_SCORE_HINT = "Pass one score per label, e.g. the positive-class probability."


def auc_thresholds(num_thresholds: int) -> torch.Tensor:
    """The ``num_thresholds`` float64 thresholds of Note [AUC by thresholds]."""
    thresholds = torch.arange(num_thresholds, dtype=torch.float64) / (num_thresholds - 1)
    thresholds[0], thresholds[-1] = -_EPSILON, 1.0 + _EPSILON
    return thresholds


class AUCMetric(Metric):
    """Area under the ROC curve (``curve="ROC"``) or the precision-recall curve (``"PR"``).

    ``update(labels, predictions, weights=None)``:

    * ``labels``: any shape ``S``; nonzero (True) marks a positive token.
    * ``predictions``: scores in ``[0, 1]`` (probabilities), shape ``S``. Values
      outside are counted as 0 or 1 (checking would cost a host sync per step).
    * ``weights``: ``None`` (all 1), or broadcastable to ``S``; tokens with
      weight <= 0 do not count.

    The value is computed on ``num_thresholds`` thresholds, see Note [AUC by
    thresholds] in this module for the exact definition and its error bound. It
    is nan until both a positive and (for ROC) a negative token have been seen.

    Args:
        num_thresholds: number of thresholds (> 1); more is closer to the exact
            AUC of the raw scores, at 2 float64 per threshold of state.
        curve: ``"ROC"`` or ``"PR"``.
        name, compute_on_system: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        name: str | None = None,
        compute_on_system: bool = True,
    ) -> None:
        metric = type(self).__name__
        self.num_thresholds = check_positive_int(metric, "num_thresholds", num_thresholds, 2)
        if curve not in _CURVES:
            raise ValueError(
                f"{metric}: curve must be one of {list(_CURVES)}, got {curve!r}; 'ROC' for the "
                "ROC curve, 'PR' for the precision-recall curve."
            )
        self.curve = curve
        super().__init__(name, compute_on_system)
        # A constant, not state (not saved, not all-reduced).
        self.register_buffer("thresholds", auc_thresholds(num_thresholds), persistent=False)
        # [num_thresholds + 1]: summed weight of positive / negative tokens per bucket.
        self.add_accumulator("positives_per_bucket", (num_thresholds + 1,))
        self.add_accumulator("negatives_per_bucket", (num_thresholds + 1,))

    @torch.no_grad()
    def update(self, labels: Any, predictions: Any, weights: Any = None) -> None:
        """Add a batch (shapes in the class docstring)."""
        metric = type(self).__name__
        labels, predictions, w = paired_inputs(
            metric, labels, predictions, weights, self.device, _SCORE_HINT
        )
        w = w.reshape(-1)
        scores = predictions.reshape(-1).to(torch.float64).clamp(0.0, 1.0)
        positive = labels.reshape(-1) != 0
        # bucket = number of thresholds strictly below the score (right=False).
        bucket = torch.bucketize(scores, self.thresholds, right=False)
        zero = torch.zeros((), dtype=torch.float64, device=w.device)
        self.positives_per_bucket.index_add_(0, bucket, torch.where(positive, w, zero))
        self.negatives_per_bucket.index_add_(0, bucket, torch.where(positive, zero, w))

    def compute(self) -> torch.Tensor:
        # Weighted count of tokens scoring above threshold i = tokens in buckets > i.
        def above(per_bucket: torch.Tensor) -> torch.Tensor:  # [T+1] -> [T]
            suffix = per_bucket.flip(0).cumsum(0).flip(0)  # suffix[j] = sum over buckets >= j
            return suffix[1:]

        tp = above(self.positives_per_bucket)  # [T], non-increasing in i
        fp = above(self.negatives_per_bucket)
        positives = self.positives_per_bucket.sum()
        negatives = self.negatives_per_bucket.sum()
        recall = tp / positives  # nan if no positive
        if self.curve == "ROC":
            x, y = fp / negatives, recall  # nan if no negative
        else:
            predicted = tp + fp
            x = recall
            y = torch.where(predicted > 0, tp / torch.where(predicted > 0, predicted, 1.0), 1.0)
        # Points run from high x to low x as the threshold rises.
        return ((x[:-1] - x[1:]) * (y[:-1] + y[1:]) / 2).sum()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_thresholds={self.num_thresholds}, curve={self.curve!r}"

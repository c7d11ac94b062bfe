"""Perplexity of a language model: exp of the mean per-token loss."""

from __future__ import annotations

from typing import Any

import torch

from weightstream.metrics._inputs import as_tensor, effective_weights
from weightstream.metrics.base import Metric


class PerplexityMetric(Metric):
    """``exp(sum(w * loss) / sum(w))`` over the tokens with weight ``w > 0``.

    ``update(labels, loss, weights=None)`` takes the loss in one of two forms:

    * **per token**: ``loss`` has the shape of ``labels`` (e.g.
      ``cross_entropy(..., reduction="none")``); it is weighted here.
    * **summed** (the reference's form): ``loss`` is a scalar, the *sum* over the
      batch's tokens of the already weighted per-token loss (not the mean). The
      denominator is then ``sum(w)``, which for a 0/1 mask is the reference's
      number of tokens with weight > 0.

    ``labels`` is used only for its shape (the tokens of the batch).

    Args: see :class:`~weightstream.metrics.base.Metric`.
    """

    def __init__(self, name: str | None = None, compute_on_system: bool = True) -> None:
        super().__init__(name, compute_on_system)
        self.add_accumulator("total_loss")  # sum of w * per-token loss
        self.add_accumulator("total_weight")  # sum of w (tokens counted)

    @torch.no_grad()
    def update(self, labels: Any, loss: Any, weights: Any = None) -> None:
        """Add a batch.

        Args:
            labels: token labels, shape ``S`` (only the shape is used).
            loss: per-token loss of shape ``S``, or a scalar summed loss (see the
                class docstring).
            weights: ``None`` (all 1), or a tensor broadcastable to ``S``.
        """
        metric = type(self).__name__
        labels = as_tensor(labels, "labels", metric, self.device)
        loss = as_tensor(loss, "loss", metric, self.device).to(torch.float64)
        w = effective_weights(metric, weights, labels.shape, self.device)
        if loss.shape == labels.shape:
            self.total_loss.add_((w * loss).sum())
        elif loss.numel() == 1:
            self.total_loss.add_(loss.reshape(()))
        else:
            raise ValueError(
                f"{metric}.update(): loss has shape {tuple(loss.shape)} but labels has shape "
                f"{tuple(labels.shape)}; pass the per-token loss with the labels' shape "
                '(reduction="none") or a scalar: the sum of the per-token losses.'
            )
        self.total_weight.add_(w.sum())

    def compute(self) -> torch.Tensor:
        return torch.exp(self.total_loss / self.total_weight)  # 0/0 = nan before any token

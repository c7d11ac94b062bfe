"""Argument and input checks shared by the metrics (pure functions).

All raise ``ValueError`` / ``TypeError`` naming the metric, the argument and the
fix. Checks on *shapes* are free; checks on *values* need the values on the
host, and each such place is marked ``# host sync``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# The hint of the metrics whose predictions are class ids.
ARGMAX_HINT = "Pass predicted class ids (e.g. logits.argmax(-1)), not logits."


def check_num_classes(metric: str, num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise TypeError(
            f"{metric}: num_classes must be an int, got {type(num_classes).__name__} "
            f"{num_classes!r}."
        )
    if num_classes < 2:
        raise ValueError(
            f"{metric}: num_classes must be at least 2, got {num_classes}; pass the number "
            "of classes the model predicts (2 for a binary task)."
        )
    return num_classes


def check_positive_int(metric: str, arg: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{metric}: {arg} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{metric}: {arg} must be >= {minimum}, got {value}.")
    return value


def class_mask(
    metric: str, num_classes: int, ignore: Iterable[int] | int | None, arg: str
) -> torch.Tensor:
    """Bool tensor [num_classes]: True for the classes the metric averages over."""
    mask = torch.ones(num_classes, dtype=torch.bool)
    if ignore is None:
        return mask
    if isinstance(ignore, int) and not isinstance(ignore, bool):
        ignore = [ignore]
    ignore = list(ignore)
    for cls in ignore:
        if isinstance(cls, bool) or not isinstance(cls, int):
            raise TypeError(f"{metric}: {arg} must be a list of class ids (ints), got {cls!r}.")
        if not 0 <= cls < num_classes:
            raise ValueError(
                f"{metric}: {arg} contains {cls}, which is not a class id in "
                f"[0, {num_classes}); list only ids of classes the model predicts."
            )
        mask[cls] = False
    if not mask.any():
        raise ValueError(
            f"{metric}: {arg}={ignore} ignores all {num_classes} classes, so there is nothing "
            "to average; ignore fewer classes."
        )
    return mask


def as_tensor(value: Any, arg: str, metric: str, device: torch.device) -> torch.Tensor:
    """``value`` as a detached tensor on ``device`` (metrics never take part in autograd)."""
    if value is None:
        raise TypeError(f"{metric}.update(): {arg} is required, got None.")
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    return value.detach().to(device)


def paired_inputs(
    metric: str, labels: Any, predictions: Any, weights: Any, device: torch.device, hint: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``labels`` and ``predictions`` as tensors of one shape, and their :func:`effective_weights`."""
    labels = as_tensor(labels, "labels", metric, device)
    predictions = as_tensor(predictions, "predictions", metric, device)
    if labels.shape != predictions.shape:
        raise ValueError(
            f"{metric}.update(): labels has shape {tuple(labels.shape)} but predictions has shape "
            f"{tuple(predictions.shape)}; they must be equal. {hint}"
        )
    return labels, predictions, effective_weights(metric, weights, labels.shape, device)


def effective_weights(
    metric: str, weights: Any, shape: torch.Size, device: torch.device, arg: str = "weights"
) -> torch.Tensor:
    """Float64 weights of ``shape``: ``weights`` broadcast, with entries <= 0 set to 0.

    ``None`` means weight 1 everywhere. A token with weight <= 0 does not count
    (the reference's masking convention: pass 0 for padding).
    """
    if weights is None:
        return torch.ones(shape, dtype=torch.float64, device=device)
    w = as_tensor(weights, arg, metric, device).to(torch.float64)
    try:
        w = torch.broadcast_to(w, shape)
    except RuntimeError:
        raise ValueError(
            f"{metric}.update(): {arg} has shape {tuple(w.shape)}, which does not broadcast "
            f"to shape {tuple(shape)}; pass one weight per token (same shape) or a scalar."
        ) from None
    return torch.where(w > 0, w, torch.zeros((), dtype=torch.float64, device=device))


def check_class_ids(
    metric: str, arg: str, ids: torch.Tensor, weights: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """``ids`` as int64 after checking that every counted token holds a class id.

    Tokens with weight 0 may hold anything (padding such as -100); they are set
    to class 0 here, harmless since their weight is 0.
    """
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(
            f"{metric}.update(): {arg} must hold integer class ids, got dtype {ids.dtype}; "
            "pass e.g. logits.argmax(-1) rather than logits or probabilities."
        )
    ids = ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < num_classes)
    # host sync: one bool read per update, so that a wrong id is an error, not a
    # silently wrong confusion matrix.
    if bool(((~in_range) & (weights > 0)).any()):
        bad = ids[(~in_range) & (weights > 0)][:5].tolist()
        raise ValueError(
            f"{metric}.update(): {arg} contains {bad}, not class ids in [0, {num_classes}); "
            "check num_classes, or give such tokens weight 0 to skip them."
        )
    return torch.where(in_range, ids, torch.zeros((), dtype=torch.int64, device=ids.device))

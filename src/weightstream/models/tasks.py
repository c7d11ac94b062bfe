"""Losses of the tasks' batch formats (see models/registry.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def model_inputs(task: str, batch: dict) -> tuple:
    """The model's positional inputs in a batch of ``task``'s format."""
    return (batch["input_ids"],) if task == "lm" else (batch["inputs"],)


def task_loss(task: str, model: Callable, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward one batch; returns (mean loss, logits, extra) for the task's batch format."""
    if task == "lm":
        logits = _logits(model(batch["input_ids"]))  # [B, T, V]
        labels = batch["labels"].to(logits.device)
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        )
        mask = batch.get("attention_mask")
        if mask is None:
            weights = torch.ones_like(per_token)
        else:
            weights = mask.to(per_token.device, per_token.dtype).flatten()
        loss = (per_token * weights).sum() / weights.sum().clamp_min(1.0)
        return loss, logits, {"per_token": per_token, "weights": weights, "labels": labels}
    if task == "classification":
        logits = model(batch["inputs"])
        labels = batch["labels"].to(logits.device)
        return F.cross_entropy(logits.float(), labels), logits, {"labels": labels}
    raise ValueError(f"unknown task {task!r}; expected 'lm' or 'classification'.")


def _logits(out):
    """The logits of a model's output: a tensor, or a transformers output's ``logits``."""
    return out if isinstance(out, torch.Tensor) else out.logits

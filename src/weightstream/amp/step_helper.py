"""``optimizer_step``: the usual backward / unscale / clip / step / update sequence in one call."""

from __future__ import annotations

import math
from typing import Any

import torch

from weightstream.amp import skip
from weightstream.amp.grad_scaler import GradScaler

__all__ = ["optimizer_step"]


def _check_clip_value(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"optimizer_step(): {name} must be a number or None, got {type(value).__name__}."
        )
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"optimizer_step(): {name} must be non-negative, got {value!r}; pass None to disable "
            "clipping."
        )


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    grad_scaler: GradScaler | None,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
    *,
    max_gradient_val: float | None = None,
) -> None:
    """Backward, unscale, clip, step, update and zero the gradients, in that order.

    Equivalent to::

        grad_scaler.scale(loss).backward()
        grad_scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_gradient_norm)    # or clip_grad_value_
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()

    where ``params`` are the optimizer's parameters. With ``grad_scaler=None``
    the loss is not scaled and ``optimizer.step()`` always runs.

    Args:
        loss: the scalar loss of the step.
        optimizer: the optimizer to step.
        grad_scaler: a :class:`GradScaler`, or None.
        max_gradient_norm: clip the global L2 norm of the gradients to this.
        max_gradient_value: clip each gradient element to [-value, value].
            At most one of the two; both must be non-negative.
    """
    # The seed's prose spells the keyword max_gradient_val; accept it as an alias.
    if max_gradient_val is not None:
        if max_gradient_value is not None:
            raise TypeError(
                "optimizer_step(): max_gradient_val is an alias of max_gradient_value; pass one."
            )
        max_gradient_value = max_gradient_val
    # Every check before backward(): a user mistake must leave gradients,
    # parameters and scaler untouched.
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"optimizer_step(): loss must be a tensor, got {type(loss).__name__}.")
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"optimizer_step(): optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
        raise TypeError(
            "optimizer_step(): grad_scaler must be a weightstream.amp.GradScaler or None, got "
            f"{type(grad_scaler).__name__}."
        )
    _check_clip_value("max_gradient_norm", max_gradient_norm)
    _check_clip_value("max_gradient_value", max_gradient_value)
    if max_gradient_norm is not None and max_gradient_value is not None:
        raise ValueError(
            "optimizer_step(): max_gradient_norm and max_gradient_value are mutually exclusive; "
            "clip by norm or by value, not both."
        )

    if grad_scaler is not None:
        grad_scaler.scale(loss).backward()
        # Clipping must see the true gradients, not the scaled ones.
        grad_scaler.unscale_(optimizer)
    else:
        loss.backward()

    params = _params_of(optimizer)
    if max_gradient_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_gradient_norm)
    elif max_gradient_value is not None:
        torch.nn.utils.clip_grad_value_(params, max_gradient_value)

    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
        # Overwrite any stale "skipped" left by an earlier scaler step.
        skip.record_step(optimizer, False)
    optimizer.zero_grad()


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params

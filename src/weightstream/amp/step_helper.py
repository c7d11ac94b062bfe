"""``optimizer_step``: the usual backward / unscale / clip / step / update sequence in one call."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from weightstream.amp import skip
from weightstream.amp.grad_scaler import GradScaler, params_of, scale_to_norm_

__all__ = [
    "apply_gradients",
    "backward_context",
    "clip_grad_norm_",
    "clip_grad_value_",
    "optimizer_step",
]


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

    where ``params`` are the optimizer's parameters (the step after the backward
    is :func:`apply_gradients`). With ``grad_scaler=None`` the loss is not
    scaled and ``optimizer.step()`` always runs. Under data parallel it is the
    same step on every rank: the gradients are the mean over the ranks, and the
    norm is the whole model's.

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

    with backward_context(optimizer, grad_scaler, max_gradient_norm, max_gradient_value):
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
        else:
            loss.backward()
    apply_gradients(optimizer, grad_scaler, max_gradient_norm, max_gradient_value)


def backward_context(
    optimizer: torch.optim.Optimizer,
    grad_scaler: GradScaler | None,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
) -> contextlib.AbstractContextManager:
    """The context of a step's last backward that :func:`apply_gradients` follows: the
    engine may start the step's update in it where nothing global comes between
    (no clipping, no loss scaling; Note [updates in backward] in runtime/updater.py)."""
    engine = getattr(optimizer, "engine", None)
    scaling = grad_scaler is not None and (grad_scaler.is_enabled() or grad_scaler.dynamic)
    clipping = max_gradient_norm is not None or max_gradient_value is not None
    if engine is None or scaling or clipping:
        return contextlib.nullcontext()
    return engine.update_in_backward(optimizer)


def apply_gradients(
    optimizer: torch.optim.Optimizer,
    grad_scaler: GradScaler | None,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
) -> None:
    """The step after the backward: unscale, clip, step, update, zero the gradients.

    The one step code of every training loop: :func:`optimizer_step` and the
    run command's trainer both end their step here. Under data parallel the
    gradients are the mean over the ranks already (SwarmX reduces them in the
    backward, Note [swarm reduce]); clipping and the scaler's non-finite check
    use the norm of the whole model's gradients, summed over the ranks where a
    sharded store spreads them (Note [sharded store]).
    """
    engine = getattr(optimizer, "engine", None)
    if engine is not None:
        engine.finish_gradients()  # host sync point: every reduction has landed
    if grad_scaler is not None:
        # Clipping must see the true gradients, not the scaled ones.
        grad_scaler.unscale_(optimizer)

    params = params_of(optimizer)
    if max_gradient_norm is not None:
        clip_grad_norm_(params, max_gradient_norm, engine)
    elif max_gradient_value is not None:
        clip_grad_value_(params, max_gradient_value, engine)

    if grad_scaler is not None:
        grad_scaler.step(optimizer)
    else:
        optimizer.step()
        # Overwrite any stale "skipped" left by an earlier scaler step.
        skip.record_step(optimizer, False)
    if grad_scaler is not None:
        grad_scaler.update()
    optimizer.zero_grad(set_to_none=True)


def clip_grad_norm_(
    params,
    max_norm: float,
    engine=None,
    eps: float = 1e-6,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients.

    Where a sharded store spreads the gradients over the ranks (each holds
    those of the parameters it owns), the norm is reduced over the ranks (a
    host sync point): the p-th root of the sum of each rank's sum of p-th
    powers, or the largest of the ranks' largest values for ``inf``; each rank
    scales its own gradients by the common coefficient. Elsewhere every rank
    holds every gradient and torch's function computes the same norm on each.
    Returns the total norm, as torch's function does.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if engine is None or not engine.grads_sharded:
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
    norm_type = float(norm_type)
    grads = [p.grad.detach() for p in params if p.grad is not None]
    # Each gradient counted on one rank (a device tier's are on every rank), summed on
    # its own device first.
    parts: dict[torch.device, torch.Tensor] = {}
    for p in params:
        if p.grad is None or not engine.counts_in_norm(p):
            continue
        g = p.grad.detach().float()
        if norm_type == math.inf:
            part, add = g.abs().max(), torch.maximum
        else:
            part = torch.sum(torch.square(g) if norm_type == 2.0 else g.abs().pow(norm_type))
            add = torch.add
        before = parts.get(g.device)
        parts[g.device] = part if before is None else add(before, part)
    local = torch.stack([x.cpu() for x in parts.values()] or [torch.zeros(())])  # host sync
    if norm_type == math.inf:
        norm = engine.max_over_ranks(local.max())
    else:
        norm = engine.sum_over_ranks(local.sum()).pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):  # host sync point
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped. Fix: pass error_if_nonfinite=False to clip anyway, or find "
            "the non-finite gradient (a loss scaler skips such steps)."
        )
    scale_to_norm_(grads, max_norm, norm, eps)
    engine.gradients_rewritten(params)
    return norm


def clip_grad_value_(params, clip_value: float, engine=None) -> None:
    """``torch.nn.utils.clip_grad_value_``; elementwise, so exact on a shard too, and
    the engine is told so (Note [changed after the reduce] in runtime/swarm.py)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    torch.nn.utils.clip_grad_value_(params, clip_value)
    if engine is not None:
        engine.gradients_rewritten(params)

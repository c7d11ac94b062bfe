"""Muon (Jordan et al., 2024): momentum SGD whose matrix updates are orthogonalized."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from weightstream.optim._common import (
    _ZeroStateOptimizer,
    check_non_negative,
    check_number,
    groups_with_grads,
    hyper,
    state_list,
)
from weightstream.optim.optimizer import ParamsT

__all__ = ["Muon"]

# Coefficients of the quintic Newton-Schulz iteration from Keller Jordan's Muon
# post: chosen to maximize the slope at zero, so few steps push all singular
# values into roughly [0.7, 1.2] rather than converging exactly to 1.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_EPS = 1e-7
_ADJUST_LR_FNS = ("original", "match_rms_adamw")


def orthogonalize(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """Approximate ``U V^T`` of ``update = U S V^T`` (2-D) by Newton-Schulz, in bfloat16.

    Each iteration maps ``X -> a X + (b X X^T + c (X X^T)^2) X``, applying the
    odd polynomial ``a s + b s^3 + c s^5`` to every singular value ``s``. Scaling
    by the Frobenius norm first puts all singular values in [0, 1]. The Gram
    matrix is formed on the short side (transposing tall matrices) to keep it small.
    """
    a, b, c = coefficients
    x = update.to(torch.bfloat16, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    if tall:
        x = x.T
    return x


def _lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Scale of the learning rate for a rows x cols update, so its RMS is shape-independent."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    # "match_rms_adamw" (Liu et al., 2025, "Muon is Scalable for LLM Training"):
    # the update RMS of AdamW, so AdamW's lr and weight decay can be reused.
    return 0.2 * math.sqrt(max(rows, cols))


class Muon(_ZeroStateOptimizer):
    """Muon: momentum, then each parameter's update is replaced by its nearest
    semi-orthogonal matrix (Newton-Schulz, ``ns_steps`` iterations in bfloat16)::

        buf = momentum buf + (1 - momentum) g
        u = (1 - momentum) g + momentum buf  if nesterov else buf
        param *= 1 - lr * weight_decay
        param -= lr * ratio(shape) * orthogonalize(u)

    Same update as ``torch.optim.Muon``. Parameters must have two or more
    dimensions; a parameter with more (a convolution kernel) is treated as the
    matrix ``shape[0] x prod(shape[1:])``. ``ns_coefficients``, ``eps`` and
    ``adjust_lr_fn`` are extensions with torch's meaning: ``adjust_lr_fn`` None or
    "original" scales lr by ``sqrt(max(1, rows / cols))`` (Keller Jordan's
    choice, for which lr=0.02 is tuned); "match_rms_adamw" by
    ``0.2 * sqrt(max(rows, cols))``.
    """

    _zero_state = ("momentum_buffer",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.02,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        *,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = _NS_EPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr, weight_decay=weight_decay, momentum=momentum, eps=eps)
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 0:
            raise ValueError(f"{name}: ns_steps must be an int >= 0, got {ns_steps!r}.")
        if not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3:
            raise ValueError(
                f"{name}: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}."
            )
        for value in ns_coefficients:
            check_number(name, "ns_coefficients", value)
        if adjust_lr_fn is not None and adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(
                f"{name}: adjust_lr_fn must be None or one of {_ADJUST_LR_FNS}, got {adjust_lr_fn!r}."
            )
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)

    def preinitialize(self) -> None:
        for p in self._all_params():
            if p.ndim < 2:
                raise ValueError(
                    f"Muon orthogonalizes matrix updates, but got a parameter of shape "
                    f"{tuple(p.shape)}. Fix: optimize biases, norm weights and other "
                    "parameters with fewer than 2 dimensions with a second optimizer "
                    "(e.g. AdamW), and give Muon only the matrices (p.ndim >= 2)."
                )
        super().preinitialize()

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, weight_decay = hyper(group, "lr"), hyper(group, "weight_decay")
            momentum = hyper(group, "momentum")
            bufs = state_list(self.state, params, "momentum_buffer")

            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            if weight_decay != 0:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
            # Newton-Schulz is a chain of matmuls per matrix: no multi-tensor form.
            for p, update in zip(params, updates):
                matrix = update.reshape(update.shape[0], -1)
                ortho = orthogonalize(
                    matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                ratio = _lr_ratio(group["adjust_lr_fn"], matrix.shape[0], matrix.shape[1])
                p.add_(ortho.reshape(p.shape), alpha=-(lr * ratio))

"""Adafactor (Shazeer and Stern, 2018): factored second moments, no first moment."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from weightstream.optim._common import (
    check_non_negative,
    check_number,
    check_pair,
    groups_with_grads,
    hyper,
)
from weightstream.optim.optimizer import Optimizer, ParamsT

__all__ = ["Adafactor"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _rms(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x) / (x.numel() ** 0.5)


class Adafactor(Optimizer):
    """Adafactor with an explicit learning rate.

    For a parameter with two or more dimensions the second moment is kept
    factored as row and column means (``exp_avg_sq_row`` of shape ``shape[:-1]``,
    ``exp_avg_sq_col`` of shape ``shape[:-2] + shape[-1:]``); otherwise in full
    (``exp_avg_sq``). Per step ``t``::

        beta2_t = 1 - t^decay_rate
        V = beta2_t V + (1 - beta2_t) (g^2 + eps[0])   (row/col means when factored)
        u = g / sqrt(V);  u /= max(1, rms(u) / clip_threshold)
        lr_t = lr * max(eps[1], rms(param)) if scale_parameter else lr
        param -= lr_t * weight_decay * param + lr_t * u

    As in the reference, only ``clip_threshold=1.0`` and ``beta1=None`` (no
    first moment) are supported, and the relative step size is not:
    ``relative_step`` and ``warmup_init`` must stay False. Half-precision
    parameters are updated in float32 (state in float32), then rounded back.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = False,
        warmup_init: bool = False,
    ) -> None:
        name = type(self).__name__
        if lr is None:
            raise ValueError(
                f"{name}: lr is required (the relative step size, lr=None, is not supported). "
                "Fix: pass lr, and schedule it with an lr scheduler, e.g. "
                "InverseSquareRootDecayLR."
            )
        check_non_negative(name, lr=lr)
        eps1, eps2 = check_pair(name, "eps", eps)
        check_non_negative(name, **{"eps[0]": eps1, "eps[1]": eps2})
        check_number(name, "clip_threshold", clip_threshold)
        if clip_threshold != 1.0:
            raise ValueError(
                f"{name}: only clip_threshold=1.0 is supported, got {clip_threshold}. "
                "Fix: remove clip_threshold or set it to 1.0."
            )
        if beta1 is not None:
            raise ValueError(
                f"{name}: only beta1=None (no first moment) is supported, got {beta1}. "
                "Fix: remove beta1, or use Adam/AdamW if you need momentum."
            )
        if relative_step:
            raise ValueError(
                f"{name}: relative_step=True is not supported. Fix: set relative_step=False "
                "and schedule lr with an lr scheduler, e.g. InverseSquareRootDecayLR."
            )
        if warmup_init:
            raise ValueError(
                f"{name}: warmup_init=True is not supported (it needs relative_step). "
                "Fix: set warmup_init=False and warm lr up with an lr scheduler."
            )
        check_number(name, "decay_rate", decay_rate)
        check_non_negative(name, weight_decay=weight_decay)
        defaults = dict(
            lr=lr,
            eps=eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                dtype = torch.float32 if p.dtype in _HALF_DTYPES else p.dtype
                shape = p.shape
                if len(shape) >= 2:
                    state["exp_avg_sq_row"] = torch.zeros(shape[:-1], dtype=dtype, device=p.device)
                    state["exp_avg_sq_col"] = torch.zeros(
                        shape[:-2] + shape[-1:], dtype=dtype, device=p.device
                    )
                else:
                    state["exp_avg_sq"] = torch.zeros(shape, dtype=dtype, device=p.device)

    def state_names_to_sparsify(self) -> list[str]:
        # The factored row/column statistics are not shaped like the parameter.
        return ["exp_avg_sq"]

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr = hyper(group, "lr")
            eps1, eps2 = group["eps"]
            decay_rate = hyper(group, "decay_rate")
            clip_threshold = hyper(group, "clip_threshold")
            weight_decay = hyper(group, "weight_decay")
            steps = self._advance_steps(params)
            # Row/column reductions make this a per-tensor loop; each line is one
            # whole-tensor op, so Python costs a few calls per parameter.
            for p, grad, s in zip(params, grads, steps):
                state = self.state[p]
                work = p.float() if p.dtype in _HALF_DTYPES else p
                if grad.dtype in _HALF_DTYPES:
                    grad = grad.float()

                if group["scale_parameter"]:
                    step_lr = torch.clamp(_rms(work), min=eps2) * lr
                else:
                    step_lr = lr
                beta2t = 1.0 - math.pow(s, decay_rate)

                update = torch.square(grad).add_(eps1)
                if "exp_avg_sq_row" in state:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    # V ~ outer(row, col) / mean(row): rsqrt of each factor.
                    row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    col_factor = col.unsqueeze(-2).rsqrt()
                    update = torch.mul(row_factor, col_factor).mul_(grad)
                else:
                    exp_avg_sq = state["exp_avg_sq"]
                    exp_avg_sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = exp_avg_sq.rsqrt().mul_(grad)

                update.div_((_rms(update) / clip_threshold).clamp_(min=1.0))
                update.mul_(step_lr)
                if weight_decay != 0:
                    work.add_(work, alpha=float(-weight_decay * step_lr))
                work.sub_(update)
                if work is not p:
                    p.copy_(work)

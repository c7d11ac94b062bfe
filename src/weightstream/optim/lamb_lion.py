"""Lamb (layer-wise trust ratio on an Adam step) and Lion (sign of a momentum interpolation)."""

from __future__ import annotations

from typing import Any

import torch

from weightstream.optim._common import (
    _ZeroStateOptimizer,
    check_adam_args,
    check_betas,
    check_non_negative,
    groups_with_grads,
    hyper,
    state_list,
    update_moments,
)
from weightstream.optim.optimizer import ParamsT

__all__ = ["Lamb", "Lion"]

# Lamb's scaling function phi clips the weight norm at this value (You et al.,
# 2019, section 3: phi(z) = min(max(z, gamma_l), gamma_u), with gamma_u = 10 in
# the reference implementation and gamma_l = 0).
_LAMB_WEIGHT_NORM_CLIP = 10.0


class Lamb(_ZeroStateOptimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning").

    Per parameter tensor (one "layer")::

        m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g^2
        r = m / (sqrt(v) + eps) + weight_decay * param
        trust = min(||param||, 10) / ||r||   (1 if either norm is 0, or if adam=True)
        param -= lr * trust * r

    As in the reference, the moments are not bias corrected (the paper's v3).
    """

    _zero_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        adam: bool = False,
    ) -> None:
        check_adam_args(type(self).__name__, lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam=adam)
        super().__init__(params, defaults)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, eps = hyper(group, "lr"), hyper(group, "eps")
            beta1, beta2 = group["betas"]
            weight_decay = hyper(group, "weight_decay")
            exp_avgs = state_list(self.state, params, "exp_avg")
            exp_avg_sqs = state_list(self.state, params, "exp_avg_sq")
            update_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)

            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denoms, eps)
            adam_steps = torch._foreach_div(exp_avgs, denoms)
            if weight_decay != 0:
                torch._foreach_add_(adam_steps, params, alpha=weight_decay)

            if group["adam"]:
                trust_ratios = [1.0] * len(params)
            else:
                weight_norms = torch.stack(torch._foreach_norm(params)).float()
                weight_norms = weight_norms.clamp(0, _LAMB_WEIGHT_NORM_CLIP)
                step_norms = torch.stack(torch._foreach_norm(adam_steps)).float()
                usable = (weight_norms > 0) & (step_norms > 0)
                ratios = torch.where(usable, weight_norms / step_norms, 1.0)
                # One read of all ratios: they scale per-tensor updates below.
                trust_ratios = ratios.tolist()
            for p, adam_step, trust in zip(params, adam_steps, trust_ratios):
                p.add_(adam_step, alpha=-lr * trust)


class Lion(_ZeroStateOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")::

    param *= 1 - lr * weight_decay
    param -= lr * sign(beta1 m + (1 - beta1) g)
    m = beta2 m + (1 - beta2) g
    """

    _zero_state = ("exp_avg",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr)
        check_betas(name, betas)
        check_non_negative(name, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, weight_decay = hyper(group, "lr"), hyper(group, "weight_decay")
            beta1, beta2 = group["betas"]
            exp_avgs = state_list(self.state, params, "exp_avg")

            if weight_decay != 0:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
            updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)

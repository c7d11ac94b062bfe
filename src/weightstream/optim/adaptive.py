"""Per-element adaptive step sizes without Adam's moments: Adadelta, Adagrad, RMSprop, Rprop.

Each follows the arithmetic of its torch.optim counterpart step for step
(Note [matching torch.optim bit for bit] in optimizer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from weightstream.optim._common import (
    _ZeroStateOptimizer,
    add_l2,
    check_non_negative,
    check_pair,
    check_unit_interval,
    groups_with_grads,
    hyper,
    state_list,
    zeros_like,
)
from weightstream.optim.optimizer import Optimizer, ParamsT

__all__ = ["Adadelta", "Adagrad", "RMSprop", "Rprop"]


class Adadelta(_ZeroStateOptimizer):
    """Adadelta (Zeiler, 2012)."""

    _zero_state = ("square_avg", "acc_delta")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr)
        check_unit_interval(name, "rho", rho, inclusive_high=True)
        check_non_negative(name, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, rho, eps = hyper(group, "lr"), hyper(group, "rho"), hyper(group, "eps")
            square_avgs = state_list(self.state, params, "square_avg")
            acc_deltas = state_list(self.state, params, "acc_delta")
            grads = add_l2(grads, params, hyper(group, "weight_decay"))

            torch._foreach_mul_(square_avgs, rho)
            torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - rho)
            # delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
            stds = torch._foreach_add(square_avgs, eps)
            torch._foreach_sqrt_(stds)
            deltas = torch._foreach_add(acc_deltas, eps)
            torch._foreach_sqrt_(deltas)
            torch._foreach_div_(deltas, stds)
            torch._foreach_mul_(deltas, grads)
            torch._foreach_mul_(acc_deltas, rho)
            torch._foreach_addcmul_(acc_deltas, deltas, deltas, value=1 - rho)
            torch._foreach_add_(params, deltas, alpha=-lr)


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011) with learning-rate decay ``lr / (1 + (t-1) lr_decay)``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-6,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay)
        check_non_negative(name, initial_accumulator_value=initial_accumulator_value, eps=eps)
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            maximize=maximize,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(
                    p, group["initial_accumulator_value"], memory_format=torch.preserve_format
                )

    def state_names_to_sparsify(self) -> list[str]:
        return ["sum"]

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, lr_decay, eps = hyper(group, "lr"), hyper(group, "lr_decay"), hyper(group, "eps")
            sums = state_list(self.state, params, "sum")
            steps = self._advance_steps(params)
            grads = add_l2(grads, params, hyper(group, "weight_decay"))

            torch._foreach_addcmul_(sums, grads, grads, value=1)
            stds = torch._foreach_sqrt(sums)
            torch._foreach_add_(stds, eps)
            step_sizes = [-(lr / (1 + (s - 1) * lr_decay)) for s in steps]
            torch._foreach_addcdiv_(params, grads, stds, step_sizes)


class RMSprop(_ZeroStateOptimizer):
    """RMSprop (Hinton, 2012), optionally centered (Graves, 2013) and with momentum.

    ``maximize`` is an extension (torch has it).
    """

    _zero_state = ("square_avg", "momentum_buffer", "grad_avg")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr)
        check_unit_interval(name, "alpha", alpha, inclusive_high=True)
        check_non_negative(name, eps=eps, weight_decay=weight_decay, momentum=momentum)
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _zero_state_for(self, group: dict[str, Any]) -> list[str]:
        names = ["square_avg"]
        if group["momentum"] > 0:
            names.append("momentum_buffer")
        if group["centered"]:
            names.append("grad_avg")
        return names

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, alpha, eps = hyper(group, "lr"), hyper(group, "alpha"), hyper(group, "eps")
            momentum = hyper(group, "momentum")
            square_avgs = state_list(self.state, params, "square_avg")
            grads = add_l2(grads, params, hyper(group, "weight_decay"))

            torch._foreach_mul_(square_avgs, alpha)
            torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
            if group["centered"]:
                # Variance instead of raw second moment: E[g^2] - E[g]^2.
                grad_avgs = state_list(self.state, params, "grad_avg")
                torch._foreach_lerp_(grad_avgs, grads, 1 - alpha)
                avgs = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1)
                torch._foreach_sqrt_(avgs)
            else:
                avgs = torch._foreach_sqrt(square_avgs)
            torch._foreach_add_(avgs, eps)

            if momentum > 0:
                bufs = state_list(self.state, params, "momentum_buffer")
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_addcdiv_(bufs, grads, avgs)
                torch._foreach_add_(params, bufs, alpha=-lr)
            else:
                torch._foreach_addcdiv_(params, grads, avgs, value=-lr)


class Rprop(Optimizer):
    """Resilient backpropagation (Riedmiller and Braun, 1993).

    Each element has its own step size, multiplied by ``etas[1]`` while the
    gradient keeps its sign and by ``etas[0]`` when it flips (then that element
    skips one update), clamped to ``step_sizes``. ``lr`` is the initial step
    size, read at a parameter's first step (as torch does). ``maximize`` is an
    extension (torch has it).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50),
        *,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr)
        etaminus, etaplus = check_pair(name, "etas", etas)
        if not 0.0 < etaminus < 1.0 < etaplus:
            raise ValueError(
                f"{name}: etas must satisfy 0 < etas[0] < 1 < etas[1], got {tuple(etas)}. "
                "Fix: e.g. etas=(0.5, 1.2)."
            )
        low, high = check_pair(name, "step_sizes", step_sizes)
        if not 0.0 <= low <= high:
            raise ValueError(
                f"{name}: step_sizes must be (min, max) with 0 <= min <= max, got "
                f"{tuple(step_sizes)}. Fix: e.g. step_sizes=(1e-6, 50)."
            )
        defaults = dict(lr=lr, etas=etas, step_sizes=step_sizes, maximize=maximize)
        super().__init__(params, defaults, enable_global_step=True)

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["prev"] = zeros_like(p)
                state["step_size"] = torch.full_like(
                    p, hyper(group, "lr"), memory_format=torch.preserve_format
                )

    def state_names_to_sparsify(self) -> list[str]:
        return ["prev", "step_size"]

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            etaminus, etaplus = group["etas"]
            step_size_min, step_size_max = group["step_sizes"]
            prevs = state_list(self.state, params, "prev")
            step_sizes = state_list(self.state, params, "step_size")
            steps = self._advance_steps(params)
            for step_size, s in zip(step_sizes, steps):
                if s == 1:
                    step_size.fill_(hyper(group, "lr"))

            # factor = etaplus where g * prev > 0, etaminus where < 0, 1 where == 0
            factors = torch._foreach_mul(grads, prevs)
            torch._foreach_sign_(factors)
            flipped = []
            for factor in factors:
                positive, negative, zero = factor.gt(0), factor.lt(0), factor.eq(0)
                factor.masked_fill_(positive, etaplus)
                factor.masked_fill_(negative, etaminus)
                factor.masked_fill_(zero, 1)
                flipped.append(factor.eq(etaminus))
            torch._foreach_mul_(step_sizes, factors)
            torch._foreach_clamp_min_(step_sizes, step_size_min)
            torch._foreach_clamp_max_(step_sizes, step_size_max)

            # Where the sign flipped, skip the update and forget the gradient.
            grads = [g.masked_fill(mask, 0) for g, mask in zip(grads, flipped)]
            signs = torch._foreach_sign(grads)
            torch._foreach_addcmul_(params, signs, step_sizes, value=-1)
            torch._foreach_copy_(prevs, grads)

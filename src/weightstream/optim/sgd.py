"""SGD (with momentum, dampening, Nesterov) and ASGD (averaged SGD)."""

from __future__ import annotations

from typing import Any

import torch

from weightstream.optim._common import (
    _ZeroStateOptimizer,
    add_l2,
    check_non_negative,
    check_number,
    groups_with_grads,
    hyper,
    state_list,
    zeros_like,
)
from weightstream.optim.compact import LOW_PRECISION, check_kahan, kahan_applies, sgd_step
from weightstream.optim.optimizer import Optimizer, ParamsT

__all__ = ["ASGD", "SGD"]


class SGD(_ZeroStateOptimizer):
    """Stochastic gradient descent, optionally with (Nesterov) momentum.

    Same update as ``torch.optim.SGD``, including its first momentum step
    ``buf = grad`` (not ``(1 - dampening) * grad``); the global step tells which
    step is the first, since the momentum buffer exists (as zeros) beforehand.

    ``kahan_summation`` (default on) keeps a compensation buffer ``kahan_comp`` for
    bfloat16/float16 parameters, updated by a float32 kernel (Note [Kahan summation]
    in optim/compact.py); float32 parameters take torch's arithmetic, bit for bit.
    """

    _zero_state = ("momentum_buffer",)

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        maximize: bool = False,
        *,
        kahan_summation: bool = True,
    ) -> None:
        name = type(self).__name__
        self.kahan_summation = check_kahan(name, kahan_summation)
        check_non_negative(name, lr=lr, momentum=momentum)
        check_number(name, "dampening", dampening)
        check_non_negative(name, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"{name}: nesterov=True needs momentum > 0 and dampening == 0, got "
                f"momentum={momentum}, dampening={dampening}. Fix: set momentum (e.g. 0.9) "
                "and dampening=0, or nesterov=False."
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def _zero_state_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._zero_state if group["momentum"] != 0 else ()

    def preinitialize(self) -> None:
        super().preinitialize()
        for p in self._all_params():
            if kahan_applies(p, self.kahan_summation):
                self.state[p]["kahan_comp"] = zeros_like(p)

    def _low_precision_update(self, group, params, grads, steps) -> None:
        """A float32 kernel per parameter (Note [Kahan summation])."""
        for p, grad, step in zip(params, grads, steps):
            sgd_step(
                p,
                grad,
                self.state[p],
                first=step == 1,
                lr=hyper(group, "lr"),
                momentum=hyper(group, "momentum"),
                dampening=hyper(group, "dampening"),
                weight_decay=hyper(group, "weight_decay"),
                nesterov=group["nesterov"],
            )

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr = hyper(group, "lr")
            momentum = hyper(group, "momentum")
            steps = self._advance_steps(params)
            low = {i for i, p in enumerate(params) if p.dtype in LOW_PRECISION}
            if low:
                pick = sorted(low)
                self._low_precision_update(
                    group,
                    [params[i] for i in pick],
                    [grads[i] for i in pick],
                    [steps[i] for i in pick],
                )
                if len(low) == len(params):
                    continue
                params = [p for i, p in enumerate(params) if i not in low]
                grads = [g for i, g in enumerate(grads) if i not in low]
                steps = [s for i, s in enumerate(steps) if i not in low]
            grads = add_l2(grads, params, hyper(group, "weight_decay"))
            if momentum != 0:
                bufs = state_list(self.state, params, "momentum_buffer")
                first = [i for i, s in enumerate(steps) if s == 1]
                later = [i for i, s in enumerate(steps) if s != 1]
                if first:
                    torch._foreach_copy_([bufs[i] for i in first], [grads[i] for i in first])
                if later:
                    later_bufs = [bufs[i] for i in later]
                    torch._foreach_mul_(later_bufs, momentum)
                    torch._foreach_add_(
                        later_bufs,
                        [grads[i] for i in later],
                        alpha=1 - hyper(group, "dampening"),
                    )
                if group["nesterov"]:
                    grads = torch._foreach_add(grads, bufs, alpha=momentum)
                else:
                    grads = bufs
            torch._foreach_add_(params, grads, alpha=-lr)


class ASGD(Optimizer):
    """Averaged SGD (Polyak and Juditsky, 1992); same update as ``torch.optim.ASGD``.

    State per parameter: ``step``, the current step size ``eta``, the averaging
    coefficient ``mu`` (both float32 scalars, as in torch) and the running
    average ``ax`` of the parameter.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        lambd: float = 1e-4,
        alpha: float = 0.75,
        t0: float = 1e6,
        weight_decay: float = 0,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr, lambd=lambd)
        check_number(name, "alpha", alpha)
        check_number(name, "t0", t0)
        check_non_negative(name, weight_decay=weight_decay)
        defaults = dict(
            lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, maximize=maximize
        )
        super().__init__(params, defaults, enable_global_step=True)

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                # eta is set again from the group's lr at the first step (as torch
                # does), in case a scheduler changed lr after construction.
                state["eta"] = torch.tensor(
                    hyper(group, "lr"), dtype=torch.float32, device=p.device
                )
                state["mu"] = torch.ones((), dtype=torch.float32, device=p.device)
                state["ax"] = zeros_like(p)

    def state_names_to_sparsify(self) -> list[str]:
        return ["ax"]

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr = hyper(group, "lr")
            lambd, alpha, t0 = hyper(group, "lambd"), hyper(group, "alpha"), hyper(group, "t0")
            etas = state_list(self.state, params, "eta")
            mus = state_list(self.state, params, "mu")
            axs = state_list(self.state, params, "ax")
            steps = self._advance_steps(params)
            for eta, s in zip(etas, steps):
                if s == 1:
                    eta.fill_(lr)
            grads = add_l2(grads, params, hyper(group, "weight_decay"))

            eta_values = [eta.item() for eta in etas]
            torch._foreach_mul_(params, [1 - lambd * e for e in eta_values])
            for p, g, e in zip(params, grads, eta_values):
                p.add_(g, alpha=-e)

            # Averaging: ax tracks the parameter itself until t0 (mu == 1), then
            # averages it. mu is read as a Python number, like torch does.
            for p, ax, mu in zip(params, axs, mus):
                mu_value = mu.item()
                if mu_value != 1:
                    ax.add_(p.sub(ax).mul_(mu_value))
                else:
                    ax.copy_(p)

            for eta, mu, s in zip(etas, mus, steps):
                eta.fill_(lr / ((1 + lambd * lr * s) ** alpha))
                mu.fill_(1 / max(1, s - t0))

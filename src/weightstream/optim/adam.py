"""The Adam family: Adam, AdamW, Adamax, NAdam, RAdam.

Each follows the arithmetic of its torch.optim counterpart step for step
(Note [matching torch.optim bit for bit] in optimizer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from weightstream.optim._common import (
    _ZeroStateOptimizer,
    add_l2,
    check_adam_args,
    check_non_negative,
    decay_weights,
    groups_with_grads,
    hyper,
    state_list,
    update_moments,
    zeros_like,
)
from weightstream.optim.compact import (
    adam_step,
    create_moment,
    is_compact,
    kahan_applies,
    parse_state_dtype,
)
from weightstream.optim.optimizer import ParamsT

__all__ = ["Adam", "AdamW", "Adamax", "NAdam", "RAdam"]


class _AdamBase(_ZeroStateOptimizer):
    """Adam and AdamW: one update, differing in how weight decay is applied.

    ``_decoupled_weight_decay`` False: L2, ``grad += weight_decay * param`` (Adam).
    True: ``param *= 1 - lr * weight_decay`` before the update (AdamW).

    ``state_dtype`` stores the moments compactly (float32, bfloat16 or int8 with
    per-block scales: Note [compact optimizer state] in optim/compact.py);
    ``kahan_summation`` keeps a compensation buffer for bfloat16/float16 parameters
    (Note [Kahan summation]). Float32 parameters with float32 state take torch's
    arithmetic, bit for bit; the others a float32 kernel per parameter.
    """

    _decoupled_weight_decay: bool
    _zero_state = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        maximize: bool,
        fused: bool,
        correct_bias: bool,
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        name = type(self).__name__
        check_adam_args(name, lr, betas, eps, weight_decay)
        if fused and not correct_bias:
            raise ValueError(
                f"{name}: fused=True needs correct_bias=True (the fused kernel "
                "always corrects the bias). Fix: drop fused or correct_bias=False."
            )
        # Fixed for the optimizer's life: they decide the state's layout (read by
        # preinitialize, which torch's __init__ reaches through add_param_group).
        self.state_dtype = parse_state_dtype(name, state_dtype)
        if not isinstance(kahan_summation, bool):
            raise TypeError(
                f"{name}: kahan_summation must be True or False, got {kahan_summation!r}."
            )
        self.kahan_summation = kahan_summation
        if fused and self.state_dtype != torch.float32:
            raise ValueError(
                f"{name}: fused=True runs torch's fused kernel on float32 state, but "
                f"state_dtype={self.state_dtype}. Fix: drop fused, or state_dtype=torch.float32."
            )
        if self.state_dtype == torch.int8 and amsgrad:
            raise ValueError(
                f"{name}: amsgrad keeps the running maximum of exp_avg_sq, which int8 state "
                "does not quantize. Fix: amsgrad=False, or state_dtype float32 or bfloat16."
            )
        defaults = dict(
            fused=bool(fused),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            correct_bias=correct_bias,
            decoupled_weight_decay=self._decoupled_weight_decay,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def _zero_state_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._zero_state if group["amsgrad"] else self._zero_state[:2]

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if group.get("fused") and kahan_applies(p, self.kahan_summation):
                    raise ValueError(
                        f"{type(self).__name__}: fused=True keeps no Kahan compensation for "
                        f"a {p.dtype} parameter (shape {tuple(p.shape)}). Fix: "
                        "kahan_summation=False, or drop fused (Note [Kahan summation])."
                    )
                if group.get("fused"):
                    # torch's fused kernel takes state of the parameter's dtype.
                    for key in self._zero_state_for(group):
                        state[key] = zeros_like(p)
                    continue
                for key in self._zero_state_for(group):
                    create_moment(state, p, key, self.state_dtype, signed=key == "exp_avg")
                if kahan_applies(p, self.kahan_summation):
                    state["kahan_comp"] = zeros_like(p)

    def _compact_update(self, group, params, grads) -> None:
        """One float32 kernel per parameter (Note [compact optimizer state])."""
        lr, eps = hyper(group, "lr"), hyper(group, "eps")
        beta1, beta2 = group["betas"]
        steps = self._advance_steps(params)
        for p, grad, step in zip(params, grads, steps):
            adam_step(
                p,
                grad,
                self.state[p],
                step=step,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=hyper(group, "weight_decay"),
                decoupled=group["decoupled_weight_decay"],
                correct_bias=group["correct_bias"],
                amsgrad=group["amsgrad"],
            )

    def _fused_update(self, group, params, grads, exp_avgs, exp_avg_sqs) -> None:
        """One fused kernel over the whole group: the host update at memory speed.

        The same kernel as torch.optim.Adam/AdamW(fused=True), so bitwise equal
        to those (not to the foreach path, which rounds differently).
        """
        steps = self._advance_step_tensors(params)
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        beta1, beta2 = group["betas"]
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_list(self.state, params, "max_exp_avg_sq") if group["amsgrad"] else [],
            steps,
            amsgrad=group["amsgrad"],
            lr=hyper(group, "lr"),
            beta1=beta1,
            beta2=beta2,
            weight_decay=hyper(group, "weight_decay"),
            eps=hyper(group, "eps"),
            maximize=False,  # groups_with_grads already negated the gradients
            grad_scale=None,
            found_inf=None,
        )

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            compact = {i for i, p in enumerate(params) if is_compact(p, self.state[p])}
            if compact and not group.get("fused"):  # fused: torch's kernel, any dtype
                self._compact_update(
                    group, [params[i] for i in sorted(compact)], [grads[i] for i in sorted(compact)]
                )
                if len(compact) == len(params):
                    continue
                params = [p for i, p in enumerate(params) if i not in compact]
                grads = [g for i, g in enumerate(grads) if i not in compact]
            lr, eps = hyper(group, "lr"), hyper(group, "eps")
            beta1, beta2 = group["betas"]
            weight_decay = hyper(group, "weight_decay")
            exp_avgs = state_list(self.state, params, "exp_avg")
            exp_avg_sqs = state_list(self.state, params, "exp_avg_sq")
            if group.get("fused"):
                self._fused_update(group, params, grads, exp_avgs, exp_avg_sqs)
                continue
            steps = self._advance_steps(params)
            grads = decay_weights(params, grads, lr, weight_decay, group["decoupled_weight_decay"])
            update_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)

            second_moments = exp_avg_sqs
            if group["amsgrad"]:
                second_moments = state_list(self.state, params, "max_exp_avg_sq")
                torch._foreach_maximum_(second_moments, exp_avg_sqs)

            # param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
            denoms = torch._foreach_sqrt(second_moments)
            if group["correct_bias"]:
                torch._foreach_div_(denoms, [(1 - beta2**s) ** 0.5 for s in steps])
                step_sizes = [-(lr / (1 - beta1**s)) for s in steps]
            else:
                step_sizes = [-lr] * len(params)
            torch._foreach_add_(denoms, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)


class Adam(_AdamBase):
    """Adam (Kingma and Ba, 2014). ``weight_decay`` is an L2 penalty added to the
    gradient; bias correction is always on. ``maximize`` is an extension (torch has it).
    """

    _decoupled_weight_decay = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        fused: bool = False,
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            fused,
            correct_bias=True,
            state_dtype=state_dtype,
            kahan_summation=kahan_summation,
        )


class AdamW(_AdamBase):
    """AdamW (Loshchilov and Hutter, 2017): decoupled weight decay.

    ``correct_bias=False`` drops the bias correction (the original BERT recipe):
    ``param -= lr * m / (sqrt(v) + eps)``.
    """

    _decoupled_weight_decay = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        correct_bias: bool = True,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        fused: bool = False,
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            fused,
            correct_bias,
            state_dtype=state_dtype,
            kahan_summation=kahan_summation,
        )


class Adamax(_ZeroStateOptimizer):
    """Adamax: Adam with the infinity norm (Kingma and Ba, 2014, section 7)."""

    _zero_state = ("exp_avg", "exp_inf")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        maximize: bool = False,
    ) -> None:
        check_adam_args(type(self).__name__, lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, enable_global_step=True)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, eps = hyper(group, "lr"), hyper(group, "eps")
            beta1, beta2 = group["betas"]
            exp_avgs = state_list(self.state, params, "exp_avg")
            exp_infs = state_list(self.state, params, "exp_inf")
            steps = self._advance_steps(params)
            grads = add_l2(grads, params, hyper(group, "weight_decay"))

            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            # u = max(beta2 u, |g| + eps)
            torch._foreach_mul_(exp_infs, beta2)
            abs_grads = torch._foreach_abs(grads)
            torch._foreach_add_(abs_grads, eps)
            torch._foreach_maximum_(exp_infs, abs_grads)

            step_sizes = [-(lr / (1 - beta1**s)) for s in steps]
            torch._foreach_addcdiv_(params, exp_avgs, exp_infs, step_sizes)


class NAdam(_ZeroStateOptimizer):
    """NAdam: Adam with Nesterov momentum (Dozat, 2016), with the momentum decay
    schedule ``mu_t = beta1 (1 - 0.5 * 0.96^(t * momentum_decay))``.

    ``maximize`` and ``decoupled_weight_decay`` are extensions (torch has them).
    """

    _zero_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum_decay: float = 4e-3,
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
    ) -> None:
        name = type(self).__name__
        check_adam_args(name, lr, betas, eps, weight_decay)
        check_non_negative(name, momentum_decay=momentum_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def preinitialize(self) -> None:
        for p in self._all_params():
            # Product of the momentum schedule mu_1 ... mu_t, a float32 scalar as in torch.
            self.state[p]["mu_product"] = torch.ones((), dtype=torch.float32, device=p.device)
        super().preinitialize()

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, eps = hyper(group, "lr"), hyper(group, "eps")
            beta1, beta2 = group["betas"]
            weight_decay = hyper(group, "weight_decay")
            momentum_decay = hyper(group, "momentum_decay")
            exp_avgs = state_list(self.state, params, "exp_avg")
            exp_avg_sqs = state_list(self.state, params, "exp_avg_sq")
            mu_products = state_list(self.state, params, "mu_product")
            steps = self._advance_steps(params)
            grads = decay_weights(params, grads, lr, weight_decay, group["decoupled_weight_decay"])

            mus = [beta1 * (1.0 - 0.5 * (0.96 ** (s * momentum_decay))) for s in steps]
            mus_next = [beta1 * (1.0 - 0.5 * (0.96 ** ((s + 1) * momentum_decay))) for s in steps]
            torch._foreach_mul_(mu_products, mus)
            products = [t.item() for t in mu_products]
            update_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)

            denoms = torch._foreach_div(exp_avg_sqs, [1 - beta2**s for s in steps])
            torch._foreach_sqrt_(denoms)
            torch._foreach_add_(denoms, eps)
            # The Nesterov step: a gradient term and a momentum term, each with its
            # own bias correction from the momentum products.
            grad_coefs = [(-lr * (1.0 - mu) / (1.0 - prod)) for mu, prod in zip(mus, products)]
            avg_coefs = [
                (-lr * mu_next) / (1.0 - prod * mu_next)
                for mu_next, prod in zip(mus_next, products)
            ]
            torch._foreach_addcdiv_(params, grads, denoms, grad_coefs)
            torch._foreach_addcdiv_(params, exp_avgs, denoms, avg_coefs)


class RAdam(_ZeroStateOptimizer):
    """RAdam (Liu et al., 2019): Adam with the variance of the adaptive learning
    rate rectified; plain momentum SGD while the rectification is undefined
    (approximated SMA length rho_t <= 5).

    ``maximize`` and ``decoupled_weight_decay`` are extensions (torch has them).
    """

    _zero_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
    ) -> None:
        check_adam_args(type(self).__name__, lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
        )
        super().__init__(params, defaults, enable_global_step=True)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads in groups_with_grads(self, groups):
            lr, eps = hyper(group, "lr"), hyper(group, "eps")
            beta1, beta2 = group["betas"]
            weight_decay = hyper(group, "weight_decay")
            exp_avgs = state_list(self.state, params, "exp_avg")
            exp_avg_sqs = state_list(self.state, params, "exp_avg_sq")
            steps = self._advance_steps(params)
            grads = decay_weights(params, grads, lr, weight_decay, group["decoupled_weight_decay"])
            update_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)

            # updates = lr * m / (1 - beta1^t), rectified below where defined.
            updates = torch._foreach_div(exp_avgs, [1 - beta1**s for s in steps])
            torch._foreach_mul_(updates, lr)

            rho_inf = 2 / (1 - beta2) - 1
            rectified: list[int] = []
            rects: list[float] = []
            bias_corrections2: list[float] = []
            for i, s in enumerate(steps):
                bias_correction2 = 1 - beta2**s
                rho_t = rho_inf - 2 * s * (beta2**s) / bias_correction2
                if rho_t > 5.0:
                    rectified.append(i)
                    bias_corrections2.append(bias_correction2)
                    rects.append(
                        (
                            (rho_t - 4)
                            * (rho_t - 2)
                            * rho_inf
                            / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
                        )
                        ** 0.5
                    )
            if rectified:
                # adaptive lr = sqrt(1 - beta2^t) / (sqrt(v) + eps), computed as
                # reciprocal-then-multiply: the order torch's `scalar / tensor` uses.
                adaptive = torch._foreach_sqrt([exp_avg_sqs[i] for i in rectified])
                torch._foreach_add_(adaptive, eps)
                torch._foreach_reciprocal_(adaptive)
                torch._foreach_mul_(adaptive, [bc**0.5 for bc in bias_corrections2])
                rectified_updates = [updates[i] for i in rectified]
                torch._foreach_mul_(rectified_updates, adaptive)
                torch._foreach_mul_(rectified_updates, rects)
            torch._foreach_add_(params, updates, alpha=-1.0)

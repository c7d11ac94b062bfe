"""The Adam family: Adam, AdamW, Adamax, NAdam, RAdam.

Each follows the arithmetic of its torch.optim counterpart step for step
(Note [matching torch.optim bit for bit] in optimizer.py). All of them take
``state_dtype`` and ``kahan_summation`` (Notes [compact optimizer state] and
[Kahan summation] in optim/compact.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

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
    CODES,
    StepScalars,
    adam_step,
    adamax_step,
    check_kahan,
    convert_moment,
    create_moment,
    is_compact,
    kahan_applies,
    nadam_step,
    parse_state_dtype,
    radam_step,
)
from weightstream.optim.optimizer import ParamsT

__all__ = ["Adam", "AdamW", "Adamax", "NAdam", "RAdam"]


class _AdamFamily(_ZeroStateOptimizer):
    """An optimizer of the Adam family: its moments (``_zero_state``) are stored in
    ``state_dtype`` (float32, bfloat16, or int8 codes with per-block scales: Note
    [compact optimizer state] in optim/compact.py), and bfloat16/float16 parameters
    keep a Kahan compensation buffer unless ``kahan_summation=False`` (Note [Kahan
    summation]).

    Each step splits a group's parameters by kernel: float32 parameters with float32
    state take ``_foreach_update``, torch's arithmetic bit for bit; the others
    (compact state, low-precision parameters) ``_kernel`` on decoded float32 chunks,
    one parameter at a time.
    """

    #: The chunked float32 update of one parameter (optim/compact.py).
    _kernel: Callable[..., None]

    def _set_state_format(self, state_dtype: torch.dtype | str, kahan_summation: bool) -> None:
        """Fixed for the optimizer's life: they decide the state's layout. Call before
        ``Optimizer.__init__``, which creates the state."""
        name = type(self).__name__
        self.state_dtype = parse_state_dtype(name, state_dtype)
        self.kahan_summation = check_kahan(name, kahan_summation)

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self._create_param_state(group, p)

    def _create_param_state(self, group: dict[str, Any], p: Tensor) -> None:
        state = self.state[p]
        for key in self._zero_state_for(group):
            create_moment(state, p, key, self.state_dtype)
        if kahan_applies(p, self.kahan_summation):
            state["kahan_comp"] = zeros_like(p)

    def _load_converts(self, saved: Any, key: str) -> bool:
        # A moment coded in int8 on one side only (Note [loading another state format]).
        moment = key.removesuffix("_scale")
        if moment in CODES and moment in saved:
            return (moment + "_scale" in saved) != (self.state_dtype == torch.int8)
        return super()._load_converts(saved, key)

    def _load_converted(self, state: dict[str, Any], saved: Any, key: str) -> None:
        if key.endswith("_scale"):
            return  # written with its moment
        if key in CODES:
            convert_moment(state, saved, key)
        else:
            super()._load_converted(state, saved, key)

    @torch.no_grad()
    def _update(self, groups: list[dict[str, Any]]) -> None:
        for group, params, grads, compact in self._by_kernel(groups):
            if compact:
                self._compact_update(group, params, grads)
            else:
                self._foreach_update(group, params, grads)

    def _by_kernel(
        self, groups: list[dict[str, Any]]
    ) -> Iterator[tuple[dict[str, Any], list[Tensor], list[Tensor], bool]]:
        """``groups_with_grads``, each group split in two: the parameters the float32
        kernel updates (``compact`` True), then the rest."""
        for group, params, grads in groups_with_grads(self, groups):
            # fused: torch's fused kernel, for any dtype (Adam, AdamW).
            kernel = [not group.get("fused") and is_compact(p, self.state[p]) for p in params]
            for compact in (True, False):
                chosen = [i for i, k in enumerate(kernel) if k == compact]
                if chosen:
                    yield group, [params[i] for i in chosen], [grads[i] for i in chosen], compact

    def _compact_update(self, group, params, grads) -> None:
        """One float32 kernel per parameter (Note [compact optimizer state])."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = (hyper(group, k) for k in ("lr", "eps", "weight_decay"))
        steps = self._advance_steps(params)
        per_param = self._kernel_args(group, params, steps)
        for p, grad, step, extra in zip(params, grads, steps, per_param):
            h = StepScalars(step, lr, beta1, beta2, eps, weight_decay)
            self._kernel(p, grad, self.state[p], h, **extra)

    def _adam_moments(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]
    ) -> tuple[list[float], list[Tensor], list[Tensor], list[Tensor]]:
        """The start of Adam's, NAdam's and RAdam's foreach update: advance the steps,
        apply weight decay, update both moments. Returns the steps, the gradients
        (with an L2 term where it applies), ``exp_avg`` and ``exp_avg_sq``."""
        beta1, beta2 = group["betas"]
        exp_avgs = state_list(self.state, params, "exp_avg")
        exp_avg_sqs = state_list(self.state, params, "exp_avg_sq")
        steps = self._advance_steps(params)
        lr, weight_decay = hyper(group, "lr"), hyper(group, "weight_decay")
        grads = decay_weights(params, grads, lr, weight_decay, group["decoupled_weight_decay"])
        update_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)
        return steps, grads, exp_avgs, exp_avg_sqs

    def _kernel_args(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> list[dict[str, Any]]:
        """The kernel's arguments besides the common ones, one dict per parameter."""
        return [{"decoupled": group["decoupled_weight_decay"]}] * len(params)

    def _foreach_update(self, group, params, grads) -> None:
        """torch's arithmetic over the group's float32 parameters with float32 state."""
        raise NotImplementedError


class _AdamBase(_AdamFamily):
    """Adam and AdamW: one update, differing in how weight decay is applied.

    ``_decoupled_weight_decay`` False: L2, ``grad += weight_decay * param`` (Adam).
    True: ``param *= 1 - lr * weight_decay`` before the update (AdamW).
    """

    _decoupled_weight_decay: bool
    _zero_state = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _kernel = staticmethod(adam_step)

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
        self._set_state_format(state_dtype, kahan_summation)
        if fused and self.state_dtype != torch.float32:
            raise ValueError(
                f"{name}: fused=True runs torch's fused kernel on float32 state, but "
                f"state_dtype={self.state_dtype}. Fix: drop fused, or state_dtype=torch.float32."
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

    def _create_param_state(self, group: dict[str, Any], p: Tensor) -> None:
        if not group.get("fused"):
            super()._create_param_state(group, p)
            return
        if kahan_applies(p, self.kahan_summation):
            raise ValueError(
                f"{type(self).__name__}: fused=True keeps no Kahan compensation for "
                f"a {p.dtype} parameter (shape {tuple(p.shape)}). Fix: "
                "kahan_summation=False, or drop fused (Note [Kahan summation])."
            )
        # torch's fused kernel takes state of the parameter's dtype.
        for key in self._zero_state_for(group):
            self.state[p][key] = zeros_like(p)

    def _kernel_args(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> list[dict[str, Any]]:
        args = dict(
            decoupled=group["decoupled_weight_decay"],
            correct_bias=group["correct_bias"],
            amsgrad=group["amsgrad"],
        )
        return [args] * len(params)

    def _fused_update(self, group, params, grads) -> None:
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
            state_list(self.state, params, "exp_avg"),
            state_list(self.state, params, "exp_avg_sq"),
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

    def _foreach_update(self, group, params, grads) -> None:
        """torch's arithmetic over the group, or its fused kernel."""
        if group.get("fused"):
            self._fused_update(group, params, grads)
            return
        lr, eps = hyper(group, "lr"), hyper(group, "eps")
        beta1, beta2 = group["betas"]
        steps, grads, exp_avgs, exp_avg_sqs = self._adam_moments(group, params, grads)

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


class Adamax(_AdamFamily):
    """Adamax: Adam with the infinity norm (Kingma and Ba, 2014, section 7).

    ``state_dtype`` int8 codes ``exp_inf`` unsigned, as its value (Note [compact
    optimizer state] in optim/compact.py).
    """

    _zero_state = ("exp_avg", "exp_inf")
    _kernel = staticmethod(adamax_step)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        maximize: bool = False,
        *,
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        check_adam_args(type(self).__name__, lr, betas, eps, weight_decay)
        self._set_state_format(state_dtype, kahan_summation)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, enable_global_step=True)

    def _kernel_args(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> list[dict[str, Any]]:
        return [{}] * len(params)

    def _foreach_update(self, group, params, grads) -> None:
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


class NAdam(_AdamFamily):
    """NAdam: Adam with Nesterov momentum (Dozat, 2016), with the momentum decay
    schedule ``mu_t = beta1 (1 - 0.5 * 0.96^(t * momentum_decay))``.

    ``maximize`` and ``decoupled_weight_decay`` are extensions (torch has them).
    """

    _zero_state = ("exp_avg", "exp_avg_sq")
    _kernel = staticmethod(nadam_step)

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
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        name = type(self).__name__
        check_adam_args(name, lr, betas, eps, weight_decay)
        check_non_negative(name, momentum_decay=momentum_decay)
        self._set_state_format(state_dtype, kahan_summation)
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

    def _create_param_state(self, group: dict[str, Any], p: Tensor) -> None:
        # Product of the momentum schedule mu_1 ... mu_t, a float32 scalar as in torch.
        self.state[p]["mu_product"] = torch.ones((), dtype=torch.float32, device=p.device)
        super()._create_param_state(group, p)

    def _nesterov_coefficients(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> tuple[list[float], list[float]]:
        """Per parameter, the coefficients of the Nesterov step's gradient term and
        momentum term, each with its own bias correction from the momentum products;
        advances each parameter's ``mu_product``."""
        lr, beta1 = hyper(group, "lr"), group["betas"][0]
        momentum_decay = hyper(group, "momentum_decay")
        mus = [beta1 * (1.0 - 0.5 * (0.96 ** (s * momentum_decay))) for s in steps]
        mus_next = [beta1 * (1.0 - 0.5 * (0.96 ** ((s + 1) * momentum_decay))) for s in steps]
        mu_products = state_list(self.state, params, "mu_product")
        torch._foreach_mul_(mu_products, mus)
        products = [t.item() for t in mu_products]
        grad_coefs = [(-lr * (1.0 - mu) / (1.0 - prod)) for mu, prod in zip(mus, products)]
        avg_coefs = [
            (-lr * mu_next) / (1.0 - prod * mu_next) for mu_next, prod in zip(mus_next, products)
        ]
        return grad_coefs, avg_coefs

    def _kernel_args(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> list[dict[str, Any]]:
        decoupled = group["decoupled_weight_decay"]
        return [
            dict(decoupled=decoupled, grad_coef=grad_coef, avg_coef=avg_coef)
            for grad_coef, avg_coef in zip(*self._nesterov_coefficients(group, params, steps))
        ]

    def _foreach_update(self, group, params, grads) -> None:
        beta2, eps = group["betas"][1], hyper(group, "eps")
        steps, grads, exp_avgs, exp_avg_sqs = self._adam_moments(group, params, grads)
        grad_coefs, avg_coefs = self._nesterov_coefficients(group, params, steps)

        denoms = torch._foreach_div(exp_avg_sqs, [1 - beta2**s for s in steps])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, grads, denoms, grad_coefs)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, avg_coefs)


def _rectification(beta2: float, step: float) -> float | None:
    """RAdam's variance rectification at ``step``; None while it is undefined (the
    approximated SMA length rho_t <= 5)."""
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / (1 - beta2**step)
    if rho_t <= 5.0:
        return None
    return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


class RAdam(_AdamFamily):
    """RAdam (Liu et al., 2019): Adam with the variance of the adaptive learning
    rate rectified; plain momentum SGD while the rectification is undefined
    (approximated SMA length rho_t <= 5).

    ``maximize`` and ``decoupled_weight_decay`` are extensions (torch has them).
    """

    _zero_state = ("exp_avg", "exp_avg_sq")
    _kernel = staticmethod(radam_step)

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
        state_dtype: torch.dtype | str = torch.float32,
        kahan_summation: bool = True,
    ) -> None:
        check_adam_args(type(self).__name__, lr, betas, eps, weight_decay)
        self._set_state_format(state_dtype, kahan_summation)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
        )
        super().__init__(params, defaults, enable_global_step=True)

    def _kernel_args(
        self, group: dict[str, Any], params: list[Tensor], steps: list[float]
    ) -> list[dict[str, Any]]:
        beta2, decoupled = group["betas"][1], group["decoupled_weight_decay"]
        return [dict(decoupled=decoupled, rect=_rectification(beta2, s)) for s in steps]

    def _foreach_update(self, group, params, grads) -> None:
        lr, eps = hyper(group, "lr"), hyper(group, "eps")
        beta1, beta2 = group["betas"]
        steps, _, exp_avgs, exp_avg_sqs = self._adam_moments(group, params, grads)

        # updates = lr * m / (1 - beta1^t), rectified below where defined.
        updates = torch._foreach_div(exp_avgs, [1 - beta1**s for s in steps])
        torch._foreach_mul_(updates, lr)

        rects = [_rectification(beta2, s) for s in steps]
        rectified = [i for i, rect in enumerate(rects) if rect is not None]
        if rectified:
            # adaptive lr = sqrt(1 - beta2^t) / (sqrt(v) + eps), computed as
            # reciprocal-then-multiply: the order torch's `scalar / tensor` uses.
            adaptive = torch._foreach_sqrt([exp_avg_sqs[i] for i in rectified])
            torch._foreach_add_(adaptive, eps)
            torch._foreach_reciprocal_(adaptive)
            torch._foreach_mul_(adaptive, [(1 - beta2 ** steps[i]) ** 0.5 for i in rectified])
            rectified_updates = [updates[i] for i in rectified]
            torch._foreach_mul_(rectified_updates, adaptive)
            torch._foreach_mul_(rectified_updates, [rects[i] for i in rectified])
        torch._foreach_add_(params, updates, alpha=-1.0)

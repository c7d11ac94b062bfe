"""Helpers shared by the optimizer implementations: argument checks, gradient lists."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

# zeros_like places state where the bound engine keeps it (Note [engine binding]).
from weightstream.optim.binding import zeros_like
from weightstream.optim.optimizer import Optimizer


def hyper(group: dict[str, Any], name: str) -> float:
    """A group hyperparameter as a Python number.

    A scheduler may store a 0-dim tensor; its float value is what torch.optim's
    single-tensor code ends up using too.
    """
    value = group[name]
    if isinstance(value, Tensor):
        return value.item()
    return value


# The key of a group's gradients in the copies of param_groups that an overlapped
# step hands to ``Optimizer._update`` (Note [overlapped updates]).
GRADS_KEY = "_weightstream_grads"


def groups_with_grads(
    optimizer: Optimizer, groups: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], list[Tensor], list[Tensor]]]:
    """Each group with a gradient to apply: ``(group, params, grads)``.

    Parameters without a gradient are skipped (as in torch.optim): their state,
    including the step count, is left alone. Where the optimizer takes ``maximize``
    and the group sets it, the gradients are negated copies; ``p.grad`` itself is
    never modified.

    A group handed over by an overlapped step carries its gradients itself
    (``GRADS_KEY``: id(param) -> gradient), taken out of ``p.grad`` when the step
    was scheduled; ``p.grad`` belongs to the caller's thread again by then.
    """
    for group in groups:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        given = group.get(GRADS_KEY)
        for p in group["params"]:
            grad = p.grad if given is None else given.get(id(p))
            if grad is None:
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"{type(optimizer).__name__} does not support sparse gradients (parameter "
                    f"of shape {tuple(p.shape)}). Fix: use dense gradients, e.g. "
                    "nn.Embedding(sparse=False)."
                )
            params.append(p)
            grads.append(grad)
        if not params:
            continue
        if "maximize" in optimizer.defaults and group["maximize"]:
            grads = torch._foreach_neg(grads)
        yield group, params, grads


def add_l2(grads: list[Tensor], params: list[Tensor], weight_decay: float) -> list[Tensor]:
    """``grad + weight_decay * param`` as new tensors (L2 penalty on the gradient)."""
    if weight_decay == 0:
        return grads
    return torch._foreach_add(grads, params, alpha=weight_decay)


def decay_weights(
    params: list[Tensor], grads: list[Tensor], lr: float, weight_decay: float, decoupled: bool
) -> list[Tensor]:
    """Apply weight decay; return the gradients to use.

    Decoupled: ``param *= 1 - lr * weight_decay`` (AdamW); otherwise the L2 penalty
    ``grad + weight_decay * param`` (:func:`add_l2`).
    """
    if weight_decay != 0 and decoupled:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
        return grads
    return add_l2(grads, params, weight_decay)


def update_moments(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: list[Tensor],
    beta1: float,
    beta2: float,
) -> None:
    """Adam's moments: ``m = beta1 m + (1 - beta1) g``;  ``v = beta2 v + (1 - beta2) g^2``."""
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)


def state_list(state: Any, params: list[Tensor], key: str) -> list[Tensor]:
    return [state[p][key] for p in params]


class _ZeroStateOptimizer(Optimizer):
    """An optimizer whose state is zero tensors shaped like each parameter.

    ``_zero_state`` names them all (all follow the parameter's sparsity mask);
    ``_zero_state_for(group)`` those a group needs, by default all of them.
    """

    _zero_state: tuple[str, ...]

    def _zero_state_for(self, group: dict[str, Any]) -> Sequence[str]:
        return self._zero_state

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                for key in self._zero_state_for(group):
                    self.state[p][key] = zeros_like(p)

    def state_names_to_sparsify(self) -> list[str]:
        return list(self._zero_state)


# ----------------------------------------------------------------- validation


def check_number(optimizer: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(
            f"{optimizer}: {name} must be a number, got {type(value).__name__} {value!r}. "
            "(In YAML, write exponents with a dot, e.g. 1.0e-8: PyYAML reads 1e-8 as a string.)"
        )


def check_non_negative(optimizer: str, **values: Any) -> None:
    for name, value in values.items():
        check_number(optimizer, name, value)
        if not value >= 0.0:
            raise ValueError(f"{optimizer}: {name} must be >= 0, got {value}.")


def check_unit_interval(
    optimizer: str, name: str, value: Any, *, inclusive_high: bool = False
) -> None:
    check_number(optimizer, name, value)
    ok = 0.0 <= value <= 1.0 if inclusive_high else 0.0 <= value < 1.0
    if not ok:
        high = "1]" if inclusive_high else "1)"
        raise ValueError(f"{optimizer}: {name} must be in [0, {high}, got {value}.")


def check_pair(optimizer: str, name: str, value: Any) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(
            f"{optimizer}: {name} must be a pair of numbers like (0.9, 0.999), got {value!r}."
        )
    for item in value:
        check_number(optimizer, name, item)
    return value[0], value[1]


def check_betas(optimizer: str, betas: Any) -> None:
    beta1, beta2 = check_pair(optimizer, "betas", betas)
    check_unit_interval(optimizer, "betas[0]", beta1)
    check_unit_interval(optimizer, "betas[1]", beta2)


def check_adam_args(optimizer: str, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    check_non_negative(optimizer, lr=lr)
    check_betas(optimizer, betas)
    check_non_negative(optimizer, eps=eps, weight_decay=weight_decay)

"""Helpers shared by the optimizer implementations: argument checks, gradient lists."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# zeros_like places state where the bound engine keeps it (Note [engine binding]).
from weightstream.optim.binding import zeros_like  # noqa: F401


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """Evaluate the loss closure with autograd on (``step`` itself runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


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


def collect_grads(
    optimizer_name: str, group: dict[str, Any], maximize: bool = False
) -> tuple[list[Tensor], list[Tensor]]:
    """The group's parameters that have a gradient, and those gradients.

    Parameters without a gradient are skipped (as in torch.optim): their state,
    including the step count, is left alone. With ``maximize`` the returned
    gradients are negated copies; ``p.grad`` itself is never modified.

    A group handed over by an overlapped step carries its gradients itself
    (``GRADS_KEY``: id(param) -> gradient), taken out of ``p.grad`` when the step
    was scheduled; ``p.grad`` belongs to the caller's thread again by then.
    """
    params: list[Tensor] = []
    grads: list[Tensor] = []
    given = group.get(GRADS_KEY)
    for p in group["params"]:
        grad = p.grad if given is None else given.get(id(p))
        if grad is None:
            continue
        if grad.is_sparse:
            raise ValueError(
                f"{optimizer_name} does not support sparse gradients (parameter of shape "
                f"{tuple(p.shape)}). Fix: use dense gradients, e.g. nn.Embedding(sparse=False)."
            )
        params.append(p)
        grads.append(grad)
    if maximize and grads:
        grads = torch._foreach_neg(grads)
    return params, grads


def add_l2(grads: list[Tensor], params: list[Tensor], weight_decay: float) -> list[Tensor]:
    """``grad + weight_decay * param`` as new tensors (L2 penalty on the gradient)."""
    if weight_decay == 0:
        return grads
    return torch._foreach_add(grads, params, alpha=weight_decay)


def state_list(state: Any, params: list[Tensor], key: str) -> list[Tensor]:
    return [state[p][key] for p in params]


# ----------------------------------------------------------------- validation


def check_number(optimizer: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(
            f"{optimizer}: {name} must be a number, got {type(value).__name__} {value!r}. "
            "(In YAML, write exponents with a dot, e.g. 1.0e-8: PyYAML reads 1e-8 as a string.)"
        )


def check_non_negative(optimizer: str, name: str, value: Any) -> None:
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

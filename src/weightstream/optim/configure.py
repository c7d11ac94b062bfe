"""Building optimizers and parameter groups from configuration (params files, dicts)."""

from __future__ import annotations

import difflib
import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from weightstream.common.schema import named_subclasses
from weightstream.optim.optimizer import Optimizer, ParamsT

__all__ = ["configure_optimizer", "is_norm_layer", "param_groups_with_weight_decay"]

# Keys of older params files, each replaced by one argument taking a pair.
_RETIRED_ALIASES = {
    "weight_decay_rate": ("weight_decay", "weight_decay=<rate>"),
    "beta1": ("betas", "betas=(beta1, beta2)"),
    "beta2": ("betas", "betas=(beta1, beta2)"),
    "eps1": ("eps", "eps=(eps1, eps2)"),
    "eps2": ("eps", "eps=(eps1, eps2)"),
    "eta1": ("etas", "etas=(eta1, eta2)"),
    "eta2": ("etas", "etas=(eta1, eta2)"),
    "step_size_min": ("step_sizes", "step_sizes=(step_size_min, step_size_max)"),
    "step_size_max": ("step_sizes", "step_sizes=(step_size_min, step_size_max)"),
}

# lr given to the constructor when `learning_rate` is a schedule (a dict or a
# list of dicts): configure_lr_scheduler writes the real value into every group
# before the first step. Optimizers read lr only inside step() (Rprop and ASGD
# read it at a parameter's first step), so the placeholder is never used.
_SCHEDULED_LR_PLACEHOLDER = 0.0


def configure_optimizer(optimizer_type: str, params: ParamsT, **kwargs: Any) -> Optimizer:
    """Construct the optimizer named ``optimizer_type`` (``cstorch.optim.configure_optimizer``).

    * ``optimizer_type`` matches the name of a :class:`weightstream.optim.Optimizer`
      subclass case-insensitively; user subclasses count once their module is imported.
    * ``learning_rate`` is passed on as ``lr``. A number (or numeric string) is the
      constant rate; a schedule (dict or list of dicts, for ``configure_lr_scheduler``)
      gives a placeholder lr that the scheduler overwrites.
    * an ``optim_params`` dict is merged into the keyword arguments.
    * only arguments the constructor takes are passed; retired aliases (``beta1``,
      ``weight_decay_rate``, ...) raise a ValueError naming the replacement, any
      other unknown key is dropped with a warning.
    """
    if not isinstance(optimizer_type, str):
        raise TypeError(
            f"configure_optimizer: optimizer_type must be the optimizer's name as a string "
            f"(e.g. 'AdamW'), got {type(optimizer_type).__name__}."
        )
    cls = _lookup(optimizer_type)
    options = _merge_optim_params(kwargs)
    if "learning_rate" in options:
        if "lr" in options:
            raise ValueError(
                "configure_optimizer: both 'learning_rate' and 'lr' are given. Fix: keep one."
            )
        options["lr"] = _learning_rate(options.pop("learning_rate"))

    accepted, takes_any = _constructor_arguments(cls)
    if takes_any:
        return cls(params, **options)
    retired = [key for key in options if key in _RETIRED_ALIASES and key not in accepted]
    if retired:
        fixes = "; ".join(
            f"'{key}' -> '{_RETIRED_ALIASES[key][0]}' (write {_RETIRED_ALIASES[key][1]})"
            for key in retired
        )
        raise ValueError(
            f"configure_optimizer({cls.__name__}): retired argument(s) {retired}. "
            f"Fix: replace {fixes}."
        )
    unknown = [key for key in options if key not in accepted]
    # Compact state asked for and not kept would hold 2-4x the bytes it was chosen to
    # save, trained silently at full width: an error, not an ignored key.
    compact = [key for key in ("state_dtype", "kahan_summation") if key in unknown]
    if compact:
        takers = sorted(
            c.__name__
            for c in {c for classes in _optimizer_classes().values() for c in classes}
            if set(compact) <= _constructor_arguments(c)[0]
        )
        raise ValueError(
            f"configure_optimizer({cls.__name__}): {cls.__name__} keeps its state in the "
            f"parameters' dtype and takes no {' or '.join(compact)} (compact optimizer "
            f"state); {', '.join(takers)} do. Fix: remove optimizer.{compact[0]}, or "
            "choose one of those."
        )
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(accepted), n=1) for k in unknown}
        typos = "".join(f" Did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
        warnings.warn(
            f"configure_optimizer({cls.__name__}): ignoring {unknown}, which "
            f"{cls.__name__} does not take (it takes {sorted(accepted)}).{typos}",
            UserWarning,
            stacklevel=2,
        )
    return cls(params, **{key: value for key, value in options.items() if key in accepted})


def _optimizer_classes() -> dict[str, list[type[Optimizer]]]:
    """Concrete public Optimizer subclasses, by lower-case name."""
    found: dict[str, list[type[Optimizer]]] = {}
    for cls in named_subclasses(Optimizer):
        found.setdefault(cls.__name__.lower(), []).append(cls)
    return found


def _lookup(optimizer_type: str) -> type[Optimizer]:
    classes = _optimizer_classes()
    matches = classes.get(optimizer_type.lower())
    if not matches:
        names = sorted(cls.__name__ for group in classes.values() for cls in group)
        close = difflib.get_close_matches(optimizer_type.lower(), list(classes), n=3, cutoff=0.6)
        hint = ""
        if close:
            hint = " Did you mean " + " or ".join(repr(classes[c][0].__name__) for c in close) + "?"
        raise ValueError(
            f"configure_optimizer: unknown optimizer_type {optimizer_type!r}.{hint} "
            f"Valid names (case-insensitive): {', '.join(names)}. A custom optimizer must "
            "subclass weightstream.optim.Optimizer and be imported before this call."
        )
    if len(matches) > 1:
        qualified = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in matches)
        raise ValueError(
            f"configure_optimizer: optimizer_type {optimizer_type!r} matches several classes: "
            f"{qualified}. Fix: give your optimizer class a distinct name."
        )
    return matches[0]


def _merge_optim_params(kwargs: dict[str, Any]) -> dict[str, Any]:
    options = dict(kwargs)
    nested = options.pop("optim_params", None)
    if nested is None:
        return options
    if not isinstance(nested, Mapping):
        raise TypeError(
            f"configure_optimizer: optim_params must be a dict of optimizer arguments, "
            f"got {type(nested).__name__}."
        )
    for key, value in nested.items():
        if key in options and not _same(options[key], value):
            raise ValueError(
                f"configure_optimizer: {key!r} is given both directly ({options[key]!r}) and "
                f"in optim_params ({value!r}). Fix: keep one."
            )
        options[key] = value
    return options


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors of several elements
        return a is b


def _learning_rate(value: Any) -> Any:
    if isinstance(value, bool):
        raise TypeError("configure_optimizer: learning_rate must be a number, got a bool.")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(
                f"configure_optimizer: learning_rate {value!r} is not a number. Fix: write a "
                "number, or a schedule (dict or list of dicts) for configure_lr_scheduler."
            ) from None
    if isinstance(value, (Mapping, list, tuple)):
        return _SCHEDULED_LR_PLACEHOLDER
    # A tensor or another number type: the constructor validates it.
    return value


def _constructor_arguments(cls: type) -> tuple[set[str], bool]:
    """Keyword arguments ``cls(params, ...)`` takes, and whether it takes ``**kwargs``."""
    arguments = list(inspect.signature(cls.__init__).parameters.values())[2:]  # after self, params
    names = {a.name for a in arguments if a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)}
    return names, any(a.kind is a.VAR_KEYWORD for a in arguments)


# ------------------------------------------------------------------ param groups

_NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

# Class names of norm layers defined outside torch: LlamaRMSNorm, T5LayerNorm,
# FusedLayerNorm, MyBatchNorm2d, ...
_NORM_NAME = re.compile(r"Norm(\d[dD])?$")


def is_norm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer (its parameters get no weight decay)."""
    return isinstance(module, _NORM_LAYERS) or any(
        _NORM_NAME.search(cls.__name__) for cls in type(module).__mro__
    )


def param_groups_with_weight_decay(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups applying ``weight_decay`` except to biases and norm layers.

    Returns ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...],
    "weight_decay": 0.0}]`` (a group with no parameters is left out). A parameter
    gets no weight decay when its own name is ``bias`` or its module is a norm
    layer (:func:`is_norm_layer`). Every parameter of the model appears once
    (a shared parameter is grouped where it first appears), in
    ``model.parameters()`` order, frozen ones included, as with ``model.parameters()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"param_groups_with_weight_decay: model must be a torch.nn.Module, "
            f"got {type(model).__name__}."
        )
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        norm = is_norm_layer(module)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if norm or name == "bias" else decay).append(p)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups

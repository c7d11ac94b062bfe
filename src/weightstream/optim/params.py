"""The params file's ``optimizer`` section: the optimizer, its learning-rate schedule,
clipping and loss scaling."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from weightstream.common.schema import (
    as_section,
    check,
    convert,
    got,
    init_names,
    plain,
    require,
    setting,
    split_extra,
    unknown_keys_error,
)

__all__ = ["OptimizerParams"]

_OPTIMIZER_KWARG_FIELDS = ("weight_decay", "betas", "eps", "momentum", "state_dtype")
_DYNAMIC_ONLY = ("initial_loss_scale", "steps_per_increase", "min_loss_scale", "max_loss_scale")


@dataclass
class OptimizerParams:
    """``optimizer``: the optimizer, its learning-rate schedule, clipping and loss scaling.

    ``learning_rate`` is a number, a numeric string, or a scheduler spec (a dict or a
    list of dicts) passed on unchanged to ``configure_lr_scheduler``. ``None`` for an
    optimizer argument means the optimizer's own default. Keys that are not fields
    (``nesterov``, ``amsgrad``, ...) go to ``extra`` and must be arguments of the
    optimizer's constructor.
    """

    optimizer_type: str = setting(
        doc="The optimizer's class name (SGD, Adam, AdamW, Adafactor, Lamb, ...: "
        "weightstream.optim); its other constructor arguments go in the same section."
    )
    learning_rate: float | str | dict[str, Any] | list[dict[str, Any]] | None = setting(
        None,
        doc="A number, or a scheduler (scheduler: CosineDecay, ...) or a list of them "
        "(configure_lr_scheduler); null: the optimizer's default.",
    )
    weight_decay: float | None = setting(
        None,
        ge=0,
        doc="The optimizer's weight decay (null: its default, 0 for Adam and AdamW, where "
        "torch.optim.AdamW takes 0.01). The run command applies it to every parameter "
        "but biases and norm layers' weights (cstorch.optim.param_groups_with_weight_decay), "
        "as the reference's model zoo does; to compare with torch.optim over "
        "model.parameters(), use those groups there too.",
    )
    betas: tuple[float, float] | None = setting(
        None, doc="The Adam family's two moment decays, each in [0, 1)."
    )
    eps: float | tuple[float, float] | None = setting(
        None,
        gt=0,
        doc="The optimizer's epsilon (two numbers for Adafactor; null: its default, 1e-6 for "
        "Adam and AdamW as in the reference API, where torch.optim takes 1e-8).",
    )
    momentum: float | None = setting(None, ge=0, doc="SGD's (and RMSprop's) momentum.")
    state_dtype: Literal["float32", "bfloat16", "int8"] | None = setting(
        None,
        doc="The Adam family (Adam, AdamW, NAdam, RAdam, Adamax): the dtype of the two "
        "moments. float32 (8 bytes a parameter), bfloat16 (4), int8 (2, with one float32 "
        "scale per block of 256: Note [compact optimizer state] in optim/compact.py); "
        "null: float32. A run may resume from a checkpoint of another state_dtype: its "
        "moments load converted (Note [loading another state format]).",
    )
    max_gradient_norm: float | None = setting(
        None, ge=0, doc="Clip the gradients' global norm to this (excludes max_gradient_value)."
    )
    max_gradient_value: float | None = setting(
        None, ge=0, doc="Clip each gradient element to [-value, value]."
    )
    loss_scaling_factor: float | Literal["dynamic"] | None = setting(
        None, doc="Loss scaling of mixed precision: a fixed number or 'dynamic'; null: none."
    )
    initial_loss_scale: float | None = setting(
        None, gt=0, doc="Dynamic loss scaling's first scale."
    )
    steps_per_increase: int | None = setting(
        None, ge=1, doc="Dynamic loss scaling doubles the scale after this many finite steps."
    )
    min_loss_scale: float | None = setting(None, gt=0, doc="Dynamic loss scaling's floor.")
    max_loss_scale: float | None = setting(None, gt=0, doc="Dynamic loss scaling's ceiling.")
    grad_accum_steps: int = setting(
        1,
        ge=1,
        doc="Loader batches per step: each step takes this many batches of batch_size and "
        "sums their gradients (the step's batch: batch_size x grad_accum_steps).",
    )
    adjust_learning_rate: dict[str, float] | None = setting(
        None,
        doc="Per-layer learning-rate factors: parameter-name patterns to factors "
        "(configure_lr_scheduler's adjust_learning_rate).",
    )
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = "optimizer"
        self.learning_rate = _check_learning_rate(self.learning_rate)
        check(self, s, skip=("learning_rate",))
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"{s}.betas must be two numbers in [0, 1), got {list(self.betas)}. "
                f"Fix: e.g. betas: [0.9, 0.999]."
            )
        if self.max_gradient_norm is not None and self.max_gradient_value is not None:
            raise ValueError(
                f"{s}: max_gradient_norm and max_gradient_value are both set; gradients are "
                f"clipped by norm or by value, not both. Fix: remove one of them."
            )
        if isinstance(self.loss_scaling_factor, float) and self.loss_scaling_factor <= 0:
            raise ValueError(
                f"{s}.loss_scaling_factor must be > 0 or 'dynamic', got "
                f"{self.loss_scaling_factor!r}. Fix: use 'dynamic', a positive number, or "
                f"remove it for no loss scaling."
            )
        if (
            self.min_loss_scale is not None
            and self.max_loss_scale is not None
            and self.min_loss_scale > self.max_loss_scale
        ):
            raise ValueError(
                f"{s}: min_loss_scale ({self.min_loss_scale}) is larger than max_loss_scale "
                f"({self.max_loss_scale}). Fix: swap them."
            )
        dynamic_only = [n for n in _DYNAMIC_ONLY if getattr(self, n) is not None]
        if dynamic_only and self.loss_scaling_factor != "dynamic":
            warnings.warn(
                f"{s}: {', '.join(dynamic_only)} only apply to dynamic loss scaling and are "
                f"ignored because loss_scaling_factor is {self.loss_scaling_factor!r}. Set "
                f"loss_scaling_factor: dynamic to use them.",
                UserWarning,
                stacklevel=3,
            )
        _check_optimizer_extra(self.optimizer_type, self.extra)

    @classmethod
    def from_dict(cls, raw: Any) -> OptimizerParams:
        values = as_section("optimizer", raw)
        require("optimizer", values, "optimizer_type", "optimizer_type: <name, e.g. AdamW>")
        known, extra = split_extra("optimizer", cls, values)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update(plain(out.pop("extra")))
        return out

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``configure_optimizer(optimizer_type, params, **kwargs)``:
        learning_rate and the optimizer arguments that are set (None ones are left to the
        optimizer's defaults), plus ``extra``."""
        kwargs: dict[str, Any] = {}
        if self.learning_rate is not None:
            kwargs["learning_rate"] = copy.deepcopy(self.learning_rate)
        for name in _OPTIMIZER_KWARG_FIELDS:
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        kwargs.update(copy.deepcopy(self.extra))
        return kwargs

    def grad_scaler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`weightstream.amp.GradScaler`."""
        return {
            "loss_scale": self.loss_scaling_factor,
            "init_scale": self.initial_loss_scale,
            "steps_per_increase": self.steps_per_increase,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }


def _check_learning_rate(value: Any) -> Any:
    path = "optimizer.learning_rate"
    fix = (
        "Fix: write a number (learning_rate: 1.0e-3), a scheduler dict "
        "({scheduler: CosineDecay, ...}) or a list of scheduler dicts."
    )
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{path} must be a number or a schedule, got {got(value)}. {fix}")
    if isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{path}: {got(value)} is not a number. {fix}") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{path} must be a finite number >= 0, got {got(value)}. {fix}")
        return value if isinstance(value, str) else number
    entries = [value] if isinstance(value, Mapping) else value
    if not isinstance(entries, (list, tuple)) or not entries:
        raise TypeError(f"{path} must be a number or a schedule, got {got(value)}. {fix}")
    for index, entry in enumerate(entries):
        where = path if isinstance(value, Mapping) else f"{path}[{index}]"
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where} must be a scheduler dict, got {got(entry)}. {fix}")
        if not isinstance(entry.get("scheduler"), str):
            raise ValueError(
                f"{where} needs a 'scheduler' key naming the scheduler (e.g. scheduler: "
                f"CosineDecay), got keys {sorted(map(str, entry))}."
            )
        convert(where, entry, dict[str, Any])  # string keys
    return plain(value)


def _check_optimizer_extra(optimizer_type: str, extra: dict[str, Any]) -> None:
    """Extra keys must be constructor arguments of the named optimizer.

    An unknown optimizer_type is configure_optimizer's error, not this one's: then the
    extra keys are left for it to judge.
    """
    from weightstream.optim import configure as optim_configure

    fields = [n for n in init_names(OptimizerParams) if n != "extra"]
    keys = dict(extra)
    nested = keys.pop("optim_params", None)
    if nested is not None:
        keys.update(convert("optimizer.optim_params", nested, dict[str, Any]))
    if "lr" in keys:
        raise ValueError(
            "optimizer.lr: write the learning rate as 'learning_rate' (the params-file name)."
        )
    try:
        cls = optim_configure._lookup(optimizer_type)
    except ValueError:
        cls = None
    accepted, takes_any = optim_configure._constructor_arguments(cls) if cls else (set(), True)
    for key in keys:
        # Adafactor still takes beta1: retired only for optimizers that do not.
        if key in optim_configure._RETIRED_ALIASES and key not in accepted:
            new, example = optim_configure._RETIRED_ALIASES[key]
            raise ValueError(
                f"optimizer.{key} is a retired name. Fix: use '{new}' (write {example})."
            )
    unknown = [k for k in keys if k not in accepted and k not in fields]
    if unknown and not takes_any:
        raise unknown_keys_error(
            f"optimizer ({cls.__name__})", unknown, sorted(set(fields) | (accepted - {"lr"}))
        )

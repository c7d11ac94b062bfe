"""Loss scaling for mixed precision training: no scaling, static, or dynamic.

Usage is that of ``torch.amp.GradScaler``::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)      # optional, e.g. to clip the true gradients
    scaler.step(optimizer)          # skipped when the gradients are not finite (dynamic)
    scaler.update()                 # adjusts the dynamic loss scale

Note [dynamic loss scaling]: in dynamic mode the decision whether a step is
applied is made from the global L2 norm over every gradient unscaled since the
last ``update()`` (the reference system's check, one number for the whole
model rather than torch's per-tensor check): if that norm is not finite, no
``optimizer.step()`` runs, so parameters and optimizer state are left exactly
as they were, and :mod:`weightstream.amp.skip` records the skip so LR
schedulers do not advance. The decision is taken at each ``step()`` from the
gradients unscaled so far, so with several optimizers call ``unscale_`` on each
of them before the first ``step()`` to make it cover all of them. ``update()``
then moves the scale with the reference algorithm: halve when the fraction of
non-finite steps since the last rescale exceeds ``overflow_tolerance``, double
after more than ``steps_per_increase`` steps without a rescale, clamp to
[min_loss_scale, max_loss_scale].

Note [float32 scale]: the reference keeps the loss scale in a float32 tensor
and does its arithmetic in float32. The scale here is a Python float that is
always a float32 value, and the few computations whose rounding could differ
(reciprocal, overflow ratio) are done in float32 with numpy, so the sequence of
scales and the unscaled gradients are those of the reference.
"""

from __future__ import annotations

import math
import warnings
import weakref
from enum import Enum, auto
from typing import Any

import numpy as np
import torch

from weightstream.amp import skip
from weightstream.amp.half import half_dtype_setting

__all__ = ["GradScaler", "OptState"]

_MIN_DYNAMIC_LOSS_SCALE = 2.0**-14
# The seeds' default (seed 003's table); they win over the API reference's 0.0.
DEFAULT_OVERFLOW_TOLERANCE = 0.05


class OptState(Enum):
    """Where one optimizer is in the scale/unscale/step cycle of the current iteration.

    READY: nothing done since the last ``update()``.
    SCALED: a loss was scaled; the gradients (once computed) carry the scale.
    UNSCALED: the gradients were divided by the scale (and checked, in dynamic mode).
    STEPPED: ``step()`` ran (or was skipped); only ``update()`` may follow.
    """

    READY = auto()
    SCALED = auto()
    UNSCALED = auto()
    STEPPED = auto()


def _f32(value: float) -> float:
    """``value`` rounded to float32; see Note [float32 scale]."""
    return float(np.float32(value))


def _check_number(name: str, value: Any, *, positive: bool, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"GradScaler(): {name} must be a number, got {type(value).__name__} {value!r}."
        )
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"GradScaler(): {name} must be a finite number {bound}, got {value!r}.")


class GradScaler:
    """Scales the loss so that half precision gradients do not underflow.

    Args:
        loss_scale: None, 0 or 1.0: no scaling (the default); a positive number:
            static scaling by that number; "dynamic": dynamic loss scaling.
        init_scale: first loss scale in dynamic mode (default 2**31 when the
            half type is cbfloat16, else 2**15), capped at ``max_loss_scale``.
        steps_per_increase: the scale doubles after more than this many steps
            without a rescale (default 2000).
        min_loss_scale: lower bound of the dynamic scale (default and least
            allowed 2**-14).
        max_loss_scale: upper bound of the dynamic scale (default as init_scale).
        overflow_tolerance: the scale halves when the fraction of non-finite
            steps since the last rescale exceeds it (default 0.05, the seeds' value;
            the wider API reference gives 0, where any overflow halves it). An overflow
            after 20 or more clean steps then skips its step without halving.
        max_gradient_norm: dynamic mode only: clip the gradients by this global
            norm inside ``step()`` (prefer ``torch.nn.utils.clip_grad_norm_``
            after ``unscale_``).

    The settings other than ``loss_scale`` apply to dynamic mode only; setting
    them otherwise gives a warning. See Note [dynamic loss scaling].
    """

    def __init__(
        self,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = DEFAULT_OVERFLOW_TOLERANCE,
        max_gradient_norm: float | None = None,
    ) -> None:
        if isinstance(loss_scale, str):
            if loss_scale != "dynamic":
                hint = (
                    ' (did you mean "dynamic"?)' if loss_scale.strip().lower() == "dynamic" else ""
                )
                raise ValueError(
                    f'GradScaler(): loss_scale must be None, a positive number or "dynamic", '
                    f"got {loss_scale!r}{hint}."
                )
        else:
            _check_number("loss_scale", loss_scale, positive=False)
        _check_number("init_scale", init_scale, positive=True)
        _check_number("min_loss_scale", min_loss_scale, positive=True)
        _check_number("max_loss_scale", max_loss_scale, positive=True)
        _check_number("overflow_tolerance", overflow_tolerance, positive=False, allow_none=False)
        _check_number("max_gradient_norm", max_gradient_norm, positive=True)
        if steps_per_increase is not None and (
            isinstance(steps_per_increase, bool) or not isinstance(steps_per_increase, int)
        ):
            raise TypeError(
                f"GradScaler(): steps_per_increase must be an int, got "
                f"{type(steps_per_increase).__name__} {steps_per_increase!r}."
            )
        if steps_per_increase is not None and steps_per_increase < 1:
            raise ValueError(
                f"GradScaler(): steps_per_increase must be >= 1, got {steps_per_increase}."
            )

        self._dynamic = loss_scale == "dynamic"
        # 0 also means "no scaling": the reference documents 0.0 as the default.
        self._scaling = self._dynamic or loss_scale not in (None, 0, 1.0)
        default_max = 2.0**31 if half_dtype_setting.name == "cbfloat16" else 2.0**15
        self._steps_per_increase = 2000 if steps_per_increase is None else steps_per_increase
        self._min_loss_scale = _f32(
            _MIN_DYNAMIC_LOSS_SCALE if min_loss_scale is None else min_loss_scale
        )
        self._max_loss_scale = _f32(default_max if max_loss_scale is None else max_loss_scale)
        self._overflow_tolerance = float(overflow_tolerance)
        self._max_gradient_norm = max_gradient_norm if self._dynamic else None

        if self._dynamic:
            if self._min_loss_scale < _MIN_DYNAMIC_LOSS_SCALE:
                raise ValueError(
                    f"GradScaler(): min_loss_scale must be >= 2**-14 in dynamic mode, "
                    f"got {min_loss_scale!r}."
                )
            if self._min_loss_scale > self._max_loss_scale:
                raise ValueError(
                    f"GradScaler(): min_loss_scale ({min_loss_scale!r}) is larger than "
                    f"max_loss_scale ({self._max_loss_scale!r}); lower min_loss_scale or raise "
                    "max_loss_scale."
                )
            init = default_max if init_scale is None else init_scale
            self._loss_scale = _f32(min(init, self._max_loss_scale))
        else:
            ignored = {
                "init_scale": init_scale,
                "steps_per_increase": steps_per_increase,
                "min_loss_scale": min_loss_scale,
                "max_loss_scale": max_loss_scale,
                "max_gradient_norm": max_gradient_norm,
            }
            set_names = [name for name, value in ignored.items() if value is not None]
            if overflow_tolerance != DEFAULT_OVERFLOW_TOLERANCE:
                set_names.append("overflow_tolerance")
            if set_names:
                warnings.warn(
                    f"GradScaler(): {', '.join(set_names)} only apply to dynamic loss scaling and "
                    f'are ignored with loss_scale={loss_scale!r}; pass loss_scale="dynamic" to '
                    "use them.",
                    stacklevel=2,
                )
            self._loss_scale = _f32(loss_scale) if self._scaling else 1.0

        # Dynamic-mode counters (state_dict keys of the same names).
        self._steps_since_rescale = 0
        self._overflows_since_rescale = 0
        self._num_skipped_steps = 0

        # Per-iteration state, reset by update() (stages back to READY; an
        # optimizer stays known so the next scale() marks it SCALED). Stages
        # are keyed weakly by the optimizer so nothing is stored on it and it
        # is never kept alive.
        self._stages: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptState] = (
            weakref.WeakKeyDictionary()
        )
        self._squared_norms: list[torch.Tensor] = []
        self._global_norm: torch.Tensor | None = None
        self._isfinite: bool | None = None
        # The engine of an optimizer unscaled this iteration whose gradients are
        # spread over the ranks (a sharded store): the non-finite check must see
        # all of them (Note [sharded store]). Reached through the optimizer's
        # binding (Note [engine binding]).
        self._sharded_engine = None

    # ----------------------------------------------------------------- queries

    @property
    def dynamic(self) -> bool:
        """True in dynamic loss scaling mode."""
        return self._dynamic

    def is_enabled(self) -> bool:
        """True when the loss is scaled (static or dynamic), as torch.amp.GradScaler."""
        return self._scaling

    def get_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self._loss_scale

    def get_num_skipped_steps(self) -> int:
        """How many optimizer steps were skipped for non-finite gradients."""
        return self._num_skipped_steps

    @property
    def global_norm(self) -> torch.Tensor | None:
        """Global L2 norm of the unscaled gradients at the latest dynamic-mode decision."""
        return self._global_norm

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """Where ``optimizer`` is in the current iteration (see :class:`OptState`)."""
        return self._stages.get(optimizer, OptState.READY)

    # --------------------------------------------------------------- the cycle

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` multiplied by the loss scale (``loss`` itself without scaling).

        Several losses may be scaled in one iteration (gradient accumulation),
        but not after ``unscale_`` or ``step`` until ``update()``.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"GradScaler.scale() expects the loss tensor, got {type(loss).__name__}."
            )
        for optimizer, stage in list(self._stages.items()):
            if stage in (OptState.UNSCALED, OptState.STEPPED):
                raise RuntimeError(
                    f"GradScaler.scale() called after unscale_() or step() of {type(optimizer).__name__} "
                    "in the same iteration; call update() first, so that scaled and unscaled "
                    "gradients do not mix."
                )
            self._stages[optimizer] = OptState.SCALED
        if not self._scaling:
            return loss
        # In float32 even for a half loss, where a large scale would overflow.
        return loss.float() * self._loss_scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the loss scale, in place.

        Call it at most once per optimizer between ``update()`` calls, before
        ``step()`` (which otherwise calls it). In dynamic mode the gradients'
        squared norms join the global norm that decides whether steps are
        applied.
        """
        _check_optimizer(optimizer, "unscale_")
        stage = self.stage(optimizer)
        if stage is OptState.UNSCALED:
            raise RuntimeError(
                "GradScaler.unscale_() has already been called on this optimizer since the last "
                "update(); call it once per iteration (step() does not unscale again)."
            )
        if stage is OptState.STEPPED:
            raise RuntimeError(
                "GradScaler.unscale_() called after step() on this optimizer; call unscale_() "
                "before step(), or update() to start the next iteration."
            )
        engine = getattr(optimizer, "engine", None)
        if engine is not None and engine.grads_sharded:
            self._sharded_engine = engine
        grads = _grads_of(optimizer)
        if self._scaling:
            # Correctly rounded float32 reciprocal, as the reference: exact for
            # the powers of two that dynamic scaling uses.
            inv_scale = float(np.float32(1.0) / np.float32(self._loss_scale))
            for grad in grads:
                grad.mul_(inv_scale)
            if engine is not None:
                engine.gradients_rewritten(params_of(optimizer))  # alike on every rank
        if self._dynamic:
            # Squared norms in float32 even for half gradients, where g*g
            # would overflow long before the gradient itself does.
            if self._sharded_engine is not None:  # each gradient counted on one rank
                grads = [p.grad for p in params_of(optimizer) if p.grad is not None
                         and self._sharded_engine.counts_in_norm(p)]  # fmt: skip
            self._squared_norms.extend(torch.sum(torch.square(g.float())) for g in grads)
        self._stages[optimizer] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done already) and run ``optimizer.step(*args, **kwargs)``.

        In dynamic mode the step is skipped, leaving parameters and optimizer
        state untouched, when the global gradient norm is not finite. Returns
        what ``optimizer.step`` returns, or None when skipped.
        """
        _check_optimizer(optimizer, "step")
        if self.stage(optimizer) is OptState.STEPPED:
            raise RuntimeError(
                "GradScaler.step() has already been called on this optimizer since the last "
                "update(); call update() once per iteration after all steps."
            )
        if self._scaling and "closure" in kwargs:
            raise ValueError(
                "GradScaler.step() does not support optimizer closures while scaling the loss; "
                "compute the loss and call scale(loss).backward() before step()."
            )
        if self.stage(optimizer) is not OptState.UNSCALED:
            self.unscale_(optimizer)

        skipped = self._dynamic and not self._decide_isfinite()
        skip.record_step(optimizer, skipped)
        self._stages[optimizer] = OptState.STEPPED
        if skipped:
            self._num_skipped_steps += 1
            return None
        if self._max_gradient_norm is not None:  # dynamic mode only: the reference's clipping
            grads = _grads_of(optimizer)
            scale_to_norm_(grads, self._max_gradient_norm, self._global_norm)
            engine = getattr(optimizer, "engine", None)
            if engine is not None:
                engine.gradients_rewritten(params_of(optimizer))  # by the whole model's norm
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """End the iteration: adjust the dynamic loss scale and reset every optimizer to READY."""
        if new_scale is not None:
            raise ValueError(
                "GradScaler.update() does not take new_scale (as the reference API); use "
                "load_state_dict({'loss_scale': ...}) to set the scale."
            )
        if self._dynamic:
            if self._isfinite is None and not self._squared_norms:
                raise RuntimeError(
                    "GradScaler.update() called before any step() since the last update(); call "
                    "scale(loss).backward() and step(optimizer) first."
                )
            self._update_scale(self._decide_isfinite())
        for optimizer in list(self._stages.keys()):
            self._stages[optimizer] = OptState.READY
        self._squared_norms = []
        self._isfinite = None
        self._sharded_engine = None

    # ------------------------------------------------------------- internals

    def _decide_isfinite(self) -> bool:
        """Global-norm finiteness of everything unscaled so far; see Note [dynamic loss scaling]."""
        if self._squared_norms:
            first = self._squared_norms[0].device  # a device tier's are on the device
            squares = torch.sum(torch.stack([s.to(first) for s in self._squared_norms]))
        else:
            squares = torch.zeros((), dtype=torch.float32)
        if self._sharded_engine is not None:
            # Every rank gets here with its own shard's squares (possibly none).
            squares = self._sharded_engine.sum_over_ranks(squares)
        self._global_norm = torch.sqrt(squares)
        # Host sync point: whether the optimizer runs is a Python decision.
        self._isfinite = bool(torch.isfinite(self._global_norm))
        return self._isfinite

    def _update_scale(self, isfinite: bool) -> None:
        """The reference update; both comparisons strict, ratio in float32."""
        self._steps_since_rescale += 1
        self._overflows_since_rescale += 0 if isfinite else 1
        ratio = np.float32(self._overflows_since_rescale) / np.float32(self._steps_since_rescale)
        scale = self._loss_scale
        if ratio > np.float32(self._overflow_tolerance):
            scale /= 2.0
            self._steps_since_rescale = 0
            self._overflows_since_rescale = 0
        if self._steps_since_rescale > self._steps_per_increase:
            scale *= 2.0
            self._steps_since_rescale = 0
            self._overflows_since_rescale = 0
        self._loss_scale = _f32(max(min(scale, self._max_loss_scale), self._min_loss_scale))

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, float | int]:
        """The scaler's state: loss_scale, plus the counters in dynamic mode."""
        if not self._dynamic:
            return {"loss_scale": self._loss_scale}
        return {
            "loss_scale": self._loss_scale,
            "steps_since_rescale": self._steps_since_rescale,
            "overflows_since_rescale": self._overflows_since_rescale,
            "num_skipped_steps": self._num_skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (values may be numbers or 0-d tensors).

        Missing keys keep their current value, as the reference does. Keys that
        belong to dynamic mode are ignored with a warning when this scaler is
        not dynamic.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"GradScaler.load_state_dict() expects a dict, got {type(state_dict).__name__}."
            )
        counters = ("steps_since_rescale", "overflows_since_rescale", "num_skipped_steps")
        unknown = sorted(set(state_dict) - {"loss_scale", *counters})
        if unknown:
            raise ValueError(
                f"GradScaler.load_state_dict(): unknown keys {unknown}; expected loss_scale, "
                f"{', '.join(counters)}. Was this state saved by a GradScaler?"
            )
        values: dict[str, float | int] = {}
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"GradScaler.load_state_dict(): {key} must be a single number, "
                        f"got a tensor of shape {tuple(value.shape)}."
                    )
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"GradScaler.load_state_dict(): {key} must be a number, got {type(value).__name__}."
                )
            if key == "loss_scale":
                if not math.isfinite(value) or value <= 0:
                    raise ValueError(
                        f"GradScaler.load_state_dict(): loss_scale must be a finite number > 0, "
                        f"got {value!r}."
                    )
            elif value < 0 or int(value) != value:
                raise ValueError(
                    f"GradScaler.load_state_dict(): {key} must be a non-negative integer, got {value!r}."
                )
            values[key] = value
        ignored = [] if self._dynamic else sorted(set(values) & set(counters))
        if ignored:
            warnings.warn(
                f"GradScaler.load_state_dict(): {ignored} are dynamic loss scaling state and are "
                "ignored by this non-dynamic GradScaler.",
                stacklevel=2,
            )
        if "loss_scale" in values and self._scaling:  # dynamic mode scales too
            self._loss_scale = _f32(values["loss_scale"])
        elif "loss_scale" in values and values["loss_scale"] != 1.0:
            warnings.warn(
                "GradScaler.load_state_dict(): loss_scale is ignored because this GradScaler "
                "does not scale the loss; construct it with loss_scale=<number> or "
                '"dynamic" to restore a scale.',
                stacklevel=2,
            )
        for key in counters:
            if key in values and self._dynamic:
                setattr(self, f"_{key}", int(values[key]))


def _check_optimizer(optimizer: Any, method: str) -> None:
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"GradScaler.{method}() expects a torch.optim.Optimizer (an object with "
            f"param_groups), got {type(optimizer).__name__}."
        )


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, each once (a parameter may sit in several groups)."""
    seen: set[int] = set()
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def scale_to_norm_(
    grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor, eps: float = 1e-6
) -> None:
    """Scale ``grads`` (of global L2 norm ``norm``) in place with torch's clip_grad_norm_ coefficient."""
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))


def _grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The existing gradients of the optimizer's parameters, each once."""
    return [p.grad.detach() for p in params_of(optimizer) if p.grad is not None]

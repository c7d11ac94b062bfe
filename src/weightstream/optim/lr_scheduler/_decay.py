"""Decaying shapes: closed forms that move from a start value towards an end (or hold).

Each class here is generic over the param-group key: it takes generic argument names
(``initial_val``, ``end_val``, ...) and computes its value with float64 tensor ops from
``self.last_epoch`` (see Note [schedule precision] in ``_base.py``). ``_lr.py`` and
``_wd.py`` turn each into a learning-rate or weight-decay scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import _checks
from ._base import ParamGroupTags, Scheduler, f64


class ConstantScheduler(Scheduler):
    """Holds ``val`` at every step; ``total_iters`` only sizes it inside a SequentialLR."""

    _initial_attr = "val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        val: float,
        total_iters: int | None = None,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        self.val = _checks.real(type(self).__name__, self._arg("val"), val)
        super().__init__(optimizer, total_iters=total_iters, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        return f64(self.val)


class PolynomialScheduler(Scheduler):
    """``(1 - t / (total_iters * a)) ** power * (initial - end) + end``, ``end`` from ``total_iters``.

    With ``cycle``, ``a = ceil((t + 1) / total_iters)`` stretches the decay window to the
    next multiple of ``total_iters`` so that the decay restarts (from a lower point) each
    window instead of holding ``end``. (The reference clamps to ``end`` before applying
    ``a``, which makes its ``cycle=True`` a no-op; here the flag does what it says.)
    """

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        end_val: float,
        total_iters: int,
        power: float = 1.0,
        cycle: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.end_val = _checks.real(owner, self._arg("end_val"), end_val)
        self.power = _checks.real(owner, "power", power)
        if not isinstance(cycle, bool):
            raise TypeError(f"{owner}: cycle must be True or False, got {cycle!r}.")
        self.cycle = cycle
        _checks.integer(owner, "total_iters", total_iters, minimum=1)
        super().__init__(optimizer, total_iters=total_iters, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        t = self._step_as_float()
        total = float(self.total_iters)
        window = total * torch.ceil((t + 1.0) / total) if self.cycle else f64(total)
        remaining = (1.0 - t / window) ** self.power
        # Equal to the textbook remaining * (initial - end) + end, written as a blend so
        # that step 0 gives initial_val exactly (no cancellation in initial - end + end).
        value = self.initial_val * remaining + self.end_val * (1.0 - remaining)
        if self.cycle:
            return value
        return torch.where(t >= total, f64(self.end_val), value)


class LinearScheduler(PolynomialScheduler):
    """:class:`PolynomialScheduler` with ``power=1``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        end_val: float,
        total_iters: int,
        cycle: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            initial_val=initial_val,
            end_val=end_val,
            total_iters=total_iters,
            power=1.0,
            cycle=cycle,
            param_group_tags=param_group_tags,
        )


class ExponentialScheduler(Scheduler):
    """``initial * decay_rate ** (t / total_iters)``; ``staircase`` floors the exponent."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        total_iters: int,
        decay_rate: float,
        staircase: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.decay_rate = _checks.real(owner, "decay_rate", decay_rate)
        self.staircase = bool(staircase)
        _checks.integer(owner, "total_iters", total_iters, minimum=1)
        super().__init__(optimizer, total_iters=total_iters, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        exponent = self._step_as_float() / self.total_iters
        if self.staircase:
            exponent = torch.floor(exponent)
        return f64(self.decay_rate) ** exponent * self.initial_val


class InverseExponentialTimeDecayScheduler(Scheduler):
    """``initial / (1 + decay_rate * t ** step_exponent / total_iters)`` (Keras InverseTimeDecay).

    ``staircase`` floors ``t ** step_exponent / total_iters``.
    """

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        step_exponent: float,
        total_iters: int,
        decay_rate: float,
        staircase: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.step_exponent = _checks.real(owner, "step_exponent", step_exponent)
        self.decay_rate = _checks.real(owner, "decay_rate", decay_rate)
        self.staircase = bool(staircase)
        _checks.integer(owner, "total_iters", total_iters, minimum=1)
        super().__init__(optimizer, total_iters=total_iters, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        alpha = self._step_as_float() ** self.step_exponent / self.total_iters
        if self.staircase:
            alpha = torch.floor(alpha)
        return self.initial_val / (1.0 + self.decay_rate * alpha)


class InverseSquareRootDecayScheduler(Scheduler):
    """``initial * scale / sqrt(max(warmup_steps, t))``: flat for ``warmup_steps`` steps."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float = 1.0,
        scale: float = 1.0,
        warmup_steps: int = 1,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.scale = _checks.real(owner, "scale", scale)
        self.warmup_steps = _checks.real(owner, "warmup_steps", warmup_steps)
        if self.warmup_steps <= 0:
            raise ValueError(
                f"{owner}: warmup_steps must be > 0 (the value divides by its square root), "
                f"got {warmup_steps}. Use warmup_steps=1 for no warm-up."
            )
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        denominator = torch.sqrt(torch.clamp(self._step_as_float(), min=self.warmup_steps))
        return self.initial_val * self.scale / denominator


class CosineDecayScheduler(Scheduler):
    """Half a cosine from ``initial`` to ``end`` over ``total_iters``, then ``end`` (Keras)."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        end_val: float,
        total_iters: int,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.end_val = _checks.real(owner, self._arg("end_val"), end_val)
        _checks.integer(owner, "total_iters", total_iters, minimum=1)
        super().__init__(optimizer, total_iters=total_iters, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        t = torch.clamp(self._step_as_float(), max=self.total_iters)
        progress = (1.0 + torch.cos(math.pi * t / self.total_iters)) / 2.0
        return self.end_val + (self.initial_val - self.end_val) * progress


class PiecewiseConstantScheduler(Scheduler):
    """``vals[k]`` from ``milestones[k-1]`` (inclusive) to ``milestones[k]``; ``vals[0]`` first."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        vals: Sequence[float],
        milestones: Sequence[int],
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.vals = _checks.real_list(owner, self._arg("vals"), vals)
        self.milestones = _checks.integer_list(owner, "milestones", milestones, increasing=True)
        if len(self.vals) != len(self.milestones) + 1:
            raise ValueError(
                f"{owner}: needs one more value than milestones (a value before the first "
                f"milestone and one after each), got {len(self.vals)} "
                f"{self._arg('vals')} and {len(self.milestones)} milestones."
            )
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    @property
    def initial_value(self) -> float:
        return self.vals[0]

    def _get_closed_form(self) -> torch.Tensor:
        t = self.last_epoch
        value = f64(self.vals[0])
        for milestone, val in zip(self.milestones, self.vals[1:]):
            value = torch.where(t < milestone, value, f64(val))
        return value


class MultiStepScheduler(Scheduler):
    """``initial * gamma ** (number of milestones <= t)`` (a repeated milestone counts twice)."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        gamma: float,
        milestones: Sequence[int],
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.gamma = _checks.real(owner, "gamma", gamma)
        # Order does not matter: each milestone passed multiplies by gamma once.
        self.milestones = _checks.integer_list(owner, "milestones", milestones, increasing=False)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        t = self.last_epoch
        value = f64(self.initial_val)
        for milestone in self.milestones:
            value = torch.where(t < milestone, value, value * self.gamma)
        return value


class StepScheduler(Scheduler):
    """``initial * gamma ** floor(t / step_size)``."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        step_size: int,
        gamma: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.step_size = _checks.integer(owner, "step_size", step_size, minimum=1)
        self.gamma = _checks.real(owner, "gamma", gamma)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        exponent = torch.floor(self._step_as_float() / self.step_size)
        return self.initial_val * f64(self.gamma) ** exponent


class LambdaScheduler(Scheduler):
    """``initial * prod(f(t) for f in self.set_value_lambda())``.

    Subclasses override :meth:`set_value_lambda` to return one function, or a list of
    functions whose product is taken, of the step as a float64 0-d tensor (use tensor ops
    on it, not Python ``if``). The reference multiplies ``initial`` in once per function;
    here it is applied once whatever the number of functions.
    """

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        self.initial_val = _checks.real(type(self).__name__, self._arg("initial_val"), initial_val)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def set_value_lambda(
        self,
    ) -> Callable[[torch.Tensor], torch.Tensor] | list[Callable[[torch.Tensor], torch.Tensor]]:
        """The factor(s) of the step; the default is the reference's example pair."""
        return [lambda t: t / 30.0, lambda t: 0.95**t]

    def _get_closed_form(self) -> torch.Tensor:
        functions = self.set_value_lambda()
        if callable(functions):
            functions = [functions]
        t = self._step_as_float()
        value = f64(self.initial_val)
        for function in functions:
            value = value * torch.as_tensor(function(t), dtype=torch.float64)
        return value


class MultiplicativeScheduler(Scheduler):
    """``initial * coefficient ** t``: the value is multiplied by ``coefficient`` every step."""

    _initial_attr = "initial_val"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_val: float,
        coefficient: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        owner = type(self).__name__
        self.initial_val = _checks.real(owner, self._arg("initial_val"), initial_val)
        self.coefficient = _checks.real(owner, "coefficient", coefficient)
        super().__init__(optimizer, total_iters=None, param_group_tags=param_group_tags)

    def _get_closed_form(self) -> torch.Tensor:
        return f64(self.coefficient) ** self._step_as_float() * self.initial_val

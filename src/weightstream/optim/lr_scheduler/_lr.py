"""The learning-rate schedulers of the reference API: each shape bound to ``param_group["lr"]``.

Every class pairs :class:`LRScheduler` (key ``"lr"``, the ``_get_closed_form_lr`` hook)
with one generic shape and renames the shape's arguments to the reference's
(``initial_val`` -> ``initial_learning_rate``, ...). :class:`_ShapeLR` binds the hook
to the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._base import LRScheduler, ParamGroupTags
from ._composite import ChainedScheduler as _Chained
from ._composite import ScalePerParamScheduler, SequentialScheduler
from ._cyclic import (
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CyclicScheduler,
    OneCycleScheduler,
)
from ._decay import (
    ConstantScheduler,
    CosineDecayScheduler,
    ExponentialScheduler,
    InverseExponentialTimeDecayScheduler,
    InverseSquareRootDecayScheduler,
    LambdaScheduler,
    LinearScheduler,
    MultiplicativeScheduler,
    MultiStepScheduler,
    PiecewiseConstantScheduler,
    PolynomialScheduler,
    StepScheduler,
)


class _ShapeLR(LRScheduler):
    """An LRScheduler whose learning rate is the closed form of the shape after it in the
    bases (``class ConstantLR(_ShapeLR, ConstantScheduler)``)."""

    def _get_closed_form_lr(self) -> torch.Tensor:
        # Past LRScheduler (whose _get_closed_form calls this hook) to the shape's.
        return super(LRScheduler, self)._get_closed_form()


class ConstantLR(_ShapeLR, ConstantScheduler):
    """Holds ``learning_rate``; ``total_iters`` only sizes it inside a SequentialLR."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        learning_rate: float,
        total_iters: int | None = None,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, learning_rate, total_iters, param_group_tags)


class PolynomialLR(_ShapeLR, PolynomialScheduler):
    """Polynomial decay from ``initial_learning_rate`` to ``end_learning_rate`` in ``total_iters``.

    ``(1 - t / total_iters) ** power * (initial - end) + end``, then ``end``; see
    :class:`PolynomialScheduler` for ``cycle``. torch's PolynomialLR is the case
    ``end_learning_rate=0`` with ``initial_learning_rate`` = the optimizer's lr.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        end_learning_rate: float,
        total_iters: int,
        power: float = 1.0,
        cycle: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            initial_learning_rate,
            end_learning_rate,
            total_iters,
            power,
            cycle,
            param_group_tags,
        )


class LinearLR(_ShapeLR, LinearScheduler):
    """Linear ramp from ``initial_learning_rate`` to ``end_learning_rate`` in ``total_iters``.

    torch's ``LinearLR(start_factor, end_factor)`` is ``initial = lr * start_factor``,
    ``end = lr * end_factor``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        end_learning_rate: float,
        total_iters: int,
        cycle: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            initial_learning_rate,
            end_learning_rate,
            total_iters,
            cycle,
            param_group_tags,
        )


class ExponentialLR(_ShapeLR, ExponentialScheduler):
    """``initial_learning_rate * decay_rate ** (t / total_iters)`` (floored with ``staircase``).

    torch's ``ExponentialLR(gamma)`` is ``total_iters=1, decay_rate=gamma``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        total_iters: int,
        decay_rate: float,
        staircase: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer, initial_learning_rate, total_iters, decay_rate, staircase, param_group_tags
        )


class InverseExponentialTimeDecayLR(_ShapeLR, InverseExponentialTimeDecayScheduler):
    """``initial_learning_rate / (1 + decay_rate * t ** step_exponent / total_iters)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        step_exponent: float,
        total_iters: int,
        decay_rate: float,
        staircase: bool = False,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            initial_learning_rate,
            step_exponent,
            total_iters,
            decay_rate,
            staircase,
            param_group_tags,
        )


class InverseSquareRootDecayLR(_ShapeLR, InverseSquareRootDecayScheduler):
    """``initial_learning_rate * scale / sqrt(max(warmup_steps, t))``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float = 1.0,
        scale: float = 1.0,
        warmup_steps: int = 1,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, scale, warmup_steps, param_group_tags)


class CosineDecayLR(_ShapeLR, CosineDecayScheduler):
    """Half a cosine from ``initial_learning_rate`` to ``end_learning_rate``, then held."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        end_learning_rate: float,
        total_iters: int,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer, initial_learning_rate, end_learning_rate, total_iters, param_group_tags
        )


class SequentialLR(_ShapeLR, SequentialScheduler):
    """Runs ``schedulers[k]`` from ``milestones[k-1]``, restarted at its own step 0 there."""


class PiecewiseConstantLR(_ShapeLR, PiecewiseConstantScheduler):
    """``learning_rates[k]`` between ``milestones[k-1]`` and ``milestones[k]``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        learning_rates: Sequence[float],
        milestones: Sequence[int],
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, learning_rates, milestones, param_group_tags)


class MultiStepLR(_ShapeLR, MultiStepScheduler):
    """``initial_learning_rate * gamma ** (number of milestones <= t)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        gamma: float,
        milestones: Sequence[int],
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, gamma, milestones, param_group_tags)


class StepLR(_ShapeLR, StepScheduler):
    """``initial_learning_rate * gamma ** floor(t / step_size)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        step_size: int,
        gamma: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, step_size, gamma, param_group_tags)


class CosineAnnealingLR(_ShapeLR, CosineAnnealingScheduler):
    """``eta_min + (initial_learning_rate - eta_min) * (1 + cos(pi * t / T_max)) / 2``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        T_max: int,
        eta_min: float = 0.0,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, T_max, eta_min, param_group_tags)


class CosineAnnealingWarmRestarts(_ShapeLR, CosineAnnealingWarmRestartsScheduler):
    """Cosine annealing from ``initial_learning_rate``, restarted after ``T_0 * T_mult ** k`` steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        T_0: int,
        T_mult: int = 1,
        eta_min: float = 0.0,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, T_0, T_mult, eta_min, param_group_tags)


class LambdaLR(_ShapeLR, LambdaScheduler):
    """``initial_learning_rate`` times the function(s) returned by :meth:`set_lr_lambda`.

    Subclass and override :meth:`set_lr_lambda`; each function receives the step as a
    float64 0-d tensor and must use tensor ops (no Python ``if`` on it).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, param_group_tags)

    def set_lr_lambda(
        self,
    ) -> Callable[[torch.Tensor], torch.Tensor] | list[Callable[[torch.Tensor], torch.Tensor]]:
        """The factor(s) of the step; the default is the reference's example pair."""
        return LambdaScheduler.set_value_lambda(self)

    def set_value_lambda(
        self,
    ) -> Callable[[torch.Tensor], torch.Tensor] | list[Callable[[torch.Tensor], torch.Tensor]]:
        return self.set_lr_lambda()


class MultiplicativeLR(_ShapeLR, MultiplicativeScheduler):
    """``initial_learning_rate * coefficient ** t``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        coefficient: float,
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(optimizer, initial_learning_rate, coefficient, param_group_tags)


class ChainedLR(_ShapeLR, _Chained):
    """``s0(t) * prod(s_k(t) / s_k.initial_value)`` over learning-rate schedulers."""


#: torch's name for :class:`ChainedLR`.
ChainedScheduler = ChainedLR


class CyclicLR(_ShapeLR, CyclicScheduler):
    """Cyclical learning rate between ``base_lr`` and ``max_lr`` (torch's CyclicLR, no momentum)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        base_lr: float,
        max_lr: float,
        step_size_up: int = 2000,
        step_size_down: int | None = None,
        mode: str = "triangular",
        gamma: float = 1.0,
        scale_mode: str = "cycle",
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            base_lr,
            max_lr,
            step_size_up,
            step_size_down,
            mode,
            gamma,
            scale_mode,
            param_group_tags,
        )


class OneCycleLR(_ShapeLR, OneCycleScheduler):
    """1cycle policy; ``initial_learning_rate`` is torch's ``max_lr / div_factor`` (no momentum)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        max_lr: float,
        total_steps: int = 1000,
        pct_start: float = 0.3,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        anneal_strategy: str = "cos",
        param_group_tags: ParamGroupTags = None,
    ) -> None:
        super().__init__(
            optimizer,
            initial_learning_rate,
            max_lr,
            total_steps,
            pct_start,
            final_div_factor,
            three_phase,
            anneal_strategy,
            param_group_tags,
        )


class ScalePerParamLR(_ShapeLR, ScalePerParamScheduler):
    """Writes ``scheduler``'s lr times each group's ``adjust_learning_rate`` (default 1)."""

    adjustment_key = "adjust_learning_rate"

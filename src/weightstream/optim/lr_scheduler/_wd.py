"""Weight-decay schedulers: the same shapes bound to ``param_group["weight_decay"]``.

The arguments keep the generic names of the shapes (``initial_val``, ``end_val``,
``vals``, ``base_val``, ``max_val``), as in the reference's weight-decay schedulers.
``ScalePerParamWD`` reads each group's ``adjust_weight_decay`` factor.
"""

from __future__ import annotations

from ._base import WDScheduler
from ._composite import ChainedScheduler, ScalePerParamScheduler, SequentialScheduler
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


class ConstantWD(WDScheduler, ConstantScheduler):
    """Holds weight decay ``val``."""


class PolynomialWD(WDScheduler, PolynomialScheduler):
    """Polynomial decay of the weight decay from ``initial_val`` to ``end_val``."""


class LinearWD(WDScheduler, LinearScheduler):
    """Linear ramp of the weight decay from ``initial_val`` to ``end_val``."""


class ExponentialWD(WDScheduler, ExponentialScheduler):
    """``initial_val * decay_rate ** (t / total_iters)``."""


class InverseExponentialTimeDecayWD(WDScheduler, InverseExponentialTimeDecayScheduler):
    """``initial_val / (1 + decay_rate * t ** step_exponent / total_iters)``."""


class InverseSquareRootDecayWD(WDScheduler, InverseSquareRootDecayScheduler):
    """``initial_val * scale / sqrt(max(warmup_steps, t))``."""


class CosineDecayWD(WDScheduler, CosineDecayScheduler):
    """Half a cosine from ``initial_val`` to ``end_val`` over ``total_iters``, then held."""


class SequentialWD(WDScheduler, SequentialScheduler):
    """Weight-decay schedulers run one after the other at ``milestones``."""


class PiecewiseConstantWD(WDScheduler, PiecewiseConstantScheduler):
    """``vals[k]`` between ``milestones[k-1]`` and ``milestones[k]``."""


class MultiStepWD(WDScheduler, MultiStepScheduler):
    """``initial_val * gamma ** (number of milestones <= t)``."""


class StepWD(WDScheduler, StepScheduler):
    """``initial_val * gamma ** floor(t / step_size)``."""


class CosineAnnealingWD(WDScheduler, CosineAnnealingScheduler):
    """``eta_min + (initial_val - eta_min) * (1 + cos(pi * t / T_max)) / 2``."""


class CosineAnnealingWarmRestartsWD(WDScheduler, CosineAnnealingWarmRestartsScheduler):
    """Cosine annealing of the weight decay with warm restarts."""


class LambdaWD(WDScheduler, LambdaScheduler):
    """``initial_val`` times the function(s) returned by ``set_value_lambda``."""


class MultiplicativeWD(WDScheduler, MultiplicativeScheduler):
    """``initial_val * coefficient ** t``."""


class ChainedWD(WDScheduler, ChainedScheduler):
    """``s0(t) * prod(s_k(t) / s_k.initial_value)`` over weight-decay schedulers."""


class CyclicWD(WDScheduler, CyclicScheduler):
    """Cyclical weight decay between ``base_val`` and ``max_val``."""


class OneCycleWD(WDScheduler, OneCycleScheduler):
    """1cycle policy applied to the weight decay."""


class ScalePerParamWD(WDScheduler, ScalePerParamScheduler):
    """Writes ``scheduler``'s weight decay times each group's ``adjust_weight_decay``."""

    adjustment_key = "adjust_weight_decay"

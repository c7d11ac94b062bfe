"""Learning-rate and weight-decay schedulers (``cstorch.optim.lr_scheduler``).

Every scheduler is a closed-form function of its step counter ``last_epoch``, written
with tensor ops. Construction performs one ``step()`` (``last_epoch`` -1 -> 0); each
``step()`` advances the counter and writes the value into the ``lr`` (``...LR``) or
``weight_decay`` (``...WD``) entry of the selected param groups as a Python float, so any
optimizer, ``torch.optim`` included, consumes it. A step the loss scaler skipped
(non-finite gradients) does not advance the schedule.

Layout: ``_base`` (stepping, skipping, tags, checkpoints), ``_decay`` and ``_cyclic``
(the shapes, generic over the param-group key), ``_composite`` (sequential, chained,
per-group scaling), ``_lr`` / ``_wd`` (the shapes bound to ``lr`` / ``weight_decay``),
``_configure`` (``configure_lr_scheduler``).
"""

from ._base import LRScheduler, Scheduler, WDScheduler
from ._configure import configure_lr_scheduler
from ._lr import (
    ChainedLR,
    ChainedScheduler,
    ConstantLR,
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    CosineDecayLR,
    CyclicLR,
    ExponentialLR,
    InverseExponentialTimeDecayLR,
    InverseSquareRootDecayLR,
    LambdaLR,
    LinearLR,
    MultiplicativeLR,
    MultiStepLR,
    OneCycleLR,
    PiecewiseConstantLR,
    PolynomialLR,
    ScalePerParamLR,
    SequentialLR,
    StepLR,
)
from ._wd import (
    ChainedWD,
    ConstantWD,
    CosineAnnealingWarmRestartsWD,
    CosineAnnealingWD,
    CosineDecayWD,
    CyclicWD,
    ExponentialWD,
    InverseExponentialTimeDecayWD,
    InverseSquareRootDecayWD,
    LambdaWD,
    LinearWD,
    MultiplicativeWD,
    MultiStepWD,
    OneCycleWD,
    PiecewiseConstantWD,
    PolynomialWD,
    ScalePerParamWD,
    SequentialWD,
    StepWD,
)

#: The reference's name for the weight-decay base class.
WeightDecayScheduler = WDScheduler

__all__ = [
    # bases
    "Scheduler",
    "LRScheduler",
    "WDScheduler",
    "WeightDecayScheduler",
    # learning rate
    "ConstantLR",
    "PolynomialLR",
    "LinearLR",
    "ExponentialLR",
    "InverseExponentialTimeDecayLR",
    "InverseSquareRootDecayLR",
    "CosineDecayLR",
    "SequentialLR",
    "PiecewiseConstantLR",
    "MultiStepLR",
    "StepLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "LambdaLR",
    "MultiplicativeLR",
    "ChainedLR",
    "ChainedScheduler",
    "CyclicLR",
    "OneCycleLR",
    "ScalePerParamLR",
    # weight decay
    "ConstantWD",
    "PolynomialWD",
    "LinearWD",
    "ExponentialWD",
    "InverseExponentialTimeDecayWD",
    "InverseSquareRootDecayWD",
    "CosineDecayWD",
    "SequentialWD",
    "PiecewiseConstantWD",
    "MultiStepWD",
    "StepWD",
    "CosineAnnealingWD",
    "CosineAnnealingWarmRestartsWD",
    "LambdaWD",
    "MultiplicativeWD",
    "ChainedWD",
    "CyclicWD",
    "OneCycleWD",
    "ScalePerParamWD",
    # configuration
    "configure_lr_scheduler",
]

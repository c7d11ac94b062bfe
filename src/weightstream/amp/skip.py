"""Which optimizers skipped their last step because of non-finite gradients.

The GradScaler records here whether its ``step(optimizer)`` was skipped;
learning-rate schedulers read it so that their step counter does not advance on
a skipped step (reference semantics). The record is keyed weakly by the
optimizer object, so it never keeps an optimizer alive and puts no attribute on
it.
"""

from __future__ import annotations

import weakref

_last_step_skipped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_step(optimizer, skipped: bool) -> None:
    """Record whether the latest step of ``optimizer`` was skipped."""
    _last_step_skipped[optimizer] = bool(skipped)


def step_was_skipped(optimizer) -> bool:
    """True when the latest step of ``optimizer`` was skipped by a loss scaler."""
    return _last_step_skipped.get(optimizer, False)

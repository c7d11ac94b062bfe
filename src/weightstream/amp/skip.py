"""Which optimizers skipped their last step because of non-finite gradients.

The GradScaler records here whether its ``step(optimizer)`` was skipped;
learning-rate schedulers read it so that their step counter does not advance on
a skipped step (reference semantics). The record belongs to the run context
(``RunContext.skipped_steps``, Note [run context] in weightstream/context.py)
and is keyed weakly by the optimizer object, so it never keeps an optimizer
alive and puts no attribute on it.
"""

from __future__ import annotations

from weightstream.context import current_run


def record_step(optimizer, skipped: bool) -> None:
    """Record whether the latest step of ``optimizer`` was skipped.

    The first record of an optimizer also registers a step hook (torch's public
    ``register_step_post_hook``) that forgets the record whenever the optimizer steps:
    a loop that calls ``optimizer.step()`` itself after a skipped scaler step would
    otherwise leave the record at "skipped", and its scheduler one step behind."""
    skipped_steps = current_run().skipped_steps
    if optimizer not in skipped_steps and hasattr(optimizer, "register_step_post_hook"):
        optimizer.register_step_post_hook(lambda opt, args, kwargs: skipped_steps.pop(opt, None))
    skipped_steps[optimizer] = bool(skipped)


def step_was_skipped(optimizer) -> bool:
    """True when the latest step of ``optimizer`` was skipped by a loss scaler."""
    return current_run().skipped_steps.get(optimizer, False)

"""Steps and closures: ``compile_step``, ``step_closure``, ``checkpoint_closure``.

The reference captures a step as a graph and runs it asynchronously, so a
tensor's value is available only after the step, in a step closure. Here a
step runs eagerly (data-dependent Python is allowed), and the same contract
holds: a step closure called inside a step runs when the step has finished,
with the tensors it was given as they are then (their last value); called
outside a step it runs at once. A checkpoint closure may run only before the
first step, on a checkpoint step (every ``checkpoint_steps``) and on the last
step (Note [checkpoint steps] in weightstream/context.py); anywhere else it is
an error, as in the reference.

The step counter lives in the run's :class:`StepContext`, part of the run
context (Note [run context] in weightstream/context.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from weightstream.context import StepContext, current_config, current_run

__all__ = ["StepContext", "checkpoint_closure", "compile_step", "step_closure", "step_context"]


def step_context() -> StepContext:
    """The step counter and pending closures of the current run (Note [run context])."""
    return current_run().steps


def compile_step(fn: Callable) -> Callable:
    """Mark ``fn`` as one whole training or evaluation step.

    Each call is one step: the step counter advances when it returns, and the
    step closures called during it run then, in the order they were called.
    """

    @functools.wraps(fn)
    def step(*args, **kwargs):
        ctx = step_context()
        if ctx.in_step:
            raise RuntimeError(
                f"compile_step function {fn.__name__!r} was called inside another step; a step "
                "must contain the whole iteration and steps cannot be nested."
            )
        ctx.in_step = True
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            ctx._pending.clear()
            raise
        finally:
            ctx.in_step = False
        ctx.step_done()
        pending, ctx._pending = ctx._pending, []
        for closure, c_args, c_kwargs in pending:
            closure(*c_args, **c_kwargs)
        return result

    step.__wrapped_step__ = True
    return step


def step_closure(fn: Callable) -> Callable:
    """Run ``fn`` with materialised tensors: after the current step, or now outside one."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        return step_context().after_step(fn, *args, **kwargs)

    return closure


def checkpoint_closure(fn: Callable) -> Callable:
    """A step closure that may only run where a checkpoint can be taken.

    Allowed before the first step, on every ``checkpoint_steps``-th step and on
    the last step of the run (as announced by the DataLoader being iterated).
    """

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        ctx = step_context()

        def run():
            if not ctx.is_checkpoint_step():
                every = current_config().checkpoint_steps
                raise RuntimeError(
                    f"checkpoint closure {fn.__name__!r} called at step {ctx.current_step()}, "
                    f"which is not a checkpoint step (checkpoint_steps={every}; allowed: before "
                    "the first step, every checkpoint_steps steps and the last step of the "
                    "DataLoader being iterated; Note [checkpoint steps]). Call it only when "
                    "step % checkpoint_steps == 0 or on the last step, or set checkpoint_steps "
                    "in configure()."
                )
            return fn(*args, **kwargs)

        return ctx.after_step(run)

    return closure

"""Steps and closures: ``compile_step``, ``step_closure``, ``checkpoint_closure``.

The reference captures a step as a graph and runs it asynchronously, so a
tensor's value is available only after the step, in a step closure. Here a
step runs eagerly (data-dependent Python is allowed), and the same contract
holds: a step closure called inside a step runs when the step has finished,
with the tensors it was given as they are then (their last value); called
outside a step it runs at once. A checkpoint closure may run only before the
first step, on a checkpoint step (every ``checkpoint_steps``) and on the last
step; anywhere else it is an error, as in the reference.

The step counter lives in one explicit :class:`StepContext` per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from weightstream.config import current_config


@dataclass
class StepContext:
    """Counts the steps run by ``compile_step`` functions in this process."""

    step: int = 0  # steps completed
    last_step: int | None = None  # the final step, when a DataLoader announced it
    in_step: bool = False
    _pending: list[tuple[Callable, tuple, dict]] = field(default_factory=list)

    def expect_steps(self, count: int) -> None:
        """A loader will drive ``count`` more steps: the last step is known."""
        self.last_step = self.step + count

    def is_checkpoint_step(self) -> bool:
        if self.step == 0 or (self.last_step is not None and self.step == self.last_step):
            return True
        every = current_config().checkpoint_steps
        return every > 0 and self.step % every == 0

    def after_step(self, fn: Callable, /, *args, **kwargs):
        """Call ``fn`` when the current step has finished, or now outside a step."""
        if self.in_step:
            self._pending.append((fn, args, kwargs))
            return None
        return fn(*args, **kwargs)


_context = StepContext()


def step_context() -> StepContext:
    return _context


def _reset_for_tests() -> None:
    global _context
    _context = StepContext()


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
        ctx.step += 1
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
                    f"checkpoint closure {fn.__name__!r} called at step {ctx.step}, which is not "
                    f"a checkpoint step (checkpoint_steps={every}; allowed: before the first step, "
                    "every checkpoint_steps steps and the last step). Call it only when "
                    "step % checkpoint_steps == 0 or on the last step, or set checkpoint_steps "
                    "in configure()."
                )
            return fn(*args, **kwargs)

        return ctx.after_step(run)

    return closure

"""Steps and closures: ``compile_step``, ``step_closure``, ``checkpoint_closure``.

The reference captures a step as a graph and runs it asynchronously, so a
tensor's value is available only after the step, in a step closure. Here a
step runs eagerly (data-dependent Python is allowed), and the same contract
holds: a step closure called inside a step runs when the step has finished,
with the tensors it was given as they are then (their last value); called
outside a step it runs at once. A checkpoint closure runs only before the
first step, on a checkpoint step (every ``checkpoint_steps``) and on the last
step (Note [checkpoint steps] in weightstream/context.py); called anywhere else
it is skipped, as in the reference, whose closure "may be called at any time".

The step counter lives in the run's :class:`StepContext`, part of the run
context (Note [run context] in weightstream/context.py).

Note [compile only]
-------------------
``configure(compile_only=True)`` asks for a run that compiles the model and
executes nothing; ``validate_only=True`` for one that only traces it. A script
written for the reference runs as written: its first ``compile_step`` call
runs the step function up to its first call of a compiled model, which fixes
the weight-streaming plan for that batch (``StreamingEngine.prepare``: the
trace and the units; a model on the meta device is planned too) and then ends
the step without running the model (:class:`StepNotRun`, a ``BaseException``
so that a user's ``except Exception`` does not swallow it; a compiled model
called outside a step runs as usual). Nothing else runs:
later ``compile_step`` calls return None at once, step and checkpoint closures
are skipped (nothing was computed for them to see, and no checkpoint is
written), and the DataLoader yields one batch, the one the compile needs. A
compile_only step also writes the compile directory of that plan, through the
callback the public ``cstorch.compile`` gives the compiled model
(compiler/api_compile.py: the compiler sits above the backend). The
``weightstream run`` command has its own compile_only and validate_only (the
compile report, the footprint verdict) and drives no ``compile_step``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

from torch.utils._pytree import tree_leaves

from weightstream.common.hosts import hosts
from weightstream.context import StepContext, current_config, current_run

__all__ = [
    "StepContext",
    "StepNotRun",
    "checkpoint_closure",
    "compile_step",
    "only_compiling",
    "outside_the_step",
    "step_closure",
    "step_context",
]

log = logging.getLogger("weightstream")


class StepNotRun(BaseException):
    """Ends a step of a compile_only or validate_only run at its first compiled-model
    call, once the model is planned (Note [compile only])."""

    def __init__(self, mode: str, what: str) -> None:
        super().__init__(f"configure({mode}=True): {what}; the step ends here.")
        self.mode, self.what = mode, what


def only_compiling() -> str | None:
    """ "compile_only" or "validate_only" when configure() asked for a run that
    executes nothing (Note [compile only]), else None."""
    config = current_config()
    return (
        "compile_only" if config.compile_only else "validate_only" if config.validate_only else None
    )


@contextlib.contextmanager
def outside_the_step() -> Iterator[None]:
    """The library's own runs of compiled models inside a compile_only step (the compile
    directory's probe, compiler/api_compile.py) run them as outside any step."""
    ctx = step_context()
    in_step, ctx.in_step = ctx.in_step, False
    try:
        yield
    finally:
        ctx.in_step = in_step


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
        if (mode := only_compiling()) is not None:
            return _compile_without_running(fn, mode, ctx, args, kwargs)
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


def _compile_without_running(fn: Callable, mode: str, ctx: StepContext, args, kwargs):
    """A step of a compile_only or validate_only run (Note [compile only])."""
    run = current_run()
    if run.compiled_without_running:
        return None
    run.compiled_without_running = True
    ctx.in_step = True
    try:
        fn(*args, **kwargs)
        what = f"step function {fn.__name__!r} called no compiled model"
    except StepNotRun as stop:
        what = stop.what
    finally:
        ctx.in_step = False
        ctx._pending.clear()
    log.warning(
        "configure(%s=True): %s. Nothing is executed: this and later steps "
        "return None, step and checkpoint closures are skipped, and the DataLoader ends "
        "after this batch. Leave %s False to train.",
        mode,
        what,
        mode,
    )
    return None


def step_closure(fn: Callable) -> Callable:
    """Run ``fn`` with materialised tensors: after the current step, or now outside one.

    A weight among its arguments has the step's value: an engine updating it behind the
    next forward (``overlap_updates``) finishes that update first. Weights ``fn`` reads
    by other means (a module's attribute) need ``optimizer.synchronize()``."""

    def settled(*args, **kwargs):
        hosts.settle(tree_leaves((args, kwargs)))  # host sync point where one is in flight
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if only_compiling() is not None:
            return None  # nothing ran for it to see (Note [compile only])
        return step_context().after_step(settled, *args, **kwargs)

    return closure


def checkpoint_closure(fn: Callable) -> Callable:
    """A step closure that runs only where a checkpoint can be taken.

    It may be called after any step, as the reference allows; it runs before the
    first step, on every ``checkpoint_steps``-th step and on the last step of the
    run (as announced by the DataLoader being iterated), and is skipped on the
    others (Note [checkpoint steps] in weightstream/context.py).
    """

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if only_compiling() is not None:
            return None  # no checkpoint in a run that executes nothing (Note [compile only])
        ctx = step_context()

        def run():
            if ctx.is_checkpoint_step():
                return fn(*args, **kwargs)
            every = current_config().checkpoint_steps
            said, key = current_run().logged, ("checkpoint closure skipped", fn.__name__)
            if every == 0 and key not in said:
                said.add(key)
                log.warning(
                    "checkpoint closure %r skipped at step %d: configure(checkpoint_steps=0) "
                    "(the default) makes only the step before the first and the last step "
                    "checkpoint steps. Fix: configure(checkpoint_steps=N) to save every N "
                    "steps.",
                    fn.__name__,
                    ctx.current_step(),
                )
            elif ctx.loader is None and key not in said:
                # Only a DataLoader announces the last step (Note [checkpoint steps]).
                said.add(key)
                log.warning(
                    "checkpoint closure %r runs every %d steps; these steps take no "
                    "cstorch.utils.data.DataLoader's batches, so the run's last step is not "
                    "known, and it gets a checkpoint only if it is a multiple of %d. Fix: "
                    "iterate a cstorch.utils.data.DataLoader, or call the function yourself "
                    "after the loop.",
                    fn.__name__,
                    every,
                    every,
                )
            else:
                log.debug(
                    "checkpoint closure %r skipped at step %d", fn.__name__, ctx.current_step()
                )
            return None

        return ctx.after_step(run)

    return closure

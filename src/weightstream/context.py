"""The run context: the state of one run that the public API keeps between calls.

Note [run context]
------------------
The reference API is made of free functions that remember things between calls:
``cstorch.configure(...)`` sets the run's configuration once, ``compile_step``
counts steps and holds the step closures until the step ends,
``amp.set_half_dtype`` selects the half type the GradScaler's defaults follow,
and a GradScaler's skipped step must be seen by the LR scheduler of the same
optimizer. All of it lives in one :class:`RunContext` (the configuration, the
:class:`StepContext`, the half type's name, the skipped-step record), not in
module globals of the modules that use it; each of those modules reads it
through :func:`current_run` at the moment it needs it.

One run context is current per process, held here (``_run``: the one
module-level holder of run state, allow-listed as such by
tests/test_module_state.py). It is a plain holder, not a ``ContextVar``: the
engine's helper threads (prefetch, update, disk I/O) start with an empty
``contextvars`` context and must see the run of the thread that built them.

:func:`start_run` makes a fresh one: ``configure()`` may be called again, the
step counter starts at 0, the half type is float16 and no skipped step is
remembered. Tests start each test with it (tests/conftest.py); the run command
runs each run in a fresh one and puts the previous back afterwards
(:func:`run_configuration`), so several runs can share a process.

What must stay process-wide whatever the run (environment and allocator
settings) is listed in Note [process-wide settings] in weightstream/__init__.py.

This module sits just above ``config`` in the import layers (pyproject.toml):
the lowest layer that can hold a :class:`~weightstream.config.RunConfig`.
The half type is kept by name and the skipped-step record by optimizer, so the
context needs nothing of ``amp`` (a layer above); ``amp/half.py`` and
``amp/skip.py`` interpret them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from weightstream.config import RunConfig, parse_configure_arguments

__all__ = [
    "LoaderSteps",
    "RunContext",
    "StepContext",
    "configure",
    "current_config",
    "current_run",
    "run_configuration",
    "start_run",
]


@dataclass
class LoaderSteps:
    """The steps one iteration of a DataLoader drives (Note [checkpoint steps])."""

    first: int  # the loader's step when the iteration began (a resumed one's saved step)
    count: int  # steps it drives
    done: int = 0  # of which run so far

    @property
    def step(self) -> int:
        return self.first + self.done


@dataclass
class StepContext:
    """Counts the steps run by ``compile_step`` functions in this run.

    Note [checkpoint steps]
    -----------------------
    A checkpoint closure may run before the first step, on the last step of the
    DataLoader iteration in progress and on every ``checkpoint_steps``-th step.
    Steps are those of the DataLoader whose batch the step took (the loader
    that yielded last): a training loader and an evaluation loader interleaved
    in one process each keep their own count, and a loader restored from a
    checkpoint at step 6 counts on from 6, so step 8 is a checkpoint step of
    ``checkpoint_steps=4`` (as is the 4th step of that iteration, the reference's
    own count). Steps run without a DataLoader count in ``step``.
    """

    step: int = 0  # steps completed in this run
    in_step: bool = False
    loader: LoaderSteps | None = None  # the DataLoader iteration steps take batches from
    _pending: list[tuple[Callable, tuple, dict]] = field(default_factory=list)

    def step_done(self) -> None:
        self.step += 1
        if self.loader is not None:
            self.loader.done += 1

    def current_step(self) -> int:
        """The step just run: the loader's (Note [checkpoint steps]), else the run's."""
        return self.step if self.loader is None else self.loader.step

    def is_checkpoint_step(self) -> bool:
        if self.step == 0:
            return True
        every = current_config().checkpoint_steps
        if self.loader is None:
            return every > 0 and self.step % every == 0
        it = self.loader
        if it.done in (0, it.count):
            return True
        return every > 0 and (it.step % every == 0 or it.done % every == 0)

    def after_step(self, fn: Callable, /, *args, **kwargs):
        """Call ``fn`` when the current step has finished, or now outside a step."""
        if self.in_step:
            self._pending.append((fn, args, kwargs))
            return None
        return fn(*args, **kwargs)


@dataclass
class RunContext:
    """Everything the public API remembers between calls for one run (Note [run context])."""

    # Set by configure() or run_configuration(); None: never configured (the defaults).
    config: RunConfig | None = None
    steps: StepContext = field(default_factory=StepContext)
    # amp.set_half_dtype's choice by name ("float16", "bfloat16", "cbfloat16");
    # amp/half.py maps it to the type.
    half_dtype: str = "float16"
    # Whether each optimizer's latest step was skipped by a loss scaler (amp/skip.py).
    # Weak keys: the record never keeps an optimizer alive nor puts an attribute on it.
    skipped_steps: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # Keys of the log lines said once a run, such as a data section's summary, which a
    # run builds more than once (the compile phase's example batch, then training).
    logged: set = field(default_factory=set)
    # A compile_only or validate_only run's first step has planned the model
    # (Note [compile only] in weightstream/executor.py): later steps return at once.
    compiled_without_running: bool = False


_run = RunContext()  # the current run: Note [run context]


def current_run() -> RunContext:
    """The run context of this process (Note [run context])."""
    return _run


def start_run() -> RunContext:
    """Make a fresh run context the current one and return it.

    Forgets the configuration, the step counter, the half type and the skipped
    steps of the previous run. Objects built in the previous run (a GradScaler,
    a DataLoader) keep what they read from it when they were built.
    """
    global _run  # the one holder of run state (Note [run context])
    _run = RunContext()
    return _run


def configure(**kwargs) -> RunConfig:
    """Set the run configuration for this process; a second call is an error.

    Takes the keyword arguments of the reference ``cstorch.configure`` (see
    :class:`~weightstream.config.RunConfig`). Arguments that only address a
    remote cluster (``mgmt_address`` and the like) are accepted and kept in
    ``extra``.
    """
    run = current_run()
    if run.config is not None:
        raise RuntimeError(
            "configure() was already called in this process; it applies globally and can be "
            "called only once. Start a new process for a run with a different configuration."
        )
    run.config = parse_configure_arguments(**kwargs)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's and weightstream launch's
    if run.config.num_csx > 1 and ranks != run.config.num_csx:
        warnings.warn(
            f"configure(num_csx={run.config.num_csx}), but this process is one of {ranks} "
            "rank(s): configure() starts no processes, so it trains as those ranks do. Fix: "
            f"start the script as {run.config.num_csx} ranks, `weightstream launch --num_csx "
            f"{run.config.num_csx} script.py` or `torchrun --nproc_per_node "
            f"{run.config.num_csx} script.py`.",
            stacklevel=2,
        )
    return run.config


@contextlib.contextmanager
def run_configuration(**kwargs) -> Iterator[RunConfig]:
    """The configuration of one run of the ``weightstream run`` command.

    Unlike :func:`configure`, which a user's script calls once per process, the
    command runs in a fresh run context with this configuration and puts the
    previous context back afterwards, so several runs can share a process
    (tests, notebooks) and none sees another's steps, half type or skipped steps.
    """
    global _run  # the one holder of run state (Note [run context])
    previous = _run
    _run = RunContext(config=RunConfig(**kwargs))
    try:
        yield _run.config
    finally:
        _run = previous


def current_config() -> RunConfig:
    """The configuration set by :func:`configure`, or the defaults if it was never called."""
    config = current_run().config
    return config if config is not None else RunConfig()

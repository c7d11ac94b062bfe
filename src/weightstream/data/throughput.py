"""How fast an input pipeline produces batches: the measurement behind the input
analyzer (``weightstream input-analyzer``) and the compile phase's input term.

A params section (``train_input`` or ``eval_input``, as a dict) names a data
processor; the processor builds a torch DataLoader. :func:`measure_input`
builds it with a given ``num_workers``, takes ``warmup`` batches (worker start
and the first batches, which a training run pays once), then times
``steps`` more: the steady-state rate at which the training process receives
batches. With ``num_workers=0`` that is also the time a training step spends
producing its batch, serially with the step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from weightstream.data.streaming import batch_size_of

_WORKER_KEYS = ("prefetch_factor", "persistent_workers")


@dataclass(frozen=True)
class InputMeasurement:
    """One timed run of a pipeline."""

    num_workers: int
    batches: int  # timed batches (after the warm-up)
    samples: int
    seconds: float  # wall time of the timed batches
    startup_s: float  # building the loader and the warm-up batches

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def seconds_per_batch(self) -> float:
        return self.seconds / self.batches if self.batches else 0.0


def section_with_workers(section: dict, num_workers: int) -> dict:
    """``section`` with ``num_workers`` set (worker-only keys dropped for 0 workers)."""
    values = dict(section)
    values["num_workers"] = num_workers
    if num_workers == 0:
        for key in _WORKER_KEYS:
            values.pop(key, None)
    return values


def measure_input(
    section: dict,
    is_training: bool = True,
    num_workers: int = 0,
    steps: int = 20,
    warmup: int | None = None,
    max_seconds: float | None = None,
    between: Callable[[], object] | None = None,
) -> InputMeasurement:
    """Time ``steps`` batches of the pipeline ``section`` describes, with ``num_workers``.

    ``warmup``: batches taken before timing (default: one per worker plus one,
    so that every worker has started). ``max_seconds``: stop timing early
    after this long (at least one batch is timed). ``between``: called (not
    timed) after each timed batch: a stand-in for the training step that
    separates two fetches in a run. The loader is iterated again from the
    start when it runs out.
    """
    from weightstream.data.processors import get_data_processor

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}.")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers!r}.")
    if "data_processor" not in section:
        raise ValueError(
            "the input section has no data_processor; name one (e.g. DigitsProcessor)."
        )
    warmup = num_workers + 1 if warmup is None else warmup
    processor = get_data_processor(section["data_processor"])
    t_start = time.perf_counter()
    with warnings.catch_warnings():
        # A measurement run: the section's own warnings were shown when it was parsed.
        warnings.simplefilter("ignore")
        loader = processor(section_with_workers(section, num_workers), is_training)
    it = iter(loader)

    def next_batch():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(loader)
            return next(it)

    try:
        for _ in range(warmup):
            next_batch()
        t0 = time.perf_counter()
        startup = t0 - t_start
        batches = samples = 0
        seconds = 0.0
        while batches < steps:
            t_batch = time.perf_counter()
            samples += batch_size_of(next_batch())
            seconds += time.perf_counter() - t_batch
            batches += 1
            if between is not None:
                between()
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                break
    finally:
        del it  # shuts the worker processes down
    return InputMeasurement(num_workers, batches, samples, seconds, startup)

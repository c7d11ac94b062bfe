"""PyTorch operators on helper threads: their OpenMP teams, and a shared pool of
single-threaded workers (Notes [helper threads and OpenMP] in runtime/device.py and
[compact kernels on many cores] in optim/compact.py)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")

# Slices of the items per worker: contiguous runs (few futures), enough of them that
# a worker slowed by other threads leaves its share to the rest.
SLICES_PER_WORKER = 4


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch's operators run on, if PyTorch already loaded one."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"):
        try:  # RTLD_NOLOAD: the library already in the process, never a new one
            return ctypes.CDLL(name, mode=noload | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def single_threaded_operators() -> None:
    """The PyTorch operators of the calling thread run on it alone; other threads keep
    their teams (Note [helper threads and OpenMP] in runtime/device.py)."""
    runtime = openmp_runtime()
    if runtime is not None:
        # PyTorch sizes a thread's team at its first call (a lazy per-thread init from
        # the process-wide torch.set_num_threads), over what was set before: first that.
        torch.get_num_threads()
        runtime.omp_set_num_threads(1)


class _Workers:
    """The process's kernel workers, made at the first call that needs them and
    widened when a caller needs more (their threads idle between calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._width = 0

    def get(self, width: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._width < width:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)  # a caller still on it finishes there
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=width,
                    thread_name_prefix="weightstream-kernel",
                    initializer=single_threaded_operators,
                )
                self._width = width
            return self._pool

    def forget(self) -> None:
        """In a forked child: the parent's workers are not there (a pool of them would
        take work and never run it)."""
        self._lock = threading.Lock()
        self._pool, self._width = None, 0


# Owner: this module, for the process.
_WORKERS = _Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKERS.forget)


def _run_all(fn: Callable[[T], None], items: list[T]) -> None:
    for item in items:
        fn(item)


def run_on_threads(fn: Callable[[T], None], items: Iterable[T]) -> None:
    """``fn(item)`` for every item, on as many threads as the calling thread's
    operators would use (``torch.get_num_threads()`` there: 1 on the CPU engine's
    helper threads, which then run them all themselves). The workers' own operators
    run single-threaded, so a run of many small operators opens no OpenMP region at
    all. ``fn`` must not depend on the order. Returns once every item is done; the
    first exception raised is raised here, after all the others finished."""
    items = list(items)
    width = min(torch.get_num_threads(), len(items))
    if width <= 1:
        _run_all(fn, items)
        return
    pool = _WORKERS.get(width)
    n = min(len(items), width * SLICES_PER_WORKER)
    bounds = [len(items) * i // n for i in range(n + 1)]
    futures = [pool.submit(_run_all, fn, items[a:b]) for a, b in itertools.pairwise(bounds)]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()  # the first failure, in order

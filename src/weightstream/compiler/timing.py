"""How the machine profile times anything on a shared machine.

``seconds`` (the first quartile of short bursts filling a budget), ``OtherLoad``
(how busy the other processes kept the CPUs), ``Calm`` and ``CalmPhases`` (what is
measured again while they are busy, and what is named disturbed), and ``Sizes``.
``torch.utils.benchmark`` does not fit: its ``blocked_autorange`` grows a burst
until the timer's overhead is under 0.01% of it (10 ms for a microsecond operator,
where this rule wants 50 us) with no least count of bursts, and
``adaptive_autorange`` stops on a spread, not on a time budget.

Note [quiet timings]
--------------------
The profile is measured once and prices every later estimate, so it must
describe the machine, not the neighbours that happened to run while it was
measured. On a shared CPU another busy process does not slow PyTorch a little:
an operator split over the thread pool waits for whichever worker the
scheduler took away, and a burst that meets such a wait runs 2x to 500x slower
(measured: a 64 x 64 product at 60 GFLOP/s undisturbed and 0.1 GFLOP/s in
the worst bursts, with other processes using 78% of 2 CPUs). A median is
right only while fewer than half the bursts are disturbed. The fastest burst
is not the answer either: with nothing else running, a 256^3 product on both
cores of this kind of virtual machine runs at 125 GFLOP/s in most bursts and
at 210 in a few (the second virtual CPU is not always there when the first
one wants it), and a training run sees the typical burst. So a timing is the
first quartile of its bursts: the typical undisturbed burst while up to three
quarters of them are disturbed. Bursts are as short as the clock allows (one
call, or enough calls for _BURST_SECONDS): the shorter the burst, the likelier
it runs between two interruptions. Measuring for a fixed budget rather than a
fixed count also bounds the profile's duration on a busy machine.

A longer disturbance (another process busy for a second) spoils every burst of
a repetition: a repetition measured while other processes used more than CALM
of the CPUs (``OtherLoad``: /proc/stat's busy time less this process's, over
the wall time x the CPUs) is measured again after a pause, up to
``Patience.retries`` times (``Calm``), and each figure is the best of its
repetitions. Longer still (another process busy through a whole phase of the
profile), the retries keep a busy repetition: that phase (the hardware
figures, the fixed costs, the operator curves, the in-situ factor, an update
cost) is measured once more after waiting up to ``Patience.wait_s`` for the
machine to go quiet (``CalmPhases``). A phase busy all the same is named in
the profile's ``disturbed``, and the next run measures a profile with a
disturbed phase again rather than trust it (an update cost or an attention
curve so measured is not kept). Ranks of one data-parallel
run on one host measure at the same time and look busy to each other: their
profiles are not judged. What such timings do not capture is deliberate: a
training run disturbed by other processes is slower than estimated by as much
as it was disturbed (``OtherLoad`` says how much).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

REPEATS = 3  # repetitions of each headline figure: the best kept, all in its ``samples``
MIN_BURSTS = 8  # a timing is the first quartile of at least this many bursts
QUANTILE = 0.25  # ... of its bursts (Note [quiet timings])
_BURST_SECONDS = 50e-6  # shortest burst: well above the clock's resolution and its cost
CALM = 0.2  # share of the CPUs other processes may use while a repetition is measured


@dataclass(frozen=True)
class Patience:
    """How a profile waits out other processes."""

    retries: int  # a repetition measured while others used more than CALM: again, this often
    pause_s: float  # before the first retry (2x before the second, ...)
    wait_s: float  # a phase busy all the same: measured once more after waiting for quiet
    judged: bool  # a phase still busy is named disturbed (False: kept as measured)


@dataclass(frozen=True)
class Sizes:
    """How long and how large each measurement of the profile is (defaults: ``FULL``)."""

    matmul_seconds: float = 0.1  # target duration of one matmul measurement
    matmul_max_n: int = 4096  # largest square matrix (memory: 3 n^2 elements)
    copy_bytes: int = 64 * 2**20
    copy_seconds: float = 0.15  # one timing of a copy
    disk_bytes: int = 64 * 2**20
    curve_seconds: float = 0.03  # one point of a throughput curve
    curve_repeats: int = 3  # measurements of each curve (each point: their best), of fixed costs
    matmul_curve: tuple[int, ...] = (16, 32, 64, 128, 256, 512)  # n of the n x n x n products
    # (T, head_dim) of the causal attentions
    attention: tuple[tuple[int, int], ...] = ((64, 16), (128, 32), (256, 64), (512, 64))
    simple_numel: tuple[int, ...] = (2**14, 2**18, 2**22)  # elements of x (and y) in x * y
    class_numel: int = 2**18  # elements of the input of each operator class
    overhead_seconds: float = 0.06  # one timing of the tiny chain
    tiny_units: int = 8  # blocks of the tiny chain (units when streamed)
    wide_features: int = 512  # features of the wide chain's blocks (2 x d^2 weights each)
    live_sets: int = 8  # most argument sets of one timed training-like pass
    update_seconds: float = 0.1  # one timing of an update sequence
    update_sets: int = 4  # models updated in turn (updates.py)
    update_numel: int | None = None  # elements of the update's large tensor (None: the model's)
    proxy: tuple[int, int, int, int] = (8, 128, 128, 4)  # (batch, seq_len, d_model, heads)
    proxy_steps: int = 90  # timed training steps of the in-situ proxy (after 2 untimed ones)
    patience: Patience = Patience(retries=3, pause_s=0.25, wait_s=30.0, judged=True)


FULL = Sizes()
# Tiny sizes for tests: they want the figures, not calm (nothing retried or judged).
QUICK = Sizes(
    matmul_seconds=0.01,
    matmul_max_n=128,
    copy_bytes=2**20,
    copy_seconds=0.02,
    disk_bytes=2**20,
    curve_seconds=0.002,
    curve_repeats=1,
    matmul_curve=(16, 64),
    attention=((16, 8),),
    simple_numel=(2**8, 2**12),
    class_numel=2**10,
    overhead_seconds=0.005,
    tiny_units=2,
    wide_features=32,
    live_sets=2,
    update_seconds=0.005,
    update_sets=2,
    update_numel=2**12,
    proxy=(2, 8, 16, 2),
    proxy_steps=2,
    patience=Patience(retries=0, pause_s=0.0, wait_s=0.0, judged=False),
)


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        # Host sync point: a timing is only meaningful once the device is done.
        torch.accelerator.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, budget: float) -> float:
    """Seconds per call of ``fn``: the first quartile of the short bursts that fill
    ``budget`` (at least MIN_BURSTS; see Note [quiet timings])."""
    fn()  # warm-up (allocations, kernel selection)
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    # As short as the clock allows: a short burst is more likely to run undisturbed.
    iters = max(1, math.ceil(_BURST_SECONDS / one))
    # A call longer than the budget allows MIN_BURSTS of gets 3 bursts: the budget
    # bounds the profile's duration.
    least = MIN_BURSTS if one * MIN_BURSTS <= budget else 3
    bursts = []
    deadline = time.perf_counter() + budget
    while len(bursts) < least or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        bursts.append((time.perf_counter() - t0) / iters)
    return first_quartile(bursts)


def seconds_after(
    fn: Callable[[], object], before: Callable[[], object], device: torch.device, budget: float
) -> float:
    """Seconds per call of ``fn`` when each call follows an untimed ``before()``: the
    first quartile of the calls that fill ``budget`` (at least MIN_BURSTS, before()
    included in the budget). For work whose speed depends on what ran just before it
    (Note [update in context] in updates.py): each burst is one call."""
    before()
    fn()  # warm-up
    sync(device)
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < MIN_BURSTS or time.perf_counter() < deadline:
        before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return first_quartile(times)


def first_quartile(times: list[float]) -> float:
    """The QUANTILE of ``times``."""
    ordered = sorted(times)
    return ordered[int(QUANTILE * (len(ordered) - 1))]


class OtherLoad:
    """How busy the other processes kept the CPUs while a ``with`` block ran.

    ``fraction``: the CPU time used by every other process over the block's
    wall time x the number of CPUs (0: this process had the machine to itself;
    0.5 on 2 CPUs: another process kept one CPU busy). None where
    ``/proc/stat`` is missing. A measurement taken with other processes busy
    is pessimistic: on a CPU, PyTorch's thread pool waits for a descheduled
    worker at every parallel operator. A child process waited on inside the
    block counts as this process.
    """

    fraction: float | None = None

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:]
        except OSError:
            return None
        jiffies = [int(v) for v in fields]
        idle = jiffies[3] + (jiffies[4] if len(jiffies) > 4 else 0)  # idle + iowait
        return (sum(jiffies[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> OtherLoad:
        self._busy = self._busy_seconds()
        self._own = sum(os.times()[:4])
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        busy = self._busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is not None and self._busy is not None and wall > 0:
            other = (busy - self._busy) - (sum(os.times()[:4]) - self._own)
            self.fraction = min(1.0, max(0.0, other / (wall * (os.cpu_count() or 1))))
        return False


def wait_for_quiet(timeout: float, threshold: float = CALM, window: float = 0.5) -> bool:
    """Wait until other processes use at most ``threshold`` of the CPUs over ``window``
    seconds (at least one window, then until ``timeout`` seconds have passed). True
    once they do, or where /proc/stat is missing; False at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        with OtherLoad() as load:
            time.sleep(window)
        if load.fraction is None or load.fraction <= threshold:
            return True
        if time.monotonic() >= deadline:
            return False


class Calm:
    """Measures the repetitions of one phase of the profile on a calm machine, and
    keeps the busiest share of the CPUs other processes used during a repetition it
    kept."""

    def __init__(self, patience: Patience):
        self.patience = patience
        self.busiest = 0.0

    def __call__(self, measure: Callable[[], T]) -> T:
        """``measure()``; measured again, after a pause, while other processes used
        more than CALM of the CPUs during it (at most ``patience.retries`` times): the
        calmest attempt.

        The first quartile of a repetition's bursts ignores short interruptions,
        not a second in which another process keeps a core busy: measured with
        others at 28% of the CPUs, every repetition of a 128^3 product ran at
        1 GFLOP/s against 180."""
        calmest = None
        for attempt in range(self.patience.retries + 1):
            if attempt:
                time.sleep(self.patience.pause_s * attempt)
            with OtherLoad() as load:
                result = measure()
            share = load.fraction or 0.0
            if calmest is None or share < calmest[0]:
                calmest = (share, result)
            if share <= CALM:
                break
        self.busiest = max(self.busiest, calmest[0])
        return calmest[1]

    @property
    def disturbed(self) -> bool:
        return self.busiest > CALM


class CalmPhases:
    """The phases of one measurement, each run with its own :class:`Calm`.

    A phase that kept a busy repetition is measured once more when the machine
    has gone quiet (waiting up to ``patience.wait_s``, and only for a moment
    once a wait was in vain), the calmer of the two kept; busy all the same,
    and judged, it is named in ``disturbed``.
    """

    def __init__(self, patience: Patience):
        self.patience = patience
        self.disturbed: list[str] = []
        self._wait_s = patience.wait_s

    def run(self, name: str, phase: Callable[[Calm], T]) -> T:
        calm = Calm(self.patience)
        result = phase(calm)
        if not (self.patience.judged and calm.disturbed):
            return result
        if wait_for_quiet(self._wait_s):
            again = Calm(self.patience)
            retried = phase(again)
            if again.busiest <= calm.busiest:
                result, calm = retried, again
        else:
            self._wait_s = 0.0  # busy all along: the next phases only look
        if calm.disturbed:
            self.disturbed.append(name)
        return result


def best_of(fn: Callable[[], float], calm: Calm, repeats: int = REPEATS):
    """The best (highest) of ``repeats`` calm throughput measurements, and all of them."""
    samples = [calm(fn) for _ in range(repeats)]
    return max(samples), samples


def best_curve(
    measure_curve: Callable[[], dict[str, float]], repeats: int, calm: Calm
) -> dict[str, float]:
    """Each point of a throughput curve: the best of ``repeats`` calm measurements."""
    curves = [calm(measure_curve) for _ in range(repeats)]
    return {k: max(c[k] for c in curves) for k in curves[0]}

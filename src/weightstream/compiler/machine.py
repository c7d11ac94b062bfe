"""What this machine can do, measured once and cached: the denominators of the estimate.

Hardware figures (throughputs of the compute device and its host):

* matmul peak (FLOP/s) per dtype: ``torch.mm`` of square matrices on the
  compute device, sized (and repeated) to take about 0.1 s;
* matmul throughput by size (float32): ``n x n x n`` products for n from 16
  to 512, timed as in a training pass (each of its own operands, outputs
  kept alive: 10-20% slower than a loop over the same hot matrices); a
  product of effective size n (``cost.matmul_size``: the geometric mean of
  its two smallest dimensions) runs at the throughput interpolated at n
  (log-log), rising to the peak beyond the largest size;
* attention throughput by size: a causal scaled dot-product attention,
  forward + backward, FLOPs counted on its math decomposition as ``cost.py``
  counts them (12 x heads x T^2 x head_dim), for (T, head_dim) from (64, 16) to
  (512, 64), keyed by the effective size cube root of T * T * head_dim;
* operator throughput (bytes read + written per second) of non-matmul
  operators: the "simple" class (elementwise arithmetic: ``x * y``, forward
  and backward) at three operator sizes, and each class of
  ``cost.OP_CLASSES`` (gelu, silu, layer_norm, softmax, transcendental) at one
  size, forward + backward, timed as in a training pass (the forwards of
  several independent inputs, outputs kept alive, then one backward: cold
  inputs and fresh outputs, not a tight loop over hot memory). Bytes are
  counted by ``cost.function_costs`` on the very function that is timed, and
  the time is the marginal one: the operators' fixed overhead (below) and,
  for a class, the simple operators of the same call (its loss) are
  subtracted first;
* host -> device copy bandwidth (bytes delivered per second): a large
  ``copy_`` from (pinned) host memory; on the CPU a host-to-host copy;
* host memory bandwidth (bytes read + written per second): a host-to-host
  copy, counting the read and the write (what the host optimizer streams);
* disk write and read bandwidth of a directory: a file written and
  ``fsync``-ed, then evicted from the page cache where the OS allows
  (``posix_fadvise(DONTNEED)``) and read back; deleted afterwards.

Software figures (fixed costs of this library and of eager PyTorch, which
dominate small models; see Note [fixed costs]):

* ``op_overhead_fwd_s`` / ``op_overhead_bwd_s``: seconds per aten operator in
  an eager forward (autograd recording) and in the backward, on tensors so
  small that their data work is nil: a chain of 8 tiny blocks (LayerNorm,
  Linear, GELU, Linear, residual add; 4 x 16 activations), operators counted
  by ``cost.function_costs`` on the same chain;
* ``unit_overhead_s``, ``param_overhead_s`` and ``stream_call_s``: seconds per
  streaming unit, per streamed parameter tensor, and per streamed call (the
  input moved to the device, the pass opened and closed, the first unit's
  prefetch handed to the background thread), per training step (forward +
  backward): the same chain streamed with each block a unit
  (``prefetch_depth=1``), streamed as one unit, and half of it streamed as one
  unit, each minus its eager twin and the units' copies at the copy
  bandwidth; the 8 units cost 7 units more than the single one, the single
  unit 24 parameter tensors more than the half one, and what is left of the
  single unit's cost is the call's. Streaming
  costs per parameter (its view of the flat buffer, its slot swapped in and
  out, its saved weight rebuilt in backward, its gradient routed back to the
  master: 40-50 us a step on a 2.5 GHz Xeon) as much as per unit: a unit of 8
  blocks costs 2.5x a unit of 1, and a one-unit model like FC-MNIST (6
  tensors) far less than a unit of a transformer (12 per block);
* ``stream_bandwidth``: bytes per second the streaming runtime moves (two
  fetches and the gradients back per unit and step): a chain of 8 blocks of
  512 features (2 MiB of weights each) streamed, minus its eager twin, minus
  what its units and parameter tensors cost, over the bytes moved; fresh
  buffers, page faults
  and the background hand-off included, which a plain copy does not see;
* ``step_overhead_s``: seconds per step of the run loop's bookkeeping (the
  trainer's loss function on labels, the loss summed and read back, a loss-log
  line, 4 TensorBoard scalars and their writer thread's interference): a
  trainer-like step of the eager chain minus a bare one;
* ``in_situ_factor``: how much slower a training step runs than the sum of
  its parts timed alone (Note [in situ]);
* optimizer update costs (``UpdateCost``), measured the first time a run asks
  for an optimizer setting and kept in ``update_costs``: the update sequence
  of the trainer (unscale, clip, step, scaler update, zero_grad, the
  learning-rate scheduler's step) timed on 1 tensor of 16 elements, on 64
  such tensors, and on 1 tensor as large as the model's trainable parameters
  (rounded up to a power of two; ``update_spec``), which gives a fixed cost, a
  cost per parameter tensor and a cost per element; 4 such models are updated
  in turn, so that each update finds its tensors cold, as after a forward and
  a backward.

Every timing is the first quartile of many short bursts, and each headline
figure the best of 3 such timings (``samples`` keeps all three, so a report
can show min/median/max), each point of a curve the best of 3 measurements of
the curve (1 with ``quick``); a figure that is the difference of two timings
(the software figures below) is the median of its 3 differences. See Note
[quiet timings]. The profile is cached as JSON under
``$WEIGHTSTREAM_CACHE_DIR`` (default ``~/.cache/weightstream``), in a file
named by a hash of the device name, the torch version, the thread count and
the profile's schema, so a different machine, torch or thread setting
measures again. The software figures also carry a digest of this library's
runtime sources (``runtime_digest``): when the runtime changes they alone are
measured again.

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
fixed count also bounds the profile's duration on a busy machine. A longer
disturbance (another process busy for a second) spoils every burst of a
repetition: a repetition measured while other processes used more than CALM
of the CPUs is measured again after a pause, up to CALM_RETRIES times
(``_calm``), and each figure is the best of its repetitions. What such
timings do not capture is deliberate: a training run disturbed by other
processes is slower than estimated by as much as it was disturbed
(``OtherLoad`` says how much).

Note [fixed costs]
------------------
A training step of a small model is mostly overhead: each aten operator
costs microseconds of Python, dispatch and autograd bookkeeping whatever its
size, each streamed unit costs hooks, a fetch in forward and another in
backward, a background-thread hand-off and its autograd node, and the
optimizer loops over parameter tensors. FLOPs at the matmul peak see none of
it (a 3-layer MLP on 64 samples estimates 8x too fast without these terms).
The constants are measured on purpose-built tiny workloads, so that the data
work is negligible and the time is the overhead alone.

Note [in situ]
--------------
Every figure above times one kind of work alone, and a training step is
slower than the sum of its parts so timed. Inside a step the operands of an
operator were written long before and left the caches, its output often
lands on memory the allocator has just taken from the kernel (a page fault
per 4 KiB: fresh memory is written at 3 GB/s against 14 GB/s for reused
memory on a 2.5 GHz Xeon VM), the backward runs with every activation alive,
and the prefetch thread allocates and copies beside the compute. Measured per
operator in a streamed training step on such a machine (2 threads, nothing
else running): products at 1.2x to 2x their alone-timed figures (backward
ones with large outputs the slowest), broadcast and reduction elementwise
operators at 2x to 7x, attention and GELU at 1x; the whole step 25-40%
slower than the sum. None of this is a property of one operator: it is how
the machine runs a training step. ``in_situ_factor`` measures it on a proxy,
two small decoder blocks with the operator mix of the model zoo's (a GPT-2
block: LayerNorm, fused qkv, causal attention, GELU MLP; a Llama block: RMS
norm, rotary positions, SwiGLU), streamed through the runtime for a few
training steps: their typical time over the estimate of the same step from
the figures above (``estimate.py``). Typical is the mean of 30 steps without
the slowest tenth, not the first quartile of Note [quiet timings]: with
nothing else running, the proxy's steps on a 2-vCPU VM alternate between
phases of ~35 ms and of ~50 ms lasting a few steps each, a run's samples/sec
is the mean over both, and a first quartile of 10 steps (one phase) put the
factor anywhere between 0.84 and 1.48 from one measurement to the next. The
estimate multiplies each pass's work (compute, memory, operators), the
streaming bookkeeping and
the optimizer update by it (an update measured alone, cold tensors and all,
runs 1.6-1.8x faster than the same update inside a run); transfers, the input
and the loop's bookkeeping are timed in their own context and stay as they
are. It is measured with the software figures (the proxy streams through the
runtime).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.common.files import write_text_atomic
from weightstream.compiler.profile import SCHEMA, MachineProfile, UpdateCost, _interp

REPEATS = 3
MIN_BURSTS = 8  # a timing is the first quartile of at least this many bursts
QUANTILE = 0.25  # ... of its bursts (Note [quiet timings])
_BURST_SECONDS = 50e-6  # shortest burst: well above the clock's resolution and its cost
ENV_CACHE_DIR = "WEIGHTSTREAM_CACHE_DIR"
_DTYPES = ("float32", "bfloat16", "float16")
# The package files whose code the software figures time (Note [fixed costs]).
_RUNTIME_SOURCES = ("runtime", "train", "optim", "amp", "common", "backend.py", "executor.py")


@dataclass(frozen=True)
class _Sizes:
    matmul_seconds: float  # target duration of one matmul measurement
    matmul_max_n: int  # largest square matrix (memory: 3 n^2 elements)
    copy_bytes: int
    disk_bytes: int
    curve_seconds: float  # one point of a throughput curve
    curve_repeats: int  # measurements of each curve (each point: their median)
    matmul_curve: tuple[int, ...]  # n of the n x n x n products
    attention: tuple[tuple[int, int], ...]  # (T, head_dim) of the causal attentions
    simple_numel: tuple[int, ...]  # elements of x (and y) in x * y
    class_numel: int  # elements of the input of each operator class
    overhead_seconds: float  # one timing of the tiny chain
    tiny_units: int  # blocks of the tiny chain (units when streamed)
    wide_features: int  # features of the wide chain's blocks (2 x d^2 weights each)
    live_sets: int  # most argument sets of one timed training-like pass
    update_numel: int  # elements of the large tensor of the update measurement
    proxy: tuple[int, int, int, int]  # (batch, seq_len, d_model, heads) of the in-situ proxy
    proxy_steps: int  # timed training steps of the proxy (after 2 untimed ones)


_FULL = _Sizes(
    matmul_seconds=0.1,
    matmul_max_n=4096,
    copy_bytes=64 * 2**20,
    disk_bytes=64 * 2**20,
    curve_seconds=0.03,
    curve_repeats=3,
    matmul_curve=(16, 32, 64, 128, 256, 512),
    attention=((64, 16), (128, 32), (256, 64), (512, 64)),
    simple_numel=(2**14, 2**18, 2**22),
    class_numel=2**18,
    overhead_seconds=0.06,
    tiny_units=8,
    wide_features=512,
    live_sets=8,
    update_numel=2**20,
    proxy=(8, 128, 128, 4),
    proxy_steps=30,
)
_QUICK = _Sizes(
    matmul_seconds=0.01,
    matmul_max_n=128,
    copy_bytes=2**20,
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
    update_numel=2**12,
    proxy=(2, 8, 16, 2),
    proxy_steps=2,
)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"
    return device.type


def runtime_digest() -> str:
    """A digest of the library sources whose speed the software figures measure."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in _RUNTIME_SOURCES:
        path = root / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "weightstream"


def profile_key(device: torch.device | str, quick: bool = False) -> str:
    device = torch.device(device)
    # The schema too: checkouts of different versions sharing one cache directory
    # keep a profile each instead of measuring again over each other's.
    ident = [
        device.type,
        device_name(device),
        torch.__version__,
        torch.get_num_threads(),
        quick,
        SCHEMA,
    ]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def default_path(device: torch.device | str, quick: bool = False) -> Path:
    return default_cache_dir() / f"machine-{profile_key(device, quick)}.json"


# ---- timing -----------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        # Host sync point: a timing is only meaningful once the device is done.
        torch.accelerator.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, budget: float) -> float:
    """Seconds per call of ``fn``: the first quartile of the short bursts that fill
    ``budget`` (at least MIN_BURSTS; see Note [quiet timings])."""
    fn()  # warm-up (allocations, kernel selection)
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
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
        _sync(device)
        bursts.append((time.perf_counter() - t0) / iters)
    return _quiet(bursts)


def _quiet(times: list[float]) -> float:
    """The QUANTILE of ``times`` (Note [quiet timings])."""
    ordered = sorted(times)
    return ordered[int(QUANTILE * (len(ordered) - 1))]


class OtherLoad:
    """How busy the other processes kept the CPUs while a ``with`` block ran.

    ``fraction``: the CPU time used by every other process over the block's
    wall time x the number of CPUs (0: this process had the machine to itself;
    0.5 on 2 CPUs: another process kept one CPU busy). None where
    ``/proc/stat`` is missing. A measurement taken with other processes busy
    is pessimistic: on a CPU, PyTorch's thread pool waits for a descheduled
    worker at every parallel operator.
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
        self._own = sum(os.times()[:2])
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        busy = self._busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is not None and self._busy is not None and wall > 0:
            other = (busy - self._busy) - (sum(os.times()[:2]) - self._own)
            self.fraction = min(1.0, max(0.0, other / (wall * (os.cpu_count() or 1))))
        return False


CALM = 0.2  # share of the CPUs other processes may use while a repetition is measured
CALM_RETRIES = 3  # a repetition measured with more is measured again, at most this often


def _calm(measure: Callable[[], object], retries: int = CALM_RETRIES):
    """``measure()``; measured again, after a pause, while other processes used more
    than CALM of the CPUs during it (at most ``retries`` times): the calmest attempt.

    The first quartile of a repetition's bursts ignores short interruptions, not
    a second in which another process keeps a core busy: measured with others at
    28% of the CPUs, every repetition of a 128^3 product ran at 1 GFLOP/s against
    180 (Note [quiet timings])."""
    calmest = None
    for attempt in range(retries + 1):
        with OtherLoad() as load:
            result = measure()
        share = load.fraction or 0.0
        if calmest is None or share < calmest[0]:
            calmest = (share, result)
        if share <= CALM:
            break
        time.sleep(0.25 * (attempt + 1))
    return calmest[1]


def _retries(sizes: _Sizes) -> int:
    return 0 if sizes is _QUICK else CALM_RETRIES  # tests want the figures, not calm


def _best_curve(measure_curve: Callable[[], dict[str, float]], sizes) -> dict[str, float]:
    """Each point of a throughput curve: the best of ``sizes.curve_repeats`` measurements."""
    curves = [_calm(measure_curve, _retries(sizes)) for _ in range(sizes.curve_repeats)]
    return {k: max(c[k] for c in curves) for k in curves[0]}


def _best3(fn, sizes: _Sizes) -> tuple[float, list[float]]:
    """The best (highest) of REPEATS throughput measurements, and all of them."""
    samples = [_calm(fn, _retries(sizes)) for _ in range(REPEATS)]
    return max(samples), samples


# ---- hardware measurements -----------------------------------------------------------


def _matmul_flops(device: torch.device, dtype: torch.dtype, sizes: _Sizes) -> tuple[float, list]:
    def operands(n: int):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        return a, b, out

    def seconds_per_product(n: int, budget: float) -> float:
        a, b, out = operands(n)
        return _seconds(lambda: torch.mm(a, b, out=out), device, budget)

    # Grow n until one product takes a twentieth of the target (n is capped to
    # bound memory), then time bursts of products that fill the target time.
    n = 64
    while True:
        t = seconds_per_product(n, sizes.matmul_seconds / 8)
        if t >= sizes.matmul_seconds / 20 or n >= sizes.matmul_max_n:
            break
        grow = min(4.0, (sizes.matmul_seconds / 20 / t) ** (1 / 3))
        n = min(sizes.matmul_max_n, max(n + 64, int(n * grow) // 64 * 64))

    def one() -> float:
        return 2 * n**3 / seconds_per_product(n, sizes.matmul_seconds)

    return _best3(one, sizes)


def _dispatch_seconds(device: torch.device, budget: float) -> float:
    """One operator on a one-element tensor without autograd: the floor of any call."""
    a = torch.ones(1, device=device)
    out = torch.empty(1, device=device)
    return _seconds(lambda: torch.add(a, a, out=out), device, budget)


_LIVE_BYTES = 64 * 2**20  # what a timed pass keeps alive, at most


def _matmul_curve(device: torch.device, sizes: _Sizes, floor: float) -> dict[str, float]:
    """FLOP/s of n x n x n products as in a training pass: each product of its own
    operands, its output kept (see :func:`_fwd_bwd_seconds`)."""
    curve = {}
    for n in sizes.matmul_curve:

        def make(n=n):
            return torch.randn(n, n, device=device), torch.randn(n, n, device=device)

        pairs = _instances(make, sizes.live_sets)

        def products(pairs=pairs):
            return [torch.mm(a, b) for a, b in pairs]

        t = _seconds(products, device, sizes.curve_seconds) / len(pairs)
        curve[str(n)] = 2 * n**3 / max(t - floor, t / 10)
    return curve


def _instances(make_args: Callable[[], tuple], most: int) -> list[tuple]:
    """Argument sets for one timed pass: 2 to ``most``, about _LIVE_BYTES in all."""
    first = make_args()
    nbytes = sum(a.numel() * a.element_size() for a in first)
    more = max(1, min(most - 1, _LIVE_BYTES // nbytes - 1))
    return [first] + [make_args() for _ in range(more)]


def _fwd_bwd_seconds(fn: Callable, arg_sets: list[tuple], device: torch.device, budget: float):
    """Seconds of one forward + backward (of the sum) of ``fn`` on one argument set.

    Timed as in a training pass: the forwards of every set first (each reads
    inputs no other operator just touched and keeps its outputs alive, as
    activations are), then one backward through all of them; the pass's time
    over the number of sets. Operators that reuse hot, just-freed memory in a
    tight loop run several times faster than inside a model.
    """

    def step():
        loss = sum(fn(*args).sum() for args in arg_sets)
        loss.backward()
        for args in arg_sets:
            for a in args:
                a.grad = None

    with torch.enable_grad():
        return _seconds(step, device, budget) / len(arg_sets)


def _overhead_of(costs, profile_partial: dict) -> float:
    """Seconds the fixed per-operator costs of ``costs`` (one entry) account for."""
    return (
        costs.fwd_ops * profile_partial["op_overhead_fwd_s"]
        + costs.bwd_ops * profile_partial["op_overhead_bwd_s"]
    )


_TRACED: dict[tuple, object] = {}  # (what, argument shapes) -> cost.function_costs of it


def _traced(what: str, fn: Callable, args: tuple):
    """``cost.function_costs(fn, args)``, traced once per process for these shapes (a
    trace on the meta device takes a tenth of a second; the curves repeat theirs)."""
    from weightstream.compiler.cost import function_costs

    key = (what, tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args))
    if key not in _TRACED:
        _TRACED[key] = function_costs(fn, args)
    return _TRACED[key]


def _attention_curve(
    device: torch.device, sizes: _Sizes, partial: dict, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    from weightstream.compiler.cost import attention_size

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    curve = {}
    for t_len, head_dim in sizes.attention:
        shape = (1, 4, t_len, head_dim)  # [B, heads, T, head_dim]

        def make(shape=shape):
            return tuple(
                torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )

        arg_sets = _instances(make, sizes.live_sets)
        args = arg_sets[0]
        costs = _traced("attention", attention, args)
        flops = costs.flops  # 12 x heads x T^2 x head_dim, as cost.py counts attention
        t = _fwd_bwd_seconds(attention, arg_sets, device, sizes.curve_seconds)
        simple = _simple_seconds(costs, partial)
        curve[str(attention_size(args, {}))] = flops / max(t - simple, t / 10)
    return curve


def _simple_seconds(costs, partial: dict) -> float:
    """Fixed costs plus the simple operators' time of ``costs`` (what is not the class)."""
    seconds = _overhead_of(costs, partial)
    curve = partial.get("op_bandwidth", {}).get("simple")
    if curve:
        for mem in (costs.fwd_mem, costs.bwd_mem):
            for nbytes, total in mem.get("simple", {}).items():
                seconds += total / _interp(curve, nbytes)
    return seconds


def _class_functions() -> dict[str, tuple[Callable, Callable[[int, torch.device], tuple]]]:
    """Operator class -> (function, its arguments for n elements): what is timed."""

    def rows(n: int, device: torch.device) -> tuple:
        return (torch.randn(n // 128, 128, device=device, requires_grad=True),)

    def norm_args(n: int, device: torch.device) -> tuple:
        return (
            *rows(n, device),
            torch.ones(128, device=device, requires_grad=True),
            torch.zeros(128, device=device, requires_grad=True),
        )

    return {
        "gelu": (lambda x: F.gelu(x, approximate="tanh"), rows),
        "silu": (F.silu, rows),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (128,), w, b), norm_args),
        "softmax": (lambda x: torch.softmax(x, -1), rows),
        "transcendental": (torch.tanh, rows),
    }


def _op_bandwidth(device: torch.device, sizes: _Sizes, partial: dict) -> dict:
    from weightstream.compiler.cost import OP_CLASSES, SIMPLE

    out: dict[str, dict[str, float]] = {SIMPLE: {}}
    partial["op_bandwidth"] = out

    def mul(x, y):
        return x * y

    for n in sizes.simple_numel:

        def make(n=n):
            return tuple(torch.randn(n, device=device, requires_grad=True) for _ in range(2))

        arg_sets = _instances(make, sizes.live_sets)
        costs = _traced("mul", mul, arg_sets[0])
        t = _fwd_bwd_seconds(mul, arg_sets, device, sizes.curve_seconds)
        moved = costs.fwd_mem_bytes + costs.bwd_mem_bytes
        out[SIMPLE][str(3 * 4 * n)] = moved / max(t - _overhead_of(costs, partial), t / 10)
    functions = _class_functions()
    assert set(functions) == set(OP_CLASSES), "every operator class has a measurement"
    for cls, (fn, make_args) in functions.items():
        arg_sets = _instances(
            lambda make_args=make_args: make_args(sizes.class_numel, device), sizes.live_sets
        )
        costs = _traced(cls, fn, arg_sets[0])
        t = _fwd_bwd_seconds(fn, arg_sets, device, sizes.curve_seconds)
        moved = sum(costs.fwd_mem.get(cls, {}).values()) + sum(costs.bwd_mem.get(cls, {}).values())
        key = str(max([*costs.fwd_mem.get(cls, {}), *costs.bwd_mem.get(cls, {})]))
        out[cls] = {key: moved / max(t - _simple_seconds(costs, partial), t / 10)}
    return out


def _copy_bandwidths(device: torch.device, sizes: _Sizes) -> tuple[float, list, float, list]:
    numel = sizes.copy_bytes // 4
    host_src = torch.ones(numel)
    host_dst = torch.empty(numel)
    budget = 0.02 if sizes is _QUICK else 0.15

    def host_copy() -> float:
        t = _seconds(lambda: host_dst.copy_(host_src), torch.device("cpu"), budget)
        return 2 * sizes.copy_bytes / t  # read + write

    host_bw, host_samples = _best3(host_copy, sizes)
    if device.type == "cpu":
        # The compute device is the host: a device copy is a host copy, and
        # the bytes it delivers are half the bytes it moves.
        return host_bw / 2, [s / 2 for s in host_samples], host_bw, host_samples
    pinned = host_src.pin_memory()
    dev_dst = torch.empty(numel, device=device)

    def h2d() -> float:
        t = _seconds(lambda: dev_dst.copy_(pinned, non_blocking=True), device, budget)
        return sizes.copy_bytes / t

    link_bw, link_samples = _best3(h2d, sizes)
    return link_bw, link_samples, host_bw, host_samples


def _disk_bandwidths(directory: Path, nbytes: int) -> tuple[float, list, float, list]:
    directory.mkdir(parents=True, exist_ok=True)
    chunk_len = min(nbytes, 8 * 2**20)
    # Random bytes: a compressing file system must not make the write look fast.
    chunk = torch.randint(0, 256, (chunk_len,), dtype=torch.uint8).numpy().tobytes()
    buf = bytearray(chunk_len)
    writes, reads = [], []
    for _ in range(REPEATS):
        fd, name = tempfile.mkstemp(prefix=".weightstream-diskprobe-", dir=directory)
        try:
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                left -= os.write(fd, chunk[: min(left, chunk_len)])
            os.fsync(fd)
            writes.append(nbytes / (time.perf_counter() - t0))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from disk, not cache
            os.close(fd)
            fd = -1
            with open(name, "rb", buffering=0) as f:
                t0 = time.perf_counter()
                while f.readinto(buf):
                    pass
                reads.append(nbytes / (time.perf_counter() - t0))
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(name)
    return statistics.median(writes), writes, statistics.median(reads), reads


# ---- software measurements (Note [fixed costs]) ----------------------------------------


class _TinyBlock(nn.Module):
    """A transformer-like block (16 features unless told): the operator mix of real models."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _tiny_chain(units: int = _FULL.tiny_units, d: int = 16) -> nn.Sequential:
    return nn.Sequential(*[_TinyBlock(d) for _ in range(units)])


class _TinyGroup(nn.Module):
    """Tiny blocks in one module: streamed as one unit (``unit_classes=[_TinyGroup]``)."""

    def __init__(self, blocks: nn.Sequential):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        return self.blocks(x)


def _fwd_bwd_split(model, x, device: torch.device, budget: float) -> tuple[float, float]:
    """(forward, backward) seconds of ``model(x).sum()``: the first quartiles of the
    steps that fit in ``budget`` seconds (at least MIN_BURSTS; Note [quiet timings]).
    The gradients are dropped after each step (not timed), as the trainer's
    ``zero_grad(set_to_none=True)`` does."""
    model(x).sum().backward()  # warm-up
    model.zero_grad(set_to_none=True)
    fwd, bwd = [], []
    deadline = time.perf_counter() + budget
    while len(fwd) < MIN_BURSTS or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        loss = model(x).sum()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        model.zero_grad(set_to_none=True)
    return _quiet(fwd), _quiet(bwd)


SCALARS_PER_STEP = 4  # Trainer._log: loss, lr, loss_scale, samples_per_sec


@contextlib.contextmanager
def tiny_training_steps(device: torch.device | str = "cpu"):
    """A callable doing what surrounds a batch fetch in a run, for timing input in context.

    Timing an input pipeline's batches back to back flatters it (about 2x for a
    small in-memory dataset on a CPU): inside a run each fetch follows a
    training step, which leaves the caches and the thread pool in another
    state, and TensorBoard's writer thread competes with it. Each call is a
    forward + backward of the tiny chain and the SCALARS_PER_STEP scalars of a
    step, logged to a temporary directory removed on exit.
    """
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device(device)
    model = _tiny_chain().to(device)
    x = torch.randn(4, 16, device=device)
    step = 0
    with tempfile.TemporaryDirectory(prefix="weightstream-logprobe-") as tmp:
        writer = SummaryWriter(tmp)

        def training_step() -> None:
            nonlocal step
            loss = model(x).sum()
            loss.backward()
            model.zero_grad(set_to_none=True)
            step += 1
            for i in range(SCALARS_PER_STEP):
                writer.add_scalar(f"s{i}", loss.item(), step)

        try:
            yield training_step
        finally:
            writer.close()


def _step_overhead(model, x, device: torch.device, budget: float) -> float:
    """Seconds per step of what a run does around the model beyond its operators: a
    trainer-like step of ``model`` minus a bare one (interleaved bursts, first
    quartiles). Both are eager: the streamed call's own cost is ``stream_call_s``.

    The trainer-like step is what ``train.trainer.Trainer`` does each step:
    ``task_loss``'s cross-entropy on labels moved to the device and cast to
    float32, the loss divided by the micro-batch count, summed on the host, read
    with ``.item()``, a line of the loss log written and flushed, and
    SCALARS_PER_STEP TensorBoard scalars (whose writer thread competes with the
    next step: that interference is part of the cost). A model of one small unit
    (FC-MNIST, a 4 ms step) spends a tenth of its step there."""
    from torch.utils.tensorboard import SummaryWriter

    from weightstream.models.tasks import task_loss

    batch = {"inputs": x, "labels": torch.zeros(x.shape[0], dtype=torch.long)}

    def plain() -> None:
        model(x).sum().backward()

    step = 0
    with tempfile.TemporaryDirectory(prefix="weightstream-logprobe-") as tmp:
        writer = SummaryWriter(tmp)
        log = open(Path(tmp) / "losses.jsonl", "a")  # closed below

        def trainer_like() -> None:
            nonlocal step
            loss, _, _ = task_loss("classification", model, batch)
            scaled = loss / 1
            scaled.backward()
            value = (torch.zeros(()) + scaled.detach().cpu()).item()
            step += 1
            log.write(json.dumps({"step": step, "loss": value}) + "\n")
            log.flush()
            for i in range(SCALARS_PER_STEP):
                writer.add_scalar(f"s{i}", value, step)

        try:
            for fn in (plain, trainer_like):
                fn()
            times: dict = {plain: [], trainer_like: []}
            deadline = time.perf_counter() + budget
            while len(times[plain]) < MIN_BURSTS or time.perf_counter() < deadline:
                for fn in (plain, trainer_like):
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    times[fn].append(time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
        finally:
            log.close()
            writer.close()
    return max(0.0, _quiet(times[trainer_like]) - _quiet(times[plain]))


def _software_figures(device: torch.device, sizes: _Sizes, copy_bandwidth: float) -> dict:
    """op_overhead_fwd_s, op_overhead_bwd_s, unit_overhead_s, param_overhead_s,
    stream_call_s, stream_bandwidth, step_overhead_s, samples."""
    from weightstream.backend import compile as ws_compile
    from weightstream.compiler.cost import function_costs

    eager = _tiny_chain(sizes.tiny_units).to(device)
    x = torch.randn(4, 16, device=device)
    costs = function_costs(eager, (x,))
    streamed_model = _tiny_chain(sizes.tiny_units)
    streamed = ws_compile(
        streamed_model,
        "wse_ws",
        device=device,
        unit_classes=[_TinyBlock],
        prefetch_depth=1,
        data_parallel=False,  # this rank's own speed, also under data parallel
    )

    # The same blocks streamed as a single unit, and half of them: the same
    # parameter tensors in fewer units, and fewer tensors in one unit, separate
    # the three costs (Note [fixed costs]).
    def one_unit(blocks: int):
        return ws_compile(
            nn.Sequential(_TinyGroup(_tiny_chain(blocks))),
            "wse_ws",
            device=device,
            unit_classes=[_TinyGroup],
            prefetch_depth=1,
            data_parallel=False,
        )

    half_blocks = max(1, sizes.tiny_units // 2)
    single, half = one_unit(sizes.tiny_units), one_unit(half_blocks)
    half_eager = _tiny_chain(half_blocks).to(device)
    # Wide units: their weights dominate, so their streaming time over the
    # tiny units' is the price of the bytes (Note [fixed costs]).
    d = sizes.wide_features
    wide_eager = _tiny_chain(sizes.tiny_units, d).to(device)
    wide_x = torch.randn(4, d, device=device)
    wide_model = _tiny_chain(sizes.tiny_units, d)
    wide = ws_compile(
        wide_model,
        "wse_ws",
        device=device,
        unit_classes=[_TinyBlock],
        prefetch_depth=1,
        data_parallel=False,
    )
    wide_bytes = 3 * sum(p.numel() * p.element_size() for p in wide_model.parameters())
    tiny_bytes = 3 * sum(p.numel() * p.element_size() for p in streamed_model.parameters())
    try:
        fwd, bwd, units, per_param, per_call, steps, streams = [], [], [], [], [], [], []
        tensors = len(list(streamed_model.parameters()))
        half_tensors = len(list(half_eager.parameters()))

        def repetition() -> tuple:
            # Interleaved: eager and streamed see the same machine conditions.
            budget = sizes.overhead_seconds
            models = [eager, streamed, single, half_eager, half]
            splits = [_fwd_bwd_split(m, x, device, budget) for m in models]
            splits += [_fwd_bwd_split(m, wide_x, device, budget) for m in (wide_eager, wide)]
            return (*splits, _step_overhead(eager, x, device, budget))

        # REPEATS times (once with quick sizes: tests want the figures, not their spread)
        for _ in range(REPEATS if sizes.curve_repeats > 1 else 1):
            timed = _calm(repetition, _retries(sizes))
            (f, b), (fs, bs), (f1, b1), (fh, bh), (fh1, bh1), (fw, bw), (fws, bws), step = timed
            fwd.append(f / costs.fwd_ops)
            bwd.append(b / costs.bwd_ops)
            # 2 fetches + gradients back of the tiny weights, at the copy bandwidth
            copies = tiny_bytes / copy_bandwidth
            many = fs + bs - f - b - copies  # call + tiny_units x unit + tensors x param
            one = f1 + b1 - f - b - copies  # call + 1 x unit + tensors x param
            one_half = fh1 + bh1 - fh - bh - copies * half_tensors / tensors
            unit = max(0.0, (many - one) / max(1, sizes.tiny_units - 1))
            units.append(unit)
            param = max(0.0, (one - one_half) / max(1, tensors - half_tensors))
            per_param.append(param)
            per_call.append(max(0.0, one - unit - tensors * param))
            per_bytes = fws + bws - fw - bw - per_call[-1] - sizes.tiny_units * unit
            per_bytes -= tensors * param
            streams.append(wide_bytes / per_bytes if per_bytes > 0 else copy_bandwidth)
            steps.append(step)
    finally:
        streamed.engine.close()
        single.engine.close()
        half.engine.close()
        wide.engine.close()
    # Direct timings: the fastest repetition; differences of two timings: the
    # median (a disturbed eager twin would make a difference too small).
    return {
        "op_overhead_fwd_s": min(fwd),
        "op_overhead_bwd_s": min(bwd),
        "unit_overhead_s": statistics.median(units),
        "param_overhead_s": statistics.median(per_param),
        "stream_call_s": statistics.median(per_call),
        "stream_bandwidth": statistics.median(streams),
        "step_overhead_s": statistics.median(steps),
        "samples": {
            "op_overhead_fwd": fwd,
            "op_overhead_bwd": bwd,
            "unit_overhead": units,
            "param_overhead": per_param,
            "stream_call": per_call,
            "stream_bandwidth": streams,
            "step_overhead": steps,
        },
    }


class _ProxyBlock(nn.Module):
    """A small decoder block with the operator mix of the zoo's (Note [in situ]).

    ``gated=False``: GPT-2's (LayerNorm, fused qkv, causal attention, GELU MLP);
    ``gated=True``: Llama's (RMS norm, rotary positions, SwiGLU MLP).
    """

    def __init__(self, d: int, heads: int, gated: bool):
        super().__init__()
        self.heads, self.gated = heads, gated
        if gated:
            self.norm1 = nn.Parameter(torch.ones(d))
            self.norm2 = nn.Parameter(torch.ones(d))
            self.gate = nn.Linear(d, 8 * d // 3, bias=False)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=not gated)
        self.proj = nn.Linear(d, d, bias=not gated)
        hidden = 8 * d // 3 if gated else 4 * d
        self.up = nn.Linear(d, hidden, bias=not gated)
        self.down = nn.Linear(hidden, d, bias=not gated)

    def _norm(self, x, norm):
        if not self.gated:
            return norm(x)
        return norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self._norm(x, self.norm1)).view(B, T, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.gated:  # rotary positions: rotate pairs of head dimensions
            pos = torch.arange(T, dtype=x.dtype, device=x.device)[:, None]
            angles = pos / (1 + torch.arange(q.shape[-1], device=x.device))
            cos, sin = angles.cos(), angles.sin()
            half = q.shape[-1] // 2

            def rotate(t):
                return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

            q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        h = self._norm(x, self.norm2)
        if self.gated:
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + self.down(F.gelu(self.up(h), approximate="tanh"))


def _typical_step(steps: list[float]) -> float:
    """The mean of ``steps`` without their slowest tenth (Note [in situ]): what a run's
    samples/sec sees, slow phases of the virtual CPUs included, a lone stall not."""
    kept = sorted(steps)[: max(1, math.ceil(0.9 * len(steps)))]
    return sum(kept) / len(kept)


def _in_situ_factor(partial: MachineProfile, sizes: _Sizes) -> tuple[float, list[float]]:
    """Measured over estimated seconds of the proxy's streamed training step (Note [in situ])."""
    from weightstream.backend import compile as ws_compile
    from weightstream.compiler.cost import unit_costs
    from weightstream.compiler.estimate import EstimateSettings, estimate

    device = torch.device(partial.device)
    batch, seq, d, heads = sizes.proxy
    model = nn.Sequential(_ProxyBlock(d, heads, gated=False), _ProxyBlock(d, heads, gated=True))
    x = torch.randn(batch, seq, d, device=device)
    compiled = ws_compile(
        model,
        "wse_ws",
        device=device,
        unit_classes=[_ProxyBlock],
        prefetch_depth=1,
        data_parallel=False,
    )
    try:
        costs = unit_costs(model, compiled.engine.prepare(x), (x,))
        est = estimate(costs, partial, EstimateSettings(batch_size=batch, prefetch_depth=1))
        # What the factor scales: each pass's work (compute, memory, operators) and
        # the streaming bookkeeping; the rest of the modelled step (transfers not
        # hidden) stays as it is. The proxy runs no update.
        scaled = sum(u.fwd_work_s + u.bwd_work_s + u.stream_s for u in est.units)
        scaled += est.outside_fwd_s + est.outside_bwd_s + est.stream_call_s
        rest = est.step_s - est.update_s - scaled
        steps = []
        for _ in range(2 + sizes.proxy_steps):
            t0 = time.perf_counter()
            compiled(x).sum().backward()
            model.zero_grad(set_to_none=True)
            _sync(device)
            steps.append(time.perf_counter() - t0)
    finally:
        compiled.engine.close()
    measured = _typical_step(steps[2:])
    factor = (measured - rest) / scaled if scaled > 0 else 1.0
    return min(3.0, max(0.5, factor)), steps[2:]


def update_key(spec: dict) -> str:
    """The ``update_costs`` key of an update setting (see :func:`update_cost`)."""
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _measure_update(spec: dict, quick: bool) -> UpdateCost:
    """Time the trainer's update sequence for ``spec`` (see :func:`update_cost`)."""
    from weightstream.amp import GradScaler
    from weightstream.optim import configure_lr_scheduler, configure_optimizer

    device = torch.device(spec["device"])
    budget = 0.005 if quick else 0.1
    big = _QUICK.update_numel if quick else spec.get("numel") or _FULL.update_numel
    sets = 2 if quick else 4

    def seconds(tensors: int, numel: int) -> float:
        # Several independent models updated in turn: each update finds its
        # parameters, gradients and state cold, as a run's update does after a
        # forward and a backward have gone through the caches.
        updates = []
        for _ in range(sets):
            params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(tensors)]
            grads = [torch.full((numel,), 1e-3, device=device) for _ in range(tensors)]
            opt = configure_optimizer(
                spec["optimizer_type"], params=params, learning_rate=1e-3, **spec["kwargs"]
            )
            schedule = spec.get("schedule")
            sched = None if schedule is None else configure_lr_scheduler(opt, schedule)
            updates.append((params, grads, opt, GradScaler(**spec["grad_scaler"]), sched))

        def update(params, grads, opt, scaler, sched):
            # The update part of Trainer._optimizer_step, in its order.
            for p, g in zip(params, grads):
                p.grad = g
            scaler.unscale_(opt)
            if spec["max_gradient_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(params, spec["max_gradient_norm"])
            elif spec["max_gradient_value"] is not None:
                torch.nn.utils.clip_grad_value_(params, spec["max_gradient_value"])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()

        def all_sets():
            for u in updates:
                update(*u)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _seconds(all_sets, device, budget) / sets

    small = 16
    t1 = seconds(1, small)
    t64 = seconds(64, small)
    t_big = seconds(1, big)
    per_tensor = max(0.0, (t64 - t1) / 63)
    per_element = max(0.0, (t_big - t1) / (big - small))
    fixed = max(0.0, t1 - per_tensor - small * per_element)
    return UpdateCost(spec, fixed, per_tensor, per_element)


# ---- the profile ---------------------------------------------------------------------


def measure(
    device: torch.device | str = "cpu", quick: bool = False, disk_dir: str | Path | None = None
) -> MachineProfile:
    """Measure a profile now (no cache). ``disk_dir=None`` skips the disk figures."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = _QUICK if quick else _FULL
    samples: dict[str, list[float]] = {}
    flops: dict[str, float] = {}
    # Measuring must not move the user's random stream.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), OtherLoad() as load:
        torch.manual_seed(0)
        with torch.no_grad():
            for name in _DTYPES:
                dtype = getattr(torch, name)
                try:
                    torch.mm(
                        torch.ones(2, 2, device=device, dtype=dtype),
                        torch.ones(2, 2, device=device, dtype=dtype),
                    )
                except (RuntimeError, TypeError):
                    continue  # not supported on this device
                flops[name], samples[f"matmul_{name}"] = _matmul_flops(device, dtype, sizes)
            link, samples["copy"], host, samples["host_memory"] = _copy_bandwidths(device, sizes)
            write = read = None
            if disk_dir is not None:
                write, samples["disk_write"], read, samples["disk_read"] = _disk_bandwidths(
                    Path(disk_dir), sizes.disk_bytes
                )
            floor = _dispatch_seconds(device, sizes.curve_seconds)
            matmul_curve = _best_curve(lambda: _matmul_curve(device, sizes, floor), sizes)
        software = _software_figures(device, sizes, link)
        samples.update(software.pop("samples"))
        tables = [
            _calm(lambda: _op_bandwidth(device, sizes, software), _retries(sizes))
            for _ in range(sizes.curve_repeats)
        ]
        op_bandwidth = {
            cls: {k: max(t[cls][k] for t in tables) for k in tables[0][cls]} for cls in tables[0]
        }
        software["op_bandwidth"] = op_bandwidth  # the best figures price the attention's loss
        attention_curve = _best_curve(lambda: _attention_curve(device, sizes, software), sizes)
    del software["op_bandwidth"]
    profile = MachineProfile(
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        matmul_flops=flops,
        copy_bandwidth=link,
        host_memory_bandwidth=host,
        disk_write_bandwidth=write,
        disk_read_bandwidth=read,
        disk_dir=None if disk_dir is None else str(disk_dir),
        matmul_curve=matmul_curve,
        attention_curve=attention_curve,
        op_bandwidth=op_bandwidth,
        runtime_digest=runtime_digest(),
        other_load=load.fraction,
        quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        samples=samples,
        **software,
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        profile.in_situ_factor, samples["in_situ"] = _calm(
            lambda: _in_situ_factor(profile, sizes), _retries(sizes)
        )
    return profile


def remeasure_software(profile: MachineProfile) -> MachineProfile:
    """``profile`` with its software figures measured again (the runtime changed)."""
    device = torch.device(profile.device)
    sizes = _QUICK if profile.quick else _FULL
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        software = _software_figures(device, sizes, profile.copy_bandwidth)
    samples = {**profile.samples, **software.pop("samples")}
    data = {**profile.to_dict(), **software, "samples": samples, "update_costs": {}}
    data["runtime_digest"] = runtime_digest()
    data["in_situ_factor"] = 1.0
    remeasured = MachineProfile.from_dict(data)
    # The proxy streams through the runtime: its factor is a software figure too.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        remeasured.in_situ_factor, samples["in_situ"] = _calm(
            lambda: _in_situ_factor(remeasured, sizes), _retries(sizes)
        )
    return remeasured


def load(path: str | Path) -> MachineProfile | None:
    """The profile stored at ``path``, or None if absent, unreadable or incomplete."""
    try:
        with open(path) as f:
            return MachineProfile.from_dict(json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        warnings.warn(
            f"weightstream: ignoring the machine profile {str(path)!r} ({exc}); measuring again.",
            stacklevel=3,
        )
        return None


def load_or_measure(
    device: torch.device | str = "cpu",
    path: str | Path | None = None,
    remeasure: bool = False,
    quick: bool = False,
    disk_dir: str | Path | None = None,
) -> MachineProfile:
    """The cached profile of ``device``, measured (and cached) on a miss.

    ``path``: the JSON file (default :func:`default_path`). ``disk_dir``: the
    directory whose disk bandwidth is measured (default: the cache file's
    directory); a cached profile of another directory is a miss. ``quick``:
    tiny sizes (a few milliseconds; for tests), cached under its own key. A
    cached profile measured with other runtime sources keeps its hardware
    figures and measures the software ones again.
    """
    device = torch.device(device)
    path = Path(path) if path is not None else default_path(device, quick)
    disk_dir = Path(disk_dir) if disk_dir is not None else path.parent
    if not remeasure:
        cached = load(path)
        if (
            cached is not None
            and cached.device_name == device_name(device)
            and cached.torch_version == torch.__version__
            and cached.num_threads == torch.get_num_threads()
            and cached.quick == quick
            and cached.disk_dir == str(disk_dir)
        ):
            if cached.runtime_digest == runtime_digest():
                return cached
            profile = remeasure_software(cached)
            write_text_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=True))
            return profile
    profile = measure(device, quick=quick, disk_dir=disk_dir)
    write_text_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=True))
    return profile


def update_spec(
    optimizer_type: str,
    kwargs: dict | None = None,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
    grad_scaler: dict | None = None,
    device: torch.device | str = "cpu",
    schedule=None,
    numel: int | None = None,
) -> dict:
    """What an update's cost depends on: the optimizer and its numeric arguments
    (the learning rate's value does not change the cost and is left out),
    gradient clipping, the loss scaler's settings, the device holding the
    parameters (the host in weight streaming) and the learning-rate schedule
    (``schedule``: the params file's ``learning_rate``, None for none), whose
    Python step runs once per step: a sequence of schedulers costs a few hundred
    microseconds, several percent of a small model's step. ``numel``: the
    model's trainable elements; the cost per element is timed on a tensor of
    that many, rounded up to a power of two in [2^14, 2^22] (None: 2^20), as
    what fits the caches decides it: SGD with momentum updates a 0.2M-element
    model at 2-3 ns an element and 4 sets of 1M elements at 5."""
    kwargs = {
        k: v
        for k, v in (kwargs or {}).items()
        if k not in ("learning_rate", "lr") and isinstance(v, (bool, int, float, str, list, tuple))
    }
    return {
        "optimizer_type": optimizer_type,
        "kwargs": kwargs,
        "max_gradient_norm": max_gradient_norm,
        "max_gradient_value": max_gradient_value,
        "grad_scaler": {k: v for k, v in (grad_scaler or {}).items() if v is not None},
        "device": str(torch.device(device)),
        "schedule": copy.deepcopy(schedule),
        "numel": None if numel is None else _update_numel(numel),
    }


def _update_numel(numel: int) -> int:
    """``numel`` rounded up to a power of two in [2^14, 2^22] (see :func:`update_spec`)."""
    return 2 ** min(22, max(14, math.ceil(math.log2(max(1, numel)))))


def attention_curve_for(
    profile: MachineProfile, dtype: str, path: str | Path | None = None
) -> None:
    """Measure ``dtype``'s attention curve into ``profile.attention_curves`` if it is not
    there yet (a few seconds; float16 on a CPU, at 3-6 GFLOP/s, takes 30), rewriting
    ``path`` (default: the profile's cache file). Only the dtypes runs compute in
    are measured. float32 has ``attention_curve``."""
    if dtype == "float32" or dtype not in profile.matmul_flops:
        return
    if dtype in profile.attention_curves:
        return
    device = torch.device(profile.device)
    sizes = _QUICK if profile.quick else _FULL
    partial = {
        "op_overhead_fwd_s": profile.op_overhead_fwd_s,
        "op_overhead_bwd_s": profile.op_overhead_bwd_s,
        "op_bandwidth": profile.op_bandwidth,
    }
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        try:
            curve = _best_curve(
                lambda: _attention_curve(device, sizes, partial, getattr(torch, dtype)), sizes
            )
        except (RuntimeError, TypeError):
            curve = {}  # no attention kernel for this dtype here: priced by its products
    profile.attention_curves[dtype] = curve
    path = Path(path) if path is not None else default_path(profile.device, profile.quick)
    write_text_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=True))


def update_cost(
    profile: MachineProfile, spec: dict, path: str | Path | None = None
) -> UpdateCost | None:
    """The cost of one optimizer update of ``spec`` (:func:`update_spec`) on this machine.

    Measured the first time (about 0.5 s) and kept in ``profile.update_costs``;
    ``path`` (default: the profile's default cache file) is rewritten with it.
    None when the optimizer cannot be built from ``spec`` (the estimate then
    prices the update by bytes over the host memory bandwidth, and says so).
    """
    key = update_key(spec)
    cached = profile.update_costs.get(key)
    if cached is not None:
        return UpdateCost(**cached)
    try:
        cost = _measure_update(spec, profile.quick)
    except (ValueError, TypeError, RuntimeError) as exc:
        warnings.warn(
            f"weightstream: could not time the optimizer update ({type(exc).__name__}: {exc}); "
            "the estimate prices it by bytes over the host memory bandwidth.",
            stacklevel=2,
        )
        return None
    profile.update_costs[key] = asdict(cost)
    path = Path(path) if path is not None else default_path(profile.device, profile.quick)
    write_text_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=True))
    return cost

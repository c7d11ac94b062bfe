"""Hardware figures of the machine profile: throughputs of the compute device and its host.

* matmul peak (FLOP/s) per dtype: ``torch.mm`` of square matrices on the
  compute device, sized (and repeated) to take about 0.1 s;
* matmul throughput by size (float32): ``n x n x n`` products for n from 16
  to 512, timed as in a training pass (each of its own operands, outputs
  kept alive: 10-20% slower than a loop over the same hot matrices); a
  product of effective size n (``operators.matmul_size``: the geometric mean of
  its two smallest dimensions) runs at the throughput interpolated at n
  (log-log), rising to the peak beyond the largest size;
* attention throughput by size: a causal scaled dot-product attention,
  forward + backward, FLOPs counted on its math decomposition as ``cost.py``
  counts them (12 x heads x T^2 x head_dim), for (T, head_dim) from (64, 16) to
  (512, 64), keyed by the effective size cube root of T * T * head_dim;
* operator throughput (bytes read + written per second) of non-matmul
  operators: the "simple" class (elementwise arithmetic: ``x * y``, forward
  and backward) at three operator sizes, and each class of
  ``operators.OP_CLASSES`` (gelu, silu, layer_norm, softmax, transcendental) at one
  size, forward + backward, timed as in a training pass (the forwards of
  several independent inputs, outputs kept alive, then one backward: cold
  inputs and fresh outputs, not a tight loop over hot memory). Bytes are
  counted by ``cost.function_costs`` on the very function that is timed, and
  the time is the marginal one: the operators' fixed overhead (software.py)
  and, for a class, the simple operators of the same call (its loss) are
  subtracted first;
* host -> device copy bandwidth (bytes delivered per second): a large
  ``copy_`` from (pinned) host memory; on the CPU a host-to-host copy;
* host memory bandwidth (bytes read + written per second): a host-to-host
  copy, counting the read and the write (what the host optimizer streams);
* disk write and read bandwidth of a directory: a file written and
  ``fsync``-ed, then evicted from the page cache where the OS allows
  (``posix_fadvise(DONTNEED)``) and read back; deleted afterwards.

Every figure is timed by the rules of ``timing.py`` (Note [quiet timings]).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from weightstream.compiler.cost import function_costs
from weightstream.compiler.operators import OP_CLASSES, SIMPLE, attention_size
from weightstream.compiler.profile import _interp
from weightstream.compiler.timing import REPEATS, Calm, Sizes, best_curve, best_of, seconds

_DTYPES = ("float32", "bfloat16", "float16")
_LIVE_BYTES = 64 * 2**20  # what a timed pass keeps alive, at most


def measure_hardware(device: torch.device, sizes: Sizes, disk_dir: Path | None, calm: Calm) -> dict:
    """The matmul peaks, copy and disk bandwidths and the matmul curve, with their
    repetitions under ``"samples"`` (``disk_dir=None``: no disk figures)."""
    samples: dict[str, list[float]] = {}
    flops: dict[str, float] = {}
    with torch.no_grad():
        for name in _DTYPES:
            dtype = getattr(torch, name)
            try:
                torch.mm(*[torch.ones(2, 2, device=device, dtype=dtype)] * 2)
            except (RuntimeError, TypeError):
                continue  # not supported on this device
            flops[name], samples[f"matmul_{name}"] = _matmul_flops(device, dtype, sizes, calm)
        link, samples["copy"], host, samples["host_memory"] = _copy_bandwidths(device, sizes, calm)
        write = read = None
        if disk_dir is not None:
            write, samples["disk_write"], read, samples["disk_read"] = _disk_bandwidths(
                Path(disk_dir), sizes.disk_bytes
            )
        floor = calm(lambda: _dispatch_seconds(device, sizes.curve_seconds))
        matmul_curve = best_curve(
            lambda: _matmul_curve(device, sizes, floor), sizes.curve_repeats, calm
        )
    return {
        "matmul_flops": flops,
        "copy_bandwidth": link,
        "host_memory_bandwidth": host,
        "disk_write_bandwidth": write,
        "disk_read_bandwidth": read,
        "matmul_curve": matmul_curve,
        "samples": samples,
    }


def operator_curves(
    device: torch.device, sizes: Sizes, overheads: dict, calm: Calm
) -> tuple[dict, dict[str, float]]:
    """(op_bandwidth, float32 attention curve): each the best of its measurements.
    ``overheads``: the fixed costs (``op_overhead_fwd_s``, ``op_overhead_bwd_s``)
    subtracted from each time."""
    tables = [
        calm(lambda: op_bandwidth(device, sizes, overheads)) for _ in range(sizes.curve_repeats)
    ]
    best = {cls: {k: max(t[cls][k] for t in tables) for k in tables[0][cls]} for cls in tables[0]}
    partial = {**overheads, "op_bandwidth": best}  # the best figures price the attention's loss
    curve = best_curve(lambda: attention_curve(device, sizes, partial), sizes.curve_repeats, calm)
    return best, curve


def _matmul_flops(
    device: torch.device, dtype: torch.dtype, sizes: Sizes, calm: Calm
) -> tuple[float, list]:
    def operands(n: int):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        return a, b, out

    def seconds_per_product(n: int, budget: float) -> float:
        a, b, out = operands(n)
        return seconds(lambda: torch.mm(a, b, out=out), device, budget)

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

    return best_of(one, calm)


def _dispatch_seconds(device: torch.device, budget: float) -> float:
    """One operator on a one-element tensor without autograd: the floor of any call."""
    a = torch.ones(1, device=device)
    out = torch.empty(1, device=device)
    return seconds(lambda: torch.add(a, a, out=out), device, budget)


def _matmul_curve(device: torch.device, sizes: Sizes, floor: float) -> dict[str, float]:
    """FLOP/s of n x n x n products as in a training pass: each product of its own
    operands, its output kept (see :func:`_fwd_bwd_seconds`)."""
    curve = {}
    for n in sizes.matmul_curve:

        def make(n=n):
            return torch.randn(n, n, device=device), torch.randn(n, n, device=device)

        pairs = _instances(make, sizes.live_sets)

        def products(pairs=pairs):
            return [torch.mm(a, b) for a, b in pairs]

        t = seconds(products, device, sizes.curve_seconds) / len(pairs)
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
        return seconds(step, device, budget) / len(arg_sets)


def _overhead_of(costs, partial: dict) -> float:
    """Seconds the fixed per-operator costs of ``costs`` (one entry) account for."""
    return (
        costs.fwd_ops * partial["op_overhead_fwd_s"] + costs.bwd_ops * partial["op_overhead_bwd_s"]
    )


_TRACED: dict[tuple, object] = {}  # (what, argument shapes) -> cost.function_costs of it


def _traced(what: str, fn: Callable, args: tuple):
    """``cost.function_costs(fn, args)``, traced once per process for these shapes (a
    trace on the meta device takes a tenth of a second; the curves repeat theirs)."""
    key = (what, tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args))
    if key not in _TRACED:
        _TRACED[key] = function_costs(fn, args)
    return _TRACED[key]


def attention_curve(
    device: torch.device, sizes: Sizes, partial: dict, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """FLOP/s of causal attention, forward + backward, by effective size. ``partial``:
    the fixed costs and ``op_bandwidth`` subtracted from each time."""

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
    total_s = _overhead_of(costs, partial)
    curve = partial.get("op_bandwidth", {}).get(SIMPLE)
    if curve:
        for mem in (costs.fwd_mem, costs.bwd_mem):
            for nbytes, total in mem.get(SIMPLE, {}).items():
                total_s += total / _interp(curve, nbytes)
    return total_s


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


def op_bandwidth(device: torch.device, sizes: Sizes, overheads: dict) -> dict:
    """Bytes per second of each operator class, by bytes one operator moves (one
    measurement; a class's simple operators are priced by this table's "simple")."""
    out: dict[str, dict[str, float]] = {SIMPLE: {}}
    partial = {**overheads, "op_bandwidth": out}

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


def _copy_bandwidths(
    device: torch.device, sizes: Sizes, calm: Calm
) -> tuple[float, list, float, list]:
    numel = sizes.copy_bytes // 4
    host_src = torch.ones(numel)
    host_dst = torch.empty(numel)

    def host_copy() -> float:
        t = seconds(lambda: host_dst.copy_(host_src), torch.device("cpu"), sizes.copy_seconds)
        return 2 * sizes.copy_bytes / t  # read + write

    host_bw, host_samples = best_of(host_copy, calm)
    if device.type == "cpu":
        # The compute device is the host: a device copy is a host copy, and
        # the bytes it delivers are half the bytes it moves.
        return host_bw / 2, [s / 2 for s in host_samples], host_bw, host_samples
    pinned = host_src.pin_memory()
    dev_dst = torch.empty(numel, device=device)

    def h2d() -> float:
        t = seconds(lambda: dev_dst.copy_(pinned, non_blocking=True), device, sizes.copy_seconds)
        return sizes.copy_bytes / t

    link_bw, link_samples = best_of(h2d, calm)
    return link_bw, link_samples, host_bw, host_samples


def _disk_bandwidths(directory: Path, nbytes: int) -> tuple[float, list, float, list]:
    """Median write and read bandwidths of REPEATS files (I/O: not judged by Calm,
    whose /proc/stat count includes the kernel's writeback)."""
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

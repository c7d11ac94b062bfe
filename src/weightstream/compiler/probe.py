"""The probe: this machine's rates, the denominators of the roofline (``estimate.py``).

Each figure is the median of ``torch.utils.benchmark``'s ``blocked_autorange``,
measured once per machine, torch version and thread count and cached as JSON
under ``$WEIGHTSTREAM_CACHE_DIR`` (default ``~/.cache/weightstream``). A compile
adds the seconds of the kernels it meets (Note [timed kernels] in cost.py) and a
disk store the bandwidths of its directory. Nothing is measured again when the
library changes and nothing watches other processes: a probe measured on a busy
machine stays until its file is deleted (only a kernel timing far over its roofline,
``OUTLIER``, is dropped and timed again).

Note [fixed costs]
------------------
A small model's step is mostly overhead: each aten operator costs microseconds
of dispatch and autograd bookkeeping whatever its size, each streamed parameter
tensor its hooks, views and gradient routed back, and each step its loss read
back and its update's Python. Three constants, measured on a chain of tiny
blocks (LayerNorm, Linear, GELU, Linear, residual; 4 x 16 activations):
``op_s``, an eager forward + backward over the operators ``cost.unit_costs``
counts on it; ``tensor_s`` and ``step_s``, a streamed AdamW step of 8 blocks
and of 2, less their operators at ``op_s``: the difference per parameter tensor
and what is left of the 2-block step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

from weightstream.common.files import write_text_atomic
from weightstream.runtime.placement import available_memory

log = logging.getLogger("weightstream")

ENV_CACHE_DIR = "WEIGHTSTREAM_CACHE_DIR"
SCHEMA = 2  # 2: kernel_s, fresh_bandwidth


@dataclass
class Probe:
    """Measured rates of one compute device and its host (see the module docstring)."""

    device: str  # "cpu", "cuda:0"
    device_name: str
    torch_version: str
    num_threads: int
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s of a large square product
    memory_bandwidth: float  # bytes read + written per second by an add on the device
    host_memory_bandwidth: float  # the same on the host
    link_bandwidth: float | None  # a pinned host -> device copy; None on the CPU
    # the CPU's new 4 KiB pages written once (Note [fresh pages] in cost.py)
    fresh_bandwidth: float | None = None
    op_s: float = 0.0  # Note [fixed costs]
    tensor_s: float = 0.0
    step_s: float = 0.0
    kernel_s: dict[str, float] = field(default_factory=dict)  # kernel key -> seconds
    # directory -> bytes per second of a write with fsync and a cold read
    disk: dict[str, dict[str, float]] = field(default_factory=dict)
    quick: bool = False  # tiny sizes (tests): not representative
    measured_at: str = ""
    schema: int = SCHEMA

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        name = str(dtype).removeprefix("torch.")
        if name not in self.matmul_flops:
            raise ValueError(
                f"the probe has no matmul throughput for {name} on {self.device} (measured: "
                f"{', '.join(sorted(self.matmul_flops))}); use one of those compute dtypes."
            )
        return self.matmul_flops[name]


@dataclass(frozen=True)
class _Sizes:
    matmul_n: int  # the largest product timed for the peak
    numel: int  # elements of the timed add and copy
    disk_bytes: int
    run_s: float  # blocked_autorange's minimum run time per figure
    kernel_s: float  # the same per kernel
    kernel_max_s: float  # a kernel whose roofline time is longer is not timed
    kernels_s: float  # time_kernels stops timing after this long


_FULL = _Sizes(2048, 2**24, 256 * 2**20, 0.5, 0.05, 5.0, 120.0)
_QUICK = _Sizes(128, 2**16, 2**20, 0.01, 0.002, 0.005, 2.0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else "cpu"
    return device.type


def default_path(device: torch.device | str, quick: bool = False) -> Path:
    device = torch.device(device)
    ident = [device.type, device_name(device), torch.__version__, torch.get_num_threads()]
    key = hashlib.sha256(json.dumps([*ident, quick, SCHEMA]).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get(ENV_CACHE_DIR) or Path(base) / "weightstream") / f"probe-{key}.json"


def _seconds(fn, run_s: float) -> float:
    """Median seconds of one ``fn()`` (``torch.utils.benchmark`` synchronizes CUDA); a call
    longer than ``run_s`` is timed once more instead."""
    t0 = time.perf_counter()
    fn()  # warm-up: first-call allocations and kernel selection
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    if time.perf_counter() - t0 > run_s:
        return timer.timeit(1).mean
    return timer.blocked_autorange(min_run_time=run_s).median


def _matmul_flops(device: torch.device, sizes: _Sizes) -> dict[str, float]:
    """Per dtype, FLOP/s of the largest product (up to ``sizes.matmul_n``) taking a
    tenth of the run time: a dtype without fast kernels (float16 on most CPUs) must
    not make the probe take minutes."""
    flops = {}
    for name in ("float32", "bfloat16", "float16"):
        a = torch.randn(sizes.matmul_n, sizes.matmul_n, device=device).to(getattr(torch, name))
        n = min(128, sizes.matmul_n)
        try:
            rate = 2 * n**3 / _seconds(lambda: a[:n, :n] @ a[:n, :n], 0.0)  # noqa: B023
        except (RuntimeError, TypeError):
            continue  # not supported on this device
        n = max(n, min(sizes.matmul_n, int((rate * sizes.run_s / 10) ** (1 / 3)) // 64 * 64))
        flops[name] = 2 * n**3 / _seconds(lambda: a[:n, :n] @ a[:n, :n], sizes.run_s)  # noqa: B023
    return flops


def _bandwidths(device: torch.device, sizes: _Sizes) -> dict:
    """The memory, host memory, link and fresh-page bandwidths (``Probe``'s fields)."""

    def add(on: torch.device) -> float:  # 3 tensors moved; fresh pages are priced apart
        a, b, c = torch.ones(3, sizes.numel, device=on)
        return 3 * a.nbytes / _seconds(lambda: torch.add(a, b, out=c), sizes.run_s)

    def touch() -> None:  # written through by every thread, as a kernel writes its output
        with mmap.mmap(-1, 4 * sizes.numel) as m:
            torch.frombuffer(m, dtype=torch.float32).fill_(1.0)

    found = {"memory_bandwidth": add(device), "link_bandwidth": None, "fresh_bandwidth": None}
    if device.type == "cpu":
        found["fresh_bandwidth"] = 4 * sizes.numel / _seconds(touch, sizes.run_s)
        return {**found, "host_memory_bandwidth": found["memory_bandwidth"]}
    src, dst = torch.ones(sizes.numel).pin_memory(), torch.empty(sizes.numel, device=device)
    link = src.nbytes / _seconds(lambda: dst.copy_(src, non_blocking=True), sizes.run_s)
    return {**found, "host_memory_bandwidth": add(torch.device("cpu")), "link_bandwidth": link}


class _TinyBlock(nn.Module):
    """A transformer-like block of 16 features: the operator mix of real models."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _fixed_costs(device: torch.device, sizes: _Sizes) -> dict[str, float]:
    """op_s, tensor_s, step_s (Note [fixed costs])."""
    from weightstream.amp.step_helper import apply_gradients
    from weightstream.backend import compile as ws_compile
    from weightstream.compiler.cost import unit_costs
    from weightstream.optim import AdamW
    from weightstream.runtime.partition import Plan

    x = torch.randn(4, 16, device=device)
    eager = nn.Sequential(*[_TinyBlock() for _ in range(8)]).to(device)

    def ops(model: nn.Module) -> int:
        return unit_costs(model, Plan([], traced=True), (x,)).ops

    op_s = _seconds(lambda: eager(x).sum().backward(), sizes.run_s) / ops(eager)

    def step_seconds(blocks: int) -> tuple[float, int]:
        model = nn.Sequential(*[_TinyBlock() for _ in range(blocks)])
        n_ops = ops(model)
        # This rank's own speed, also under data parallel: the probe never joins the ranks.
        compiled = ws_compile(
            model, "wse_ws", device=device, unit_classes=[_TinyBlock], data_parallel=False
        )
        opt = AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            compiled(x).sum().backward()
            apply_gradients(opt, None)
            opt.zero_grad(set_to_none=True)

        try:
            return _seconds(step, sizes.run_s) - n_ops * op_s, len(list(model.parameters()))
        finally:
            compiled.engine.close()

    (many, many_tensors), (few, few_tensors) = step_seconds(8), step_seconds(2)
    tensor_s = (many - few) / (many_tensors - few_tensors)
    if tensor_s <= 0 or few < few_tensors * tensor_s:
        # Noise larger than the difference: all of it per tensor, none per step.
        return {"op_s": op_s, "tensor_s": max(0.0, many / many_tensors), "step_s": 0.0}
    return {"op_s": op_s, "tensor_s": tensor_s, "step_s": few - few_tensors * tensor_s}


def existing_dir(path: str | Path) -> Path:
    """``path``, or its nearest parent that is a directory (a store makes its own later)."""
    where = Path(path)
    while not where.is_dir() and where.parent != where:
        where = where.parent
    return where


def disk_bandwidths(directory: Path, nbytes: int) -> dict[str, float]:
    """Write (with fsync) and read (page cache dropped where the OS allows) of one file of
    random bytes: a compressing file system must not make the write look fast."""
    chunk = os.urandom(min(nbytes, 8 << 20))
    fd, name = tempfile.mkstemp(prefix=".weightstream-diskprobe-", dir=directory)
    try:
        t0 = time.perf_counter()
        for start in range(0, nbytes, len(chunk)):
            os.write(fd, chunk[: nbytes - start])
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for start in range(0, nbytes, len(chunk)):
            os.pread(fd, len(chunk), start)
        return {"read": nbytes / (time.perf_counter() - t0), "write": write}
    finally:
        os.close(fd)
        os.unlink(name)


def _rng(device: torch.device):
    """Measuring must not move the user's random stream."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def measure(device: torch.device | str = "cpu", quick: bool = False) -> Probe:
    """Measure the probe now (no cache, no kernels, no disk figures)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = _QUICK if quick else _FULL
    with _rng(device), torch.no_grad():
        torch.manual_seed(0)
        flops, rates = _matmul_flops(device, sizes), _bandwidths(device, sizes)
    with _rng(device):
        fixed = _fixed_costs(device, sizes)
    ident = (str(device), device_name(device), torch.__version__, torch.get_num_threads())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return Probe(*ident, flops, **rates, **fixed, quick=quick, measured_at=stamp)


# A timing over this many times a kernel's roofline, plus a scheduler tick or so, was
# taken on a busy machine (a 2 MFLOP product timed at 17 ms beside other runs): not
# kept, not used. The slowest real kernels met are some 30x (bf16 attention: Note
# [timed kernels] in cost.py).
OUTLIER, OUTLIER_SLACK_S = 100, 5e-3


def timing(probe: Probe, key: str, roofline_s: float) -> float | None:
    """The probe's seconds of kernel ``key``, unless missing or an outlier (``OUTLIER``)."""
    s = probe.kernel_s.get(key)
    return s if s is not None and s <= OUTLIER * roofline_s + OUTLIER_SLACK_S else None


def _free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory() or 0


def time_kernels(probe: Probe, kernels: dict, path: str | Path | None = None) -> None:
    """Time the kernels of ``kernels`` (key -> ``cost.Kernel``) the probe has not
    met yet, largest first, and cache their seconds (Note [timed kernels]). A kernel
    whose tensors would take more than a quarter of the free memory, whose roofline
    time is over ``kernel_max_s``, that fails to run, or that is left when
    ``kernels_s`` have passed, stays untimed: the roofline prices it (a later
    compile times what is left)."""
    device, sizes = torch.device(probe.device), _QUICK if probe.quick else _FULL
    peak, bw = max(probe.matmul_flops.values()), probe.memory_bandwidth
    roofline = {key: max(k.flops / peak, k.nbytes / bw) for key, k in kernels.items()}
    todo = [key for key, s in roofline.items() if timing(probe, key, s) is None]
    todo = sorted((key for key in todo if roofline[key] <= sizes.kernel_max_s), key=roofline.get)
    if not todo:
        return
    path = Path(path or default_path(device, probe.quick))
    log.info("Timing %d kernels of this model on %s, once (cached in %s)", len(todo), device, path)
    stop = time.monotonic() + sizes.kernels_s
    with _rng(device), torch.no_grad():
        for k in (kernels[key] for key in reversed(todo)):
            if time.monotonic() > stop or 4 * k.nbytes > _free_bytes(device):
                continue
            try:
                probe.kernel_s[k.key] = _seconds(k.runner(device), sizes.kernel_s)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                continue  # an argument the replay cannot make
            if timing(probe, k.key, roofline[k.key]) is None:
                del probe.kernel_s[k.key]  # measured under load: priced by the roofline
    _save(probe, path)


def _save(probe: Probe, path: Path) -> None:
    write_text_atomic(Path(path), json.dumps(dataclasses.asdict(probe), indent=2, sort_keys=True))


def load_or_measure(
    device: torch.device | str = "cpu",
    path: str | Path | None = None,
    quick: bool = False,
    disk_dir: str | Path | None = None,
) -> Probe:
    """The cached probe of ``device``, measured and cached on a miss; with ``disk_dir``,
    that directory's disk bandwidths measured and cached too if they are not yet."""
    device = torch.device(device)
    path = Path(path) if path is not None else default_path(device, quick)
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"probe schema {data.get('schema')!r}, expected {SCHEMA}")
        probe = Probe(**data)
        if not probe.matmul_flops or probe.memory_bandwidth <= 0:
            raise ValueError("the probe is incomplete")
    except FileNotFoundError:
        probe = None
    except (OSError, ValueError, TypeError) as exc:
        probe = None
        warnings.warn(f"weightstream: ignoring the probe {str(path)!r} ({exc}).", stacklevel=2)
    if probe is None or probe.device_name != device_name(device) or probe.quick != quick:
        log.info("Measuring this machine's rates on %s, once (cached in %s)", device, path)
        probe = measure(device, quick)
        _save(probe, path)
    if disk_dir is not None and str(disk_dir) not in probe.disk:
        where = existing_dir(disk_dir)
        # A quarter of the free space at most: the probe must not take the room the
        # store's state was planned into. A disk it cannot write is left unpriced
        # (the estimate says so); the run reports the disk's own error, if any.
        free = shutil.disk_usage(where).free
        nbytes = min((_QUICK if quick else _FULL).disk_bytes, free // 4)
        try:
            if nbytes < 1 << 20:
                raise OSError(f"{free:,} bytes free")
            probe.disk[str(disk_dir)] = disk_bandwidths(where, nbytes)
            _save(probe, path)
        except OSError as exc:
            log.warning("The disk store's rates are not measured in %s (%s).", where, exc)
    return probe

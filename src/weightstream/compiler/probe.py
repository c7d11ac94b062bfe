"""The probe: this machine's rates, the denominators of the roofline (``estimate.py``).

Measured once per machine and torch version in a few seconds, and cached as JSON
under ``$WEIGHTSTREAM_CACHE_DIR`` (default ``~/.cache/weightstream``) in a file
named by a hash of the device, its name, the torch version and the thread count.
Each rate is the median of ``torch.utils.benchmark.Timer.blocked_autorange``:

* ``matmul_flops``: FLOP/s of an n x n x n product, per dtype the device runs;
* ``memory_bandwidth``: bytes read + written per second by an elementwise add
  on the compute device, its output fresh memory as an operator's is in a step;
* ``host_memory_bandwidth``: the same on the host (the optimizer's memory; on the
  CPU the same figure);
* ``link_bandwidth``: bytes per second of a pinned host -> device copy (None on
  the CPU: the host is the device);
* ``disk``: write (with ``fsync``) and read (page cache dropped) bandwidths of a
  directory, measured when a run first keeps a disk store there;
* ``op_s``, ``tensor_s``, ``step_s``: fixed costs (Note [fixed costs]).

Nothing is measured again when the library changes, and nothing watches for
other processes: a probe measured on a busy machine stays until the cache file
is deleted (``WEIGHTSTREAM_CACHE_DIR`` names where it is).

Note [fixed costs]
------------------
A training step of a small model is mostly overhead, not data: each aten
operator costs microseconds of Python, dispatch and autograd bookkeeping
whatever its size, each streamed parameter tensor costs hooks, views and a
gradient routed back, and each step its loss read back and its update's Python.
A roofline sees none of it (FC-MNIST's step is 3 ms of which its products are a
fraction), so the probe measures three constants on tiny workloads whose data
work is nil, and the estimate adds them to the data terms:

* ``op_s``: seconds per operator, a forward + backward of a chain of tiny blocks
  (LayerNorm, Linear, GELU, Linear, residual; 4 x 16 activations) over the
  operators ``cost.function_costs`` counts on that chain;
* ``tensor_s`` and ``step_s``: a tiny training step (streamed forward and
  backward, AdamW update, loss read back) of the chain with 8 blocks and with 2,
  less their operators at ``op_s``: the difference over the difference in
  parameter tensors is ``tensor_s``, what is left of the 2-block step ``step_s``.

They are measured with the streaming runtime of this checkout, but cached per
machine and torch version only (a runtime change that moves them needs the cache
file deleted); layer pipelined runs are charged ``tensor_s`` too, a small
overestimate of their update's per-tensor Python.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
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

ENV_CACHE_DIR = "WEIGHTSTREAM_CACHE_DIR"
SCHEMA = 1
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Probe:
    """Measured rates of one compute device and its host (see the module docstring)."""

    device: str  # "cpu", "cuda:0"
    device_name: str
    torch_version: str
    num_threads: int
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s
    memory_bandwidth: float  # compute device memory, bytes read + written per second
    host_memory_bandwidth: float
    link_bandwidth: float | None  # host -> device, bytes per second; None on the CPU
    op_s: float = 0.0  # per operator (Note [fixed costs])
    tensor_s: float = 0.0  # per trainable parameter tensor per step
    step_s: float = 0.0  # per training step
    # directory -> {"read": bytes/s, "write": bytes/s}
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Probe:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"probe schema {data.get('schema')!r}, expected {SCHEMA}")
        probe = cls(**data)
        if not probe.matmul_flops or probe.memory_bandwidth <= 0:
            raise ValueError("the probe is incomplete")
        return probe


@dataclass(frozen=True)
class _Sizes:
    matmul_n: int  # the product timed for the peak
    add_numel: int  # elements of each operand of the timed add
    copy_numel: int  # elements of the timed host -> device copy
    disk_bytes: int
    run_s: float  # blocked_autorange's minimum run time per figure


_FULL = _Sizes(2048, 2**24, 2**26, 256 * 2**20, 0.5)
_QUICK = _Sizes(128, 2**16, 2**16, 2**20, 0.01)


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


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "weightstream"


def default_path(device: torch.device | str, quick: bool = False) -> Path:
    device = torch.device(device)
    ident = [device.type, device_name(device), torch.__version__, torch.get_num_threads()]
    key = hashlib.sha256(json.dumps([*ident, quick, SCHEMA]).encode()).hexdigest()[:16]
    return default_cache_dir() / f"probe-{key}.json"


def _seconds(fn, device: torch.device, run_s: float) -> float:
    """Median seconds of one ``fn()`` (``torch.utils.benchmark`` synchronizes CUDA)."""
    fn()  # warm-up: first-call allocations and kernel selection
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=run_s).median


def _matmul_flops(device: torch.device, sizes: _Sizes) -> dict[str, float]:
    """Per dtype, FLOP/s of the largest product (up to ``sizes.matmul_n``) that takes
    a fifth of the run time: a dtype without fast kernels (float16 on most CPUs, 100x
    slower) must not make the probe take minutes."""
    flops = {}
    for name in _DTYPES:
        dtype = getattr(torch, name)
        n = min(128, sizes.matmul_n)
        try:
            t = _seconds(_product(n, dtype, device), device, 0.0)
        except (RuntimeError, TypeError):
            continue  # not supported on this device
        rate = 2 * n**3 / t
        n = max(n, min(sizes.matmul_n, int((rate * sizes.run_s / 10) ** (1 / 3)) // 64 * 64))
        flops[name] = 2 * n**3 / _seconds(_product(n, dtype, device), device, sizes.run_s)
    return flops


def _product(n: int, dtype: torch.dtype, device: torch.device):
    a = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, a, out=out)


def _add_bandwidth(device: torch.device, sizes: _Sizes) -> float:
    """Bytes per second of ``a + b`` into a fresh output (3 tensors moved)."""
    a = torch.ones(sizes.add_numel, device=device)
    b = torch.ones(sizes.add_numel, device=device)
    return 3 * a.nbytes / _seconds(lambda: a + b, device, sizes.run_s)


def _link_bandwidth(device: torch.device, sizes: _Sizes) -> float:
    src = torch.ones(sizes.copy_numel).pin_memory()
    dst = torch.empty(sizes.copy_numel, device=device)
    return src.nbytes / _seconds(lambda: dst.copy_(src, non_blocking=True), device, sizes.run_s)


class _TinyBlock(nn.Module):
    """A transformer-like block of 16 features: the operator mix of real models."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _fixed_costs(device: torch.device, sizes: _Sizes) -> dict[str, float]:
    """op_s, tensor_s, step_s (Note [fixed costs])."""
    from weightstream.amp.step_helper import apply_gradients
    from weightstream.backend import compile as ws_compile
    from weightstream.compiler.cost import function_costs
    from weightstream.optim import AdamW

    x = torch.randn(4, 16, device=device)
    eager = nn.Sequential(*[_TinyBlock() for _ in range(8)]).to(device)
    costs = function_costs(eager, (x,))
    op_s = _seconds(lambda: eager(x).sum().backward(), device, sizes.run_s) / costs.ops

    def step_seconds(blocks: int) -> tuple[float, int]:
        model = nn.Sequential(*[_TinyBlock() for _ in range(blocks)])
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
            t = _seconds(step, device, sizes.run_s)
        finally:
            compiled.engine.close()
        ops = function_costs(nn.Sequential(*[_TinyBlock() for _ in range(blocks)]), (x,)).ops
        return t - ops * op_s, len(list(model.parameters()))

    many, many_tensors = step_seconds(8)
    few, few_tensors = step_seconds(2)
    tensor_s = (many - few) / (many_tensors - few_tensors)
    if tensor_s <= 0 or few < few_tensors * tensor_s:
        # Noise larger than the difference: all of it per tensor, none per step.
        return {"op_s": op_s, "tensor_s": max(0.0, many / many_tensors), "step_s": 0.0}
    return {"op_s": op_s, "tensor_s": tensor_s, "step_s": few - few_tensors * tensor_s}


def _disk_bandwidths(directory: Path, nbytes: int) -> dict[str, float]:
    """Write (with fsync) and read (page cache dropped where the OS allows) of one file."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk_len = min(nbytes, 8 * 2**20)
    # Random bytes: a compressing file system must not make the write look fast.
    chunk = torch.randint(0, 256, (chunk_len,), dtype=torch.uint8).numpy().tobytes()
    buf = bytearray(chunk_len)
    fd, name = tempfile.mkstemp(prefix=".weightstream-diskprobe-", dir=directory)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, chunk_len)])
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with open(name, "rb", buffering=0) as f:
            t0 = time.perf_counter()
            while f.readinto(buf):
                pass
            read = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(name)
    return {"read": read, "write": write}


def measure(device: torch.device | str = "cpu", quick: bool = False) -> Probe:
    """Measure the probe now (no cache, no disk figures)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = _QUICK if quick else _FULL
    # Measuring must not move the user's random stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(0)
        flops = _matmul_flops(device, sizes)
        memory = _add_bandwidth(device, sizes)
        host = memory if device.type == "cpu" else _add_bandwidth(torch.device("cpu"), sizes)
        link = None if device.type == "cpu" else _link_bandwidth(device, sizes)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fixed = _fixed_costs(device, sizes)
    return Probe(
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        matmul_flops=flops,
        memory_bandwidth=memory,
        host_memory_bandwidth=host,
        link_bandwidth=link,
        quick=quick,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **fixed,
    )


def _load(path: Path) -> Probe | None:
    try:
        return Probe.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        warnings.warn(
            f"weightstream: ignoring the probe {str(path)!r} ({exc}); measuring again.",
            stacklevel=3,
        )
        return None


def _save(probe: Probe, path: Path) -> None:
    write_text_atomic(path, json.dumps(probe.to_dict(), indent=2, sort_keys=True))


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
    probe = _load(path)
    if probe is None or probe.device_name != device_name(device) or probe.quick != quick:
        probe = measure(device, quick)
        _save(probe, path)
    if disk_dir is not None and str(disk_dir) not in probe.disk:
        sizes = _QUICK if quick else _FULL
        where = Path(disk_dir)
        while not where.is_dir() and where.parent != where:  # the store makes its own later
            where = where.parent
        probe.disk[str(disk_dir)] = _disk_bandwidths(where, sizes.disk_bytes)
        _save(probe, path)
    return probe

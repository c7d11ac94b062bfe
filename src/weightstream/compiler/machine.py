"""What this machine can do, measured once and cached: the denominators of the estimate.

* matmul throughput (FLOP/s) per dtype: ``torch.mm`` of square matrices on the
  compute device, sized (and repeated) to take about 0.2 s;
* host -> device copy bandwidth (bytes delivered per second): a large
  ``copy_`` from (pinned) host memory; on the CPU a host-to-host copy;
* host memory bandwidth (bytes read + written per second): a host-to-host
  copy, counting the read and the write (what the host optimizer streams);
* disk write and read bandwidth of a directory: a file written and
  ``fsync``-ed, then evicted from the page cache where the OS allows
  (``posix_fadvise(DONTNEED)``) and read back; deleted afterwards.

Each figure is the median of 3 repetitions (``samples`` keeps all three, so a
report can show min/median/max). The profile is cached as JSON under
``$WEIGHTSTREAM_CACHE_DIR`` (default ``~/.cache/weightstream``), in a file
named by a hash of the device name, the torch version and the thread count,
so a different machine, torch or thread setting measures again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SCHEMA = 1
REPEATS = 3
ENV_CACHE_DIR = "WEIGHTSTREAM_CACHE_DIR"
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class _Sizes:
    matmul_seconds: float  # target duration of one matmul measurement
    matmul_max_n: int  # largest square matrix (memory: 3 n^2 elements)
    copy_bytes: int
    disk_bytes: int


_FULL = _Sizes(
    matmul_seconds=0.2, matmul_max_n=4096, copy_bytes=128 * 2**20, disk_bytes=256 * 2**20
)
_QUICK = _Sizes(matmul_seconds=0.01, matmul_max_n=128, copy_bytes=2**20, disk_bytes=2**20)


@dataclass
class MachineProfile:
    """Measured throughputs of one compute device and its host."""

    device: str  # "cpu", "cuda:0"
    device_name: str
    torch_version: str
    num_threads: int
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s (dtypes the device supports)
    copy_bandwidth: float  # host -> device, bytes delivered per second
    host_memory_bandwidth: float  # host RAM, bytes read + written per second
    disk_write_bandwidth: float | None  # bytes per second (write + fsync)
    disk_read_bandwidth: float | None
    disk_dir: str | None
    quick: bool = False  # measured with tiny sizes (tests): not representative
    measured_at: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)  # every repetition
    schema: int = SCHEMA

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        name = _dtype_name(dtype)
        if name not in self.matmul_flops:
            raise ValueError(
                f"the machine profile has no matmul throughput for {name} on {self.device} "
                f"(measured: {', '.join(sorted(self.matmul_flops))}); use one of those "
                "compute dtypes."
            )
        return self.matmul_flops[name]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"machine profile schema {data.get('schema')!r}, expected {SCHEMA}")
        profile = cls(**data)
        if not profile.matmul_flops or profile.copy_bandwidth <= 0:
            raise ValueError("machine profile is incomplete")
        return profile


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


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


def profile_key(device: torch.device | str, quick: bool = False) -> str:
    device = torch.device(device)
    ident = [device.type, device_name(device), torch.__version__, torch.get_num_threads(), quick]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def default_path(device: torch.device | str, quick: bool = False) -> Path:
    return default_cache_dir() / f"machine-{profile_key(device, quick)}.json"


# ---- measurements -----------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        # Host sync point: a timing is only meaningful once the device is done.
        torch.accelerator.synchronize(device)


def _median3(fn) -> tuple[float, list[float]]:
    samples = [fn() for _ in range(REPEATS)]
    return statistics.median(samples), samples


def _matmul_flops(device: torch.device, dtype: torch.dtype, sizes: _Sizes) -> tuple[float, list]:
    def operands(n: int):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up (kernel selection, first touch of out)
        _sync(device)
        return a, b, out

    def seconds_per_product(n: int, budget: float) -> float:
        # As many products as fit in the budget: one product of a small matrix
        # is too short to time against the thread pool's wake-up.
        a, b, out = operands(n)
        iters, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            iters += 1
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= budget:
                return elapsed / iters

    def timed(n: int, iters: int) -> float:
        a, b, out = operands(n)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        _sync(device)
        return time.perf_counter() - t0

    # Grow n until one product takes a twentieth of the target (n is capped to
    # bound memory), then repeat the product to fill the target time.
    n = 64
    while True:
        t = seconds_per_product(n, sizes.matmul_seconds / 8)
        if t >= sizes.matmul_seconds / 20 or n >= sizes.matmul_max_n:
            break
        grow = min(4.0, (sizes.matmul_seconds / 20 / t) ** (1 / 3))
        n = min(sizes.matmul_max_n, max(n + 64, int(n * grow) // 64 * 64))
    iters = max(1, round(sizes.matmul_seconds / t))

    def one() -> float:
        return 2 * n**3 * iters / timed(n, iters)

    return _median3(one)


def _copy_bandwidths(device: torch.device, sizes: _Sizes) -> tuple[float, list, float, list]:
    numel = sizes.copy_bytes // 4
    host_src = torch.ones(numel)
    host_dst = torch.empty(numel)
    host_dst.copy_(host_src)  # first touch

    def host_copy() -> float:
        t0 = time.perf_counter()
        host_dst.copy_(host_src)
        return 2 * sizes.copy_bytes / (time.perf_counter() - t0)  # read + write

    host_bw, host_samples = _median3(host_copy)
    if device.type == "cpu":
        # The compute device is the host: a device copy is a host copy, and
        # the bytes it delivers are half the bytes it moves.
        return host_bw / 2, [s / 2 for s in host_samples], host_bw, host_samples
    pinned = host_src.pin_memory()
    dev_dst = torch.empty(numel, device=device)
    dev_dst.copy_(pinned)
    _sync(device)

    def h2d() -> float:
        t0 = time.perf_counter()
        dev_dst.copy_(pinned, non_blocking=True)
        _sync(device)
        return sizes.copy_bytes / (time.perf_counter() - t0)

    link_bw, link_samples = _median3(h2d)
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
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(0)
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
    return MachineProfile(
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
        quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        samples=samples,
    )


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    tiny sizes (a few milliseconds; for tests), cached under its own key.
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
            return cached
    profile = measure(device, quick=quick, disk_dir=disk_dir)
    _write_json_atomic(path, profile.to_dict())
    return profile

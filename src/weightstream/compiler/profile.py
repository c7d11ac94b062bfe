"""MachineProfile and UpdateCost: what machine.py measures and estimate.py reads."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import torch

SCHEMA = 6  # 5: ``disturbed`` (Note [quiet timings]); 6: runs got faster (Note [helper
# threads and OpenMP] in runtime/device.py, Note [one event per step] in common/scalars.py)


@dataclass
class UpdateCost:
    """Seconds of one optimizer update: fixed + per parameter tensor + per element."""

    spec: dict  # what was measured (optimizer, its arguments, clipping, scaler, device)
    fixed_s: float
    per_tensor_s: float
    per_element_s: float

    def seconds(self, tensors: int, elements: int) -> float:
        return self.fixed_s + tensors * self.per_tensor_s + elements * self.per_element_s


@dataclass
class MachineProfile:
    """Measured throughputs of one compute device and its host, and fixed costs."""

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
    # float32 FLOP/s of an n x n x n product, by str(n)
    matmul_curve: dict[str, float] = field(default_factory=dict)
    # FLOP/s of causal attention forward + backward, by str(effective size)
    attention_curve: dict[str, float] = field(default_factory=dict)
    # the same curve for other dtypes, by dtype name: measured when a run first
    # computes in one (attention_curve_for); {} when it has no attention kernel
    attention_curves: dict[str, dict[str, float]] = field(default_factory=dict)
    # operator class -> str(bytes one operator moves) -> bytes per second
    op_bandwidth: dict[str, dict[str, float]] = field(default_factory=dict)
    op_overhead_fwd_s: float = 0.0  # per aten operator in forward (autograd recording)
    op_overhead_bwd_s: float = 0.0  # per aten operator in backward
    unit_overhead_s: float = 0.0  # per streamed unit per step (forward + backward)
    param_overhead_s: float = 0.0  # per streamed parameter tensor per step
    stream_call_s: float = 0.0  # per step of a streamed model, whatever its units
    # bytes (2 fetches + gradients back) per second the streaming runtime moves
    stream_bandwidth: float = 0.0
    step_overhead_s: float = 0.0  # the run loop's bookkeeping per step (logging, loss read)
    # a training step's work and fixed costs in situ over the same timed alone (Note [in situ])
    in_situ_factor: float = 1.0
    update_costs: dict[str, dict] = field(default_factory=dict)  # update_key -> UpdateCost
    runtime_digest: str = ""  # of the sources the software figures timed
    # share of the CPUs other processes used while this was measured (OtherLoad)
    other_load: float | None = None
    # phases other processes kept busy through their retries (Note [quiet timings]):
    # a cached profile with any is measured again
    disturbed: list[str] = field(default_factory=list)
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

    def matmul_throughput(self, n: int, dtype: torch.dtype | str) -> float:
        """FLOP/s of a product of effective size ``n`` (0: unknown shape -> the peak).

        The float32 curve interpolated at n (log-log), scaled for the dtype by
        :meth:`_dtype_scaled`.
        """
        peak = self.peak_flops(dtype)
        if n <= 0 or not self.matmul_curve:
            return peak
        f32 = self.matmul_flops.get("float32", peak)
        return self._dtype_scaled(_interp(self.matmul_curve, n, end=f32), peak)

    def _dtype_scaled(self, f32_speed: float, peak: float) -> float:
        """A float32 speed at some size, for a dtype of matmul peak ``peak``.

        A dtype faster than float32 (half precision on tensor cores or AMX) scales
        the curve by the peaks' ratio. A slower one (bfloat16 on a CPU without
        native bf16 instructions: a flat ~50 GFLOP/s against float32's 120-260
        on this kind of VM) runs at its peak wherever float32 is faster than
        that: its kernels are bound by their own arithmetic, not by what holds
        float32 back at that size. Scaling the curve down by the ratio instead
        priced a 128-wide bf16 product at 22 GFLOP/s (measured: 50), and the
        estimate swung with the float32 peak's phase (Note [quiet timings]).
        """
        f32 = self.matmul_flops.get("float32", peak)
        return min(peak, f32_speed * max(1.0, peak / f32))

    def attention_throughput(self, n: int, dtype: torch.dtype | str) -> float:
        """FLOP/s of attention of effective size ``n``: the dtype's own curve (bfloat16
        attention on a CPU without native bf16 ran 3.6x slower than float32 at T=128
        but at 76 GFLOP/s at T=1024: no one ratio fits), else the float32 curve
        scaled by :meth:`_dtype_scaled`."""
        peak = self.peak_flops(dtype)
        own = self.attention_curves.get(_dtype_name(dtype))
        if own:
            return min(peak, _interp(own, n))
        if not self.attention_curve:
            return peak
        return self._dtype_scaled(_interp(self.attention_curve, n), peak)

    def in_situ_compute_factor(self, dtype: torch.dtype | str) -> float:
        """``in_situ_factor`` for products and attention in ``dtype`` (Note [in situ]).

        The proxy measures float32. What slows work inside a step (cold operands,
        fresh pages) adds about the same time per byte whatever the kernel's
        speed, so a kernel k times slower than float32's hides it k times
        better: the excess over 1 scales with the dtype's peak over float32's
        (at most 1). Measured: GPT-2 small streamed in bfloat16 on a CPU without
        native bf16 ran its 7 TFLOP step at 47 GFLOP/s, the bf16 peak (48),
        where the float32 factor of 1.25 priced it 1.6x too slow.
        """
        f = self.in_situ_factor
        f32 = self.matmul_flops.get("float32")
        if not f32:
            return f
        return 1.0 + (f - 1.0) * min(1.0, self.peak_flops(dtype) / f32)

    def op_throughput(self, cls: str, nbytes: int) -> float:
        """Bytes per second of a non-matmul operator of class ``cls`` moving ``nbytes``.

        A class without a figure (or an unknown one) is priced as "simple";
        without any figure, the host memory bandwidth.
        """
        curve = self.op_bandwidth.get(cls) or self.op_bandwidth.get("simple")
        if not curve:
            return self.host_memory_bandwidth
        return _interp(curve, nbytes)

    def cold_op_throughput(self) -> float:
        """Bytes per second of a simple operator on operands larger than the caches: the
        "simple" curve at its largest size (the host memory bandwidth without one)."""
        simple = self.op_bandwidth.get("simple")
        if not simple:
            return self.host_memory_bandwidth
        return simple[max(simple, key=float)]

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


def _interp(curve: dict[str, float], x: float, end: float | None = None) -> float:
    """``curve`` (str(x) -> y) at ``x``: log-log interpolation, clamped at the first
    point, and beyond the last one either clamped or (``end``) rising linearly in
    log x to ``end`` at 4 x the last x."""
    points = sorted((float(k), v) for k, v in curve.items())
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        last_x, last_y = points[-1]
        if end is None or end <= last_y:
            return last_y
        frac = min(1.0, math.log(x / last_x) / math.log(4))
        return last_y * (end / last_y) ** frac
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            frac = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + frac * (math.log(y1) - math.log(y0)))
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")

"""Estimated step time and samples/sec of a training run, before any step: a roofline.

Inputs: the counted per-unit costs (``cost.py``), the probe's rates
(``probe.py``) and the run settings.

Note [the roofline]
-------------------
Per streaming unit, with the probe's rates:

* compute and memory: each kernel (Note [timed kernels] in operators.py) at its
  timed seconds, or, untimed, at max(FLOPs / peak, bytes / memory bandwidth);
  kernels with FLOPs count as compute, the others as memory. Memory also holds
  the bytes of the operators that are not kernels at the memory bandwidth, and
  on the CPU the large outputs at the first-touch bandwidth of fresh pages
  (Note [fresh pages] in operators.py);
* overhead: operators x ``op_s`` and trainable parameter tensors x ``tensor_s``
  (Note [fixed costs] in probe.py);
* update: the optimizer's bytes per trainable parameter (``update_bytes``) over
  the bandwidth of the memory holding the masters (the host's when streaming);
* link: 2 fetches of the weights and the gradients back, over the host -> device
  link (on the CPU a fetch is a host copy: each byte read and written);
* disk: the disk store's file traffic a step, shared among the units by their
  trainable parameters.

On a CPU compute, memory, overhead and update run one after the other; on an
accelerator the host's operator overhead hides under the device's work, so the
larger of the two counts. With prefetching (``prefetch_depth`` >= 1) link and
disk overlap that work and the unit takes the largest; without, their sum. A
unit whose forward runs again in the backward (activation checkpointing) has its
forward's terms twice. The step is the sum over the units, plus what runs
outside them, ``step_s`` and the input pipeline's seconds per batch when the
training process itself makes the batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from weightstream.compiler.cost import StepCosts, UnitCost
from weightstream.compiler.probe import Probe

# Bytes each trainable parameter moves in an update, by optimizer (fp32 state;
# each foreach operator reads its operands and writes its result). AdamW: decay
# p (rw), lerp m with g (r m g, w m), v * b2 + g*g (r v g, w v), sqrt(v) (r v, w),
# bias correction and eps (rw twice), p += m / denom (r p m d, w p): 80.
UPDATE_BYTES = {"adamw": 80, "adam": 80, "sgd": 12, "sgd_momentum": 28}
DEFAULT_UPDATE_BYTES = 80
CLIP_BYTES = 12  # gradient clipping: the norm reads each gradient, the scaling rw
TERMS = ("compute", "memory", "overhead", "update", "link", "disk")


@dataclass
class EstimateSettings:
    """What the estimate needs to know of the run besides the costs.

    ``prefetch_depth`` 0 serializes link and disk with the work;
    ``transfer_dtype`` is the dtype weights and gradients travel in (None: their
    own); ``weight_streaming`` False prices layer pipelined; ``input_s``: seconds
    the input pipeline costs the training process per batch; ``recompute``: the
    units whose forward runs again in their backward; ``disk_*``: the disk
    store's file traffic a step and its directory (the probe's key).
    """

    batch_size: int
    prefetch_depth: int = 1
    compute_dtype: str = "float32"
    transfer_dtype: str | None = None
    weight_streaming: bool = True
    update_bytes: int = DEFAULT_UPDATE_BYTES
    input_s: float = 0.0
    recompute: tuple[int, ...] = ()
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        self.recompute = tuple(sorted(self.recompute))
        for name in ("compute_dtype", "transfer_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            value = str(value).removeprefix("torch.")
            setattr(self, name, value)
            if not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(
                    f"{name} must name a torch dtype (e.g. 'bfloat16'), got {value!r}."
                )
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}.")
        for name in ("update_bytes", "input_s", "disk_read_bytes", "disk_write_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}.")


@dataclass
class UnitEstimate:
    """One unit's (or, index -1, what runs outside the units') seconds, term by term."""

    index: int
    name: str
    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    fwd_memory_s: float = 0.0
    bwd_memory_s: float = 0.0
    fwd_overhead_s: float = 0.0
    bwd_overhead_s: float = 0.0
    stream_s: float = 0.0  # its parameter tensors' fixed costs
    update_s: float = 0.0
    transfer_s: float = 0.0  # link: 2 fetches + gradients back
    disk_s: float = 0.0
    time_s: float = 0.0  # its share of the step
    bound: str = "compute"  # the term that sets time_s

    @property
    def terms(self) -> dict[str, float]:
        return {
            "compute": self.fwd_compute_s + self.bwd_compute_s,
            "memory": self.fwd_memory_s + self.bwd_memory_s,
            "overhead": self.fwd_overhead_s + self.bwd_overhead_s + self.stream_s,
            "update": self.update_s,
            "link": self.transfer_s,
            "disk": self.disk_s,
        }


@dataclass
class Estimate:
    settings: EstimateSettings
    units: list[UnitEstimate]
    outside: UnitEstimate
    step_s: float
    est_samples_per_sec: float
    bound: str  # the largest term of the step (TERMS or input)
    compute_s: float
    memory_s: float
    overhead_s: float  # operators, parameter tensors and the probe's step_s
    update_s: float
    transfer_s: float
    disk_s: float
    input_s: float
    total_flops: int
    ops: int
    op_bytes: int
    link_bytes: int  # 2 x weights fetched + gradients back
    host_bytes: int  # the update's traffic
    limit_s: float  # the physical limit of one step: max over the resources
    limit_bound: str
    limit_samples_per_sec: float
    timed_kernels: str  # "timed / all" kernels priced by the probe's timings
    notes: list[str] = field(default_factory=list)

    @property
    def model_samples_per_sec(self) -> float:
        """What the model consumes when the input costs the training process nothing."""
        return self.settings.batch_size / (self.step_s - self.input_s)

    def to_dict(self) -> dict:
        return asdict(self)


def _link_bytes(u: UnitCost, transfer_dtype: str | None) -> int:
    """2 fetches of the weights + the gradients back, in the transfer dtype."""
    if transfer_dtype is None:
        return 2 * u.weight_bytes + u.trainable_bytes
    return (2 * u.numel + u.trainable_numel) * getattr(torch, transfer_dtype).itemsize


def _pass(kernels, nbytes: int, ops: int, peak: float, probe: Probe) -> tuple[float, float, float]:
    """(compute, memory, overhead) seconds of one pass of one entry."""
    bw = probe.memory_bandwidth
    compute, memory = 0.0, nbytes / bw
    for key, flops, b in kernels:
        s = probe.kernel_s.get(key)
        s = max(flops / peak, b / bw) if s is None else s
        if flops:
            compute += s
        else:
            memory += s
    return compute, memory, ops * probe.op_s


def _entry(e: UnitCost, probe: Probe, settings: EstimateSettings, recomputed: bool) -> UnitEstimate:
    """An entry's work terms; link, disk and update are the caller's."""
    peak = probe.peak_flops(settings.compute_dtype)
    fresh = e.fresh_bytes / probe.fresh_bandwidth if probe.fresh_bandwidth else 0.0
    fc, fm, fo = _pass(e.fwd_kernels, e.fwd_bytes, e.fwd_ops, peak, probe)
    bc, bm, bo = _pass(e.bwd_kernels, e.bwd_bytes, e.bwd_ops, peak, probe)
    if recomputed:  # activation checkpointing: the forward again in the backward
        bc, bm, bo = bc + fc, bm + fm, bo + fo
    return UnitEstimate(e.index, e.name, fc, bc, fm + fresh, bm, fo, bo)


def _close(u: UnitEstimate, on_cpu: bool, overlap: bool) -> None:
    """Set ``u.time_s`` and ``u.bound`` from its terms (Note [the roofline])."""
    t = u.terms
    data = t["compute"] + t["memory"]
    work = (data + t["overhead"] if on_cpu else max(data, t["overhead"])) + t["update"]
    u.time_s = max(work, t["link"], t["disk"]) if overlap else work + t["link"] + t["disk"]
    if overlap and u.time_s > work:
        u.bound = "link" if t["link"] >= t["disk"] else "disk"
    else:
        u.bound = max(TERMS[:4], key=t.__getitem__)


def estimate(costs: StepCosts, probe: Probe, settings: EstimateSettings) -> Estimate:
    """Estimate one step of ``costs`` on ``probe``'s machine (Note [the roofline])."""
    ws, on_cpu = settings.weight_streaming, probe.device_type == "cpu"
    host_bw = probe.host_memory_bandwidth if ws else probe.memory_bandwidth
    disk_s, notes = 0.0, []
    if settings.disk_read_bytes + settings.disk_write_bytes:
        rates = probe.disk.get(str(settings.disk_dir))
        if rates:
            disk_s = settings.disk_read_bytes / rates["read"]
            disk_s += settings.disk_write_bytes / rates["write"]
        else:
            notes.append(
                f"the disk store's traffic is not priced: no disk figures for {settings.disk_dir!r}"
            )
    trainable = sum(u.trainable_numel for u in costs.units) or 1
    link_bytes = host_bytes = 0
    units = []
    for u in costs.units:
        e = _entry(u, probe, settings, u.index in settings.recompute)
        e.stream_s = u.trainable_tensors * probe.tensor_s
        host_bytes += u.trainable_numel * settings.update_bytes
        e.update_s = u.trainable_numel * settings.update_bytes / host_bw
        if ws:
            nbytes = _link_bytes(u, settings.transfer_dtype)
            link_bytes += nbytes
            e.transfer_s = (
                2 * nbytes / probe.memory_bandwidth if on_cpu else nbytes / probe.link_bandwidth
            )
        e.disk_s = disk_s * u.trainable_numel / trainable
        _close(e, on_cpu, settings.prefetch_depth >= 1)
        units.append(e)
    outside = _entry(costs.outside, probe, settings, False)
    _close(outside, on_cpu, settings.prefetch_depth >= 1)
    step = sum(e.time_s for e in units) + outside.time_s + probe.step_s + settings.input_s
    if step <= 0:
        raise ValueError(
            "the step has no cost (no FLOPs, no bytes, no operators): nothing to estimate. "
            "Check that the model has parameters and the example batch reaches them."
        )
    totals = {k: sum(e.terms[k] for e in (*units, outside)) for k in TERMS}
    totals["overhead"] += probe.step_s
    totals["input"] = settings.input_s
    peak = probe.peak_flops(settings.compute_dtype)
    if on_cpu:  # one memory for everything: a copy of n bytes reads n and writes n
        limits = {"host memory": (2 * link_bytes + host_bytes + costs.op_bytes) / host_bw}
    else:
        limits = {"device link": link_bytes / probe.link_bandwidth if ws else 0.0}
        limits["host memory"] = host_bytes / host_bw
    limits["disk"] = disk_s
    limit_bound, limit = max([("compute", costs.flops / peak), *limits.items()], key=lambda x: x[1])
    if not costs.backward_measured:
        notes.append(f"backward FLOPs and operators are 2 x forward ({costs.backward_error})")
    if probe.quick:
        notes.append("the probe was measured with tiny sizes (quick=True)")
    timed = sum(key in probe.kernel_s for key in costs.kernels)
    return Estimate(
        settings=settings,
        units=units,
        outside=outside,
        step_s=step,
        est_samples_per_sec=settings.batch_size / step,
        bound=max(totals, key=totals.__getitem__),
        compute_s=totals["compute"],
        memory_s=totals["memory"],
        overhead_s=totals["overhead"],
        update_s=totals["update"],
        transfer_s=totals["link"],
        disk_s=totals["disk"],
        input_s=settings.input_s,
        total_flops=costs.flops,
        ops=costs.ops,
        op_bytes=costs.op_bytes,
        link_bytes=link_bytes,
        host_bytes=host_bytes,
        limit_s=limit,
        limit_bound=limit_bound,
        limit_samples_per_sec=settings.batch_size / limit if limit > 0 else float("inf"),
        timed_kernels=f"{timed} / {len(costs.kernels)}",
        notes=notes,
    )

"""Estimated step time and samples/sec of a training run, before any step: a roofline
of the counted costs (``cost.py``) at the probe's rates (``probe.py``).

Note [the roofline]
-------------------
Per streaming unit:

* compute and memory: each kernel (Note [timed kernels] in cost.py) at its
  timed seconds, untimed at max(FLOPs / peak, bytes / bandwidth), as compute if
  it has FLOPs, else as memory; memory also holds the other operators' bytes at
  the memory bandwidth and, on the CPU, new large outputs at the fresh-page rate
  (Note [fresh pages] in cost.py);
* overhead: operators x ``op_s`` + trainable tensors x ``tensor_s`` (Note [fixed
  costs] in probe.py);
* update: ``update_bytes`` per trainable parameter at the masters' memory
  bandwidth (the host's when streaming, the device's for the device tier);
* link: 2 fetches of the weights and the gradients back over the host -> device
  link (on the CPU a host copy: each byte read and written); none for the
  device tier's units (Note [device tier] in runtime/placement.py);
* disk: the disk store's file traffic a step, shared by trainable parameters;
* collective (data parallel, N ranks): SwarmX's collectives at the costs the
  run's own process group measured when it compiled (``swarm.collective_costs``:
  seconds a call and a byte): the gradients all-reduced, in buckets of
  ``reduce_bucket_bytes``, or, for a sharded store's streamed unit, its weights
  broadcast by their owner twice (forward and backward) and its gradients
  reduced to it; the owner's update is then 1/N of the units' on average.

On a CPU compute, memory, overhead and update add up, and the collectives with
them (gloo's copies and sums run on the cores that compute); on an accelerator
the host's overhead hides under the device's work (the larger counts). With
prefetching link, disk and, on an accelerator, the collectives overlap the work
(the largest counts), without they add. A recomputed unit (activation
checkpointing) does its forward twice. The step: the units, what runs outside
them, ``step_s`` and the input pipeline's seconds per batch when the training
process makes the batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightstream.compiler.cost import StepCosts, UnitCost
from weightstream.compiler.probe import Probe, timing

# Bytes each trainable parameter moves in an update, by optimizer (fp32 state;
# each foreach operator reads its operands and writes its result). AdamW: decay
# p (rw), lerp m with g (r m g, w m), v * b2 + g*g (r v g, w v), sqrt(v) (r v, w),
# bias correction and eps (rw twice), p += m / denom (r p m d, w p): 80.
UPDATE_BYTES = {"adamw": 80, "adam": 80, "sgd": 12, "sgd_momentum": 28}
DEFAULT_UPDATE_BYTES = 80
CLIP_BYTES = 12  # gradient clipping: the norm reads each gradient, the scaling rw
TERMS = ("compute", "memory", "overhead", "update", "link", "disk", "collective")


@dataclass
class EstimateSettings:
    """What the estimate needs to know of the run besides the costs."""

    batch_size: int
    prefetch_depth: int = 1  # 0: link and disk serialized with the work
    compute_dtype: str = "float32"
    transfer_dtype: str | None = None  # weights and gradients on the link; None: their own
    weight_streaming: bool = True  # False: layer pipelined
    update_bytes: int = DEFAULT_UPDATE_BYTES
    input_s: float = 0.0  # what the input pipeline costs the training process a batch
    recompute: tuple[int, ...] = ()  # units whose forward runs again in their backward
    resident: tuple[int, ...] = ()  # the device tier's units: no link, updated on the device
    disk_read_bytes: int = 0  # the disk store's file traffic a step
    disk_write_bytes: int = 0
    disk_dir: str | None = None  # its directory: the probe's key
    ranks: int = 1  # data parallel: the ranks (this estimate is one rank's step)
    sharded: bool = False  # a sharded store (Note [sharded store] in runtime/sharding.py)
    # swarm.PRICED_COLLECTIVES -> [seconds a call, seconds a byte], measured on the ranks
    collectives: dict[str, list[float]] | None = None
    reduce_bucket_bytes: int = 4 * 2**20  # StreamingConfig.reduce_bucket_bytes

    def __post_init__(self) -> None:
        self.recompute = tuple(sorted(self.recompute))
        self.resident = tuple(sorted(self.resident))
        for name in ("compute_dtype", "transfer_dtype"):
            value = getattr(self, name)
            value = value if value is None else str(value).removeprefix("torch.")
            if value is not None and not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(
                    f"{name} must name a torch dtype (e.g. 'bfloat16'), not {value!r}."
                )
            setattr(self, name, value)
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}.")


@dataclass
class UnitEstimate:
    """One unit's (or, index -1, what runs outside the units') seconds, term by term."""

    index: int
    name: str
    compute_s: float = 0.0  # kernels with FLOPs
    memory_s: float = 0.0  # the other kernels, the small operators' bytes, fresh pages
    overhead_s: float = 0.0  # operators and parameter tensors at their fixed costs
    update_s: float = 0.0
    link_s: float = 0.0  # 2 fetches + gradients back
    disk_s: float = 0.0
    collective_s: float = 0.0  # data parallel: its broadcasts and reductions
    time_s: float = 0.0  # its share of the step
    bound: str = "compute"  # the term that sets time_s

    def term(self, name: str) -> float:
        return getattr(self, f"{name}_s")


@dataclass
class Estimate:
    settings: EstimateSettings
    units: list[UnitEstimate]
    outside: UnitEstimate
    step_s: float
    bound: str  # the largest term of the step (TERMS or input)
    terms: dict[str, float]  # seconds a step per term of TERMS and "input"
    link_bytes: int  # 2 x weights fetched + gradients back
    host_bytes: int  # the update's traffic
    limit_s: float  # the physical limit of one step: max over the resources
    limit_bound: str
    timed_kernels: str  # "timed / all" kernels priced by the probe's timings
    notes: list[str] = field(default_factory=list)

    est_samples_per_sec = property(lambda self: self.settings.batch_size / self.step_s)

    @property
    def model_samples_per_sec(self) -> float:
        """What the model consumes when the input costs the training process nothing."""
        return self.settings.batch_size / (self.step_s - self.settings.input_s)

    @property
    def limit_samples_per_sec(self) -> float:
        return self.settings.batch_size / self.limit_s if self.limit_s > 0 else float("inf")


def _link_bytes(u: UnitCost, transfer_dtype: str | None) -> int:
    """2 fetches of the weights + the gradients back, in the transfer dtype."""
    if transfer_dtype is None:
        return 2 * u.weight_bytes + u.trainable_bytes
    return (2 * u.numel + u.trainable_numel) * getattr(torch, transfer_dtype).itemsize


def _weight_bytes(u: UnitCost, transfer_dtype: str | None) -> int:
    """One fetch of the unit's weights in the transfer dtype."""
    if transfer_dtype is None:
        return u.weight_bytes
    return u.numel * getattr(torch, transfer_dtype).itemsize


def _work(e: UnitCost, probe: Probe, peak: float, recomputed: bool) -> UnitEstimate:
    """An entry's compute, memory and operator overhead; the caller adds the rest."""
    again = int(recomputed)  # activation checkpointing: the forward again in the backward
    bw = probe.memory_bandwidth
    memory = (e.fwd_bytes * (1 + again) + e.bwd_bytes) / bw
    if probe.fresh_bandwidth:
        memory += e.fresh_bytes / probe.fresh_bandwidth
    compute = 0.0
    for key, flops, nbytes in e.fwd_kernels * (1 + again) + e.bwd_kernels:
        roofline = max(flops / peak, nbytes / bw)
        s = timing(probe, key, roofline)
        s = roofline if s is None else s
        compute, memory = (compute + s, memory) if flops else (compute, memory + s)
    overhead = (e.fwd_ops * (1 + again) + e.bwd_ops) * probe.op_s
    return UnitEstimate(e.index, e.name, compute, memory, overhead)


def _close(u: UnitEstimate, on_cpu: bool, overlap: bool) -> None:
    """Set ``u.time_s`` and ``u.bound`` from its terms (Note [the roofline])."""
    data = u.compute_s + u.memory_s
    work = (data + u.overhead_s if on_cpu else max(data, u.overhead_s)) + u.update_s
    working = [*TERMS[:4], "collective"] if on_cpu else list(TERMS[:4])
    aside = ["link", "disk"] if on_cpu else ["link", "disk", "collective"]
    if on_cpu:  # gloo's copies and sums take the cores that compute
        work += u.collective_s
    u.time_s = max(work, *map(u.term, aside)) if overlap else work + sum(map(u.term, aside))
    if overlap and u.time_s > work:
        u.bound = max(aside, key=u.term)
    else:
        u.bound = max(working, key=u.term)


def _collectives(costs: StepCosts, settings: EstimateSettings) -> list[float]:
    """Each unit's seconds of collectives a step (Note [the roofline]), one rank's."""
    c, n = settings.collectives, len(costs.units)
    if settings.ranks <= 1 or not c:
        return [0.0] * n
    out, bucket = [0.0] * n, 0
    reduced = []  # units whose gradients are all-reduced, in order: buckets of them
    for i, u in enumerate(costs.units):
        streamed = settings.weight_streaming and u.index not in settings.resident
        if settings.sharded and streamed:
            latency, per_byte = c["broadcast"]
            out[i] = 2 * (latency + _weight_bytes(u, settings.transfer_dtype) * per_byte)
            if u.trainable_bytes:
                latency, per_byte = c["reduce"]
                out[i] += latency + u.trainable_bytes * per_byte
        elif u.trainable_bytes:
            reduced.append(i)
    latency, per_byte = c["all_reduce"]
    for k, i in enumerate(reduced):  # a call per bucket, at the unit that fills it
        nbytes = costs.units[i].trainable_bytes
        bucket += nbytes
        out[i] += nbytes * per_byte
        if bucket >= settings.reduce_bucket_bytes or k == len(reduced) - 1:
            out[i] += latency
            bucket = 0
    return out


def estimate(costs: StepCosts, probe: Probe, settings: EstimateSettings) -> Estimate:
    """Estimate one step of ``costs`` on ``probe``'s machine (Note [the roofline])."""
    ws, on_cpu = settings.weight_streaming, probe.device_type == "cpu"
    host_bw = probe.host_memory_bandwidth if ws else probe.memory_bandwidth
    peak, overlap = probe.peak_flops(settings.compute_dtype), settings.prefetch_depth >= 1
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
    collectives = _collectives(costs, settings)
    for u, collective_s in zip(costs.units, collectives, strict=True):
        e = _work(u, probe, peak, u.index in settings.recompute)
        e.overhead_s += u.trainable_tensors * probe.tensor_s
        e.collective_s = collective_s
        update = u.trainable_numel * settings.update_bytes
        if u.index in settings.resident:  # Note [device tier] in runtime/placement.py
            e.update_s = update / probe.memory_bandwidth
        else:
            if settings.sharded and ws:  # its owner's: 1/N of the units on average
                update //= settings.ranks
            host_bytes += update
            e.update_s = update / host_bw
        if ws and u.index not in settings.resident:
            nbytes = _link_bytes(u, settings.transfer_dtype)
            link_bytes += nbytes
            e.link_s = (
                2 * nbytes / probe.memory_bandwidth if on_cpu else nbytes / probe.link_bandwidth
            )
        e.disk_s = disk_s * u.trainable_numel / trainable
        _close(e, on_cpu, overlap)
        units.append(e)
    outside = _work(costs.outside, probe, peak, False)
    _close(outside, on_cpu, overlap)
    step = sum(e.time_s for e in units) + outside.time_s + probe.step_s + settings.input_s
    if step <= 0:
        raise ValueError(
            "the step has no cost (no FLOPs, no bytes, no operators): nothing to estimate. "
            "Check that the model has parameters and the example batch reaches them."
        )
    terms = {k: sum(e.term(k) for e in (*units, outside)) for k in TERMS}
    terms["overhead"] += probe.step_s
    terms["input"] = settings.input_s
    if on_cpu:  # one memory for everything: a copy of n bytes reads n and writes n
        limits = {"host memory": (2 * link_bytes + host_bytes + costs.op_bytes) / host_bw}
    else:
        limits = {"device link": link_bytes / probe.link_bandwidth if ws else 0.0}
        limits["host memory"] = host_bytes / host_bw
    limits["disk"] = disk_s
    limits["collectives"] = sum(collectives)
    limit_bound, limit = max([("compute", costs.flops / peak), *limits.items()], key=lambda x: x[1])
    if not costs.backward_measured:
        notes.append(f"backward FLOPs and operators are 2 x forward ({costs.backward_error})")
    if probe.quick:
        notes.append("the probe was measured with tiny sizes (quick=True)")
    bw = probe.memory_bandwidth
    timed = sum(
        timing(probe, key, max(k.flops / peak, k.nbytes / bw)) is not None
        for key, k in costs.kernels.items()
    )
    bound = max(terms, key=terms.__getitem__)
    return Estimate(settings, units, outside, step, bound, terms, link_bytes, host_bytes,
                    limit, limit_bound, f"{timed} / {len(costs.kernels)}", notes)  # fmt: skip

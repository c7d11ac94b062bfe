"""Estimated step time and samples/sec of a training run, before any step.

Inputs: the measured per-unit costs (``cost.py``), the machine profile
(``machine.py``) and the run settings. Every term is written out here.

Per entry (a streaming unit, or everything outside the units) and pass
(forward, backward), the work on the compute device is:

* compute: matmul-like FLOPs by effective size n / the matmul throughput at n
  (``MachineProfile.matmul_throughput``: the measured curve, the dtype's peak
  for large or unknown shapes), plus attention FLOPs by effective size / the
  attention throughput at n, plus any other counted FLOPs / the peak;
* memory: for each non-matmul operator, the bytes it reads and writes / the
  measured throughput of its class at its size
  (``MachineProfile.op_throughput``; Note [operator bytes] in ``operators.py``),
  at most the simple operators' throughput on operands larger than the caches
  (``MachineProfile.cold_op_throughput``: a step's operands are cold, Note [in situ]);
* overhead: operators run x the fixed cost of one operator in that pass
  (``op_overhead_fwd_s`` / ``op_overhead_bwd_s``; Note [fixed costs] in
  ``software.py``).

work = (compute + memory) x ``in_situ_factor`` + overhead: the profile's figures
time each kind of work alone, and a training step runs its work on data slower
than the sum of its parts (cold operands, outputs on fresh memory, the prefetch
thread beside the compute); the factor is measured on a proxy training step
(Note [in situ] in ``software.py``). The fixed costs (operators, streaming
bookkeeping) and a measured update below are not scaled: they are measured as
they occur in a step. Compute in a dtype slower than float32 takes
a diluted factor (``MachineProfile.in_situ_compute_factor``).

Weight streaming adds, per unit:

* transfer: forward = weight bytes / streaming bandwidth (the forward
  fetch); backward = (weight bytes + gradient bytes) / streaming bandwidth
  (the backward fetch, and the gradients of trainable parameters going back
  to the host). The streaming bandwidth is the one the runtime was measured
  to achieve (``MachineProfile.stream_bandwidth``), or the copy bandwidth;
* the unit's share of a pass: with prefetch_depth >= 1 the fetch of the next
  unit of the pass (forward: the next unit; backward: the previous one) runs
  behind this unit's work, so max(work, next unit's transfer), and the first
  unit of each pass (forward: the first; backward: the last) also waits for
  its own fetch, which nothing hides; with 0, work + its own transfer;
* stream: ``unit_overhead_s`` per unit per step (hooks, the two fetches'
  bookkeeping, the background hand-off, the stream-in autograd node), plus
  ``param_overhead_s`` per parameter tensor the unit streams (its view of the
  flat buffer, its slot swapped in and out, its saved weight rebuilt in
  backward, its gradient routed back to the master);

and once per step, whatever the units, ``stream_call_s`` (the streamed call:
the input moved to the device, the pass opened and closed, the first unit's
prefetch handed to the background thread), a fixed cost like the stream term.

Layer pipelined runs (``weight_streaming=False``) have no transfer and no
stream term: a unit's share is its work.

A unit whose forward runs again in its backward (``activation_checkpointing``;
``EstimateSettings.recompute``) adds its forward work to its backward work; its
backward fetch is counted already.

update: the optimizer step after the backward (no overlap). With a measured
``UpdateCost`` (``machine.update_cost``: the trainer's whole update sequence,
clipping, loss scaler and learning-rate scheduler included): fixed + trainable
tensors x per tensor + trainable elements x per element, split per unit by its
tensors and elements (the fixed part is the step's); each timed update follows
tiny training steps, as it follows a backward in a run (Note [update in context]
in ``updates.py``). Without one: trainable
parameters x optimizer bytes per parameter / host memory bandwidth (AdamW in
fp32 streams 7 tensors of 4 bytes per parameter: it reads param, grad,
exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes).

input: seconds the training process spends producing one batch (measured by
the compile phase when the data loader has no worker processes; 0 with
workers, whose throughput the input analyzer compares with the model's).

step overhead: the run loop's bookkeeping per step (``step_overhead_s``:
reading the loss back, logging TensorBoard scalars), and the step's passes
starting cold after the last update (``software.py``).

step = sum over units (forward share + backward share + stream) + stream call +
outside work (forward + backward) + update + step overhead + input; est. samples/sec =
batch / step, and the model's own consumption rate is batch / (step - input). With
a disk store whose files hold part of the training state, at least its file
traffic bound (Note [disk traffic in the estimate]).

Note [disk traffic in the estimate]
-----------------------------------
A disk store keeps what its RAM tier cannot hold in files (Note [disk tier] in
runtime/store.py), and a step reads and writes them: its placement predicts the
bytes (``Placement.disk_reads_per_step`` / ``disk_writes_per_step``), priced at
the profile's disk bandwidths (a 64 MiB file written with fsync and read back
cold, on the profile's disk directory). A step cannot take less than the file
traffic plus what cannot overlap it: while the masters are in RAM the forward
reads no file (state is read for each unit's update, once its gradient exists,
and written after it), so the floor is the forward + the traffic; with masters in
the files the traffic spans the whole step. Measured at 1.39x RAM
(``benchmarks/larger_than_ram.py``, 15.6 GiB a step, two runs): forward 3.8 and
4.9 s, the traffic at that run's burst bandwidths 8.6 and 12.6 s, compute alone
7.3 and 9.5 s, the step 15.3 and 20.3 s. The floor is 0.81 and 0.86 of the
step; the compute alone, all an estimate without this term could see, 0.48 and
0.47. Bursts run faster than a step's sustained mix of reads beside writes, so
the floor stays below the step while the disk keeps the speed it was profiled
at (this VM's disk varies 1.5-2.5x over hours: the profile's figures are
measured once); what the tier costs besides (the store's per-tensor I/O) is not
priced: a 0.9M-parameter model with 19 MB of traffic a step ran at half its
estimate. The report shows the term (``disk``) whether or not it binds, so the
cost of a budget is visible before any step.

The physical limit (design.md, "Performance") is the larger of the compute
time (all FLOPs / peak) and the busiest link's time (bytes it moves / its
bandwidth): the device link carries 2 x weights + gradients, host RAM the
optimizer traffic. When the compute device is the CPU the link *is* host
RAM, so both traffics and the non-matmul operators' bytes are added on that
one link (a copy of n bytes moves 2n).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from weightstream.compiler.cost import StepCosts, UnitCost
from weightstream.compiler.profile import MachineProfile, UpdateCost

ADAMW_FP32_BYTES_PER_PARAM = 7 * 4  # see the module docstring


@dataclass
class EstimateSettings:
    """The run settings the estimate depends on.

    Attributes:
        batch_size: samples per step (per rank).
        prefetch_depth: as ``StreamingConfig.prefetch_depth``; >= 1 overlaps copies.
        compute_dtype: dtype whose matmul throughput prices the FLOPs.
        transfer_dtype: dtype the weights (and their gradients) cross the link
            in; None: the masters' own dtype (what the engine streams today).
        optimizer_bytes_per_param: host bytes read + written per trainable
            parameter by one optimizer update (used without ``update``).
        weight_streaming: False for a layer pipelined run (nothing streams).
        update: the measured cost of the run's optimizer update, or None.
        input_s: seconds per batch the input pipeline costs the training process.
        step_overhead_s: seconds per step of the training loop's own bookkeeping.
        recompute: indices of the units whose forward runs again in their backward
            (``activation_checkpointing``): their backward work includes it.
        disk_read_bytes, disk_write_bytes: bytes the disk store's files move a step
            (its placement's prediction; 0 for a store in RAM).
        forward_reads_disk: whether the forward reads some of them (masters in the files).
    """

    batch_size: int
    prefetch_depth: int = 1
    compute_dtype: str = "float32"
    transfer_dtype: str | None = None
    optimizer_bytes_per_param: int = ADAMW_FP32_BYTES_PER_PARAM
    weight_streaming: bool = True
    update: UpdateCost | None = None
    input_s: float = 0.0
    step_overhead_s: float = 0.0
    recompute: tuple[int, ...] = ()
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    forward_reads_disk: bool = False

    def __post_init__(self) -> None:
        self.recompute = tuple(sorted(self.recompute))
        self.compute_dtype = str(self.compute_dtype).removeprefix("torch.")
        if self.transfer_dtype is not None:
            self.transfer_dtype = str(self.transfer_dtype).removeprefix("torch.")
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}.")
        for name in ("compute_dtype", "transfer_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(
                    f"{name} must name a torch dtype (e.g. 'bfloat16'), got {value!r}."
                )
        if self.optimizer_bytes_per_param < 0:
            raise ValueError(
                f"optimizer_bytes_per_param must be >= 0, got {self.optimizer_bytes_per_param!r}."
            )
        for name in ("input_s", "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}.")


@dataclass
class PassWork:
    """The work of one entry in one pass (seconds), term by term."""

    compute_s: float = 0.0  # FLOPs at the throughput of their size
    memory_s: float = 0.0  # non-matmul operators' bytes at their class's throughput
    overhead_s: float = 0.0  # operators x fixed cost per operator

    @property
    def work_s(self) -> float:
        return self.compute_s + self.memory_s + self.overhead_s


@dataclass
class UnitEstimate:
    index: int
    name: str
    fwd_compute_s: float
    bwd_compute_s: float
    fwd_transfer_s: float  # forward fetch
    bwd_transfer_s: float  # backward fetch + gradients back
    update_s: float
    fwd_s: float  # the unit's share of the step in forward
    bwd_s: float
    bound: str  # "compute", "memory", "overhead" or "transfer": the largest, both passes
    fwd_memory_s: float = 0.0
    bwd_memory_s: float = 0.0
    fwd_overhead_s: float = 0.0
    bwd_overhead_s: float = 0.0
    stream_s: float = 0.0  # streaming bookkeeping per step (weight streaming only)

    @property
    def fwd_work_s(self) -> float:
        return self.fwd_compute_s + self.fwd_memory_s + self.fwd_overhead_s

    @property
    def bwd_work_s(self) -> float:
        return self.bwd_compute_s + self.bwd_memory_s + self.bwd_overhead_s

    @property
    def share_s(self) -> float:
        """The unit's part of the step: both passes and the streaming bookkeeping."""
        return self.fwd_s + self.bwd_s + self.stream_s


@dataclass
class Estimate:
    settings: EstimateSettings
    units: list[UnitEstimate]
    outside_fwd_s: float
    outside_bwd_s: float
    update_s: float
    step_s: float
    est_samples_per_sec: float
    compute_s: float  # every FLOP at its throughput, units and outside
    transfer_s: float  # every weight and gradient byte over the link
    bound: str  # the largest of compute, memory, overhead, transfer, update, input, disk
    total_flops: int
    link_bytes: int  # 2 x weights fetched + gradients back
    host_bytes: int  # optimizer traffic in host RAM
    limit_s: float  # physical limit of one step (see the module docstring)
    limit_bound: str  # "compute" or the busiest link: "device link", "host memory"
    limit_samples_per_sec: float
    notes: list[str] = field(default_factory=list)
    memory_s: float = 0.0  # non-matmul operators, units and outside
    overhead_s: float = 0.0  # operators' fixed costs, streaming and loop bookkeeping
    input_s: float = 0.0
    ops: int = 0  # aten operators per step
    op_bytes: int = 0  # bytes the non-matmul operators move per step
    stream_call_s: float = 0.0  # the streamed call's own cost per step (weight streaming)
    disk_s: float = 0.0  # the disk store's file traffic a step at the disk's bandwidths

    @property
    def model_samples_per_sec(self) -> float:
        """What the model consumes when the input costs the training process nothing."""
        return self.settings.batch_size / (self.step_s - self.input_s)

    def fraction_of_limit(self, samples_per_sec: float) -> float:
        """A measured throughput as a fraction of the physical limit."""
        return samples_per_sec / self.limit_samples_per_sec

    def to_dict(self) -> dict:
        return asdict(self)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _transfer_bytes(u: UnitCost, transfer_dtype: str | None) -> tuple[int, int]:
    """(weight bytes per fetch, gradient bytes back) of one unit."""
    if transfer_dtype is None:
        return u.weight_bytes, u.trainable_bytes
    size = _itemsize(transfer_dtype)
    return u.numel * size, u.trainable_numel * size


def pass_work(
    flops: int,
    matmul: dict[int, int],
    attention: dict[int, int],
    mem: dict[str, dict[int, int]],
    ops: int,
    op_overhead_s: float,
    machine: MachineProfile,
    dtype: str,
) -> PassWork:
    """The work of one pass of one entry (see the module docstring)."""
    compute = 0.0
    rest = flops
    for n, f in matmul.items():
        compute += f / machine.matmul_throughput(int(n), dtype)
        rest -= f
    for n, f in attention.items():
        compute += f / machine.attention_throughput(int(n), dtype)
        rest -= f
    compute += max(rest, 0) / machine.peak_flops(dtype)
    memory = 0.0
    cold = machine.cold_op_throughput()  # a step's operands are not in cache (Note [in situ])
    for cls, by_size in mem.items():
        for nbytes, total in by_size.items():
            memory += total / min(machine.op_throughput(cls, int(nbytes)), cold)
    return PassWork(
        machine.in_situ_compute_factor(dtype) * compute,
        machine.in_situ_factor * memory,
        ops * op_overhead_s,
    )


def _entry_work(e: UnitCost, machine: MachineProfile, dtype: str) -> tuple[PassWork, PassWork]:
    fwd = pass_work(
        e.fwd_flops,
        e.fwd_matmul,
        e.fwd_attention,
        e.fwd_mem,
        e.fwd_ops,
        machine.op_overhead_fwd_s,
        machine,
        dtype,
    )
    bwd = pass_work(
        e.bwd_flops,
        e.bwd_matmul,
        e.bwd_attention,
        e.bwd_mem,
        e.bwd_ops,
        machine.op_overhead_bwd_s,
        machine,
        dtype,
    )
    return fwd, bwd


def estimate(costs: StepCosts, machine: MachineProfile, settings: EstimateSettings) -> Estimate:
    """Estimate one step of ``costs`` on ``machine`` (see the module docstring)."""
    dtype = settings.compute_dtype
    peak = machine.peak_flops(dtype)
    link_bw = machine.copy_bandwidth
    stream_bw = machine.stream_bandwidth or link_bw
    ram_bw = machine.host_memory_bandwidth
    ws = settings.weight_streaming
    overlap = settings.prefetch_depth >= 1
    upd = settings.update
    recompute = set(settings.recompute)
    units = []
    link_bytes = host_bytes = 0
    n = len(costs.units)
    transfers = []  # (forward fetch, backward fetch + gradients back) per unit, seconds
    for u in costs.units:
        weights, grads = _transfer_bytes(u, settings.transfer_dtype)
        if ws:
            link_bytes += 2 * weights + grads
        transfers.append((weights / stream_bw, (weights + grads) / stream_bw) if ws else (0.0, 0.0))
    for i, u in enumerate(costs.units):
        upd_bytes = u.trainable_numel * settings.optimizer_bytes_per_param
        host_bytes += upd_bytes
        fwd, bwd = _entry_work(u, machine, dtype)
        if u.index in recompute:  # activation checkpointing: the forward again
            bwd = PassWork(
                bwd.compute_s + fwd.compute_s,
                bwd.memory_s + fwd.memory_s,
                bwd.overhead_s + fwd.overhead_s,
            )
        ft, bt = transfers[i]
        if overlap:
            next_ft = transfers[i + 1][0] if i + 1 < n else 0.0
            next_bt = transfers[i - 1][1] if i > 0 else 0.0
            fs = max(fwd.work_s, next_ft) + (ft if i == 0 else 0.0)
            bs = max(bwd.work_s, next_bt) + (bt if i == n - 1 else 0.0)
        else:
            fs, bs = fwd.work_s + ft, bwd.work_s + bt
        if upd is not None:
            # Measured in its context (Note [update in context]): not scaled.
            update = u.trainable_tensors * upd.per_tensor_s + u.trainable_numel * upd.per_element_s
        else:
            update = upd_bytes / ram_bw
        sides = {
            "compute": fwd.compute_s + bwd.compute_s,
            "memory": fwd.memory_s + bwd.memory_s,
            "overhead": fwd.overhead_s + bwd.overhead_s,
            "transfer": ft + bt,
        }
        units.append(
            UnitEstimate(
                index=u.index,
                name=u.name,
                fwd_compute_s=fwd.compute_s,
                bwd_compute_s=bwd.compute_s,
                fwd_transfer_s=ft,
                bwd_transfer_s=bt,
                update_s=update,
                fwd_s=fs,
                bwd_s=bs,
                bound=max(sides.items(), key=lambda x: x[1])[0],
                fwd_memory_s=fwd.memory_s,
                bwd_memory_s=bwd.memory_s,
                fwd_overhead_s=fwd.overhead_s,
                bwd_overhead_s=bwd.overhead_s,
                stream_s=(
                    machine.unit_overhead_s + u.tensors * machine.param_overhead_s if ws else 0.0
                ),
            )
        )
    out_fwd, out_bwd = _entry_work(costs.outside, machine, dtype)
    fixed = upd.fixed_s if upd is not None else 0.0
    update = sum(e.update_s for e in units) + fixed
    call = machine.stream_call_s if ws and units else 0.0
    step = (
        sum(e.share_s for e in units)
        + call
        + out_fwd.work_s
        + out_bwd.work_s
        + update
        + settings.step_overhead_s
        + settings.input_s
    )
    disk = _disk_seconds(settings, machine)
    if disk > 0:  # Note [disk traffic in the estimate]
        forward = sum(e.fwd_s for e in units) + out_fwd.work_s + call
        floor = (0.0 if settings.forward_reads_disk else forward) + disk
        step = max(step, floor + settings.step_overhead_s + settings.input_s)
    compute = (
        sum(e.fwd_compute_s + e.bwd_compute_s for e in units)
        + out_fwd.compute_s
        + out_bwd.compute_s
    )
    memory = sum(e.fwd_memory_s + e.bwd_memory_s for e in units) + (
        out_fwd.memory_s + out_bwd.memory_s
    )
    overhead = (
        sum(e.fwd_overhead_s + e.bwd_overhead_s + e.stream_s for e in units)
        + call
        + out_fwd.overhead_s
        + out_bwd.overhead_s
        + settings.step_overhead_s
    )
    transfer = sum(e.fwd_transfer_s + e.bwd_transfer_s for e in units)
    sides = {
        "compute": compute,
        "memory": memory,
        "overhead": overhead,
        "transfer": transfer,
        "update": update,
        "input": settings.input_s,
        "disk": disk,
    }
    bound = max(sides.items(), key=lambda x: x[1])[0]

    notes = []
    if not costs.backward_measured:
        notes.append(f"backward FLOPs and operators are 2 x forward ({costs.backward_error})")
    if machine.quick:
        notes.append("the machine profile was measured with tiny sizes (quick=True)")
    if machine.other_load is not None and machine.other_load > 0.1:
        notes.append(
            f"other processes used {machine.other_load:.0%} of the CPUs while the machine "
            "profile was measured: its figures may be low (remeasure on a quiet machine)"
        )
    if settings.disk_read_bytes + settings.disk_write_bytes and not disk:
        notes.append(
            "the disk store's file traffic is not priced: the machine profile has no disk figures"
        )
    if upd is None:
        notes.append(
            f"the optimizer update is priced as {settings.optimizer_bytes_per_param} bytes per "
            "parameter over the host memory bandwidth (no measured update cost)"
        )
    op_bytes = costs.mem_bytes
    if machine.device_type == "cpu":
        # One memory for everything: a copy of n bytes reads n and writes n.
        links = {"host memory": (2 * link_bytes + host_bytes + op_bytes) / ram_bw}
    else:
        links = {"device link": link_bytes / link_bw, "host memory": host_bytes / ram_bw}
    limit_bound, limit = max([("compute", costs.flops / peak), *links.items()], key=lambda x: x[1])
    if step <= 0 or limit <= 0:
        raise ValueError(
            "the step has no measured cost (no FLOPs and no weights): nothing to estimate. "
            "Check that the model has parameters and the example batch reaches them."
        )
    return Estimate(
        settings=settings,
        units=units,
        outside_fwd_s=out_fwd.work_s,
        outside_bwd_s=out_bwd.work_s,
        update_s=update,
        step_s=step,
        est_samples_per_sec=settings.batch_size / step,
        compute_s=compute,
        transfer_s=transfer,
        bound=bound,
        total_flops=costs.flops,
        link_bytes=link_bytes,
        host_bytes=host_bytes,
        limit_s=limit,
        limit_bound=limit_bound,
        limit_samples_per_sec=settings.batch_size / limit,
        notes=notes,
        memory_s=memory,
        overhead_s=overhead,
        input_s=settings.input_s,
        ops=costs.ops,
        op_bytes=op_bytes,
        stream_call_s=call,
        disk_s=disk,
    )


def _disk_seconds(settings: EstimateSettings, machine: MachineProfile) -> float:
    """Seconds the disk store's files take a step at the profile's disk bandwidths; 0
    without traffic or without disk figures (Note [disk traffic in the estimate])."""
    read_bw, write_bw = machine.disk_read_bandwidth, machine.disk_write_bandwidth
    if not read_bw or not write_bw:
        return 0.0
    return settings.disk_read_bytes / read_bw + settings.disk_write_bytes / write_bw

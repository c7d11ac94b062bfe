"""Estimated step time and samples/sec of a weight-streaming run, before any step.

Inputs: the measured per-unit costs (``cost.py``), the machine profile
(``machine.py``) and the run settings. Per unit:

* compute: forward (backward) FLOPs / matmul peak of the compute dtype. The
  FLOPs are matmul-like operators only, so layers dominated by elementwise
  work (norms, embeddings) estimate near 0 s: the estimate is optimistic there.
* transfer: forward = weight bytes / copy bandwidth (the forward fetch);
  backward = (weight bytes + gradient bytes) / copy bandwidth (the backward
  fetch, and the gradients of trainable parameters going back to the host).
* the unit's share of the step: with prefetch_depth >= 1 the next unit's
  copy overlaps this unit's compute, so max(compute, transfer); with 0,
  compute + transfer.
* update: trainable parameters x optimizer bytes per parameter / host memory
  bandwidth. AdamW in fp32 streams 7 tensors of 4 bytes per parameter: it
  reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
  exp_avg_sq (28 bytes). The update runs after the backward (no overlap).

step = sum over units (forward share + backward share) + compute outside the
units (loss, root-level operators) + update; est. samples/sec = batch / step.

The physical limit (design.md, "Performance") is the larger of the compute
time (all FLOPs / peak) and the busiest link's time (bytes it moves / its
bandwidth): the device link carries 2 x weights + gradients, host RAM the
optimizer traffic. When the compute device is the CPU the link *is* host
RAM, so both traffics are added on that one link (a copy of n bytes moves 2n).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from weightstream.compiler.cost import StepCosts, UnitCost
from weightstream.compiler.machine import MachineProfile

ADAMW_FP32_BYTES_PER_PARAM = 7 * 4  # see the module docstring


@dataclass
class EstimateSettings:
    """The run settings the estimate depends on.

    Attributes:
        batch_size: samples per step (per rank).
        prefetch_depth: as ``StreamingConfig.prefetch_depth``; >= 1 overlaps copies.
        compute_dtype: dtype whose matmul peak prices the FLOPs.
        transfer_dtype: dtype the weights (and their gradients) cross the link
            in; None: the masters' own dtype (what the engine streams today).
        optimizer_bytes_per_param: host bytes read + written per trainable
            parameter by one optimizer update.
    """

    batch_size: int
    prefetch_depth: int = 1
    compute_dtype: str = "float32"
    transfer_dtype: str | None = None
    optimizer_bytes_per_param: int = ADAMW_FP32_BYTES_PER_PARAM

    def __post_init__(self) -> None:
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
    bound: str  # "compute" or "transfer": the larger side, summed over both passes


@dataclass
class Estimate:
    settings: EstimateSettings
    units: list[UnitEstimate]
    outside_fwd_s: float
    outside_bwd_s: float
    update_s: float
    step_s: float
    est_samples_per_sec: float
    compute_s: float  # every FLOP at peak, units and outside
    transfer_s: float  # every weight and gradient byte over the link
    bound: str  # "compute", "transfer" or "update": the largest of the three
    total_flops: int
    link_bytes: int  # 2 x weights fetched + gradients back
    host_bytes: int  # optimizer traffic in host RAM
    limit_s: float  # physical limit of one step (see the module docstring)
    limit_bound: str  # "compute" or the busiest link: "device link", "host memory"
    limit_samples_per_sec: float
    notes: list[str] = field(default_factory=list)

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


def estimate(costs: StepCosts, machine: MachineProfile, settings: EstimateSettings) -> Estimate:
    """Estimate one step of ``costs`` on ``machine`` (see the module docstring)."""
    peak = machine.peak_flops(settings.compute_dtype)
    link_bw = machine.copy_bandwidth
    ram_bw = machine.host_memory_bandwidth
    overlap = settings.prefetch_depth >= 1
    units = []
    link_bytes = host_bytes = 0
    for u in costs.units:
        weights, grads = _transfer_bytes(u, settings.transfer_dtype)
        link_bytes += 2 * weights + grads
        upd_bytes = u.trainable_numel * settings.optimizer_bytes_per_param
        host_bytes += upd_bytes
        fc, bc = u.fwd_flops / peak, u.bwd_flops / peak
        ft, bt = weights / link_bw, (weights + grads) / link_bw
        if overlap:
            fs, bs = max(fc, ft), max(bc, bt)
        else:
            fs, bs = fc + ft, bc + bt
        units.append(
            UnitEstimate(
                index=u.index,
                name=u.name,
                fwd_compute_s=fc,
                bwd_compute_s=bc,
                fwd_transfer_s=ft,
                bwd_transfer_s=bt,
                update_s=upd_bytes / ram_bw,
                fwd_s=fs,
                bwd_s=bs,
                bound="transfer" if ft + bt > fc + bc else "compute",
            )
        )
    outside_fwd = costs.outside.fwd_flops / peak
    outside_bwd = costs.outside.bwd_flops / peak
    update = sum(e.update_s for e in units)
    step = sum(e.fwd_s + e.bwd_s for e in units) + outside_fwd + outside_bwd + update
    compute = sum(e.fwd_compute_s + e.bwd_compute_s for e in units) + outside_fwd + outside_bwd
    transfer = sum(e.fwd_transfer_s + e.bwd_transfer_s for e in units)
    bound = max(
        ("compute", compute), ("transfer", transfer), ("update", update), key=lambda x: x[1]
    )[0]

    notes = []
    if not costs.backward_measured:
        notes.append(f"backward FLOPs are 2 x forward ({costs.backward_error})")
    if machine.quick:
        notes.append("the machine profile was measured with tiny sizes (quick=True)")
    if machine.device_type == "cpu":
        # One memory for both: a copy of n bytes reads n and writes n.
        links = {"host memory": (2 * link_bytes + host_bytes) / ram_bw}
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
        outside_fwd_s=outside_fwd,
        outside_bwd_s=outside_bwd,
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
    )

"""The host bytes of a run's training state and where they fit: ``--validate_only``'s verdict.

Note [host footprint]
---------------------
Host bytes per parameter decide whether a model trains on a machine at all
(design.md, "Bytes per parameter are the product's limit"). A run validated
with ``--validate_only`` reports them before anything is allocated, counted
from the tensors the run would hold, not from a table of bytes per setting:

* the masters: the parameters themselves, in ``runconfig.master_dtype``;
* the optimizer state: the run's optimizer constructed over the meta-device
  parameters allocates its state there as it would on the host (its
  ``preinitialize``: AdamW's moments in ``state_dtype``, int8 codes and their
  block scales, the Kahan buffer of bf16 masters; Notes [compact optimizer
  state] and [Kahan summation] in optim/compact.py), so the count is that of
  the allocation code itself;
* the gradients: one per trainable master, of its dtype, unless they pass
  from the backward to the update in memory (update_in_backward on one rank:
  Note [updates in backward]);
* the host mirror: each streamed parameter again in the compute dtype, where
  the engine keeps one (``mirror.host_mirror_of``) and the masters are not in
  that dtype already (Note [host mirror]).

Activations, the device copies of units in flight and the disk store's I/O
buffers are not training state; the budget the state is compared with leaves
room for them (``placement.default_budget``'s margin, the disk store's working
set). Where it goes:

* a RAM store: "RAM" when the total fits the host budget, else "neither";
* a disk store: as it would place it (``budgets.predicted_placement`` with
  these state sizes, Note [hybrid placement]): "RAM" when nothing goes to the
  files, "RAM + disk" when the files' part fits the free disk at
  ``store_dir``, else "neither".

"neither" comes with the fixes that reduce the bytes or add room, each with what it
would take (compact state: about its bytes, as this count gives them with bf16 masters
and int8 moments; a disk store: its files against the free disk at ``store_dir``) and
whether that fits this machine; those that fit come first.
tests/test_footprint.py checks the count against a real run's store.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from weightstream.common.units import format_bytes
from weightstream.runtime import placement as places
from weightstream.runtime.budgets import predicted_placement
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.mirror import host_mirror_of
from weightstream.runtime.partition import Plan

KINDS = {
    "master": "masters",
    "state": "optimizer state",
    "grad": "gradients",
    "mirror": "host mirror",
}


@dataclass
class HostFootprint:
    """A run's training state in host bytes, by kind, and where it goes (the Note)."""

    numel: int  # parameters (masters), trainable or not
    bytes: dict[str, int]  # by kind: master, state, grad, mirror
    store: str  # "ram" or "disk", as configured
    budget: int  # host bytes the state may take (host_memory_budget, else the default)
    ram_total: int | None
    ram_available: int | None
    store_dir: str | None = None
    disk_free: int | None = None
    placement: places.Placement | None = None  # a disk store's
    # A RAM store that does not fit: where a disk store would put it.
    as_disk_store: places.Placement | None = None
    # The settings of compact state not in use yet (Note [compact optimizer state]),
    # and about the bytes the state would take with all of them.
    compact: list[str] = dataclasses.field(default_factory=list)
    compact_total: int | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def per_parameter(self) -> float:
        return self.total / max(self.numel, 1)

    @property
    def ram_bytes(self) -> int:
        return self.total if self.placement is None else self.total - self.placement.disk_bytes

    @property
    def disk_bytes(self) -> int:
        return 0 if self.placement is None else self.placement.disk_bytes

    @property
    def where(self) -> str:
        """ "RAM", "RAM + disk" or "neither"."""
        if self.store == "ram":
            return "RAM" if self.total <= self.budget else "neither"
        if self.disk_bytes == 0:
            return "RAM"
        if self.disk_free is not None and self.disk_bytes > self.disk_free:
            return "neither"
        return "RAM + disk"

    def describe(self) -> str:
        """The report's lines: bytes per parameter by kind, the machine, the verdict."""
        n = max(self.numel, 1)
        kinds = " + ".join(
            f"{KINDS[k]} {v / n:.4g}" for k, v in self.bytes.items() if v
        )  # e.g. masters 4 + optimizer state 8 + gradients 4
        lines = [
            f"Host training state: {self.per_parameter:.4g} bytes a parameter ({kinds}) x "
            f"{self.numel:,} parameters = {format_bytes(self.total)} ({self.total:,} bytes)",
            f"Host: RAM {_size(self.ram_total)}, available {_size(self.ram_available)}, "
            f"budget for the state {format_bytes(self.budget)} ({self.budget:,} bytes)",
        ]
        if self.store == "disk":
            lines.append(
                f"Disk at the store's directory {self.store_dir}: {_size(self.disk_free)} free"
            )
        where = self.where
        split = ""
        if self.placement is not None:  # a disk store's: its RAM tier, then its files
            split = (
                f" (RAM {format_bytes(self.ram_bytes)}, {self.ram_bytes:,} bytes; "
                f"disk {format_bytes(self.disk_bytes)}, {self.disk_bytes:,} bytes)"
            )
        if where == "neither" and self.store == "ram":
            split = " (a RAM store: it exceeds the budget, and there is no disk tier)"
        lines.append(f"The state goes to: {where}{split if where != 'RAM' else ''}")
        if where == "neither":
            lines.append("Fix: " + self.fixes())
        return "\n".join(lines)

    def _verdict(self, total: int) -> tuple[bool, str]:
        """Whether a state of ``total`` bytes would fit, said as the report says it: in
        the budget (a RAM store), or its RAM tier as now and the rest in the free disk."""
        if self.store == "ram" or total <= self.budget:
            if total <= self.budget:
                return True, "fits the budget"
            return False, f"still more than the budget of {format_bytes(self.budget)}"
        disk = max(0, total - self.ram_bytes)
        if self.disk_free is None or disk <= self.disk_free:
            return True, f"about {format_bytes(disk)} of it on the disk"
        return False, (
            f"still about {format_bytes(disk)} for the disk, which has "
            f"{format_bytes(self.disk_free)} free"
        )

    def fixes(self) -> str:
        """What makes a state that fits neither fit (the Note), each with what it would
        take and whether that fits this machine, those that fit first."""
        fixes: list[tuple[bool, str]] = []
        if self.compact and self.compact_total is not None:
            fits, verdict = self._verdict(self.compact_total)
            per = self.compact_total / max(self.numel, 1)
            fixes.append(
                (
                    fits,
                    "compact state: " + " and ".join(self.compact) + f" (about {per:.3g} "
                    f"bytes a parameter, {format_bytes(self.compact_total)}: {verdict})",
                )
            )
        if self.store == "ram":
            disk = self.as_disk_store
            if disk is not None:
                room = self.disk_free
                fits = room is None or disk.disk_bytes <= room
                free = "" if room is None else f", where {format_bytes(room)} is free"
                fixes.append(
                    (
                        fits,
                        f"a disk store: runconfig.store: disk (its RAM tier would hold "
                        f"{format_bytes(disk.ram_bytes)} and its files "
                        f"{format_bytes(disk.disk_bytes)} under runconfig.store_dir{free}"
                        f"{'' if fits else ': too little'})",
                    )
                )
            else:
                fixes.append((True, "a disk store: runconfig.store: disk"))
        else:
            fixes.append(
                (True, f"a runconfig.store_dir on a disk with {format_bytes(self.disk_bytes)} free")
            )
        fixes.sort(key=lambda fix: not fix[0])  # stable: those that fit first
        fixes = [text for _, text in fixes]
        default = places.default_budget()
        if self.budget < default:
            fixes.append(
                f"a larger runconfig.host_memory_budget (without one: {format_bytes(default)}, "
                "the available RAM less 2 GiB and 10% of the machine's memory)"
            )
        fixes.append(
            "a smaller model (fewer or narrower layers: n_layer, d_model next to model.preset)"
        )
        return "; or ".join(fixes) + "."


def host_footprint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    config: StreamingConfig,
    device: torch.device,
    store_dir: str | None = None,
    device_tier: frozenset[int] = frozenset(),
) -> HostFootprint:
    """The training state of ``model`` (on the meta device or not) under ``config``,
    the streaming settings as configured (``store``, ``host_memory_budget``,
    ``compute_dtype``), with ``optimizer``'s state as constructed (the Note).
    ``device_tier``: the plan's units the device tier holds, out of a disk store's
    placement (their bytes count in the total on the CPU only, whose device memory is
    the host's)."""
    named = list(_unique(model.named_parameters()))
    numel = sum(p.numel() for _, p in named)  # every parameter: bytes a parameter of them
    if device.type != "cpu":  # the tier's units live in the accelerator's memory
        tiered = {id(p) for u in plan.units if u.index in device_tier for p in u.params}
        named = [(n, p) for n, p in named if id(p) not in tiered]
    state_bytes = _state_bytes(named, optimizer)
    grads_kept = not (config.update_in_backward and not _data_parallel(config))
    counted = {
        "master": sum(p.nbytes for _, p in named),
        "state": sum(sum(v) for v in state_bytes.values()),
        "grad": sum(p.nbytes for _, p in named if p.requires_grad) if grads_kept else 0,
        "mirror": _mirror_bytes(plan, config, device, device_tier),
    }
    budget = config.host_memory_budget
    if budget is None:
        budget = places.default_budget()
    found = HostFootprint(
        numel=numel,
        bytes=counted,
        store=config.store,
        budget=budget,
        ram_total=places.total_memory(),
        ram_available=places.available_memory(),
    )
    found.compact = _compact_settings(optimizer, [p for _, p in named])
    if found.compact:
        found.compact_total = _compact_total(
            named, optimizer, config, grads_kept, counted["mirror"]
        )
    found.store_dir = str(store_dir) if store_dir is not None else None
    found.disk_free = _free_disk(store_dir)
    if config.store == "disk":
        found.placement = predicted_placement(model, plan, config, device, state_bytes, device_tier)
    elif found.where == "neither":
        disk = dataclasses.replace(config, store="disk")
        found.as_disk_store = predicted_placement(
            model, plan, disk, device, state_bytes, device_tier
        )
    return found


def _compact_settings(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> list[str]:
    """The params-file settings that would hold this state in fewer bytes."""
    found = []
    state_dtype = getattr(optimizer, "state_dtype", None)  # the Adam family's
    if state_dtype == torch.float32:
        found.append(
            "optimizer: {state_dtype: bfloat16} (moments 4 bytes a parameter instead of 8) "
            "or {state_dtype: int8} (about 2)"
        )
    elif state_dtype == torch.bfloat16:
        found.append("optimizer: {state_dtype: int8} (moments about 2 bytes a parameter)")
    if any(p.dtype == torch.float32 for p in masters):
        found.append(
            "runconfig.master_dtype: bfloat16 (masters and gradients 2 bytes a parameter "
            "each instead of 4, plus a 2-byte Kahan buffer)"
        )
    return found


def _compact_total(
    named, optimizer: torch.optim.Optimizer, config, grads_kept: bool, mirror: int
) -> int:
    """About the bytes of the state with the settings :func:`_compact_settings` names:
    float32 masters (their gradients, their optimizer state of their dtype) in bfloat16,
    with a 2-byte Kahan buffer where the optimizer keeps one; the Adam family's moments
    in int8 (a byte each and a float32 scale per BLOCK); the host mirror gone where the
    compute dtype is bfloat16 (the masters are in it then)."""
    from weightstream.optim.compact import BLOCK

    int8 = getattr(optimizer, "state_dtype", None) is not None  # the Adam family's
    kahan = getattr(optimizer, "kahan_summation", False)
    total = 0
    for _, p in named:
        n = p.numel()
        width = 2 if p.is_floating_point() and p.element_size() >= 2 else p.element_size()
        total += n * width  # the master
        if not p.requires_grad:
            continue
        total += n * width if grads_kept else 0
        total += 2 * n if kahan and width == 2 else 0
        for key, t in optimizer.state.get(p, {}).items():
            if not torch.is_tensor(t) or key == "kahan_comp" or key.endswith("_scale"):
                continue  # counted above, or with their moment
            if tuple(t.shape) != tuple(p.shape):
                total += t.nbytes  # a step count, a factored second moment...
            elif int8:
                total += n + 4 * -(-n // BLOCK)
            else:
                total += n * width
    # bf16 masters are their own mirror under a bf16 compute dtype, and stream as they
    # are without one; a float16 compute dtype keeps its mirror of them.
    return total + (mirror if config.compute_dtype == torch.float16 else 0)


def _unique(named):
    seen = set()
    for name, p in named:
        if id(p) not in seen:  # a tied weight is one master
            seen.add(id(p))
            yield name, p


def _data_parallel(config: StreamingConfig) -> bool:
    from weightstream.runtime import swarm

    return config.data_parallel and swarm.world_size() > 1


def _mirror_bytes(
    plan: Plan, config: StreamingConfig, device: torch.device, device_tier=frozenset()
) -> int:
    """The host mirror's bytes: the streamed parameters in the compute dtype, where the
    masters are not in it already (Note [host mirror]); the device tier's units do not
    stream."""
    sharding = config.store_sharding or ("sharded" if device.type == "cpu" else "replicated")
    sharded = _data_parallel(config) and sharding == "sharded"
    wanted, blocked = host_mirror_of(config, device, config.store == "disk", sharded)
    compute = config.compute_dtype
    if not wanted or blocked or not isinstance(compute, torch.dtype):
        return 0
    streamed = {id(p): p for u in plan.units if u.index not in device_tier for p in u.params}
    return sum(p.numel() * compute.itemsize for p in streamed.values() if p.dtype != compute)


def _free_disk(directory: str | None) -> int | None:
    """Free bytes on the file system of ``directory`` (its nearest existing parent)."""
    if directory is None:
        return None
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: int | None) -> str:
    return "unknown" if n is None else f"{format_bytes(n)} ({n:,} bytes)"


def _state_bytes(named, optimizer: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Per parameter name, the bytes of each tensor of ``optimizer``'s state for it."""
    return {
        name: [t.nbytes for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)]
        for name, p in named
    }


def resident_footprint(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[bool, str]:
    """Layer pipelined: (whether the training state fits, one line for the log). Masters,
    gradients and optimizer state all stay on ``device`` (its memory: the host's on the
    CPU), counted as :func:`host_footprint` counts them, and against the whole of that
    memory: nothing can go elsewhere. Where that memory is not known here, it fits."""
    named = list(_unique(model.named_parameters()))
    masters = sum(p.nbytes for _, p in named)
    grads = sum(p.nbytes for _, p in named if p.requires_grad)
    state = sum(map(sum, _state_bytes(named, optimizer).values()))
    total = masters + grads + state
    if device.type == "cpu":
        room, where = places.available_memory(), "this host's available RAM"
    elif device.type == "cuda" and torch.cuda.is_available():
        room, where = torch.cuda.mem_get_info(device)[1], f"{device}'s memory"
    else:
        room, where = None, f"{device}'s memory (not measured here)"
    numel = sum(p.numel() for _, p in named) or 1
    line = (
        f"Training state (layer pipelined, all on {device}): {format_bytes(total)} "
        f"({total / numel:.1f} bytes a parameter: masters {format_bytes(masters)}, gradients "
        f"{format_bytes(grads)}, optimizer state {format_bytes(state)}), before activations"
    )
    if room is None:
        return True, f"{line}; {where}."
    if total <= room:
        return True, f"{line}; fits {where} ({format_bytes(room)})."
    return False, (
        f"{line}: more than {where} ({format_bytes(room)}). Fix: weight streaming "
        "(runconfig.execution_mode: weight_streaming), whose store keeps the state in host "
        "RAM or on disk; or compact state (optimizer: {state_dtype: bfloat16}, "
        "runconfig.master_dtype: bfloat16)."
    )

"""What a streaming plan needs of the device's and the host's memory, checked before any
step, and where a disk store would place the training state: decided from the plan and
the settings alone, before (or without) a store (Notes [disk tier], [hybrid placement]).
"""

from __future__ import annotations

import torch
from torch import nn

from weightstream.common.units import format_bytes
from weightstream.runtime import swarm
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.partition import Plan
from weightstream.runtime.placement import Placement, PlacementPlan, default_budget


def check_budget(plan: Plan, config: StreamingConfig, device: torch.device) -> None:
    """Fail before any step when the plan cannot fit the device memory budget."""
    _check_host_budget(plan, config, device)
    budget = config.device_memory_budget
    if budget is None:
        return
    for u in plan.units:
        if u.weight_bytes > budget:
            raise ValueError(
                f"streaming unit {u.display_name!r} ({type(u.module).__name__}) holds "
                f"{u.weight_bytes:,} bytes ({format_bytes(u.weight_bytes)}) of weights, more than "
                f"the device memory budget of {budget:,} bytes ({format_bytes(budget)}). Split it "
                "into smaller units (granularity='module', or name its submodules in "
                "unit_modules) or raise device_memory_budget."
            )
    need = plan.weight_bound(config.prefetch_depth)
    if need > budget:
        raise ValueError(
            f"the streaming plan needs up to {need:,} bytes of device memory for weights "
            f"((prefetch_depth {config.prefetch_depth} + 1) x largest unit "
            f"{plan.largest_unit_bytes:,} + pinned units {plan.pinned_bytes:,}), more than the "
            f"device memory budget of {budget:,} bytes. Lower prefetch_depth, use smaller "
            "units, or raise device_memory_budget."
        )


# Store bytes touched by one unit's update, per byte of its weights: the master,
# its gradient and two optimizer moments (Adam), the most of any built-in optimizer
# but AMSGrad and Adafactor's factored statistics, which are smaller.
UPDATE_BYTES_PER_WEIGHT_BYTE = 4


def _held_in_host_memory(config: StreamingConfig, device: torch.device) -> tuple[int, int]:
    """Units of host memory the disk store's working set counts beside its I/O buffers:
    device copies (the CPU's are host memory) and gradients held (one on its way to the
    store on the CPU; two for their updates under update_in_backward, any device)."""
    cpu = device.type == "cpu"
    return config.prefetch_depth + 1 if cpu else 0, 2 if config.update_in_backward else int(cpu)


def _updates_buffered(config: StreamingConfig) -> int:
    """Units' updates the I/O buffers hold: two when the next share reads ahead (Note
    [updates in backward])."""
    return 2 if config.update_in_backward else 1


def disk_working_set(plan: Plan, config: StreamingConfig, device: torch.device) -> int:
    """The most host memory the disk store's files are resident in at once: (prefetch_depth
    + 1) units in flight plus one unit's update (Note [disk tier]). On the CPU the units'
    device copies (as many again) and one unit's gradients on their way to the store are
    host memory too, and count. Under update_in_backward two units' gradients are held
    in memory for their updates, on any device (Note [updates in backward])."""
    copies, grads = _held_in_host_memory(config, device)
    return disk_io_set(plan, config) + (copies + grads) * plan.largest_unit_bytes


def ram_tier_of(plan: Plan, config: StreamingConfig, device: torch.device) -> tuple[int, bool]:
    """The disk store's RAM tier (``host_memory_budget`` less the working set; Note
    [hybrid placement]) and whether gradients go to the update in memory, not to the
    store (update_in_backward on one rank)."""
    budget = config.host_memory_budget
    if budget is None:
        budget = default_budget()
    data_parallel = config.data_parallel and swarm.world_size() > 1
    grads_to_update = config.update_in_backward and not data_parallel
    return budget - disk_working_set(plan, config, device), grads_to_update


def predicted_placement(
    module: nn.Module,
    plan: Plan,
    config: StreamingConfig,
    device: torch.device,
    state_bytes: dict[str, list[int]] | None = None,
    device_tier: frozenset[int] = frozenset(),
) -> Placement:
    """Where a disk store under ``config`` would place ``module``'s training state, as
    the store decides it when it takes the module (``PlacementPlan``), without one.
    ``state_bytes``: each parameter's optimizer state tensors by name (default: AdamW's
    two of the parameter's size). ``device_tier``: the plan's units in the device tier,
    whose state the store does not hold (Note [device tier] in runtime/placement.py)."""
    ram_tier, grads_to_update = ram_tier_of(plan, config, device)
    tiered = {id(p) for u in plan.units if u.index in device_tier for p in u.params}
    named = [(n, p) for n, p in module.named_parameters() if id(p) not in tiered]
    sizes = {name: p.numel() * p.element_size() for name, p in named}
    if state_bytes is not None:
        state_bytes = {name: v for name, v in state_bytes.items() if name in sizes}
    places = PlacementPlan(sizes, ram_tier, grads=not grads_to_update, state_bytes=state_bytes)
    return places.predicted


def disk_io_set(plan: Plan, config: StreamingConfig) -> int:
    """The disk store's own part of it, its explicit I/O buffers (Note [explicit disk
    I/O]): (prefetch_depth + 1) units in flight plus one unit's update, two under
    update_in_backward (the next share reads ahead: Note [updates in backward])."""
    updates = _updates_buffered(config)
    return (
        config.prefetch_depth + 1 + updates * UPDATE_BYTES_PER_WEIGHT_BYTE
    ) * plan.largest_unit_bytes


def _check_host_budget(plan: Plan, config: StreamingConfig, device: torch.device) -> None:
    """The disk store's resident pages must fit ``host_memory_budget`` (Note [disk tier])."""
    budget = config.host_memory_budget
    if budget is None or config.store != "disk":
        return
    largest = plan.largest_unit_bytes
    need = disk_working_set(plan, config, device)
    if need > budget:
        copies, held = _held_in_host_memory(config, device)
        terms = " and as many device copies" if copies else ""
        terms += f" + gradients of {held} unit(s)" if held else ""
        updates = _updates_buffered(config)
        terms += f" + {updates} units' updates" if updates > 1 else " + one unit's update"
        raise ValueError(
            f"the disk store needs up to {need:,} bytes of host memory "
            f"((prefetch_depth {config.prefetch_depth} + 1) units in flight{terms} "
            f"at {UPDATE_BYTES_PER_WEIGHT_BYTE}x its weights, largest unit "
            f"{largest:,} bytes), more than host_memory_budget {budget:,} bytes "
            f"({format_bytes(budget)}). Use smaller units (unit_size_target), lower "
            "prefetch_depth, or raise host_memory_budget."
        )

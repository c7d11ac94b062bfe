"""Settings of the weight-streaming runtime, validated where they are made."""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass
from typing import Any, Literal

import torch

from weightstream.common.schema import (
    check,
    init_names,
    known_keys,
    params_names,
    setting,
)

_BYTES = "use a positive number of bytes"


@dataclass
class StreamingConfig:
    """How a model is split into streaming units, moved and stored.

    The params file's runconfig section sets these settings by name (those with
    ``in_params``); ``cstorch.compile`` takes them as keyword arguments. Each
    field's ``doc`` says what it does (``docs/params.md`` is generated from them).
    """

    prefetch_depth: int = setting(
        1,
        ge=0,
        doc="How many units ahead (forward) or behind (backward) are copied to the "
        "device while the current one computes; 0 copies each unit when it is needed.",
    )
    granularity: Literal["auto", "module"] = setting(
        "auto",
        doc="'auto' merges the modules that own parameters along the module tree into "
        "blocks of at most unit_size_target bytes (a transformer block becomes one unit); "
        "'module' makes every module that directly owns parameters its own unit.",
    )
    unit_size_target: int = setting(
        64 * 2**20, ge=1, fix=_BYTES, doc="The merge limit of 'auto', in bytes of weights."
    )
    unit_modules: list[str] | tuple[str, ...] | None = setting(
        None,
        doc="Qualified module names (as in model.named_modules()) that each become one "
        "unit with everything below them, whatever the granularity.",
    )
    unit_classes: tuple | list | None = setting(
        None,
        in_params=False,
        doc="Module classes (or class names) whose instances each become one unit with "
        "everything below them (the run command sets a Hugging Face model's decoder layer).",
    )
    device_memory_budget: int | None = setting(
        None,
        ge=1,
        fix=_BYTES,
        doc="Bytes of device memory that streamed weights may use; compile fails, before "
        "any step, if the plan needs more.",
    )
    device_tier_budget: int | Literal["auto"] | None = setting(
        None,
        ge=0,
        fix=f"{_BYTES}, or 'auto'",
        doc="Bytes of compute-device memory for the device tier: whole units whose masters, "
        "gradients and optimizer state stay on the device, are updated there and are never "
        "streamed, chosen to move the fewest bytes a step (Note [device tier] in "
        "runtime/placement.py). 'auto': what an accelerator has left after the first step "
        "(its peak), placed before the second (on the CPU nothing). None or 0: every unit "
        "streams. On the CPU the device is host memory: such units compute on their masters "
        "without a copy, and their bytes come on top of host_memory_budget (the store's "
        "RAM tier). Under data parallel every rank holds the same units, also with a "
        "sharded store ('auto': the least room over the ranks).",
    )
    compute_dtype: Any = setting(
        None,
        in_params=False,
        doc="The dtype floating-point weights are cast to on their way to the device "
        "('bfloat16', 'float16', 'cbfloat16', a torch dtype, or None for each parameter's "
        "own). The store keeps the masters in their own dtype (normally fp32) and "
        "accumulates gradients there in that dtype; cbfloat16 weights travel as float32 "
        "holding cbfloat16 values. The run command takes it from model.mixed_precision "
        "and model.fp16_type.",
    )
    overlap_updates: bool = setting(
        False,
        doc="Apply the optimizer step unit by unit in the background, behind the next "
        "forward, which waits per unit (Note [overlapped updates] in runtime/updater.py). "
        "p.grad is None right after step() in this mode, and a parameter holds its new "
        "value only once the next forward fetched it or optimizer.synchronize() returned: "
        "call that before reading or writing weights between steps (an in-place write "
        "before it stops the step with an error where the unit's update has not begun; "
        "one racing an update under way is not caught).",
    )
    update_in_backward: bool = setting(
        False,
        doc="Start each unit's share of the optimizer step during the backward, as soon as "
        "its gradients are final, on the update worker, when the step code knows that "
        "nothing global comes between (amp.optimizer_step or the run command, without "
        "gradient clipping or loss scaling, on one rank); otherwise the step runs as "
        "without it (Note [updates in backward] in runtime/updater.py). Exact. p.grad is "
        "None right after the backward's units handed their gradients over. With a disk "
        "store the gradients then go to the update in memory, never to the files: about "
        "half the disk traffic of a step.",
    )
    activation_checkpointing: bool = setting(
        False,
        doc="Keep only each streaming unit's inputs from the forward and recompute the "
        "unit's forward inside its backward, its weights fetched once more (as the "
        "backward fetches them anyway): activation memory drops to the units' inputs plus "
        "one unit's activations, for one more forward's compute. Exact: dropout draws the "
        "same numbers again. A unit whose forward encloses other units (a root that owns "
        "the embedding) keeps its own activations. Layer pipelined applies it to the same "
        "units (Note [activation checkpointing] in runtime/recompute.py).",
    )
    activation_offload: bool = setting(
        False,
        doc="Move each tensor of at least 1 MiB that the forward saves for the backward "
        "(not a streamed weight) to page-locked host memory while the forward runs, and "
        "bring it back, ahead of need, in the backward: device activation memory drops to "
        "the units still computing (with activation_checkpointing: the units' inputs go to "
        "the host too). Exact. The reference's activation servers (max_act_per_csx). Only "
        "useful on an accelerator (Note [activation offload] in runtime/offload.py).",
    )
    host_mirror: bool | None = setting(
        None,
        doc="Keep each streamed unit's weights also as one flat host buffer in their "
        "compute dtype (pinned on accelerators), written by the update or once per forward "
        "pass, and copy "
        "that buffer to the device: one asynchronous copy of 2 bytes a parameter in bf16 "
        "instead of a cast per tensor from pageable fp32 (Note [host mirror] in "
        "runtime/mirror.py). Costs host memory of the weights in the compute dtype. "
        "null: on for accelerators, off on the CPU (where both move the same bytes). Not "
        "used with a sharded or disk store, or cbfloat16.",
    )
    store: Literal["ram", "disk"] = setting(
        "ram",
        doc="Where the store keeps masters, gradients and optimizer state: 'ram' "
        "(ordinary host memory) or 'disk' (files under store_dir, for models larger than "
        "RAM; Note [disk tier] in runtime/store.py). With 'disk' the optimizer step runs "
        "unit by unit and p.grad is None right after step().",
    )
    store_dir: str | os.PathLike | None = setting(
        None,
        doc="The directory of the disk store's files (the Python API's default: a new "
        "temporary directory; the run command's: model_dir/store). The files are "
        "unlinked once open, and a directory the store made is removed when it closes. "
        "The first run on a disk also writes a file of up to 256 MiB there, a quarter of "
        "the free space at most, to measure the disk for the compile estimate.",
    )
    host_memory_budget: int | None = setting(
        None,
        ge=1,
        fix=_BYTES,
        doc="Bytes of host memory the disk store may use: it needs (prefetch_depth + 1) "
        "units in flight plus one unit's update (master, gradient and two optimizer "
        "moments) of the largest unit (on the CPU also the units' device copies and a "
        "unit's gradients), and compile fails, before any step, if the budget is smaller; the rest is its RAM tier, which keeps masters, then optimizer state, "
        "then gradients in ordinary memory (Note [hybrid placement] in "
        "runtime/placement.py). None: the memory available when the store is built less "
        "2 GiB and 10% of the machine's memory.",
    )
    store_sharding: Literal["replicated", "sharded"] | None = setting(
        None,
        doc="With data parallel (more than one rank): 'replicated' keeps every master "
        "and all optimizer state on every rank; 'sharded' gives each streaming unit one "
        "owner rank that alone keeps its masters and optimizer state, broadcasts its "
        "weights and runs its update (Note [sharded store] in runtime/sharding.py). None: "
        "sharded on the CPU, as the reference's MemoryX, and replicated on accelerators, "
        "where a sharded store saves host memory but its fetches add a host broadcast "
        "and skip the host mirror. With one rank all are the same.",
    )
    num_wgt_servers: int | None = setting(
        None,
        ge=1,
        fix="give a number of ranks",
        aliases=("max_wgt_servers", "weight_servers"),
        doc="How many ranks own units of a sharded store (ranks 0 .. num_wgt_servers-1); "
        "more than the ranks means every rank. null: max_wgt_servers of configure() "
        "(24 unless set), the reference's bound on its weight servers.",
    )
    reduce_bucket_bytes: int = setting(
        4 * 2**20,
        ge=0,
        fix="use a number of bytes >= 0 (0: one collective per unit)",
        doc="Under data parallel, neighbouring streaming units share one gradient "
        "collective until it holds this many bytes (a larger unit has its own); 0: one "
        "collective per unit (Note [swarm reduce] in runtime/swarm.py).",
    )
    data_parallel: bool = setting(
        True,
        in_params=False,
        doc="Under torch.distributed with more than one rank, join them (rank 0's "
        "weights broadcast, gradients reduced in the backward, the store sharded if so "
        "configured). False: this model is this rank's alone (a measurement, a local "
        "evaluation copy).",
    )
    init_weights: bool = setting(
        True,
        in_params=False,
        doc="Draw the initial values of a meta-device model's parameters when the store "
        "materializes it (the model's rule: init_module, reset_parameters(), "
        "transformers' _init_weights). False: leave them at zero for a checkpoint to fill "
        "(a warm start); the first call then refuses to run while any was never loaded.",
    )
    section: InitVar[str] = ""

    def __post_init__(self, section: str) -> None:
        s = f"{section}." if section else ""
        check(self, section, skip=("compute_dtype", "unit_classes"))
        if self.store != "disk" and (self.store_dir is not None or self.host_memory_budget):
            fix = "store: disk" if section else "store='disk'"  # a params file, or Python
            raise ValueError(
                f"{s}store_dir and {s}host_memory_budget configure the disk store, but "
                f"{s}store is {self.store!r}. Fix: set {fix}, or remove them."
            )
        self.compute_dtype = _resolve_compute_dtype(self.compute_dtype)
        if self.unit_classes is not None:
            for c in self.unit_classes:
                if not (
                    isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))
                ):
                    raise TypeError(
                        f"unit_classes entries must be nn.Module subclasses or class names, "
                        f"got {c!r}."
                    )

    @classmethod
    def from_kwargs(cls, section: str = "", **kwargs: Any) -> StreamingConfig:
        """The settings given by name, an alias (``weight_servers``) for its setting;
        an unknown name is refused with the nearest valid ones."""
        values = known_keys(section or "StreamingConfig", cls, kwargs, init_names(cls))
        return cls(**values, section=section)

    def params_values(self) -> dict[str, Any]:
        """The settings a params file may set, by name (the runconfig's keys)."""
        return {name: getattr(self, name) for name in params_names(type(self))}


_COMPUTE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "cbfloat16": "cbfloat16",
    "cb16": "cbfloat16",
}


def _resolve_compute_dtype(value):
    """None, a torch floating dtype, or the string "cbfloat16"."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    if getattr(value, "name", None) == "cbfloat16":  # the amp.cbfloat16 object
        return "cbfloat16"
    if isinstance(value, str) and value.lower() in _COMPUTE_DTYPES:
        return _COMPUTE_DTYPES[value.lower()]
    raise ValueError(
        f"compute_dtype must be None, a floating torch dtype or one of "
        f"{', '.join(sorted(_COMPUTE_DTYPES))}; got {value!r}."
    )

"""Settings of the weight-streaming runtime, validated where they are made."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GRANULARITIES = ("auto", "module")
STORES = ("ram", "disk")
STORE_SHARDINGS = ("replicated", "sharded")


@dataclass
class StreamingConfig:
    """How a model is split into streaming units and how they are moved.

    Attributes:
        prefetch_depth: how many units ahead (forward) or behind (backward) are
            copied to the device while the current one computes. 0 copies each
            unit synchronously when it is needed.
        granularity: ``"auto"`` merges the modules that own parameters along the
            module tree into blocks of at most ``unit_size_target`` bytes (a
            transformer block becomes one unit); ``"module"`` makes every module
            that directly owns parameters its own unit.
        unit_size_target: the merge limit of ``"auto"``, in bytes of weights.
        unit_modules: qualified module names (as in ``model.named_modules()``)
            that each become one unit with everything below them. Overrides the
            granularity for those subtrees.
        unit_classes: module classes (or class names) whose instances each
            become one unit with everything below them.
        device_memory_budget: bytes of device memory that streamed weights may
            use. Compile fails, before any step, if the plan needs more.
        compute_dtype: the dtype floating-point weights are cast to on their way
            to the device ("bfloat16", "float16", "cbfloat16", a torch dtype, or
            None to stream each parameter in its own dtype). The store keeps the
            masters in their own dtype (normally fp32) and gradients are
            accumulated there in that dtype. cbfloat16 has no torch dtype: its
            weights travel as float32 holding cbfloat16 values.
        overlap_updates: apply a weightstream optimizer's step unit by unit in
            the background, behind the next forward, which waits per unit
            (Note [overlapped updates] in runtime/updater.py). ``p.grad`` is None
            right after ``step()`` in this mode.
        store: where the store keeps masters, gradients and optimizer state:
            ``"ram"`` (ordinary host memory) or ``"disk"`` (memory-mapped files
            under ``store_dir``, for models larger than RAM; Note [disk tier] in
            runtime/store.py). With ``"disk"`` the optimizer step runs unit by
            unit and ``p.grad`` is None right after ``step()``.
        store_dir: the directory of the disk store's files (default: a new
            temporary directory). The files are unlinked once mapped.
        host_memory_budget: bytes of host memory the disk store may use: its
            files' resident pages need at most (prefetch_depth + 1) units in
            flight plus one unit's update (master, gradient and two optimizer
            moments) of the largest unit, and compile fails, before any step, if
            the budget is smaller; the rest is its RAM tier, which keeps masters,
            then optimizer state, then gradients in ordinary memory (Note [hybrid
            placement] in runtime/placement.py). None: the memory available when
            the store is built less 2 GiB and 10% of the machine's memory.
        store_sharding: with data parallel (torch.distributed initialized, more
            than one rank), ``"replicated"`` keeps every master and all optimizer
            state on every rank; ``"sharded"`` gives each streaming unit one owner
            rank that alone keeps its masters and optimizer state, broadcasts its
            weights and runs its update (Note [sharded store] in
            runtime/sharding.py). With one rank both are the same.
        weight_servers: how many ranks own units of a sharded store (ranks
            0 .. weight_servers-1); None: every rank. More than the world size
            means every rank.
        reduce_bucket_bytes: under data parallel, neighbouring streaming units
            share one gradient collective until it holds this many bytes (a
            larger unit has its own); 0: one collective per unit (Note [swarm
            reduce] in runtime/swarm.py).
        init_weights: draw the initial values of a meta-device model's parameters
            when the store materializes it (the model's rule: ``init_module``,
            ``reset_parameters()``, transformers' ``_init_weights``). False: leave
            them at zero for a checkpoint to fill (a warm start); the first call
            then refuses to run while any of them was never loaded.
        data_parallel: under torch.distributed with more than one rank, join
            them (rank 0's weights broadcast, gradients reduced in the backward,
            the store sharded if so configured). False: this model is this
            rank's alone (a measurement, a local evaluation copy).
    """

    prefetch_depth: int = 1
    granularity: str = "auto"
    unit_size_target: int = 64 * 2**20
    unit_modules: list[str] | tuple[str, ...] | None = None
    unit_classes: tuple | list | None = None
    device_memory_budget: int | None = None
    compute_dtype: str | torch.dtype | None = None
    overlap_updates: bool = False
    store: str = "ram"
    store_dir: str | None = None
    host_memory_budget: int | None = None
    store_sharding: str = "replicated"
    weight_servers: int | None = None
    data_parallel: bool = True
    init_weights: bool = True
    reduce_bucket_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if (
            isinstance(self.reduce_bucket_bytes, bool)
            or not isinstance(self.reduce_bucket_bytes, int)
            or self.reduce_bucket_bytes < 0
        ):
            raise ValueError(
                "reduce_bucket_bytes must be a number of bytes >= 0 (0: one collective per "
                f"unit), got {self.reduce_bucket_bytes!r}."
            )
        if not isinstance(self.init_weights, bool):
            raise TypeError(f"init_weights must be a bool, got {self.init_weights!r}.")
        if not isinstance(self.data_parallel, bool):
            raise TypeError(f"data_parallel must be a bool, got {self.data_parallel!r}.")
        if self.store_sharding not in STORE_SHARDINGS:
            raise ValueError(
                f"store_sharding must be one of {', '.join(map(repr, STORE_SHARDINGS))}, "
                f"got {self.store_sharding!r}."
            )
        if self.weight_servers is not None and (
            isinstance(self.weight_servers, bool)
            or not isinstance(self.weight_servers, int)
            or self.weight_servers <= 0
        ):
            raise ValueError(
                f"weight_servers must be a positive number of ranks or None (every rank), "
                f"got {self.weight_servers!r}."
            )
        if self.store not in STORES:
            raise ValueError(
                f"store must be one of {', '.join(map(repr, STORES))}, got {self.store!r}."
            )
        if self.store != "disk" and (self.store_dir is not None or self.host_memory_budget):
            raise ValueError(
                "store_dir and host_memory_budget configure the disk store; set store='disk' "
                "to use them, or remove them."
            )
        if self.store_dir is not None and not isinstance(self.store_dir, (str, os.PathLike)):
            raise TypeError(f"store_dir must be a directory path, got {self.store_dir!r}.")
        if self.host_memory_budget is not None and (
            isinstance(self.host_memory_budget, bool)
            or not isinstance(self.host_memory_budget, int)
            or self.host_memory_budget <= 0
        ):
            raise ValueError(
                "host_memory_budget must be a positive number of bytes or None, "
                f"got {self.host_memory_budget!r}."
            )
        self.compute_dtype = _resolve_compute_dtype(self.compute_dtype)
        if not isinstance(self.overlap_updates, bool):
            raise TypeError(f"overlap_updates must be a bool, got {self.overlap_updates!r}.")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int):
            raise TypeError(
                f"prefetch_depth must be an int >= 0, got {type(self.prefetch_depth).__name__}."
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}.")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, "
                f"got {self.granularity!r}."
            )
        if not isinstance(self.unit_size_target, int) or self.unit_size_target <= 0:
            raise ValueError(
                f"unit_size_target must be a positive number of bytes, got {self.unit_size_target!r}."
            )
        if self.unit_modules is not None and (
            isinstance(self.unit_modules, str)
            or not all(isinstance(n, str) for n in self.unit_modules)
        ):
            raise TypeError("unit_modules must be a list of qualified module names (strings).")
        if self.unit_classes is not None:
            for c in self.unit_classes:
                if not (
                    isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))
                ):
                    raise TypeError(
                        f"unit_classes entries must be nn.Module subclasses or class names, got {c!r}."
                    )
        if self.device_memory_budget is not None and (
            not isinstance(self.device_memory_budget, int) or self.device_memory_budget <= 0
        ):
            raise ValueError(
                "device_memory_budget must be a positive number of bytes or None, "
                f"got {self.device_memory_budget!r}."
            )


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

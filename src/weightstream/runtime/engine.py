"""The weight-streaming execution of one module: plan at the first call, then stream."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils import _pytree as pytree

from weightstream.compiler.partition import Plan, build_plan
from weightstream.compiler.trace import trace_forward
from weightstream.runtime import swarm
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.device import DeviceOps
from weightstream.runtime.sharding import ShardedStore
from weightstream.runtime.store import DiskStore
from weightstream.runtime.streamer import Streamer
from weightstream.runtime.updater import UnitUpdater


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def check_budget(plan: Plan, config: StreamingConfig) -> None:
    """Fail before any step when the plan cannot fit the device memory budget."""
    _check_host_budget(plan, config)
    budget = config.device_memory_budget
    if budget is None:
        return
    for u in plan.units:
        if u.weight_bytes > budget:
            raise ValueError(
                f"streaming unit {u.display_name!r} ({type(u.module).__name__}) holds "
                f"{u.weight_bytes:,} bytes ({_fmt_bytes(u.weight_bytes)}) of weights, more than "
                f"the device memory budget of {budget:,} bytes ({_fmt_bytes(budget)}). Split it "
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


def _check_host_budget(plan: Plan, config: StreamingConfig) -> None:
    """The disk store's resident pages must fit ``host_memory_budget`` (Note [disk tier])."""
    budget = config.host_memory_budget
    if budget is None or config.store != "disk":
        return
    largest = plan.largest_unit_bytes
    need = (config.prefetch_depth + 1 + UPDATE_BYTES_PER_WEIGHT_BYTE) * largest
    if need > budget:
        raise ValueError(
            f"the disk store needs up to {need:,} bytes of host memory "
            f"((prefetch_depth {config.prefetch_depth} + 1) units in flight + one unit's "
            f"update at {UPDATE_BYTES_PER_WEIGHT_BYTE}x its weights, largest unit "
            f"{largest:,} bytes), more than host_memory_budget {budget:,} bytes "
            f"({_fmt_bytes(budget)}). Use smaller units (unit_size_target), lower "
            "prefetch_depth, or raise host_memory_budget."
        )


class StreamingEngine:
    """Runs a module in weight-streaming mode on ``device``.

    The module's parameters stay on the host as the masters (the store); the
    engine installs hooks that stream them to the device around each unit.
    """

    def __init__(self, module: nn.Module, device: torch.device, config: StreamingConfig):
        self.module = module
        self.device = torch.device(device)
        self.config = config
        self.ops = DeviceOps(self.device)
        self.plan: Plan = build_plan(module, config)  # structural; refined at the first call
        check_budget(self.plan, config)
        self.streamer: Streamer | None = None
        self.updater: UnitUpdater | None = None
        self.store: DiskStore | None = None
        self.shards: ShardedStore | None = None
        _place(module, self.device)
        if config.store == "disk":
            self.store = DiskStore(config.store_dir)
            self.store.take_module(module)

    def _compile(self, args: tuple, kwargs: dict) -> None:
        """Trace the real batch shape on the meta device and fix the plan."""
        try:
            trace = trace_forward(self.module, args, kwargs)
        except Exception as exc:
            warnings.warn(
                "weightstream: could not trace the model on the meta device "
                f"({type(exc).__name__}: {exc}); using a plan built from the module structure. "
                "Parameters read outside their own module's forward will not be streamed.",
                stacklevel=3,
            )
            plan = build_plan(self.module, self.config)
            plan.trace_error = f"{type(exc).__name__}: {exc}"
        else:
            plan = build_plan(self.module, self.config, trace)
        check_budget(plan, self.config)
        self.plan = plan
        if self.config.store_sharding == "sharded" and swarm.world_size() > 1:
            if self.device.type != "cpu":
                raise ValueError(
                    "store_sharding='sharded' runs on the CPU (gloo) only so far; use "
                    "store_sharding='replicated' on accelerators."
                )
            # Fixed with the plan: ownership is by the plan's units (Note [sharded store]).
            self.shards = ShardedStore([u.params for u in plan.units], self.config.weight_servers)
        self.updater = None
        if self.config.overlap_updates or self.store is not None:
            self.updater = UnitUpdater(
                [u.params for u in plan.units],
                background=self.config.overlap_updates,
                store=self.store,
            )
            # Reading or loading the whole model must see the step fully applied.
            self._state_hooks = [
                self.module.register_state_dict_pre_hook(self._synchronize_hook),
                self.module.register_load_state_dict_pre_hook(self._synchronize_hook),
            ]
        self.streamer = Streamer(
            plan,
            self.ops,
            self.config.prefetch_depth,
            self.stream_dtype,
            self._postprocess(),
            before_fetch=None if self.updater is None else self.updater.wait_unit,
            store=self.store,
            shards=self.shards,
        )
        self.streamer.install()

    def _synchronize_hook(self, *_args, **_kwargs) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """Wait until an overlapped optimizer step is completely applied."""
        if self.updater is not None:
            self.updater.synchronize()

    def stream_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` travels in: the compute dtype for floating weights."""
        dt = self.config.compute_dtype
        if dt is None or not p.is_floating_point():
            return p.dtype
        return torch.float32 if dt == "cbfloat16" else dt

    def _postprocess(self):
        """cbfloat16 travels as float32 rounded to the cbfloat16 grid on the way."""
        if self.config.compute_dtype != "cbfloat16":
            return None
        from weightstream.amp.cbfloat16 import round_to_cbfloat16

        def to_cbfloat16(flat: torch.Tensor) -> None:
            flat.copy_(round_to_cbfloat16(flat))

        return to_cbfloat16

    def prepare(self, *args, **kwargs) -> Plan:
        """Fix the plan for a batch like ``args`` now, without running a step."""
        if self.streamer is None:
            args, kwargs = self._to_device(args, kwargs)
            self._compile(args, kwargs)
        return self.plan

    def _to_device(self, args, kwargs):
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(self.device, non_blocking=True), (args, kwargs)
        )

    def __call__(self, *args, **kwargs):
        args, kwargs = self._to_device(args, kwargs)
        if self.streamer is None:
            self._compile(args, kwargs)
        streamer = self.streamer
        streamer.begin_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(streamer.pack, streamer.unpack):
                out = self.module(*args, **kwargs)
        except BaseException:
            streamer.abort_forward()
            raise
        streamer.end_forward()
        return out

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        if self.store is not None:
            self.store.close()


def _place(module: nn.Module, device: torch.device) -> None:
    """Masters on the host, buffers on the device.

    Buffers (running statistics, rotary tables) are small and updated in place
    by the forward, so they live on the device for the whole run; the plan
    reports them as resident.
    """
    host = torch.device("cpu")
    for p in module.parameters():
        if p.device != host and not p.is_meta:
            with torch.no_grad():
                p.data = p.data.to(host)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[name] = b.to(device)

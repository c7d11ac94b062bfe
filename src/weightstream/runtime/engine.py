"""The weight-streaming execution of one module: plan at the first call, then stream."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from weightstream.common.materialize import materialize_buffers
from weightstream.common.units import format_bytes
from weightstream.context import current_config
from weightstream.optim.binding import hosts
from weightstream.optim.optimizer import Optimizer as WeightstreamOptimizer
from weightstream.runtime import swarm
from weightstream.runtime.budgets import check_budget, disk_io_set, ram_tier_of
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.device import DeviceOps
from weightstream.runtime.loading import copy_then_release, holds_tensors
from weightstream.runtime.memoryx import MemoryX, RamTier
from weightstream.runtime.mirror import host_mirror_of
from weightstream.runtime.offload import ActivationOffload
from weightstream.runtime.partition import Plan, build_plan
from weightstream.runtime.placement import device_tier
from weightstream.runtime.recompute import recomputed_units, without_cache
from weightstream.runtime.sharding import ShardedStore, unit_group_params, unit_groups
from weightstream.runtime.store import DiskStore
from weightstream.runtime.streamer import Streamer
from weightstream.runtime.trace import trace_forward
from weightstream.runtime.updater import UnitUpdater

log = logging.getLogger("weightstream")


class StreamingEngine:
    """One compiled model's weight-streaming runtime: MemoryX, SwarmX, the streamer, the updater.

    Note [the engine]
    -----------------
    ``cstorch.compile(model, backend="wse_ws")`` builds one engine, which the
    compiled module owns. Everything that touches the model's training state
    reaches it through this object, explicitly:

    * the store (MemoryX, ``self.store``, Note [memoryx]): the masters stay on
      the host, in RAM or in a disk store's files (its tier); with data parallel
      and a sharded store each rank keeps the units it owns (its replicas, Note
      [sharded store]). Where things live is fixed here, at construction, before
      any optimizer state exists or any checkpoint is loaded;
    * SwarmX (``self.reducer``): under torch.distributed the engine joins the
      process group itself (torchrun's environment), broadcasts rank 0's
      weights, and reduces each unit's gradients over the ranks as its
      backward ends (Note [swarm reduce] in runtime/swarm.py);
    * the streamer: fetch, evict and prefetch around each unit, built at the
      first call, when the batch shape is known and the model is traced;
    * the updater: applies an optimizer step unit by unit (overlapped with the
      next forward, or page by page with a disk store).

    Optimizers bind to it (Note [engine binding] in optim/binding.py) through
    the :class:`~weightstream.optim.binding.ParameterHost` protocol that it
    implements; the GradScaler and the step code reach it through the optimizer.
    """

    def __init__(self, module: nn.Module, device: torch.device, config: StreamingConfig):
        self.module = module
        self.config = config
        # Owner: this engine. Why: tests and traces read the order of streaming
        # and reduce events; recording is off unless enabled.
        self.events = swarm.EventLog()
        if config.data_parallel:
            swarm.init_from_env(torch.device(device))  # under torchrun: selects the rank's GPU
        # After that selection: "cuda" resolves to this rank's device index.
        self.ops = DeviceOps(device)
        self.device = self.ops.device
        self.plan: Plan = build_plan(module, config)  # structural; refined at the first call
        check_budget(self.plan, config, self.device)
        self.streamer: Streamer | None = None
        self.reducer: swarm.GradientReducer | None = None
        if config.store == "disk" or not config.init_weights:
            # A meta-device model that will run: its buffers (rotary tables) are
            # derived from the configuration, computed on the host, then placed.
            materialize_buffers(module, "cpu")
        _place(module, self.device)
        # MemoryX (Note [memoryx]): the tier now, the replicas when joining the swarm.
        self.store = MemoryX(self._tier(module))
        # Meta parameters get storage in the tier (a disk store's files, or host memory
        # for a warm start), and values from their rule or, later, from a load ...
        self._awaiting: set[str] = set(self.store.take_module(module, config.init_weights))
        # ... as new parameters: the plan, and the shards' owners taken from it, must
        # name the new ones.
        self.plan = build_plan(module, config)
        self._params = {id(p): p for p in module.parameters()}
        on_meta = any(p.is_meta for p in module.parameters())
        if config.data_parallel and swarm.world_size() > 1 and not on_meta:
            swarm.check_host_collectives()
            swarm.broadcast_module(module)  # every rank starts from rank 0's weights
            self._join_swarm(module)
        # Every optimizer step goes through the updater, the one update path: by unit in
        # forward order behind the next forward, in the backward, or at the step (Note
        # [overlapped updates]).
        self.updater = UnitUpdater(
            [u.params for u in self.plan.units],
            background=config.overlap_updates,
            tier=self.store.tier,
            thread_init=self.ops.helper_thread_init,
            in_backward=config.update_in_backward,
        )
        self.updater.name_of = self._name_of
        if config.update_in_backward:
            self.store.tier.hands_over = self.updater.takes
        # One pair of gradient hooks per master, the store's (Note [one gradient hook]).
        self.store.hook_gradients(
            module.parameters(),
            self.reducer,
            self.updater.gradient_final if config.update_in_backward else None,
        )
        # Reading or loading the whole model must see the step fully applied, and
        # on a sharded store every rank's shard (Note [sharded store]).
        self._state_hooks = [
            module.register_state_dict_pre_hook(_function(self._synchronize_hook)),
            module.register_state_dict_post_hook(_function(self._state_dict_post_hook)),
            module.register_load_state_dict_pre_hook(_function(self._load_pre_hook)),
            module.register_load_state_dict_post_hook(_function(self._load_post_hook)),
        ]
        # Each module's tensors copied and given back one at a time (Note [bounded loads]).
        self._state_hooks += [
            m.register_load_state_dict_pre_hook(copy_then_release)
            for m in module.modules()
            if holds_tensors(m)
        ]
        if self.store.sharded:
            # torch.optim's step does not come through apply_step: checked before it
            # (Note [changed after the reduce] in runtime/swarm.py).
            self._state_hooks.append(
                register_optimizer_step_pre_hook(
                    lambda optimizer, args, kwargs: self._before_foreign_step(optimizer)
                )
            )
        self._skipped_on_load: list[str] = []
        self._warned_update_in_backward = False
        self._warned_unchecked_step = False
        # The units whose training state lives on the device (Note [device tier] in
        # runtime/placement.py), placed at the first call; the optimizers bound so far,
        # whose state moves with them.
        self.resident: frozenset[int] = frozenset()
        # In binding order, the same on every rank (a sharded store's broadcasts follow it).
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._recompute: set[int] = set()
        # "auto": "waiting" for the first step, "due" after it (placed before the next
        # forward), then None.
        self._auto_tier = "waiting" if config.device_tier_budget == "auto" else None
        hosts.add(self)

    def _tier(self, module: nn.Module):
        """The tier of the training state: host memory, or a disk store's files."""
        config = self.config
        if config.store != "disk":
            return RamTier()
        ram_tier, grads_to_update = ram_tier_of(self.plan, config, self.device)
        return DiskStore(
            config.store_dir,
            ram_capacity=ram_tier,
            # The buffers of explicit I/O are its disk part (Note [explicit disk I/O]).
            io_capacity=disk_io_set(self.plan, config),
            grads_to_update=grads_to_update,
        )

    def _join_swarm(self, module: nn.Module) -> None:
        """Shard the store (if configured) and install the gradient reduction."""
        # The reduction rewrites p.grad after a disk tier's hook: gradients go
        # through their mappings (Note [explicit disk I/O]).
        self.store.tier.explicit_grads = False
        unit_params = [u.params for u in self.plan.units]
        owners = None
        # Events name a bucket by its first unit (a tied head's bucket is its embedding's).
        first_unit = [self.plan.units[g[0]].display_name for g in unit_groups(unit_params)]
        # None: sharded on the CPU, as the reference's MemoryX, replicated on
        # accelerators, where a sharded fetch adds a host broadcast and skips the
        # host mirror (StreamingConfig; Note [sharded store]).
        sharding = self.config.store_sharding or (
            "sharded" if self.device.type == "cpu" else "replicated"
        )
        if sharding == "sharded":
            # Fixed with the structural plan, before any optimizer state exists.
            servers = self.config.num_wgt_servers or current_config().max_wgt_servers
            shards = ShardedStore(unit_params, servers, self.store.tier)
            self.store.shard(shards)
            self.store.refill(self.module)  # other ranks' masters gave RAM back
            buckets, owners = shards.group_params, shards.group_owner
        else:
            buckets = unit_group_params(unit_params)
        buckets, owners, taken = swarm.coalesce(buckets, owners, self.config.reduce_bucket_bytes)
        names = [first_unit[idx[0]] for idx in taken]  # a bucket by its first unit
        self.reducer = swarm.GradientReducer(
            buckets,
            owners,
            note=lambda event, b: self.events(event, names[b]),
            install_hooks=False,  # the store's hooks call it (Note [one gradient hook])
        )

    # ---- the ParameterHost protocol (Note [engine binding]) ---------------------------------

    @property
    def grads_sharded(self) -> bool:
        return self.store.sharded

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        return self.store.counts_in_norm(p)

    def holds(self, p: torch.Tensor) -> bool:
        return self._params.get(id(p)) is p

    def state_zeros_like(
        self,
        p: torch.Tensor,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        return self.store.state_zeros_like(p, dtype, shape)

    def plan_state(self, state_bytes: dict[torch.Tensor, list[int]]) -> None:
        self.store.plan_state(state_bytes)

    def bind_optimizer(self, optimizer) -> None:
        self.store.bind_optimizer(optimizer)
        self._optimizers[optimizer] = None
        if self.resident:  # an optimizer built before compile(): its state joins the tier
            self._tier_state_to_device([optimizer], self._tier_params())

    def apply_step(self, optimizer) -> None:
        """The optimizer's update of the masters, through the updater (Note [overlapped
        updates] in runtime/updater.py)."""
        if self.store.sharded:
            self._check_gradients_unchanged()
        self.updater.defer(optimizer)
        if self._auto_tier == "waiting":
            self._auto_tier = "due"

    @contextlib.contextmanager
    def update_in_backward(self, optimizer):
        """Within the block (one backward), each unit's share of ``optimizer``'s next
        step starts once its gradients are final; the caller guarantees that
        ``step()`` follows with nothing global in between (Note [updates in backward]
        in runtime/updater.py). Nothing changes where the engine cannot do it."""
        if not self._can_update_in_backward(optimizer):
            yield
            return
        self.updater.arm(optimizer)
        try:
            yield
        except BaseException as exc:
            if self.updater.disarm():
                raise RuntimeError(
                    "the backward failed after some units had begun their optimizer update "
                    "(update_in_backward): those units' weights and optimizer state are "
                    "stepped, the others not. Fix: load the last checkpoint before training "
                    "on (Note [updates in backward] in runtime/updater.py)."
                ) from exc
            raise

    def _can_update_in_backward(self, optimizer) -> bool:
        if not self.config.update_in_backward or self.streamer is None:
            return False
        if getattr(optimizer, "engine", None) is not self:
            return False  # torch.optim's own step() does not come through the engine
        if self.reducer is not None:
            if not self._warned_update_in_backward:
                self._warned_update_in_backward = True
                warnings.warn(
                    "weightstream: update_in_backward is ignored under data parallel, where "
                    "a gradient is final only once SwarmX reduced it; the step runs after "
                    "the backward (Note [updates in backward] in runtime/updater.py).",
                    stacklevel=4,
                )
            return False
        return True

    def _names(self) -> dict[int, str]:
        """id(p) -> each parameter's first name in the module (for messages)."""
        names: dict[int, str] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        return names

    def _name_of(self, p: torch.Tensor) -> str:
        return repr(self._names().get(id(p), f"of shape {tuple(p.shape)}"))

    def _check_gradients_unchanged(self) -> None:
        """Stop the step on every rank if something rewrote an owned gradient after its
        reduction without seeing the other ranks' shards (Note [changed after the reduce]
        in runtime/swarm.py). Collective: a host sync point."""
        self.finish_gradients()
        changed = self.reducer.changed_after_reduce()
        once = sum(map(self.counts_in_norm, changed))  # a device tier's: on every rank
        count = self.sum_over_ranks(torch.tensor(float(once)))
        if int(count) == 0:
            return
        names = self._names()
        mine = [names.get(id(p), "?") for p in changed]
        here = f" (on this rank: {', '.join(mine[:4])}{' ...' if len(mine) > 4 else ''})"
        raise RuntimeError(
            f"weightstream: {int(count)} gradient(s) were changed after SwarmX reduced them"
            f"{here if mine else ''}, and the store is sharded: each rank holds only the "
            "gradients of the parameters it owns, so an operation over the whole model, such "
            "as torch.nn.utils.clip_grad_norm_, saw one rank's share and would train wrong. "
            "Nothing was updated. Fix: clip with compiled.clip_grad_norm_(max_norm) (or "
            "compiled.clip_grad_value_), or cstorch.amp.optimizer_step(..., "
            "max_gradient_norm=...), which use the whole model's norm; or compile with "
            "store_sharding='replicated' (Note [changed after the reduce] in runtime/swarm.py)."
        )

    def _before_foreign_step(self, optimizer) -> None:
        """The check of ``apply_step`` before the step of an optimizer that does not come
        through the engine (torch.optim's own) over this store's masters."""
        if isinstance(optimizer, WeightstreamOptimizer) or self.reducer is None:
            return
        if any(id(q) in self._params for g in optimizer.param_groups for q in g["params"]):
            self._check_gradients_unchanged()

    def _warn_unchecked_step(self) -> None:
        if self.reducer.stepped_elsewhere():
            self._warned_unchecked_step = True
            warnings.warn(
                "weightstream: an optimizer updated the masters of a sharded store without "
                "coming through the engine (torch.optim's own step()), so nothing checked "
                "that the gradients were not changed after their reduce by an operation "
                "that sees only this rank's shard (torch.nn.utils.clip_grad_norm_ would "
                "train wrong). Fix: use weightstream's optimizers (cstorch.optim), or "
                "store_sharding='replicated' (Note [changed after the reduce] in "
                "runtime/swarm.py).",
                stacklevel=3,
            )

    def gradients_rewritten(self, params: list[torch.Tensor]) -> None:
        if self.store.sharded:
            self.reducer.rewritten(params)

    def finish_gradients(self) -> None:
        """Wait for every gradient reduction still in flight (host sync point)."""
        if self.reducer is not None:
            self.reducer.wait()

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return swarm.sum_over_ranks(value)

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return swarm.max_over_ranks(value)

    def gather_optimizer_state(self, optimizer, state: dict) -> dict:
        return self.store.gather_optimizer_state(optimizer, state)

    def load_optimizer_state(self, optimizer, state: dict, load) -> None:
        self.store.load_optimizer_state(optimizer, state, load)

    # ---- state-dict hooks -------------------------------------------------------------

    def _synchronize_hook(self, *_args, **_kwargs) -> None:
        self.synchronize()

    def _state_dict_post_hook(self, module, state, prefix, _local_metadata) -> None:
        # Sharded: collective, every rank gets the whole model (Note [sharded store]).
        self.store.gather_module_state(module, state, prefix)

    def _load_pre_hook(
        self, _module, state, prefix, _metadata, _strict, _missing, _unexpected, _errors
    ) -> None:
        self.synchronize()
        self._skipped_on_load = []
        if self._awaiting:
            # Filled by this load (a warm start, or a model built on meta).
            self._awaiting.difference_update(
                k[len(prefix) :] for k in state if k.startswith(prefix)
            )
        # Parameters owned elsewhere keep their placeholders: their entries are
        # taken out (shapes checked first, so a wrong checkpoint still fails).
        for name, p in self.store.unowned_names(self.module, prefix).items():
            value = state.get(name)
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                del state[name]
                self._skipped_on_load.append(name)

    def _load_post_hook(self, _module, incompatible) -> None:
        skipped = set(self._skipped_on_load)
        self._skipped_on_load = []
        if skipped:
            incompatible.missing_keys[:] = [
                k for k in incompatible.missing_keys if k not in skipped
            ]

    # ---- compile ----------------------------------------------------------------------

    def _compile(self, args: tuple, kwargs: dict) -> None:
        """Trace the real batch shape on the meta device and fix the streaming plan."""
        if self._awaiting:
            names = sorted(self._awaiting)
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            raise ValueError(
                f"parameters {', '.join(map(repr, names[:8]))}{more} of the model built on the "
                "meta device have no values: they have no initialization rule (or "
                "init_weights=False) and no state dict filled them. Fix: load the weights "
                "first (model.load_state_dict), or give their modules reset_parameters()."
            )
        trace = None
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
            plan.trace_refused = isinstance(exc, (ValueError, IndexError))
        else:
            plan = build_plan(self.module, self.config, trace)
        check_budget(plan, self.config, self.device)
        self.plan = plan
        self.updater.set_units([u.params for u in plan.units])
        self._recompute = self._recomputed_units(plan, trace)
        budget = self.config.device_tier_budget
        if budget != "auto":  # "auto": after the first step (_place_auto_tier)
            self.resident = self._place_device_tier(budget)
        self._install_streamer()

    def _install_streamer(self) -> None:
        """The streamer of the plan and the device tier as they are now (a previous one's
        hooks removed first)."""
        if self.streamer is not None:
            self.streamer.remove()
        plan = self.plan
        streamed = [u.weight_bytes for u in plan.units if u.index not in self.resident]
        # As many idle copy buffers as copies may be in flight (Note [CPU copy buffers]).
        self.ops.keep(self.config.prefetch_depth + 1, max(streamed, default=0))
        mirror = self._host_mirror()
        self.streamer = Streamer(
            plan,
            self.ops,
            self.config.prefetch_depth,
            self.stream_dtype,
            self.store,
            self._postprocess(),
            before_fetch=self.updater.wait_unit,
            note=self.events,
            recompute=self._recompute,  # the device tier's units too
            mirror=mirror,
            mirror_by_update=self.updater.apart,
            offload=self._activation_offload(),
            resident=self.resident,
        )
        # The update writes what it changed into the mirrors (Note [host mirror]).
        mirrored = mirror and self.updater.apart
        self.updater.on_updated = self.streamer.mirror_updated if mirrored else None
        self.streamer.install()

    def _place_auto_tier(self) -> None:
        """``device_tier_budget="auto"``: what the device has left after the first step's
        peak holds the device tier from the second step on (Note [device tier])."""
        self._auto_tier = None
        self.updater.synchronize()  # the first step fully applied: its state moves as it is
        # Ranks that share a GPU share its room (Note [ranks sharing a device]).
        room = self.ops.tier_room() // swarm.ranks_per_device(self.device)
        if self.reducer is not None:  # every rank places the same units: the least room
            room = -int(swarm.max_over_ranks(torch.tensor(-room, dtype=torch.int64)))
        self.resident = self._place_device_tier(room, asked=False) if room > 0 else frozenset()
        if self.resident:
            self._install_streamer()
            log.info("Device tier placed after the first step: %s", self.describe_tiers())
        else:
            log.info(
                "Device tier 'auto': nothing placed after the first step (%s of room on %s); "
                "every unit streams",
                format_bytes(room),
                self.device,
            )

    def _place_device_tier(self, budget: int | None, asked: bool = True) -> frozenset[int]:
        """Choose the units of the device tier within ``budget`` bytes (the user's, or
        ``"auto"``'s room: ``asked=False``) and move their masters, gradients and optimizer
        state to the device (Note [device tier] in runtime/placement.py)."""
        if not budget:
            return frozenset()
        plan, recompute = self.plan, self._recompute
        if self.config.compute_dtype == "cbfloat16":
            warnings.warn(
                "weightstream: device_tier_budget is ignored with cbfloat16, whose grid is "
                "applied on the way to the device; every unit streams (Note [device tier] in "
                "runtime/placement.py). Fix: drop device_tier_budget.",
                stacklevel=4,
            )
            return frozenset()
        unit_params = [u.params for u in plan.units]
        groups = []
        for indices in unit_groups(unit_params):
            params = {id(p): p for i in indices for p in unit_params[i]}.values()
            nbytes = sum(p.nbytes for p in params)  # masters, then gradients and state
            nbytes += sum(p.nbytes + self._state_bytes(p) for p in params if p.requires_grad)
            groups.append((indices, nbytes, max(2 + (i in recompute) for i in indices)))
        chosen = frozenset(device_tier(groups, budget, len(plan.units)))
        if not chosen and asked and groups:
            warnings.warn(
                f"weightstream: device_tier_budget={budget:,} bytes holds no unit: the "
                f"smallest needs {min(n for _, n, _ in groups):,} (its masters, gradients and "
                "optimizer state), so every unit streams. Fix: a larger budget, or smaller "
                "units (granularity='module', a smaller unit_size_target).",
                stacklevel=4,
            )
        moved = self._tier_params(chosen)
        if self.store.sharded:  # every rank holds the tier's units (Note [sharded store])
            self.store.replicas.replicate(moved)
            self.reducer.replicate(moved)
        with torch.no_grad():
            olds = [p.data for p in moved]
            for p in moved:
                p.data = self._into_device_memory(p.data)
                if p.grad is not None:
                    p.grad = self._into_device_memory(p.grad)
        self.store.tier.forget(moved, olds)  # a disk store gives their files and RAM back
        self._tier_state_to_device(list(self._optimizers), moved)
        self.store.refill(self.module, list(self._optimizers))  # the RAM they gave back
        return chosen

    def _tier_params(self, units: Iterable[int] | None = None) -> list[torch.nn.Parameter]:
        """The parameters of the device tier's ``units`` (default: the placed ones), each
        once; meta parameters (shapes only: validate_only, compile_only) left out."""
        units = self.resident if units is None else units
        unique = {id(p): p for i in units for p in self.plan.units[i].params}.values()
        return [p for p in unique if not p.is_meta]

    def _into_device_memory(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in ordinary memory of the device: out of a disk store's files or the RAM
        tier, or from the host."""
        held = self.store.tier.holds(t)
        return t.to(self.device, copy=held) if held or t.device != self.device else t

    def _tier_state_to_device(self, optimizers: list, params: list[torch.nn.Parameter]) -> None:
        """The ``optimizers``' state of the device tier's ``params`` on the device: when the
        tier is placed, and for an optimizer bound later (one built before ``compile()``,
        its state made where the parameters were then). On a sharded store every rank
        takes the owner's state first (collective: binding and placing follow the same
        order on every rank)."""
        if not optimizers or not params:
            return
        if self.store.sharded:
            self.store.replicas.replicate_state(params, optimizers)
        old_state = []
        with torch.no_grad():
            for p in params:
                for optimizer in optimizers:
                    state = optimizer.state.get(p, {})
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            old_state.append(value)
                            state[key] = self._into_device_memory(value)
        tier = self.store.tier
        tier.drop([t for t in old_state if tier.holds(t)], "state")

    def describe_tiers(self) -> str:
        """One line for the log: this rank's training state on the device and on the host,
        and the bytes a step moves over the link (fetches and gradients of the streamed units) and
        through host memory in their update (masters and state read and written, gradients
        read), once the plan is fixed (Note [device tier] in runtime/placement.py)."""
        device, host, link, update = {}, {}, 0, 0
        seen: set[int] = set()
        recompute = self.streamer.recompute if self.streamer is not None else frozenset()
        for u in self.plan.units:
            on_device = u.index in self.resident
            if not on_device:
                fetches = 2 + (u.index in recompute)
                link += sum(fetches * p.numel() * self.stream_dtype(p).itemsize for p in u.params)
                link += sum(p.nbytes for p in u.params if p.requires_grad)
            for p in u.params:
                if id(p) in seen or not self.store.owns(p):  # a sharded store: this rank's
                    continue
                seen.add(id(p))
                where = device if on_device else host
                kinds = {"masters": p.nbytes}
                if p.requires_grad:
                    kinds |= {"gradients": p.nbytes, "optimizer state": self._state_bytes(p)}
                    if not on_device:
                        update += 2 * p.nbytes + p.nbytes + 2 * kinds["optimizer state"]
                for k, n in kinds.items():
                    where[k] = where.get(k, 0) + n

        def parts(where: dict[str, int]) -> str:
            return ", ".join(f"{k} {format_bytes(n)}" for k, n in where.items() if n) or "nothing"

        streamed = len(self.plan.units) - len(self.resident)
        auto = " ('auto': placed before the second step)" if self._auto_tier else ""
        placed = self.store.predicted_placement()  # a disk store's (Note [hybrid placement])
        disk = (
            ""
            if placed is None
            else f", {format_bytes(placed.disk_bytes_per_step)} to and from disk"
        )
        return (
            f"device tier{auto}: {len(self.resident)} of {len(self.plan.units)} units on "
            f"{self.device} ({parts(device)}); host: {streamed} units ({parts(host)}); a step "
            f"moves {format_bytes(link)} over the link and {format_bytes(update)} through host "
            f"memory in the update{disk}"
        )

    def _state_bytes(self, p: torch.Tensor) -> int:
        """Bytes of ``p``'s optimizer state as the bound optimizers made it (AdamW's two
        moments of ``p``'s size where none is bound yet)."""
        if not self._optimizers:
            return 2 * p.nbytes
        states = [opt.state.get(p, {}) for opt in self._optimizers]
        return sum(v.nbytes for s in states for v in s.values() if isinstance(v, torch.Tensor))

    def _activation_offload(self) -> ActivationOffload | None:
        """Saved activations in host memory (Note [activation offload] in offload.py)."""
        if not self.config.activation_offload:
            return None
        if self.device.type == "cpu":
            warnings.warn(
                "weightstream: activation_offload on the CPU copies saved activations "
                "within host memory and saves nothing (Note [activation offload] in "
                "runtime/offload.py). Fix: use it with an accelerator, or drop it.",
                stacklevel=4,
            )
        return ActivationOffload(self.ops)

    def _host_mirror(self) -> bool:
        """Whether fetches copy a compute-dtype mirror (Note [host mirror] in mirror.py)."""
        wanted, blocked = host_mirror_of(
            self.config, self.device, self.store.on_disk, self.store.sharded
        )
        if blocked and self.config.host_mirror:
            warnings.warn(
                f"weightstream: host_mirror is ignored with {blocked}, whose fetches read "
                "the masters directly (Note [host mirror] in runtime/mirror.py). Fix: leave "
                "host_mirror unset.",
                stacklevel=4,
            )
        return wanted and blocked is None

    def _recomputed_units(self, plan: Plan, trace) -> set[int]:
        """The units checkpointed under ``activation_checkpointing`` (Note [activation
        checkpointing] in runtime/recompute.py)."""
        if not self.config.activation_checkpointing:
            return set()
        chosen = recomputed_units(plan, trace)
        if not chosen:
            warnings.warn(
                "weightstream: activation_checkpointing is ignored for this model: every "
                "streaming unit either encloses other units or reads weights of an enclosing "
                "unit, so none can be recomputed. Fix: choose smaller units "
                "(granularity='module', unit_modules or unit_classes), or set "
                "activation_checkpointing=False.",
                stacklevel=4,
            )
        return chosen

    def synchronize(self) -> None:
        """Wait until an overlapped optimizer step is completely applied."""
        self.updater.synchronize()

    def no_sync(self):
        """Backwards inside accumulate gradients locally, unreduced (all micro-batches but
        the last of a step; Note [swarm reduce])."""
        return contextlib.nullcontext() if self.reducer is None else self.reducer.no_sync()

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

    def _refuse_meta(self) -> None:
        """A model left on the meta device (shapes only) can be planned, not run."""
        meta = [n for n, p in self.module.named_parameters() if p.is_meta]
        if meta:
            raise RuntimeError(
                f"{len(meta)} parameter(s) of the model, such as {meta[0]!r}, are on the meta "
                "device (shapes only), so it can be planned (validate_only, compile_only) but "
                "not run: the RAM store keeps such a model as it is. Fix: build the model on "
                "the CPU, compile with store='disk' (which materializes it in its files, one "
                "module at a time), or load its weights first (init_weights=False, then "
                "load_state_dict)."
            )

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
        if self.store.sharded and not self._warned_unchecked_step:
            self._warn_unchecked_step()
        args, kwargs = self._to_device(args, kwargs)
        if self.streamer is None:
            self._refuse_meta()
            self._compile(args, kwargs)
        if self._auto_tier == "due":
            self._place_auto_tier()
        if self._recompute:
            kwargs = without_cache(self.module, kwargs)
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
        hosts.discard(self)
        self.updater.close()
        self.updater.on_updated = None  # the mirrors go with the streamer
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        for h in self._state_hooks:
            h.remove()
        self._state_hooks = []
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        self.store.close()


def _function(method):
    """``method`` as a plain function: torch marks public hooks with an attribute, and the
    meta-device trace deep-copies the module with its hooks (a bound method would copy
    the engine along)."""
    return lambda *args: method(*args)


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

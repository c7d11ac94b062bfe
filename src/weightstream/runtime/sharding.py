"""The sharded store: each streaming unit's masters and optimizer state live on one rank.

Note [sharded store]
--------------------
With data parallel and ``StreamingConfig(store_sharding="sharded")`` the store
is split across the ranks acting as weight servers (MemoryX with
``num_wgt_servers``) instead of being replicated on every rank:

* Ownership. Every streaming unit of the plan has one owner rank, chosen
  greedily by weight bytes (largest first, to the least loaded owner, ties to
  the lowest rank): a pure function of the plan, so every rank computes the
  same table without talking. Units that share a parameter (a tied embedding)
  are owned together, because a unit's flat device buffer is broadcast from a
  single rank and must be whole there. A rank keeps real host masters and
  optimizer state only for the units it owns; every other parameter's data is
  a storage-free placeholder (one element expanded to the shape), and so is
  its optimizer state, so per-rank store memory is about 1/N of the
  replicated store's.

* Fetch (forward and backward). The owner copies its masters into the unit's
  flat device buffer and broadcasts it; the other ranks receive into a fresh
  buffer. Every rank must issue the broadcasts in the same order, so all of
  them, synchronous fetches included, run on DeviceOps' single worker thread,
  on a process group of their own: no collective of another thread can
  interleave with them.

* Gradients. ``_StreamIn.backward`` (Note [streaming and autograd]) hands each
  unit's gradients to :meth:`ShardedStore.reduce_grads`, which sums them on the
  owner (``dist.reduce`` on a second group of its own, issued from the
  autograd thread) and divides by the world size: the mean over the ranks, as
  ``swarm.average_gradients`` computes for the replicated store. Non-owners
  get no gradient for the master, so every optimizer skips it there and only
  the owner runs the unit's update. Global decisions see every shard: the
  gradient norm for clipping and the loss scaler's non-finite check
  all-reduce the sum of squares.

* Checkpoints. The trainer's state dict gathers every unit that rank 0 does
  not own to rank 0, one unit group at a time (the owner sends the masters and
  their optimizer state entries), into the same single-file layout as a
  replicated run. The masters of a unit travel once per save, so rank 0 holds
  the whole state only while it writes the file, as a replicated run always
  does. Loading into a sharded store fills the owned tensors only.

The model is built whole on every rank (rank 0's weights are broadcast to all)
and sharded when the plan is fixed, at the engine's first call: until then a
rank holds everything, as with the replicated store.
"""

from __future__ import annotations

import datetime
import os
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

# id(streamed master) -> the sharded store that places it (as updater._updater_of).
_store_of: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def store_for(params: Iterable[torch.Tensor]) -> ShardedStore | None:
    """The sharded store placing any of ``params``, if one does."""
    for p in params:
        s = _store_of.get(id(p))
        if s is not None:
            return s
    return None


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype over a one-element storage (no data)."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and t.untyped_storage().nbytes() <= t.element_size()


def placeholder_state_for(p: torch.Tensor) -> torch.Tensor | None:
    """Optimizer state for ``p`` when a sharded store keeps ``p`` on another rank."""
    s = _store_of.get(id(p))
    if s is None or s.owns(p):
        return None
    return placeholder(p)


def _unit_groups(unit_params: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """Unit indices joined into groups that share a parameter, in first-unit order."""
    parent = list(range(len(unit_params)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[int, int] = {}
    for i, params in enumerate(unit_params):
        for p in params:
            j = first.setdefault(id(p), i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(unit_params)):
        groups.setdefault(find(i), []).append(i)
    return [groups[k] for k in sorted(groups)]


def _params_of(unit_params: Sequence[Sequence[torch.Tensor]], group: list[int]) -> list:
    """The parameters of a group's units, each once (a tied one is in several)."""
    seen: dict[int, torch.Tensor] = {}
    for i in group:
        for p in unit_params[i]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def assign_owners(unit_params: Sequence[Sequence[torch.Tensor]], num_owners: int) -> list[int]:
    """Each unit's owner rank in 0..num_owners-1 (see the Note); the same on every rank."""
    assert num_owners >= 1
    owners = [0] * len(unit_params)
    loads = [0] * num_owners
    groups = _unit_groups(unit_params)

    def nbytes(group: list[int]) -> int:
        return sum(p.numel() * p.element_size() for p in _params_of(unit_params, group))

    sized = sorted(((nbytes(g), g) for g in groups), key=lambda x: (-x[0], x[1][0]))
    for size, group in sized:
        r = min(range(num_owners), key=lambda k: (loads[k], k))
        loads[r] += size
        for i in group:
            owners[i] = r
    return owners


def _timeout() -> datetime.timedelta:
    # The same bound as the default group (runtime/swarm.py): a lost peer must
    # fail a weight broadcast as fast as any other collective.
    return datetime.timedelta(seconds=float(os.environ.get("WEIGHTSTREAM_DIST_TIMEOUT", "60")))


class ShardedStore:
    """Ownership of the plan's units across ranks, and the collectives that move them.

    Args:
        unit_params: each unit's master parameters, in the plan's order.
        weight_servers: how many ranks own units (None: every rank).
    """

    def __init__(self, unit_params: Sequence[Sequence[nn.Parameter]], weight_servers: int | None):
        assert dist.is_initialized()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.num_owners = min(weight_servers or self.world, self.world)
        self.unit_params = [list(ps) for ps in unit_params]
        self.owner_of_unit = assign_owners(self.unit_params, self.num_owners)
        self.groups = _unit_groups(self.unit_params)
        self._owner_of_param: dict[int, int] = {}
        self._params: dict[int, nn.Parameter] = {}
        for params, owner in zip(self.unit_params, self.owner_of_unit):
            for p in params:
                self._owner_of_param[id(p)] = owner
                self._params[id(p)] = p
        # Owner: this store. Why: weight broadcasts run on DeviceOps' worker
        # thread and gradient reduces on the autograd thread; each needs a group
        # of its own so that every rank sees each group's collectives in the
        # same order (Note [sharded store]). new_group is collective: every rank
        # builds its engine's store at the same point, the first call.
        self.weight_group = dist.new_group(timeout=_timeout())
        self.grad_group = dist.new_group(timeout=_timeout())
        for i in self._params:
            _store_of[i] = self
        # Optimizers whose state was sharded already (a plain load_state_dict
        # cannot write into placeholders, so it never brings the state back).
        self._sharded_optimizers: weakref.WeakSet = weakref.WeakSet()
        self._drop_unowned_masters()

    # ---- ownership -------------------------------------------------------------------

    def owns(self, p: torch.Tensor) -> bool:
        return self._owner_of_param.get(id(p), self.rank) == self.rank

    def streams(self, p: torch.Tensor) -> bool:
        return id(p) in self._owner_of_param

    def unstreamed(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters outside every unit: replicated, reduced as before."""
        return [p for p in params if id(p) not in self._owner_of_param]

    def _drop_unowned_masters(self) -> None:
        with torch.no_grad():
            for p in self._params.values():
                if not self.owns(p) and not is_placeholder(p.data):
                    p.data = placeholder(p.data)
                    p.grad = None

    def shard_optimizer_state(self, optimizer) -> None:
        """Replace the state of parameters owned elsewhere by placeholders (idempotent).

        The optimizer is built before the plan is fixed and preinitializes its
        state for every parameter; a checkpoint may also be loaded into it then.
        """
        if optimizer in self._sharded_optimizers:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self.owns(p):
                    continue
                state = optimizer.state.get(p)
                for key, value in (state or {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        if not is_placeholder(value):
                            state[key] = placeholder(value)
        self._sharded_optimizers.add(optimizer)

    # ---- transfers ---------------------------------------------------------------------

    def fetch_flat(
        self, unit_index: int, masters: Sequence[torch.Tensor], dtype: torch.dtype, numel: int, ops
    ) -> torch.Tensor:
        """The unit's flat device buffer of ``dtype``, broadcast from its owner.

        Runs on DeviceOps' worker thread only (Note [sharded store]).
        """
        owner = self.owner_of_unit[unit_index]
        if owner == self.rank:
            flat = ops.copy_flat(masters, dtype, numel)
        else:
            flat = torch.empty(numel, dtype=dtype, device=ops.device)
        dist.broadcast(flat, src=owner, group=self.weight_group)  # host sync point
        return flat

    def reduce_grads(
        self, unit_index: int, grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Sum one unit's gradients on its owner, as the mean over ranks; None elsewhere.

        Called from ``_StreamIn.backward`` on the autograd thread. Which
        gradients are None is a property of the graph, the same on every rank.
        """
        owner = self.owner_of_unit[unit_index]
        out: list[torch.Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in idx])
            dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=self.grad_group)
            if owner != self.rank:
                continue
            flat.div_(self.world)
            offset = 0
            for i in idx:
                g = grads[i]
                out[i] = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
        return out

    # ---- checkpoints -----------------------------------------------------------------------

    def gather_to_main(
        self, module: nn.Module, model_state: dict, optimizer=None, optim_state: dict | None = None
    ) -> tuple[dict, dict | None]:
        """Rank 0's state dicts with every shard's masters and optimizer state filled in.

        Every rank calls this in the same order; a unit group owned by rank r > 0
        travels from r to rank 0 only (the other ranks' dicts keep placeholders
        and are not written). See Note [sharded store].
        """
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if name in model_state:
                names.setdefault(id(p), []).append(name)
        index_of: dict[int, int] = {}
        if optimizer is not None:
            flat = [p for g in optimizer.param_groups for p in g["params"]]
            index_of = {id(p): i for i, p in enumerate(flat)}
        for group in self.groups:
            owner = self.owner_of_unit[group[0]]
            if owner == 0 or self.rank not in (0, owner):
                continue
            params = _params_of(self.unit_params, group)
            if self.rank == owner:
                payload = {
                    "model": [p.detach() for p in params],
                    "state": [
                        optim_state["state"].get(index_of[id(p)])
                        if optim_state is not None and id(p) in index_of
                        else None
                        for p in params
                    ],
                }
                dist.send_object_list([payload], dst=0)  # host sync point
                continue
            box = [None]
            dist.recv_object_list(box, src=owner)  # host sync point
            payload = box[0]
            for p, tensor, entry in zip(params, payload["model"], payload["state"]):
                for name in names.get(id(p), ()):
                    model_state[name] = tensor
                if entry is not None and id(p) in index_of:
                    optim_state["state"][index_of[id(p)]] = entry
        return model_state, optim_state

    def load_model_state(self, module: nn.Module, state: dict) -> None:
        """``module.load_state_dict(state)`` filling only the masters this rank owns."""
        skipped = set()
        for name, p in module.named_parameters(remove_duplicate=False):
            if self.streams(p) and not self.owns(p):
                skipped.add(name)
        result = module.load_state_dict(
            {k: v for k, v in state.items() if k not in skipped}, strict=False
        )
        missing = [k for k in result.missing_keys if k not in skipped]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                f"{missing}, unexpected keys {list(result.unexpected_keys)}."
            )

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """``optimizer.load_state_dict(state)`` keeping only the state this rank owns.

        The optimizer's loader copies into its preinitialized tensors, and the
        placeholders of parameters owned elsewhere cannot be written into: they
        get real tensors for the duration of the load and are dropped right
        after. So a load after the plan is fixed briefly holds the whole
        optimizer state, as a load before it (the run command's resume) does.
        """
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        # Placeholders cannot be written into: give the optimizer's loader fresh
        # tensors to copy into for parameters owned elsewhere, then drop them.
        for p in flat:
            if self.owns(p):
                continue
            entry = optimizer.state.get(p)
            for key, value in (entry or {}).items():
                if isinstance(value, torch.Tensor) and is_placeholder(value):
                    entry[key] = torch.empty(value.shape, dtype=value.dtype)
        self._sharded_optimizers.discard(optimizer)
        try:
            optimizer.load_state_dict(state)
        finally:
            self.shard_optimizer_state(optimizer)

"""The sharded store: each streaming unit's masters and optimizer state live on one rank.

Note [sharded store]
--------------------
With data parallel and ``StreamingConfig(store_sharding="sharded")`` the store
is split across the ranks acting as weight servers (MemoryX with
``num_wgt_servers``) instead of being replicated on every rank:

* Ownership, fixed when the engine is built (``cstorch.compile``), before any
  optimizer state or checkpoint load exists. Every unit of the structural plan
  (the module tree, without a trace) has one owner rank, chosen greedily by
  weight bytes (largest first, to the least loaded owner, ties to the lowest
  rank): a pure function of the model, so every rank computes the same table
  without talking. Units that share a parameter (a tied embedding) are owned
  together. A rank keeps real host masters and optimizer state only for the
  parameters it owns; every other parameter's data is a storage-free
  placeholder (one element expanded to the shape), and so is its optimizer
  state, so per-rank store memory is about 1/N of the replicated store's.

* Fetch (forward and backward). The traced plan of the first call may group
  parameters differently (a parameter read by another module's forward joins
  that unit); a unit's flat device buffer is filled run by run of parameters
  of one owner, each run broadcast from its owner (one broadcast when the unit
  has a single owner, the usual case). Every rank must issue the broadcasts in
  the same order, so all of them, synchronous fetches included, run on
  DeviceOps' single worker thread, on a process group of their own: no
  collective of another thread can interleave with them.

* Host tensors on gloo, whatever the compute device. The store's masters,
  gradients and optimizer state are host tensors (but the device tier's, below),
  so every collective of the store moves host tensors on gloo: the reduces of
  the gradients, the whole-state gathers and the weight broadcasts. On an
  accelerator a fetch broadcasts into page-locked host buffers (the owner casts
  its masters into one on the host) and copies them to the device on the
  prefetch thread's copy stream (``DeviceOps.staging``, ``from_staging``); NCCL
  is never asked, so ranks that share a GPU work as ranks with one each (Note
  [ranks sharing a device] in runtime/swarm.py).

* Gradients. SwarmX's reducer (Note [swarm reduce] in runtime/swarm.py) sums
  each unit group's gradients on its owner as the backward produces them, and
  divides by the world size; the other ranks drop theirs, so every optimizer
  skips those parameters there and only the owner runs the unit's update.
  Global decisions see every shard: the gradient norm for clipping and the
  loss scaler's non-finite check sum the squares over the ranks. A user's own
  whole-model operation (torch's ``clip_grad_norm_``) would see one shard: it
  stops the step instead (Note [changed after the reduce] in runtime/swarm.py).

* Whole-model reads. ``model.state_dict()`` and ``optimizer.state_dict()`` are
  collective on a sharded store: every rank calls them (as every rank runs the
  same training script) and every rank gets the whole state, each unit group
  broadcast from its owner in turn on a third group of its own, never a
  placeholder. ``cstorch.save`` of it writes the same file as a replicated
  run. ``model.load_state_dict()`` and ``optimizer.load_state_dict()`` fill the
  owned tensors only.

The model is built whole on every rank, rank 0's weights are broadcast to all
(the engine does it when it is built), and then the masters owned elsewhere
are dropped.

With ``store="disk"`` each rank's disk store keeps the files of the units it
owns only (the others' are given back when their masters are dropped), and a
whole-model read gathers the other ranks' tensors into scratch files of the
store, so saving stays within the host memory budget.

On accelerators the store is replicated unless ``store_sharding="sharded"`` is
asked for (StreamingConfig): a sharded fetch adds gloo's host broadcast and a
host cast on the prefetch thread, and the host mirror is off (Note [host
mirror] in runtime/mirror.py), so sharding trades fetch work for host memory
there (not measured yet).

The device tier (Note [device tier] in runtime/placement.py) is held by every
rank: its units are few and the device's memory is each rank's own, so no
fetch of theirs needs a collective. When it is placed (the same units on every
rank), their masters and optimizer state are broadcast from their owners on the
host, then move to each rank's device (``replicate``); from then on every rank
owns them: SwarmX all-reduces their gradients on the device (NCCL, or gloo's
CUDA all-reduce where ranks share a GPU), every rank updates them alike, and a
whole-model read takes them from the rank's own copy. A whole-model norm
counts each of their gradients on its first owner alone (``counts_in_norm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightstream.common.flat import flatten, unflatten_views
from weightstream.common.pages import release_pages
from weightstream.runtime import swarm


def placeholder(t: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """A tensor of ``t``'s shape (or ``shape``) and dtype over a one-element storage (no
    data)."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(
        t.shape if shape is None else shape
    )


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and t.untyped_storage().nbytes() <= t.element_size()


def unit_groups(unit_params: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
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


def unit_group_params(unit_params: Sequence[Sequence[torch.Tensor]]) -> list[list]:
    """The parameters of each group of units sharing a parameter, in forward order."""
    return [_params_of(unit_params, g) for g in unit_groups(unit_params)]


def assign_owners(unit_params: Sequence[Sequence[torch.Tensor]], num_owners: int) -> list[int]:
    """Each unit's owner rank in 0..num_owners-1 (see the Note); the same on every rank."""
    assert num_owners >= 1
    owners = [0] * len(unit_params)
    loads = [0] * num_owners
    groups = unit_groups(unit_params)

    def nbytes(group: list[int]) -> int:
        return sum(p.numel() * p.element_size() for p in _params_of(unit_params, group))

    sized = sorted(((nbytes(g), g) for g in groups), key=lambda x: (-x[0], x[1][0]))
    for size, group in sized:
        r = min(range(num_owners), key=lambda k: (loads[k], k))
        loads[r] += size
        for i in group:
            owners[i] = r
    return owners


class Replicated:
    """Every unit on this rank: one process, or data parallel with a whole copy of the
    store on every rank (``store_sharding="replicated"``). The replicas' verbs of
    :class:`ShardedStore`, for a rank that owns everything (Note [memoryx])."""

    sharded = False

    def owns(self, p: torch.Tensor) -> bool:
        return True

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        return True

    def state_zeros_like(self, p: torch.Tensor, dtype=None, shape=None) -> None:
        return None

    def shard_optimizer_state(self, optimizer) -> None:
        pass

    def fetch_flat(
        self, masters: Sequence[torch.Tensor], dtype: torch.dtype, numel: int, ops, tier
    ) -> torch.Tensor:
        """A flat device buffer of ``dtype`` holding ``masters``; masters kept in files
        are read into buffers here, on the prefetch thread (Note [explicit disk I/O])."""
        paged = tier.page_in(masters)
        try:
            sources = masters if not paged else [paged.view(m) for m in masters]
            return ops.copy_flat(sources, dtype, numel)
        finally:
            if paged:
                paged.finish()

    def gather_module_state(self, module: nn.Module, state: dict, prefix: str = "") -> None:
        pass  # this rank's state dict is whole already

    def gather_optimizer_state(self, optimizer, state: dict) -> dict:
        return state

    def unowned_names(self, module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
        return {}

    def load_optimizer_state(self, optimizer, state: dict, load) -> None:
        load(state)


class ShardedStore:
    """Ownership of the model's parameters across ranks, and the collectives that move them.

    Args:
        unit_params: each unit's master parameters of the structural plan.
        weight_servers: how many ranks own units (None: every rank).
        tier: the tier holding this rank's masters (Note [memoryx]).
    """

    sharded = True

    def __init__(
        self,
        unit_params: Sequence[Sequence[nn.Parameter]],
        weight_servers: int | None,
        tier,
    ):
        self.tier = tier
        assert dist.is_initialized()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.num_owners = min(weight_servers or self.world, self.world)
        self.unit_params = [list(ps) for ps in unit_params]
        owner_of_unit = assign_owners(self.unit_params, self.num_owners)
        groups = unit_groups(self.unit_params)
        # Each group of units sharing a parameter: its parameters and its owner.
        self.group_params = [_params_of(self.unit_params, g) for g in groups]
        self.group_owner = [owner_of_unit[g[0]] for g in groups]
        self._owner_of_param: dict[int, int] = {}
        for params, owner in zip(self.group_params, self.group_owner):
            for p in params:
                self._owner_of_param[id(p)] = owner
        # id(p) of the parameters every rank holds from the device tier's placement on
        # (see the Note): owned by all, counted in a whole-model norm by their owner.
        self._everywhere: set[int] = set()
        # Owner: this store. Why: weight broadcasts run on DeviceOps' worker
        # thread, whole-state gathers on the caller's; each needs a group of its
        # own so that every rank sees each group's collectives in the same order
        # (Note [sharded store]). new_group is collective: every rank builds its
        # engine at the same point, in compile().
        self.weight_group = dist.new_group(timeout=swarm.timeout())
        self.state_group = dist.new_group(timeout=swarm.timeout())
        self._drop_unowned_masters()

    # ---- ownership -------------------------------------------------------------------

    def owner_of(self, p: torch.Tensor) -> int:
        return self._owner_of_param.get(id(p), self.rank)

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._everywhere or self.owner_of(p) == self.rank

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank adds ``p``'s gradient to a whole-model norm summed over the
        ranks: each gradient once, a replicated one by its owner."""
        return self.owner_of(p) == self.rank

    def replicate(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank holds ``params`` from now on (the device tier's, see the Note):
        their masters broadcast from their owners to the ranks that hold placeholders
        (their optimizers' state follows with ``replicate_state``). Collective, in the
        same order on every rank."""
        new = [p for p in params if id(p) not in self._everywhere]
        with torch.no_grad():
            for owner, owned in self._by_owner(new):
                values = self._broadcast_from_owner(owner, [p.data for p in owned], False)
                if owner != self.rank:
                    for p, value in zip(owned, values):
                        p.data = value
        self._everywhere.update(id(p) for p in params)

    def replicate_state(self, params: Sequence[torch.Tensor], optimizers) -> None:
        """The ``optimizers``' state of ``params``, which every rank holds, as their owners
        have it (for the tier's placement, and for an optimizer bound after it).
        Collective, in the same order on every rank."""
        with torch.no_grad():
            for owner, owned in self._by_owner(params):
                states = [opt.state.get(p, {}) for opt in optimizers for p in owned]
                keys = [(s, k) for s in states for k in sorted(s) if torch.is_tensor(s[k])]
                got = self._broadcast_from_owner(owner, [s[k] for s, k in keys], False)
                if owner != self.rank:
                    for (state, key), value in zip(keys, got):
                        state[key] = value

    def _by_owner(self, params: Sequence[torch.Tensor]) -> list[tuple[int, list[torch.Tensor]]]:
        by_owner: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_owner.setdefault(self.owner_of(p), []).append(p)
        return sorted(by_owner.items())

    def _drop_unowned_masters(self) -> None:
        dropped, old = [], []
        with torch.no_grad():
            for params in self.group_params:
                for p in params:
                    if not self.owns(p) and not is_placeholder(p.data):
                        old.append(p.data)
                        p.data = placeholder(p.data)
                        p.grad = None
                        dropped.append(p)
        self.tier.forget(dropped, old)  # a disk tier's files go back to the disk

    def state_zeros_like(
        self,
        p: torch.Tensor,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        """A placeholder for the optimizer state of a parameter owned elsewhere (of
        ``p``'s dtype and shape unless given: compact state)."""
        if self.owns(p):
            return None
        like = p if dtype is None and shape is None else torch.empty(0, dtype=dtype or p.dtype)
        return placeholder(like, p.shape if shape is None else shape)

    def shard_optimizer_state(self, optimizer) -> None:
        """Replace the state of parameters owned elsewhere by placeholders (idempotent).

        Needed only for an optimizer built before the engine, whose state was
        created whole; one built after it creates placeholders directly.
        """
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self.owns(p):
                    continue
                state = optimizer.state.get(p)
                for key, value in (state or {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        if not is_placeholder(value):
                            state[key] = placeholder(value)

    # ---- transfers ---------------------------------------------------------------------

    def fetch_flat(
        self, masters: Sequence[torch.Tensor], dtype: torch.dtype, numel: int, ops, tier=None
    ) -> torch.Tensor:
        """A flat device buffer of ``dtype`` holding ``masters``, each from its owner
        (owned masters are read through the tier's mappings, read ahead by ``prefetch``).

        Runs on DeviceOps' worker thread only (Note [sharded store]).
        """
        runs: list[tuple[int, list[torch.Tensor]]] = []
        for m in masters:
            owner = self.owner_of(m)
            if runs and runs[-1][0] == owner:
                runs[-1][1].append(m)
            else:
                runs.append((owner, [m]))
        pieces = []
        for owner, run in runs:
            n = sum(m.numel() for m in run)
            if owner == self.rank:
                piece = ops.staging_flat(run, dtype, n)
            else:
                piece = ops.staging(n, dtype)
            # A host tensor on every compute device: gloo carries it (see the Note).
            dist.broadcast(piece, src=owner, group=self.weight_group)  # host sync point
            pieces.append(piece)
        return ops.from_staging(pieces)

    def _broadcast_from_owner(
        self, owner: int, tensors: list[torch.Tensor], scratch: bool = True
    ) -> list[torch.Tensor]:
        """``tensors`` as the owner has them, on every rank (one collective per dtype);
        ``scratch``: a disk store's copies in scratch files (``_whole``)."""
        out: list[torch.Tensor] = list(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            same = [tensors[i] for i in idx]
            if owner == self.rank:
                flat = flatten(same)
            else:
                numel = sum(t.numel() for t in same)
                flat = torch.empty(numel, dtype=dtype, device=same[0].device)
            dist.broadcast(flat, src=owner, group=self.state_group)  # host sync point
            if owner == self.rank:
                continue  # the owner's tensors are the values
            for i, view in zip(idx, unflatten_views(flat, same)):
                out[i] = self._whole(view) if scratch else view.clone()
        return out

    def _whole(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` received from its owner, kept until the caller drops it.

        On a disk store the copy is a scratch file of the store, its pages given
        back at once: a gathered model larger than memory costs disk space, not
        memory (the checkpoint writer reads it tensor by tensor)."""
        if not self.tier.paged or value.device.type != "cpu":
            return value.clone()
        out = self.tier.scratch(value.shape, value.dtype, "gathered")
        out.copy_(value)
        release_pages([out])
        return out

    # ---- whole-model reads ------------------------------------------------------------

    def gather_module_state(self, module: nn.Module, state: dict, prefix: str = "") -> None:
        """Fill ``state`` (``module.state_dict()``) with every parameter's owner values.

        Collective: every rank calls it and every rank gets the whole state.
        """
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state:
                names.setdefault(id(p), []).append(prefix + name)
        for params, owner in zip(self.group_params, self.group_owner):
            params = [p for p in params if id(p) not in self._everywhere]  # whole here
            values = self._broadcast_from_owner(owner, [p.detach() for p in params])
            if owner == self.rank:
                continue  # this rank's own values are in the dict already
            for p, value in zip(params, values):
                for name in names.get(id(p), ()):
                    state[name] = value

    def gather_optimizer_state(self, optimizer, state: dict) -> dict:
        """``state`` (torch's format) with every parameter's state as its owner has it."""
        index_of = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        for params, owner in zip(self.group_params, self.group_owner):
            entries = [
                (index_of[id(p)], key)
                for p in params
                if id(p) in index_of and id(p) not in self._everywhere
                for key, value in sorted(state["state"].get(index_of[id(p)], {}).items())
                if isinstance(value, torch.Tensor)
            ]
            if not entries:
                continue
            values = self._broadcast_from_owner(owner, [state["state"][i][k] for i, k in entries])
            if owner == self.rank:
                continue
            for (i, key), value in zip(entries, values):
                state["state"][i] = {**state["state"][i], key: value}
        return state

    # ---- loads ------------------------------------------------------------------------

    def unowned_names(self, module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
        """State-dict names of the parameters other ranks own, with the parameters."""
        return {
            prefix + name: p
            for name, p in module.named_parameters(remove_duplicate=False)
            if not self.owns(p)
        }

    def load_optimizer_state(self, optimizer, state: dict, load) -> None:
        """``load(state, skip)`` (the optimizer's loader), copying only the state this
        rank owns: the placeholders of parameters owned elsewhere stay as they are,
        and their values are never read from the checkpoint (Note [bounded loads])."""
        load(state, skip=lambda p: not self.owns(p))

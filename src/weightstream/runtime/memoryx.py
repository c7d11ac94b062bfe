"""MemoryX: the store of one compiled model's training state, which the engine always holds.

Note [memoryx]
--------------
The masters, their gradients and the optimizer state of a weight-streamed model
live in one object, whatever holds them. Two independent choices make it up,
each an object with the same verbs whichever it is, so no caller asks which:

* the **tier**: where a host tensor of the training state lives. ``RamTier``:
  host memory, ordinary tensors (the masters are the module's own parameters,
  nothing is paged); ``DiskStore`` (runtime/store.py): files under
  ``store_dir`` with a RAM tier for what fits the budget (Note [disk tier],
  Note [hybrid placement]). A tier allocates state (``zeros_like``), takes the
  module (``take_module``), pages masters in for a fetch and back out
  (``page_in``, ``release``, ``prefetch``), settles pending writes, and moves
  state out of its files into RAM given back (``refill``);
* the **replicas**: which ranks hold which units. ``Replicated``
  (runtime/sharding.py): this rank holds every unit; ``ShardedStore``: each
  unit group on one owner rank, its weights broadcast from there (Note
  [sharded store]). The replicas own a parameter or not, fill a unit's flat
  device buffer (``fetch_flat``, reading owned masters through the tier), and
  gather or load whole-model state collectively.

The engine builds MemoryX with its tier when it is built, and shards it when it
joins the swarm (before any optimizer state exists). The streamer's fetches,
the updater's paging and the engine's state-dict hooks all go through it.

Note [one gradient hook]
------------------------
What happens to a master's gradient between autograd and the update is one
sequence, run by one pair of hooks per master that MemoryX owns, in a fixed
order written in one place (``_accumulated``), not by hooks of several owners
whose order of registration decides it:

1. before autograd accumulates (a tensor hook): SwarmX sets aside a mean
   already reduced in this step, so that only the new local part is reduced
   (Note [swarm reduce]);
2. accumulated (a post-accumulate-grad hook): the tier takes the gradient
   (a disk tier writes it to its file, or leaves it in memory where the
   armed update takes it: Note [updates in backward]); then SwarmX marks it
   final in its bucket, and a complete bucket starts its reduction; then the
   updater, when a step is armed in the backward, takes it and starts the
   unit's share once the share is complete.

A frozen master (``requires_grad=False``) gets no hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from weightstream.common.materialize import materialize
from weightstream.runtime import swarm
from weightstream.runtime.placement import Placement
from weightstream.runtime.sharding import Replicated, ShardedStore
from weightstream.runtime.store import DiskStore


class RamTier:
    """Host memory: the training state is ordinary tensors (Note [memoryx]).

    The methods the disk tier needs for its files are no-ops here, so the
    streamer and the updater call them without asking which tier they have.
    """

    #: State may live in files: the update pages it in and out (the updater's pager).
    paged = False
    #: Set by the engine; read by the disk tier's gradient hook only.
    hands_over: Callable[[torch.Tensor], bool] | None = None
    explicit_grads = False
    bytes_mapped = 0
    places = None  # a disk tier's PlacementPlan (Note [hybrid placement])

    def take_module(self, module: nn.Module, init_weights: bool = True) -> list[str]:
        """Give a meta-device model host storage where its values come from a load (a
        warm start, ``init_weights=False``); returns the names left for the load."""
        if init_weights or not any(p.is_meta for p in module.parameters()):
            return []
        return materialize(
            module, lambda p: torch.zeros(p.shape, dtype=p.dtype), skip=lambda _n: True
        )

    def zeros_like(
        self,
        p: torch.Tensor,
        kind: str = "state",
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """None: the optimizer makes an ordinary tensor."""
        return None

    def page_in(self, tensors: Iterable[torch.Tensor], wait: bool = True) -> None:
        return None  # the masters are read where they are

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def prefetch(self, tensors: Iterable[torch.Tensor], mapped_reads: bool = False) -> None:
        pass

    def settle(self) -> None:
        pass

    def holds(self, t: torch.Tensor) -> bool:
        return False

    def take_grad(self, p: torch.Tensor) -> None:
        pass  # autograd's gradient stays where it is

    def forget(self, params: Iterable[torch.Tensor], old_data: Iterable[torch.Tensor]) -> None:
        pass  # the dropped tensors' memory goes back when they die

    def drop(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        pass  # likewise

    def plan_state(self, state_bytes: dict[torch.Tensor, list[int]]) -> None:
        pass  # ordinary tensors, where they are made

    def refill(self, held: Sequence[tuple[torch.Tensor, str, torch.Tensor]]) -> list[None]:
        return [None] * len(held)  # everything is in memory already

    def placement(self) -> Placement:
        return Placement(0)

    def close(self) -> None:
        pass


Tier = RamTier | DiskStore


class MemoryX:
    """One model's training state: a tier and the replicas over it (Note [memoryx])."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.replicas: Replicated | ShardedStore = Replicated()
        # The gradient hooks' collaborators (Note [one gradient hook]): SwarmX's reducer
        # under data parallel, the updater's taker of final gradients under
        # update_in_backward; None where there is none.
        self._reducer = None
        self._on_final: Callable[[torch.Tensor], None] | None = None
        self._grad_hooks: list = []

    # ---- what it is --------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Each rank holds the units it owns (their gradients too), not every unit."""
        return self.replicas.sharded

    @property
    def on_disk(self) -> bool:
        return self.tier.paged

    def shard(self, replicas: ShardedStore) -> None:
        """Hold only this rank's units from now on (the engine, joining the swarm)."""
        self.replicas = replicas

    def placement(self) -> Placement:
        """Bytes of the tier's training state in RAM and in files, by kind."""
        return self.tier.placement()

    def predicted_placement(self) -> Placement | None:
        """A disk tier's placement as predicted (for the state its optimizer planned, or
        AdamW's two moments before one did: Note [hybrid placement]); None in host memory."""
        places = self.tier.places
        return None if places is None else places.predicted

    @property
    def bytes_mapped(self) -> int:
        return self.tier.bytes_mapped

    def holds(self, t: torch.Tensor) -> bool:
        return self.tier.holds(t)

    # ---- the module and its state ------------------------------------------------------------

    def take_module(self, module: nn.Module, init_weights: bool = True) -> list[str]:
        """Place every parameter of ``module`` in the tier; the names a load must fill."""
        return self.tier.take_module(module, init_weights)

    def owns(self, p: torch.Tensor) -> bool:
        return self.replicas.owns(p)

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        return self.replicas.counts_in_norm(p)

    def state_zeros_like(
        self,
        p: torch.Tensor,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        """Where ``p``'s optimizer state lives: a placeholder if another rank owns ``p``,
        the tier's tensor, or None for an ordinary tensor. ``dtype`` and ``shape``
        (default ``p``'s) are those of compact state (Note [compact optimizer state])."""
        held_elsewhere = self.replicas.state_zeros_like(p, dtype, shape)
        if held_elsewhere is not None:
            return held_elsewhere
        return self.tier.zeros_like(p, "state", dtype, shape)

    def plan_state(self, state_bytes: dict[torch.Tensor, list[int]]) -> None:
        """The sizes of the state an optimizer is about to create: a disk tier places it
        by them (its RAM tier, Note [hybrid placement])."""
        self.tier.plan_state(state_bytes)

    def refill(self, module: nn.Module, optimizers: Sequence = ()) -> None:
        """Hold in the RAM a disk tier gave back (another rank's masters, the device
        tier's units) what of ``module``'s masters and the ``optimizers``' state it
        keeps in files, masters first, and then the masters' gradients in its files
        (Note [hybrid placement]). Between steps: the tensors moved are replaced where
        they are referenced."""
        held, where = [], []  # where: (master, None, None) or (its master, state, key)
        for p in module.parameters():
            if not self.tier.holds(p.data):
                continue  # another rank's, or on the device
            held.append((p.data, "master", p))
            where.append((p, None, None))
            for optimizer in optimizers:
                state = optimizer.state.get(p, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and self.tier.holds(value):
                        held.append((value, "state", p))
                        where.append((p, state, key))
        with torch.no_grad():
            for moved, (p, state, key) in zip(self.tier.refill(held), where):
                if moved is None:
                    continue
                if state is None:
                    p.data = moved
                else:
                    state[key] = moved

    def bind_optimizer(self, optimizer) -> None:
        self.replicas.shard_optimizer_state(optimizer)

    # ---- gradients (autograd's thread; Note [one gradient hook]) -------------------------------

    def hook_gradients(
        self,
        params: Iterable[nn.Parameter],
        reducer=None,
        on_final: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Install the one pair of gradient hooks on every trainable master (each once)."""
        assert not self._grad_hooks, "hooked once, when the engine is built"
        self._reducer, self._on_final = reducer, on_final
        seen: set[int] = set()
        for p in params:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if reducer is not None:
                self._grad_hooks.append(p.register_hook(swarm.before_accumulate_hook(reducer, p)))
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, p: nn.Parameter) -> None:
        self.tier.take_grad(p)  # move: into a disk tier's file, unless the update takes it
        if self._reducer is not None:
            self._reducer.after_accumulate(p)  # reduce: final in its bucket
        if self._on_final is not None:
            self._on_final(p)  # mark final: an armed update takes it

    # ---- fetches (the streamer; on its worker thread) ----------------------------------------

    @property
    def fetch_on_worker(self) -> bool:
        """Every fetch must run on the one worker thread, in issue order (a sharded
        store's broadcasts: Note [sharded store])."""
        return self.sharded

    def prefetch(self, params: Sequence[torch.Tensor]) -> None:
        """Start reading ``params``' pages ahead of their fetch."""
        self.tier.prefetch(params, mapped_reads=self.sharded)

    def fetch_flat(self, masters: Sequence[torch.Tensor], dtype: torch.dtype, numel: int, ops):
        """A flat device buffer of ``dtype`` holding ``masters``, then their pages back."""
        try:
            return self.replicas.fetch_flat(masters, dtype, numel, ops, self.tier)
        finally:
            self.tier.release(masters)

    # ---- whole-model reads and loads -----------------------------------------------------------

    def gather_module_state(self, module: nn.Module, state: dict, prefix: str = "") -> None:
        self.replicas.gather_module_state(module, state, prefix)

    def gather_optimizer_state(self, optimizer, state: dict) -> dict:
        return self.replicas.gather_optimizer_state(optimizer, state)

    def load_optimizer_state(self, optimizer, state: dict, load) -> None:
        self.replicas.load_optimizer_state(optimizer, state, load)

    def unowned_names(self, module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
        return self.replicas.unowned_names(module, prefix)

    def close(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        self.tier.close()

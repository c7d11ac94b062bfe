"""SwarmX: data parallelism over torch.distributed (gloo on CPU, NCCL on CUDA; gloo alone
where ranks share a GPU, Note [ranks sharing a device]).

Every rank runs every layer on its share of the global batch. The gradients of
all ranks are reduced (averaged: each rank's loss is a mean over its share,
and the shares are equal, so the mean of the ranks' gradients is the gradient
of the global mean loss) bucket by bucket while the backward runs
(:class:`GradientReducer`, Note [swarm reduce]); with the replicated store
every rank then applies the same update to its own copy, so the copies stay
equal, and with the sharded store each bucket's owner does. Losses for
logging are averaged with :func:`average`.

The transport is torch.distributed only. A rank that dies makes the others'
next collective fail (gloo reports the closed connection) or time out after
``WEIGHTSTREAM_DIST_TIMEOUT`` seconds (default 60); the launcher
(:mod:`weightstream.cli.launch`) then stops the run and names the rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightstream.common.flat import flatten, unflatten_views

# Gradients of parameters outside a streaming plan (layer pipelined) travel in
# buckets of about this many bytes: fewer, larger collectives than one per
# tensor, each started as soon as its gradients are final.
BUCKET_BYTES = 32 * 2**20
# Buckets whose reduction may be in flight at once; starting one more waits for the
# oldest (Note [swarm reduce], "Bounded").
REDUCE_IN_FLIGHT = 2

log = logging.getLogger("weightstream")

# The backend of ranks with a GPU each: gloo for host tensors, NCCL for device tensors.
HOST_AND_CUDA = "cpu:gloo,cuda:nccl"

# Note [ranks sharing a device]
# -----------------------------
# NCCL refuses two ranks of one communicator on one GPU, so ranks that outnumber
# the GPUs their node shows them (LOCAL_WORLD_SIZE > torch.cuda.device_count():
# two ranks on one GPU to test data parallel, or more ranks than GPUs) join a
# process group whose every collective runs on gloo, and take the GPUs round
# robin (local rank modulo the GPUs). Otherwise each rank has a GPU of its own
# and the group is HOST_AND_CUDA: gloo for host tensors, NCCL for device tensors.
# The choice (``backend_for``) reads only LOCAL_WORLD_SIZE and the number of
# visible GPUs, so every rank of a node makes the same one; nodes must be alike.
#
# Weight streaming needs nothing of NCCL: its collectives move host tensors
# (the masters' gradients, the sharded store's weights and whole-state gathers:
# Note [sharded store] in runtime/sharding.py). The few collectives on device
# tensors are the module functions below (the model's buffers broadcast when it
# is built; the loops' loss, token-count and metric sums). Where the group has
# no backend of the device's own (gloo alone, whether chosen here or by a user
# who started the group with "gloo"), they run on a host copy of the tensor
# (``_collective``): gloo takes some CUDA tensors (broadcast, all-reduce) but not
# all collectives, and a host copy of a few scalars a step costs nothing that
# matters. With NCCL present they run on the device tensor as before.
#
# A layer-pipelined model's gradients are device tensors: on gloo alone its
# reducer's all-reduce relies on gloo's own CUDA all-reduce.


def backend_for(device: torch.device, local_ranks: int, devices: int) -> str:
    """The backend the ranks join with: gloo on the CPU; on CUDA, HOST_AND_CUDA when each
    of the ``local_ranks`` ranks of a node has one of its ``devices`` GPUs to itself, and
    gloo alone when they share (Note [ranks sharing a device])."""
    if device.type != "cuda":
        return "gloo"
    return "gloo" if local_ranks > devices else HOST_AND_CUDA


def device_index(local_rank: int, local_ranks: int, devices: int) -> int:
    """The GPU of local rank ``local_rank``: its own, or round robin where the ranks
    outnumber the GPUs (Note [ranks sharing a device])."""
    return local_rank % devices if local_ranks > devices > 0 else local_rank


def ranks_per_device(device: torch.device) -> int:
    """How many of this node's ranks compute on each of its GPUs: more than one where
    they outnumber them (Note [ranks sharing a device]), else 1."""
    if device.type != "cuda" or not dist.is_initialized():
        return 1
    local_ranks, devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    return -(-local_ranks // devices) if local_ranks > devices > 0 else 1


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by the torchrun environment, if there is one."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    # Weight streaming reduces and broadcasts host tensors (the masters' gradients
    # and weights); on CUDA, NCCL serves the device's and gloo the host's, or gloo
    # both where ranks share a GPU (Note [ranks sharing a device]).
    backend = "gloo"
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        devices = torch.cuda.device_count()
        backend = backend_for(device, local_ranks, devices)
        if backend == "gloo":
            log.info(
                "%d ranks on this node share %d GPU(s), and NCCL refuses two ranks on one "
                "GPU: every collective runs on gloo (host tensors; Note [ranks sharing a "
                "device] in weightstream/runtime/swarm.py).",
                local_ranks,
                devices,
            )
        torch.cuda.set_device(device_index(local_rank, local_ranks, devices))
    dist.init_process_group(backend=backend, timeout=timeout())
    # Joined here, so left here: a group still alive when the interpreter shuts down
    # can abort the process ("terminate called without an active exception": gloo's
    # threads outlive it, pytorch#190489). A user's own destroy_process_group first
    # makes this a no-op.
    atexit.register(shutdown)
    return True


def check_host_collectives() -> None:
    """Raise if the process group cannot run collectives on host tensors, which weight
    streaming's data parallel does (the masters, their gradients)."""
    backend = str(dist.get_backend())
    if not host_capable(backend):
        raise RuntimeError(
            f"weightstream: the process group's backend {backend!r} cannot reduce host "
            "tensors, and weight streaming keeps the masters and their gradients in host "
            f"memory. Fix: dist.init_process_group(backend={HOST_AND_CUDA!r}) (or let "
            "weightstream join the group: it does so under torchrun)."
        )


def host_capable(backend: str) -> bool:
    """Whether a backend string (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``) has a
    backend for host tensors."""
    backend = backend.lower()
    if ":" not in backend:
        return backend not in ("nccl", "xccl", "hccl")  # device-only backends
    return any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))


def device_native(backend: str, device_type: str) -> bool:
    """Whether a backend string (``"cpu:gloo,cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``,
    ``"nccl"``, ``"gloo"``) serves tensors of ``device_type`` with a backend other than
    gloo (the device's own, NCCL for CUDA). False: they go through host copies (Note
    [ranks sharing a device])."""
    backend = backend.lower()
    if ":" not in backend:
        return backend != "gloo"
    for part in backend.split(","):
        device, _, name = part.partition(":")
        if device.strip() == device_type:
            return name.strip() != "gloo"
    return False


def _collective(t: torch.Tensor, run: Callable[[torch.Tensor], object]) -> None:
    """``run(t)``, a collective that writes ``t`` in place, on a host copy of ``t`` where
    the group has no backend of ``t``'s device's own (Note [ranks sharing a device])."""
    if t.device.type == "cpu":
        run(t)
        return
    config = getattr(dist, "get_backend_config", dist.get_backend)()
    if device_native(str(config), t.device.type):
        run(t)
        return
    host = t.cpu()  # host sync point
    run(host)
    t.copy_(host)


def timeout() -> datetime.timedelta:
    """How long a collective waits for a lost peer: ``WEIGHTSTREAM_DIST_TIMEOUT`` seconds (60)."""
    return datetime.timedelta(seconds=float(os.environ.get("WEIGHTSTREAM_DIST_TIMEOUT", "60")))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over the ranks (a copy; ``value`` itself with one rank)."""
    if world_size() == 1:
        return value
    out = value.detach().clone()
    _collective(out, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM))  # host sync point
    return out


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The elementwise largest value of a tensor over the ranks (``value`` with one rank)."""
    if world_size() == 1:
        return value
    out = value.detach().clone()
    _collective(out, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))  # host sync point
    return out


def average(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over the ranks (``value`` itself with one rank)."""
    if world_size() == 1:
        return value
    return sum_over_ranks(value) / world_size()


def all_gather_objects(obj) -> list:
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


#: The collectives the compile estimate prices (Note [the roofline] in compiler/estimate.py).
PRICED_COLLECTIVES = ("all_reduce", "broadcast", "reduce")


def collective_costs(nbytes: int = 4 * 2**20, repeats: int = 5) -> dict[str, list[float]]:
    """Each of ``PRICED_COLLECTIVES`` on this run's process group, timed on host tensors
    as SwarmX moves them: ``[seconds a call, seconds a byte]``, from the median of
    ``repeats`` calls of 1 KiB and of ``nbytes``, the slowest rank's (the same on every
    rank). Collective: every rank calls it at the same point."""

    def median_s(op: str, t: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):  # the first: a warm-up
            dist.barrier()
            start = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(t)
            elif op == "broadcast":
                dist.broadcast(t, src=0)
            else:
                dist.reduce(t, dst=0)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    small, large = torch.zeros(256), torch.zeros(max(nbytes // 4, 512))
    measured = []
    for op in PRICED_COLLECTIVES:
        t_small, t_large = median_s(op, small), median_s(op, large)
        per_byte = max(t_large - t_small, 0.0) / (large.nbytes - small.nbytes)
        measured += [t_small, per_byte]
    slowest = max_over_ranks(torch.tensor(measured, dtype=torch.float64)).tolist()
    return {op: slowest[2 * i : 2 * i + 2] for i, op in enumerate(PRICED_COLLECTIVES)}


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers equal to rank 0's."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            _collective(t.data, lambda x: dist.broadcast(x, src=0))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- reduce

# Note [swarm reduce]
# -------------------
# SwarmX reduces gradients in the backward, bucket by bucket, in every training
# loop (the run command's trainer, ``amp.optimizer_step``, a hand-written
# ``loss.backward(); optimizer.step()``): nothing but the backward itself has to
# happen for the ranks' gradients to be averaged.
#
# * Buckets. A streaming engine's bucket is a unit of its structural plan,
#   fixed when the engine is built (units sharing a parameter, a tied
#   embedding, form one bucket; the traced plan of the first call may group
#   parameters otherwise, and only the streaming follows it), merged with its
#   neighbours of the same owner until it holds StreamingConfig's
#   reduce_bucket_bytes (``coalesce``): small units share a collective, a
#   large unit keeps its own; a resident model's are runs of about
#   BUCKET_BYTES of parameters. A post-accumulate-grad hook on each parameter
#   notes that its gradient of this backward is final (autograd has summed
#   every use of it); when a bucket's last parameter is final its gradients
#   are flattened and the collective starts asynchronously, so it runs while
#   the backward goes on through the units before it. At the end of the
#   backward (a callback queued on autograd's engine) buckets whose parameters
#   got no gradient in part are reduced over the parameters that did, and
#   every collective is waited for: ``p.grad`` after ``backward()``
#   holds the mean over the ranks, as with DDP. Which gradients exist is a
#   property of the graph, the same on every rank, so every rank issues the
#   same collectives in the same order.
# * Replicated store: all-reduce, then divide by the world size; every rank
#   gets the mean. Sharded store: reduce to the bucket's owner, which alone
#   gets the mean; the other ranks drop their gradient (None), so every
#   optimizer skips the parameter there.
# * Gradient accumulation. Under ``no_sync()`` a backward only accumulates
#   locally; the first backward outside it reduces the whole local sum, once
#   per optimizer step. A second backward outside ``no_sync()`` before the
#   step is still exact: a parameter whose gradient holds a reduced mean has
#   that mean set aside before autograd accumulates into it (a pre-accumulate
#   hook), the new local sum is reduced alone, and the mean is added back.
#   Reducing the sum of a mean and a local part again would count the mean
#   N times on a sharded owner.
# * What "the mean" assumes: every rank's loss is a mean over an equal share
#   of the global batch, so the mean of the ranks' gradients is the gradient
#   of the global mean. A loss weighted by a per-rank count (tokens kept by an
#   attention mask) gives each rank's mean its own denominator, and the
#   average of the ranks then differs from one device's mean over the whole
#   batch, as with DDP; weight such losses by a global count.
# * Bounded. At most REDUCE_IN_FLIGHT buckets' reductions are in flight: one
#   more waits for the oldest to land first. A bucket in flight holds its
#   flattened copy (and, on its owner, the gradients too), and a backward that
#   outruns the transport would otherwise hold the whole model's gradients at
#   once on every rank, whatever it owns: two ranks of a sharded store (a 0.5B
#   Llama on the CPU) peaked at 0.81x one rank's host memory while they held
#   0.57x of it between steps. The transport serves one collective of a group
#   at a time, so a deeper queue would not finish sooner. Waiting cannot
#   deadlock: the oldest reduction was issued after its bucket's backward, for
#   which every rank needed only fetches this rank has already issued.
# * Its own process group: the collectives are issued from the autograd
#   thread while a sharded store's weight broadcasts run on the prefetch
#   thread; each thread's collectives must reach every rank in one order.

# Note [changed after the reduce]
# -------------------------------
# On a sharded store each rank holds the reduced gradients of the parameters it
# owns, and no others. A whole-model operation run by the user's own loop
# between ``backward()`` and ``optimizer.step()`` then sees one shard: torch's
# ``clip_grad_norm_`` computes the shard's norm and scales the shard by it, and
# the run trains on, wrong (a transformers Llama on 2 ranks: 0.0074 away from
# eager PyTorch in the weights). weightstream's own whole-model operations
# (the GradScaler's unscale and non-finite check, ``optimizer_step``'s and the
# compiled module's ``clip_grad_norm_``, which sum the squares over the ranks)
# are exact, and tell the reducer so (``rewritten``).
#
# So the reducer records each reduced gradient's ``_version`` (autograd's count
# of in-place writes) as it lands, and the engine's ``apply_step`` asks, before
# any update, which owned gradients something else changed in place or
# replaced since. The answer is summed over the ranks (a rank that owns no
# changed gradient must stop too, or it would wait in the next collective), and
# any change stops the step on every rank with an error that names the fix;
# the masters and the optimizer state are untouched. A loop that only reads the
# gradients, or drops them (``zero_grad`` before a skipped step), passes. An
# elementwise change (``clip_grad_value_``) would be exact on a shard too, but
# the version cannot tell it from a norm's scaling: it goes through the
# compiled module's ``clip_grad_value_``. The replicated store gives every rank
# every gradient, so torch's functions see the whole model there, and nothing
# is checked.
#
# A torch.optim optimizer's ``step()`` does not come through the engine: the
# same check runs before it, from torch's global optimizer step pre-hook (the
# engine's, for optimizers over its masters). An update that still escapes it
# (a parameter written in place by hand) is seen by the next forward, an owned
# master changed after its gradient landed, which warns once that nothing was
# checked.


def before_accumulate_hook(
    reducer: GradientReducer, p: torch.nn.Parameter
) -> Callable[[torch.Tensor], None]:
    """A tensor hook of ``p`` calling ``reducer.before_accumulate(p)`` (set aside a mean
    reduced earlier in this step)."""

    def hook(_grad: torch.Tensor) -> None:
        reducer.before_accumulate(p)

    return hook


@dataclass
class _InFlight:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    work: object  # torch.distributed Work
    owner: int | None  # the rank it was reduced to; None: all of them


class GradientReducer:
    """Averages gradients over the ranks bucket by bucket as the backward produces them.

    Args:
        buckets: parameter lists in forward order (Note [swarm reduce]).
        owners: each bucket's owner rank (a sharded store), or None: every rank
            gets the mean (a replicated store).
        note: called with (event, bucket) when a bucket's reduction starts, for
            tests and traces; None: nothing is recorded.
        install_hooks: register its own gradient hooks on the parameters (a resident
            model's); False: the store's one gradient hook calls ``before_accumulate``
            and ``after_accumulate`` (Note [one gradient hook] in runtime/memoryx.py).

    Owner: the engine (or compiled module) of one model; ``close()`` removes its hooks.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[torch.nn.Parameter]],
        owners: Sequence[int] | None = None,
        note: Callable[[str, int], None] | None = None,
        install_hooks: bool = True,
    ):
        assert dist.is_initialized()
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.owners = None if owners is None else list(owners)
        self._note = note
        self.buckets: list[list[torch.nn.Parameter]] = []
        self._bucket_of: dict[int, int] = {}
        for params in buckets:
            mine = [p for p in params if p.requires_grad and id(p) not in self._bucket_of]
            for p in mine:
                self._bucket_of[id(p)] = len(self.buckets)
            self.buckets.append(mine)
        # Owner: this reducer. Why: see the Note (collectives from the autograd thread).
        # new_group is collective: every rank builds its reducer at the same point.
        self.group = dist.new_group(timeout=timeout())
        self._sync = True
        self._final: list[set[int]] = [set() for _ in self.buckets]  # final in this backward
        self._started: set[int] = set()  # buckets whose reduction started in this backward
        self._in_flight: list[_InFlight] = []
        self._callback_queued = False
        self._reduced: set[int] = set()  # id(p) whose .grad holds a reduced mean
        self._set_aside: dict[int, torch.Tensor] = {}  # id(p) -> its mean, during a backward
        # A sharded owner's reduced gradients as the reduction left them: id(p) ->
        # (p, its gradient, the gradient's _version, p's _version) (Note [changed after
        # the reduce]).
        self._landed: dict[int, tuple[torch.nn.Parameter, weakref.ref, int, int]] = {}
        # id(p) of a sharded store's parameters that every rank holds (its device tier's,
        # Note [sharded store]): all-reduced whatever their bucket's owner.
        self._everywhere: set[int] = set()
        self._hooks = []
        if install_hooks:
            for params in self.buckets:
                for p in params:
                    self._hooks.append(p.register_hook(before_accumulate_hook(self, p)))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self.after_accumulate))

    # ---- hooks (autograd thread) ---------------------------------------------------------

    def before_accumulate(self, p: torch.nn.Parameter) -> None:
        """Autograd is about to accumulate a gradient of ``p``."""
        self._queue_finish()
        if id(p) in self._reduced:
            # A reduced mean from an earlier backward of this step: set it aside
            # so that only the new local part is reduced (see the Note).
            self._reduced.discard(id(p))
            if p.grad is not None:
                self._set_aside[id(p)] = p.grad.detach().clone()
                p.grad = None

    def after_accumulate(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient of this backward is accumulated: its bucket may start."""
        b = self._bucket_of.get(id(p))
        if b is None:
            return  # not reduced here (frozen, or outside the buckets)
        self._queue_finish()
        if not self._sync:
            return
        final = self._final[b]
        final.add(id(p))
        if len(final) == len(self.buckets[b]):
            self._start(b)

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _finish_backward(self) -> None:
        """End of a backward: reduce the partly final buckets, then wait for all."""
        self._callback_queued = False
        if self._sync:
            for b, final in enumerate(self._final):
                if final and b not in self._started:
                    self._start(b)
        for final in self._final:
            final.clear()
        self._started.clear()
        self.wait()

    # ---- collectives ----------------------------------------------------------------------

    def _start(self, b: int) -> None:
        self._started.add(b)
        params = [p for p in self.buckets[b] if id(p) in self._final[b] and p.grad is not None]
        if not params:
            return
        if self._note is not None:
            self._note("reduce_start", b)
        by_kind: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in params:
            kind = (p.grad.dtype, p.grad.device, id(p) in self._everywhere)
            by_kind.setdefault(kind, []).append(p)
        for (*_, everywhere), same in by_kind.items():
            owner = None if self.owners is None or everywhere else self.owners[b]
            grads = [p.grad for p in same]
            # One contiguous gradient is reduced in place: no copy of the largest
            # tensors (an embedding, a head) to hold or to write back.
            lone = len(grads) == 1 and grads[0].is_contiguous()
            flat = grads[0].detach().view(-1) if lone else flatten(grads)
            if owner is None:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                work = dist.reduce(
                    flat, dst=owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True
                )
                if owner != self.rank:
                    for p in same:
                        p.grad = None  # sent: only the owner keeps this gradient
                        self._set_aside.pop(id(p), None)
            self._in_flight.append(_InFlight(same, flat, work, owner))
        while len(self._in_flight) > REDUCE_IN_FLIGHT:  # bounded (Note [swarm reduce])
            self._land(self._in_flight.pop(0))

    def wait(self) -> None:
        """Wait for every started reduction and put the means into ``p.grad``."""
        in_flight, self._in_flight = self._in_flight, []
        for item in in_flight:
            self._land(item)

    def _land(self, item: _InFlight) -> None:
        """Wait for one reduction; on a rank that keeps its mean, put it into ``p.grad``."""
        item.work.wait()  # host sync point
        if item.owner is None or item.owner == self.rank:
            item.flat.div_(self.world)
            grads = [p.grad for p in item.params]
            for p, mean in zip(item.params, unflatten_views(item.flat, grads)):
                # In place: the gradient keeps its storage (a disk store's file).
                if mean.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(mean)
                earlier = self._set_aside.pop(id(p), None)
                if earlier is not None:
                    p.grad.add_(earlier)
                self._reduced.add(id(p))
                if self.owners is not None:
                    landed = (p, weakref.ref(p.grad), p.grad._version, p._version)
                    self._landed[id(p)] = landed

    def replicate(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Every rank holds ``params`` from now on: their gradients are all-reduced."""
        self._everywhere.update(id(p) for p in params)

    def rewritten(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The gradients of ``params`` were rewritten in place by an operation that saw
        the whole model (unscaling, clipping by the global norm or by value): their new
        values count as the reduced ones."""
        for p in params:
            entry = self._landed.get(id(p))
            if entry is not None and p.grad is not None and entry[1]() is p.grad:
                self._landed[id(p)] = (p, entry[1], p.grad._version, entry[3])

    def changed_after_reduce(self) -> list[torch.nn.Parameter]:
        """The owned parameters whose gradient something else changed or replaced after
        its reduction landed; forgets every record (Note [changed after the reduce])."""
        changed = []
        for p, ref, version, _ in self._landed.values():
            g = ref()
            if g is None:
                if p.grad is not None:
                    changed.append(p)  # replaced by another tensor (None: dropped)
            elif p.grad is not g or g._version != version:
                changed.append(p)
        self._landed.clear()
        return changed

    def stepped_elsewhere(self) -> bool:
        """Whether an owned master changed after its gradient landed with no
        ``changed_after_reduce`` since: an optimizer whose step does not come through
        the engine (torch.optim's own) updated it, unchecked. Forgets every record."""
        stepped = any(p._version != version for p, _, _, version in self._landed.values())
        self._landed.clear()
        return stepped

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate locally (all micro-batches but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def coalesce(
    buckets: Sequence[Sequence[torch.nn.Parameter]],
    owners: Sequence[int] | None,
    cap: int,
) -> tuple[list[list[torch.nn.Parameter]], list[int] | None, list[list[int]]]:
    """Merge neighbouring buckets of one owner into buckets of at least ``cap`` bytes.

    Walks the buckets in backward order (the order their gradients become final)
    and closes a merged bucket once it holds ``cap`` bytes, so small units share
    one collective while a unit of ``cap`` bytes or more keeps its own (as DDP's
    bucket_cap_mb). Returns the merged buckets and owners in forward order, and
    for each the indices of the buckets it took.
    """
    merged: list[tuple[list[int], int | None]] = []
    current: list[int] = []
    size = 0
    for b in reversed(range(len(buckets))):
        owner = None if owners is None else owners[b]
        if current and (size >= cap or (owners is not None and owners[current[0]] != owner)):
            merged.append((current, None if owners is None else owners[current[0]]))
            current, size = [], 0
        current.append(b)
        size += sum(p.numel() * p.element_size() for p in buckets[b])
    if current:
        merged.append((current, None if owners is None else owners[current[0]]))
    merged.reverse()
    out_buckets = [[p for b in sorted(idx) for p in buckets[b]] for idx, _ in merged]
    out_owners = None if owners is None else [o for _, o in merged]
    return out_buckets, out_owners, [sorted(idx) for idx, _ in merged]


def resident_buckets(params: Sequence[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Runs of about BUCKET_BYTES of ``params`` (a model without a streaming plan)."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if size >= BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return [b for b in buckets if b]


class EventLog:
    """(event, unit name, seconds) of an engine's streaming and reduce events, when enabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[str, str, float]] = []

    def __call__(self, event: str, unit: str) -> None:
        if self.enabled:
            self.events.append((event, unit, time.perf_counter()))

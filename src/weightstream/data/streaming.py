"""Who streams input data, and how much of a batch each streamer sends.

In the reference system the input workers of each CS-X stream the data. Here
every data-parallel rank of ``torch.distributed`` builds and streams its own
loader (design.md: past one machine we run data parallel over
torch.distributed), so the streamers are the ranks: ``num_streamers()`` is the
world size and ``get_streaming_rank()`` the rank. Before the process group
is initialized they come from torchrun's environment (RANK, WORLD_SIZE), so a
loader built before ``cstorch.compile`` joins the ranks sees them too; without
either a run is one streamer of rank 0.

These are functions, not cached values, because the process group may be
initialized after this module is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from weightstream.data._checks import check_int

__all__ = [
    "batch_size_of",
    "get_streaming_batch_size",
    "get_streaming_rank",
    "is_streamer",
    "num_streamers",
    "rank_share",
]


class _Watch:
    consulted = False


# While the DataLoader calls an input_fn: whether it asked which rank it is
# (Note [rank share]).
_watch: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar(
    "weightstream_streaming_watch", default=None
)


@contextlib.contextmanager
def watching() -> Iterator[_Watch]:
    """Note whether code inside asks for the rank, the number of streamers or a share."""
    watch = _Watch()
    token = _watch.set(watch)
    try:
        yield watch
    finally:
        _watch.reset(token)


def _consulted() -> None:
    watch = _watch.get()
    if watch is not None:
        watch.consulted = True


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _launched() -> tuple[int, int] | None:
    """(rank, world size) from torchrun's environment, before the process group exists.

    ``cstorch.compile`` joins the ranks; a DataLoader built before it must see
    them already (Note [rank share]).
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def _rank_and_world() -> tuple[int, int]:
    """(rank, world size); asking counts as consulting them (Note [rank share])."""
    _consulted()
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return _launched() or (0, 1)


def num_streamers() -> int:
    """The number of processes streaming input: the world size, or 1 when not distributed."""
    return _rank_and_world()[1]


def get_streaming_rank() -> int:
    """This process's index among the streamers: the rank, or 0 when not distributed."""
    return _rank_and_world()[0]


def is_streamer() -> bool:
    """Whether this process streams input data.

    Always True here: every rank feeds its own share of the batch (there is no
    separate user process that only drives the run, as in the reference
    appliance), so code guarded by ``if is_streamer():`` runs on every rank.
    """
    return True


def get_streaming_batch_size(global_batch: int) -> int:
    """The per-streamer batch size for a global batch of ``global_batch`` samples.

    Raises ValueError when the global batch does not divide evenly across the
    streamers, since data-parallel ranks must step on equal shares.
    """
    check_int("global_batch", global_batch, minimum=1)
    streamers = num_streamers()
    if global_batch % streamers:
        raise ValueError(
            f"The global batch size {global_batch} does not divide by the number of "
            f"streamers ({streamers} data-parallel ranks): each rank must get the same "
            f"share. Use a global batch that is a multiple of {streamers} (e.g. "
            f"{(global_batch // streamers + 1) * streamers}), or change the number of ranks."
        )
    return global_batch // streamers


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (or array); 1 if it has none."""
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim >= 1:
            return int(leaf.shape[0])
    return 1


# Note [rank share]
# -----------------
# Under data parallel every rank builds its own loader with input_fn (the
# reference's contract), and an input_fn written for the reference shards its
# data by rank itself: it asks ``get_streaming_rank()``, ``num_streamers()`` or
# ``get_streaming_batch_size()``, or its loader uses a DistributedSampler. Such
# a loader is left alone. An input_fn that does none of that (a script written
# for one device) makes the same global batches on every rank; the DataLoader
# then gives each rank its share: the contiguous 1/N of every batch's rows at
# the rank's place (rank r of N takes rows r*B/N .. (r+1)*B/N - 1), so N ranks
# together train on exactly the global batch a single device would.
#
# Both rest on what the DataLoader cannot see: which batches input_fn makes on
# each rank. An input_fn that shards by rank some other way (its own slice of
# the data by torch.distributed.get_rank(), a rank read outside input_fn) would
# be taken for global batches and cut again: half the data, silently; ranks
# whose shares differ in size would be averaged as equal shares (a mean of the
# ranks' means, not the global batch's). So the first batch of each iteration
# is compared over the ranks (:func:`check_first_batch`, one small all_gather):
# shared batches must be the same on every rank (a fingerprint of their bytes),
# a rank's own batches of the same size on every rank (else a warning: an
# evaluation may have them of any size); the error says which and how to fix it.


def _fingerprint(batch: Any) -> int:
    """64 bits of a hash of every leaf of ``batch`` (tensors by their bytes)."""
    digest = hashlib.blake2b(digest_size=8)
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous().view(-1)
            digest.update(str((t.dtype, tuple(leaf.shape))).encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            digest.update(repr(leaf).encode())
    return int.from_bytes(digest.digest(), "little", signed=True)


def check_first_batch(batch: Any, shared: bool) -> None:
    """Compare an iteration's first batch over the ranks (Note [rank share]): the same
    batch on every rank where ``shared`` (global batches, each rank takes its share),
    else the same number of samples. Collective: every rank calls it."""
    mine = torch.tensor([_fingerprint(batch) if shared else 0, batch_size_of(batch)])
    every = [torch.empty_like(mine) for _ in range(num_streamers())]
    dist.all_gather(every, mine)
    sizes = [int(t[1]) for t in every]
    if shared and len({int(t[0]) for t in every}) > 1:
        raise ValueError(
            "the DataLoader's first batch differs between the data-parallel ranks (batch "
            f"sizes by rank: {sizes}), but its input_fn asked no rank (get_streaming_rank(), "
            "num_streamers() or get_streaming_batch_size() inside input_fn, or a "
            "DistributedSampler), so each batch was taken for a global batch to share out: "
            "each rank would train on a share of its own batch, and lose the rest. Fix: if "
            "input_fn shards by rank, ask cstorch.utils.data.get_streaming_rank() inside "
            "it; if it does not, make its batches the same on every rank (seed its shuffle)."
        )
    if not shared and len(set(sizes)) > 1:
        # A warning: an evaluation's metrics add up any sizes; training's gradients do not.
        warnings.warn(
            f"weightstream: the data-parallel ranks' first batches have {sizes} samples (by "
            "rank). In training their gradients are averaged as equal shares, so a sample "
            "weighs more on one rank than on another (the mean of the ranks' means, not the "
            "global batch's mean). Fix: give every rank batches of "
            "get_streaming_batch_size(global_batch) samples (drop_last=True for the last).",
            stacklevel=4,
        )


def rank_share(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s rows of every tensor in ``batch`` (Note [rank share])."""

    def share(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        rows = t.shape[0]
        if rows % world:
            raise ValueError(
                f"a batch of {rows} samples does not divide over {world} data-parallel ranks: "
                "each rank takes an equal share of every global batch. Use a batch size that "
                f"is a multiple of {world} (drop_last=True drops a short last batch), or shard "
                "the data in input_fn yourself (get_streaming_batch_size, DistributedSampler)."
            )
        per = rows // world
        return t[rank * per : (rank + 1) * per]

    return pytree.tree_map_only(torch.Tensor, share, batch)

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
import os
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["get_streaming_batch_size", "get_streaming_rank", "is_streamer", "num_streamers"]


class _Watch:
    consulted = False


# While the DataLoader calls an input_fn: whether it asked which rank it is
# (Note [rank share] in data/dataloader.py).
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
    them already (Note [rank share] in data/dataloader.py).
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def num_streamers() -> int:
    """The number of processes streaming input: the world size, or 1 when not distributed."""
    _consulted()
    if _distributed():
        return dist.get_world_size()
    launched = _launched()
    return 1 if launched is None else launched[1]


def get_streaming_rank() -> int:
    """This process's index among the streamers: the rank, or 0 when not distributed."""
    _consulted()
    if _distributed():
        return dist.get_rank()
    launched = _launched()
    return 0 if launched is None else launched[0]


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
    if isinstance(global_batch, bool) or not isinstance(global_batch, int):
        raise TypeError(
            f"global_batch must be an int, got {type(global_batch).__name__} {global_batch!r}."
        )
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}.")
    streamers = num_streamers()
    if global_batch % streamers:
        raise ValueError(
            f"The global batch size {global_batch} does not divide by the number of "
            f"streamers ({streamers} data-parallel ranks): each rank must get the same "
            f"share. Use a global batch that is a multiple of {streamers} (e.g. "
            f"{(global_batch // streamers + 1) * streamers}), or change the number of ranks."
        )
    return global_batch // streamers

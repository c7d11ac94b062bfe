"""What a user's loader holds that decides its order: the parts a restart must put back.

Pure functions over the object ``input_fn`` returned. They only read
attributes that torch's DataLoader documents (``dataset``, ``sampler``,
``batch_sampler``, ``batch_size``, ``generator``) and call the user's own
``state_dict``/``load_state_dict``/``set_epoch``; nothing is stored on the
user's objects.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.data

from weightstream.data.sampler import DistributedSampler
from weightstream.data.steps import loader_length

__all__ = [
    "capture",
    "fast_forward_target",
    "generators",
    "input_workers",
    "is_stateful",
    "set_epoch",
    "shards_itself",
    "splits_over_workers",
    "stateful_parts",
    "trusted_length",
]

_TorchDataLoader = torch.utils.data.DataLoader


def _has(obj: Any, *methods: str) -> bool:
    return all(callable(getattr(obj, m, None)) for m in methods)


def _named_parts(loader: Any) -> dict[str, Any]:
    """The sub-objects of a torch DataLoader by path, each object once (first path wins)."""
    if not isinstance(loader, _TorchDataLoader):
        return {}
    batch_sampler = loader.batch_sampler
    candidates = [
        ("dataset", loader.dataset),
        ("sampler", loader.sampler),
        ("batch_sampler", batch_sampler),
        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
    ]
    parts, seen = {}, set()
    for name, obj in candidates:
        if obj is not None and id(obj) not in seen:
            seen.add(id(obj))
            parts[name] = obj
    return parts


def is_stateful(loader: Any) -> bool:
    """Whether the loader itself saves and restores its position (e.g. torchdata's StatefulDataLoader).

    Such a loader's own state is authoritative: it is restored instead of
    replaying batches.
    """
    return _has(loader, "state_dict", "load_state_dict")


def stateful_parts(loader: Any) -> dict[str, Any]:
    """Dataset and samplers of a torch DataLoader that have state_dict/load_state_dict."""
    return {
        n: o for n, o in _named_parts(loader).items() if _has(o, "state_dict", "load_state_dict")
    }


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The torch.Generators a torch DataLoader and its samplers draw their order from."""
    found, seen = {}, set()
    holders = (
        {"loader": loader, **_named_parts(loader)} if isinstance(loader, _TorchDataLoader) else {}
    )
    for name, obj in holders.items():
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            found[f"{name}.generator"] = gen
    return found


def capture(loader: Any) -> dict:
    """Copies of the generator states and user states that decide the loader's next pass."""
    return {
        "generators": {n: g.get_state() for n, g in generators(loader).items()},
        "user_state": {n: copy.deepcopy(o.state_dict()) for n, o in stateful_parts(loader).items()},
    }


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader (or, for a torch DataLoader, its dataset and samplers) a new epoch begins."""
    if _has(loader, "set_epoch"):
        loader.set_epoch(epoch)
        return
    for obj in _named_parts(loader).values():
        if _has(obj, "set_epoch"):
            obj.set_epoch(epoch)


def trusted_length(loader: Any) -> int | None:
    """``len(loader)`` when it is exact: a torch DataLoader over a map-style dataset, or a sequence.

    Other lengths (an IterableDataset's, a user iterable's) may be estimates,
    so a pass over them ends when they run out.
    """
    if isinstance(loader, Sequence):
        return len(loader)
    if isinstance(loader, _TorchDataLoader) and not splits_over_workers(loader):
        return loader_length(loader)  # None for a sampler without __len__
    return None


def fast_forward_target(loader: Any) -> tuple[DistributedSampler, int] | None:
    """The DistributedSampler that orders the loader, and how many of its items make a batch.

    A restored pass can then skip consumed batches in the sampler instead of
    loading them. Only when nothing else carries state along the pass: a
    torch DataLoader over a map-style dataset without its own state_dict. For
    the same reason the loader's position is then a place in the sampler's
    global order, the same on every rank (Note [global position]).
    """
    if not isinstance(loader, _TorchDataLoader) or splits_over_workers(loader):
        return None
    if _has(loader.dataset, "state_dict", "load_state_dict"):
        return None
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, DistributedSampler):
        return batch_sampler, 1
    if batch_sampler is None and isinstance(loader.sampler, DistributedSampler):
        return loader.sampler, 1
    if isinstance(batch_sampler, torch.utils.data.BatchSampler) and isinstance(
        batch_sampler.sampler, DistributedSampler
    ):
        return batch_sampler.sampler, batch_sampler.batch_size
    return None


def input_workers(loader: Any) -> int | None:
    """The worker processes of a torch DataLoader (``num_workers``); None for other loaders."""
    return loader.num_workers if isinstance(loader, _TorchDataLoader) else None


def splits_over_workers(loader: Any) -> bool:
    """Whether the loader's order depends on its worker count: a torch DataLoader of an IterableDataset.

    Each worker iterates its own copy of such a dataset (which shards itself by
    worker) and torch interleaves their batches, so another ``num_workers``
    gives another order. A map-style dataset is ordered by its sampler in the
    main process, whatever the worker count.
    """
    return isinstance(loader, _TorchDataLoader) and isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    )


def shards_itself(loader: Any) -> bool:
    """Whether ``loader`` (a torch DataLoader) draws its indices with a distributed sampler."""
    samplers = [getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers.append(getattr(batch_sampler, "sampler", None))
    kinds = (DistributedSampler, torch.utils.data.DistributedSampler)
    return any(isinstance(s, kinds) for s in samplers)

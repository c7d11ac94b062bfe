"""``load``: a checkpoint as a lazy read-only mapping, a caching one, or eagerly.

# Note [lazy state dict]

``load(path)`` returns a :class:`LazyStateDict` for the root dict. It is a
real ``dict`` subclass (torch's ``load_state_dict`` functions test
``isinstance(x, dict)``) whose stored values are placeholders; every read path
(``[]``, ``get``, ``items``, ``values``, iteration, ``dict(x)``, ``copy``) is
overridden, and every write raises. Rules:

* a nested dict is another LazyStateDict (one view object per key);
* a leaf is read from the file when it is accessed: each access reads again
  in lazy mode (``map_location=None``), the first read is kept in cache mode
  (``map_location="cache"``);
* a list or tuple is built in full when it is accessed (with the leaves in it
  read), because optimizer ``param_groups`` and the like are lists that torch
  copies and mutates; lists of large tensors are rare in a state dict.

Tied tensors come back as one tensor object in cache and eager modes; a lazy
read returns a fresh tensor per access. The file stays open while any view of
it is alive (closing: :meth:`LazyStateDict.close` or ``with load(p) as sd:``);
since a save replaces a checkpoint by renaming, never in place, an open lazy
checkpoint keeps reading the file it opened even if a newer save replaces it.
``copy.deepcopy`` of a lazy dict materializes it. Pickling it (``torch.save``)
materializes it too, with every dict as an OrderedDict: a dict subclass cannot
pickle as a plain dict, and OrderedDict is the one dict type
``torch.load(weights_only=True)`` rebuilds (so the seed's recipe
``torch.save(cstorch.load(path), "x.pt")`` gives a file torch loads safely). For
exact types use ``torch.save(sd.to_dict(), ...)`` or ``load(path, "cpu")``.
Saving a lazy dict with :func:`save` streams it tensor by tensor.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections import OrderedDict
from collections.abc import Hashable, ItemsView, Mapping, ValuesView
from typing import Any

import torch

from weightstream.checkpoint.opener import open_source
from weightstream.checkpoint.source import Source
from weightstream.checkpoint.tree import (
    Branch,
    Leaf,
    Node,
    Subtree,
    TreeView,
    iter_leaves,
    join_key,
    read_once,
    restore_metadata,
    unflatten,
)


class _Loader:
    """What all views of one loaded checkpoint share: the open source and the cache."""

    def __init__(self, source: Source, cache: bool) -> None:
        self.source = source
        # Cache mode: each value read once (tied keys share it); None: read on every access.
        self.cache = read_once(source.read, lambda k: _slot(source.tie(k), k)) if cache else None
        self.closed = False
        # Close the file when the last view is garbage collected.
        self._finalizer = weakref.finalize(self, source.close)

    def read(self, key: str) -> Any:
        if self.closed:
            raise ValueError(
                f"the checkpoint {self.source.path} was closed; load() it again to read {key!r}."
            )
        return self.source.read(key) if self.cache is None else self.cache(key)

    def materialize(self, node: Node) -> Any:
        """The real nested value of ``node``, tied leaves read once."""
        if self.cache is not None:
            return unflatten(node, self.read)
        return unflatten(node, read_once(self.read, self.source.tie))

    def close(self) -> None:
        self.closed = True
        self._finalizer()


def _slot(tie: Hashable | None, key: str) -> Hashable:
    return ("key", key) if tie is None else tie


def _read_only(*_: Any, **__: Any) -> None:
    raise TypeError(
        "a lazily loaded checkpoint is read-only; call .to_dict() for a mutable copy, or "
        "load it with map_location='cpu'."
    )


class LazyStateDict(dict, TreeView):
    """A dict node of a loaded checkpoint whose leaves are read on access.

    See Note [lazy state dict]. Behaves as a read-only dict: ``sd["model"]``,
    ``sd.items()``, ``model.load_state_dict(sd["model"])`` and
    ``optimizer.load_state_dict(sd["optimizer"])`` work. Extra methods:
    :meth:`to_dict` (read everything into ordinary containers),
    :meth:`close`, and use as a context manager.
    """

    def __init__(self, loader: _Loader, node: Branch, key: str) -> None:
        dict.__init__(self, zip(node.keys, node.children))
        self._loader = loader
        self._node = node
        self._key = key
        self._views: dict[Any, Any] = {}
        if node.kind == "odict":
            metadata = restore_metadata(node.metadata)
            if metadata is not None:
                self._metadata = metadata  # read by Module.load_state_dict

    # -- reading -----------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        node = dict.__getitem__(self, key)
        if isinstance(node, Leaf):
            return self._loader.read(node.key)
        if key in self._views:
            return self._views[key]
        if node.kind in ("dict", "odict"):
            value = LazyStateDict(self._loader, node, join_key(self._key, key))
        else:
            value = self._loader.materialize(node)
            if self._loader.cache is None:
                return value  # lazy mode: a fresh list per access
        self._views[key] = value
        return value

    def describe(self, key: Any):
        """Facts of leaf ``key`` (shape, dtype, ...: a ``LeafInfo``) without reading its data."""
        node = dict.__getitem__(self, key)
        if not isinstance(node, Leaf):
            raise TypeError(f"{join_key(self._key, key)!r} is a container, not a leaf.")
        return self._loader.source.describe(node.key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if dict.__contains__(self, key) else default

    def __iter__(self):
        # Defined in Python on purpose: dict(x) and {**x} then use keys() and
        # __getitem__ instead of copying the placeholders.
        return iter(dict.keys(self))

    def values(self) -> ValuesView:  # type: ignore[override]
        return ValuesView(self)

    def items(self) -> ItemsView:  # type: ignore[override]
        return ItemsView(self)

    def copy(self) -> dict:
        """A plain dict of this level (leaves read, nested dicts still lazy)."""
        return {k: self[k] for k in self}

    __copy__ = copy

    def read_small_values(self) -> None:
        """Read every leaf below this node that is not a tensor, and drop it: a
        damaged value or a pickle (refused without ``allow_pickle``) raises now,
        before a caller that loads tensor by tensor has changed anything."""
        source = self._loader.source
        for leaf in iter_leaves(self._node):
            if source.describe(leaf.key).kind != "tensor":
                self._loader.read(leaf.key)

    def to_dict(self) -> Any:
        """Everything below this node read into ordinary dicts, lists and tuples."""
        return self._loader.materialize(self._node)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.to_dict(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The data, never the open file; every node as an OrderedDict (Note [lazy state dict]).
        value = self.to_dict()
        state = getattr(value, "__dict__", None) or None
        return OrderedDict, (), state, None, iter(value.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Any) -> dict:
        return self.copy() | other

    def __ror__(self, other: Any) -> dict:
        return other | self.copy()

    def __repr__(self) -> str:
        keys = list(dict.keys(self))
        shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        where = f" at {self._key!r}" if self._key else ""
        return f"<LazyStateDict {self._loader.source.path}{where}: {len(keys)} keys [{shown}]>"

    # -- writing is refused ------------------------------------------------

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    pop = popitem = setdefault = update = clear = _read_only  # type: ignore[assignment]

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Close the file (every view of this checkpoint stops reading)."""
        self._loader.close()

    def __enter__(self) -> LazyStateDict:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ws_subtree(self) -> Subtree:
        source = self._loader.source
        return self._node, self._loader.read, source.tie, source.describe


def load(
    path: str | os.PathLike,
    map_location: str | torch.device | None = None,
    *,
    allow_pickle: bool = False,
    allow_incomplete: bool = False,
    mmap: bool | None = None,
    verify: bool = True,
) -> Any:
    """Load a checkpoint saved by :func:`save` (or the reference system, or another format).

    Args:
        path: an H5 checkpoint (ours or the reference system's), a safetensors
            file, a Hugging Face sharded checkpoint (its
            ``model.safetensors.index.json`` or the directory holding it), or,
            with ``allow_pickle=True`` only, a ``torch.save`` file.
        map_location: None (default): a lazy read-only mapping; tensors are
            read from the file on access (Note [lazy state dict]). "cache":
            the same, but each value is read once and kept. "cpu", another
            device string or a ``torch.device``: everything is read now and
            placed there.
        allow_pickle: permit unpickling (torch.save files, and values this
            format stores pickled). Unpickling can run arbitrary code: only
            for files you trust.
        allow_incomplete: read an H5 file that lacks the ``__SUCCESS__``
            marker (only for files of old releases that did not write it).
        mmap: map uncompressed tensors from the file instead of copying them
            (copy-on-write; see Note [fast reads]). Faster and lighter for
            large checkpoints; the file must not be truncated in place while
            the tensors live (weightstream's saves replace, never truncate).
            None (default): mapped in lazy mode, where a value is read for a
            use and then dropped (so ``model.load_state_dict(load(p)["model"])``
            never holds the whole model: Note [bounded loads]), copied in the
            other modes.
        verify: check each tensor's stored checksum (default) when reading it.

    Raises:
        CheckpointError (a ValueError) naming the file, the problem and the
        fix: an incomplete, truncated or corrupted file, a missing dataset,
        a pickle without ``allow_pickle``.
    """
    mode, device = _parse_map_location(map_location)
    if mmap is None:
        mmap = mode == "lazy"
    source = open_source(
        path,
        allow_pickle=allow_pickle,
        allow_incomplete=allow_incomplete,
        mmap=mmap,
        verify=verify,
    )
    if mode == "eager":
        with source:
            return _materialize_on(source, device)
    loader = _Loader(source, cache=mode == "cache")
    tree = source.tree
    if isinstance(tree, Branch) and tree.kind in ("dict", "odict"):
        return LazyStateDict(loader, tree, "")
    try:
        return loader.materialize(tree)  # a root list or leaf is read at once
    finally:
        loader.close()


def _parse_map_location(map_location: Any) -> tuple[str, torch.device | None]:
    if map_location is None:
        return "lazy", None
    if map_location == "cache":
        return "cache", None
    if isinstance(map_location, (str, torch.device)):
        try:
            return "eager", torch.device(map_location)
        except (RuntimeError, ValueError) as e:
            raise ValueError(
                f"load(): map_location={map_location!r} is not a device ({e}); use None "
                "(lazy), 'cache', 'cpu' or a device such as 'cuda:0'."
            ) from e
    raise TypeError(
        f"load(): map_location must be None (lazy), 'cache', 'cpu', a device string or a "
        f"torch.device, not {type(map_location).__name__}."
    )


def _materialize_on(source: Source, device: torch.device) -> Any:
    """Read every leaf (tied ones once) and place tensors on ``device``, one at a time."""

    def read(key: str) -> Any:
        value = source.read(key)
        if isinstance(value, torch.Tensor) and value.device != device:
            return _to_device(value, device)
        return value

    return unflatten(source.tree, read_once(read, source.tie))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(t.detach().to(device), requires_grad=t.requires_grad)
    return t.to(device)

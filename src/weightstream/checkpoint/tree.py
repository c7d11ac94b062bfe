"""The state as a tree: its spec (:class:`Leaf`, :class:`Branch`), flattening, JSON.

A checkpoint stores the leaves of a nested state under flattened keys (Note
[checkpoint layout] in ``format.py``) and the nesting as a tree spec, so that
:func:`unflatten` rebuilds what was saved. Pure functions shared by the
writers, the readers and the converters of every format; nothing here knows a
file format.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

_SPEC_FORMAT = "weightstream.tree"
_SPEC_VERSION = 1


# --------------------------------------------------------------------------
# The tree spec
# --------------------------------------------------------------------------


@dataclass
class Leaf:
    """A leaf of the state; ``key`` is its flattened key."""

    key: str


@dataclass
class Branch:
    """A container of the state.

    kind: "dict", "odict" (an OrderedDict, e.g. a module's state_dict),
    "list" or "tuple". ``keys`` are the dict keys (str, int, float, bool or
    None) or the positions for lists and tuples. ``metadata`` is an
    OrderedDict's ``_metadata`` (module versions) when it is JSON-serializable.
    """

    kind: str
    keys: list
    children: list
    metadata: Any = None


Node = Leaf | Branch

_SIMPLE_KEY_TYPES = (str, int, float, bool, type(None))


def join_key(prefix: str, key: Any) -> str:
    """Flattened key of ``key`` inside the container at ``prefix``."""
    return str(key) if prefix == "" else f"{prefix}.{key}"


def iter_leaves(node: Node):
    """Yield every Leaf of ``node`` in order."""
    if isinstance(node, Leaf):
        yield node
        return
    for child in node.children:
        yield from iter_leaves(child)


def rekey(node: Node, prefix: str) -> tuple[Node, list[tuple[str, str]]]:
    """Copy of ``node`` placed at ``prefix``; also returns (new key, old key) pairs."""
    pairs: list[tuple[str, str]] = []

    def visit(n: Node, key: str) -> Node:
        if isinstance(n, Leaf):
            pairs.append((key, n.key))
            return Leaf(key)
        children = [visit(c, join_key(key, k)) for k, c in zip(n.keys, n.children)]
        return Branch(n.kind, list(n.keys), children, n.metadata)

    return visit(node, prefix), pairs


def find_subtree(node: Node, key: str) -> Node | None:
    """The node whose flattened key is ``key`` ("" is the root), or None."""
    if key == "":
        return node
    if isinstance(node, Leaf):
        return None
    for k, child in zip(node.keys, node.children):
        name = str(k)
        if key == name:
            return child
        if key.startswith(name + "."):
            found = find_subtree(child, key[len(name) + 1 :])
            if found is not None:
                return found
    return None


def tree_to_json(node: Node) -> str:
    """The ``__spec__`` attribute: the tree as JSON.

    A leaf is ``null``; a container is ``{"dict": [[key, node], ...]}`` (also
    ``"odict"``, with ``"metadata"``), ``{"list": [node, ...]}`` or
    ``{"tuple": [...]}``. Dict keys keep their JSON type (string, number,
    true/false, null), so int keys (optimizer state) come back as ints.
    """

    def enc(n: Node) -> Any:
        if isinstance(n, Leaf):
            return None
        if n.kind in ("dict", "odict"):
            out: dict[str, Any] = {n.kind: [[k, enc(c)] for k, c in zip(n.keys, n.children)]}
            if n.metadata is not None:
                out["metadata"] = n.metadata
            return out
        return {n.kind: [enc(c) for c in n.children]}

    doc = {"format": _SPEC_FORMAT, "version": _SPEC_VERSION, "tree": enc(node)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=True)


def is_tree_json(text: str) -> bool:
    """True when ``text`` looks like our JSON spec (the reference's is hex)."""
    return text.lstrip().startswith("{")


def tree_from_json(text: str) -> Node:
    """Inverse of :func:`tree_to_json`; raises ValueError on a malformed spec."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != _SPEC_FORMAT:
        raise ValueError("not a weightstream tree spec")
    if doc.get("version") != _SPEC_VERSION:
        raise ValueError(f"unsupported tree spec version {doc.get('version')!r}")

    def dec(obj: Any, key: str) -> Node:
        if obj is None:
            return Leaf(key)
        if not isinstance(obj, dict):
            raise ValueError(f"bad node at {key!r}")
        for kind in ("dict", "odict"):
            if kind in obj:
                pairs = obj[kind]
                if not isinstance(pairs, list) or not all(
                    isinstance(p, list) and len(p) == 2 for p in pairs
                ):
                    raise ValueError(f"bad {kind} node at {key!r}")
                keys = [p[0] for p in pairs]
                if not all(isinstance(k, _SIMPLE_KEY_TYPES) for k in keys):
                    raise ValueError(f"bad dict key at {key!r}")
                children = [dec(p[1], join_key(key, p[0])) for p in pairs]
                return Branch(kind, keys, children, obj.get("metadata"))
        for kind in ("list", "tuple"):
            if kind in obj:
                items = obj[kind]
                if not isinstance(items, list):
                    raise ValueError(f"bad {kind} node at {key!r}")
                children = [dec(c, join_key(key, i)) for i, c in enumerate(items)]
                return Branch(kind, list(range(len(items))), children)
        raise ValueError(f"unknown node at {key!r}")

    return dec(doc.get("tree"), "")


def _json_metadata(metadata: Any) -> Any:
    """A state_dict's ``_metadata`` as JSON-able [[prefix, {...}], ...], or None."""
    if not isinstance(metadata, dict):
        return None
    pairs = [[k, v] for k, v in metadata.items()]
    try:
        if json.loads(json.dumps(pairs)) != pairs:
            return None
    except (TypeError, ValueError):
        return None
    return pairs


def restore_metadata(pairs: Any) -> Any:
    """Inverse of :func:`_json_metadata` (an OrderedDict, as torch builds it)."""
    if not isinstance(pairs, list):
        return None
    return OrderedDict((k, v) for k, v in pairs)


# --------------------------------------------------------------------------
# Deferred leaves: values read only when the writer needs them
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deferred:
    """A leaf whose value is read on demand (streaming a checkpoint into another).

    ``get()`` reads it; ``tie()`` gives a hashable identity of the stored object
    (equal for keys linked to one dataset) or None; ``info()`` describes the
    value without reading it (a :class:`~weightstream.checkpoint.source.LeafInfo`).
    """

    get: Callable[[], Any]
    tie: Callable[[], Hashable | None]
    info: Callable[[], Any]


# A stored tree's node and, for a leaf key of it: how to read it, its tie, its description.
Subtree = tuple[Node, Callable[[str], Any], Callable[[str], Hashable | None], Callable[[str], Any]]


class TreeView:
    """Mixin for objects that are a view of a stored tree (the lazy state dict).

    :func:`flatten` grafts such a view (its ``_ws_subtree``) as :class:`Deferred`
    leaves instead of reading it, so ``save(load(path), other)`` streams tensor by tensor.
    """

    def _ws_subtree(self) -> Subtree:
        raise NotImplementedError


# --------------------------------------------------------------------------
# Flattening
# --------------------------------------------------------------------------


@dataclass
class Flattened:
    """A state split into its tree and its leaves, in order."""

    tree: Node
    leaves: list[tuple[str, Any]] = field(default_factory=list)


def flatten(state: Any) -> Flattened:
    """Split ``state`` into a tree spec and (flattened key, value) leaves.

    Containers: dict (and dict subclasses other than OrderedDict, stored as
    dict), OrderedDict, list, tuple. A dict whose keys are not all str, int,
    float, bool or None, and tuple subclasses (namedtuples, torch.Size) are
    leaves. Raises ValueError on a reference cycle.
    """
    out = Flattened(tree=Leaf(""))
    on_path: set[int] = set()

    def visit(x: Any, key: str) -> Node:
        if isinstance(x, TreeView):
            node, read, tie, info = x._ws_subtree()
            new_node, pairs = rekey(node, key)
            for new_key, old_key in pairs:
                deferred = Deferred(
                    lambda k=old_key: read(k),
                    lambda k=old_key: tie(k),
                    lambda k=old_key: info(k),
                )
                out.leaves.append((new_key, deferred))
            return new_node
        kind = _container_kind(x)
        if kind is None:
            out.leaves.append((key, x))
            return Leaf(key)
        if id(x) in on_path:
            raise ValueError(
                f"save(): the state contains a reference cycle at key {key!r}; "
                "a checkpoint must be a tree. Remove the back-reference."
            )
        on_path.add(id(x))
        try:
            if kind in ("dict", "odict"):
                keys = list(x.keys())
                children = [visit(x[k], join_key(key, k)) for k in keys]
                metadata = _json_metadata(getattr(x, "_metadata", None))
                return Branch(kind, keys, children, metadata)
            items = list(x)
            children = [visit(v, join_key(key, i)) for i, v in enumerate(items)]
            return Branch(kind, list(range(len(items))), children)
        finally:
            on_path.discard(id(x))

    out.tree = visit(state, "")
    return out


def _container_kind(x: Any) -> str | None:
    if isinstance(x, dict):
        if not all(type(k) in _SIMPLE_KEY_TYPES for k in x):
            return None  # keys JSON cannot carry: the dict is pickled whole
        return "odict" if isinstance(x, OrderedDict) else "dict"
    if isinstance(x, list):
        return "list"
    if type(x) is tuple:
        return "tuple"
    return None


def read_once(
    read: Callable[[str], Any], tie: Callable[[str], Hashable | None]
) -> Callable[[str], Any]:
    """``read`` for :func:`unflatten`, keys of one ``tie`` identity read once (tied tensors)."""
    seen: dict[Hashable, Any] = {}

    def value_of(key: str) -> Any:
        slot = tie(key)
        if slot is None:
            return read(key)
        if slot not in seen:
            seen[slot] = read(key)
        return seen[slot]

    return value_of


def resolve_leaves(flat: Flattened) -> Callable[[str], Any]:
    """``value_of(key)`` for :func:`unflatten` of ``flat``: reads deferred leaves,
    tied ones once."""
    values = dict(flat.leaves)
    deferred = {k: v for k, v in flat.leaves if isinstance(v, Deferred)}
    return read_once(
        lambda k: deferred[k].get() if k in deferred else values[k],
        lambda k: deferred[k].tie() if k in deferred else None,
    )


def unflatten(node: Node, value_of: Callable[[str], Any]) -> Any:
    """Rebuild the nested state from ``node``; ``value_of(key)`` gives each leaf."""
    if isinstance(node, Leaf):
        return value_of(node.key)
    values = [unflatten(c, value_of) for c in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, values))
    if node.kind == "odict":
        result = OrderedDict(zip(node.keys, values))
        metadata = restore_metadata(node.metadata)
        if metadata is not None:
            result._metadata = metadata  # type: ignore[attr-defined]
        return result
    if node.kind == "list":
        return values
    return tuple(values)

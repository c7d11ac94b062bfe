"""Decode the reference system's ``__spec__`` without running pickle code.

The reference writes ``__spec__`` as ``dill.dumps(TreeSpec).hex()``, the
``torch.utils._pytree`` spec of the saved state. Unpickling arbitrary bytes can
run code, so this module uses an unpickler whose ``find_class`` admits only
the handful of names such a spec contains (TreeSpec, LeafSpec, the builtin
container types, OrderedDict, dill's builtin-type loader) and maps the two
spec classes to inert stand-ins. Anything else (a namedtuple node, a custom
pytree type) makes decoding fail, and the reader falls back to a flat dict
keyed by the dataset names.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict, defaultdict
from typing import Any

from weightstream.checkpoint.tree import Branch, Leaf, Node, join_key


class _SpecStub:
    """Inert stand-in for ``torch.utils._pytree.TreeSpec`` (any torch version)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.type = args[0] if args else kwargs.get("type")
        self.context = args[1] if len(args) > 1 else kwargs.get("context")
        self.children_specs = list(args[2]) if len(args) > 2 else kwargs.get("children_specs", [])

    def __setstate__(self, state: Any) -> None:
        # torch < 2.2 pickles the instance __dict__; newer releases a list
        # [type, context, children_specs, num_nodes, num_leaves, num_children];
        # a slotted dataclass gives (None, {slots}).
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.type = state.get("type")
            self.context = state.get("context")
            self.children_specs = list(state.get("children_specs", state.get("children", [])))
        elif isinstance(state, (list, tuple)) and len(state) >= 3:
            self.type, self.context, self.children_specs = state[0], state[1], list(state[2])
        else:
            raise pickle.UnpicklingError("unrecognised TreeSpec state")


class _LeafStub(_SpecStub):
    """Inert stand-in for ``torch.utils._pytree.LeafSpec``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(None, None, [])


_DILL_TYPES = {
    "dict": dict,
    "DictType": dict,
    "list": list,
    "ListType": list,
    "tuple": tuple,
    "TupleType": tuple,
    "NoneType": type(None),
}


def _dill_load_type(name: str) -> type:
    if name not in _DILL_TYPES:
        raise pickle.UnpicklingError(f"type {name!r} is not allowed in a spec")
    return _DILL_TYPES[name]


def _reconstructor(cls: type, base: type, state: Any) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, _SpecStub)):
        raise pickle.UnpicklingError("only spec objects may be reconstructed")
    return cls.__new__(cls)


_ALLOWED = {
    ("torch.utils._pytree", "TreeSpec"): _SpecStub,
    ("torch.utils._pytree", "LeafSpec"): _LeafStub,
    # builtins; __builtin__ in protocol 0-2 pickles
    **{
        (m, t.__name__): t for m in ("builtins", "__builtin__") for t in (dict, list, tuple, object)
    },
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "defaultdict"): defaultdict,
    ("dill._dill", "_load_type"): _dill_load_type,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("copy_reg", "_reconstructor"): _reconstructor,
}


class _SpecUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed in a checkpoint spec"
            ) from None


def decode_reference_spec(text: str) -> Node:
    """The tree of a reference ``__spec__`` (hex of a pickled TreeSpec).

    Raises ValueError (or pickle.UnpicklingError) when the spec holds anything
    but dict, OrderedDict, list and tuple nodes.
    """
    data = bytes.fromhex(text.strip())
    spec = _SpecUnpickler(io.BytesIO(data)).load()
    return _to_tree(spec, "")


def _to_tree(spec: Any, key: str) -> Node:
    if not isinstance(spec, _SpecStub):
        raise ValueError(f"unexpected object in spec at {key!r}")
    if isinstance(spec, _LeafStub) or spec.type is None:
        return Leaf(key)
    children = spec.children_specs
    if spec.type in (dict, defaultdict, OrderedDict):
        keys = list(spec.context) if spec.context is not None else []
        # torch >= 2.2 may store a defaultdict's context as [factory, keys].
        if spec.type is defaultdict and len(keys) == 2 and isinstance(keys[1], list):
            keys = keys[1]
        if len(keys) != len(children):
            raise ValueError(f"spec at {key!r} has {len(keys)} keys, {len(children)} children")
        kind = "odict" if spec.type is OrderedDict else "dict"
        nodes = [_to_tree(c, join_key(key, k)) for k, c in zip(keys, children)]
        return Branch(kind, keys, nodes)
    if spec.type in (list, tuple):
        kind = "list" if spec.type is list else "tuple"
        nodes = [_to_tree(c, join_key(key, i)) for i, c in enumerate(children)]
        return Branch(kind, list(range(len(children))), nodes)
    raise ValueError(f"unsupported node type {spec.type!r} in spec at {key!r}")

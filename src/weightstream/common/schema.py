"""Typed settings: one mechanism checks every settings dataclass of the params file.

A section of the params file is a dataclass next to the component it configures
(``StreamingConfig`` in runtime/config.py, ``InputParams`` in data/, ...). Its
fields carry their annotation and a :func:`setting` with the documentation, the
bounds, the fix to suggest and the other names the setting is accepted under;
:func:`check` checks (and normalises) an instance against all of it, and
:func:`known_keys` takes a section's raw mapping: aliases resolved, unknown keys
refused with the nearest valid ones. ``docs/params.md`` is generated from
the same fields (``weightstream.cli.params_doc``).

Why not pydantic: YAML gives lists where a field wants a tuple, ints where it
wants a float, and a user who quotes a number should hear so; pydantic's strict
mode refuses the first two and its lax mode takes ``"3"`` for 3 and ``1`` for
true. Its errors would also have to be translated back into this project's
message (the key, what was expected, what was given, "did you mean", the fix),
which is most of what :func:`convert` is.

Errors: TypeError for a value of the wrong type, ValueError for a wrong value or
an unknown key; every message names ``section.key``, what is expected, what was
given and how to fix it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union

__all__ = [
    "aliases",
    "as_section",
    "check",
    "convert",
    "describe",
    "did_you_mean",
    "got",
    "hints",
    "init_names",
    "known_keys",
    "params_names",
    "plain",
    "require",
    "resolve_aliases",
    "setting",
    "split_extra",
    "unknown_keys_error",
]

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 4


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    ge: float | None = None,
    gt: float | None = None,
    fix: str | None = None,
    aliases: tuple[str, ...] = (),
    in_params: bool = True,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with what :func:`check`, :func:`known_keys` and the params
    reference need: ``doc`` (one paragraph), the bounds ``ge`` / ``gt`` (checked
    when the value is not None), the ``fix`` a bound's error suggests, other
    names it is accepted under (``aliases``), and whether the params file may set
    it (``in_params``: False for settings the run command derives itself)."""
    metadata = dict(doc=doc, ge=ge, gt=gt, fix=fix, aliases=aliases, in_params=in_params)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def got(value: Any) -> str:
    """What a message says was given: the type and a short repr."""
    return f"{type(value).__name__} {_repr.repr(value)}"


def describe(tp: Any) -> str:
    """An annotation in words, for 'must be ...'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is dict or origin is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple) or tp in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} {_plural(args[0])}"
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin in (Union, types.UnionType):
        choices = [a for a in args if a is not type(None)]
        if all(typing.get_origin(a) is Literal for a in choices):  # Optional[Literal[...]]
            words = [repr(w) for a in choices for w in typing.get_args(a)]
            return "one of " + ", ".join(words) + (" or null" if len(choices) < len(args) else "")
        words = [
            ", ".join(map(repr, typing.get_args(a)))
            if typing.get_origin(a) is Literal
            else describe(a)
            for a in args
        ]
        words = list(dict.fromkeys(words))  # list[str] | tuple[str, ...]: said once
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    if tp is os.PathLike:
        return "a path"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        tp, "mappings" if (tp is dict or typing.get_origin(tp) is dict) else "values"
    )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt])(i?)b\s*$", re.IGNORECASE)


def _quoted_number_hint(value: Any) -> str:
    if isinstance(value, str):
        size = _SIZE.match(value)
        if size is not None:  # "2GB": a byte count written with its unit
            number, prefix, binary = size.groups()
            scale = (1024 if binary else 1000) ** ("kmgt".index(prefix.lower()) + 1)
            return f" (bytes as a number: write {int(float(number) * scale)})"
        try:
            float(value)
        except ValueError:
            return ""
        return " (a number in quotes? write it without quotes)"
    return ""


def did_you_mean(value: Any, choices: Iterable[Any], n: int = 3) -> str:
    """`` Did you mean 'a' or 'b'?`` for the close matches of ``value`` among
    ``choices`` (their string forms), else ``""``."""
    words = [str(c) for c in choices]
    close = difflib.get_close_matches(value, words, n=n) if isinstance(value, str) else []
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def named_subclasses(base: type) -> list[type]:
    """The concrete public subclasses of ``base`` at any depth, defined so far (a
    user's too): the classes a params file may name (``optimizer_type``, a
    scheduler), without those named with a leading ``_`` or still abstract."""
    found, pending, seen = [], list(base.__subclasses__()), set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        if not cls.__name__.startswith("_") and not inspect.isabstract(cls):
            found.append(cls)
    return found


def _convert_union(path: str, value: Any, tp: Any, args: tuple) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own message, saying null is allowed too
        try:
            return convert(path, value, options[0])
        except (TypeError, ValueError) as e:
            prefix = f"{path} must be {describe(options[0])}"
            message = str(e)
            if not message.startswith(prefix):
                raise
            error = ValueError if isinstance(e, ValueError) else TypeError
            raise error(f"{path} must be {describe(tp)}{message[len(prefix) :]}") from None
    for option in options:
        try:
            return convert(path, value, option)
        except (TypeError, ValueError):
            continue
    hint = _quoted_number_hint(value) if {int, float} & set(options) else ""
    words = [str(w) for o in options if typing.get_origin(o) is Literal for w in o.__args__]
    suggestion = did_you_mean(value, words, n=1)
    raise TypeError(f"{path} must be {describe(tp)}, got {got(value)}{hint}.{suggestion}")


def _convert_number(path: str, value: Any, tp: type) -> Any:
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            hint = f" (write {int(value)})"
        else:
            hint = _quoted_number_hint(value)
        raise TypeError(f"{path} must be an integer, got {got(value)}{hint}.")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{path} must be a finite number, got {got(value)}.")
        return number
    raise TypeError(f"{path} must be a number, got {got(value)}{_quoted_number_hint(value)}.")


def _convert_sequence(path: str, value: Any, tp: Any, origin: Any, args: tuple) -> Any:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{path} must be {describe(tp)}, got {got(value)}.")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ValueError(
                f"{path} must be {describe(tp)}, got {len(value)} value(s): {got(value)}."
            )
        items = [convert(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]
    else:
        item_type = args[0] if args else Any
        items = [convert(f"{path}[{i}]", v, item_type) for i, v in enumerate(value)]
    return tuple(items) if (origin is tuple or tp is tuple) else items


def convert(path: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp``; ints become floats where a
    float is expected and lists become tuples where a tuple is expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(path, value, tp, args)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        hint = did_you_mean(value, args, n=1)
        raise ValueError(f"{path} must be {describe(tp)}, got {got(value)}.{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"{path} must be true or false, got {got(value)}.")
    if tp in (int, float):
        return _convert_number(path, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"{path} must be a string, got {got(value)}.")
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} must be a mapping (key: value lines), got {got(value)}.")
        value_type = args[1] if args else Any
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: keys must be strings, got {got(key)}.")
            out[key] = convert(f"{path}.{key}", item, value_type)
        return out
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(path, value, tp, origin, args)
    if isinstance(tp, type):  # a class of the API (torch.dtype, os.PathLike)
        if isinstance(value, tp):
            return value
        raise TypeError(f"{path} must be {describe(tp)}, got {got(value)}.")
    raise AssertionError(f"{path}: no check for annotation {tp!r}")  # a field this file added


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a class (cached)."""
    return typing.get_type_hints(cls)


def _path(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def _check_bounds(path: str, value: Any, meta: Mapping[str, Any]) -> None:
    values = value if isinstance(value, tuple) else (value,)
    for bound, ok, words in (
        (meta.get("ge"), lambda v, b: v >= b, ">="),
        (meta.get("gt"), lambda v, b: v > b, ">"),
    ):
        if bound is None:
            continue
        if any(isinstance(v, (int, float)) and not ok(v, bound) for v in values):
            fix = meta.get("fix") or f"use a value {words} {bound}"
            raise ValueError(f"{path} must be {words} {bound}, got {value!r}. Fix: {fix}.")


def check(obj: Any, section: str = "", skip: tuple[str, ...] = ()) -> None:
    """Check (and normalise) every init field of the dataclass ``obj``: its
    annotation, then the bounds of its :func:`setting`. ``section`` prefixes the
    names in messages (``runconfig.max_steps``; empty: the bare name)."""
    annotations = hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or f.name in skip:
            continue
        path = _path(section, f.name)
        value = convert(path, getattr(obj, f.name), annotations[f.name])
        _check_bounds(path, value, f.metadata)
        object.__setattr__(obj, f.name, value)


def init_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_keys_error(section: str, unknown: list[str], valid: list[str]) -> ValueError:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
        parts.append(
            f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
        )
    return ValueError(
        f"{section}: unknown key(s) {', '.join(parts)}. Valid keys in {section}: "
        f"{', '.join(sorted(valid))}."
    )


def aliases(cls: type) -> dict[str, str]:
    """Every alias of ``cls``'s settings mapped to the setting's name."""
    return {a: f.name for f in dataclasses.fields(cls) for a in f.metadata.get("aliases", ())}


def resolve_aliases(section: str, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every alias key renamed to its setting's name; an alias given
    beside its setting (or a second alias of it) is an error."""
    names = aliases(cls)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        name = names.get(key, key)
        if name in out:
            raise ValueError(
                f"{section}: {given[name]!r} and {key!r} are the same setting ({name}). "
                f"Fix: keep one of them."
            )
        out[name] = value
        given[name] = key
    return out


def params_names(cls: type) -> list[str]:
    """The settings of ``cls`` a params file may set."""
    return [f.name for f in dataclasses.fields(cls) if f.init and f.metadata.get("in_params", True)]


def known_keys(section: str, cls: type, values: Mapping[str, Any], valid: list[str]) -> dict:
    """``values`` with ``cls``'s aliases renamed to their settings; a key that is not
    in ``valid`` is refused with the nearest valid ones."""
    out = resolve_aliases(section, cls, dict(values))
    unknown = [k for k in out if k not in valid]
    if unknown:
        raise unknown_keys_error(section, unknown, [*valid, *aliases(cls)])
    return out


def as_section(section: str, raw: Any) -> dict[str, Any]:
    """A section's raw value as a dict with string keys (a copy)."""
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"{section} must be a mapping of key: value lines, got {got(raw)}. Fix: indent "
            f"the section's keys under '{section}:'."
        )
    for key in raw:
        if not isinstance(key, str):
            raise TypeError(f"{section}: keys must be strings, got {got(key)}.")
    return copy.deepcopy(dict(raw))


def require(section: str, raw: dict[str, Any], name: str, example: str) -> None:
    if name not in raw:
        raise ValueError(f"{section}: missing required key {name!r}. Fix: add '{example}'.")


def split_extra(section: str, cls: type, values: dict[str, Any]) -> tuple[dict, dict]:
    """A section's keys split into the dataclass's fields and the rest (its ``extra``)."""
    if "extra" in values:
        raise ValueError(
            f"{section}: 'extra' is not a key of the params file. Fix: write its keys directly "
            f"in the {section} section."
        )
    names = set(init_names(cls))
    known = {k: v for k, v in values.items() if k in names}
    extra = {k: v for k, v in values.items() if k not in names}
    return known, extra


def plain(value: Any) -> Any:
    """Tuples to lists, mappings to dicts, paths to strings, dataclasses to dicts of
    their init fields, recursively (what yaml.safe_dump writes)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return value


#: The answer to a ``master_dtype`` passed to ``compile()`` or ``configure()``: it is a
#: params-file key (``runconfig.master_dtype``), and the Python API's way is the model's dtype.
MASTER_DTYPE_HINT = (
    "master_dtype is not an argument here: the store keeps each master in its parameter's "
    "dtype. For bfloat16 masters convert the model before compiling, model.to(torch.bfloat16) "
    "(what the run command's runconfig.master_dtype does); the Adam family and momentum SGD "
    "then keep a Kahan compensation buffer (kahan_summation=True). Compact optimizer state is "
    "the optimizer's state_dtype, e.g. cstorch.optim.AdamW(..., state_dtype='bfloat16')."
)

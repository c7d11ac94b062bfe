"""Argument checks shared by the schedulers: pure functions, one fix-it message each.

Every check names the scheduler class and the argument, says what was received and
what to pass instead, so a mistake in a params file is fixed from the message alone.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy


def real(owner: str, name: str, value: Any) -> float:
    """``value`` as a float; TypeError unless it is a real number (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: {name} must be a real number, got {type(value).__name__} {value!r}. "
            f"Pass a float such as {name}=0.1."
        )
    return float(value)


def integer(owner: str, name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int at least ``minimum``; TypeError/ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an integer, got {type(value).__name__} {value!r}. "
            f"Pass a whole number of steps, e.g. {name}=100."
        )
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}.")
    return value


def optional_integer(owner: str, name: str, value: Any, minimum: int | None = None) -> int | None:
    """Like :func:`integer` but lets ``None`` through (meaning "not set")."""
    return None if value is None else integer(owner, name, value, minimum)


def choice(owner: str, name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value`` when it is one of ``allowed``; ValueError listing them otherwise."""
    if value not in allowed:
        raise ValueError(f"{owner}: {name} must be one of {list(allowed)}, got {value!r}.")
    return value


def integer_list(owner: str, name: str, values: Any, *, increasing: bool) -> list[int]:
    """A list/tuple/array of non-negative ints; with ``increasing``, strictly increasing."""
    if isinstance(values, numpy.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"{owner}: {name} must be a list of integers, got {type(values).__name__} "
            f"{values!r}. Pass e.g. {name}=[100, 200]."
        )
    out = [integer(owner, f"{name}[{i}]", v, minimum=0) for i, v in enumerate(values)]
    if increasing and any(b <= a for a, b in itertools.pairwise(out)):
        raise ValueError(
            f"{owner}: {name} must be strictly increasing, got {out}. Sort them and drop "
            f"duplicates."
        )
    return out


def real_list(owner: str, name: str, values: Any) -> list[float]:
    """A non-empty list/tuple/array of real numbers as floats."""
    if isinstance(values, numpy.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or not values:
        raise TypeError(
            f"{owner}: {name} must be a non-empty list of numbers, got {values!r}. "
            f"Pass e.g. {name}=[0.1, 0.01]."
        )
    return [real(owner, f"{name}[{i}]", v) for i, v in enumerate(values)]


def tags(owner: str, value: Any) -> frozenset[str | None] | None:
    """Normalise ``param_group_tags``: None (all groups), one tag, or a collection of tags.

    ``None`` inside a collection selects the untagged groups (reference semantics).
    """
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset([value])
    if not isinstance(value, Iterable):
        raise TypeError(
            f"{owner}: param_group_tags must be a tag string or a list of tags, got "
            f"{type(value).__name__} {value!r}."
        )
    items = list(value)
    for item in items:
        if item is not None and not isinstance(item, str):
            raise TypeError(
                f"{owner}: param_group_tags entries must be strings (or None for untagged "
                f"groups), got {type(item).__name__} {item!r}."
            )
    if len(set(items)) != len(items):
        raise ValueError(
            f"{owner}: param_group_tags contains duplicates: {items}. List each tag once."
        )
    if not items:
        raise ValueError(
            f"{owner}: param_group_tags is empty, so the scheduler would touch no group. "
            f"Pass None to schedule every group, or the tags of the groups to schedule."
        )
    return frozenset(items)


def tags_as_list(value: frozenset[str | None] | None) -> list[str | None] | None:
    """Normalised tags as a sorted list (None first), the form stored in checkpoints."""
    if value is None:
        return None
    return sorted(value, key=lambda tag: (tag is not None, tag or ""))


def group_tags(group: dict) -> frozenset[str | None]:
    """The tags of one param group; an untagged group carries the tag ``None``."""
    value = group.get("tags")
    if not value:
        return frozenset([None])
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(value)

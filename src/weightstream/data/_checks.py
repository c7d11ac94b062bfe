"""Argument checks shared by the data modules (one wording for one mistake)."""

from __future__ import annotations


def check_int(name: str, value, minimum: int) -> None:
    """Raise TypeError unless ``value`` is an int (not a bool), ValueError if below ``minimum``."""
    # bool is an int subclass; True as a count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")

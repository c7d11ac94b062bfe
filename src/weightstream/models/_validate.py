"""Field checks shared by the zoo's config dataclasses (one wording for one mistake).

Each check names the dataclass field and says what would be accepted, because
the fields are the keys of the params file's ``model`` section and the message
is what a user sees for a typo in that file.
"""

from __future__ import annotations


def positive_int(owner: str, name: str, value: object) -> None:
    # bool is an int subclass; ``n_layer: true`` in YAML is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{owner}.{name} must be a positive int, got {type(value).__name__} {value!r}; "
            f"set model.{name} to a whole number >= 1."
        )


def optional_positive_int(owner: str, name: str, value: object, default: str) -> None:
    """None is allowed and means ``default`` (said in the message so the fix is clear)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{owner}.{name} must be a positive int or null ({default}), got "
            f"{type(value).__name__} {value!r}; set model.{name} to a whole number >= 1 or "
            "remove it."
        )


def positive_float(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{owner}.{name} must be a positive number, got {type(value).__name__} {value!r}."
        )


def probability(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{owner}.{name} must be a number in [0, 1), got {value!r}; use 0.0 to disable it."
        )


def boolean(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}.{name} must be true or false, got {type(value).__name__} {value!r}."
        )

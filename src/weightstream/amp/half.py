"""Which 16-bit floating point type "half precision" means: float16, bfloat16 or cbfloat16.

The choice is one process-wide setting, held by the single
:class:`HalfDtypeSetting` instance :data:`half_dtype_setting` (the reference
API makes it process-wide too: ``cstorch.amp.set_half_dtype`` is called once,
before the model and the GradScaler are built). Everything that depends on it
reads it through :func:`get_half_dtype` at the moment it needs it, e.g. the
GradScaler's default loss scales when it is constructed.
"""

from __future__ import annotations

import torch

from weightstream.amp.cbfloat16 import CBFloat16, cbfloat16

__all__ = [
    "HalfDtype",
    "HalfDtypeSetting",
    "get_half_dtype",
    "half_dtype_setting",
    "set_half_dtype",
]

#: What :func:`get_half_dtype` returns: a torch dtype, or the cbfloat16 object.
HalfDtype = torch.dtype | CBFloat16

_BY_NAME: dict[str, HalfDtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "cbfloat16": cbfloat16,
}
_NAME_OF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class HalfDtypeSetting:
    """The process-wide half precision type. Default: float16 (as in the reference).

    Read and change it with :meth:`get` / :meth:`set` (or the module functions
    :func:`get_half_dtype` / :func:`set_half_dtype`, which use
    :data:`half_dtype_setting`). Objects that derive defaults from it read it
    when they are built and do not follow later changes.
    """

    def __init__(self) -> None:
        self._name = "float16"

    @property
    def name(self) -> str:
        """ "float16", "bfloat16" or "cbfloat16"."""
        return self._name

    def get(self) -> HalfDtype:
        """torch.float16, torch.bfloat16, or :data:`weightstream.amp.cbfloat16`."""
        return _BY_NAME[self._name]

    def set(self, value: str | torch.dtype | CBFloat16) -> HalfDtype:
        """Select the half type by name, torch dtype or the cbfloat16 object; returns it."""
        self._name = _normalize(value)
        return self.get()


def _normalize(value: object) -> str:
    choices = '"float16" (torch.float16), "bfloat16" (torch.bfloat16) or "cbfloat16"'
    if isinstance(value, CBFloat16):
        return "cbfloat16"
    if isinstance(value, torch.dtype):
        if value in _NAME_OF:
            return _NAME_OF[value]
        raise ValueError(
            f"set_half_dtype(): {value} is not a 16-bit floating point type; use {choices}."
        )
    if isinstance(value, str):
        if value in _BY_NAME:
            return value
        hint = ""
        if value.strip().lower() in _BY_NAME:
            hint = f" Did you mean {value.strip().lower()!r}?"
        raise ValueError(f"set_half_dtype(): unknown half type {value!r}; use {choices}.{hint}")
    raise TypeError(
        f"set_half_dtype() expects a name or a torch dtype, got {type(value).__name__} {value!r}; "
        f"use {choices}."
    )


#: The one process-wide half type setting.
half_dtype_setting = HalfDtypeSetting()


def set_half_dtype(value: str | torch.dtype | CBFloat16) -> HalfDtype:
    """Select the 16-bit type used for half precision: "float16", "bfloat16" or "cbfloat16".

    Also accepts torch.float16, torch.bfloat16 and :data:`weightstream.amp.cbfloat16`.
    Returns the selected type, as :func:`get_half_dtype` would. Call it before
    building the GradScaler: the scaler's default loss scales depend on it.
    """
    return half_dtype_setting.set(value)


def get_half_dtype() -> HalfDtype:
    """The selected half type: torch.float16, torch.bfloat16 or the cbfloat16 object."""
    return half_dtype_setting.get()

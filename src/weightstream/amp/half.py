"""Which 16-bit floating point type "half precision" means: float16, bfloat16 or cbfloat16.

The choice is one setting of the run (the reference API makes it process-wide:
``cstorch.amp.set_half_dtype`` is called once, before the model and the
GradScaler are built), kept by name in the run context (Note [run context] in
weightstream/context.py). :data:`half_dtype_setting` reads and changes it there.
Everything that depends on it reads it through :func:`get_half_dtype` at the
moment it needs it, e.g. the GradScaler's default loss scales when it is
constructed.
"""

from __future__ import annotations

import torch

from weightstream.amp.cbfloat16 import CBFloat16, cbfloat16
from weightstream.context import current_run

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
    """The half precision type of the current run. Default: float16 (as in the reference).

    Read and change it with :meth:`get` / :meth:`set` (or the module functions
    :func:`get_half_dtype` / :func:`set_half_dtype`, which use
    :data:`half_dtype_setting`). It holds nothing itself: every instance reads
    and writes the run context (Note [run context]), and a fresh run starts at
    float16. Objects that derive defaults from it read it when they are built
    and do not follow later changes.
    """

    @property
    def name(self) -> str:
        """ "float16", "bfloat16" or "cbfloat16"."""
        return current_run().half_dtype

    def get(self) -> HalfDtype:
        """torch.float16, torch.bfloat16, or :data:`weightstream.amp.cbfloat16`."""
        return _BY_NAME[self.name]

    def set(self, value: str | torch.dtype | CBFloat16) -> HalfDtype:
        """Select the half type by name, torch dtype or the cbfloat16 object; returns it."""
        current_run().half_dtype = _normalize(value)
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


#: The half type setting of the current run (a view of the run context; it holds nothing).
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

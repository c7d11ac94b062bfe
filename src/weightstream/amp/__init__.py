"""weightstream.amp: mixed precision (reference API section 3).

- :class:`GradScaler`: no, static or dynamic loss scaling with the reference
  update rule; skipped steps are recorded in :mod:`weightstream.amp.skip`.
- :func:`optimizer_step`: backward, unscale, clip, step, update, zero_grad.
- Half types: :func:`set_half_dtype` / :func:`get_half_dtype` select float16,
  bfloat16 or :data:`cbfloat16` (a 16-bit format with 6 exponent bits, emulated
  by rounding float32 values: :func:`round_to_cbfloat16`).
"""

from weightstream.amp import skip
from weightstream.amp.cbfloat16 import (
    CBFloat16,
    cbfloat16,
    cbfloat16_bits_to_float32,
    float32_to_cbfloat16_bits,
    round_to_cbfloat16,
)
from weightstream.amp.grad_scaler import GradScaler, OptState
from weightstream.amp.half import (
    HalfDtypeSetting,
    get_half_dtype,
    half_dtype_setting,
    set_half_dtype,
)
from weightstream.amp.step_helper import optimizer_step

__all__ = [
    "CBFloat16",
    "GradScaler",
    "HalfDtypeSetting",
    "OptState",
    "cbfloat16",
    "cbfloat16_bits_to_float32",
    "float32_to_cbfloat16_bits",
    "get_half_dtype",
    "half_dtype_setting",
    "optimizer_step",
    "round_to_cbfloat16",
    "set_half_dtype",
    "skip",
]

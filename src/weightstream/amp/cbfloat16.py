"""cbfloat16: the 16-bit floating point format with one exponent bit more than float16.

Layout, most significant bit first::

    | sign (1) | exponent (6, bias 31) | mantissa (9) |

It is IEEE-like: exponent field 0 holds zero and the denormals
(``mantissa * 2**-39``), exponent field 63 holds infinity (mantissa 0) and NaN
(mantissa != 0), everything in between is a normal number
``(1 + mantissa / 2**9) * 2**(exponent - 31)``. Compared with float16 this
trades one mantissa bit for twice the exponent range (largest finite value
about 4.3e9, smallest normal 2**-30), which is why dynamic loss scaling is often
unnecessary with it.

torch has no cbfloat16 dtype, so values live in float32 tensors that hold
exactly representable cbfloat16 values (:func:`round_to_cbfloat16`), or as
16-bit patterns in integer tensors (:func:`float32_to_cbfloat16_bits`,
:func:`cbfloat16_bits_to_float32`). The :data:`cbfloat16` object describes the
format and is what :func:`weightstream.amp.get_half_dtype` returns when the
format is selected.

Note [cbfloat16 rounding]: every cbfloat16 value is exactly representable in
float32 (9 <= 23 mantissa bits, 2**-39 >= 2**-149), so conversion from float32
is a single rounding. For results that are normal in cbfloat16 the rounding is
done on the float32 bit pattern: adding ``0x1FFF + lsb`` below the 14 bits
that are dropped rounds to nearest with ties to even, and a mantissa carry
propagates into the exponent by itself (including the carry into the
all-ones exponent, which is exactly the overflow to infinity). For results
that are denormal in cbfloat16 (``|x| < 2**-30``) the quantum is the fixed
``2**-39``, so ``round(|x| * 2**39)`` (exact scaling by a power of two, then
torch.round, which rounds half to even) is the mantissa field; a result of 512
is the bit pattern of the smallest normal, so that carry needs no special case.
"""

from __future__ import annotations

import torch

__all__ = [
    "CBFloat16",
    "cbfloat16",
    "cbfloat16_bits_to_float32",
    "float32_to_cbfloat16_bits",
    "round_to_cbfloat16",
]

EXPONENT_BITS = 6
MANTISSA_BITS = 9
EXPONENT_BIAS = 31

# float32 layout, for the bit-level conversion.
_F32_MANTISSA_BITS = 23
_F32_EXPONENT_BIAS = 127
_DROPPED_BITS = _F32_MANTISSA_BITS - MANTISSA_BITS  # 14 mantissa bits dropped
_REBIAS = _F32_EXPONENT_BIAS - EXPONENT_BIAS  # 96: float32 exponent field - cbfloat16 field
# Smallest float32 exponent field whose values are normal in cbfloat16 (2**-30).
_F32_EXP_OF_MIN_NORMAL = 1 + _REBIAS

_EXP_ALL_ONES = (1 << EXPONENT_BITS) - 1  # 63
_MANTISSA_MASK = (1 << MANTISSA_BITS) - 1  # 0x1FF
_INF_BITS = _EXP_ALL_ONES << MANTISSA_BITS  # 0x7E00
_QUIET_BIT = 1 << (MANTISSA_BITS - 1)  # 0x100
_SIGN_BIT = 1 << (EXPONENT_BITS + MANTISSA_BITS)  # 0x8000
# Scaling that turns a cbfloat16 denormal into its integer mantissa field.
_DENORMAL_SCALE = 2.0 ** (EXPONENT_BIAS - 1 + MANTISSA_BITS)  # 2**39

_F32_SIGN = 1 << 31
_F32_INF_BITS = 0x7F800000

# Floating dtypes whose every value is exact in float32, so converting through
# float32 adds no second rounding.
_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)
_BIT_DTYPES = (torch.int16, torch.int32, torch.int64, torch.uint16)


def _as_float32(x: torch.Tensor, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}() expects a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in _EXACT_IN_FLOAT32:
        hint = (
            " Convert with .float() first; note that float64 -> float32 -> cbfloat16 rounds twice."
            if x.dtype == torch.float64
            else ""
        )
        raise TypeError(
            f"{fn}() expects a float32, float16 or bfloat16 tensor, got {x.dtype}.{hint}"
        )
    return x.detach().to(torch.float32)


def float32_to_cbfloat16_bits(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to the nearest cbfloat16 value (ties to even) and return its bit patterns.

    Values beyond the largest finite cbfloat16 round to infinity as IEEE
    rounding prescribes (everything at or above the midpoint between the
    largest finite value and 2**32), tiny values round to the denormals or to
    a signed zero, NaN stays NaN (sign and top payload bits kept, quiet bit
    set). See Note [cbfloat16 rounding].

    Args:
        x: float32 (or float16/bfloat16, exact in float32) tensor of any shape.

    Returns:
        An int16 tensor of the same shape holding the 16-bit patterns
        (two's complement view: patterns with the sign bit set are negative).
    """
    x = _as_float32(x, "float32_to_cbfloat16_bits")
    bits = x.view(torch.int32)
    negative = bits < 0
    magnitude = bits & 0x7FFFFFFF  # |x| as bits; no sign-bit games on int32 after this
    exponent = magnitude >> _F32_MANTISSA_BITS

    # Normal results: round on the bit pattern, then rebias the exponent.
    lsb = (magnitude >> _DROPPED_BITS) & 1
    half_minus_one = (1 << (_DROPPED_BITS - 1)) - 1
    normal = ((magnitude + half_minus_one + lsb) >> _DROPPED_BITS) - (_REBIAS << MANTISSA_BITS)
    # Anything that carried into (or started at) the all-ones exponent is an
    # overflow, including float32 infinity itself.
    normal = normal.clamp(max=_INF_BITS)

    # Denormal results: fixed quantum 2**-39. Masked so large inputs cannot
    # overflow the scaled value.
    small = exponent < _F32_EXP_OF_MIN_NORMAL
    scaled = torch.where(small, x.abs(), 0.0) * _DENORMAL_SCALE
    denormal = torch.round(scaled).to(torch.int32)

    result = torch.where(small, denormal, normal)
    is_nan = magnitude > _F32_INF_BITS
    nan_bits = _INF_BITS | _QUIET_BIT | ((magnitude >> _DROPPED_BITS) & _MANTISSA_MASK)
    result = torch.where(is_nan, nan_bits, result)
    result = result | (negative.to(torch.int32) << (EXPONENT_BITS + MANTISSA_BITS))
    # int32 in [0, 65535] -> int16 two's complement, written out so no narrowing
    # conversion with implementation-defined wrap-around is involved.
    result = torch.where(result >= _SIGN_BIT, result - (1 << 16), result)
    return result.to(torch.int16)


def cbfloat16_bits_to_float32(bits: torch.Tensor) -> torch.Tensor:
    """Decode cbfloat16 bit patterns into float32 values (exact: no rounding happens).

    Args:
        bits: integer tensor (int16, uint16, int32 or int64) whose low 16 bits
            are the patterns, e.g. the output of
            :func:`float32_to_cbfloat16_bits` or integers in [0, 65535].

    Returns:
        A float32 tensor of the same shape. NaN patterns give a float32 NaN
        with the same sign and payload.
    """
    if not isinstance(bits, torch.Tensor):
        raise TypeError(
            f"cbfloat16_bits_to_float32() expects a torch.Tensor, got {type(bits).__name__}."
        )
    if bits.dtype not in _BIT_DTYPES:
        raise TypeError(
            "cbfloat16_bits_to_float32() expects an integer tensor of bit patterns "
            f"(int16, uint16, int32 or int64), got {bits.dtype}. To convert float values, "
            "use round_to_cbfloat16() instead."
        )
    b = bits.detach().to(torch.int64) & 0xFFFF
    negative = (b >> (EXPONENT_BITS + MANTISSA_BITS)) & 1
    exponent = (b >> MANTISSA_BITS) & _EXP_ALL_ONES
    mantissa = b & _MANTISSA_MASK

    normal = ((exponent + _REBIAS) << _F32_MANTISSA_BITS) | (mantissa << _DROPPED_BITS)
    special = _F32_INF_BITS | (mantissa << _DROPPED_BITS)  # inf (mantissa 0) or NaN
    magnitude = torch.where(exponent == _EXP_ALL_ONES, special, normal)
    # Denormals: mantissa * 2**-39 is exact in float32 (a normal float32).
    denormal = (mantissa.to(torch.float32) / _DENORMAL_SCALE).view(torch.int32).to(torch.int64)
    magnitude = torch.where(exponent == 0, denormal, magnitude)
    # Assemble in int64 and wrap to int32 explicitly: 1 << 31 does not fit int32.
    full = magnitude | (negative << 31)
    full = torch.where(full >= _F32_SIGN, full - (1 << 32), full)
    return full.to(torch.int32).view(torch.float32)


def round_to_cbfloat16(x: torch.Tensor) -> torch.Tensor:
    """Return float32 values holding the cbfloat16 value nearest to each element of ``x``.

    Round to nearest, ties to even; overflow gives +-inf; NaN stays NaN; the
    sign of zero is kept. Equivalent to
    ``cbfloat16_bits_to_float32(float32_to_cbfloat16_bits(x))``. Not
    differentiable (it works on ``x.detach()``).
    """
    return cbfloat16_bits_to_float32(float32_to_cbfloat16_bits(x))


class CBFloat16:
    """Description of the cbfloat16 format, usable where a half dtype is expected.

    torch has no cbfloat16 dtype, so this object stands in for one: it is what
    ``get_half_dtype()`` returns after ``set_half_dtype("cbfloat16")``, and a
    compute engine uses it by keeping float32 tensors and calling
    :meth:`round` on them. The properties follow ``torch.finfo`` names.
    Use the module-level instance :data:`cbfloat16`; instances compare equal.
    """

    name = "cbfloat16"
    bits = 16
    itemsize = 2
    exponent_bits = EXPONENT_BITS
    mantissa_bits = MANTISSA_BITS
    exponent_bias = EXPONENT_BIAS
    is_floating_point = True
    #: torch dtype of the bit patterns (:meth:`to_bits`).
    storage_dtype = torch.int16
    #: torch dtype of the tensors that hold cbfloat16 values (:meth:`round`).
    compute_dtype = torch.float32

    @property
    def max(self) -> float:
        """Largest finite value: (2 - 2**-9) * 2**31."""
        return (2.0 - 2.0**-MANTISSA_BITS) * 2.0 ** (_EXP_ALL_ONES - 1 - EXPONENT_BIAS)

    @property
    def min(self) -> float:
        """Most negative finite value (as ``torch.finfo.min``): -max."""
        return -self.max

    @property
    def eps(self) -> float:
        """Difference between 1.0 and the next larger value: 2**-9."""
        return 2.0**-MANTISSA_BITS

    @property
    def smallest_normal(self) -> float:
        """Smallest positive normal value: 2**-30."""
        return 2.0 ** (1 - EXPONENT_BIAS)

    tiny = smallest_normal

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive denormal value: 2**-39."""
        return 1.0 / _DENORMAL_SCALE

    def round(self, tensor: torch.Tensor) -> torch.Tensor:
        """float32 tensor of the nearest cbfloat16 values; see :func:`round_to_cbfloat16`."""
        return round_to_cbfloat16(tensor)

    def to_bits(self, tensor: torch.Tensor) -> torch.Tensor:
        """int16 bit patterns; see :func:`float32_to_cbfloat16_bits`."""
        return float32_to_cbfloat16_bits(tensor)

    def from_bits(self, bits: torch.Tensor) -> torch.Tensor:
        """float32 values of bit patterns; see :func:`cbfloat16_bits_to_float32`."""
        return cbfloat16_bits_to_float32(bits)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CBFloat16)

    def __hash__(self) -> int:
        return hash(CBFloat16)

    def __repr__(self) -> str:
        return "weightstream.amp.cbfloat16"


#: The cbfloat16 format (see :class:`CBFloat16`).
cbfloat16 = CBFloat16()

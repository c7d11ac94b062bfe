"""One compiled kernel for a large parameter's Adam/AdamW step on compact state.

Note [fused compact kernels]
----------------------------
The chunked update (Note [compact optimizer state] in optim/compact.py) runs
about twenty operators a chunk; each reads and writes its chunk once more, and
each costs a dispatch. Compiled into one loop by ``torch.compile`` (inductor's
C++ backend), the same arithmetic reads and writes each value once. Measured
(``benchmarks/host_optimizer.py --compact --numel 16000000``, 2 cores, 113 GB/s
of memory bandwidth), median bytes moved a second, chunks -> compiled: bf16
masters with Kahan and bf16 moments 5.7 -> 59.3 GB/s; bf16 moments 8.4 -> 26.6;
bf16 masters with Kahan 9.7 -> 23.5. On an accelerator's host with many cores the
chunks are bound by their operators (Note [compact kernels on many cores]).

So the step of a parameter of at least ``FUSED_MIN_NUMEL`` values on the CPU,
under Adam or AdamW without amsgrad, with float32 or bfloat16 moments and a
float32 or bfloat16 master (with or without its Kahan buffer), is that one
kernel. (int8 moments compiled the same way, each block's scale a reduction,
ran at 0.9 GB/s against the chunks' 3.0: they take the chunks.) Its expression
is the chunk's, term for term in the same order, with precision casts emulated
(a rounding to bfloat16 is a rounding, as eagerly). Its float32 results still
differ from the operators' in the last bit here and there: on the CPU ATen's
``lerp``, ``add(alpha=)`` and ``addcmul`` round through fused multiply-adds
(measured against float64 emulations: each agrees bit for bit only so), which
the compiled loop does not form. So a parameter takes one path or the other by
its size and formats alone: a streamed run and the same optimizer run eagerly
take the same kernel for it and agree bit for bit (tested), and both paths are
AdamW to the rounding of their state against torch.optim in float64 (tested).
The flags of a step (decoupled or L2 weight decay, bias correction) are values,
not branches, so one compiled kernel serves each combination of dtypes.

Where the kernel cannot be built (``torch.compile`` needs a C++ compiler for
the CPU), the first step says so once and every parameter takes the chunks,
as before; so does ``WEIGHTSTREAM_FUSED_KERNELS=0``.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

#: The size from which a parameter's step is the compiled kernel: below it the
#: chunks are a handful and the compile (seconds) is not worth it.
FUSED_MIN_NUMEL = 2**20

_FLOATS = (torch.float32, torch.bfloat16)


def _adam(
    p: Tensor,
    comp: Tensor | None,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    decay: Tensor,
    l2: Tensor,
    beta1c: Tensor,
    beta2: Tensor,
    beta2c: Tensor,
    neg_step_size: Tensor,
    bias_correction2_sqrt: Tensor,
    eps: Tensor,
) -> None:
    """The chunk's AdamW/Adam expression on whole flat tensors (compiled; see the Note).
    Decoupled decay: ``decay = 1 - lr * wd``, ``l2 = 0``; L2: ``decay = 1``, ``l2 = wd``."""
    x = p.float()
    if comp is not None:
        x = x + comp.float()
    x = x * decay
    gf = g.float() + l2 * x
    mf = torch.lerp(m.float(), gf, beta1c)
    vf = v.float() * beta2 + beta2c * gf * gf
    denom = vf.sqrt() / bias_correction2_sqrt + eps
    x = x + neg_step_size * mf / denom  # addcdiv's order: (value * m) / denom
    p.copy_(x)
    if comp is not None:
        comp.copy_(x - p.float())
    m.copy_(mf)
    v.copy_(vf)


class _Kernels:
    """The compiled kernel, made at the first step that needs it, or why there is none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adam = None
        self.unavailable: str | None = (
            "WEIGHTSTREAM_FUSED_KERNELS=0"
            if os.environ.get("WEIGHTSTREAM_FUSED_KERNELS", "1") == "0"
            else None
        )

    def adam(self):
        with self._lock:
            if self._adam is None:
                self._adam = torch.compile(
                    _adam,
                    dynamic=True,
                    fullgraph=True,
                    options={
                        "emulate_precision_casts": True,
                        "cpp.enable_floating_point_contract_flag": "off",
                    },
                )
            return self._adam

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self.unavailable is not None:
                return
            self.unavailable = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        warnings.warn(
            "weightstream: the compiled kernel of compact optimizer state could not be built "
            f"({self.unavailable}); every parameter takes the chunked kernel, several times "
            "slower (Note [fused compact kernels] in optim/fused.py). Fix: install a C++ "
            "compiler (g++) for torch.compile's CPU backend.",
            stacklevel=4,
        )


# Owner: this module, for the process.
_KERNELS = _Kernels()


def fusable(p: Tensor, state: dict[str, Any], amsgrad: bool) -> bool:
    """Whether ``p``'s Adam/AdamW step is the compiled kernel (see the Note)."""
    if amsgrad or _KERNELS.unavailable is not None:
        return False
    if p.device.type != "cpu" or p.numel() < FUSED_MIN_NUMEL or not p.is_contiguous():
        return False
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if m is None or v is None or p.dtype not in _FLOATS:
        return False
    return m.dtype in _FLOATS and v.dtype == m.dtype and m.is_contiguous() and v.is_contiguous()


def adam_step_fused(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    step_size: float,
    bias_correction2_sqrt: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> bool:
    """The step of a :func:`fusable` parameter; False if the kernel could not be built
    (nothing was changed: the caller runs the chunks)."""
    comp = state.get("kahan_comp")

    def scalar(value: float) -> Tensor:
        return torch.tensor(value, dtype=torch.float32)

    args = (
        scalar(1 - lr * weight_decay if decoupled else 1.0),
        scalar(0.0 if decoupled else weight_decay),
        scalar(1 - beta1),
        scalar(beta2),
        scalar(1 - beta2),
        scalar(-step_size),
        scalar(bias_correction2_sqrt),
        scalar(eps),
    )
    comp = None if comp is None else comp.view(-1)
    flat = [t.view(-1) for t in (p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"])]
    kernel = _KERNELS.adam()
    try:
        with torch.no_grad():
            kernel(flat[0], comp, *flat[1:], *args)
    except Exception as exc:  # the compile failed: no value was written
        _KERNELS.failed(exc)
        return False
    return True

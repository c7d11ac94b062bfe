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
kernel; so are int8 moments of whole blocks, decoded and coded again as the
chunks do (each block's scale a reduction over its 256 values): int8 moments
3.2 -> 14.4 GB/s, bf16 masters with Kahan and int8 moments 2.6 -> 9.1 (a
symbolic block size left the reductions unvectorized: 1.6). That kernel is two
loops over the blocks: the scales' reductions, then the step that codes with
them. By default inductor stored the decayed master and the new root in
buffers of their own for the second loop to read, 43 bytes a parameter moved
where 22 do when each loop computes them again (``_RECOMPUTE``: the same bits;
on another 2-core host, 40 GB/s, int8 moments 5.5 -> 9.5 GB/s and bf16 masters
with Kahan and int8 moments 4.1 -> 5.1, where the arithmetic now binds: three
roots and two divisions a value). Its expression
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

#: Inductor's limits past which an intermediate is stored in a buffer of its own
#: rather than recomputed where it is read, raised so that nothing is stored (the
#: names every torch from 2.11 knows; later ones add CPU-only variants, which these
#: override).
_RECOMPUTE = {
    "realize_reads_threshold": 100,
    "realize_opcount_threshold": 1000,
    "realize_acc_reads_threshold": 100,
}


def _known(options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` this torch's inductor has (``torch.compile`` refuses any other):
    a torch without one builds the kernel without it, one path for streamed and eager
    runs alike."""
    from torch._inductor import config

    known = {}
    for key, value in options.items():
        section, _, name = key.rpartition(".")
        holder = getattr(config, section, None) if section else config
        if holder is not None and hasattr(holder, name):
            known[key] = value
    return known


def _master(p: Tensor, comp: Tensor | None) -> Tensor:
    """``p`` (plus its Kahan compensation) in float32, as the chunks' ``Master.read``."""
    x = p.float()
    return x if comp is None else x + comp.float()


def _store(p: Tensor, comp: Tensor | None, x: Tensor) -> None:
    """``x`` rounded into ``p``, the rounding's error into ``comp`` (``Master.write``)."""
    p.copy_(x)
    if comp is not None:
        comp.copy_(x - p.float())


def _stepped(
    x: Tensor, g: Tensor, m: Tensor, v: Tensor, scalars: tuple[Tensor, ...], block: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk's Adam/AdamW expression: ``(x, m, v, sqrt(v))`` after the step, each
    term in the chunk's order. ``scalars``: ``decay`` (``1 - lr * wd`` decoupled, else
    1), ``l2`` (``wd`` for L2 decay, else 0), ``1 - beta1``, ``beta2``, ``1 - beta2``,
    ``-step_size``, the second bias correction's root and eps. ``block``: the moments
    are rows of that many values (int8), ``x`` and ``g`` flat."""
    decay, l2, beta1c, beta2, beta2c, neg_step_size, bias_correction2_sqrt, eps = scalars
    x = x * decay
    gf = g.float() + l2 * x
    if block:
        gf = gf.view(-1, block)
    mf = torch.lerp(m, gf, beta1c)
    vf = v * beta2 + beta2c * gf * gf
    root = vf.sqrt()
    step = neg_step_size * mf / (root / bias_correction2_sqrt + eps)  # addcdiv's order
    return x + step.view(x.shape), mf, vf, root


def _adam(
    p: Tensor, comp: Tensor | None, g: Tensor, m: Tensor, v: Tensor, scalars: tuple[Tensor, ...]
) -> None:
    """The step on float moments, flat tensors (compiled; see the Note)."""
    x, mf, vf, _ = _stepped(_master(p, comp), g, m.float(), v.float(), scalars)
    _store(p, comp, x)
    m.copy_(mf)
    v.copy_(vf)


def _decoded(
    codes: Tensor, scale: Tensor, q: float, signed: bool, root: bool, block: int
) -> Tensor:
    """The chunks' ``Moment.read`` of whole blocks (rows): ``scale * (code / Q)**2``,
    with the code's sign for a signed moment, squared again where the codes hold a root."""
    rows = codes.float().view(-1, block)
    factor = (scale * (1.0 / (q * q))).unsqueeze(1)
    values = rows * rows.abs() * factor if signed else rows * rows * factor
    return values * values if root else values


def _encoded(values: Tensor, codes: Tensor, scale: Tensor, q: float, signed: bool) -> None:
    """The chunks' ``Moment.write``: each block's largest magnitude as its scale, the
    codes ``round(Q * sqrt(|x| / scale))`` (with the sign; a non-zero value of an
    unsigned moment never gets code 0)."""
    magnitude = values.abs() if signed else values
    block_scale = magnitude.amax(dim=1)
    scale.copy_(block_scale)
    inverse = torch.where(block_scale > 0, (q * q) / block_scale, 0.0).unsqueeze(1)
    coded = (magnitude * inverse).sqrt().round()
    coded = coded * values.sign() if signed else torch.maximum(coded, values.sign())
    codes.copy_(coded.view(-1))


def _adam_int8(
    p: Tensor,
    comp: Tensor | None,
    g: Tensor,
    m: tuple[Tensor, Tensor],
    v: tuple[Tensor, Tensor],
    scalars: tuple[Tensor, ...],
    codes: tuple[float, float, int],
) -> None:
    """The step on int8 moments of whole blocks, ``(codes, scales)`` each: ``exp_avg``
    signed, ``exp_avg_sq`` coded as its root, as the chunks' ``Moment`` codes them;
    ``codes``: their Q and the block."""
    signed_q, unsigned_q, block = codes
    decoded_m = _decoded(*m, signed_q, True, False, block)
    decoded_v = _decoded(*v, unsigned_q, False, True, block)
    x, mf, _, root = _stepped(_master(p, comp), g, decoded_m, decoded_v, scalars, block)
    _store(p, comp, x)
    _encoded(mf, *m, signed_q, True)
    _encoded(root, *v, unsigned_q, False)


class _Kernels:
    """The compiled kernel, made at the first step that needs it, or why there is none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adam: dict[bool, Any] = {}
        self.unavailable: str | None = (
            "WEIGHTSTREAM_FUSED_KERNELS=0"
            if os.environ.get("WEIGHTSTREAM_FUSED_KERNELS", "1") == "0"
            else None
        )

    def adam(self, int8: bool):
        """The compiled kernel of float moments, or of int8 ones, whose sizes become
        dynamic at the second size it sees (``dynamic=None``), its block staying a
        constant (see the Note)."""
        with self._lock:
            if int8 not in self._adam:
                options = {
                    "emulate_precision_casts": True,
                    "cpp.enable_floating_point_contract_flag": "off",
                }
                if int8:  # recompute the step in each loop rather than store it (see the Note)
                    options.update(_RECOMPUTE)
                self._adam[int8] = torch.compile(
                    _adam_int8 if int8 else _adam,
                    dynamic=None if int8 else True,
                    fullgraph=True,
                    options=_known(options),
                )
            return self._adam[int8]

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


def fusable(p: Tensor, state: dict[str, Any], amsgrad: bool, block: int) -> bool:
    """Whether ``p``'s Adam/AdamW step is the compiled kernel (see the Note); ``block``:
    the values of one int8 scale."""
    if amsgrad or _KERNELS.unavailable is not None:
        return False
    if p.device.type != "cpu" or p.numel() < FUSED_MIN_NUMEL or not p.is_contiguous():
        return False
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if m is None or v is None or p.dtype not in _FLOATS:
        return False
    if not (m.is_contiguous() and v.is_contiguous()):
        return False
    if "exp_avg_scale" in state:  # int8
        return p.numel() % block == 0
    return m.dtype in _FLOATS and v.dtype == m.dtype


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
    codes: tuple[float, float, int] | None = None,
) -> bool:
    """The step of a :func:`fusable` parameter; False if the kernel could not be built
    (nothing was changed: the caller runs the chunks). ``codes``: int8 moments' ranges
    (``exp_avg``'s Q, ``exp_avg_sq``'s) and block, as the chunks' ``Moment`` has them."""

    def scalar(value: float) -> Tensor:
        return torch.tensor(value, dtype=torch.float32)

    scalars = (
        scalar(1 - lr * weight_decay if decoupled else 1.0),
        scalar(0.0 if decoupled else weight_decay),
        scalar(1 - beta1),
        scalar(beta2),
        scalar(1 - beta2),
        scalar(-step_size),
        scalar(bias_correction2_sqrt),
        scalar(eps),
    )
    comp = state.get("kahan_comp")
    comp = None if comp is None else comp.view(-1)
    p_flat, g_flat = p.view(-1), grad.contiguous().view(-1)
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    try:
        kernel = _KERNELS.adam(codes is not None)
        with torch.no_grad():
            if codes is None:
                kernel(p_flat, comp, g_flat, m, v, scalars)
            else:
                m_scale, v_scale = state["exp_avg_scale"], state["exp_avg_sq_scale"]
                kernel(p_flat, comp, g_flat, (m, m_scale), (v, v_scale), scalars, codes)
    except Exception as exc:  # the kernel could not be made: no value was written
        _KERNELS.failed(exc)
        return False
    return True

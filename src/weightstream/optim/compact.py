"""Compact optimizer state and Kahan-compensated low-precision parameters.

Note [compact optimizer state]
------------------------------
Host bytes per parameter bound what fits and how fast a streamed step runs
(design.md, "Bytes per parameter are the product's limit"); AdamW's two fp32
moments are 8 of them. ``state_dtype`` stores them smaller; the whole Adam family
takes it (Adam, AdamW, NAdam, RAdam: ``exp_avg`` and ``exp_avg_sq``; Adamax:
``exp_avg`` and ``exp_inf``):

* ``torch.float32`` (default): both moments in float32 (in
  the parameter's dtype where that is wider, float64), 8 bytes a parameter.
  For float32 parameters this is torch.optim's update, bit for bit (Note
  [matching torch.optim bit for bit]).
* ``torch.bfloat16``: both moments in bfloat16, 4 bytes. Each step decodes
  them to float32, runs the float32 update and rounds them back to nearest.
  Known limit: a change smaller than half a bfloat16 ulp (2**-9 relative) is
  lost, so ``exp_avg_sq`` with beta2 = 0.999 does not decay while the
  gradients shrink (it only grows), nor does Adamax's ``exp_inf`` (``beta2 u``
  rounds back to ``u``); the update is then damped, never blown up.
* ``torch.int8``: 8-bit codes shaped like the parameter plus one float32 scale
  per block of ``BLOCK`` (256) consecutive values of the flattened parameter,
  as bitsandbytes' 8-bit Adam: 2 bytes + 8/256 a parameter. State keys:
  ``exp_avg`` (int8), ``exp_avg_scale`` (float32, ``ceil(numel / 256)``),
  ``exp_avg_sq`` (uint8), ``exp_avg_sq_scale`` (float32); Adamax's ``exp_inf``
  (uint8), ``exp_inf_scale`` (float32); with ``amsgrad``, ``max_exp_avg_sq``
  (uint8) and ``max_exp_avg_sq_scale`` (float32), coded as ``exp_avg_sq``. The
  scale is the block's largest magnitude, so every block uses its whole code
  range. How each key is coded is ``CODES``.

  The map is not linear: a code ``q`` stands for ``scale * (q / Q)**2``
  (``Q`` = 127 signed for ``exp_avg``, 255 unsigned for the square root of
  ``exp_avg_sq``). Why: the values of a block span orders of magnitude, and a
  linear 8-bit grid rounds the small ones to zero; the square-law map keeps a
  resolution of about 2/q relative (1.6% at the top of ``exp_avg``'s range)
  and reaches ``scale / Q**2`` (1/16129, 1/65025) before zero, which is the
  same idea as bitsandbytes' dynamic map at the cost of one sqrt and one
  square. ``exp_avg_sq`` stores ``sqrt(v)``, what the update divides by, so
  its error is relative to the denominator and its range is squared again.
  A non-zero ``v`` never gets code 0 (it is clamped to code 1): a zero
  denominator under a non-zero ``exp_avg`` would make the update ``lr * m / eps``.
  Rounding is to nearest, deterministic, so eager and streamed runs agree.
  AMSGrad's running maximum holds the largest root: ``max(sqrt(m), sqrt(v))`` is
  ``sqrt(max(m, v))``, so its codes divide as ``exp_avg_sq``'s do. The maximum
  is non-decreasing to within its coding's half step: a block whose scale
  changes codes its other values again. (bitsandbytes' 8-bit Adam refuses
  amsgrad; torchao's low-bit AdamW quantises the maximum as here.)

  Adamax's ``exp_inf`` ``u = max(beta2 u, |g| + eps)`` is, like ``sqrt(v)``,
  non-negative and what the update divides by, so it gets the codes
  ``sqrt(v)`` gets: unsigned (uint8, Q = 255), the same square-law map, of
  ``u`` itself (``u`` is already of the gradient's scale; coding its square
  root would square the range again, which nothing needs, and coarsen the top).
  Its error is then relative to the denominator, half a code step (about 1/q
  at code q, 0.4% at the top), as for Adam's ``sqrt(v)``. ``u >= eps > 0``
  after the first step, so no ``u`` gets code 0 (the clamp above): never a
  zero denominator.
  Rounding is to nearest, not up, though ``u`` is a maximum: rounding up
  would keep the stored maximum at or above every ``|g|`` it covers (Adamax's
  bound ``|step| <= lr`` exactly), but re-encoding a decoded value computes
  ``Q sqrt(u / scale)`` in float32, a hair above the integer code as often as
  below, and ceil would then add a code a step with nothing pushing ``u`` up:
  drift. Round to nearest gives a decoded value its own code back; the bound
  holds to within that half step. Decay works in int8 where bfloat16 state stalls:
  codes are relative to the block maximum, so while no new maximum arrives
  ``beta2 u`` shrinks the scale and keeps the codes.

The scales are optimizer state like the codes: allocated through
``binding.zeros_like`` (a disk store's files, a sharded store's placeholders),
saved and loaded by ``state_dict``, gathered over ranks. The kernels work on
one parameter at a time, on chunks of ``CHUNK`` values (a multiple of
``BLOCK``): decode to float32, the float32 update, encode. Each chunk is a few
whole-tensor ops, with float32 scratch of one chunk (bounded memory, cache
sized), never a Python loop over values or blocks. A parameter's result
depends on that parameter alone, so an update in one call (eager), per unit
(streamed) or per parameter (a disk store's pager) gives the same bits.

Note [compact kernels on many cores]
------------------------------------
A chunk's update is about twenty operators on 64K values. On one thread with
an OpenMP team each operator is a parallel region, and once the process has
more OpenMP threads than CPUs (the compute thread's team, an accelerator's
update thread's: Note [helper threads and OpenMP] in runtime/device.py) each
region wakes its workers through the kernel. Measured on an H200's 16-core
host (1.1B Llama, batch 8): with bf16 state the step took 18.6-21.4 s against
0.56 s with fp32 state (torch's fused kernel, one operator a tensor), about
55 us an operator; stack dumps every 25 s found the update thread in these
chunks each time.

So ``each_chunk`` spreads a parameter's chunks over a shared pool of workers
whose operators run single-threaded (``common.threads.run_on_threads``): as
many as the calling thread's team, so the CPU engine's single-threaded helper
threads run them all themselves, as before. No OpenMP region is opened, and a
chunk's float32 scratch stays in its core's cache. A chunk's result depends on
its own values only (int8 blocks never straddle two chunks), so the bits are
those of one thread in any order (tested). Measured here (2 cores,
``benchmarks/host_optimizer.py --compact``, 16M values): bf16 masters with
Kahan and bf16 state 6.9 -> 9.1 GB/s, bf16 masters with Kahan 12.0 -> 15.4.
On the H200's host the 4.87B model with bf16 state then took 47 s a step
(batch 4; fp32 state 2.04 s): 9.7 ns a parameter against 17 before. Still
bound by operators, not memory: sixteen workers each run twenty small operators
a chunk through Python and its GIL. A large parameter under Adam or AdamW
therefore takes one compiled kernel instead (Note [fused compact kernels] in
optim/fused.py); the other optimizers take the chunks.

Note [Kahan summation]
----------------------
A bfloat16 master has 8 significant bits: an update smaller than half its ulp
(a 2**-9 relative change: lr 1e-4 on a weight of 0.5) rounds back to the old
value and is lost, every step. With ``kahan_summation=True`` (the default,
as in the ``optimi`` library) a low-precision parameter (bfloat16, float16)
keeps a compensation buffer ``kahan_comp`` of its own dtype holding what the
last rounding dropped. Each step computes in float32 ``x = p + comp``, applies
weight decay and the update to ``x``, stores ``p = round(x)`` and
``comp = x - p`` (rounded again, but the residual is below half an ulp of
``p`` so its own rounding error is ~2**-8 of that: about 16 significant bits
together). The Adam family (Adam, AdamW, NAdam, RAdam, Adamax) and SGD keep
it; 2 bytes a
parameter. For float32 (and wider) parameters it is a no-op, not an error:
the default is on, and a float32 model must not need a flag to run; no buffer
is allocated and the arithmetic is unchanged. ``fused=True`` (torch's fused
kernel, Adam and AdamW) keeps no compensation: it needs float32 state and
parameters, or
``kahan_summation=False``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from weightstream.common.threads import run_on_threads
from weightstream.optim.binding import zeros_like
from weightstream.optim.fused import adam_step_fused, fusable

__all__ = ["BLOCK", "CHUNK", "LOW_PRECISION", "STATE_DTYPES", "parse_state_dtype"]

#: Values sharing one scale in int8 state (Note [compact optimizer state]).
BLOCK = 256
#: Values one kernel call works on: float32 scratch of a few of these (256 KiB each)
#: is live, small enough to stay in cache between the ops of one chunk.
CHUNK = BLOCK * 256
#: Parameter dtypes that keep a Kahan compensation buffer (Note [Kahan summation]).
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: ``state_dtype`` values, by the name a params file uses.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}

_SIGNED_Q = 127.0
_UNSIGNED_Q = 255.0


def parse_state_dtype(optimizer: str, value: Any) -> torch.dtype:
    """``state_dtype`` as a torch dtype: a dtype or its name ("float32", "bfloat16",
    "int8"); anything else is an error naming the choices."""
    if isinstance(value, str):
        dtype = STATE_DTYPES.get(value.removeprefix("torch."))
    elif isinstance(value, torch.dtype):
        dtype = value if value in STATE_DTYPES.values() else None
    else:
        raise TypeError(
            f"{optimizer}: state_dtype must be a torch dtype or its name, got "
            f"{type(value).__name__} {value!r}. Fix: one of torch.float32, torch.bfloat16, "
            "torch.int8 (in a params file: float32, bfloat16, int8)."
        )
    if dtype is None:
        raise ValueError(
            f"{optimizer}: state_dtype {value!r} is not supported. Fix: one of "
            f"{', '.join(STATE_DTYPES)} (Note [compact optimizer state] in optim/compact.py)."
        )
    return dtype


def check_kahan(optimizer: str, kahan_summation: Any) -> bool:
    """``kahan_summation`` checked to be a bool (Note [Kahan summation])."""
    if not isinstance(kahan_summation, bool):
        raise TypeError(
            f"{optimizer}: kahan_summation must be True or False, got {kahan_summation!r}."
        )
    return kahan_summation


def kahan_applies(p: Tensor, kahan_summation: bool) -> bool:
    """Whether ``p`` keeps a compensation buffer (Note [Kahan summation])."""
    return kahan_summation and p.dtype in LOW_PRECISION


def moment_dtype(p: Tensor, state_dtype: torch.dtype) -> torch.dtype:
    """The dtype of float32 / bfloat16 moments of ``p`` (float32 state: never narrower
    than float32, never narrower than ``p``)."""
    if state_dtype == torch.float32:
        return torch.promote_types(p.dtype, torch.float32)
    return state_dtype


def num_blocks(numel: int) -> int:
    return max(1, math.ceil(numel / BLOCK))


class Code(NamedTuple):
    """How one moment is coded in int8 (Note [compact optimizer state])."""

    #: int8 codes for a signed value, uint8 for a non-negative one.
    signed: bool
    #: The codes hold the square root of the value: what the update divides by.
    root: bool


#: The int8 coding of each moment of the Adam family, by state key.
CODES = {
    "exp_avg": Code(signed=True, root=False),
    "exp_avg_sq": Code(signed=False, root=True),
    "max_exp_avg_sq": Code(signed=False, root=True),
    "exp_inf": Code(signed=False, root=False),
}


def create_moment(state: dict[str, Any], p: Tensor, key: str, state_dtype: torch.dtype) -> None:
    """Zero state ``key`` of ``p`` in ``state_dtype`` (int8: codes and ``key + "_scale"``)."""
    if state_dtype == torch.int8:
        state[key] = zeros_like(p, dtype=torch.int8 if CODES[key].signed else torch.uint8)
        state[key + "_scale"] = zeros_like(p, dtype=torch.float32, shape=(num_blocks(p.numel()),))
    else:
        state[key] = zeros_like(p, dtype=moment_dtype(p, state_dtype))


def is_compact(p: Tensor, state: dict[str, Any]) -> bool:
    """Whether ``p``'s update takes the float32 chunk kernel (compact state or a
    low-precision parameter), not the foreach path of torch's arithmetic."""
    m = state.get("exp_avg", state.get("momentum_buffer"))
    return p.dtype in LOW_PRECISION or (m is not None and m.dtype != p.dtype)


# ------------------------------------------------------------------ codecs


class Moment:
    """One moment of one parameter, read and written a chunk at a time as float32.

    ``read(start, end)`` returns a float32 tensor of ``padded(end - start)`` values
    (whole blocks for int8, zeros past ``end``): a view of fp32 state itself (written
    in place), or a decoded copy that ``write`` encodes back. How int8 codes map to
    values is ``CODES[key]``.
    """

    def __init__(self, state: dict[str, Any], key: str) -> None:
        self.codes: Tensor = state[key].view(-1)
        self.scale: Tensor | None = state.get(key + "_scale")
        code = CODES[key]
        self.signed = code.signed
        self.q = _SIGNED_Q if code.signed else _UNSIGNED_Q
        #: int8 codes of the square root: :meth:`write` takes the root, not the value.
        self.stores_root = self.scale is not None and code.root

    @property
    def in_place(self) -> bool:
        return self.codes.dtype == torch.float32

    def read(self, start: int, end: int) -> Tensor:
        codes = self.codes[start:end]
        if self.scale is None:
            return codes if self.in_place else codes.float()
        blocks = _ceil_div(end - start, BLOCK)
        out = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        out[: end - start].copy_(codes)
        rows = out.view(blocks, BLOCK)
        scale = self.scale[start // BLOCK : start // BLOCK + blocks]
        # value = scale * (q / Q)**2, with q's sign for a signed moment; a root
        # moment's codes hold the square root of its value.
        factor = scale.mul(1.0 / (self.q * self.q)).unsqueeze(1)
        if self.signed:
            rows.mul_(rows.abs()).mul_(factor)
        else:
            rows.square_().mul_(factor)
            if self.stores_root:
                rows.square_()
        return out

    def write(self, values: Tensor, start: int, end: int) -> None:
        """Store ``values`` (from :meth:`read`, updated; where :attr:`stores_root`, their
        square root, which the update computes for its denominator anyway)."""
        if self.in_place:
            return
        codes = self.codes[start:end]
        if self.scale is None:
            codes.copy_(values[: end - start])
            return
        blocks = values.numel() // BLOCK
        rows = values.view(blocks, BLOCK)
        magnitude = rows.abs() if self.signed else rows.clone()
        scale = magnitude.amax(dim=1)
        self.scale[start // BLOCK : start // BLOCK + blocks].copy_(scale)
        # q = round(Q * sqrt(|x| / scale)); an all-zero block has scale 0, codes 0.
        inverse = torch.where(scale > 0, (self.q * self.q) / scale, 0.0).unsqueeze(1)
        magnitude.mul_(inverse).sqrt_().round_()
        if self.signed:
            magnitude.mul_(rows.sign())
        else:
            # A non-zero value never gets code 0 (the zero denominator of the Note).
            magnitude.clamp_(min=rows.sign())
        codes.copy_(magnitude.view(-1)[: end - start])


def convert_moment(state: dict[str, Any], saved: Any, key: str) -> None:
    """Moment ``key`` of ``saved`` (one parameter's state in any format: float, or
    int8 codes with ``key + "_scale"``) into ``state``'s tensors in their format, a
    chunk at a time through float32 (Note [loading another state format] in
    optim/optimizer.py)."""
    scale = key + "_scale"
    source = Moment({key: saved[key], **({scale: saved[scale]} if scale in saved else {})}, key)
    target = Moment(state, key)
    n = target.codes.numel()
    if source.codes.numel() != n:
        raise ValueError(
            f"load_state_dict: state {key!r} has {source.codes.numel()} values in the state "
            f"dict but {n} here. Fix: load it into an optimizer over the same model."
        )
    with torch.no_grad():
        for start in range(0, n, CHUNK):
            end = min(start + CHUNK, n)
            values = source.read(start, end)
            if target.scale is None:
                target.codes[start:end].copy_(values[: end - start])
                continue
            padded = torch.zeros(_ceil_div(end - start, BLOCK) * BLOCK, dtype=torch.float32)
            padded[: end - start].copy_(values[: end - start])
            if target.stores_root:
                padded.sqrt_()
            target.write(padded, start, end)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ parameters


class Master:
    """A parameter read and written a chunk at a time as float32, with its Kahan
    compensation where it has one (Note [Kahan summation])."""

    def __init__(self, p: Tensor, state: dict[str, Any]) -> None:
        assert p.is_contiguous(), "the store's masters are contiguous"
        self.flat = p.view(-1)
        comp = state.get("kahan_comp")
        self.comp = None if comp is None else comp.view(-1)
        self.in_place = p.dtype == torch.float32

    def read(self, start: int, end: int) -> Tensor:
        """``p + comp`` in float32 (a view of a float32 parameter itself)."""
        x = self.flat[start:end]
        if self.in_place:
            return x
        x = x.float()
        if self.comp is not None:
            x.add_(self.comp[start:end])
        return x

    def write(self, x: Tensor, start: int, end: int) -> None:
        """Round ``x`` into the parameter, the rounding error into the compensation
        (``x`` is scratch afterwards)."""
        if self.in_place:
            return
        target = self.flat[start:end]
        target.copy_(x)
        if self.comp is not None:
            self.comp[start:end].copy_(x.sub_(target))


def each_chunk(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    keys: tuple[str, ...],
    body: Callable[[int, Tensor, Tensor, list[Tensor]], None],
) -> None:
    """One parameter's update, ``body(start, x, g, moments)`` on each chunk, all float32.

    ``x`` is ``p`` (plus its Kahan compensation) from ``start`` and ``moments`` the
    decoded state ``keys``, each updated in place by ``body``; they are written back
    (encoded, rounded) after it, then ``x``. ``g`` has ``n = g.numel()`` values
    and may be the gradient itself, so it is never written; a moment has
    ``padded(n)`` values (int8: whole blocks), of which ``[:n]`` are the chunk's.
    The chunks run on several threads where the calling thread's operators would
    (Note [compact kernels on many cores]): each is the update of its own values,
    so any order gives the same bits.
    """
    master = Master(p, state)
    moments = [Moment(state, key) for key in keys]
    g_flat = grad.reshape(-1)
    numel = p.numel()

    @torch.no_grad()  # grad mode is a thread's own: the workers' too
    def run(start: int) -> None:
        end = min(start + CHUNK, numel)
        x = master.read(start, end)
        values = [moment.read(start, end) for moment in moments]
        body(start, x, g_flat[start:end].to(torch.float32), values)
        for moment, value in zip(moments, values):
            moment.write(value, start, end)
        master.write(x, start, end)

    run_on_threads(run, range(0, numel, CHUNK))


# ------------------------------------------------------------------ the updates
#
# One function per update, each in the order of torch's single-tensor code on the
# decoded float32 values (Note [compact optimizer state]); the optimizers compute
# their per-step scalars (bias corrections, schedules) and call these per parameter.


class StepScalars(NamedTuple):
    """The scalars of one parameter's step that every update of the Adam family takes."""

    step: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def _decay(x: Tensor, g: Tensor, lr: float, weight_decay: float, decoupled: bool) -> Tensor:
    """Weight decay on ``x`` (decoupled) or as the L2 term of a new gradient."""
    if weight_decay == 0:
        return g
    if decoupled:
        x.mul_(1 - lr * weight_decay)
        return g
    return g.add(x, alpha=weight_decay)


def _adam_moments(
    g: Tensor, m: Tensor, v: Tensor, v_state: Moment, beta1: float, beta2: float
) -> Tensor | None:
    """Adam's two moments of one chunk, in place. Where ``v_state`` stores its root
    (int8), ``v`` becomes ``sqrt(v)`` here and ``v[:n]``, returned, must stay so (a
    new tensor for a denominator); otherwise None."""
    n = g.numel()
    m[:n].lerp_(g, 1 - beta1)
    v[:n].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if not v_state.stores_root:
        return None
    return v.sqrt_()[:n]


def adam_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: StepScalars,
    *,
    decoupled: bool,
    correct_bias: bool,
    amsgrad: bool,
) -> None:
    """One Adam/AdamW step of ``p`` in float32 on decoded state."""
    step, lr, beta1, beta2, eps, weight_decay = h
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    v_state = Moment(state, "exp_avg_sq")
    if correct_bias:
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    else:
        step_size, bias_correction2_sqrt = lr, 1.0
    if fusable(p, state, amsgrad, BLOCK):  # Note [fused compact kernels] in optim/fused.py
        codes = None
        if v_state.scale is not None:  # int8: the moments' code ranges, whole blocks
            codes = (Moment(state, "exp_avg").q, v_state.q, BLOCK)
        if adam_step_fused(
            p, grad, state, step_size, bias_correction2_sqrt, lr, beta1, beta2, eps,
            weight_decay, decoupled, codes,
        ):  # fmt: skip
            return

    def body(start: int, x: Tensor, g: Tensor, moments: list[Tensor]) -> None:
        m, v, *top = moments
        n = g.numel()
        g = _decay(x, g, lr, weight_decay, decoupled)
        root = _adam_moments(g, m, v, v_state, beta1, beta2)
        if top:  # amsgrad
            if v_state.stores_root:
                # int8: v holds sqrt(v) by now, and the maximum's codes hold a root too
                # (CODES): the maximum of the roots, the root of the maximum (sqrt is
                # monotone), stays the root that is written and divides.
                top[0].sqrt_()
            torch.maximum(top[0], v, out=top[0])
            root = top[0][:n] if v_state.stores_root else top[0][:n].sqrt()
        elif root is None:
            root = v[:n].sqrt()
        if correct_bias:
            denom = root.div(bias_correction2_sqrt)
        else:  # a view of v (int8) must stay sqrt(v) for its encoding
            denom = root.clone() if v_state.stores_root else root
        denom.add_(eps)
        x.addcdiv_(m[:n], denom, value=-step_size)

    each_chunk(p, grad, state, keys, body)


def nadam_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: StepScalars,
    *,
    decoupled: bool,
    grad_coef: float,
    avg_coef: float,
) -> None:
    """One NAdam step of ``p`` in float32 on decoded state: the Nesterov step's
    gradient and momentum terms with the optimizer's coefficients."""
    step, lr, beta1, beta2, eps, weight_decay = h
    v_state = Moment(state, "exp_avg_sq")
    bias_correction2 = 1 - beta2**step

    def body(start: int, x: Tensor, g: Tensor, moments: list[Tensor]) -> None:
        m, v = moments
        n = g.numel()
        g = _decay(x, g, lr, weight_decay, decoupled)
        root = _adam_moments(g, m, v, v_state, beta1, beta2)
        if root is None:
            denom = v[:n].div(bias_correction2).sqrt_()
        else:
            denom = root.div(bias_correction2**0.5)
        denom.add_(eps)
        x.addcdiv_(g, denom, value=grad_coef)
        x.addcdiv_(m[:n], denom, value=avg_coef)

    each_chunk(p, grad, state, ("exp_avg", "exp_avg_sq"), body)


def radam_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: StepScalars,
    *,
    decoupled: bool,
    rect: float | None,
) -> None:
    """One RAdam step of ``p`` in float32 on decoded state: rectified by ``rect``, or
    plain momentum SGD where the rectification is undefined (None)."""
    step, lr, beta1, beta2, eps, weight_decay = h
    v_state = Moment(state, "exp_avg_sq")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step

    def body(start: int, x: Tensor, g: Tensor, moments: list[Tensor]) -> None:
        m, v = moments
        n = g.numel()
        g = _decay(x, g, lr, weight_decay, decoupled)
        root = _adam_moments(g, m, v, v_state, beta1, beta2)
        update = m[:n].div(bias_correction1).mul_(lr)
        if rect is not None:
            # adaptive lr = sqrt(1 - beta2^t) / (sqrt(v) + eps), reciprocal-then-multiply
            # as torch's `scalar / tensor`.
            adaptive = root.add(eps) if root is not None else v[:n].sqrt().add_(eps)
            adaptive.reciprocal_().mul_(bias_correction2**0.5)
            update.mul_(adaptive).mul_(rect)
        x.add_(update, alpha=-1.0)

    each_chunk(p, grad, state, ("exp_avg", "exp_avg_sq"), body)


def adamax_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: StepScalars,
) -> None:
    """One Adamax step of ``p`` in float32 on decoded state (``exp_inf``'s int8 codes:
    Note [compact optimizer state])."""
    step, lr, beta1, beta2, eps, weight_decay = h
    step_size = lr / (1 - beta1**step)

    def body(start: int, x: Tensor, g: Tensor, moments: list[Tensor]) -> None:
        m, u = moments
        n = g.numel()
        g = _decay(x, g, lr, weight_decay, decoupled=False)
        m[:n].lerp_(g, 1 - beta1)
        # u = max(beta2 u, |g| + eps)
        torch.maximum(u[:n].mul_(beta2), g.abs().add_(eps), out=u[:n])
        x.addcdiv_(m[:n], u[:n], value=-step_size)

    each_chunk(p, grad, state, ("exp_avg", "exp_inf"), body)


def sgd_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    first: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """One SGD step of a low-precision ``p`` in float32 with Kahan compensation (Note
    [Kahan summation]); the momentum buffer keeps ``p``'s dtype, as in torch."""
    buf_flat = state["momentum_buffer"].view(-1) if momentum != 0 else None

    def body(start: int, x: Tensor, g: Tensor, moments: list[Tensor]) -> None:
        end = start + g.numel()
        g = _decay(x, g, lr, weight_decay, decoupled=False)
        if buf_flat is not None:
            buf = buf_flat[start:end]
            b = g.clone() if first else buf.float().mul_(momentum).add_(g, alpha=1 - dampening)
            buf.copy_(b)
            g = g.add(b, alpha=momentum) if nesterov else b
        x.add_(g, alpha=-lr)

    each_chunk(p, grad, state, (), body)

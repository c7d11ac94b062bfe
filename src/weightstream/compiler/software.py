"""Software figures of the machine profile: fixed costs of this library and of eager
PyTorch, which dominate small models (Note [fixed costs]), and the in-situ factor.

* ``op_overhead_fwd_s`` / ``op_overhead_bwd_s``: seconds per aten operator in
  an eager forward (autograd recording) and in the backward, on tensors so
  small that their data work is nil: a chain of 8 tiny blocks (LayerNorm,
  Linear, GELU, Linear, residual add; 4 x 16 activations), operators counted
  by ``cost.function_costs`` on the same chain;
* ``unit_overhead_s``, ``param_overhead_s`` and ``stream_call_s``: seconds per
  streaming unit, per streamed parameter tensor, and per streamed call (the
  input moved to the device, the pass opened and closed, the first unit's
  prefetch handed to the background thread), per training step (forward +
  backward): the same chain streamed with each block a unit
  (``prefetch_depth=1``), streamed as one unit, and half of it streamed as one
  unit, each minus its eager twin and the units' copies at the copy
  bandwidth; the 8 units cost 7 units more than the single one, the single
  unit 24 parameter tensors more than the half one, and what is left of the
  single unit's cost is the call's. Streaming
  costs per parameter (its view of the flat buffer, its slot swapped in and
  out, its saved weight rebuilt in backward, its gradient routed back to the
  master: 40-50 us a step on a 2.5 GHz Xeon) as much as per unit: a unit of 8
  blocks costs 2.5x a unit of 1, and a one-unit model like FC-MNIST (6
  tensors) far less than a unit of a transformer (12 per block);
* ``stream_bandwidth``: bytes per second the streaming runtime moves (two
  fetches and the gradients back per unit and step): a chain of 8 blocks of
  512 features (2 MiB of weights each) streamed, minus its eager twin, minus
  what its units and parameter tensors cost, over the bytes moved; fresh
  buffers, page faults and the background hand-off included, which a plain
  copy does not see;
* ``step_overhead_s``: seconds per step of the run loop's bookkeeping (the
  trainer's loss function on labels, the loss summed and read back, a loss-log
  line, one TensorBoard event of 4 scalars and its writer thread's interference)
  and of the step's passes starting cold after the last update: a trainer-like
  step of the eager chain after an update minus a bare one back to back;
* ``in_situ_factor``: how much slower a training step runs its work on data
  (compute, memory) than the sum of its parts timed alone (Note [in situ]).

A figure that is the difference of two timings is the median of its
repetitions' differences; a direct timing the fastest repetition.

Note [fixed costs]
------------------
A training step of a small model is mostly overhead: each aten operator
costs microseconds of Python, dispatch and autograd bookkeeping whatever its
size, each streamed unit costs hooks, a fetch in forward and another in
backward, a background-thread hand-off and its autograd node, and the
optimizer loops over parameter tensors. FLOPs at the matmul peak see none of
it (a 3-layer MLP on 64 samples estimates 8x too fast without these terms).
The constants are measured on purpose-built tiny workloads, so that the data
work is negligible and the time is the overhead alone.

Note [in situ]
--------------
Every figure of the profile times one kind of work alone, and a training step
is slower than the sum of its parts so timed. Inside a step the operands of an
operator were written long before and left the caches, its output often
lands on memory the allocator has just taken from the kernel (a page fault
per 4 KiB: fresh memory is written at 3 GB/s against 14 GB/s for reused
memory on a 2.5 GHz Xeon VM), the backward runs with every activation alive,
and the prefetch thread allocates and copies beside the compute. Measured per
operator in a streamed training step on such a machine (2 threads, nothing
else running): products at 1.2x to 2x their alone-timed figures (backward
ones with large outputs the slowest), broadcast and reduction elementwise
operators at 2x to 7x, attention and GELU at 1x; the whole step 25-40%
slower than the sum. (Part of that was the prefetch thread's own OpenMP team
waking the compute's workers through the kernel at every operator, since gone:
Note [helper threads and OpenMP] in runtime/device.py. The factor measured on a
2-vCPU EPYC went from 1.46-1.91 to 1.11-1.23.) None of this is a property of
one operator: it is how the machine runs a training step. ``in_situ_factor`` measures it on a proxy,
two small decoder blocks with the operator mix of the model zoo's (a GPT-2
block: LayerNorm, fused qkv, causal attention, GELU MLP; a Llama block: RMS
norm, rotary positions, SwiGLU), streamed through the runtime for a few
training steps: their typical time over the estimate of the same step from
the other figures (``estimate.py``). Typical is the mean of 90 steps without
the slowest tenth, not the first quartile of Note [quiet timings]: with
nothing else running, the proxy's steps on a 2-vCPU VM alternate between
phases of ~33 ms and of ~42-50 ms lasting from a few steps to a whole second, a
run's samples/sec is the mean over both, and a first quartile of 10 steps (one
phase) put the factor anywhere between 0.84 and 1.48 from one measurement to
the next; 30 steps (one second) still gave 1.46 to 1.91 within ten minutes. The
estimate multiplies each pass's work on data (compute, memory) by it. The
optimizer update is timed after tiny training steps instead (an update timed
back to back ran 1.5-1.8x faster than inside a run: Note [update in context] in
updates.py), and is not scaled. The fixed costs (per
operator, per streamed unit, tensor and call) are measured as they occur in a
step, on purpose-built chains, and stay as they are: scaled, they priced
FC-MNIST's overhead-bound step 1.35x too slow (measured on a 2-vCPU EPYC;
1.15-1.22x unscaled). Transfers, the input and the loop's bookkeeping are
timed in their own context and stay as they are too. And a step's operands
are cold: no non-matmul operator is priced faster than the simple operators
on operands larger than the caches (``MachineProfile.cold_op_throughput``); the
curve's points for small operands are timed on operands the caches still hold,
and the tiny Llama's multiplications of 1 MiB (rotary positions, norm) ran at 39 GB/s in
its steps, against 131 GB/s on that curve and 51 GB/s at its largest size. It is
measured with the software figures (the proxy streams through the runtime).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.amp.step_helper import apply_gradients
from weightstream.backend import compile as ws_compile
from weightstream.common.scalars import ScalarWriter
from weightstream.compiler.cost import function_costs, unit_costs
from weightstream.compiler.estimate import EstimateSettings, estimate
from weightstream.compiler.profile import MachineProfile
from weightstream.compiler.timing import FULL, MIN_BURSTS, Calm, Sizes, first_quartile, sync
from weightstream.models.tasks import task_loss
from weightstream.optim import SGD


class _TinyBlock(nn.Module):
    """A transformer-like block (16 features unless told): the operator mix of real models."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _tiny_chain(units: int = FULL.tiny_units, d: int = 16) -> nn.Sequential:
    return nn.Sequential(*[_TinyBlock(d) for _ in range(units)])


class _TinyGroup(nn.Module):
    """Tiny blocks in one module: streamed as one unit (``unit_classes=[_TinyGroup]``)."""

    def __init__(self, blocks: nn.Sequential):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        return self.blocks(x)


def _streamed(model: nn.Module, unit_class: type, device: torch.device):
    """``model`` streamed with each ``unit_class`` module a unit, prefetching one."""
    # This rank's own speed, also under data parallel: a measurement never joins the ranks.
    return ws_compile(
        model,
        "wse_ws",
        device=device,
        unit_classes=[unit_class],
        prefetch_depth=1,
        data_parallel=False,
    )


def _fwd_bwd_split(model, x, device: torch.device, budget: float) -> tuple[float, float]:
    """(forward, backward) seconds of ``model(x).sum()``: the first quartiles of the
    steps that fit in ``budget`` seconds (at least MIN_BURSTS; Note [quiet timings]).
    The gradients are dropped after each step (not timed), as the trainer's
    ``zero_grad(set_to_none=True)`` does."""
    model(x).sum().backward()  # warm-up
    model.zero_grad(set_to_none=True)
    fwd, bwd = [], []
    deadline = time.perf_counter() + budget
    while len(fwd) < MIN_BURSTS or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        loss = model(x).sum()
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        model.zero_grad(set_to_none=True)
    return first_quartile(fwd), first_quartile(bwd)


# What Trainer._log writes each step, as one event (Note [one event per step]).
_SCALARS = ("loss", "lr", "loss_scale", "samples_per_sec")
_BURST_STEPS = 4  # steps of each kind in a row in _step_overhead


# Tiny training steps per call of ``tiny_training_steps``' callable: the least after
# which more leave the timed work no slower (see there).
CONTEXT_STEPS = 3


@contextlib.contextmanager
def tiny_training_steps(device: torch.device | str = "cpu"):
    """A callable doing what surrounds a batch fetch or an update in a run, for timing
    them in context.

    Timing an input pipeline's batches back to back flatters it (about 2x for a
    small in-memory dataset on a CPU): inside a run each fetch follows a
    training step, which leaves the caches and the thread pool in another
    state, and TensorBoard's writer thread competes with it; so does the update
    (Note [update in context] in updates.py). Each call is CONTEXT_STEPS
    forwards + backwards of the tiny chain and the scalars of a step, logged to a
    temporary directory removed on exit. One tiny step is not enough of a step's
    other work: on a 2-vCPU Xeon, FC-MNIST's batch of 64 digits took 408 us back
    to back, 666 after one tiny step, 745 after three and 742 after five (745-889
    in the run command's steps); its update likewise (Note [update in context]).
    """
    device = torch.device(device)
    model = _tiny_chain().to(device)
    x = torch.randn(4, 16, device=device)
    step = 0
    with tempfile.TemporaryDirectory(prefix="weightstream-logprobe-") as tmp:
        writer = ScalarWriter(tmp)

        def training_step() -> None:
            nonlocal step
            for _ in range(CONTEXT_STEPS):
                loss = model(x).sum()
                loss.backward()
                model.zero_grad(set_to_none=True)
            step += 1
            writer.add(step, dict.fromkeys(_SCALARS, loss.item()))

        try:
            yield training_step
        finally:
            writer.close()


def _step_overhead(model, x, device: torch.device, budget: float) -> float:
    """Seconds per step of what a run does around the model beyond its operators: a
    trainer-like step of ``model`` after an update, minus a bare one back to back
    (alternating bursts, first quartiles). Both are eager: the streamed call's own
    cost is ``stream_call_s``.

    The trainer-like step is what ``train.trainer.Trainer`` does each step:
    ``task_loss``'s cross-entropy on labels moved to the device and cast to
    float32, the loss divided by the micro-batch count, summed on the host, read
    with ``.item()``, a line of the loss log written and flushed, and
    the step's TensorBoard scalars (whose writer thread competes with the
    next step: that interference is part of the cost). A model of one small unit
    (FC-MNIST, a 4 ms step) spends a tenth of its step there. Each follows the
    update of the step before (untimed), as in a run, and so starts cold: the
    operators' fixed costs are timed back to back (``_fwd_bwd_split``), and a pass
    after the update and logging of a step takes longer by about 0.3 ms (on a
    2-vCPU Xeon: the tiny chain's 3.11 -> 3.45 ms, FC-MNIST's 1.08 -> 1.38 ms), a
    cost per step whatever the model (Note [update in context] in updates.py)."""
    batch = {"inputs": x, "labels": torch.zeros(x.shape[0], dtype=torch.long)}
    opt = SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def plain() -> None:
        model(x).sum().backward()

    step = 0
    with tempfile.TemporaryDirectory(prefix="weightstream-logprobe-") as tmp:
        writer = ScalarWriter(tmp)
        log = open(Path(tmp) / "losses.jsonl", "a")  # closed below

        def trainer_like() -> None:
            nonlocal step
            loss, _, _ = task_loss("classification", model, batch)
            scaled = loss / 1
            scaled.backward()
            value = (torch.zeros(()) + scaled.detach().cpu()).item()
            step += 1
            log.write(json.dumps({"step": step, "loss": value}) + "\n")
            log.flush()
            writer.add(step, dict.fromkeys(_SCALARS, value))

        # Before each timed call, untimed: the last step's update for the
        # trainer-like step, dropping the gradients for the bare one.
        before = {trainer_like: lambda: apply_gradients(opt, None), plain: model.zero_grad}
        try:
            for fn in (plain, trainer_like):
                before[fn]()
                fn()
            times: dict = {plain: [], trainer_like: []}
            deadline = time.perf_counter() + budget
            while len(times[plain]) < MIN_BURSTS or time.perf_counter() < deadline:
                for fn in (plain, trainer_like):
                    for i in range(_BURST_STEPS):
                        before[fn]()
                        t0 = time.perf_counter()
                        fn()
                        sync(device)
                        # the first bare step of a burst follows the trainer-like one's work
                        if fn is trainer_like or i > 0:
                            times[fn].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        finally:
            log.close()
            writer.close()
    return max(0.0, first_quartile(times[trainer_like]) - first_quartile(times[plain]))


def fixed_costs(device: torch.device, sizes: Sizes, copy_bandwidth: float, calm: Calm) -> dict:
    """op_overhead_fwd_s, op_overhead_bwd_s, unit_overhead_s, param_overhead_s,
    stream_call_s, stream_bandwidth, step_overhead_s, and their repetitions under
    ``"samples"`` (Note [fixed costs])."""
    eager = _tiny_chain(sizes.tiny_units).to(device)
    x = torch.randn(4, 16, device=device)
    costs = function_costs(eager, (x,))
    streamed_model = _tiny_chain(sizes.tiny_units)
    many = _streamed(streamed_model, _TinyBlock, device)
    # The same blocks streamed as a single unit, and half of them: the same
    # parameter tensors in fewer units, and fewer tensors in one unit, separate
    # the three costs (Note [fixed costs]).
    half_blocks = max(1, sizes.tiny_units // 2)
    single = _streamed(nn.Sequential(_TinyGroup(_tiny_chain(sizes.tiny_units))), _TinyGroup, device)
    half = _streamed(nn.Sequential(_TinyGroup(_tiny_chain(half_blocks))), _TinyGroup, device)
    half_eager = _tiny_chain(half_blocks).to(device)
    # Wide units: their weights dominate, so their streaming time over the
    # tiny units' is the price of the bytes (Note [fixed costs]).
    d = sizes.wide_features
    wide_eager = _tiny_chain(sizes.tiny_units, d).to(device)
    wide_x = torch.randn(4, d, device=device)
    wide_model = _tiny_chain(sizes.tiny_units, d)
    wide = _streamed(wide_model, _TinyBlock, device)
    wide_bytes = 3 * sum(p.numel() * p.element_size() for p in wide_model.parameters())
    tiny_bytes = 3 * sum(p.numel() * p.element_size() for p in streamed_model.parameters())
    tensors = len(list(streamed_model.parameters()))
    half_tensors = len(list(half_eager.parameters()))
    fwd, bwd, units, per_param, per_call, steps, streams = [], [], [], [], [], [], []

    def repetition() -> tuple:
        # Interleaved: eager and streamed see the same machine conditions.
        budget = sizes.overhead_seconds
        models = [eager, many, single, half_eager, half]
        splits = [_fwd_bwd_split(m, x, device, budget) for m in models]
        splits += [_fwd_bwd_split(m, wide_x, device, budget) for m in (wide_eager, wide)]
        return (*splits, _step_overhead(eager, x, device, budget))

    try:
        for _ in range(sizes.curve_repeats):
            timed = calm(repetition)
            (f, b), (fs, bs), (f1, b1), (fh, bh), (fh1, bh1), (fw, bw), (fws, bws), step = timed
            fwd.append(f / costs.fwd_ops)
            bwd.append(b / costs.bwd_ops)
            # 2 fetches + gradients back of the tiny weights, at the copy bandwidth
            copies = tiny_bytes / copy_bandwidth
            all_units = fs + bs - f - b - copies  # call + tiny_units x unit + tensors x param
            one = f1 + b1 - f - b - copies  # call + 1 x unit + tensors x param
            one_half = fh1 + bh1 - fh - bh - copies * half_tensors / tensors
            unit = max(0.0, (all_units - one) / max(1, sizes.tiny_units - 1))
            units.append(unit)
            param = max(0.0, (one - one_half) / max(1, tensors - half_tensors))
            per_param.append(param)
            per_call.append(max(0.0, one - unit - tensors * param))
            per_bytes = fws + bws - fw - bw - per_call[-1] - sizes.tiny_units * unit
            per_bytes -= tensors * param
            streams.append(wide_bytes / per_bytes if per_bytes > 0 else copy_bandwidth)
            steps.append(step)
    finally:
        for compiled in (many, single, half, wide):
            compiled.engine.close()
    # Direct timings: the fastest repetition; differences of two timings: the
    # median (a disturbed eager twin would make a difference too small).
    return {
        "op_overhead_fwd_s": min(fwd),
        "op_overhead_bwd_s": min(bwd),
        "unit_overhead_s": statistics.median(units),
        "param_overhead_s": statistics.median(per_param),
        "stream_call_s": statistics.median(per_call),
        "stream_bandwidth": statistics.median(streams),
        "step_overhead_s": statistics.median(steps),
        "samples": {
            "op_overhead_fwd": fwd,
            "op_overhead_bwd": bwd,
            "unit_overhead": units,
            "param_overhead": per_param,
            "stream_call": per_call,
            "stream_bandwidth": streams,
            "step_overhead": steps,
        },
    }


class _ProxyBlock(nn.Module):
    """A small decoder block with the operator mix of the zoo's (Note [in situ]).

    ``gated=False``: GPT-2's (LayerNorm, fused qkv, causal attention, GELU MLP);
    ``gated=True``: Llama's (RMS norm, rotary positions, SwiGLU MLP).
    """

    def __init__(self, d: int, heads: int, gated: bool):
        super().__init__()
        self.heads, self.gated = heads, gated
        if gated:
            self.norm1 = nn.Parameter(torch.ones(d))
            self.norm2 = nn.Parameter(torch.ones(d))
            self.gate = nn.Linear(d, 8 * d // 3, bias=False)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=not gated)
        self.proj = nn.Linear(d, d, bias=not gated)
        hidden = 8 * d // 3 if gated else 4 * d
        self.up = nn.Linear(d, hidden, bias=not gated)
        self.down = nn.Linear(hidden, d, bias=not gated)

    def _norm(self, x, norm):
        if not self.gated:
            return norm(x)
        return norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self._norm(x, self.norm1)).view(B, T, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.gated:  # rotary positions: rotate pairs of head dimensions
            pos = torch.arange(T, dtype=x.dtype, device=x.device)[:, None]
            angles = pos / (1 + torch.arange(q.shape[-1], device=x.device))
            cos, sin = angles.cos(), angles.sin()
            half = q.shape[-1] // 2

            def rotate(t):
                return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

            q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        h = self._norm(x, self.norm2)
        if self.gated:
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + self.down(F.gelu(self.up(h), approximate="tanh"))


def _typical_step(steps: list[float]) -> float:
    """The mean of ``steps`` without their slowest tenth (Note [in situ]): what a run's
    samples/sec sees, slow phases of the virtual CPUs included, a lone stall not."""
    kept = sorted(steps)[: max(1, math.ceil(0.9 * len(steps)))]
    return sum(kept) / len(kept)


def in_situ_factor(partial: MachineProfile, sizes: Sizes) -> tuple[float, list[float]]:
    """Measured over estimated seconds of the proxy's streamed training step (Note [in
    situ]), and the timed steps."""
    device = torch.device(partial.device)
    batch, seq, d, heads = sizes.proxy
    model = nn.Sequential(_ProxyBlock(d, heads, gated=False), _ProxyBlock(d, heads, gated=True))
    x = torch.randn(batch, seq, d, device=device)
    compiled = _streamed(model, _ProxyBlock, device)
    try:
        costs = unit_costs(model, compiled.engine.prepare(x), (x,))
        est = estimate(costs, partial, EstimateSettings(batch_size=batch, prefetch_depth=1))
        # What the factor scales: the work on data (compute and memory; float32, so
        # the compute's factor is this one); the rest of the modelled step (fixed
        # costs, transfers not hidden) stays as it is. The proxy runs no update.
        scaled = est.compute_s + est.memory_s
        rest = est.step_s - est.update_s - scaled
        steps = []
        for _ in range(2 + sizes.proxy_steps):
            t0 = time.perf_counter()
            compiled(x).sum().backward()
            model.zero_grad(set_to_none=True)
            sync(device)
            steps.append(time.perf_counter() - t0)
    finally:
        compiled.engine.close()
    measured = _typical_step(steps[2:])
    factor = (measured - rest) / scaled if scaled > 0 else 1.0
    return min(3.0, max(0.5, factor)), steps[2:]

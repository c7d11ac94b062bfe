"""Weight streaming on an accelerator, against resident eager PyTorch and FSDP2 CPU offload.

Trains Llama-style decoders (``weightstream.models.Llama``, sizes from ``SIZES``:
about 1B to 5B parameters, or a few million with ``--tiny``) for ``--warmup``
untimed steps and ``--steps`` timed ones, in three ways, one after the other
(they do not fit in memory together), each on a freshly built model drawn from
the same seed and fed the same batch:

* **WS**: ``weightstream.backend.compile(model, "wse_ws", device=...,
  compute_dtype=...)``, every decoder block one streaming unit, the host masters
  updated by ``weightstream.optim.AdamW(fused=True)``;
* **eager**: the same model resident on the device under autocast of the same
  dtype, ``torch.optim.AdamW(fused=True)`` on the device; only where its
  estimated memory fits (params x 18 bytes + activations), else a reason;
* **FSDP2 CPU offload**: ``fully_shard`` on every block and on the root with
  ``CPUOffloadPolicy`` and ``MixedPrecisionPolicy(param_dtype=...)``, in this
  one process with a world-size-1 process group (gloo on CPU, nccl on CUDA),
  ``torch.optim.AdamW(fused=True)`` on the offloaded fp32 shards.

Measured on the spot before the models (Note [roofline]): the dense matmul peak of
the compute dtype, pinned H2D and D2H bandwidth (on the CPU, a host memory copy),
pageable H2D, and host memory bandwidth. Per size it prints step time
min / median / max with the forward / backward / optimizer split, tokens/s, model
TFLOPS (6 x params x tokens / median step, attention FLOPs not counted) and % of
the measured peak, the bytes WS moved over the link per step and their rate, and
the roofline as a fraction of the measured WS step, and two ratios:
``ws_vs_eager`` = WS median step / eager median step (above 1: WS is slower) and
``ws_vs_fsdp2`` = WS tokens/s / FSDP2 tokens/s (above 1: WS is faster). The last
line is ``RESULT {json}``; a size that does not fit the host is reported as
``skipped`` with why, a WS failure as ``error`` (and the exit status is 1).

WS's training state is ``--state`` (fp32 masters and AdamW moments by default;
bf16 masters with their Kahan buffer, bf16 or int8 moments: ``STATES``), in RAM
or, with ``--store disk``, in a disk store (the model then built on the meta
device and made in the store's files). More WS runs follow the first, each
printed with its tokens/s over the run it is set against: ``--device-tier``
(the same state with a device tier, against the first), ``--vs-state`` (another
state, against the first), and both (the other state with the tier, against
the first state's tier run). ``--checkpoint DIR`` saves the first run's state
there, times the save against a raw write of as many bytes to the same directory
(with fsync), watches the host's resident memory, and resumes it into a new
model that must take the next step to the same bits.

    PYTHONPATH=src python3 benchmarks/gpu_stream.py [--sizes 1b,3b,5b] [--steps 5]
    .venv/bin/python benchmarks/gpu_stream.py --device cpu --tiny --steps 2 --warmup 1

Note [roofline]
---------------
The physical limit of one WS step is the largest of

* compute: 6 x params x tokens / the measured dense matmul peak of the dtype;
* link: the bytes the runtime moved to the device in the step (its residency
  meter's count: every weight fetch, forward and backward, in the transfer
  dtype) and back (the gradients, in the masters' dtype: computed from the
  plan, the runtime has no counter for them) over the measured pinned
  bandwidth of each direction. PCIe is full duplex, so on CUDA the two
  directions overlap (max); on the CPU the "link" is a host memory copy and the
  two share the memory bus (sum);
* host: the step's host memory traffic over the measured host memory bandwidth.
  Per trainable parameter: the optimizer's 28 bytes (AdamW in fp32 reads param,
  grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq; with
  ``--state`` compact, ``compile_phase.compact_update_bytes``); on an
  accelerator also the host mirror's write (the master read, the
  transfer-dtype copy written: Note [host mirror]) and the gradients' arrival
  (written in the masters' dtype by the copy engine: Note [gradients out]); and
  every byte copied to the device, which the copy engine reads from host memory.
  On the CPU the device copies and the gradients are the compute's own memory
  traffic and only the optimizer counts;
* disk (``--store disk``): the bytes the store's placement reads and writes a
  step over the read and write bandwidths of its directory, measured after the
  run as the compile's probe measures them (``probe.disk_bandwidths``).

With ``--activation-offload`` the saved activations (the offload's own count of
bytes sent out in the timed steps) go out in the forward and come back in the
backward: added to both directions of the link and, on an accelerator, twice to
the host memory traffic (written by one copy, read by the other).

``fraction_of_roofline = roofline_s / measured median step``. On the CPU the
three share the same cores and memory, so no run can overlap them and the
fraction stays well below 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import faulthandler
import functools
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint
from _common import (
    current_rss_bytes,
    fmt,
    lm_loss,
    peak_rss_bytes,
    print_result,
    reset_peak_rss,
    summary,
)

import weightstream as cstorch
from weightstream import backend
from weightstream.compiler.compile_phase import compact_update_bytes
from weightstream.compiler.probe import disk_bandwidths, existing_dir
from weightstream.models import Llama, LlamaConfig
from weightstream.models.llama import LlamaBlock
from weightstream.models.zoo import LLAMA_PRESETS
from weightstream.optim import fused

GiB = 2**30
# The same AdamW hyperparameters for every mode (weightstream's AdamW and torch's
# differ in their default eps and weight decay).
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Host bytes of training state per parameter: fp32 master, fp32 gradient, two fp32 moments.
STATE_BYTES_PER_PARAM = 16
# WS's training state (--state, --vs-state): the masters' dtype and AdamW's state dtype.
# bf16 masters keep a bf16 Kahan buffer (Note [Kahan summation] in optim/compact.py);
# int8 moments are block-quantised (Note [compact optimizer state]).
STATES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (torch.float32, torch.int8),
    "bf16-int8": (torch.bfloat16, torch.int8),
}
# Host memory traffic of one fused fp32 AdamW update per parameter (Note [roofline]).
ADAMW_BYTES_PER_PARAM = 28
# Margin on the activation estimate when deciding whether eager fits.
ACTIVATION_MARGIN = 1.25


@dataclass(frozen=True)
class Size:
    cfg: LlamaConfig
    batch: int  # default batch (--batch overrides)
    seq: int  # default sequence length (--seq overrides)


_LLAMA = {"vocab_size": 32000, "seq_len": 2048, "n_kv_head": 8}
# Llama-3.2-like shapes with Llama 2's 32000-token vocabulary. Default batches keep
# the activations (about 15 / 34 / 21 GiB in bf16) well inside an 80 GB device next
# to WS's streamed weights; 5b is the largest whose fp32 masters, gradients and AdamW
# state (16 bytes a parameter, 78 GB) fit a 128 GiB host with room for the rest.
SIZES: dict[str, Size] = {
    "tiny": Size(
        LlamaConfig(vocab_size=1024, seq_len=64, n_layer=4, d_model=256, n_head=4, n_kv_head=2),
        batch=4,
        seq=64,
    ),  # 3.7M params
    "1b": Size(LlamaConfig(**_LLAMA, n_layer=16, d_model=2048, n_head=32, d_ff=8192), 4, 2048),
    "3b": Size(LlamaConfig(**_LLAMA, n_layer=28, d_model=3072, n_head=24, d_ff=8192), 4, 2048),
    "5b": Size(LlamaConfig(**_LLAMA, n_layer=26, d_model=4096, n_head=32, d_ff=11008), 2, 2048),
    # Llama-2-7B's shape: its 108 GB of state needs a host larger than 128 GiB.
    "7b": Size(
        LlamaConfig(vocab_size=32000, seq_len=2048, n_layer=32, d_model=4096, n_head=32),
        2,
        2048,
    ),
    # The zoo's Llama 2 13B shape and its 20B: in a 128 GiB host only with compact state
    # (--state bf16-int8: 8 bytes a parameter at a step's peak), the 20B with the disk
    # store too (--store disk). Their activations want --activation-checkpointing.
    "13b": Size(LlamaConfig(**{**LLAMA_PRESETS["13b"], "seq_len": 2048}), 4, 2048),
    "20b": Size(LlamaConfig(**{**LLAMA_PRESETS["20b"], "seq_len": 2048}), 4, 2048),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---- the device ---------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Host sync point: wait until the device has finished everything queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Give back what the last model left: Python garbage, cached device blocks and
    cached pinned host blocks (FSDP2's offloaded shards are pinned)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def host_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free_memory(device)
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "cpu"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ---- machine limits, measured on the spot ---------------------------------------------------


def _best_seconds(fn, device: torch.device, reps: int, rounds: int = 3) -> float:
    """Best time of ``reps`` calls over ``rounds`` tries, per call (after one warm-up)."""
    fn()
    sync(device)
    best = math.inf
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of an n x n x n product of ``dtype`` on the device (the dense peak)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    return 2 * n**3 / seconds


def link_bandwidths(device: torch.device, nbytes: int) -> dict[str, float]:
    """Bytes/s of host -> device and device -> host copies: from pinned memory (what
    a streaming runtime should use) and from pageable memory. On the CPU, a host
    memory copy (each byte counted once) stands for every one of them."""
    if device.type != "cuda":
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src).fill_(2)
        h2d = nbytes / _best_seconds(lambda: dst.copy_(src), device, 3)
        d2h = nbytes / _best_seconds(lambda: src.copy_(dst), device, 3)
        return {"pinned_h2d": h2d, "pinned_d2h": d2h, "pageable_h2d": h2d}
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {
        "pinned_h2d": nbytes
        / _best_seconds(lambda: dev.copy_(pinned, non_blocking=True), device, 5),
        "pinned_d2h": nbytes
        / _best_seconds(lambda: pinned.copy_(dev, non_blocking=True), device, 5),
        "pageable_h2d": nbytes / _best_seconds(lambda: dev.copy_(pageable), device, 3),
    }
    return out  # the buffers go with this frame (main frees the device's cache)


def host_bandwidth(nbytes: int) -> float:
    """Host memory bytes read + written per second: the best of a copy, an add and an
    in-place scale (the last is the pattern of an in-place optimizer update; see
    benchmarks/host_optimizer.py)."""
    a = torch.ones(nbytes // 4)
    b = torch.full_like(a, 2.0)
    cpu = torch.device("cpu")
    best = 0.0
    for op, moved in ((lambda: b.copy_(a), 2), (lambda: b.add_(a), 3), (lambda: b.mul_(1.0), 2)):
        best = max(best, moved * nbytes / _best_seconds(op, cpu, 3, rounds=2))
    return best


def pick_dtype(device: torch.device, requested: str, n: int, reps: int):
    """The compute dtype, why, and the measured dense peak of each dtype tried."""
    if requested != "auto":
        dtype = DTYPES[requested]
        return dtype, "requested", {requested: matmul_peak(device, dtype, n, reps)}
    if device.type == "cuda":
        return (
            torch.bfloat16,
            "bf16 on CUDA",
            {"bf16": matmul_peak(device, torch.bfloat16, n, reps)},
        )
    # The CPU: bf16 only where the hardware has bf16 dot products and it is faster.
    peaks = {k: matmul_peak(device, dt, n, reps) for k, dt in DTYPES.items()}
    native = sorted({"avx512_bf16", "amx_bf16", "bf16"} & _cpu_flags())
    speed = f"bf16 matmul {peaks['bf16'] / 1e9:.0f} vs fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s"
    capability = torch.backends.cpu.get_cpu_capability()
    if native and peaks["bf16"] >= peaks["fp32"]:
        return torch.bfloat16, f"native bf16 ({', '.join(native)}; {capability}); {speed}", peaks
    why = "no native bf16 in the CPU flags" if not native else "bf16 is slower"
    return torch.float32, f"{why} ({capability}); {speed}", peaks


# ---- models and their memory ------------------------------------------------------------


def held_bytes_per_param(state: str) -> int:
    """Host bytes a parameter holds at a step's peak in WS: its master and gradient (of
    the master's dtype), a bf16 master's Kahan buffer, AdamW's two moments (int8's block
    scales, a 64th, not counted)."""
    master, moments = STATES[state]
    p = master.itemsize
    return 2 * p + (p if p < 4 else 0) + 2 * moments.itemsize


def update_bytes_per_param(state: str) -> int:
    """Host memory bytes of one AdamW update per parameter (Note [roofline])."""
    if state == "fp32":
        return ADAMW_BYTES_PER_PARAM
    return compact_update_bytes(*STATES[state])


def config_of(size: Size, seq: int) -> LlamaConfig:
    return dataclasses.replace(size.cfg, seq_len=max(seq, size.cfg.seq_len))


def count_params(cfg: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(cfg).parameters())


# Each step's seconds printed as it ends (--stacks).
PROGRESS = False

# Elements of one seeded piece of a matrix's initial values (drawn on one thread).
INIT_PIECE = 2**24


def build(cfg: LlamaConfig, checkpointed: bool = False) -> Llama:
    """The model from seed 0, by the zoo's rule (``Llama.init_module``: N(0, 0.02)
    matrices, norms at 1) drawn in pieces of ``INIT_PIECE`` values, each from a
    generator of its own seed, on every core: the same values whatever the threads.
    (CPU ``normal_`` runs on one thread: a 4.9B model took about 20 s, each of a
    call's several modes, from the GPU machine's 15 minutes.) ``checkpointed``: each
    block's forward recomputed in the backward by ``torch.utils.checkpoint`` (the
    peers' activation checkpointing)."""
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device="cpu")
    pieces, seen = [], set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and id(m.weight) not in seen:
            seen.add(id(m.weight))  # a tied weight once
            flat = m.weight.data.view(-1)
            pieces += [flat[i : i + INIT_PIECE] for i in range(0, flat.numel(), INIT_PIECE)]
            if getattr(m, "bias", None) is not None:
                m.bias.data.zero_()
        elif not list(m.children()):
            for p in m.parameters(recurse=False):
                p.data.fill_(1.0)  # the RMSNorms' scales

    def draw(i: int) -> None:
        pieces[i].normal_(0.0, 0.02, generator=torch.Generator().manual_seed(i))

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(draw, range(len(pieces))))  # ATen releases the GIL while it draws
    if checkpointed:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in the backward (non-reentrant)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def activation_bytes(cfg: LlamaConfig, tokens: int, dtype: torch.dtype) -> int:
    """Rough bytes saved for the backward of one step (before a margin).

    Per token and block, in elements of the compute dtype (e bytes each) unless
    said: two RMSNorms (the fp32 input, 4 d bytes, and the normed output, e d);
    attention (rotated q, its rotate-half, the repeated k and v, the attention
    output and the o_proj input: about 7 d + 2 kv); the SwiGLU's gate, silu,
    up and product (4 ffn). Then the logits: e + 4 (the fp32 copy) + 4 (log-softmax)
    + 4 (their gradient) bytes per token and vocabulary entry.
    """
    e = torch.empty((), dtype=dtype).element_size()
    d, kv, f = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    per_block = 8 * d + e * (7 * d + 2 * kv + 4 * f)
    return tokens * (cfg.n_layer * per_block + cfg.vocab_size * (e + 12))


# ---- one training step --------------------------------------------------------------------


def train_step(
    model,
    opt,
    x,
    y,
    device: torch.device,
    autocast_dtype,
    in_backward: bool = False,
    saved_on_host: bool = False,
) -> tuple[float, list]:
    """One step: forward, backward, update; the loss and the seconds of each phase.

    The device is synchronized at each phase's end (host sync points) so that the
    phases are timed apart; the kernels of a phase are queued long before its end,
    so this costs the device one launch latency per phase. ``in_backward``: the
    backward runs in the step's backward context, where a weightstream engine may
    start each unit's update as soon as its gradient is final (Note [updates in
    backward]); the optimizer phase is then what is left of the update.
    ``saved_on_host``: the forward's saved tensors go to host memory
    (``torch.autograd.graph.save_on_cpu``, the peers' activation offload).
    """
    ctx = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    saving = (
        torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        if saved_on_host
        else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    with ctx, saving:
        loss = lm_loss(model(x), y)
    sync(device)
    t1 = time.perf_counter()
    backward_ctx = (
        cstorch.amp.step_helper.backward_context(opt, None)
        if in_backward
        else contextlib.nullcontext()
    )
    with backward_ctx:
        loss.backward()
    sync(device)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    t3 = time.perf_counter()
    return loss.item(), [t1 - t0, t2 - t1, t3 - t2]


@dataclass
class Timing:
    steps: list[float] = dataclasses.field(default_factory=list)
    phases: list[list[float]] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)

    def figures(self, tokens: int, params: int, peak: float) -> dict:
        med = statistics.median(self.steps)
        flops = 6 * params * tokens / med
        return {
            "step_s": summary(self.steps),
            "phases_s": {
                name: statistics.median(p[i] for p in self.phases)
                for i, name in enumerate(("forward", "backward", "optimizer"))
            },
            "tokens_per_s": tokens / med,
            "tflops": flops / 1e12,
            "pct_peak": 100 * flops / peak,
            "loss": {"first": self.losses[0], "last": self.losses[-1]},
        }


def run_steps(
    model,
    opt,
    x,
    y,
    device,
    autocast_dtype,
    warmup: int,
    steps: int,
    on_timed=None,
    in_backward: bool = False,
    saved_on_host: bool = False,
):
    """``warmup`` untimed steps, then ``steps`` timed ones; ``on_timed()`` runs just before
    the first timed step (to read counters and reset peaks)."""
    timing = Timing()
    for i in range(warmup + steps):
        if i == warmup and on_timed is not None:
            on_timed()
        loss, phases = train_step(
            model, opt, x, y, device, autocast_dtype, in_backward, saved_on_host
        )
        if PROGRESS:
            print(f"    step {i + 1} of {warmup + steps}: {sum(phases):.3f} s", flush=True)
        timing.losses.append(loss)
        if i >= warmup:
            timing.phases.append(phases)
            timing.steps.append(sum(phases))
    return timing


def _reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _device_peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _failure(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        text = "out of device memory: " + text
    return text[:400]


# ---- weight streaming -----------------------------------------------------------------------


def _fetched_bytes(runner) -> int | None:
    """The engine's count of bytes it copied to the device so far (its residency meter)."""
    streamer = getattr(runner.engine, "streamer", None)
    meter = getattr(streamer, "meter", None)
    return getattr(meter, "total_fetched_bytes", None)


def _transfer_bytes(runner) -> tuple[int, int, int]:
    """From the plan: the bytes of one fetch of every unit (in the transfer dtype) and of
    every gradient (in the masters' dtype: Note [gradients out]), and the device-memory
    bound of the streamed weights."""
    engine = runner.engine
    streamed = [u for u in engine.streamer.units if u.index not in engine.resident]
    fetch = sum(u.device_bytes() for u in streamed)
    trainable = {id(p): p for u in streamed for p in u.params if p.requires_grad}.values()
    grads = sum(p.numel() * p.element_size() for p in trainable)
    return fetch, grads, engine.plan.weight_bound(engine.config.prefetch_depth)


def _disk_traffic(runner) -> tuple[int, int]:
    """Bytes a step reads from and writes to the disk store's files (0, 0 in RAM)."""
    placed = runner.engine.store.predicted_placement()
    return (0, 0) if placed is None else (placed.disk_reads_per_step, placed.disk_writes_per_step)


def build_ws(cfg: LlamaConfig, state: str, on_meta: bool) -> Llama:
    """WS's model with masters of ``state``'s dtype: from seed 0 as the peers', or on the
    meta device (``on_meta``: a disk store makes the values in its files, by each
    module's initialization rule, without the whole model in memory first)."""
    if not on_meta:
        return build(cfg).to(STATES[state][0])
    with torch.device("meta"):
        return Llama(cfg).to(STATES[state][0])


def make_ws(cfg, device, dtype, args, device_tier: int | str | None, state: str):
    """WS's compiled model, its model and its AdamW, as the options say."""
    disk = args.store == "disk"
    model = build_ws(cfg, state, on_meta=disk)
    store = {}
    if disk:
        budget = args.host_memory_budget
        store = {"store": "disk", "store_dir": args.store_dir}
        if budget is not None:
            store["host_memory_budget"] = int(budget * GiB)
    runner = backend.compile(
        model,
        "wse_ws",
        device=device,
        compute_dtype=dtype,
        unit_classes=(LlamaBlock,),
        prefetch_depth=args.prefetch_depth,
        overlap_updates=args.overlap_updates,
        update_in_backward=args.update_in_backward,
        activation_checkpointing=args.activation_checkpointing,
        activation_offload=args.activation_offload,
        device_tier_budget=device_tier,
        **store,
        # This process's model alone, even if a process group exists (FSDP2's is
        # destroyed after each size, but a launcher's environment must not join it).
        data_parallel=False,
    )
    # torch's fused kernel for fp32 state, the compact kernels for the others.
    fused, moments = state == "fp32", STATES[state][1]
    opt = cstorch.optim.AdamW(model.parameters(), **ADAMW, fused=fused, state_dtype=moments)
    return runner, model, opt


def run_ws(
    cfg, x, y, device, dtype, args, device_tier: int | str | None = None, state: str = "fp32"
) -> dict:
    began = time.perf_counter()
    runner, model, opt = make_ws(cfg, device, dtype, args, device_tier, state)
    built = time.perf_counter()
    start: list[int | None] = []
    offloaded: list[int] = []

    def offloaded_bytes() -> int:  # the streamer exists from the first step (--warmup 0)
        offload = getattr(runner.engine.streamer, "offload", None)  # None without the option
        return 0 if offload is None else offload.bytes_out

    def on_timed():
        _reset_device_peak(device)
        start.append(_fetched_bytes(runner))
        offloaded.append(offloaded_bytes())

    try:
        timing = run_steps(
            runner, opt, x, y, device, None, args.warmup, args.steps, on_timed,
            in_backward=args.update_in_backward,
        )  # fmt: skip
        fetch, grads, bound = _transfer_bytes(runner)
        end = _fetched_bytes(runner)
        peak_bytes = _device_peak(device)
        if args.profile:
            profile_step(runner, opt, x, y, device, args.update_in_backward)
        saved = None
        if args.checkpoint and device_tier is None and state == args.state:  # the first run
            saved = save_checkpoint(runner, model, opt, x, y, device, args)
        counted = None if end is None or start[0] is None else (end - start[0]) / args.steps
        # Saved activations sent to host memory a step (each comes back once).
        act = (offloaded_bytes() - offloaded[0]) / args.steps
        plan = runner.engine.plan
        return {
            "timing": timing,
            "units": len(plan.units),
            "largest_unit_bytes": plan.largest_unit_bytes,
            "weight_bound_bytes": bound,
            "h2d_bytes_counted": counted,
            "h2d_bytes_plan": 2 * fetch,  # Note [roofline]: a forward and a backward fetch
            "d2h_bytes_plan": grads,
            "offload_bytes": act,
            "device_peak_bytes": peak_bytes,
            "mirror": runner.engine.streamer.mirror_bytes() > 0,
            "resident_units": len(runner.engine.resident),
            "tiers": runner.engine.describe_tiers(),
            "transfer_bytes": torch.empty((), dtype=dtype).element_size(),
            "state": state,
            # The disk store's file traffic a step, as its placement predicts it.
            "disk_bytes": _disk_traffic(runner),
            "checkpoint": saved,
        }
    finally:
        runner.close()  # its tensors go with this frame; run_size frees the memory
        # Where a device call's minutes go (each mode builds its model afresh).
        kernels = ""
        if state != "fp32":  # Note [fused compact kernels] in optim/fused.py
            why = fused._KERNELS.unavailable
            kernels = (
                f"; compiled update of parameters of {fused.FUSED_MIN_NUMEL:,}+ values"
                if why is None
                else f"; chunked updates only ({why})"
            )
        print(
            f"  (WS, {state} state, tier {device_tier or 0}: built in {built - began:.1f} s, "
            f"ran in {time.perf_counter() - built:.1f} s{kernels})",
            flush=True,
        )


def _checksums(model, opt) -> list[int]:
    """Exact integer sums of every tensor's bits: the weights' and the optimizer state's."""
    tensors = list(model.state_dict().values())
    tensors += [v for st in opt.state_dict()["state"].values() for v in st.values()]
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            bits = t.detach().cpu().contiguous().view(-1)
            if bits.dtype.is_floating_point:
                bits = bits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.itemsize])
            out.append(int(bits.to(torch.int64).sum()))
    return out


def save_checkpoint(runner, model, opt, x, y, device, args) -> dict:
    """``--checkpoint DIR``: WS's model and optimizer state saved there (``cstorch.save``),
    timed, with the host's resident memory before and at its peak while saving; then one
    more step, whose bits the resumed run must reproduce (``resume_checkpoint``)."""
    directory = Path(args.checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gpu_stream.mdl"
    gc.collect()
    rss_before = current_rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    save_s = time.perf_counter() - t0
    size = path.stat().st_size
    out = {
        "path": str(path),
        "bytes": size,
        "save_s": save_s,
        "rss_before_gib": rss_before / GiB,
        "rss_peak_gib": peak_rss_bytes() / GiB,
    }
    train_step(runner, opt, x, y, device, None, args.update_in_backward)
    out["checksums"] = _checksums(model, opt)
    print(
        f"  checkpoint: {size / 1e9:.2f} GB saved in {save_s:.1f} s; host RSS "
        f"{out['rss_before_gib']:.1f} GiB before, {out['rss_peak_gib']:.1f} GiB at the peak "
        "of the process"
    )
    return out


def disk_write_rate(saved: dict) -> dict:
    """The checkpoint's directory's write rate, measured on a file of the checkpoint's size
    (once it is deleted; at most what the disk has free): a disk writes its first GiB
    faster than a sustained stream (on one VM 1.8 GB/s for 256 MiB, 0.45 for 9 GiB), so a
    smaller probe would flatter it. ``save_vs_disk``: the save's time over that write's."""
    directory = Path(saved["path"]).parent
    nbytes = max(2**20, min(saved["bytes"], shutil.disk_usage(directory).free - GiB))
    write = disk_bandwidths(directory, nbytes)["write"]
    ratio = saved["save_s"] / (saved["bytes"] / write)
    print(
        f"  the save took {ratio:.2f}x a raw write of its bytes ({write / 1e9:.2f} GB/s for a "
        f"{nbytes / 1e9:.1f} GB file with fsync)"
    )
    return {"write_gbps": write / 1e9, "write_probe_bytes": nbytes, "save_vs_disk": ratio}


def resume_checkpoint(cfg, x, y, device, dtype, args, saved: dict) -> dict:
    """A new WS model and optimizer load ``saved``'s checkpoint and take the step the
    saving run took after it: every bit of the weights and the state must agree."""
    runner, model, opt = make_ws(cfg, device, dtype, args, None, args.state)
    try:
        t0 = time.perf_counter()
        state = cstorch.load(saved["path"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        del state
        load_s = time.perf_counter() - t0
        train_step(runner, opt, x, y, device, None, args.update_in_backward)
        exact = _checksums(model, opt) == saved["checksums"]
    finally:
        runner.close()
    print(f"  resumed: loaded in {load_s:.1f} s; the next step {'exact' if exact else 'DIFFERS'}")
    return {"load_s": load_s, "exact": exact}


def profile_step(model, opt, x, y, device: torch.device, in_backward: bool) -> None:
    """One more step under torch.profiler: the operators that took the most host and
    device time, printed (where a streamed step spends what the roofline does not)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        train_step(model, opt, x, y, device, None, in_backward)
    averages = prof.key_averages()
    print("  profile of one WS step, by host time:")
    print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
    if device.type == "cuda":
        print("  by device time:")
        print(averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))


# ---- the peers ------------------------------------------------------------------------------


def steps_with_adamw(model, x, y, device, autocast_dtype, args) -> tuple[Timing, str]:
    """The steps of a peer with torch's fused AdamW; where the fused kernel refuses the
    parameters (at construction or at the first step: FSDP2's DTensor shards, say),
    once more with its foreach AdamW. Returns the timing and which AdamW ran."""
    params = list(model.parameters())

    def run(opt):
        return run_steps(
            model, opt, x, y, device, autocast_dtype, args.warmup, args.steps,
            lambda: _reset_device_peak(device), saved_on_host=args.activation_offload,
        )  # fmt: skip

    try:
        return run(torch.optim.AdamW(params, **ADAMW, fused=True)), "torch AdamW fused"
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        why = f"{type(exc).__name__}: {exc}"[:200]
    for p in params:
        p.grad = None
    opt = torch.optim.AdamW(params, **ADAMW, foreach=True)
    return run(opt), f"torch AdamW foreach (fused failed: {why})"


def run_eager(cfg, x, y, device, dtype, args, params: int, act_bytes: int) -> dict:
    """The model resident on the device; a reason instead where it would not fit."""
    autocast = None if dtype == torch.float32 else dtype
    per_param = STATE_BYTES_PER_PARAM + (
        torch.empty((), dtype=dtype).element_size() if autocast else 0
    )
    need = params * per_param + act_bytes
    free = device_free_bytes(device)
    if need > free:
        return {
            "reason": f"does not fit: needs about {need / GiB:.1f} GiB (params x {per_param} "
            f"bytes + activations {act_bytes / GiB:.1f} GiB), {free / GiB:.1f} GiB free"
        }
    model = None
    try:
        model = build(cfg, args.activation_checkpointing).to(device)
        timing, optimizer = steps_with_adamw(model, x, y, device, autocast, args)
        return {"timing": timing, "device_peak_bytes": _device_peak(device), "optimizer": optimizer}
    except Exception as exc:  # the peer is reported unavailable, with why
        return {"reason": _failure(exc)}
    finally:
        del model
        free_memory(device)


def run_fsdp2(cfg, x, y, device, dtype, args, params: int) -> dict:
    """FSDP2 with CPU offload in this process, world size 1; a reason where it cannot run."""
    need = params * STATE_BYTES_PER_PARAM
    free = host_available_bytes()
    if need * 1.1 > free:
        return {
            "reason": f"host memory: needs about {need / GiB:.1f} GiB of fp32 state, "
            f"{free / GiB:.1f} GiB available"
        }
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except Exception as exc:
        return {"reason": _failure(exc)}
    if not dist.is_available():
        return {"reason": "torch.distributed is not available in this build"}
    pg_backend = "nccl" if device.type == "cuda" else "gloo"
    fd, store_path = tempfile.mkstemp(prefix="gpu_stream_pg_")
    os.close(fd)
    model = None
    initialized = False
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            pg_backend, store=dist.FileStore(store_path, 1), rank=0, world_size=1
        )
        initialized = True
        mesh = init_device_mesh(device.type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype)
        # Pinned shards let the copies to the device run asynchronously; there is
        # no pinned memory without an accelerator.
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        model = build(cfg, args.activation_checkpointing)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        timing, optimizer = steps_with_adamw(model, x, y, device, None, args)
        return {
            "timing": timing,
            "device_peak_bytes": _device_peak(device),
            "backend": pg_backend,
            "optimizer": optimizer,
        }
    except Exception as exc:  # the peer is reported unavailable, with why
        return {"reason": _failure(exc)}
    finally:
        del model
        if initialized:
            dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.unlink(store_path)
        free_memory(device)


# ---- one size -------------------------------------------------------------------------------


def host_bytes(
    params: int, h2d: float, transfer_bytes: int, mirror: bool, device, act_out: float, state: str
) -> float:
    """Host memory bytes one WS step moves (Note [roofline])."""
    update = update_bytes_per_param(state)
    if device.type != "cuda":
        return update * params
    master = STATES[state][0].itemsize
    mirror_write = master + transfer_bytes if mirror else 0
    grads_in = master  # in the masters' dtype, written by the copy engine (Note [gradients out])
    return (update + mirror_write + grads_in) * params + h2d + act_out


def roofline(params, tokens, peak, h2d, d2h, host_bytes, limits, device, disk_s=0.0) -> dict:
    """Note [roofline]."""
    compute = 6 * params * tokens / peak
    to_dev, from_dev = h2d / limits["pinned_h2d"], d2h / limits["pinned_d2h"]
    link = max(to_dev, from_dev) if device.type == "cuda" else to_dev + from_dev
    host = host_bytes / limits["host"]
    parts = {"compute_s": compute, "link_s": link, "host_s": host}
    if disk_s:
        parts["disk_s"] = disk_s
    bound = max(parts, key=parts.get)
    return {**parts, "roofline_s": parts[bound], "bound": bound[: -len("_s")]}


def peer_figures(r: dict, tokens: int, params: int, peak: float) -> dict:
    if "timing" not in r:
        return {"reason": r["reason"]}
    out = r["timing"].figures(tokens, params, peak)
    if r.get("device_peak_bytes") is not None:
        out["device_peak_gib"] = r["device_peak_bytes"] / GiB
    for key, name in (("backend", "process_group"), ("optimizer", "optimizer")):
        if key in r:
            out[name] = r[key]
    return out


def run_size(name: str, size: Size, device, dtype, peak: float, limits: dict, args) -> dict:
    seq = args.seq or size.seq
    batch = args.batch or size.batch
    cfg = config_of(size, seq)
    params = count_params(cfg)
    tokens = batch * seq
    print(
        f"\n[{name}] Llama {cfg.n_layer} blocks, d_model {cfg.d_model}, heads {cfg.n_head}/"
        f"{cfg.kv_heads}, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}: {params / 1e9:.3f}B params; "
        f"batch {batch} x seq {seq} = {tokens} tokens/step, {dtype_name(dtype)}",
        flush=True,
    )
    base = {"params": params, "tokens_per_step": tokens, "batch": batch, "seq": seq}
    host_need = params * held_bytes_per_param(args.state)
    room, where = host_available_bytes(), "host memory"
    if args.store == "disk":  # the disk store keeps in files what RAM does not hold
        room += shutil.disk_usage(existing_dir(args.store_dir)).free
        where = f"host memory and {args.store_dir}'s disk"
    if host_need * 1.1 + 2 * GiB > room:
        reason = (
            f"{where}: the {args.state} state needs {host_need / GiB:.1f} GiB, "
            f"{room / GiB:.1f} GiB available"
        )
        print(f"  skipped: {reason}")
        return {**base, "skipped": reason}

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = torch.roll(x, -1, 1)
    x, y = x.to(device), y.to(device)

    error = None
    try:
        ws = run_ws(cfg, x, y, device, dtype, args, state=args.state)
    except Exception as exc:
        error = _failure(exc)
    # After the except block: no traceback holds the frames' tensors any more.
    free_memory(device)
    if error is not None:
        print(f"  WS failed: {error}")
        return {**base, "error": error}
    fig = ws["timing"].figures(tokens, params, peak)
    med = fig["step_s"]["median"]
    h2d = ws["h2d_bytes_counted"] if ws["h2d_bytes_counted"] is not None else ws["h2d_bytes_plan"]
    act_out = ws["offload_bytes"]  # activations each way: out in the forward, back after
    h2d, d2h = h2d + act_out, ws["d2h_bytes_plan"] + act_out
    moved = host_bytes(params, h2d, ws["transfer_bytes"], ws["mirror"], device, act_out, args.state)
    reads, writes = ws["disk_bytes"]
    disk_s = 0.0
    if reads + writes:  # the store's directory, measured as the compile's probe measures it
        nbytes = 2 * GiB if device.type == "cuda" else 256 * 2**20
        rates = disk_bandwidths(existing_dir(args.store_dir), nbytes)
        disk_s = reads / rates["read"] + writes / rates["write"]
        print(
            f"  disk store: {reads / 1e9:.1f} GB read and {writes / 1e9:.1f} GB written a step; "
            f"{args.store_dir}: read {rates['read'] / 1e9:.2f} GB/s, write "
            f"{rates['write'] / 1e9:.2f} GB/s"
        )
    roof = roofline(params, tokens, peak, h2d, d2h, moved, limits, device, disk_s)

    # Eager needs about what WS keeps on the device besides its streamed weights.
    # (The estimate counts every activation: with checkpointing only the measured peak.)
    act = ACTIVATION_MARGIN * activation_bytes(cfg, tokens, dtype)
    if ws["device_peak_bytes"] is not None:
        measured = ws["device_peak_bytes"] - ws["weight_bound_bytes"]
        act = measured if args.activation_checkpointing else max(act, measured)
    peers = {}
    if "eager" in args.peers:
        peers["eager"] = run_eager(cfg, x, y, device, dtype, args, params, int(act))
    if "fsdp2" in args.peers:
        peers["fsdp2_cpu_offload"] = run_fsdp2(cfg, x, y, device, dtype, args, params)
    peer = {
        key: peer_figures(peers[key], tokens, params, peak)
        if key in peers
        else {"reason": "not run (--peers)"}
        for key in ("eager", "fsdp2_cpu_offload")
    }

    result = {
        **base,
        **fig,
        "h2d_bytes_per_step": h2d,
        "disk_bytes_per_step": {"read": reads, "write": writes},
        "host_bytes_per_step": moved,
        "h2d_bytes_plan": ws["h2d_bytes_plan"],
        "d2h_bytes_per_step": d2h,
        "activation_offload_bytes_per_step": act_out,
        "h2d_gbps": h2d / med / 1e9,
        "d2h_gbps": d2h / med / 1e9,
        "pinned_h2d_gbps": limits["pinned_h2d"] / 1e9,
        "pinned_d2h_gbps": limits["pinned_d2h"] / 1e9,
        "pageable_h2d_gbps": limits["pageable_h2d"] / 1e9,
        "roofline": roof,
        "roofline_s": roof["roofline_s"],
        "fraction_of_roofline": roof["roofline_s"] / med,
        "optimizer": f"weightstream AdamW (host masters, {args.state} state)",
        "units": ws["units"],
        "largest_unit_bytes": ws["largest_unit_bytes"],
        "weight_bound_bytes": ws["weight_bound_bytes"],
        "device_peak_gib": _gib(ws["device_peak_bytes"]),
        "peer": peer,
        "ws_vs_fsdp2": _ratio(fig["tokens_per_s"], peer["fsdp2_cpu_offload"].get("tokens_per_s")),
        "ws_vs_eager": _ratio(med, peer["eager"].get("step_s", {}).get("median")),
    }
    if ws["checkpoint"] is not None:
        saved = {k: v for k, v in ws["checkpoint"].items() if k != "checksums"}
        try:
            saved["resume"] = resume_checkpoint(cfg, x, y, device, dtype, args, ws["checkpoint"])
        except Exception as exc:
            saved["resume"] = {"error": _failure(exc)}
        free_memory(device)
        Path(saved["path"]).unlink(missing_ok=True)
        result["checkpoint"] = {**saved, **disk_write_rate(saved)}
    report_size(result)
    # More WS runs against the first: with the device tier, with --vs-state, and with
    # both against the tier's (the same pair, the tier on).
    again = functools.partial(run_again, cfg, x, y, device, dtype, args, tokens, params, peak)
    tier = args.device_tier == "auto" or args.device_tier > 0
    if tier:
        result["device_tier"] = with_tier = again(fig, "device tier", tier=True, state=args.state)
        eager = peer["eager"].get("step_s", {}).get("median")
        if "step_s" in with_tier and eager is not None:  # what fits the device: eager's speed?
            with_tier["ws_vs_eager"] = with_tier["step_s"]["median"] / eager
            print(f"  WS + device tier / eager step time {with_tier['ws_vs_eager']:.2f}x")
    if args.vs_state:
        result["vs_state"] = again(fig, f"{args.vs_state} state", tier=False, state=args.vs_state)
        if tier and "tokens_per_s" in result["device_tier"]:
            result["vs_state_device_tier"] = again(
                result["device_tier"],
                f"{args.vs_state} state + tier",
                tier=True,
                state=args.vs_state,
            )
    return result


def run_again(cfg, x, y, device, dtype, args, tokens, params, peak, against: dict, label: str,
              tier: bool, state: str) -> dict:  # fmt: skip
    """WS again, with ``--device-tier`` GiB for its device tier (Note [device tier] in
    runtime/placement.py) if ``tier`` and the training ``state``: its figures and its
    tokens/s over those of the run ``against``."""
    budget = None
    if tier:
        budget = "auto" if args.device_tier == "auto" else int(args.device_tier * GiB)
    try:
        ws = run_ws(cfg, x, y, device, dtype, args, device_tier=budget, state=state)
    except Exception as exc:
        error = _failure(exc)
    else:
        error = None
    free_memory(device)
    if error is not None:
        print(f"  WS with {label} failed: {error}")
        return {"error": error}
    fig = ws["timing"].figures(tokens, params, peak)
    ratio = fig["tokens_per_s"] / against["tokens_per_s"]
    print(
        f"  WS, {label} (device tier {args.device_tier if tier else 0} GiB, {state} state): "
        f"{ws['tiers']}; {fig['tokens_per_s']:.0f} tokens/s, {fig['pct_peak']:.1f}% of peak, "
        f"{ratio:.3f}x the run it is set against"
    )
    return {
        **fig,
        "budget_gib": args.device_tier if tier else 0,
        "state": state,
        "resident_units": ws["resident_units"],
        "h2d_bytes_plan": ws["h2d_bytes_plan"],
        "device_peak_gib": _gib(ws["device_peak_bytes"]),
        "vs_against": ratio,
    }


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GiB


def _ratio(a: float, b: float | None) -> float | None:
    return None if b is None else a / b


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


PEER_NAMES = {"eager": "eager", "fsdp2_cpu_offload": "FSDP2 offload"}


def report_size(r: dict) -> None:
    head = f"  {'mode':<14} {'step s min / median / max':<26} {'tokens/s':>10} {'TFLOPS':>8} "
    print(head + f"{'% peak':>7}  fwd / bwd / opt s (median)  loss first -> last")
    rows = [("WS", r)] + [(PEER_NAMES.get(k, k), v) for k, v in r["peer"].items()]
    for name, f in rows:
        if "step_s" not in f:
            print(f"  {name:<14} unavailable: {f['reason']}")
            continue
        ph = f["phases_s"]
        print(
            f"  {name:<14} {fmt(f['step_s']):<26} {f['tokens_per_s']:>10.0f} {f['tflops']:>8.3f} "
            f"{f['pct_peak']:>6.1f}%  {ph['forward']:.3f} / {ph['backward']:.3f} / "
            f"{ph['optimizer']:.3f}     {f['loss']['first']:.4f} -> {f['loss']['last']:.4f}"
        )
    counted = (
        ""
        # the weights' count against the plan's (the activations are counted apart)
        if abs(
            r["h2d_bytes_per_step"] - r["activation_offload_bytes_per_step"] - r["h2d_bytes_plan"]
        )
        < 1
        else (f" (plan, 2 fetches: {r['h2d_bytes_plan'] / 1e9:.3f})")
    )
    print(
        f"  WS link per step: H2D {r['h2d_bytes_per_step'] / 1e9:.3f} GB{counted} at "
        f"{r['h2d_gbps']:.2f} GB/s (pinned {r['pinned_h2d_gbps']:.2f}, pageable "
        f"{r['pageable_h2d_gbps']:.2f}); D2H {r['d2h_bytes_per_step'] / 1e9:.3f} GB at "
        f"{r['d2h_gbps']:.2f} GB/s (pinned {r['pinned_d2h_gbps']:.2f})"
    )
    peak = "" if r["device_peak_gib"] is None else f"; device peak {r['device_peak_gib']:.2f} GiB"
    print(
        f"  WS plan: {r['units']} units, largest {r['largest_unit_bytes'] / 2**20:.1f} MiB, "
        f"streamed weights bound {r['weight_bound_bytes'] / 2**20:.1f} MiB{peak}"
        + (
            f"; activations offloaded {r['activation_offload_bytes_per_step'] / 1e9:.3f} GB"
            if r["activation_offload_bytes_per_step"]
            else ""
        )
    )
    roof = r["roofline"]
    print(
        f"  roofline: compute {roof['compute_s']:.4f} s, link {roof['link_s']:.4f} s, host "
        f"memory {r['host_bytes_per_step'] / 1e9:.1f} GB {roof['host_s']:.4f} s"
        + (f", disk {roof['disk_s']:.4f} s" if "disk_s" in roof else "")
        + f" -> "
        f"{roof['roofline_s']:.4f} s ({roof['bound']}); "
        f"WS at {r['fraction_of_roofline']:.0%} of it"
    )
    ratios = []
    if r["ws_vs_eager"] is not None:
        ratios.append(f"WS/eager step time {r['ws_vs_eager']:.2f}x")
    if r["ws_vs_fsdp2"] is not None:
        ratios.append(f"WS/FSDP2 tokens/s {r['ws_vs_fsdp2']:.2f}x")
    if ratios:
        print("  " + "; ".join(ratios))


# ---- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    ap.add_argument(
        "--tiny", action="store_true", help="the tiny config only (same as --sizes tiny)"
    )
    ap.add_argument(
        "--sizes",
        default="1b,3b,5b",
        help=f"comma-separated names among {', '.join(SIZES)} (default 1b,3b,5b)",
    )
    ap.add_argument("--batch", type=int, help="sequences per step (default: the size's)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the size's)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="compute dtype (auto: bf16 on CUDA; on the CPU bf16 if native and faster, else fp32)",
    )
    ap.add_argument(
        "--peers", default="eager,fsdp2", help="peers to run: eager, fsdp2 (comma-separated)"
    )
    ap.add_argument("--prefetch-depth", type=int, default=1, help="WS units fetched ahead")
    ap.add_argument(
        "--overlap-updates", action="store_true", help="WS: updates behind the next forward"
    )
    ap.add_argument(
        "--update-in-backward",
        action="store_true",
        help="WS: each unit's update starts as soon as its gradient is final",
    )
    ap.add_argument(
        "--device-tier",
        type=lambda v: v if v == "auto" else float(v),
        default=0.0,
        help="GiB of device memory for WS's device tier, or 'auto' (what the device has "
        "left after the first step): WS runs again with it, and its tokens/s over WS's "
        "without it is printed (default 0: not run)",
    )
    ap.add_argument(
        "--state",
        choices=STATES,
        default="fp32",
        help="WS's training state: masters and AdamW moments fp32; bf16 masters (with a "
        "Kahan buffer) and bf16 moments; fp32 masters and int8 moments; bf16 masters and "
        "int8 moments (default fp32)",
    )
    ap.add_argument(
        "--vs-state",
        choices=STATES,
        help="WS runs again with this training state, and its tokens/s over the first run's "
        "is printed (with --device-tier also both with the tier)",
    )
    ap.add_argument(
        "--store", choices=("ram", "disk"), default="ram", help="WS's store (default ram)"
    )
    ap.add_argument("--store-dir", help="the disk store's directory (--store disk)")
    ap.add_argument(
        "--checkpoint",
        help="a directory: WS's state saved there after the timed steps (timed against the "
        "disk's write rate, host RSS watched), then resumed by a new model and checked "
        "bit for bit after one more step",
    )
    ap.add_argument(
        "--host-memory-budget",
        type=float,
        help="GiB of host memory for the disk store's RAM part (default: the store's own)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="WS: one more step under torch.profiler, printed"
    )
    ap.add_argument(
        "--stacks",
        type=float,
        metavar="SECONDS",
        help="where a run takes longer than it should: every SECONDS each thread's stack "
        "on stderr (faulthandler), and each step's seconds as it ends",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="every mode recomputes each block's forward in the backward (WS: its "
        "activation_checkpointing; the peers: torch.utils.checkpoint around each block)",
    )
    ap.add_argument(
        "--activation-offload",
        action="store_true",
        help="every mode keeps the forward's saved activations in host memory (WS: its "
        "activation_offload; the peers: torch.autograd.graph.save_on_cpu)",
    )
    args = ap.parse_args()
    if args.store == "disk" and not args.store_dir:
        ap.error("--store disk needs --store-dir (a directory with room for the state's files)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    args.sizes = ["tiny"] if args.tiny else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown sizes {unknown}; choose among {', '.join(SIZES)}")
    args.peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    if args.peers - {"eager", "fsdp2"}:
        ap.error(f"unknown peers {sorted(args.peers - {'eager', 'fsdp2'})}; use eager, fsdp2")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # each line as it comes, through a pipe too
    args = parse_args()
    if args.stacks:
        global PROGRESS
        PROGRESS = True
        faulthandler.dump_traceback_later(args.stacks, repeat=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tiny = args.sizes == ["tiny"]
    # Measurement sizes: large enough for the device's peak, small enough to be quick.
    n, reps = (8192, 20) if device.type == "cuda" else ((1024, 3) if tiny else (2048, 3))
    link_bytes = GiB if device.type == "cuda" else (64 if tiny else 512) * 2**20
    host_bytes = (64 if tiny else 512) * 2**20

    dtype, why, peaks = pick_dtype(device, args.dtype, n, reps)
    peak = peaks[dtype_name(dtype)]
    limits = link_bandwidths(device, link_bytes)
    free_memory(device)
    limits["host"] = host_bandwidth(host_bytes)
    print(
        f"device {device} ({device_name(device)}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; host memory available "
        f"{host_available_bytes() / GiB:.1f} GiB"
    )
    print(f"compute dtype {dtype_name(dtype)}: {why}")
    print(
        f"measured: {dtype_name(dtype)} dense peak {peak / 1e12:.3f} TFLOP/s ({n}^3 matmul); "
        f"pinned H2D {limits['pinned_h2d'] / 1e9:.2f} GB/s, D2H {limits['pinned_d2h'] / 1e9:.2f} "
        f"GB/s, pageable H2D {limits['pageable_h2d'] / 1e9:.2f} GB/s"
        f"{' (CPU: a host memory copy)' if device.type == 'cpu' else ''}; host memory "
        f"{limits['host'] / 1e9:.1f} GB/s"
    )
    print(f"{args.warmup} warm-up + {args.steps} timed steps per mode, modes run one after another")

    sizes = {}
    for name in args.sizes:
        sizes[name] = run_size(name, SIZES[name], device, dtype, peak, limits, args)
        free_memory(device)
    print_result(
        "gpu_stream",
        device=str(device),
        device_name=device_name(device),
        dtype=dtype_name(dtype),
        dtype_reason=why,
        options={
            k: getattr(args, k)
            for k in (
                "prefetch_depth",
                "update_in_backward",
                "overlap_updates",
                "activation_checkpointing",
                "activation_offload",
                "device_tier",
                "state",
                "vs_state",
                "store",
            )
        },
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        steps=args.steps,
        warmup=args.warmup,
        limits={
            "peak_tflops": peak / 1e12,
            "matmul_tflops": {k: v / 1e12 for k, v in peaks.items()},
            "pinned_h2d_gbps": limits["pinned_h2d"] / 1e9,
            "pinned_d2h_gbps": limits["pinned_d2h"] / 1e9,
            "pageable_h2d_gbps": limits["pageable_h2d"] / 1e9,
            "host_gbps": limits["host"] / 1e9,
        },
        sizes=sizes,
    )
    if any("error" in s for s in sizes.values()):
        sys.exit(1)  # WS itself failed on some size (its error is in the RESULT)


if __name__ == "__main__":
    main()

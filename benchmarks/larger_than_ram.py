"""A model whose fp32 training state is larger than this machine's RAM, trained from the disk store.

Builds a GPT on the meta device, sized so that its fp32 training state (masters,
gradients and AdamW's two moments: 16 bytes per parameter) is ``--ram-factor``
times the machine's RAM (MemTotal), materializes it straight into the disk
store (``store="disk"``, Note [disk tier] in runtime/store.py), and trains it for
``--steps`` steps. Reports the loss of each step, seconds per step
(min/median/max), peak RSS, and the step time against the disk-bandwidth limit:
every byte of the training state read once and written once per step,
``16 B x params / read bandwidth + 16 B x params / write bandwidth``, with the
bandwidths measured on the store's own directory just before the run (a 2 GiB
file written with fsync and read back after dropping it from the page cache,
best of 3). Needs free disk space of about the training state's size.

    .venv/bin/python benchmarks/larger_than_ram.py --store-dir runs/large_store [--steps 3]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from pathlib import Path

import torch
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
from weightstream.models import GPT, GPTConfig
from weightstream.runtime.engine import UPDATE_BYTES_PER_WEIGHT_BYTE

STATE_BYTES_PER_PARAM = 16  # fp32 master, gradient, exp_avg, exp_avg_sq


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo (Linux only)")


def disk_bandwidths(directory: Path, nbytes: int = 2 * 2**30, repeats: int = 3):
    """Best write (with fsync) and cold read bandwidth of ``directory``, bytes/s."""
    chunk = bytes(64 * 2**20)
    path = directory / "bandwidth.probe"
    best_w = best_r = 0.0
    try:
        for _ in range(repeats):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            t = time.perf_counter()
            for _ in range(nbytes // len(chunk)):
                os.write(fd, chunk)
            os.fsync(fd)
            best_w = max(best_w, nbytes / (time.perf_counter() - t))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must hit the disk
            os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            t = time.perf_counter()
            while os.read(fd, len(chunk)):
                pass
            best_r = max(best_r, nbytes / (time.perf_counter() - t))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return best_r, best_w


def config_for(target_params: int, d_model: int, seq_len: int) -> GPTConfig:
    per_layer = 12 * d_model * d_model + 13 * d_model  # attention + MLP + 2 LayerNorms
    n_layer = math.ceil(target_params / per_layer)
    return GPTConfig(
        vocab_size=256, seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=d_model // 128
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-dir", required=True, help="directory of the disk store's files")
    ap.add_argument("--ram-factor", type=float, default=1.3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()

    ram = mem_total()
    cfg = config_for(int(args.ram_factor * ram / STATE_BYTES_PER_PARAM), args.d_model, args.seq_len)
    store_dir = Path(args.store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    state = STATE_BYTES_PER_PARAM * params
    free = shutil.disk_usage(store_dir).free
    print(
        f"RAM {ram / 2**30:.1f} GiB; GPT {cfg.n_layer} blocks, d_model {cfg.d_model}: "
        f"{params / 1e9:.2f}B params, fp32 training state {state / 2**30:.1f} GiB = "
        f"{state / ram:.2f}x RAM; free disk in {store_dir}: {free / 2**30:.1f} GiB",
        flush=True,
    )
    if free < state * 1.02:
        raise SystemExit(f"not enough free disk space in {store_dir} for {state / 2**30:.1f} GiB")
    read_bw, write_bw = disk_bandwidths(store_dir)
    limit = state / read_bw + state / write_bw

    t0 = time.perf_counter()
    torch.manual_seed(0)
    unit_bytes = 4 * (12 * cfg.d_model**2 + 13 * cfg.d_model)
    budget = (1 + 1 + UPDATE_BYTES_PER_WEIGHT_BYTE) * unit_bytes
    runner = cstorch.compile(
        model, backend="ws", store="disk", store_dir=str(store_dir), host_memory_budget=budget
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.roll(x, -1, 1)
    runner.engine.prepare(x)
    setup = time.perf_counter() - t0
    print(
        f"materialized in the disk store in {setup:.0f} s; {len(runner.plan.units)} units, "
        f"largest {runner.plan.largest_unit_bytes / 2**20:.0f} MiB; host_memory_budget "
        f"{budget / 2**30:.2f} GiB; RSS now {current_rss_bytes() / 2**30:.2f} GiB",
        flush=True,
    )

    reset_peak_rss()
    baseline = current_rss_bytes()
    times, losses = [], []
    for i in range(args.steps):
        t = time.perf_counter()
        loss = lm_loss(runner(x), y)
        t_fwd = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # host sync point: the step is complete
        end = time.perf_counter()
        times.append(end - t)
        print(
            f"  step {i + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s (forward "
            f"{t_fwd - t:.1f}, backward {t_bwd - t_fwd:.1f}, update {end - t_bwd:.1f}), "
            f"peak RSS so far {peak_rss_bytes() / 2**30:.2f} GiB",
            flush=True,
        )
    peak = peak_rss_bytes()
    s = summary(times)
    print(
        f"seconds per step (min / median / max) {fmt(s, 1)}; disk-bandwidth limit {limit:.1f} s "
        f"(read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s, "
        f"{state / 1e9:.1f} GB each way): {s['median'] / limit:.2f}x the limit; "
        f"peak RSS {peak / 2**30:.2f} GiB ({peak / ram:.1%} of RAM, "
        f"{(peak - baseline) / 2**30:.2f} GiB above the RSS before the first step); "
        f"losses finite: {all(math.isfinite(v) for v in losses)}"
    )
    runner.engine.close()
    print_result(
        "larger_than_ram",
        params=params,
        state_bytes=state,
        ram_bytes=ram,
        state_over_ram=state / ram,
        seconds=s,
        limit_seconds=limit,
        over_limit=s["median"] / limit,
        peak_rss=peak,
        losses=losses,
        pid=os.getpid(),
    )


if __name__ == "__main__":
    main()

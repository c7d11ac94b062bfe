"""RAM store against disk store: step time and peak resident memory.

Trains the benchmark GPT (6 blocks, d_model 512, seq 256, batch 8) in weight
streaming mode with weightstream's AdamW (fused), once with the store in RAM and
once with ``store="disk"`` (Note [disk tier] in runtime/store.py), the two
taking turns step by step in one process so machine noise hits both alike.
Peak RSS is measured in a fresh process per store (VmHWM over 3 steps, minus
the RSS before the first step). Prints min/median/max seconds per step, the
ratio disk/RAM and each as a fraction of the machine limit (compute at the
measured fp32 matmul peak; the disk store's files stay in the page cache here,
so the disk is not the limit).

    .venv/bin/python benchmarks/disk_store.py [--steps 10] [--warmup 2] [--store-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from _common import (
    GPT_BENCH,
    GPT_BENCH_BATCH,
    current_rss_bytes,
    fmt,
    gpt_batch,
    lm_loss,
    machine_profile,
    peak_rss_bytes,
    print_result,
    reset_peak_rss,
    summary,
    train_step_flops,
)

import weightstream as cstorch
from weightstream.models import GPT
from weightstream.runtime.budgets import UPDATE_BYTES_PER_WEIGHT_BYTE


def make_runner(store: str, store_dir: str):
    torch.manual_seed(0)
    model = GPT(GPT_BENCH)
    kwargs = {}
    if store == "disk":
        kwargs = {"store": "disk", "store_dir": store_dir}
    runner = cstorch.compile(model, backend="ws", **kwargs)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return runner, opt


def step(runner, opt, x, y) -> float:
    t0 = time.perf_counter()
    loss = lm_loss(runner(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # host sync point: the step is complete
    return time.perf_counter() - t0


def rss_child(store: str, store_dir: str) -> None:
    """In a fresh process: peak RSS growth over 3 steps with one store."""
    x, y = gpt_batch()
    runner, opt = make_runner(store, store_dir)
    runner.engine.prepare(x)
    baseline = current_rss_bytes()
    reset_peak_rss()
    for _ in range(3):
        step(runner, opt, x, y)
    print(json.dumps({"baseline": baseline, "peak": peak_rss_bytes()}))


def measure_rss(store: str, store_dir: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", store, "--store-dir", store_dir],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--store-dir", default=None, help="disk store directory (default: a temp dir)")
    ap.add_argument("--rss-child", choices=["ram", "disk"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    store_dir = args.store_dir or tempfile.mkdtemp(prefix="weightstream-bench-store-")
    if args.rss_child:
        rss_child(args.rss_child, store_dir)
        return

    rss = {s: measure_rss(s, store_dir) for s in ("ram", "disk")}
    x, y = gpt_batch()
    runners = {s: make_runner(s, store_dir) for s in ("ram", "disk")}
    times: dict[str, list[float]] = {s: [] for s in runners}
    for i in range(args.warmup + args.steps):
        for s, (runner, opt) in runners.items():
            t = step(runner, opt, x, y)
            if i >= args.warmup:
                times[s].append(t)

    plan = runners["disk"][0].plan
    params = sum(p.numel() for p in runners["ram"][0].parameters())
    flops = train_step_flops(GPT_BENCH, GPT_BENCH_BATCH)
    limit = flops / machine_profile(store_dir).peak_flops(torch.float32)
    budget = (1 + 1 + UPDATE_BYTES_PER_WEIGHT_BYTE) * plan.largest_unit_bytes
    print(
        f"GPT {GPT_BENCH.n_layer} blocks, d_model {GPT_BENCH.d_model}, seq {GPT_BENCH.seq_len}, "
        f"batch {GPT_BENCH_BATCH}: {params / 1e6:.1f}M params, training state "
        f"{16 * params / 2**20:.0f} MiB (fp32 masters, gradients, 2 moments); "
        f"{len(plan.units)} units, largest {plan.largest_unit_bytes / 2**20:.1f} MiB; "
        f"{torch.get_num_threads()} threads; store dir {store_dir} ({os.statvfs(store_dir).f_bsize} B blocks)"
    )
    print(f"seconds per step over {args.steps} steps (min / median / max)")
    result: dict = {"params": params}
    med = {s: summary(ts)["median"] for s, ts in times.items()}
    for s, ts in times.items():
        growth = rss[s]["peak"] - rss[s]["baseline"]
        print(
            f"  {s:<5} {fmt(summary(ts))}   {limit / med[s]:.0%} of the compute limit "
            f"({limit:.3f} s)   peak RSS {rss[s]['peak'] / 2**20:.0f} MiB "
            f"(+{growth / 2**20:.0f} MiB during steps)"
        )
        result[s] = {
            "seconds": summary(ts),
            "fraction_of_limit": limit / med[s],
            "peak_rss": rss[s]["peak"],
            "rss_growth": growth,
        }
    per_step = [d / r for d, r in zip(times["disk"], times["ram"])]
    result["disk_over_ram"] = med["disk"] / med["ram"]
    result["disk_over_ram_per_step"] = summary(per_step)
    print(
        f"  disk/RAM median ratio {result['disk_over_ram']:.3f} "
        f"(per-step ratios {fmt(summary(per_step))}); the disk store's resident pages are "
        f"bounded by {budget / 2**20:.0f} MiB (prefetch_depth 1: 2 units in flight + one update)"
    )
    print_result("disk_store", **result)


if __name__ == "__main__":
    main()

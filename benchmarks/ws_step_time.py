"""Step time of weight streaming (WS) and layer pipelined (LP) against eager PyTorch.

Trains the benchmark GPT (6 blocks, d_model 512, 8 heads, seq 256, batch 8,
vocab 4096) with torch.optim.AdamW in the three modes, in fp32 and with bf16
autocast. The modes take turns step by step (eager, LP, WS, eager, ...) so that
machine noise hits all of them alike. Prints min/median/max seconds per step and
the ratios WS/eager and LP/eager of the medians.

    .venv/bin/python benchmarks/ws_step_time.py [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from _common import GPT_BENCH as CFG
from _common import GPT_BENCH_BATCH as BATCH
from _common import machine_profile, print_result, summary, train_step_flops

import weightstream as cstorch
from weightstream.models import GPT


def make_runner(mode: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = model if mode == "eager" else cstorch.compile(model, backend=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return runner, opt


def step(runner, opt, x, y, autocast: bool) -> float:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        logits = runner(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # host sync point: the step is complete
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    print(
        f"GPT {CFG.n_layer} blocks, d_model {CFG.d_model}, seq {CFG.seq_len}, batch {BATCH}, "
        f"vocab {CFG.vocab_size}: {GPT(CFG).num_parameters() / 1e6:.1f}M params; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    modes = ["eager", "lp", "ws"]
    profile = machine_profile()
    flops = train_step_flops(CFG, BATCH)
    result = {}
    for dtype in args.dtypes.split(","):
        autocast = dtype == "bf16"
        runners = {m: make_runner(m) for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.warmup + args.steps):
            for m in modes:
                t = step(*runners[m], x, y, autocast)
                if i >= args.warmup:
                    times[m].append(t)
        med = {m: statistics.median(ts) for m, ts in times.items()}
        print(f"\n[{dtype}] seconds per step over {args.steps} steps (min / median / max)")
        for m in modes:
            ts = times[m]
            print(f"  {m:<6} {min(ts):.3f} / {med[m]:.3f} / {max(ts):.3f}")
        # Per-round ratios show the spread of the ratio itself, not only of the times.
        for m in ("lp", "ws"):
            r = sorted(a / b for a, b in zip(times[m], times["eager"]))
            print(
                f"  {m.upper()}/eager median ratio {med[m] / med['eager']:.3f} "
                f"(per-step ratios min {r[0]:.3f} / median {statistics.median(r):.3f} / max {r[-1]:.3f})"
            )
        peak = profile.peak_flops(torch.bfloat16 if autocast else torch.float32)
        limit = flops / peak
        print(
            f"  machine limit: {flops / 1e9:.1f} GFLOP per step at the measured matmul peak "
            f"{peak / 1e9:.0f} GFLOP/s = {limit:.3f} s; WS reaches {limit / med['ws']:.0%} of it"
        )
        r_ws = [a / b for a, b in zip(times["ws"], times["eager"])]
        result[dtype] = {
            m: {"seconds": summary(ts), "fraction_of_limit": limit / med[m]}
            for m, ts in times.items()
        }
        result[dtype]["ws_over_eager"] = med["ws"] / med["eager"]
        result[dtype]["ws_over_eager_per_step"] = summary(r_ws)
        ws = runners["ws"][0]
        print(
            f"  WS plan: {len(ws.plan.units)} units, largest {ws.plan.largest_unit_bytes / 2**20:.1f} MiB, "
            f"peak device weights {ws.engine.streamer.meter.peak_bytes / 2**20:.1f} MiB "
            f"(bound {ws.plan.weight_bound(ws.engine.config.prefetch_depth) / 2**20:.1f} MiB)"
        )
    print_result("ws_step_time", steps=args.steps, flops_per_step=flops, dtypes=result)


if __name__ == "__main__":
    main()

"""Host optimizer throughput: weightstream's AdamW against torch.optim.AdamW.

The store runs the optimizer update on the host; this measures parameters
updated per second on a GPT-like set of tensors (fp32), for ours (foreach and
fused) and torch's (foreach and fused), taking turns so noise hits all alike.
Prints min/median/max Gparam/s and ratios against torch fused, and the fraction
of the memory-bandwidth limit (AdamW fp32 moves 28 bytes per parameter: reads
param, grad, exp_avg, exp_avg_sq, writes param, exp_avg, exp_avg_sq).

    .venv/bin/python benchmarks/host_optimizer.py [--mparams 50] [--repeats 7]

``--compact`` instead compares the compact-state kernels (Note [compact optimizer
state] in optim/compact.py) with the fp32 one on one tensor of ``--numel``
elements: bytes moved per second by each (reads and writes of the parameter,
its Kahan compensation, the moments and their scales, and the gradient read),
side by side in one run, with min/median/max and the ratio to fp32 state; the
rows marked "chunks" run the chunked kernel where the compiled one would (Note
[fused compact kernels] in optim/fused.py).

    .venv/bin/python benchmarks/host_optimizer.py --compact [--numel 4000000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import print_result, summary

import weightstream as cstorch
from weightstream.optim import fused


def shapes(total: int) -> list[tuple[int, ...]]:
    """Matrices and vectors like a transformer's, adding up to about ``total`` params."""
    d = 1024
    out, n = [], 0
    while n < total:
        for s in [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]:
            out.append(s)
            n += torch.Size(s).numel()
    return out


def memory_bandwidth() -> float:
    """Bytes read + written per second by the best of a copy, an add and a scale.

    The in-place scale usually wins: it writes back the lines it has just read,
    with no separate destination to fetch first, which is the pattern of the
    optimizer's in-place update, so its rate is the fair limit.
    """
    a = torch.empty(256 * 2**20 // 4).normal_()
    b = torch.empty_like(a).normal_()
    best = 0.0
    for op, moved in ((lambda: b.copy_(a), 2), (lambda: b.add_(a), 3), (lambda: b.mul_(1.0), 2)):
        op()
        t = time.perf_counter()
        for _ in range(5):
            op()
        best = max(best, 5 * moved * a.numel() * 4 / (time.perf_counter() - t))
    return best


COMPACT_VARIANTS = {
    # name: (parameter dtype, state_dtype, chunks: the chunked kernel where the
    # compiled one would run, Note [fused compact kernels] in optim/fused.py)
    "fp32 state": (torch.float32, torch.float32, False),
    "bf16 state": (torch.float32, torch.bfloat16, False),
    "bf16 state, chunks": (torch.float32, torch.bfloat16, True),
    "int8 state": (torch.float32, torch.int8, False),
    "int8 state, chunks": (torch.float32, torch.int8, True),
    "bf16 master+Kahan": (torch.bfloat16, torch.float32, False),
    "bf16 master+Kahan, chunks": (torch.bfloat16, torch.float32, True),
    "bf16 master+Kahan+bf16 state": (torch.bfloat16, torch.bfloat16, False),
    "bf16 master+Kahan+bf16 state, chunks": (torch.bfloat16, torch.bfloat16, True),
    "bf16 master+Kahan+int8 state": (torch.bfloat16, torch.int8, False),
    "bf16 master+Kahan+int8 state, chunks": (torch.bfloat16, torch.int8, True),
}


def _step(opt, chunks: bool) -> None:
    """``opt.step()``, on the chunked kernel if ``chunks`` (the compiled one marked
    unavailable meanwhile, as where it cannot be built)."""
    kernels = fused._KERNELS
    before = kernels.unavailable
    if chunks:
        kernels.unavailable = "benchmark: the chunked kernel"
    try:
        opt.step()
    finally:
        kernels.unavailable = before


def bytes_moved(p: torch.Tensor, state: dict) -> int:
    """Bytes one step moves: the parameter and every state tensor read and written, the
    gradient read (the step counter aside)."""
    held = sum(v.nbytes for k, v in state.items() if k != "step")
    return 2 * p.nbytes + 2 * held + p.nbytes


def compact(args) -> None:
    torch.manual_seed(0)
    opts, moved = {}, {}
    for name, (dtype, state_dtype, chunks) in COMPACT_VARIANTS.items():
        p = torch.randn(args.numel).to(dtype).requires_grad_()
        p.grad = torch.randn(args.numel).to(dtype)
        opt = cstorch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, state_dtype=state_dtype)
        _step(opt, chunks)  # warm-up (and the kernel's compile)
        opts[name], moved[name] = opt, bytes_moved(p, opt.state[p])
    if fused._KERNELS.unavailable is not None:
        print(f"the compiled kernel is unavailable ({fused._KERNELS.unavailable})")
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(args.repeats):
        for name, opt in opts.items():  # taking turns: noise hits all alike
            t = time.perf_counter()
            _step(opt, COMPACT_VARIANTS[name][2])
            times[name].append(time.perf_counter() - t)
    bw = memory_bandwidth()
    print(
        f"AdamW update of one tensor of {args.numel / 1e6:.1f}M elements; "
        f"{torch.get_num_threads()} threads; memory bandwidth {bw / 1e9:.1f} GB/s"
    )
    ref_rate = moved["fp32 state"] / statistics.median(times["fp32 state"])
    ref_time = statistics.median(times["fp32 state"])
    result = {}
    for name, ts in times.items():
        rates = sorted(moved[name] / t / 1e9 for t in ts)
        med = statistics.median(ts)
        rate = moved[name] / med
        print(
            f"  {name:<37} {moved[name] / args.numel:5.2f} B/param moved   GB/s min "
            f"{rates[0]:.2f} / median {statistics.median(rates):.2f} / max {rates[-1]:.2f}   "
            f"bytes/s vs fp32 {rate / ref_rate:.2f}x   step time vs fp32 {med / ref_time:.2f}x   "
            f"{rate / bw:.0%} of bandwidth"
        )
        result[name] = {
            "gbytes_per_s": summary([moved[name] / t / 1e9 for t in ts]),
            "bytes_per_param": moved[name] / args.numel,
            "bytes_per_s_vs_fp32": rate / ref_rate,
            "time_vs_fp32": med / ref_time,
        }
    print_result("host_optimizer_compact", numel=args.numel, variants=result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mparams", type=float, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compact", action="store_true", help="compare the compact-state kernels")
    ap.add_argument("--numel", type=int, default=4_000_000, help="elements (with --compact)")
    args = ap.parse_args()
    if args.compact:
        compact(args)
        return
    torch.manual_seed(0)
    sh = shapes(int(args.mparams * 1e6))
    n = sum(torch.Size(s).numel() for s in sh)
    variants = {
        "ours foreach": lambda ps: cstorch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1),
        "ours fused": lambda ps: cstorch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, eps=1e-6, foreach=True),
        "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, eps=1e-6, fused=True),
    }
    opts = {}
    for name, make in variants.items():
        ps = [torch.randn(s, requires_grad=True) for s in sh]
        for p in ps:
            p.grad = torch.randn_like(p)
        opts[name] = make(ps)
        opts[name].step()  # warm-up (and torch's lazy state)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(args.repeats):
        for name, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    bw = memory_bandwidth()
    limit = bw / 28  # params/s if the update only moved its 28 bytes per param at copy speed
    print(
        f"{n / 1e6:.1f}M fp32 params in {len(sh)} tensors; {torch.get_num_threads()} threads; "
        f"memory bandwidth {bw / 1e9:.1f} GB/s -> memory limit {limit / 1e9:.2f} Gparam/s"
    )
    ref = statistics.median(times["torch fused"])
    result = {}
    for name, ts in times.items():
        rates = sorted(n / t / 1e9 for t in ts)
        med = statistics.median(ts)
        print(
            f"  {name:<14} Gparam/s min {rates[0]:.3f} / median {statistics.median(rates):.3f} / "
            f"max {rates[-1]:.3f}   speed vs torch fused {ref / med:.2f}x   "
            f"{n / med / limit:.0%} of the memory limit"
        )
        result[name] = {
            "gparam_per_s": summary([n / t / 1e9 for t in ts]),
            "vs_torch_fused": ref / med,
            "fraction_of_limit": n / med / limit,
        }
    print_result("host_optimizer", params=n, variants=result)


if __name__ == "__main__":
    main()

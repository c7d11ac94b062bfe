"""Host optimizer throughput: weightstream's AdamW against torch.optim.AdamW.

The store runs the optimizer update on the host; this measures parameters
updated per second on a GPT-like set of tensors (fp32), for ours (foreach and
fused) and torch's (foreach and fused), taking turns so noise hits all alike.
Prints min/median/max Gparam/s and ratios against torch fused, and the fraction
of the memory-bandwidth limit (AdamW fp32 moves 28 bytes per parameter: reads
param, grad, exp_avg, exp_avg_sq, writes param, exp_avg, exp_avg_sq).

    .venv/bin/python benchmarks/host_optimizer.py [--mparams 50] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import print_result, summary

import weightstream as cstorch


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mparams", type=float, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
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

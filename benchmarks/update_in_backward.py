"""The optimizer step started in the backward against the step after it.

Trains the benchmark GPT (6 blocks, d_model 512, seq 256, batch 8) in weight
streaming mode with weightstream's AdamW (fused) through ``amp.optimizer_step``,
twice: with ``update_in_backward=True`` (each unit's share of the step starts as
soon as its gradients are final, Note [updates in backward]) and without, each
with the RAM store and with the disk store (``--store ram,disk``). The runs of
one store take turns step by step in one process, so machine noise hits both
alike; their losses must be equal (the benchmark says if they are not). Prints
min/median/max seconds per step and the ratio with / without.

On a CPU the update competes with the backward for the same cores, so the gain
is what the update's memory traffic and the disk store's I/O waits leave idle;
on an accelerator the host cores are free while the device runs the backward.

    .venv/bin/python benchmarks/update_in_backward.py [--steps 8] [--warmup 2]
        [--store ram,disk] [--store-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import GPT_BENCH, fmt, gpt_batch, lm_loss, print_result, summary

import weightstream as cstorch
from weightstream.models import GPT


def make_runner(store: str, store_dir: str, early: bool):
    torch.manual_seed(0)
    model = GPT(GPT_BENCH)
    kwargs = {"store": "disk", "store_dir": store_dir} if store == "disk" else {}
    runner = cstorch.compile(model, backend="ws", update_in_backward=early, **kwargs)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return runner, opt


def step(runner, opt, x, y) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = lm_loss(runner(x), y)
    cstorch.amp.optimizer_step(loss, opt, None)
    value = loss.item()  # host sync point: the step is complete (step() waited for it)
    return time.perf_counter() - t0, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--store", default="ram,disk", help="comma-separated: ram, disk")
    ap.add_argument("--store-dir", default=None, help="disk store directory (default: a temp dir)")
    args = ap.parse_args()
    x, y = gpt_batch()
    results = {}
    print(f"benchmark GPT, batch {x.shape[0]} x {x.shape[1]}, {torch.get_num_threads()} threads")
    for store in [s for s in args.store.split(",") if s]:
        with (
            tempfile.TemporaryDirectory(dir=args.store_dir) as d1,
            tempfile.TemporaryDirectory(dir=args.store_dir) as d2,
        ):
            runs = {
                "after": make_runner(store, d1, False),
                "in_backward": make_runner(store, d2, True),
            }
            times = {k: [] for k in runs}
            losses = {k: [] for k in runs}
            for i in range(args.warmup + args.steps):
                for name, (runner, opt) in runs.items():
                    seconds, loss = step(runner, opt, x, y)
                    losses[name].append(loss)
                    if i >= args.warmup:
                        times[name].append(seconds)
            for runner, _ in runs.values():
                runner.engine.close()
        ratios = [a / b for a, b in zip(times["in_backward"], times["after"])]
        same = losses["in_backward"] == losses["after"]
        results[store] = {
            "after_s": summary(times["after"]),
            "in_backward_s": summary(times["in_backward"]),
            "ratio": summary(ratios),
            "same_losses": same,
        }
        print(
            f"{store:>4} store: step after the backward {fmt(summary(times['after']))} s, "
            f"in the backward {fmt(summary(times['in_backward']))} s; ratio "
            f"{fmt(summary(ratios))} (median {statistics.median(ratios):.3f}); "
            f"losses {'equal' if same else 'DIFFER'}"
        )
    print_result("update_in_backward", stores=results)


if __name__ == "__main__":
    main()

"""Compact training state: quality and held host bytes against fp32, side by side.

Trains the same GPT (same initial weights, same batches of the embedded byte
corpus) four ways, weight streamed on the CPU:

* fp32: fp32 masters, fp32 AdamW moments;
* bf16 masters + Kahan (Note [Kahan summation] in optim/compact.py);
* bf16 masters + Kahan + bf16 state;
* fp32 masters + int8 state (Note [compact optimizer state]);

and prints each one's final train loss (mean of the last 20 steps) and eval loss
with their ratio to fp32, plus the host bytes per parameter it holds, measured as
the growth of the process's resident memory from before the model is built
(freed heap pages given back first: ``trim_heap``) to two moments of a step
after a few: within the step (after the backward: the gradients are alive) and
at rest (after the update and ``zero_grad()``, which frees the gradients as the
run command's trainer does).

    .venv/bin/python benchmarks/compact_state.py [--steps 2000] [--d-model 512]
        [--layers 8] [--seq-len 256] [--batch 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F
from _common import current_rss_bytes, print_result

import weightstream as cstorch
from weightstream.common.pages import trim_heap
from weightstream.data.corpus import ByteCorpusDataset
from weightstream.models import GPT, GPTConfig

VARIANTS = {
    # name: (master dtype, state_dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16 masters+Kahan": (torch.bfloat16, torch.float32),
    "bf16 masters+Kahan+bf16 state": (torch.bfloat16, torch.bfloat16),
    "fp32 masters+int8 state": (torch.float32, torch.int8),
}
RSS_STEPS = 3  # steps before the resident memory is read: every buffer exists by then


def _batches(dataset, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(dataset), (batch,), generator=g)
        xs, ys = zip(*(dataset[int(i)] for i in idx))
        yield torch.stack(xs), torch.stack(ys)


def _loss(runner, x, y) -> torch.Tensor:
    # Mixed precision: bf16 compute whatever the masters (the GPU recipe).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = runner(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _held(rss0: int, params: int) -> float:
    """Resident memory grown since ``rss0``, per parameter (freed heap pages returned)."""
    gc.collect()
    trim_heap()
    return (current_rss_bytes() - rss0) / params


def train(name: str, cfg: GPTConfig, args, train_set, eval_set) -> dict:
    master_dtype, state_dtype = VARIANTS[name]
    gc.collect()
    trim_heap()
    rss0 = current_rss_bytes()
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(master_dtype)
    params = sum(p.numel() for p in model.parameters())
    runner = cstorch.compile(model, backend="wse_ws", device="cpu")
    opt = cstorch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), state_dtype=state_dtype
    )
    losses, held, in_step = [], None, None
    start = time.perf_counter()
    batches = _batches(train_set, args.batch, args.steps, seed=1 + args.seed)
    for step, (x, y) in enumerate(batches):
        loss = _loss(runner, x, y)
        loss.backward()
        measure = step + 1 == min(RSS_STEPS, args.steps)
        if measure:  # within the step: the gradients are alive
            in_step = _held(rss0, params)
        opt.step()
        opt.zero_grad()  # set_to_none: the gradients go, as in the run command's trainer
        losses.append(loss.item())
        if (step + 1) % 200 == 0:
            print(
                f"  {name}: step {step + 1}, loss {loss.item():.4f}, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
        if measure:
            opt.synchronize()
            held = _held(rss0, params)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        evals = [
            _loss(runner, x, y).item()
            for x, y in _batches(eval_set, args.batch, args.eval_batches, seed=2)
        ]
    tail = losses[-min(20, len(losses)) :]
    out = {
        "params": params,
        "train_loss": sum(tail) / len(tail),
        "eval_loss": sum(evals) / len(evals),
        "held_bytes_per_param": held,
        "in_step_bytes_per_param": in_step,
        "seconds": seconds,
    }
    runner.engine.close()
    del runner, model, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument(
        "--seed", type=int, default=0, help="initial weights and training batches (eval: fixed)"
    )
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--max-bytes", type=int, default=8 * 2**20, help="corpus bytes")
    args = ap.parse_args()
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
    )
    train_set = ByteCorpusDataset(args.seq_len, split="train", max_bytes=args.max_bytes)
    eval_set = ByteCorpusDataset(args.seq_len, split="eval", max_bytes=args.max_bytes)
    # A throwaway start: one-time allocations (threads, the allocator's arenas, the
    # streaming plan's caches) must not count as the first variant's held bytes.
    train("fp32", cfg, argparse.Namespace(**{**vars(args), "steps": RSS_STEPS, "eval_batches": 1}),
          train_set, eval_set)  # fmt: skip
    results = {name: train(name, cfg, args, train_set, eval_set) for name in VARIANTS}
    ref = results["fp32"]
    print(
        f"GPT d_model {args.d_model} x {args.layers} layers, {ref['params'] / 1e6:.1f}M params, "
        f"{args.steps} steps of {args.batch} x {args.seq_len} bytes"
    )
    for name, r in results.items():
        r["train_vs_fp32"] = r["train_loss"] / ref["train_loss"]
        r["eval_vs_fp32"] = r["eval_loss"] / ref["eval_loss"]
        print(
            f"  {name:<30} train {r['train_loss']:.4f} ({r['train_vs_fp32']:.4f}x)   "
            f"eval {r['eval_loss']:.4f} ({r['eval_vs_fp32']:.4f}x)   "
            f"held {r['held_bytes_per_param']:.1f} B/param at rest "
            f"({r['held_bytes_per_param'] / ref['held_bytes_per_param']:.2f}x), "
            f"{r['in_step_bytes_per_param']:.1f} within a step "
            f"({r['in_step_bytes_per_param'] / ref['in_step_bytes_per_param']:.2f}x)   "
            f"{r['seconds']:.0f} s"
        )
    print_result("compact_state", steps=args.steps, seed=args.seed, variants=results)


if __name__ == "__main__":
    main()

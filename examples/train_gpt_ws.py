"""Train a small GPT in weight-streaming mode on the standard library's source text.

Written against the reference API (``import weightstream as cstorch``): configure,
compile with the weight-streaming backend, a configured optimizer and LR
schedule, the restartable DataLoader, a compiled step, step closures for the
logs and a checkpoint closure. Prints the loss every ``--log-steps`` steps and
an evaluation loss before and after training.

    .venv/bin/python examples/train_gpt_ws.py [--steps 300] [--model-dir runs/example]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.data.corpus import VOCAB_SIZE, ByteCorpusDataset
from weightstream.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--log-steps", type=int, default=25)
    ap.add_argument("--checkpoint-steps", type=int, default=100)
    ap.add_argument("--model-dir", default="runs/example")
    ap.add_argument("--backend", default="wse_ws")
    args = ap.parse_args()

    cstorch.configure(model_dir=args.model_dir, checkpoint_steps=args.checkpoint_steps)
    os.makedirs(args.model_dir, exist_ok=True)
    torch.manual_seed(0)

    cfg = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, n_layer=4, d_model=128, n_head=4)
    model = GPT(cfg)
    compiled_model = cstorch.compile(model, backend=args.backend)

    optimizer = cstorch.optim.configure_optimizer(
        optimizer_type="AdamW",
        params=model.parameters(),
        learning_rate=1e-3,
        weight_decay=0.01,
        betas=(0.9, 0.95),
    )
    # A tenth of the steps of warmup, then cosine decay; at least a step of each, so that
    # a short run (--steps 4) has a schedule too.
    warmup = max(1, args.steps // 10)
    lr_scheduler = cstorch.optim.configure_lr_scheduler(
        optimizer,
        learning_rate=[
            {
                "scheduler": "Linear",
                "initial_learning_rate": 1e-4,
                "end_learning_rate": 1e-3,
                "total_iters": warmup,
            },
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 1e-3,
                "end_learning_rate": 1e-4,
                "total_iters": max(1, args.steps - warmup),
            },
        ],
    )

    def train_input_fn(batch_size):
        ds = ByteCorpusDataset(args.seq_len, split="train")
        return torch.utils.data.DataLoader(
            ds,
            batch_size=batch_size,
            sampler=cstorch.utils.data.DistributedSampler(ds, seed=0),
            drop_last=True,
        )

    def eval_batches(n=4):
        ds = ByteCorpusDataset(args.seq_len, split="eval")
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size)
        return [b for _, b in zip(range(n), loader)]

    dataloader = cstorch.utils.data.DataLoader(
        train_input_fn, args.batch_size, num_steps=args.steps
    )

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @cstorch.compile_step
    def training_step(batch):
        inputs, targets = batch
        loss = loss_fn(compiled_model(inputs), targets)
        cstorch.amp.optimizer_step(loss, optimizer, None, max_gradient_norm=1.0)
        lr_scheduler.step()
        return loss

    def evaluate() -> float:
        compiled_model.eval()
        with torch.no_grad():
            losses = [loss_fn(compiled_model(x), y).item() for x, y in eval_batches()]
        compiled_model.train()
        return sum(losses) / len(losses)

    t_start = time.perf_counter()

    @cstorch.step_closure
    def post_training_step(step, loss):
        if step % args.log_steps == 0 or step == args.steps:
            rate = step * args.batch_size / (time.perf_counter() - t_start)
            print(
                f"global_step = {step}, loss = {loss.item():.4f}, "
                f"lr = {lr_scheduler.get_last_lr()[0]:.2e}, samples/sec = {rate:.1f}",
                flush=True,
            )

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        path = os.path.join(args.model_dir, f"checkpoint_{step}.mdl")
        state_dict = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "dataloader": dataloader.state_dict(),
            "global_step": step,
        }
        cstorch.save(state_dict, path)
        print(f"Saved checkpoint {path}", flush=True)

    print(
        f"GPT {cfg.n_layer} blocks, d_model {cfg.d_model}: {model.num_parameters():,} parameters; "
        f"backend {args.backend}; {args.steps} steps of batch {args.batch_size} x {args.seq_len}"
    )
    print(compiled_model.plan.describe() if compiled_model.plan else "(no streaming plan)")
    initial_eval = evaluate()
    print(
        f"eval loss before training = {initial_eval:.4f} (uniform guess: {math.log(VOCAB_SIZE):.4f})"
    )
    for step, batch in enumerate(dataloader, start=1):
        loss = training_step(batch)
        post_training_step(step, loss)
        if step % args.checkpoint_steps == 0 or step == args.steps:
            save_checkpoint(step)
    final_eval = evaluate()
    elapsed = time.perf_counter() - t_start
    print(f"eval loss after training = {final_eval:.4f} (before: {initial_eval:.4f})")
    print(
        f"Training finished with {args.steps * args.batch_size} samples in {elapsed:.1f} seconds, "
        f"{args.steps * args.batch_size / elapsed:.1f} samples/second."
    )
    if compiled_model.engine is not None:
        s = compiled_model.engine.streamer
        print(
            f"Streamed {s.meter.total_fetched_bytes / 2**30:.2f} GiB of weights; peak device "
            f"weights {s.meter.peak_bytes / 2**20:.2f} MiB of {sum(p.numel() * 4 for p in model.parameters()) / 2**20:.2f} MiB"
        )


if __name__ == "__main__":
    main()

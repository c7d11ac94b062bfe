"""Host memory per rank of the sharded store: one rank holding the whole training state
against N ranks on one machine sharing one copy of it (Note [sharded store] in
runtime/sharding.py).

Trains one of ``gpu_stream.py``'s Llama shapes (``--size``) for a few steps, first in
one process, then in ``--ranks`` processes started as torchrun starts them, all on
the same device (on a GPU: every rank on the one GPU, joined with gloo; on the CPU:
every rank on the CPU), with ``store_sharding="sharded"``. Each rank builds the model
from seed 0 in host memory as a user's model is built (``gpu_stream.build``), compiles it, runs its
steps on its share of the batch and reports its resident set after the steps
(``VmRSS``) and its peak during them (``VmHWM`` reset after the build). The parent
prints each run's figures and the ratio of a sharded rank's RSS to the single rank's:
the store's promise is about 1/N of the state per rank, plus each process's own
(torch, the CUDA context, the streaming buffers).

    python benchmarks/sharded_rss.py [--size 1b] [--ranks 2] [--steps 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    """One rank (RANK and WORLD_SIZE from the environment): build, compile, train, report."""
    import torch
    from _common import current_rss_bytes, lm_loss, peak_rss_bytes, reset_peak_rss
    from gpu_stream import ADAMW, SIZES, build, config_of

    import weightstream as cstorch
    from weightstream.models.llama import LlamaBlock

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(args.device)
    size = SIZES[args.size]
    cfg = config_of(size, args.seq)
    if args.n_layer:
        cfg = dataclasses.replace(cfg, n_layer=args.n_layer)
    started = time.perf_counter()
    # The same values on every rank, drawn on every core (the zoo's init runs on one
    # thread: most of a 1.1B rank's start on the GPU machine's clock).
    model = build(cfg)
    compiled = cstorch.compile(
        model,
        backend="wse_ws",
        device=device,
        compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        unit_classes=(LlamaBlock,),
        store_sharding="sharded" if world > 1 else "replicated",
        activation_checkpointing=True,
        data_parallel=world > 1,
    )
    opt = cstorch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    built_s = time.perf_counter() - started
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.roll(x, -1, 1)
    share = args.batch // world
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    x, y = x.to(device), y.to(device)
    reset_peak_rss()
    losses = []
    for _ in range(args.steps):
        loss = lm_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    record = {
        "rank": rank,
        "world": world,
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": built_s,
        "rss_bytes": current_rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        "losses": losses,
        "backend": str(torch.distributed.get_backend()) if world > 1 else None,
    }
    compiled.close()
    if world > 1:
        torch.distributed.destroy_process_group()
    Path(args.out, f"world{world}_rank{rank}.json").write_text(json.dumps(record))


def launch(args: argparse.Namespace, world: int, out: str) -> list[dict]:
    """``world`` ranks of this script as torchrun would start them (one machine)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if args.device == "cuda":  # every rank on the one GPU
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    cmd = [sys.executable, __file__, "--worker", "--out", out]
    for key in ("size", "batch", "seq", "steps", "device", "n_layer"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    port = _free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
        procs.append(subprocess.Popen(cmd, env=rank_env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{world} rank(s): exit codes {codes}")
    return [json.loads(Path(out, f"world{world}_rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", help="a gpu_stream.py size (default 1b)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the sharded run")
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over ranks)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=0, help="blocks (default: the size's)")
    ap.add_argument("--device", default=None, help="cuda where there is one, else cpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.batch % args.ranks:
        ap.error(f"--batch {args.batch} is not a multiple of --ranks {args.ranks}")
    print(
        f"{args.size}, batch {args.batch} x seq {args.seq}, {args.steps} steps on {args.device}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out:
        one = launch(args, 1, out)[0]
        print(
            f"  1 rank (whole state, {one['params'] / 1e9:.3f}B params): RSS "
            f"{one['rss_bytes'] / GiB:.2f} GiB, peak {one['peak_rss_bytes'] / GiB:.2f} GiB, "
            f"built in {one['build_s']:.1f} s, losses {one['losses']}",
            flush=True,
        )
        many = launch(args, args.ranks, out)
    for r in many:
        print(
            f"  rank {r['rank']} of {args.ranks} (sharded, {r['backend']}): RSS "
            f"{r['rss_bytes'] / GiB:.2f} GiB ({r['rss_bytes'] / one['rss_bytes']:.3f}x), "
            f"peak {r['peak_rss_bytes'] / GiB:.2f} GiB "
            f"({r['peak_rss_bytes'] / one['peak_rss_bytes']:.3f}x), losses {r['losses']}"
        )
    worst = max(r["rss_bytes"] for r in many) / one["rss_bytes"]
    worst_peak = max(r["peak_rss_bytes"] for r in many) / one["peak_rss_bytes"]
    print(f"  largest sharded rank / one rank: RSS {worst:.3f}x, peak {worst_peak:.3f}x")
    print(
        "RESULT "
        + json.dumps(
            {
                "benchmark": "sharded_rss",
                "size": args.size,
                "ranks": args.ranks,
                "device": args.device,
                "one_rank": one,
                "sharded": many,
                "rss_ratio": worst,
                "peak_rss_ratio": worst_peak,
            }
        )
    )


if __name__ == "__main__":
    main()

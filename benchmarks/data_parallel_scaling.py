"""Data-parallel scaling on this machine: samples/sec with 1 and 2 local ranks.

Runs the run command (weight streaming) on a GPT with a fixed global batch: one
rank, then two ranks with the replicated store and with the sharded store
(the default), and prints samples/sec from each run's performance.json, the
speed-ups, and the scaling model of docs/scaling.md evaluated with the
measured one-rank step time and this machine's measured collective bandwidth.

    .venv/bin/python benchmarks/data_parallel_scaling.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

PARAMS = {
    "train_input": {
        "data_processor": "TextCorpusProcessor",
        "batch_size": 16,
        "seq_len": 128,
        "vocab_size": 256,
        "shuffle_seed": 1,
    },
    "model": {
        "name": "gpt2",
        "n_layer": 4,
        "d_model": 256,
        "n_head": 4,
        "seq_len": 128,
        "vocab_size": 256,
    },
    "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
    "runconfig": {"checkpoint_steps": 0, "log_steps": 1000, "seed": 1},
}


def run(num_ranks: int, sharding: str, steps: int, work: Path) -> dict:
    params = work / f"params_{sharding}.yaml"
    cfg = json.loads(json.dumps(PARAMS))
    cfg["runconfig"]["max_steps"] = steps
    cfg["runconfig"]["store_sharding"] = sharding
    params.write_text(yaml.safe_dump(cfg))
    model_dir = work / f"ranks{num_ranks}_{sharding}"
    cmd = [
        sys.executable,
        "-m",
        "weightstream",
        "run",
        "CPU",
        "-p",
        str(params),
        "-o",
        str(model_dir),
        "--num_csx",
        str(num_ranks),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((model_dir / "performance" / "performance.json").read_text())


def allreduce_bandwidth(nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of a 2-rank gloo all-reduce on loopback (bus bandwidth, ring formula)."""
    code = f"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones({nbytes // 4})
dist.all_reduce(t)
start = time.perf_counter()
for _ in range(5):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    print(5 * {nbytes} / (time.perf_counter() - start))
"""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    out = [p.communicate()[0] for p in procs]
    return float(out[0].strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = [(1, "replicated"), (2, "replicated"), (2, "sharded")]
        results = {key: run(*key, args.steps, work) for key in runs}
    bw = allreduce_bandwidth()
    batch = PARAMS["train_input"]["batch_size"]
    one = results[(1, "replicated")]["samples_per_sec"]
    t1 = batch / one
    n_params = 4 * 12 * 256**2 + 2 * 256 * 256 + 128 * 256  # blocks + embeddings (approx.)
    weight_bytes = grad_bytes = 4 * n_params
    # Both ranks share this machine's cores: each computes half the batch at half
    # the machine's throughput, so the compute term stays t1 (docs/scaling.md).
    # Replicated: a ring all-reduce of the gradients. Sharded: each unit's weights
    # broadcast from its owner in forward and in backward, its gradients reduced
    # to it; each rank receives (N-1)/N of the bytes of each.
    comm = {
        "replicated": 2 * (2 - 1) / 2 * grad_bytes / bw,
        "sharded": (2 * weight_bytes + grad_bytes) * (2 - 1) / 2 / bw,
    }
    print(f"global batch {batch}, {args.steps} steps, {time.strftime('%Y-%m-%d')}")
    print(f"  1 rank             : {one:8.2f} samples/s  (step {t1:.3f} s)")
    for sharding in ("replicated", "sharded"):
        two = results[(2, sharding)]["samples_per_sec"]
        model_t2 = t1 + comm[sharding]
        print(
            f"  2 ranks, {sharding:<10}: {two:8.2f} samples/s  (step {batch / two:.3f} s)  "
            f"speed-up {two / one:.2f}x; model (docs/scaling.md) step {model_t2:.3f} s = "
            f"{t1:.3f} compute + {comm[sharding]:.3f} collectives -> "
            f"{batch / model_t2:.2f} samples/s"
        )
    print(f"  collective bandwidth (gloo all-reduce, loopback): {bw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()

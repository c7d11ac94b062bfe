"""Data-parallel scaling on this machine: samples/sec with 1, 2 and 4 local ranks.

Runs the run command (weight streaming) on a GPT with a fixed global batch: one
rank, then 2 and 4 ranks with the replicated store and with the sharded store
(the default), and prints samples/sec from each run's performance.json, the
speed-ups, and the scaling model of docs/scaling.md evaluated with the
measured one-rank step time and this machine's measured collective bandwidth.

``--compare-with REV`` runs the same grid on the code of git revision REV too
(a temporary worktree), interleaved run by run, and prints the ratio of this
tree's samples/sec to REV's: a before/after measured side by side.

    .venv/bin/python benchmarks/data_parallel_scaling.py [--steps 20] [--ranks 1 2 4]
        [--compare-with REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


ROOT = Path(__file__).resolve().parent.parent


def run(
    num_ranks: int, sharding: str, steps: int, work: Path, src: Path | None = None, repeat: int = 0
) -> dict:
    """One run of the run command, in a model_dir of its own (a second run in one
    directory would resume from the first's checkpoint and train nothing);
    ``src``: another tree's ``src`` to run instead."""
    params = work / f"params_{sharding}.yaml"
    cfg = json.loads(json.dumps(PARAMS))
    cfg["runconfig"]["max_steps"] = steps
    cfg["runconfig"]["store_sharding"] = sharding
    params.write_text(yaml.safe_dump(cfg))
    tree = "other" if src else "this"
    model_dir = work / f"ranks{num_ranks}_{sharding}_{tree}_{repeat}"
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
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return json.loads((model_dir / "performance" / "performance.json").read_text())


def worktree(rev: str, into: Path) -> Path:
    """A checkout of ``rev`` (git worktree) under ``into``; returns its ``src``."""
    path = into / "other"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return path / "src"


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
dist.destroy_process_group()  # gloo left to interpreter exit may abort (pytorch#190489)
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


def _versus(this: list[float], before: list[float], rev: str) -> str:
    """Median samples/s of ``rev`` and this/before per interleaved pair: min/median/max."""
    ratios = sorted(a / b for a, b in zip(this, before))
    return (
        f"  | {rev}: {statistics.median(before):8.2f}, this/before min/median/max "
        f"{ratios[0]:.2f}/{statistics.median(ratios):.2f}/{ratios[-1]:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--compare-with", metavar="REV", default=None)
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of each configuration (min/median/max)"
    )
    args = ap.parse_args()
    grid = [(1, "replicated")] + [
        (n, sharding) for n in args.ranks if n > 1 for sharding in ("replicated", "sharded")
    ]
    results: dict = {key: [] for key in grid}
    other: dict = {key: [] for key in grid}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = worktree(args.compare_with, work) if args.compare_with else None
        try:
            for i in range(args.repeats):
                for key in grid:  # interleaved: both trees see the same machine phases
                    got = run(*key, args.steps, work, repeat=i)
                    results[key].append(got["samples_per_sec"])
                    if src is not None:
                        got = run(*key, args.steps, work, src, repeat=i)
                        other[key].append(got["samples_per_sec"])
        finally:
            if src is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src.parent)],
                    check=False,
                )
    bw = allreduce_bandwidth()
    batch = PARAMS["train_input"]["batch_size"]
    one = statistics.median(results[(1, "replicated")])
    t1 = batch / one
    n_params = 4 * 12 * 256**2 + 2 * 256 * 256 + 128 * 256  # blocks + embeddings (approx.)
    weight_bytes = grad_bytes = 4 * n_params
    print(
        f"global batch {batch}, {args.steps} steps, {args.repeats} run(s) each (medians), "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    line = f"  1 rank              : {one:8.2f} samples/s  (step {t1:.3f} s)"
    if src is not None:
        line += _versus(results[(1, "replicated")], other[(1, "replicated")], args.compare_with)
    print(line)
    for n, sharding in grid[1:]:
        # The ranks share this machine's cores: each computes 1/N of the batch at
        # 1/N of the machine's throughput, so the compute term stays t1
        # (docs/scaling.md). Replicated: a ring all-reduce of the gradients.
        # Sharded: each unit's weights broadcast from its owner in forward and in
        # backward, its gradients reduced to it; each rank receives (N-1)/N of
        # the bytes of each.
        comm = {
            "replicated": 2 * (n - 1) / n * grad_bytes / bw,
            "sharded": (2 * weight_bytes + grad_bytes) * (n - 1) / n / bw,
        }[sharding]
        got = statistics.median(results[(n, sharding)])
        model_t = t1 + comm
        line = (
            f"  {n} ranks, {sharding:<10}: {got:8.2f} samples/s  (step {batch / got:.3f} s)  "
            f"speed-up {got / one:.2f}x; model step {model_t:.3f} s = {t1:.3f} compute + "
            f"{comm:.3f} collectives -> {batch / model_t:.2f} samples/s"
        )
        if src is not None:
            line += _versus(results[(n, sharding)], other[(n, sharding)], args.compare_with)
        print(line)
    print(f"  collective bandwidth (gloo all-reduce, loopback): {bw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()

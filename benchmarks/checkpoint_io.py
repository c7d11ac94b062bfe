"""Checkpoint save/load time: weightstream H5 against torch.save/load and safetensors.

Saves and loads one state of several float32 and bfloat16 tensors (2 GiB by
default) with the three libraries, taking turns within each repetition so that
machine noise hits all of them alike. Prints min/median/max seconds per
operation and the ratios of the medians ours/torch and ours/safetensors.

"load" means: the call returns and every page of every tensor has been touched
(a mapped file returns at once, so the call alone would measure nothing). Two
kinds of load are compared like for like: copying into memory (ours default,
torch.load default, safetensors backend="pread") and mapping the file (ours
mmap=True, torch.load(mmap=True), safetensors default backend="mmap"). The
files are read right after being written, so from the page cache: this
measures the libraries, not the disk. torch and safetensors do not fsync;
weightstream does by default (its atomic save, Note [atomic save]), so ours is
timed both ways: "ours" (default, fsync) and "ours (no fsync)". Likewise ours
verifies each tensor's checksum on load, which for a mapped file means reading
every page; "ours (mmap, no verify)" is the like-for-like mapped load.

    .venv/bin/python benchmarks/checkpoint_io.py [--gib 2] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weightstream.checkpoint import load, save


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """Eight tensors of equal size: six float32, two bfloat16 (rows of 1024)."""
    per_tensor = int(gib * 2**30) // 8
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(6):
        state[f"layers.{i}.weight"] = torch.rand(per_tensor // 4096, 1024, generator=g)
    for i in range(2):
        rows = per_tensor // 2048
        state[f"embedding.{i}"] = torch.rand(rows, 1024, generator=g).to(torch.bfloat16)
    return state


def touch(state: dict[str, torch.Tensor]) -> int:
    """Read one byte of every 4 KiB page of every tensor (forces mapped pages in)."""
    total = 0
    for t in state.values():
        total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def fresh(path: Path) -> Path:
    """Delete ``path`` and flush dirty pages, outside the clock.

    Every save then writes a new file, as a trainer does (checkpoint_{step}.mdl),
    and starts with no writeback of an earlier file in flight. (Replacing an
    existing file on ext4 starts writeback of the new one, see auto_da_alloc,
    which would charge disk time to whichever library replaces a file.)
    """
    path.unlink(missing_ok=True)
    os.sync()
    return path


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory for the files (default: temp)")
    args = ap.parse_args()
    state = make_state(args.gib)
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state: {len(state)} tensors, {nbytes / 2**30:.2f} GiB; {args.repeats} repeats")

    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    def run_ours(path: Path) -> None:
        fresh(path)
        record("save ours (no fsync)", timed(lambda: save(state, path, fsync=False)))
        fresh(path)
        record("save ours", timed(lambda: save(state, path)))
        os.sync()
        record("load ours", timed(lambda: touch(load(path, map_location="cpu"))))
        record("load ours (mmap)", timed(lambda: touch(load(path, "cpu", mmap=True))))
        record(
            "load ours (mmap, no verify)",
            timed(lambda: touch(load(path, "cpu", mmap=True, verify=False))),
        )
        back = load(path, map_location="cpu")  # correctness of what was timed
        assert all(torch.equal(back[k], v) for k, v in state.items())

    def run_torch(path: Path) -> None:
        fresh(path)
        record("save torch", timed(lambda: torch.save(state, path)))
        os.sync()
        record("load torch", timed(lambda: touch(torch.load(path))))
        record("load torch (mmap)", timed(lambda: touch(torch.load(path, mmap=True))))

    def run_safetensors(path: Path) -> None:
        fresh(path)
        record("save safetensors", timed(lambda: save_file(state, path)))
        os.sync()
        record("load safetensors", timed(lambda: touch(load_file(path, backend="pread"))))
        record("load safetensors (mmap)", timed(lambda: touch(load_file(path))))

    runs = [(run_ours, "state.mdl"), (run_torch, "state.pt"), (run_safetensors, "state.st")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.repeats):
            # Each library saves then loads its own file, which is deleted before
            # the next one runs (one file in the page cache at a time); the order
            # rotates so that no library always goes first.
            for i in range(len(runs)):
                run, name = runs[(rep + i) % len(runs)]
                path = Path(tmp) / name
                run(path)
                fresh(path)

    print(f"{'operation (seconds)':<30}{'min':>8}{'median':>8}{'max':>8}   GiB/s (median)")
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"{name:<30}{min(values):8.3f}{med:8.3f}{max(values):8.3f}   "
            f"{nbytes / 2**30 / med:6.2f}"
        )
    med = {name: statistics.median(values) for name, values in times.items()}
    print("ratios of medians (< 1: ours faster):")
    for name, label in (
        ("save ours", "save"),
        ("save ours (no fsync)", "save, no fsync"),
        ("load ours", "load, copying"),
        ("load ours (mmap)", "load, mapped"),
        ("load ours (mmap, no verify)", "load, mapped, no verify"),
    ):
        op = name.split()[0]
        suffix = " (mmap)" if "mmap" in name else ""
        print(
            f"  {label:<24} ours/torch {med[name] / med[f'{op} torch{suffix}']:.2f}, "
            f"ours/safetensors {med[name] / med[f'{op} safetensors{suffix}']:.2f}"
        )


if __name__ == "__main__":
    main()

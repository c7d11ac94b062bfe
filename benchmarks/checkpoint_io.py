"""Checkpoint save/load time: weightstream H5 against torch.save/load and safetensors.

Saves and loads one state of float32 and bfloat16 tensors (2 GiB in 8 tensors
by default) with the three libraries, taking turns within each repetition (the
order rotates every repetition) so that machine noise hits all of them alike.
Prints min/median/max seconds per operation and the ratios of the medians
ours/torch and ours/safetensors.

Fairness, stated:

* Durability. A save is timed twice per library: without fsync (the call
  alone; ``save(..., fsync=False)`` for ours) and durable (the call, then
  fsync of the file and of its directory; ours does both itself by default,
  Note [atomic save]). Ratios compare like with like.
* Page cache. Every save writes a new file (the old one is deleted and
  ``os.sync()`` flushes dirty pages first, outside the clock). Loads are
  timed warm by default: the whole file is read once before the timed loads,
  so all three read from the page cache and the figures measure the
  libraries, not the disk. ``--cold`` instead evicts the file's pages
  (``posix_fadvise(DONTNEED)``, this file only) before each timed load.
* "load" means: the call returns and every page of every tensor has been
  touched (a mapped file returns at once, so the call alone would measure
  nothing). Copying loads (ours default, torch.load default, safetensors
  ``backend="pread"``) and mapped loads (ours ``mmap=True``,
  ``torch.load(mmap=True)``, safetensors default) are compared like for like.
  Ours verifies every tensor's checksum on load (a mapped load then reads
  every page); "ours (mmap, no verify)" is the like-for-like mapped load.
* Freeing what was loaded happens outside the clock, for every library.

    .venv/bin/python benchmarks/checkpoint_io.py [--gib 2] [--tensors 8] [--repeats 5] \\
        [--dir /tmp] [--cold]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from weightstream.checkpoint import load, save


def make_state(gib: float, count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of equal size (rows of 1024): 3/4 float32, 1/4 bfloat16."""
    per_tensor = int(gib * 2**30) // count
    g = torch.Generator().manual_seed(0)
    state = {}
    n_bf16 = count // 4
    for i in range(count - n_bf16):
        state[f"layers.{i}.weight"] = torch.rand(per_tensor // 4096, 1024, generator=g)
    for i in range(n_bf16):
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


def fsync_file_and_dir(path: Path) -> None:
    """What ours does after writing (Note [atomic save]): the file, then its directory."""
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def warm(path: Path) -> None:
    """Read the whole file once so that timed loads start from the page cache."""
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(16 * 2**20)
        while f.readinto(buffer):
            pass


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (it is clean: ``fresh`` synced it)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=8, help="number of tensors (equal sizes)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory for the files (default: temp)")
    ap.add_argument(
        "--cold", action="store_true", help="evict each file from the page cache before loads"
    )
    args = ap.parse_args()
    state = make_state(args.gib, args.tensors)
    nbytes = sum(t.nbytes for t in state.values())
    cache = "cold (file evicted before each load)" if args.cold else "warm (file read once first)"
    print(
        f"state: {len(state)} tensors, {nbytes / 2**30:.2f} GiB; {args.repeats} repeats; "
        f"loads {cache}; torch {torch.__version__}"
    )

    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        del result  # freeing what was loaded: outside the clock
        gc.collect()

    def timed_save(name: str, path: Path, fn: Callable[[], None], durable: bool) -> None:
        def run() -> None:
            fn()
            if durable:
                fsync_file_and_dir(path)

        fresh(path)
        timed(name, run)

    def timed_load(name: str, path: Path, fn: Callable[[], Any]) -> None:
        if args.cold:
            evict(path)
        timed(name, lambda: touch(fn()))

    def prepare_loads(path: Path) -> None:
        os.sync()
        if not args.cold:
            warm(path)

    def run_ours(path: Path) -> None:
        timed_save("save ours", path, lambda: save(state, path, fsync=False), durable=False)
        timed_save("save ours (fsync)", path, lambda: save(state, path), durable=False)
        prepare_loads(path)
        timed_load("load ours", path, lambda: load(path, map_location="cpu"))
        timed_load("load ours (mmap)", path, lambda: load(path, "cpu", mmap=True))
        timed_load(
            "load ours (mmap, no verify)",
            path,
            lambda: load(path, "cpu", mmap=True, verify=False),
        )
        back = load(path, map_location="cpu")  # correctness of what was timed
        assert all(torch.equal(back[k], v) for k, v in state.items())

    def run_torch(path: Path) -> None:
        timed_save("save torch", path, lambda: torch.save(state, path), durable=False)
        timed_save("save torch (fsync)", path, lambda: torch.save(state, path), durable=True)
        prepare_loads(path)
        timed_load("load torch", path, lambda: torch.load(path))
        timed_load("load torch (mmap)", path, lambda: torch.load(path, mmap=True))

    def run_safetensors(path: Path) -> None:
        timed_save("save safetensors", path, lambda: save_file(state, path), durable=False)
        timed_save("save safetensors (fsync)", path, lambda: save_file(state, path), durable=True)
        prepare_loads(path)
        timed_load("load safetensors", path, lambda: load_file(path, backend="pread"))
        timed_load("load safetensors (mmap)", path, lambda: load_file(path))

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
        ("save ours", "save, no fsync"),
        ("save ours (fsync)", "save, fsync"),
        ("load ours", "load, copying"),
        ("load ours (mmap)", "load, mapped"),
        ("load ours (mmap, no verify)", "load, mapped, no verify"),
    ):
        op = name.split()[0]
        suffix = next((s for s in (" (mmap)", " (fsync)") if s.strip(" ()") in name), "")
        print(
            f"  {label:<24} ours/torch {med[name] / med[f'{op} torch{suffix}']:.2f}, "
            f"ours/safetensors {med[name] / med[f'{op} safetensors{suffix}']:.2f}"
        )


if __name__ == "__main__":
    main()

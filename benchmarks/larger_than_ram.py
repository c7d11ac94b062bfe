"""A model whose fp32 training state is larger than this machine's RAM, trained from the disk store.

Builds a GPT on the meta device, sized so that its fp32 training state (masters,
gradients and AdamW's two moments: 16 bytes per parameter) is ``--ram-factor``
times the machine's RAM, materializes it straight into the disk
store (``store="disk"``, Note [disk tier] in runtime/store.py) with its RAM tier
under the default ``host_memory_budget`` (Note [hybrid placement] in
runtime/placement.py), and trains it for ``--steps`` steps. Reports per step
after the first (which makes the optimizer state, so reads none of it from the
files) the step time (min / median / max) against two rooflines, measured on the
store's own directory, moved as the store moves its tensors (its I/O threads,
O_DIRECT where allowed):

* hybrid: the bytes the placement reads and writes per step (what is not in
  RAM), read and written at the same time by the store's threads right after
  the run, on about 8 GiB in the same proportion, scaled to the step
  (``step_traffic_seconds``); also priced at the burst bandwidths below,
  ``reads / read bandwidth + writes / write bandwidth``, as before. The burst
  figure flatters a disk whose first GiB go faster than the rest: on this VM a
  2 GiB file read back at 2.5 GB/s, while a step's 10 GB of mixed traffic ran
  at 1.65 GB/s, in the run and in the probe alike;
* all on disk: every byte of the state read once and written once a step, at
  the burst bandwidths (a 2 GiB file written and read back, best of 3);
* this phase order's: where the masters are all in RAM (and without
  overlap_updates) the forward reads nothing from the files, so the least step
  is the forward (median of the timed steps) plus the hybrid roofline. Moving
  file traffic into the forward would need buffers from the RAM tier, each
  byte of which adds a read and a write a step;

and against the step's compute alone (eager PyTorch on two blocks of the same
shape in RAM, scaled to the model), the other physical limit: on a machine
with few cores the larger of the two bounds the step.

Then the run saves a checkpoint and a new process resumes from it (the seed's
``cstorch.load`` + ``load_state_dict`` into a model built on the meta device):
its peak RSS, the load time and the time to the end of its first step. Needs
free disk space of about the state's part on disk plus the checkpoint (12
bytes a parameter).

    .venv/bin/python benchmarks/larger_than_ram.py --store-dir runs/large_store [--steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import (
    current_rss_bytes,
    fmt,
    lm_loss,
    parse_result,
    peak_rss_bytes,
    print_result,
    reset_peak_rss,
    summary,
)

import weightstream as cstorch
from weightstream.amp.step_helper import backward_context
from weightstream.models import GPT, GPTConfig
from weightstream.runtime.budgets import disk_working_set
from weightstream.runtime.diskio import BufferPool, DiskIO, StoreFile, open_for_io
from weightstream.runtime.placement import total_memory

STATE_BYTES_PER_PARAM = 16  # fp32 master, gradient, exp_avg, exp_avg_sq


def probe_file(path: Path, nbytes: int) -> StoreFile:
    """A file of ``nbytes`` allocated at ``path`` and opened as the store opens its files
    (O_DIRECT where allowed); unlinked at once, so closing it removes it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    try:
        fd, direct = open_for_io(path, None)
    finally:
        path.unlink()
    return StoreFile(fd, nbytes, direct, "probe")


def disk_bandwidths(directory: Path, nbytes: int = 2 * 2**30, repeats: int = 3):
    """Best write and cold read bandwidth of ``directory``, bytes/s, moved the way the
    store moves its tensors (Note [explicit disk I/O]): its reader and writer
    threads, O_DIRECT where the file system allows it, a 2 GiB tensor a time."""
    pool = BufferPool(nbytes)
    io = DiskIO(pool)
    buf = pool.take(nbytes)
    buf.fill_(1)
    best_w = best_r = 0.0
    try:
        f = probe_file(directory / "bandwidth.probe", nbytes)
        try:
            for _ in range(repeats):
                t = time.perf_counter()
                io.write(f, buf, give_back=False).wait()
                os.fsync(f.fd)
                best_w = max(best_w, nbytes / (time.perf_counter() - t))
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must hit the disk
                t = time.perf_counter()
                io.read(f, buf).wait()
                best_r = max(best_r, nbytes / (time.perf_counter() - t))
        finally:
            f.close()
    finally:
        io.close()
    return best_r, best_w


def step_traffic_seconds(
    directory: Path, reads: int, writes: int, total: int = 8 * 2**30, piece: int = 64 * 2**20
) -> float:
    """Seconds the disk takes to read ``reads`` and write ``writes`` bytes at the same
    time, moved as the store moves a step's tensors (its reader and writer threads,
    O_DIRECT where allowed, a few tensors in flight each way): timed on about ``total``
    bytes in the same proportion (at most half the free space), and scaled.

    A short probe measures the disk's burst: on this VM 2 GiB read back at 2.5 GB/s,
    while 8 GiB streams at 1.1-1.5 GB/s (dd, O_DIRECT) and a step's reads beside its
    writes at about 1.0 + 0.7 GB/s. A step moves many GiB, so its roofline is the
    sustained rate of its own mix."""
    if reads + writes == 0:
        return 0.0
    total = min(total, shutil.disk_usage(directory).free // 2)
    scale = (reads + writes) / total
    n_read = max(1, round(reads / scale / piece)) if reads else 0
    n_write = max(1, round(writes / scale / piece)) if writes else 0
    in_flight = 4
    pool = BufferPool(2 * in_flight * piece)
    io = DiskIO(pool)
    files: list[StoreFile] = []
    try:
        for i in range(n_read + n_write):
            files.append(probe_file(directory / f"traffic.probe.{i}", piece))
        sources, targets = files[:n_read], files[n_read:]
        buf = pool.take(piece)
        buf.fill_(1)
        for f in sources:  # data to read back; then off the page cache and the queue
            io.write(f, buf, give_back=False).wait()
        pool.give(buf)
        os.sync()
        for f in sources:
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        pending = []
        for i in range(max(n_read, n_write)):
            if i < n_read:
                f = sources[i]
                b = pool.take(piece)
                pending.append((io.read(f, b), b))
            if i < n_write:
                b = pool.take(piece)
                pending.append((io.write(targets[i], b), None))  # gives b back when done
            while len(pending) >= 2 * in_flight:
                transfer, b = pending.pop(0)
                transfer.wait()
                if b is not None:
                    pool.give(b)
        for transfer, b in pending:
            transfer.wait()
            if b is not None:
                pool.give(b)
        for f in targets:
            os.fsync(f.fd)
        elapsed = time.perf_counter() - t
    finally:
        io.close()
        for f in files:
            f.close()
    return elapsed * (reads + writes) / ((n_read + n_write) * piece)


def compute_seconds(cfg: GPTConfig, size: int, blocks: int = 2, steps: int = 5) -> float:
    """The step's compute alone: eager PyTorch (forward, backward, fused AdamW) on
    ``blocks`` blocks of the same shape, all in RAM, median step scaled to the model's
    blocks. The other physical limit beside the disk's."""
    torch.manual_seed(0)
    small = GPT(dataclasses.replace(cfg, n_layer=blocks))
    opt = torch.optim.AdamW(small.parameters(), lr=1e-5, fused=True)
    x, y = batch(cfg, size)
    times = []
    for _ in range(steps + 1):  # the first allocates the gradients and the state
        t = time.perf_counter()
        lm_loss(small(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return summary(times[1:])["median"] * cfg.n_layer / blocks


def config_for(target_params: int, d_model: int, seq_len: int) -> GPTConfig:
    per_layer = 12 * d_model * d_model + 13 * d_model  # attention + MLP + 2 LayerNorms
    n_layer = math.ceil(target_params / per_layer)
    return GPTConfig(
        vocab_size=256, seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=d_model // 128
    )


def build(
    cfg: GPTConfig,
    store_dir: Path,
    budget: int | None,
    init_weights: bool,
    overlap: bool = False,
    in_backward: bool = False,
):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    runner = cstorch.compile(
        model,
        backend="ws",
        store="disk",
        store_dir=str(store_dir),
        host_memory_budget=budget,
        init_weights=init_weights,
        overlap_updates=overlap,
        update_in_backward=in_backward,
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, runner, opt


def batch(cfg: GPTConfig, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def step(runner, opt, x, y) -> tuple[float, list[float]]:
    t = time.perf_counter()
    loss = lm_loss(runner(x), y)
    t_fwd = time.perf_counter()
    with backward_context(opt, None):  # Note [updates in backward], where enabled
        loss.backward()
    t_bwd = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.item()  # host sync point: the step is complete
    return value, [t_fwd - t, t_bwd - t_fwd, time.perf_counter() - t_bwd]


def resume(args, cfg: GPTConfig) -> None:
    """The second process: the seed's resume recipe, then one step."""
    t0 = time.perf_counter()
    model, runner, opt = build(
        cfg,
        Path(args.store_dir) / "resume",
        args.budget,
        False,
        args.overlap_updates,
        args.update_in_backward,
    )
    state = cstorch.load(args.resume)
    t_load = time.perf_counter()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    state.close()
    load_seconds = time.perf_counter() - t_load
    x, y = batch(cfg, args.batch)
    loss, _ = step(runner, opt, x, y)
    first_step = time.perf_counter() - t0
    runner.engine.close()
    print_result(
        "larger_than_ram_resume",
        loss=loss,
        load_seconds=load_seconds,
        time_to_first_step=first_step,
        peak_rss=peak_rss_bytes(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-dir", required=True, help="directory of the disk store's files")
    ap.add_argument("--ram-factor", type=float, default=1.35)
    ap.add_argument("--steps", type=int, default=4, help="steps; all but the first are timed")
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, help="host_memory_budget (default: the store's)")
    ap.add_argument("--no-resume", action="store_true", help="skip the checkpoint and resume")
    ap.add_argument(
        "--overlap-updates",
        action="store_true",
        help="apply each update behind the next forward (overlap_updates)",
    )
    ap.add_argument(
        "--update-in-backward",
        action="store_true",
        help="start each unit's update in the backward (update_in_backward)",
    )
    ap.add_argument("--resume", help=argparse.SUPPRESS)  # the resuming process's checkpoint
    ap.add_argument("--compute-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    ram = total_memory()
    cfg = config_for(int(args.ram_factor * ram / STATE_BYTES_PER_PARAM), args.d_model, args.seq_len)
    if args.resume:
        resume(args, cfg)
        return
    if args.compute_only:
        print_result("compute", compute_seconds=compute_seconds(cfg, args.batch))
        return
    store_dir = Path(args.store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    state = STATE_BYTES_PER_PARAM * params
    free = shutil.disk_usage(store_dir).free
    print(
        f"RAM {ram / 2**30:.1f} GiB; GPT {cfg.n_layer} blocks, d_model {cfg.d_model}: "
        f"{params / 1e9:.2f}B params, fp32 training state {state / 2**30:.1f} GiB = "
        f"{state / ram:.2f}x RAM; free disk in {store_dir}: {free / 2**30:.1f} GiB",
        flush=True,
    )
    read_bw, write_bw = disk_bandwidths(store_dir)
    all_on_disk = state / read_bw + state / write_bw
    # In a process of its own: the memory it frees must not shrink the RAM tier.
    out = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--compute-only"],
        capture_output=True,
        text=True,
        check=True,
    )
    compute = parse_result(out.stdout)["compute_seconds"]

    before_store = current_rss_bytes()  # the interpreter, torch, nothing of the model
    t0 = time.perf_counter()
    model, runner, opt = build(
        cfg, store_dir, args.budget, True, args.overlap_updates, args.update_in_backward
    )
    x, y = batch(cfg, args.batch)
    runner.engine.prepare(x)
    store = runner.engine.store.tier
    setup = time.perf_counter() - t0
    print(
        f"materialized in {setup:.0f} s; {len(runner.plan.units)} units, largest "
        f"{runner.plan.largest_unit_bytes / 2**20:.0f} MiB; {store.places.predicted.describe()}; "
        f"RSS now {current_rss_bytes() / 2**30:.2f} GiB",
        flush=True,
    )

    reset_peak_rss()
    baseline = current_rss_bytes()
    times, forwards, losses = [], [], []
    for i in range(args.steps):
        loss, phases = step(runner, opt, x, y)
        losses.append(loss)
        times.append(sum(phases))
        forwards.append(phases[0])
        print(
            f"  step {i + 1}: loss {loss:.4f}, {times[-1]:.1f} s (forward {phases[0]:.1f}, "
            f"backward {phases[1]:.1f}, update {phases[2]:.1f}), peak RSS so far "
            f"{peak_rss_bytes() / 2**30:.2f} GiB",
            flush=True,
        )
    peak = peak_rss_bytes()
    if len(times) > 1:
        # The first step is not timed against the rooflines: its optimizer state is
        # made in it, so it reads none from the files (and with overlap_updates its
        # forward waited for no update).
        times, forwards = times[1:], forwards[1:]
    placed = store.placement()
    burst = placed.disk_reads_per_step / read_bw + placed.disk_writes_per_step / write_bw
    hybrid = step_traffic_seconds(
        store_dir, placed.disk_reads_per_step, placed.disk_writes_per_step
    )
    limit = max(hybrid, compute)
    # Where the masters are all in RAM the forward reads nothing from the files, and
    # what the files move is the backward's (each unit's update reads and writes its
    # state there): reading or writing during the forward would need buffers taken
    # from the RAM tier, whose every byte adds a read and a write a step. So the
    # least step of this order is the forward plus the hybrid roofline. (With
    # overlap_updates the forward waits for updates that use the files: no such bound.)
    idle_forward = not placed.disk.get("master") and not args.overlap_updates
    phase_bound = hybrid + summary(forwards)["median"]
    engine = runner.engine
    budget = placed.ram_capacity + disk_working_set(engine.plan, engine.config, engine.device)
    s = summary(times)

    def over(bound: float) -> dict[str, float] | None:
        """The step times over ``bound``; None where it is 0 (nothing to move)."""
        return {k: v / bound for k, v in s.items()} if bound > 0 else None

    if not idle_forward:
        bound_line = "  the forward uses the files here (masters in them, or overlapped updates)"
    elif hybrid > 0:
        bound_line = (
            f"  forward (no file read in it) + hybrid roofline {phase_bound:.1f} s "
            f"({phase_bound / hybrid:.2f}x the roofline): {fmt(over(phase_bound), 2)}x"
        )
    else:  # a budget that holds the whole state: the files move nothing a step
        bound_line = "  no file traffic a step (the RAM tier holds the whole state)"
    hybrid_line = (
        f"  hybrid roofline (the step's reads and writes, timed together) {hybrid:.1f} s: "
        f"{fmt(over(hybrid), 2)}x; at the burst bandwidths {burst:.1f} s: "
        f"{fmt(over(burst), 2)}x; "
        if hybrid > 0
        else "  "
    )
    print(
        f"seconds per step (min / median / max) {fmt(s, 1)}; disk read {read_bw / 1e9:.2f} GB/s, "
        f"write {write_bw / 1e9:.2f} GB/s; {placed.describe()}\n"
        f"{hybrid_line}all-on-disk roofline (burst) {all_on_disk:.1f} s: "
        f"{s['median'] / all_on_disk:.2f}x\n"
        f"  compute alone (eager, in RAM) {compute:.1f} s; the larger limit {limit:.1f} s: "
        f"{fmt(over(limit), 2)}x\n"
        f"{bound_line}\n"
        f"  peak RSS {peak / 2**30:.2f} GiB against a budget of {budget / 2**30:.2f} GiB "
        f"({peak / ram:.1%} of RAM, {(peak - baseline) / 2**30:.2f} GiB above the RSS before "
        f"the first step, {(peak - before_store) / 2**30:.2f} GiB above the RSS before the "
        f"store was built); losses finite: {all(math.isfinite(v) for v in losses)}",
        flush=True,
    )
    resumed = None
    if not args.no_resume:
        checkpoint = store_dir / "larger_than_ram.mdl"
        t = time.perf_counter()
        cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
        save_seconds = time.perf_counter() - t
        runner.engine.close()
        # Nothing of this run may stay: the new process's RAM tier is sized from
        # the memory available when it starts, and its files need the disk space.
        del model, runner, opt, store
        gc.collect()
        try:
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--resume", str(checkpoint)],
                capture_output=True,
                text=True,
            )
        finally:
            checkpoint.unlink(missing_ok=True)
        if out.returncode != 0:
            raise SystemExit(
                f"the resuming process failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
            )
        resumed = parse_result(out.stdout)
        resumed["save_seconds"] = save_seconds
        print(
            f"checkpoint saved in {save_seconds:.0f} s; a new process resumed from it: loaded in "
            f"{resumed['load_seconds']:.0f} s, first step done {resumed['time_to_first_step']:.0f}"
            f" s after it started, peak RSS {resumed['peak_rss'] / 2**30:.2f} GiB "
            f"(budget {budget / 2**30:.2f} GiB)",
            flush=True,
        )
    else:
        runner.engine.close()
    print_result(
        "larger_than_ram",
        params=params,
        state_bytes=state,
        ram_bytes=ram,
        state_over_ram=state / ram,
        overlap_updates=args.overlap_updates,
        update_in_backward=args.update_in_backward,
        budget=budget,
        placement={"ram": placed.ram, "disk": placed.disk},
        disk_read_bytes_per_step=placed.disk_reads_per_step,
        disk_write_bytes_per_step=placed.disk_writes_per_step,
        read_bandwidth=read_bw,
        write_bandwidth=write_bw,
        seconds=s,
        hybrid_limit_seconds=hybrid,
        over_hybrid=over(hybrid),
        hybrid_burst_seconds=burst,
        over_hybrid_burst=over(burst),
        limit_seconds=all_on_disk,
        over_limit=s["median"] / all_on_disk,
        compute_seconds=compute,
        over_max_limit=over(limit),
        phase_bound_seconds=phase_bound if idle_forward and hybrid > 0 else None,
        over_phase_bound=over(phase_bound) if idle_forward and hybrid > 0 else None,
        peak_rss=peak,
        losses=losses,
        resume=resumed,
        pid=os.getpid(),
    )


if __name__ == "__main__":
    main()

"""Soak (design invariant 3 over time): 2,000 steps of a small GPT in weight-streaming mode,
a checkpoint every 100 steps (the oldest pruned beyond five), through the run command.

The run is a subprocess, ``python -m weightstream run CPU -p params.yaml -m train -o
model_dir``; the test samples its resident memory (VmRSS), thread count (/proc/<pid>/status)
and open file descriptors (/proc/<pid>/fd) a few times a second, with the step it has
reached (train/losses.jsonl). After a warm-up of 200 steps (two checkpoints written, the
allocator's pools filled):

* resident memory grows by less than 2 % from the warm-up to the end (medians over the
  100 steps after warm-up and the last 100 steps, so one sample's noise does not decide);
* the thread count never exceeds its warm-up value;
* the open files at rest (the fewest sampled in a window) do not grow from the
  warm-up to the end, and no sample exceeds them by more than a checkpoint save
  holds open while it writes (the temporary file, then the directory it fsyncs):
  the samples, a few per 100 steps, catch a save only by chance, so the warm-up's
  most is not a bound (a run at 40 steps a second sampled 4 open files in the
  warm-up and 5 once later, a save in progress).

Slow (several minutes): ``pytest -m slow tests/test_soak.py -s`` prints the figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import params_files as pf
import pytest

from weightstream import checkpoint as ckpt
from weightstream.train.trainer import LOSS_LOG, LossLog

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

STEPS = 2000
CHECKPOINT_STEPS = 100
WARM_UP = 200
WINDOW = 100  # steps over which the warm-up and the final figures are taken
RUN = (sys.executable, "-m", "weightstream", "run", "CPU")
SAVE_OPEN_FILES = 2  # a save's temporary file, and the directory it fsyncs after the rename


def _params(path: Path) -> Path:
    return pf.write(
        path,
        pf.params(
            # About 1,400 batches per epoch: the run crosses an epoch boundary.
            train_input=pf.text_input(4, 32, shuffle_seed=1, max_bytes=200_000),
            model=pf.gpt2(2, 32, 32, dropout=0.1),
            optimizer=pf.adamw(
                pf.warmup_cosine(1e-3, 100, STEPS - 100),
                weight_decay=0.01,
                max_gradient_norm=1.0,
                loss_scaling_factor="dynamic",
            ),
            runconfig={
                "max_steps": STEPS,
                "checkpoint_steps": CHECKPOINT_STEPS,
                "max_checkpoints": 5,
                "log_steps": 500,
                "seed": 1,
                "execution_mode": "weight_streaming",
                "unit_size_target": 4000,
            },
        ),
    )


def _status(pid: int) -> tuple[int, int, int] | None:
    """(resident bytes, threads, open file descriptors) of ``pid``, or None once it is gone."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    if "VmRSS" not in fields:
        return None  # exiting: a zombie's status has no memory lines
    rss = int(fields["VmRSS"].split()[0]) * 1024
    return rss, int(fields["Threads"]), fds


def _step(model_dir: Path) -> int:
    try:
        entries = LossLog.read(model_dir / LOSS_LOG)
    except (OSError, ValueError):
        return 0
    return entries[-1][0] if entries else 0


def test_soak_memory_threads_and_files_stay_flat(tmp_path):
    params = _params(tmp_path / "params.yaml")
    model_dir = tmp_path / "model_dir"
    log = open(tmp_path / "run.log", "wb")  # closed below
    proc = subprocess.Popen(
        [*RUN, "-p", str(params), "-m", "train", "-o", str(model_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    samples: list[tuple[int, int, int, int]] = []  # (step, rss, threads, fds)
    started = time.monotonic()
    try:
        while proc.poll() is None:
            assert time.monotonic() - started < 3600, "the soak run takes over an hour"
            status = _status(proc.pid)
            step = _step(model_dir)
            if status is not None and step > 0:
                samples.append((step, *status))
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    output = (tmp_path / "run.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    elapsed = time.monotonic() - started

    assert [s for s, _ in LossLog.read(model_dir / LOSS_LOG)] == list(range(1, STEPS + 1))
    kept = [s for s, _ in ckpt.list_checkpoints(model_dir)]
    assert kept == list(range(STEPS - 4 * CHECKPOINT_STEPS, STEPS + 1, CHECKPOINT_STEPS))

    warm = [x for x in samples if WARM_UP <= x[0] < WARM_UP + WINDOW]
    after = [x for x in samples if x[0] >= WARM_UP]
    final = [x for x in samples if x[0] > STEPS - WINDOW]
    assert len(warm) >= 3 and len(final) >= 3, f"too few samples: {len(samples)}"
    rss_warm = statistics.median(x[1] for x in warm)
    rss_final = statistics.median(x[1] for x in final)
    growth = (rss_final - rss_warm) / rss_warm
    threads_warm, fds_warm = max(x[2] for x in warm), min(x[3] for x in warm)
    threads_max, fds_max = max(x[2] for x in after), max(x[3] for x in after)
    fds_final = min(x[3] for x in final)
    figures = {
        "steps": STEPS,
        "seconds": round(elapsed, 1),
        "samples": len(samples),
        "rss_warm_mib": round(rss_warm / 2**20, 2),
        "rss_final_mib": round(rss_final / 2**20, 2),
        "rss_max_after_warm_up_mib": round(max(x[1] for x in after) / 2**20, 2),
        "rss_growth_percent": round(100 * growth, 3),
        "threads_warm": threads_warm,
        "threads_max_after_warm_up": threads_max,
        "threads_final": final[-1][2],
        "open_files_warm_at_rest": fds_warm,
        "open_files_final_at_rest": fds_final,
        "open_files_max_after_warm_up": fds_max,
        "open_files_final": final[-1][3],
    }
    print("\nsoak figures:", json.dumps(figures, indent=2))
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=2))
    assert growth < 0.02, figures
    assert threads_max <= threads_warm, figures
    assert fds_final <= fds_warm, figures
    assert fds_max <= fds_warm + SAVE_OPEN_FILES, figures

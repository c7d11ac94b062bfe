"""What the benchmarks share: the benchmark GPT, timing summaries, machine limits.

Every benchmark prints its own report and, as its last line, ``RESULT {json}``
with its figures, which ``benchmarks/run_all.py`` gathers into one table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from weightstream.models import GPT, GPTConfig

# The benchmark model of the step-time benchmarks: 6 blocks, d_model 512.
GPT_BENCH = GPTConfig(vocab_size=4096, seq_len=256, n_layer=6, d_model=512, n_head=8)
GPT_BENCH_BATCH = 8


def gpt_batch(cfg: GPTConfig = GPT_BENCH, batch: int = GPT_BENCH_BATCH):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    return x, y


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def train_step_flops(cfg: GPTConfig = GPT_BENCH, batch: int = GPT_BENCH_BATCH) -> int:
    """FLOPs of one forward + backward of the GPT, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = GPT(cfg)
        x = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
        y = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        lm_loss(model(x), y).backward()
    return counter.get_total_flops()


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['min']:.{digits}f} / {s['median']:.{digits}f} / {s['max']:.{digits}f}"


def machine_profile(disk_dir: str | Path | None = None):
    """The machine's measured rates (the compiler's probe, cached; measured once on a miss)."""
    from weightstream.compiler import probe

    return probe.load_or_measure("cpu", disk_dir=disk_dir)


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def reset_peak_rss() -> None:
    """Make the peak resident set the current one (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def print_result(name: str, **figures) -> None:
    print("RESULT " + json.dumps({"benchmark": name, **figures}), flush=True)


def parse_result(stdout: str) -> dict:
    """The figures of the last ``RESULT`` line a benchmark printed."""
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line in:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])

"""Run the performance benchmarks one after the other and print one table.

Each benchmark runs as its own process (so one's memory and threads do not
disturb the next), prints its full report here, and ends with a ``RESULT``
line that this script gathers. The table gives, per benchmark, the ratio it is
about (medians of interleaved runs, with min/median/max where it has them) and
how close the measured figure is to the machine's limit.

    .venv/bin/python benchmarks/run_all.py [--quick] [--large-store-dir DIR]

``--quick`` runs fewer steps and repeats. ``--large-store-dir`` adds the
larger-than-RAM runs at 1.35x RAM (with a checkpoint and a resume) and at 2x
RAM (about 20 minutes; free disk space of about 1.6x RAM there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str) -> dict | None:
    print(f"\n===== {script} {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
        else:
            print(line, end="", flush=True)
    code = proc.wait()
    print(f"===== {script}: exit {code}, {time.perf_counter() - t0:.0f} s", flush=True)
    return result if code == 0 else None


def _mmm(s: dict, digits: int = 3) -> str:
    return f"{s['min']:.{digits}f} / {s['median']:.{digits}f} / {s['max']:.{digits}f}"


def rows_ws_step_time(r: dict) -> list[tuple[str, str, str, str]]:
    out = []
    model = "" if r.get("model", "gpt") == "gpt" else f"{r['model']}, "
    for dtype, d in r["dtypes"].items():
        out.append(
            (
                f"WS/eager step time, {model}{dtype}",
                f"{d['ws_over_eager']:.3f}",
                _mmm(d["ws_over_eager_per_step"]),
                f"WS {d['ws']['fraction_of_limit']:.0%}, eager "
                f"{d['eager']['fraction_of_limit']:.0%} of matmul peak",
            )
        )
    return out


def rows_host_optimizer(r: dict) -> list[tuple[str, str, str, str]]:
    out = []
    for name in ("ours fused", "ours foreach"):
        v = r["variants"][name]
        out.append(
            (
                f"host AdamW, {name} / torch fused",
                f"{v['vs_torch_fused']:.3f}",
                _mmm(v["gparam_per_s"]) + " Gparam/s",
                f"{v['fraction_of_limit']:.0%} of memory bandwidth",
            )
        )
    tf = r["variants"]["torch foreach"]
    fused = r["variants"]["ours fused"]
    out.append(
        (
            "host AdamW, ours fused / torch foreach",
            f"{fused['gparam_per_s']['median'] / tf['gparam_per_s']['median']:.3f}",
            _mmm(tf["gparam_per_s"]) + " Gparam/s (torch foreach)",
            f"{tf['fraction_of_limit']:.0%} of memory bandwidth (torch foreach)",
        )
    )
    return out


def rows_disk_store(r: dict) -> list[tuple[str, str, str, str]]:
    return [
        (
            "disk store / RAM store step time",
            f"{r['disk_over_ram']:.3f}",
            _mmm(r["disk_over_ram_per_step"]),
            f"disk {r['disk']['fraction_of_limit']:.0%}, RAM {r['ram']['fraction_of_limit']:.0%} "
            "of matmul peak",
        ),
        (
            "disk store / RAM store peak RSS",
            f"{r['disk']['peak_rss'] / r['ram']['peak_rss']:.3f}",
            f"{r['disk']['peak_rss'] / 2**20:.0f} vs {r['ram']['peak_rss'] / 2**20:.0f} MiB",
            f"growth during steps {r['disk']['rss_growth'] / 2**20:.0f} vs "
            f"{r['ram']['rss_growth'] / 2**20:.0f} MiB",
        ),
    ]


def rows_larger_than_ram(r: dict) -> list[tuple[str, str, str, str]]:
    overlap = ", overlapped updates" if r.get("overlap_updates") else ""
    overlap += ", updates in the backward" if r.get("update_in_backward") else ""
    name = (
        f"larger than RAM ({r['state_over_ram']:.2f}x RAM, {r['params'] / 1e9:.2f}B params"
        f"{overlap})"
    )
    rows = []
    if r.get("over_hybrid"):  # None where the files move nothing a step
        rows += [
            (
                f"{name}: step / hybrid roofline",
                f"{r['over_hybrid']['median']:.2f}",
                _mmm(r["over_hybrid"]),
                f"roofline {r['hybrid_limit_seconds']:.1f} s: the placement's disk reads and "
                f"writes, timed together on the spot; peak RSS {r['peak_rss'] / 2**30:.1f} GiB, "
                f"budget {r['budget'] / 2**30:.1f} GiB",
            ),
            (
                f"{name}: step / hybrid roofline at burst bandwidths",
                f"{r['over_hybrid_burst']['median']:.2f}",
                _mmm(r["over_hybrid_burst"]),
                f"roofline {r['hybrid_burst_seconds']:.1f} s: the same bytes at a 2 GiB file's "
                "read and write bandwidths, best of 3",
            ),
        ]
    rows += [
        (
            f"{name}: step / the larger of disk and compute",
            f"{r['over_max_limit']['median']:.2f}",
            _mmm(r["over_max_limit"]),
            f"compute alone {r['compute_seconds']:.1f} s (eager PyTorch on two blocks in "
            "RAM, scaled)",
        ),
        (
            f"{name}: step / all-on-disk roofline",
            f"{r['over_limit']:.2f}",
            _mmm(r["seconds"], 1) + " s/step",
            f"roofline {r['limit_seconds']:.1f} s: the whole state read and written a step",
        ),
    ]
    if r.get("over_phase_bound"):  # where the forward reads no file (8a4425d and later)
        rows.insert(
            len(rows) - 1,
            (
                f"{name}: step / (forward + hybrid roofline)",
                f"{r['over_phase_bound']['median']:.2f}",
                _mmm(r["over_phase_bound"]),
                f"{r['phase_bound_seconds']:.1f} s: no file is read in the forward, so "
                "this phase order's least step",
            ),
        )
    if r.get("resume"):
        m = r["resume"]
        rows.append(
            (
                f"{name}: resume in a new process",
                f"{m['peak_rss'] / r['budget']:.2f} of budget",
                f"first step after {m['time_to_first_step']:.0f} s",
                f"peak RSS {m['peak_rss'] / 2**30:.1f} GiB; load {m['load_seconds']:.0f} s",
            )
        )
    return rows


def rows_estimate(r: dict) -> list[tuple[str, str, str, str]]:
    out = []
    for name, m in r["models"].items():
        out.append(
            (
                f"measured / estimated samples/s, {name}",
                f"{m['ratio']['median']:.3f}",
                _mmm(m["ratio"]),
                m.get("limit", ""),
            )
        )
    return out


TABLE = {
    "ws_step_time": rows_ws_step_time,
    "host_optimizer": rows_host_optimizer,
    "disk_store": rows_disk_store,
    "larger_than_ram": rows_larger_than_ram,
    "estimate_vs_measured": rows_estimate,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--large-store-dir", help="also run the larger-than-RAM model, store here")
    args = ap.parse_args()
    q = args.quick
    plan: list[tuple[str, list[str]]] = [
        ("ws_step_time.py", ["--steps", "4" if q else "10", "--warmup", "1"]),
        (
            "ws_step_time.py",
            ["--model", "hf-llama", "--dtypes", "fp32", "--steps", "4" if q else "10"],
        ),
        ("host_optimizer.py", ["--repeats", "3" if q else "7"]),
        ("disk_store.py", ["--steps", "4" if q else "10", "--warmup", "1"]),
        ("estimate_vs_measured.py", ["--repeats", "1" if q else "3"]),
    ]
    if args.large_store_dir:
        # The later ones without a checkpoint: disk space and time.
        for factor, extra in (
            ("1.35", []),
            ("1.35", ["--no-resume", "--overlap-updates", "--steps", "4"]),
            ("1.35", ["--no-resume", "--overlap-updates", "--update-in-backward", "--steps", "4"]),
            ("2.0", ["--no-resume"]),
            ("2.0", ["--no-resume", "--update-in-backward"]),
        ):
            plan.append(
                (
                    "larger_than_ram.py",
                    ["--store-dir", args.large_store_dir, "--ram-factor", factor, *extra],
                )
            )
    results = [(script, run(script, *a)) for script, a in plan]

    rows: list[tuple[str, str, str, str]] = []
    for script, r in results:
        if r is None:
            rows.append((script, "failed", "(see its output above)", ""))
            continue
        rows.extend(TABLE[r["benchmark"]](r))
    head = ("benchmark", "ratio (median)", "min / median / max", "against the machine's limit")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()

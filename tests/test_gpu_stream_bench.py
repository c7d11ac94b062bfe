"""benchmarks/gpu_stream.py runs in its tiny CPU version and reports every figure.

Only the shape and sanity of the RESULT line are checked, never a timing
(design.md: benchmarks print ratios, tests do not assert speed).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_stream.py"

SIZE_FIELDS = (
    "params",
    "tokens_per_step",
    "step_s",
    "tokens_per_s",
    "tflops",
    "pct_peak",
    "h2d_gbps",
    "d2h_gbps",
    "pinned_h2d_gbps",
    "roofline_s",
    "fraction_of_roofline",
    "peer",
    "ws_vs_fsdp2",
    "ws_vs_eager",
)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# 11-13 s each on 2 cores: the benchmark's smoke runs, with the slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_cpu_run_reports_every_field(dtype):
    """Forced to each compute dtype, so the checks hold on CPUs with and without native
    bf16 (``--dtype auto`` picks bf16 only where the CPU has it)."""
    # One thread: the machine's cores are shared, and two OpenMP threads on a
    # busy core make small operators wait for each other for tens of milliseconds.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--dtype",
        dtype,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), done.stdout[-2000:]
    r = json.loads(last[len("RESULT ") :])

    assert r["benchmark"] == "gpu_stream"
    assert r["device"] == "cpu"
    assert r["dtype"] == dtype and r["dtype_reason"] == "requested"
    assert list(r["sizes"]) == ["tiny"]
    s = r["sizes"]["tiny"]
    missing = [k for k in SIZE_FIELDS if k not in s]
    assert not missing, missing

    assert 1e6 < s["params"] < 1e7
    assert s["tokens_per_step"] == s["batch"] * s["seq"]
    steps = s["step_s"]
    assert all(_positive(steps[k]) for k in ("min", "median", "max"))
    assert steps["min"] <= steps["median"] <= steps["max"]
    for k in ("tokens_per_s", "tflops", "pct_peak", "h2d_gbps", "d2h_gbps", "pinned_h2d_gbps"):
        assert _positive(s[k]), (k, s[k])
    assert math.isclose(s["tokens_per_s"], s["tokens_per_step"] / steps["median"])
    # The link, counted by the engine: every weight crosses in the compute dtype once or
    # twice a step (a forward and a backward fetch; a unit still resident when the backward
    # reaches it is not fetched again), never more than the plan's two fetches. Each
    # gradient goes back once, in the fp32 masters' dtype (Note [gradients out]).
    weight_bytes = s["params"] * (2 if dtype == "bf16" else 4)
    assert s["h2d_bytes_plan"] == 2 * weight_bytes
    assert weight_bytes <= s["h2d_bytes_per_step"] <= s["h2d_bytes_plan"]
    assert s["d2h_bytes_per_step"] == 4 * s["params"]
    assert _positive(s["roofline_s"])
    assert 0 < s["fraction_of_roofline"] <= 1.5
    assert s["roofline"]["bound"] in ("compute", "link", "host")
    assert math.isfinite(s["loss"]["first"])

    peers = s["peer"]
    assert set(peers) == {"eager", "fsdp2_cpu_offload"}
    for name, p in peers.items():
        if "reason" in p:
            assert isinstance(p["reason"], str) and p["reason"], name
            continue
        assert _positive(p["step_s"]["median"]) and _positive(p["tokens_per_s"]), name
        # The same model, seed and batch: the first losses agree to bf16 rounding.
        assert abs(p["loss"]["first"] - s["loss"]["first"]) < 0.05, (name, p["loss"])
    for ratio, peer in (("ws_vs_eager", "eager"), ("ws_vs_fsdp2", "fsdp2_cpu_offload")):
        if "reason" in peers[peer]:
            assert s[ratio] is None
        else:
            assert _positive(s[ratio])


@pytest.mark.slow  # the options' smoke run (what it prints): with the slow tests
def test_tiny_cpu_run_with_updates_in_the_backward_and_a_profile():
    """The options of a GPU session's runs (scripts/gpu_check.sh) work anywhere: the
    update in the backward behind the next forward, activation checkpointing, and the
    profiled step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--steps", "2"]
    cmd += ["--warmup", "1", "--peers", "", "--update-in-backward", "--overlap-updates"]
    cmd += ["--profile", "--activation-checkpointing"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "profile of one WS step" in done.stdout
    r = json.loads(done.stdout.strip().splitlines()[-1][len("RESULT ") :])
    s = r["sizes"]["tiny"]
    assert s["loss"]["last"] < s["loss"]["first"]  # it trains
    assert s["peer"]["eager"] == {"reason": "not run (--peers)"}
    assert r["options"]["activation_checkpointing"] and r["options"]["update_in_backward"]


@pytest.mark.slow  # the options' smoke run: with the slow tests
def test_tiny_cpu_run_with_compact_state_the_tier_and_the_disk_store(tmp_path):
    """The runs of the compact-state acceptance (scripts/gpu_check.sh) work anywhere: WS
    in fp32 against bf16 state, each with and without a device tier, and its checkpoint
    saved and resumed bit for bit; then bf16 masters with int8 moments in a disk store,
    priced with the disk in the roofline."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    common = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--steps", "2"]
    common += ["--warmup", "1", "--peers", "", "--dtype", "fp32"]

    def run(*options: str) -> dict:
        cmd = [*common, *options]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1][len("RESULT ") :])["sizes"]["tiny"]

    checkpoints = tmp_path / "checkpoints"
    s = run("--vs-state", "bf16", "--device-tier", "0.001", "--checkpoint", str(checkpoints))
    assert s["optimizer"].endswith("fp32 state)")
    saved = s["checkpoint"]
    assert saved["resume"]["exact"] is True and _positive(saved["save_vs_disk"])
    assert saved["bytes"] > 12 * s["params"]  # fp32 masters and two moments, and the rest
    assert not any(checkpoints.iterdir())  # the file is removed after the check
    for key, state, units in (
        ("device_tier", "fp32", 1),
        ("vs_state", "bf16", 0),
        ("vs_state_device_tier", "bf16", 1),
    ):
        assert s[key]["state"] == state and s[key]["resident_units"] == units, key
        assert _positive(s[key]["vs_against"]) and s[key]["loss"]["last"] < s[key]["loss"]["first"]
    # The weights cross in the compute dtype (fp32 here) whatever the masters' dtype.
    assert s["vs_state"]["h2d_bytes_plan"] == s["h2d_bytes_plan"]

    store = tmp_path / "store"
    s = run("--state", "bf16-int8", "--store", "disk", "--store-dir", str(store),
            "--host-memory-budget", "0.016")  # fmt: skip
    assert s["loss"]["last"] < s["loss"]["first"]
    assert s["disk_bytes_per_step"]["read"] > 0 and s["disk_bytes_per_step"]["write"] > 0
    assert _positive(s["roofline"]["disk_s"])
    assert s["d2h_bytes_per_step"] == 2 * s["params"]  # gradients in the masters' bf16

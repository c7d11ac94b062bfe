"""benchmarks/sharded_rss.py runs in its tiny CPU version: one rank, then two sharded
ranks on their halves of the same batch, each reporting its resident set.

Checked: the shape of the RESULT line and that the runs trained the same model on the
same data (the two ranks' first losses average to the one rank's: same weights,
halves of one batch). Never the memory ratio itself on a model this small, where the
process's own (torch, gloo) outweighs the state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sharded_rss.py"


@pytest.mark.slow  # 19 s on 2 cores: the benchmark's smoke run, with the slow tests
def test_tiny_cpu_run_reports_each_rank_and_trains_the_same_model():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(SCRIPT), "--size", "tiny", "--seq", "64", "--steps", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), done.stdout[-2000:]
    r = json.loads(last[len("RESULT ") :])
    assert (r["benchmark"], r["ranks"], r["device"]) == ("sharded_rss", 2, "cpu")
    one, many = r["one_rank"], r["sharded"]
    assert [m["rank"] for m in many] == [0, 1]
    assert all(m["backend"] == "gloo" and m["world"] == 2 for m in many)
    for m in [one, *many]:
        assert 0 < m["rss_bytes"] <= m["peak_rss_bytes"]
    assert r["rss_ratio"] == max(m["rss_bytes"] for m in many) / one["rss_bytes"]
    first = (many[0]["losses"][0] + many[1]["losses"][0]) / 2
    assert abs(first - one["losses"][0]) <= 1e-5 * abs(one["losses"][0])
    assert many[0]["losses"][0] != many[1]["losses"][0]  # each rank its own half

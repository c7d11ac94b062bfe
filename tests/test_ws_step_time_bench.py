"""benchmarks/ws_step_time.py runs for both of its models and reports its figures.

It had stopped running (a compiled GPT was called with ``input_ids=``) and
nothing noticed. Only the RESULT line's shape is checked, never a timing
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
SCRIPT = ROOT / "benchmarks" / "ws_step_time.py"


@pytest.mark.slow  # 40 s each on 2 cores: with the slow tests (README), not the default ones
@pytest.mark.parametrize("model", ["gpt", "hf-llama"])
def test_one_step_of_each_mode_reports_the_ratios(model):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(SCRIPT), "--model", model, "--dtypes", "fp32"]
    cmd += ["--steps", "1", "--warmup", "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), done.stdout[-2000:]
    r = json.loads(last[len("RESULT ") :])
    assert r["benchmark"] == "ws_step_time" and r["model"] == model
    fp32 = r["dtypes"]["fp32"]
    for mode in ("eager", "lp", "ws"):
        seconds = fp32[mode]["seconds"]
        assert 0 < seconds["min"] <= seconds["median"] <= seconds["max"]
        assert (
            math.isfinite(fp32[mode]["fraction_of_limit"]) and fp32[mode]["fraction_of_limit"] > 0
        )
    assert fp32["ws_over_eager"] > 0

"""The example script of the README runs (shortened) and trains."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_train_gpt_ws_example_runs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_gpt_ws.py"),
            "--steps",
            "30",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--log-steps",
            "10",
            "--checkpoint-steps",
            "15",
            "--model-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    before = float(re.search(r"eval loss before training = ([\d.]+)", out).group(1))
    after = float(re.search(r"eval loss after training = ([\d.]+)", out).group(1))
    assert after < before - 1.0, out
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint_*.mdl")) == [
        "checkpoint_15.mdl",
        "checkpoint_30.mdl",
    ]


@pytest.mark.slow  # 8 s on 2 cores: a second run of the example, with the slow tests
def test_train_gpt_ws_example_runs_a_few_steps(tmp_path):
    """Fewer than 10 steps: a warmup of at least one step (it was steps // 10 = 0, which
    LinearLR refuses)."""
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt_ws.py"), "--steps", "2",
         "--batch-size", "4", "--seq-len", "16", "--model-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip

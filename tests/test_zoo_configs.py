"""The zoo's full-size params files in configs/: planned without their weights, and
trained at a reduced size through the disk store they configure.

A full-size model (up to Llama 2 7B: 27 GB of fp32 weights, 108 GB of training
state) is validated and compiled on the meta device, so these runs take seconds
and little memory. Training one needs the hardware; the reduced runs keep
every setting of the file but the model's width and depth and the batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from weightstream import checkpoint as ckpt
from weightstream.cli.main import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# The files whose training state is larger than a 24 GiB host: they use store: disk.
LARGE = ("gpt2_xl", "gpt3_xl", "gptj_6b", "llama2_7b", "llama2_13b", "llama_20b")
# The default suite takes the largest Llamas (its 15 minutes); -m slow all.
DEFAULT = ("llama2_7b", "llama_20b")
EACH = [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in LARGE]
BYTES_PER_PARAM = 4  # fp32 masters


@pytest.fixture(autouse=True)
def _quiet_logs():
    import logging

    logging.getLogger("weightstream").handlers.clear()
    yield


# The child's own peak: VmHWM of its address space. Not getrusage's ru_maxrss, which
# Linux carries across exec from the forked copy of this process (the test process's
# size, over 2 GiB late in the suite).
PEAK_RSS = """
import resource, sys
from weightstream.cli.main import main
code = main(sys.argv[1:])
try:
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("PEAK", peak)
sys.exit(code)
"""


@pytest.mark.parametrize("name", EACH)
def test_full_size_config_validates_without_building_the_weights(tmp_path, name):
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert raw["runconfig"]["store"] == "disk"
    model_dir = tmp_path / "m"
    args = ["run", "CPU", "-p", str(CONFIGS / f"{name}.yaml"), "-o", str(model_dir)]
    if name == "llama2_7b":  # the largest, in a process of its own to read its peak memory
        run = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, *args, "--validate_only"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        peak = int(run.stdout.split("PEAK")[-1])
        assert peak < 2 * 2**30, peak  # its weights alone are 27 GB
    else:
        assert main([*args, "--validate_only"]) == 0
    assert not (model_dir / "store").exists()  # nothing materialized
    assert not list(model_dir.glob("checkpoint_*"))


@pytest.mark.slow  # 20 s on 2 cores; validate_only plans the full sizes by default
def test_full_size_compile_plans_every_weight(tmp_path):
    """GPT-J 6B compiled (plan, report, estimate) from shapes alone, in both modes."""
    from test_params import PUBLISHED_SIZES

    path = str(CONFIGS / "gptj_6b.yaml")
    for mode in ("weight_streaming", "layer_pipelined"):
        model_dir = tmp_path / mode
        argv = ["run", "CPU", "-p", path, "-o", str(model_dir), "--compile_only"]
        assert main([*argv, "--execution_mode", mode]) == 0
        (compiled,) = model_dir.glob("ws_*")
        plan = json.loads((compiled / "plan.json").read_text())
        weights = sum(u["weight_bytes"] for u in plan["units"])
        assert weights == PUBLISHED_SIZES["gptj_6b"] * BYTES_PER_PARAM, mode
        assert 0 < plan["est_samples_per_sec"] < 1  # 147 TFLOP a step on a CPU
        assert (compiled / "compile_report.txt").is_file()


REDUCED = {
    "gpt2_xl": dict(n_layer=2, d_model=64, n_head=4, seq_len=64),
    "gpt3_xl": dict(n_layer=2, d_model=64, n_head=4, seq_len=64),
    "gptj_6b": dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, seq_len=64),
    "llama2_7b": dict(n_layer=2, d_model=64, n_head=4, d_ff=160, seq_len=64),
    "llama2_13b": dict(n_layer=2, d_model=64, n_head=4, d_ff=160, seq_len=64),
    "llama_20b": dict(n_layer=2, d_model=64, n_head=4, d_ff=160, seq_len=64),
}


@pytest.mark.parametrize("name", EACH)
def test_reduced_size_trains_through_the_disk_store(tmp_path, name):
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    raw["model"].update(REDUCED[name])
    for section in ("train_input", "eval_input"):
        raw[section].update(batch_size=2, seq_len=64, num_workers=0, max_bytes=2**20)
    params = tmp_path / f"{name}_reduced.yaml"
    params.write_text(yaml.safe_dump(raw))
    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-p", str(params), "-o", str(model_dir), "--max_steps", "3"]
    assert main(argv) == 0
    state = ckpt.load(ckpt.checkpoint_path(model_dir, 3), map_location="cpu")
    assert state["global_step"] == 3
    weights = state["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())
    vocab = raw["train_input"]["vocab_size"]
    assert weights["wte.weight"].shape == (vocab, 64)
    assert not (model_dir / "store").exists()  # the store made it, empty, and removed it


def test_layer_pipelined_model_on_meta_refuses_to_run():
    import weightstream as cstorch

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    compiled = cstorch.compile(model, backend="wse_lp", device="cpu")
    with pytest.raises(RuntimeError, match=r"meta device .* Fix: build it on the CPU"):
        compiled(torch.ones(2, 4))

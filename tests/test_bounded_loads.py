"""Putting a checkpoint back into a disk-store model holds one tensor at a time.

Note [bounded loads]: a model whose training state is many times the host
memory budget resumes (the seed's ``cstorch.load`` + ``load_state_dict``, and
the run command), evaluates and warm-starts in a new process with peak RSS
growth within the budget, the largest tensor and a constant, and continues bit
for bit as the run that never stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import params_files as pf
import pytest
import torch
from trees import assert_same_tree

from weightstream import checkpoint as ckpt

_RSS = """
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
"""

# The reader's own buffers and the allocator's slack beside the one tensor in flight.
CONSTANT = 16 * 2**20


def _python(script: str, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_SEED_SCRIPT = _RSS + textwrap.dedent(
    """
    import json, sys
    import torch
    import weightstream as cstorch

    mode, workdir, budget, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    runner = cstorch.compile(
        model, backend="ws", granularity="module", prefetch_depth=1, store="disk",
        store_dir=f"{workdir}/store-{mode}", host_memory_budget=budget,
        init_weights=mode != "resume",  # a resume's weights come from the checkpoint
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1))
    growth = None
    if mode == "resume":
        base = rss("VmRSS")
        reset_peak()
        state_dict = cstorch.load(f"{workdir}/checkpoint.mdl")
        model.load_state_dict(state_dict["model"])
        opt.load_state_dict(state_dict["optimizer"])
        growth = rss("VmHWM") - base
        state_dict.close()
    losses = []
    for _ in range(steps):
        loss = runner(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                 f"{workdir}/{'checkpoint' if mode == 'first' else mode}.mdl")
    print(json.dumps({"losses": losses, "growth": growth}))
    """
)


@pytest.mark.slow  # 41 s on 2 cores; a warm start into a disk store is bounded by default
def test_seed_recipe_resumes_a_disk_store_model_one_tensor_at_a_time(tmp_path):
    """24 Linear(1024, 1024): 96 MiB of weights, 384 MiB of training state with the
    gradients and AdamW's moments, 10x the budget (the disk store's compile-time
    bound on the CPU: (prefetch_depth 1 + 1) units in flight plus one unit's update
    at 4x its weights, 2 device copies and a unit's gradients). Before Note
    [bounded loads] this load grew RSS by 300 MB."""
    unit = 1024 * 1024 * 4 + 1024 * 4  # fp32 weight and bias
    budget = (1 + 1 + 4 + 1 + 1 + 1) * unit
    largest = 1024 * 1024 * 4
    whole = _python(_SEED_SCRIPT, "whole", tmp_path, budget, 4)
    _python(_SEED_SCRIPT, "first", tmp_path, budget, 2)
    resumed = _python(_SEED_SCRIPT, "resume", tmp_path, budget, 2)
    assert resumed["growth"] <= budget + largest + CONSTANT, (resumed["growth"], budget)
    # Continues bit for bit: the losses and every tensor of the final state.
    assert resumed["losses"] == whole["losses"][2:]
    a = ckpt.load(tmp_path / "whole.mdl", map_location="cpu")
    b = ckpt.load(tmp_path / "resume.mdl", map_location="cpu")
    assert_same_tree(a, b, "state")


# The run command in a process of its own, with the peak RSS growth of each
# checkpoint load measured around the trainer's load methods (the code runs
# unchanged; the wrapper only reads /proc).
_RUN_SCRIPT = _RSS + textwrap.dedent(
    """
    import functools, json, sys
    from weightstream.cli.main import main
    from weightstream.train.trainer import Trainer

    loads = {}

    def measured(name, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            base = rss("VmRSS")
            reset_peak()
            try:
                return method(*args, **kwargs)
            finally:
                loads[name] = rss("VmHWM") - base
        return wrapper

    Trainer.load_checkpoint = measured("load_checkpoint", Trainer.load_checkpoint)
    Trainer.warm_start = measured("warm_start", Trainer.warm_start)
    rc = main(sys.argv[1:])
    print(json.dumps({"rc": rc, **loads}))
    """
)


def _run(*args) -> dict:
    got = _python(_RUN_SCRIPT, "run", "CPU", *args)
    assert got["rc"] == 0, got
    return got


def _params(path: Path, budget: int, **runconfig) -> Path:
    """A GPT-2 of 12 layers of d_model 256: 9.5 M parameters, a 151 MB training state."""
    path.mkdir(parents=True, exist_ok=True)
    section = pf.text_input(4, 32)
    return pf.write(
        path / "params.yaml",
        pf.params(
            train_input={**section, "shuffle_seed": 3},
            eval_input=section,
            model=pf.gpt2(12, 256, 32),
            optimizer=pf.adamw(pf.warmup_cosine(3e-3, 2, 100), max_gradient_norm=1.0),
            runconfig={
                "max_steps": 4,
                "checkpoint_steps": 2,
                "log_steps": 1,
                "eval_steps": 2,
                "seed": 7,
                "unit_size_target": 20_000,  # a unit a module: mlp.fc is the largest
                "prefetch_depth": 1,
                "store": "disk",
                "host_memory_budget": budget,
                **runconfig,
            },
        ),
    )


@pytest.mark.slow  # 70 s on 2 cores; the seed recipe's test above covers the same loads
def test_run_command_resume_eval_and_warm_start_of_a_disk_store_model_are_bounded(tmp_path):
    """The run command's resume, ``-m eval`` and warm start of a model whose state is
    more than 4x the host memory budget: each load grows RSS by at most the budget,
    the largest tensor and the constant, and the resume continues bit for bit."""
    largest_unit = (256 * 1024 + 1024) * 4  # mlp.fc: weight and bias, fp32
    budget = 10 * 2**20
    assert (1 + 1 + 4 + 1 + 1 + 1) * largest_unit <= budget  # the compile-time bound on the CPU
    params = _params(tmp_path, budget)
    whole, split = tmp_path / "whole", tmp_path / "split"
    _run("-p", params, "-o", whole)
    _run("-p", params, "-o", split, "--max_steps", "2")
    resumed = _run("-p", params, "-o", split)  # autoload resumes at step 2
    a = ckpt.load(whole / "checkpoint_4.mdl", map_location="cpu")
    b = ckpt.load(split / "checkpoint_4.mdl", map_location="cpu")
    state_bytes = 4 * sum(t.numel() * t.element_size() for t in a["model"].values())
    assert state_bytes >= 4 * budget
    largest = max(t.numel() * t.element_size() for t in a["model"].values())
    bound = budget + largest + CONSTANT
    assert resumed["load_checkpoint"] <= bound, (resumed["load_checkpoint"], bound)
    assert_same_tree(a["model"], b["model"], "model")
    assert_same_tree(a["optimizer"], b["optimizer"], "optimizer")

    evaluated = _run(
        "-p", params, "-m", "eval", "-o", tmp_path / "eval",
        "--checkpoint_path", whole / "checkpoint_4.mdl",
    )  # fmt: skip
    assert evaluated["load_checkpoint"] <= bound, (evaluated["load_checkpoint"], bound)

    warm = _params(
        tmp_path / "warm",
        budget,
        checkpoint_path=str(whole / "checkpoint_4.mdl"),
        load_checkpoint_states="model,optimizer",
        max_steps=1,
    )
    started = _run("-p", warm, "-o", tmp_path / "warm" / "out")
    assert started["warm_start"] <= bound, (started["warm_start"], bound)
    written = ckpt.load(tmp_path / "warm" / "out" / "checkpoint_1.mdl", map_location="cpu")
    assert int(written["global_step"]) == 1


_CONVERT_SCRIPT = _RSS + textwrap.dedent(
    """
    import json, sys
    from weightstream.checkpoint.cli import main

    base = rss("VmRSS")
    reset_peak()
    rc = main(["convert", *sys.argv[1:]])
    print(json.dumps({"rc": rc, "growth": rss("VmHWM") - base}))
    """
)


def test_checkpoint_convert_holds_one_tensor_at_a_time(tmp_path):
    """A 192 MiB trainer-style checkpoint (24 Linear(1024, 1024) and an AdamW-sized
    state) converted to safetensors and back to H5 in a new process: RSS grows by
    about one 4 MiB tensor and the reader's and writer's buffers, not by the file."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"model": weights, "moments": {k: torch.randn_like(v) for k, v in weights.items()}}
    source = tmp_path / "state.mdl"
    ckpt.save(state, source)
    total = sum(t.numel() * 4 for part in state.values() for t in part.values())
    assert total >= 192 * 2**20
    largest = 1024 * 1024 * 4
    for src, dst in (
        (source, tmp_path / "state.safetensors"),
        (tmp_path / "state.safetensors", tmp_path / "back.mdl"),
    ):
        got = _python(_CONVERT_SCRIPT, src, dst)
        assert got["rc"] == 0
        assert got["growth"] <= largest + CONSTANT, (src, got["growth"])
    back = ckpt.load(tmp_path / "back.mdl", map_location="cpu")
    for key, value in weights.items():
        assert torch.equal(back["model"][key], value), key

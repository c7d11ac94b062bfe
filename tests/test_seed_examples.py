"""The seeds' full training and evaluation examples run unchanged but for the
import line, a model and data of our choice, and the seed's own typos (see the
scripts in tests/seed_examples/, where each change is marked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import weightstream as cstorch
from weightstream.context import start_run

pytest.importorskip("sklearn")

HERE = Path(__file__).parent / "seed_examples"


def _run(script: str, backend: str) -> dict:
    ns = {"BACKEND": backend, "__name__": "__seed_example__"}
    code = compile((HERE / script).read_text(), str(HERE / script), "exec")
    exec(code, ns)
    return ns


@pytest.mark.parametrize("backend", ["wse_ws", "wse_lp"])
def test_seed_training_then_evaluation_examples(backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes checkpoint_{i}.mdl into the cwd
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("seed_support", None)
    ns = _run("train.py", backend)
    losses = ns["LOSSES"]
    assert len(losses) == 200
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.5 * first, (first, last)  # it trains
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*.mdl")) == [
        "checkpoint_0.mdl",
        "checkpoint_100.mdl",
    ]

    start_run()  # the evaluation example is a separate process in the seed
    import seed_support

    seed_support.eval_checkpoint = str(tmp_path / "checkpoint_100.mdl")
    ev = _run("evaluate.py", backend)
    assert ev["total_steps"] == 100
    acc = float(ev["accuracy"])
    assert acc > 0.8, acc  # 10 classes: chance is 0.1
    assert isinstance(cstorch.metrics.AccuracyMetric, type)


def test_seed_training_example_with_compile_only_executes_nothing(tmp_path, monkeypatch):
    """The seed's example with ``compile_only=True`` in its configure() call compiles
    and runs no step: no loss printed, no checkpoint written, the weights as built."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("seed_support", None)
    source = (HERE / "train.py").read_text()
    call = "    checkpoint_steps=checkpoint_steps,\n"
    assert source.count(call) == 1
    source = source.replace(call, call + "    compile_only=True,\n")
    ns = {"BACKEND": "wse_ws", "__name__": "__seed_example__"}
    exec(compile(source, str(HERE / "train.py"), "exec"), ns)
    assert ns["LOSSES"] == [] and ns["i"] == 0  # one batch, for the compile
    assert list(tmp_path.glob("checkpoint_*.mdl")) == []
    built = ns["make_model"]()
    for name, value in ns["model"].state_dict().items():
        torch.testing.assert_close(value, built.state_dict()[name], rtol=0, atol=0)
    assert ns["compiled_model"].plan is not None

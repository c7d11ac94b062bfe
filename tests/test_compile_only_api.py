"""``configure(compile_only=True)`` and ``validate_only=True`` in a Python script:
the first step plans the model and nothing executes (Note [compile only] in
weightstream/executor.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

import weightstream as cstorch
from weightstream.context import start_run


def _batches(n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n * 4, 16, generator=g), torch.randint(0, 4, (n * 4,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _script(backend: str, model: nn.Module, **configure) -> dict:
    """A reference-style training script; what it saw."""
    seen = {"batches": 0, "closures": 0, "checkpoints": 0, "results": []}
    cstorch.configure(checkpoint_steps=1, **configure)
    compiled = cstorch.compile(model, backend=backend)
    opt = cstorch.optim.configure_optimizer("SGD", params=model.parameters(), lr=0.1)
    loader = cstorch.utils.data.DataLoader(_batches, num_steps=6)

    @cstorch.compile_step
    def train_step(batch):
        x, y = batch
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    @cstorch.step_closure
    def log_loss(loss):
        seen["closures"] += 1

    @cstorch.checkpoint_closure
    def save(step):
        seen["checkpoints"] += 1

    save(0)
    for batch in loader:
        seen["batches"] += 1
        loss = train_step(batch)
        seen["results"].append(loss)
        log_loss(loss)
        save(1)
    seen["compiled"] = compiled
    return seen


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("backend", ["wse_ws", "wse_lp"])
@pytest.mark.parametrize("mode", ["compile_only", "validate_only"])
def test_a_script_compiles_and_executes_nothing(backend, mode, caplog, tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="weightstream"):
        seen = _script(backend, model, model_dir=str(tmp_path), **{mode: True})
    assert seen["batches"] == 1  # the one the compile needs
    assert seen["results"] == [None]
    assert (seen["closures"], seen["checkpoints"]) == (0, 0)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    text = caplog.text
    assert f"configure({mode}=True)" in text and "Nothing is executed" in text
    if backend == "wse_ws":
        assert seen["compiled"].plan is not None and len(seen["compiled"].plan.units) >= 2
        assert "planned for weight streaming in" in text
    else:
        assert "compiled for layer pipelined execution" in text
    # compile_only leaves its compile directory in model_dir, as the run command's does;
    # validate_only only traces.
    written = list(tmp_path.glob("ws_*"))
    assert len(written) == (mode == "compile_only"), written
    assert list(tmp_path.glob("checkpoint_*")) == []


def _flops(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Forward and backward FLOPs of ``model(x).sum()`` by torch's own counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as forward:
        out = model(x).sum()
    with FlopCounterMode(display=False) as backward:
        out.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def test_compile_only_writes_the_plan_and_estimate_of_the_scripts_step(tmp_path, caplog):
    """The compile directory of a script's compile_only step: its plan, the FLOPs torch's
    counter finds in the step, the script's optimizer priced; read back with json. A second
    compile of the same model and batch finds it there; compile_dir puts it elsewhere."""
    model_dir, compile_dir = tmp_path / "model", tmp_path / "compiled"
    with caplog.at_level(logging.INFO, logger="weightstream"):
        seen = _script("wse_ws", _model(), model_dir=str(model_dir), compile_only=True)
    (directory,) = model_dir.glob("ws_*")
    assert f"its compile directory is {directory}" in caplog.text
    plan = json.loads((directory / "plan.json").read_text())
    report = (directory / "compile_report.txt").read_text()
    compiled = seen["compiled"]
    assert [u["name"] for u in plan["units"]] == [u.display_name for u in compiled.plan.units]
    assert plan["totals"]["params"] == sum(p.numel() for p in compiled.parameters())
    forward, backward = _flops(_model(), torch.randn(4, 16))
    assert plan["totals"]["fwd_flops"] == forward
    assert plan["totals"]["bwd_flops"] == backward
    settings = plan["estimate_settings"]
    assert settings["batch_size"] == 4 and settings["weight_streaming"] is True
    assert settings["update_bytes"] == 12  # plain SGD: read p and g, write p
    assert plan["est_samples_per_sec"] > 0
    assert "the script's input pipeline is not priced" in report

    caplog.clear()
    start_run()  # a new run (configure() is once per run)
    with caplog.at_level(logging.INFO, logger="weightstream"):
        _script("wse_ws", _model(), model_dir=str(model_dir), compile_only=True)
    assert f"its compile directory {directory} was already there" in caplog.text
    start_run()
    _script(
        "wse_ws",
        _model(),
        model_dir=str(model_dir),
        compile_dir=str(compile_dir),
        compile_only=True,
    )
    assert [p.name for p in compile_dir.glob("ws_*")] == [directory.name]


def test_compile_only_prices_the_optimizer_built_before_the_step(tmp_path):
    """AdamW with bf16 state: the update's bytes are compact state's (Note [compact
    optimizer state]), not fp32 AdamW's; no optimizer at all is priced as AdamW, said."""
    from weightstream.compiler.compile_phase import compact_update_bytes
    from weightstream.compiler.estimate import DEFAULT_UPDATE_BYTES

    def compile_only(optimizer: bool) -> dict:
        start_run()  # a new run (configure() is once per run)
        model_dir = tmp_path / str(optimizer)
        cstorch.configure(model_dir=str(model_dir), compile_only=True)
        model = _model()
        compiled = cstorch.compile(model, backend="wse_ws")
        opt = (
            cstorch.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.bfloat16)
            if optimizer
            else None
        )

        @cstorch.compile_step
        def step(x):
            return compiled(x).sum()

        assert step(torch.randn(4, 16)) is None
        del opt
        (directory,) = model_dir.glob("ws_*")
        return json.loads((directory / "plan.json").read_text())

    with_adamw = compile_only(True)
    expected = compact_update_bytes(torch.float32, torch.bfloat16)
    assert with_adamw["estimate_settings"]["update_bytes"] == expected
    without = compile_only(False)
    assert without["estimate_settings"]["update_bytes"] == DEFAULT_UPDATE_BYTES
    assert any("no optimizer was built" in n for n in without["estimate"]["notes"])


def test_the_same_script_trains_without_the_setting():
    """The control: the script above trains and runs its closures."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    seen = _script("wse_ws", model)
    assert seen["batches"] == 6 and seen["closures"] == 6 and seen["checkpoints"] == 7
    assert all(isinstance(r, torch.Tensor) for r in seen["results"])
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_validate_only_plans_a_model_too_large_to_build():
    """A transformers model on the meta device (shapes only) is planned, as the run
    command's --validate_only plans the zoo's largest configurations."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    cstorch.configure(validate_only=True)
    compiled = cstorch.compile(model, backend="wse_ws", device="cpu")

    @cstorch.compile_step
    def step(ids):
        return compiled(input_ids=ids, labels=ids).loss

    ids = torch.zeros(1, 16, dtype=torch.long)
    assert step(ids) is None and step(ids) is None
    plan = compiled.plan
    assert sum(u.numel for u in plan.units) == sum(p.numel() for p in model.parameters())
    assert len(plan.units) >= 32
    assert "masters 25.1 GiB" in compiled.engine.describe_tiers()  # 6.74e9 x 4 bytes

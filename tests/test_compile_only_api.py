"""``configure(compile_only=True)`` and ``validate_only=True`` in a Python script:
the first step plans the model and nothing executes (Note [compile only] in
weightstream/executor.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import weightstream as cstorch


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
def test_a_script_compiles_and_executes_nothing(backend, mode, caplog):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="weightstream"):
        seen = _script(backend, model, **{mode: True})
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

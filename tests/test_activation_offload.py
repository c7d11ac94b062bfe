"""Activation offload (Note [activation offload] in runtime/offload.py): the forward's
saved activations go to host memory and come back in the backward. Training must stay
bit for bit eager PyTorch's, with and without activation checkpointing. On the CPU the
copies are host copies (the engine says the option saves nothing there); the CUDA side
(streams, page-locked memory, device memory saved) is tested in test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from test_engine import _assert_same_state, _matches_eager

import weightstream as cstorch
from weightstream.models import Llama, LlamaConfig
from weightstream.runtime import offload as offload_module

LLAMA = LlamaConfig(vocab_size=128, seq_len=64, n_layer=3, d_model=64, n_head=4, n_kv_head=2)


def _llama():
    return Llama(LLAMA)


def _batch_lm(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (8, 64), generator=g)
    return x, torch.roll(x, -1, 1)


def _train(backend, steps=3, **kw):
    torch.manual_seed(0)
    model = _llama()
    runner = model if backend is None else cstorch.compile(model, backend=backend, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _batch_lm(step)
        loss = torch.nn.functional.cross_entropy(runner(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, runner, torch.stack(losses)


@pytest.fixture
def small_threshold(monkeypatch):
    # The zoo's activations are a few KiB: offload every one of them.
    monkeypatch.setattr(offload_module, "MIN_BYTES", 0)


@pytest.mark.filterwarnings("ignore:weightstream. activation_offload on the CPU")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_with_offloaded_activations_equals_eager(small_threshold, checkpointing):
    ref, _, ref_losses = _train(None)
    model, runner, losses = _train(
        "ws",
        granularity="module",
        activation_offload=True,
        activation_checkpointing=checkpointing,
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    assert runner.engine.streamer.offload.bytes_out > 0


@pytest.mark.filterwarnings("ignore:weightstream. activation_offload on the CPU")
@pytest.mark.parametrize("model_name", ["gpt_tied", "called_twice", "root_params"])
def test_zoo_models_with_offloaded_activations_equal_eager(small_threshold, model_name):
    _matches_eager(model_name, steps=3, accum=2, granularity="module", activation_offload=True)


def test_a_saved_tensor_unpacked_twice_comes_back_twice(small_threshold):
    """``retain_graph``: a record handed out once is copied back again."""
    with pytest.warns(UserWarning, match="activation_offload on the CPU"):
        torch.manual_seed(0)
        model = _llama()
        runner = cstorch.compile(model, backend="ws", activation_offload=True)
        x, y = _batch_lm(0)
        loss = torch.nn.functional.cross_entropy(runner(x).flatten(0, 1), y.flatten())
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for p, g in zip(model.parameters(), first):
        assert torch.equal(p.grad, 2 * g)


def test_small_tensors_stay():
    """Below MIN_BYTES nothing moves (a copy would cost more than it saves)."""
    with pytest.warns(UserWarning, match="activation_offload on the CPU"):
        _, runner, _ = _train("ws", steps=1, activation_offload=True)
    assert runner.engine.streamer.offload.bytes_out == 0  # every activation < 1 MiB

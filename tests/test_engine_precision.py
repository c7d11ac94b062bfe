"""Weight streaming with a compute dtype: fp32 masters in the store, weights cast
on their way to the device, gradients accumulated back in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import weightstream as cstorch
from weightstream.amp import round_to_cbfloat16
from weightstream.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, d_model=32, n_head=4, tie_embeddings=False)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (4, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _reference_step(model, opt, x, y, cast):
    """The recipe: fp32 masters; each step every floating weight is cast to the
    compute dtype, the model runs on those casts (under bf16 autocast), and the
    gradient of each cast comes back to its master in fp32."""
    masters = dict(model.named_parameters())
    casts = {n: cast(p.detach()).requires_grad_() for n, p in masters.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = functional_call(model, casts, (x,))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    for n, p in masters.items():
        p.grad = casts[n].grad.to(p.dtype)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _ws_step(runner, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = runner(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize(
    ("compute_dtype", "cast"),
    [
        ("bfloat16", lambda t: t.to(torch.bfloat16)),
        # cbfloat16 travels as float32 holding cbfloat16 values.
        ("cbfloat16", round_to_cbfloat16),
    ],
)
def test_ws_compute_dtype_equals_the_cast_recipe_bitwise(compute_dtype, cast):
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", compute_dtype=compute_dtype)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(10):
        x, y = _batch(step)
        expected = _reference_step(ref, opt_ref, x, y, cast)
        got = _ws_step(runner, opt, x, y)
        assert torch.equal(got, expected), step
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32  # the store keeps fp32 masters
        assert torch.equal(a, b), name


def test_bf16_stream_halves_device_weight_bytes():
    model = GPT(CFG)
    fp32 = cstorch.compile(GPT(CFG), backend="ws", granularity="module")
    bf16 = cstorch.compile(model, backend="ws", granularity="module", compute_dtype="bf16")
    x, y = _batch(0)
    for r in (fp32, bf16):
        F.cross_entropy(r(x).flatten(0, 1).float(), y.flatten()).backward()
    assert bf16.engine.streamer.meter.peak_bytes * 2 == fp32.engine.streamer.meter.peak_bytes
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_bad_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype"):
        cstorch.StreamingConfig(compute_dtype="int8")

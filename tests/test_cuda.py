"""Weight streaming on a CUDA device against the same model resident on it.

Every test here carries the ``cuda`` marker and is skipped where no CUDA device
exists (CI has none; sessions with a GPU run ``pytest -m cuda``). In fp32 the
streamed run computes the same kernels on the same values as the resident one,
so losses and weights are compared bit for bit; cuBLAS picks its algorithms by
shape, not by where a weight came from, and TF32 is switched off so that both
runs use full fp32 products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.models import GPT, GPTConfig, Llama, LlamaConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPT_CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, d_model=64, n_head=4)
LLAMA_CFG = LlamaConfig(vocab_size=256, seq_len=32, n_layer=3, d_model=64, n_head=4, n_kv_head=2)
MODELS = {"gpt": (GPT, GPT_CFG), "llama": (Llama, LLAMA_CFG)}
DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _full_fp32_products():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (4, 32), generator=g)
    return x.to(DEVICE), torch.roll(x, -1, 1).to(DEVICE)


def _train(make, cfg, steps: int, **compile_kw):
    """(model, runner, losses): AdamW on the model, resident on the device (no
    ``compile_kw``) or streamed from host masters."""
    torch.manual_seed(0)
    model = make(cfg)
    if compile_kw:
        runner = cstorch.compile(model, backend="ws", device=DEVICE, **compile_kw)
    else:
        runner = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for step in range(steps):
        x, y = _batch(step, cfg.vocab_size)
        loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return model, runner, torch.stack(losses)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), name


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("host_mirror", [False, True])
def test_streamed_fp32_training_equals_resident(name, host_mirror):
    make, cfg = MODELS[name]
    ref, _, ref_losses = _train(make, cfg, 4)
    model, runner, losses = _train(
        make, cfg, 4, granularity="module", prefetch_depth=1, host_mirror=host_mirror
    )
    assert torch.equal(losses, ref_losses)
    _same_weights(model, ref)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the masters stay home
    assert runner.engine.streamer.resident_bytes() == 0


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_device_weight_memory_within_the_plan_bound(depth):
    make, cfg = MODELS["llama"]
    _, runner, _ = _train(make, cfg, 2, granularity="module", prefetch_depth=depth)
    engine = runner.engine
    bound = engine.plan.weight_bound(depth)
    # The meter counts every device buffer the streamer made while it lived.
    assert 0 < engine.streamer.meter.peak_bytes <= bound


def test_the_copy_runs_on_its_own_stream_and_the_compute_waits_for_its_event():
    """A background fetch is issued on the copy stream and hands back an event that
    the compute stream waits on: the copy of unit k+1 can run while unit k computes."""
    make, cfg = MODELS["gpt"]
    torch.manual_seed(0)
    runner = cstorch.compile(make(cfg), backend="ws", device=DEVICE, granularity="module")
    x, _ = _batch(0, cfg.vocab_size)
    runner(x)  # plan fixed
    ops = runner.engine.ops
    compute = torch.accelerator.current_stream()
    host = torch.randn(1 << 20).pin_memory()
    transfer = ops.submit(lambda: [ops.copy_buffer(host)], background=True)
    (buf,) = transfer.wait()
    assert ops._copy_stream is not None and ops._copy_stream != compute
    torch.accelerator.synchronize()
    assert torch.equal(buf.cpu(), host)


def test_activation_checkpointing_is_exact_on_cuda():
    make, cfg = MODELS["llama"]
    _, _, plain = _train(make, cfg, 3, granularity="module")
    _, _, again = _train(make, cfg, 3, granularity="module", activation_checkpointing=True)
    assert torch.equal(plain, again)


def test_bf16_host_mirror_streams_two_bytes_a_parameter_and_trains_as_without_it():
    make, cfg = MODELS["gpt"]
    kw = {"granularity": "module", "compute_dtype": "bf16"}

    def train(mirror: bool):
        torch.manual_seed(0)
        model = make(cfg)
        runner = cstorch.compile(model, backend="ws", device=DEVICE, host_mirror=mirror, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(3):
            x, y = _batch(step, cfg.vocab_size)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = runner(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        return model, runner, torch.stack(losses)

    a, _, la = train(False)
    b, rb, lb = train(True)
    assert torch.equal(la, lb)
    _same_weights(a, b)
    params = sum(p.numel() for p in b.parameters())
    assert rb.engine.streamer.mirror_bytes() == 2 * params
    assert all(m.flat.is_pinned() for g in rb.engine.streamer._mirrors.values() for m in g.values())

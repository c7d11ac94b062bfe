"""Weight streaming on a CUDA device against eager PyTorch on it.

Every test here carries the ``cuda`` marker and is skipped where no CUDA device
exists (CI has none; sessions with a GPU run ``pytest -m cuda``, or
``scripts/gpu_check.sh``). The reference is eager PyTorch with the model resident
on the device and its optimizer on fp32 host copies of the weights (what a
streamed run does: the forward and backward on the device, the update on the
host), built from torch parts only. In fp32 the streamed run then computes the
same kernels on the same values, so losses and weights are compared bit for bit:
TF32 is off so that both runs use full fp32 products, and deterministic
algorithms are asked for (cuBLAS picks its algorithms by shape, not by where a
weight came from). A resident run whose optimizer also runs on the device is not
such a reference: CPU and CUDA kernels of AdamW round differently (measured: the
same losses to 4 digits, different weights after 4 steps).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.models import GPT, GPTConfig, Llama, LlamaConfig
from weightstream.runtime.device import DeviceOps

# Deterministic cuBLAS needs this before its first handle (read once per process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

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
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.use_deterministic_algorithms(deterministic)


def _batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (4, 32), generator=g)
    return x.to(DEVICE), torch.roll(x, -1, 1).to(DEVICE)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _reference(make, cfg, steps: int, make_opt=None, on_device: frozenset[str] = frozenset()):
    """(model, losses): eager PyTorch, the model resident on the device and the optimizer
    on fp32 host copies of its weights (the module docstring); the parameters named in
    ``on_device`` updated on the device by an optimizer of their own instead (a device
    tier's: Note [device tier] in runtime/placement.py)."""
    torch.manual_seed(0)
    host = make(cfg)
    resident = copy.deepcopy(host).to(DEVICE)
    named = dict(resident.named_parameters())  # a tied weight once
    pairs = [(h, named[n]) for n, h in host.named_parameters() if n not in on_device]
    make_opt = make_opt or _adamw
    parts = [[h for h, _ in pairs], [p for n, p in named.items() if n in on_device]]
    opts = [make_opt(part) for part in parts if part]  # a whole-model tier leaves no host part
    losses = []
    for step in range(steps):
        with torch.no_grad():
            for h, d in pairs:
                d.copy_(h)
        x, y = _batch(step, cfg.vocab_size)
        loss = _loss(resident(x), y)
        loss.backward()
        for h, d in pairs:
            h.grad, d.grad = (None if d.grad is None else d.grad.cpu()), None
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().cpu())
    with torch.no_grad():
        for h, d in pairs:
            d.copy_(h)
    return resident, torch.stack(losses)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _train(make, cfg, steps: int, optimizer_first: bool = False, **compile_kw):
    """(model, runner, losses): AdamW on the host masters of the streamed model, built
    after ``compile()`` (``optimizer_first``: before it, its state made on the host)."""
    torch.manual_seed(0)
    model = make(cfg)
    opt = _adamw(model.parameters()) if optimizer_first else None
    runner = cstorch.compile(model, backend="ws", device=DEVICE, **compile_kw)
    opt = opt or _adamw(model.parameters())
    losses = []
    for step in range(steps):
        x, y = _batch(step, cfg.vocab_size)
        loss = _loss(runner(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return model, runner, torch.stack(losses)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        p, q = p.detach().cpu(), q.detach().cpu()
        assert torch.equal(p, q), f"{name}: max |difference| {(p - q).abs().max().item():.3g}"


def _same_losses(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"losses {a.tolist()} against {b.tolist()}"


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("host_mirror", [False, True])
def test_streamed_fp32_training_equals_eager(name, host_mirror):
    make, cfg = MODELS[name]
    ref, ref_losses = _reference(make, cfg, 4)
    model, runner, losses = _train(
        make, cfg, 4, granularity="module", prefetch_depth=1, host_mirror=host_mirror
    )
    _same_losses(losses, ref_losses)
    _same_weights(model, ref)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the masters stay home
    assert runner.engine.streamer.resident_bytes() == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_updates_in_the_backward_equal_eager(name):
    """Each unit's host update starts as its gradient arrives (Note [updates in
    backward]); weightstream's AdamW against torch's with the same hyperparameters."""
    make, cfg = MODELS[name]
    torch_adamw = lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, eps=1e-6)  # noqa: E731
    ref, ref_losses = _reference(make, cfg, 4, torch_adamw)
    torch.manual_seed(0)
    model = make(cfg)
    runner = cstorch.compile(
        model, backend="ws", device=DEVICE, granularity="module", update_in_backward=True
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(4):
        x, y = _batch(step, cfg.vocab_size)
        losses.append(_loss(runner(x), y))
        cstorch.amp.optimizer_step(losses[-1], opt, None)
    _same_losses(torch.stack([loss.detach().cpu() for loss in losses]), ref_losses)
    _same_weights(model, ref)


def test_gradients_leave_the_device_from_pinned_memory_on_their_own_stream():
    """Note [gradients out]: the backward copies into page-locked host memory (never
    pageable memory) and the gradients reach the masters exactly."""
    make, cfg = MODELS["llama"]
    torch.manual_seed(0)
    model = make(cfg)
    runner = cstorch.compile(model, backend="ws", device=DEVICE, granularity="module")
    x, y = _batch(0, cfg.vocab_size)
    _loss(runner(x), y).backward()  # warm-up: plan, streams, host memory
    model.zero_grad()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _loss(runner(x), y).backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert any("DtoH (Device -> Pinned)" in n for n in names), sorted(names)
    assert not any("DtoH (Device -> Pageable)" in n for n in names)
    torch.manual_seed(0)
    ref = make(cfg).to(DEVICE)  # the same initial weights
    _loss(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad.cpu()), name


def _busy(ms_worth: int = 40) -> None:
    """Queue about ``ms_worth`` milliseconds of fp32 products on the current stream."""
    a = torch.randn(4096, 4096, device=DEVICE)
    out = torch.empty_like(a)
    for _ in range(ms_worth // 2):
        torch.mm(a, a, out=out)


def _copy_ends_before_the_compute(issue, settle, stream):
    """Event timing: ``issue()`` starts a copy on ``stream``, about 40 ms of products
    are queued behind it on the compute stream, ``settle`` takes what ``issue``
    returned; the copy must be done before the products are. Returns ``settle``'s."""
    _busy(2)
    torch.cuda.synchronize()
    start, compute_done, copy_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    pending = issue()
    _busy()
    compute_done.record()
    value = settle(pending)
    copy_done.record(stream)  # behind the copy in the side stream's queue
    torch.cuda.synchronize()
    assert start.elapsed_time(copy_done) < start.elapsed_time(compute_done)
    return value


def test_a_prefetch_copy_overlaps_the_compute_before_it():
    """A background copy from pinned memory, issued before a long run of kernels on
    the compute stream, is done before they are."""
    ops = DeviceOps(DEVICE)
    host = torch.randn(64 << 20).pin_memory()  # 256 MiB: about 5 ms at PCIe Gen5 speed
    (buf,) = _copy_ends_before_the_compute(
        lambda: ops.submit(lambda: [ops.copy_buffer(host)], background=True),
        lambda transfer: transfer.wait(),
        ops._copy_stream,
    )
    assert torch.equal(buf.cpu(), host)
    ops.close()


def test_gradients_copy_out_while_the_backward_computes():
    """Gradients handed to the host are copied on the gradient stream while later
    kernels run on the compute stream (Note [gradients out])."""
    ops = DeviceOps(DEVICE)
    grads = [torch.randn(16 << 20, device=DEVICE, dtype=torch.bfloat16), None]
    grads.append(torch.randn(3, 5, device=DEVICE, dtype=torch.bfloat16))
    expected = [None if g is None else g.float().cpu() for g in grads]

    def issue():
        out = ops.grads_to_host(grads, [torch.float32] * 3, key=0)
        grads.clear()  # autograd drops its gradients: the copies must still read them
        return out

    host = _copy_ends_before_the_compute(
        issue,
        lambda out: out.take(),
        ops._grad_stream,
    )
    assert host[1] is None
    for h, e in zip(host, expected):
        assert h is None or (h.dtype == torch.float32 and torch.equal(h, e))
    ops.close()


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
    # Each unit's mirror holds its weights, a tied one in both of its units.
    params = sum(p.numel() for u in rb.engine.plan.units for p in u.params)
    assert params > sum(p.numel() for p in b.parameters())  # GPT's head is tied
    assert rb.engine.streamer.mirror_bytes() == 2 * params
    assert all(m.flat.is_pinned() for g in rb.engine.streamer._mirrors.values() for m in g.values())


def test_gradients_never_taken_leave_the_later_ones_exact():
    """A backward that fails between a unit's device node and its host node drops the
    gradients on their way: the copies still land in the unit's memory, ordered before
    any later copy, so the next gradients of that unit arrive exact, and the in-flight
    bound holds (Note [gradients out])."""
    ops = DeviceOps(DEVICE)
    grad = torch.randn(1 << 20, device=DEVICE, dtype=torch.bfloat16)
    for i in range(3 * ops.GRADS_IN_FLIGHT):
        ops.grads_to_host([grad * i], [torch.float32], key=0)  # dropped at once
        assert len(ops._grads_in_flight) <= ops.GRADS_IN_FLIGHT
    (host,) = ops.grads_to_host([grad], [torch.float32], key=0).take()
    assert torch.equal(host, grad.float().cpu())
    ops.close()


def test_gradient_and_mirror_memory_is_page_locked_at_its_exact_size():
    """The caching host allocator rounds pinned requests up to a power of two; the
    gradients' and the mirror's memory is registered at its size (Note [gradients out])."""
    ops = DeviceOps(DEVICE)
    nbytes = (3 << 20) + 64  # rounded, it would be 4 MiB
    buf = ops.pinned_bytes(nbytes)
    assert buf.is_pinned() and buf.untyped_storage().nbytes() < (4 << 20)
    mirror = ops.host_empty(nbytes // 2, torch.bfloat16)
    assert mirror.is_pinned() and mirror.untyped_storage().nbytes() < (4 << 20)
    # A device-to-host copy into it is asynchronous and exact.
    src = torch.randn(nbytes // 4, device=DEVICE)
    buf.view(torch.float32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf.view(torch.float32), src.cpu())
    del buf, mirror
    ops.close()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offload_is_exact_and_frees_device_memory(checkpointing, monkeypatch):
    """Note [activation offload]: training with the saved activations in host memory
    equals training without; the forward's device memory peak drops; the records are
    page-locked."""
    from weightstream.runtime import offload as offload_module

    monkeypatch.setattr(offload_module, "MIN_BYTES", 0)  # the test model's are small
    make, cfg = MODELS["llama"]
    kw = {"granularity": "module", "activation_checkpointing": checkpointing}
    _, _, plain = _train(make, cfg, 3, **kw)
    _, runner, offloaded = _train(make, cfg, 3, activation_offload=True, **kw)
    _same_losses(plain, offloaded)
    assert runner.engine.streamer.offload.bytes_out > 0

    def forward_peak(**extra):
        torch.manual_seed(0)
        model = make(cfg)
        runner = cstorch.compile(model, backend="ws", device=DEVICE, **kw, **extra)
        x, y = _batch(0, cfg.vocab_size)
        runner(x)  # plan fixed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = _loss(runner(x), y)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base  # what the graph keeps until backward
        offload = runner.engine.streamer.offload
        records = [] if offload is None else [r() for r in offload._records]
        assert all(r.host.is_pinned() for r in records)
        loss.backward()
        return held, len(records)

    held_plain, _ = forward_peak()
    held_off, records = forward_peak(activation_offload=True)
    assert records > 0 and held_off < held_plain


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["optimizer-after", "before"])
@pytest.mark.parametrize("part", ["some", "all"])
def test_the_device_tier_equals_eager_with_its_updates_on_the_device(part, optimizer_first):
    """Units of the device tier keep masters, gradients and AdamW state on the GPU and
    are updated there by the same (single-tensor) AdamW as the reference's device part;
    the other units stream as always: bit for bit in fp32. An optimizer built before
    ``compile()`` made its state on the host: the tier's share moves to the GPU when it
    binds (it used to stay there, and the first step failed on mixed devices)."""
    make, cfg = MODELS["gpt"]
    budget = 200_000 if part == "some" else 2**40
    model, runner, losses = _train(
        make, cfg, 4, optimizer_first, granularity="module", device_tier_budget=budget
    )
    resident = runner.engine.resident
    assert resident and (part == "all") == (len(resident) == len(runner.plan.units))
    tier = {id(p) for i in resident for p in runner.plan.units[i].params}
    on_device = {n for n, p in model.named_parameters() if id(p) in tier}
    assert all(p.device.type == "cuda" for p in model.parameters() if id(p) in tier)
    assert all(p.device.type == "cpu" for p in model.parameters() if id(p) not in tier)
    ref, ref_losses = _reference(make, cfg, 4, on_device=frozenset(on_device))
    _same_losses(losses, ref_losses)
    _same_weights(model, ref)

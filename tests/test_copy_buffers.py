"""The CPU's recycled copy buffers (Note [CPU copy buffers] in runtime/device.py).

A storage may go back to the pool only when nothing can read it any more; the
tests hold views in the ways a model or a user does (a view, a view saved by
autograd, a weight kept by a forward hook) and check that what they hold is
never overwritten, and that training stays bitwise equal to eager PyTorch with
units large enough to be pooled.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import weightstream as cstorch
from weightstream.runtime.device import CopyBuffers

MiB = 2**20


def _pool(count=2, nbytes=4 * MiB) -> CopyBuffers:
    pool = CopyBuffers()
    pool.keep(count, nbytes)
    return pool


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_storage_comes_back_only_when_its_last_view_dies():
    pool = _pool()
    a = pool.empty(MiB, torch.float32)  # 4 MiB
    ptr = _ptr(a)
    view = a[10:20].view(2, 5)
    del a
    gc.collect()
    assert pool.idle_bytes == 0  # the view still reads it
    b = pool.empty(MiB, torch.float32)
    assert _ptr(b) != ptr
    del view
    gc.collect()
    assert pool.idle_bytes == 4 * MiB
    c = pool.empty(MiB // 2, torch.float32)  # any copy fits a pooled storage
    assert _ptr(c) == ptr and c.numel() == MiB // 2
    assert pool.allocated == 2


def test_a_view_saved_by_autograd_keeps_its_storage_out():
    pool = _pool()
    a = pool.empty(MiB, torch.float32)
    a.fill_(2.0)
    ptr = _ptr(a)
    x = torch.ones(5, requires_grad=True)
    y = (x * a[:5]).sum()  # mul saves its operand a[:5]
    del a
    gc.collect()
    other = pool.empty(MiB, torch.float32)
    assert _ptr(other) != ptr
    other.fill_(-1.0)
    y.backward()
    assert torch.equal(x.grad, torch.full((5,), 2.0))
    gc.collect()
    del y
    gc.collect()
    assert pool.idle_bytes == 4 * MiB


def test_the_pool_keeps_at_most_count_storages_and_serves_small_or_large_requests_apart():
    pool = _pool(count=1)
    held = [pool.empty(MiB, torch.float32) for _ in range(3)]  # more alive than count
    assert pool.allocated == 3
    del held
    gc.collect()
    assert pool.idle_bytes == 4 * MiB  # one kept, two given back to the allocator
    small = pool.empty(16, torch.float32)  # under CopyBuffers.SMALL: not pooled
    large = pool.empty(2 * MiB, torch.float32)  # over the pooled size: not pooled
    assert pool.allocated == 3 and small.numel() == 16 and large.numel() == 2 * MiB
    pool.keep(0, 0)
    assert pool.idle_bytes == 0


class _Wide(nn.Module):
    """Four 1024x1024 layers (4 MiB each in fp32): units large enough to be pooled."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))
        self.head = nn.Linear(1024, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _train(model, runner, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 1024, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = F.cross_entropy(runner(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_streamed_training_with_pooled_copies_matches_eager_bitwise(depth):
    torch.manual_seed(0)
    eager = _Wide()
    torch.manual_seed(0)
    model = _Wide()
    runner = cstorch.compile(model, backend="ws", prefetch_depth=depth, granularity="module")
    assert _train(model, runner) == _train(eager, eager)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q)
    pool = runner.engine.ops._buffers
    # Recycled: as many storages as copies may be in flight, made in the first step.
    assert pool.nbytes == runner.engine.plan.largest_unit_bytes
    assert pool.allocated <= depth + 1
    made = pool.allocated
    _train(model, runner, steps=2)
    assert pool.allocated == made


@pytest.mark.parametrize("how", ["as is", "detached"])
def test_a_weight_kept_by_a_hook_is_never_overwritten(how):
    """A hook keeps the weight, or a detached alias of it (which shares the storage
    but not the handed-out tensor: only the storage's use count sees it)."""
    torch.manual_seed(0)
    model = _Wide()
    runner = cstorch.compile(model, backend="ws", prefetch_depth=0, granularity="module")
    kept = []
    keep = (lambda w: w) if how == "as is" else (lambda w: w.detach())
    for layer in model.layers:
        layer.register_forward_hook(lambda m, _args, _out: kept.append(keep(m.weight)))
    expected = [layer.weight.detach().clone() for layer in model.layers]
    loss = runner(torch.randn(2, 1024)).sum()
    loss.backward()
    del loss
    gc.collect()
    runner(torch.randn(2, 1024))  # another pass over the same units
    assert len(kept) == 8
    for seen, want in zip(kept[:4], expected):
        assert torch.equal(seen, want)

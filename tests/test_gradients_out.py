"""The host side of an accelerator's gradient hand-over, on the CPU (Note [gradients
out] in runtime/device.py): the packed layout of a unit's gradients in recycled host
memory, and autograd taking those tensors as ``.grad`` without a copy. The device
side (the cast and copy on the gradient stream, page-locked memory) is tested in
test_cuda.py."""

from __future__ import annotations

import torch

from weightstream.runtime.device import HostGrads, StoragePool, _packed_bytes, _packed_views


def _arrived(pool, key, *grads):
    """A unit's gradients as the device side leaves them: cast to fp32 into the
    unit's packed host memory (no event: the CPU copies synchronously)."""
    like = [None if g is None else (g.shape, torch.float32) for g in grads]
    host = _packed_views(pool.empty(key, _packed_bytes(like), torch.uint8), like)
    for g, h in zip(grads, host):
        if g is not None:
            h.copy_(g)
    return HostGrads(host, None)


def test_a_unit_s_gradients_share_one_storage_and_missing_ones_stay_missing():
    pool = StoragePool(per_key=2)
    bf16 = torch.randn(7, 3).to(torch.bfloat16)
    fp32 = torch.randn(5)
    out = _arrived(pool, 0, bf16, None, fp32).take()
    assert out[1] is None
    assert out[0].dtype == torch.float32 and torch.equal(out[0], bf16.float())
    assert torch.equal(out[2], fp32)
    assert out[0].is_contiguous() and out[2].is_contiguous()
    # Both in one kept storage, each view aligned for its dtype.
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    assert out[2].data_ptr() % 64 == 0


def test_a_write_to_one_gradient_of_a_unit_leaves_the_others_versions():
    """Autograd's version counter is shared by views: the unit's gradients are tensors of
    their own over the one storage, so the sharded store's check (Note [changed after the
    reduce]) sees a write to one gradient as that gradient's alone. On CUDA two ranks were
    stopped at every step, each unit's gradients but the last written "changed"."""
    pool = StoragePool(per_key=2)
    out = _arrived(pool, 0, torch.randn(4, 3), torch.randn(5), torch.randn(2)).take()
    versions = [g._version for g in out]
    out[1].copy_(torch.ones(5))  # as the reducer puts a mean into one .grad
    assert [g._version for g in out] == [versions[0], versions[1] + 1, versions[2]]
    assert torch.equal(out[1], torch.ones(5))
    assert len({g.untyped_storage().data_ptr() for g in out}) == 1


def test_memory_is_handed_out_again_only_when_nothing_shares_it():
    pool = StoragePool(per_key=2)
    first = pool.empty("unit", 1024, torch.uint8)
    ptr = first.data_ptr()
    alias = first[100:200].detach()  # as autograd's AccumulateGrad keeps a .grad
    del first
    second = pool.empty("unit", 1024, torch.uint8)
    assert second.data_ptr() != ptr  # the alias still shares the first storage
    del alias
    third = pool.empty("unit", 1024, torch.uint8)
    assert third.data_ptr() == ptr  # nothing shares it now
    assert pool.empty("other unit", 1024, torch.uint8).data_ptr() not in (ptr, second.data_ptr())
    assert pool.kept_bytes() == 3 * 1024
    # Past per_key busy storages the allocator serves, and nothing more is kept.
    extra = pool.empty("unit", 1024, torch.uint8)
    assert extra.data_ptr() not in (ptr, second.data_ptr())
    assert pool.kept_bytes() == 3 * 1024
    # A larger request replaces an idle smaller storage.
    del second, third, extra
    big = pool.empty("unit", 4096, torch.uint8)
    assert pool.kept_bytes() == 4096 + 1024 + 1024
    assert big.numel() == 4096


class _HandBack(torch.autograd.Function):
    """Gives ``w`` the gradient of its output through a HostGrads, as the host node
    of the hand-over does."""

    @staticmethod
    def forward(ctx, pool, w):
        ctx.pool = pool
        return w.detach().to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        (grad,) = _arrived(ctx.pool, "w", g).take()
        return None, grad


def test_autograd_takes_the_tensors_as_grad_and_the_memory_comes_back_each_step():
    pool = StoragePool(per_key=2)
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(8, 64, dtype=torch.bfloat16)

    def backward():
        (x @ _HandBack.apply(pool, w)).float().sum().backward()

    backward()
    first = w.grad.untyped_storage().data_ptr()
    expected = w.grad.clone()
    # Taken as it is: .grad lives in the pool's storage (no copy by AccumulateGrad).
    assert pool.kept_bytes() == w.grad.untyped_storage().nbytes()
    w.grad = None  # zero_grad(set_to_none=True)
    backward()
    assert w.grad.untyped_storage().data_ptr() == first  # the same memory again
    assert torch.equal(w.grad, expected)
    # Accumulation: the second gradient is added into .grad, then its memory is free.
    backward()
    assert torch.equal(w.grad, expected + expected)
    assert w.grad.untyped_storage().data_ptr() == first
    assert pool.kept_bytes() == 2 * w.grad.untyped_storage().nbytes()


def test_a_pool_makes_its_memory_with_the_allocator_it_is_given():
    made = []

    def alloc(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = StoragePool(per_key=1, alloc=alloc)
    a = pool.empty("unit", 100, torch.float32, size=1000)
    assert made == [1000] and a.numel() == 100
    del a
    pool.empty("unit", 200, torch.float32)  # fits the idle storage: nothing made
    assert made == [1000]

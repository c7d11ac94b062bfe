"""SwarmX: data parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

Every rank runs every layer on its share of the global batch. Before the
optimizer step the gradients of all ranks are reduced (averaged: each rank's
loss is a mean over its share, and the shares are equal, so the mean of the
ranks' gradients is the gradient of the global mean loss); every rank then
applies the same update to its own copy of the store, so the copies stay equal
(the replicated store). Losses for logging are averaged the same way.

The transport is torch.distributed only. A rank that dies makes the others'
next collective fail (gloo reports the closed connection) or time out after
``WEIGHTSTREAM_DIST_TIMEOUT`` seconds (default 60); the launcher
(:mod:`weightstream.cli.launch`) then stops the run and names the rank.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# Gradients travel in flat buckets of about this many bytes: fewer, larger
# collectives than one per tensor, without a second full copy of the gradients.
BUCKET_BYTES = 32 * 2**20


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by the torchrun environment, if there is one."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    timeout = datetime.timedelta(seconds=float(os.environ.get("WEIGHTSTREAM_DIST_TIMEOUT", "60")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)
    return True


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def average_gradients(params) -> None:
    """All-reduce the gradients of ``params`` to their mean over the ranks (in place)."""
    n = world_size()
    if n == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= BUCKET_BYTES:
            _reduce_bucket(bucket, n)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, n)


def _reduce_bucket(grads: list[torch.Tensor], n: int) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # host sync point
        flat.div_(n)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over the ranks (a copy; ``value`` itself with one rank)."""
    if world_size() == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)  # host sync point
    return out


def average(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over the ranks (``value`` itself with one rank)."""
    if world_size() == 1:
        return value
    return sum_over_ranks(value) / world_size()


def clip_grad_norm_sharded_(
    params, max_norm: float, replicated=(), eps: float = 1e-6
) -> torch.Tensor:
    """``clip_grad_norm_`` over gradients spread across the ranks (a sharded store).

    Each rank holds the gradients of the masters it owns; the global norm is the
    square root of the sum over ranks of each rank's sum of squares. Gradients
    of ``replicated`` parameters are equal on every rank and count once (rank
    0's). Returns the global norm, as torch's function does.
    """
    replicated_ids = {id(p) for p in replicated}
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    for p, g in ((p, p.grad) for p in params if p.grad is not None):
        if id(p) in replicated_ids and rank() != 0:
            continue
        total = total + torch.sum(torch.square(g.detach().float()))
    norm = torch.sqrt(sum_over_ranks(total))
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return norm


def all_gather_objects(obj) -> list:
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers equal to rank 0's."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

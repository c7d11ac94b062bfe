"""The sharded store on a CUDA device, two ranks sharing one GPU (Note [sharded store] in
runtime/sharding.py, Note [ranks sharing a device] in runtime/swarm.py).

Two ranks started as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE) see one GPU, so ``cstorch.compile`` joins them with gloo alone
(NCCL refuses two ranks on one GPU) and puts both on it. Each trains half of every
batch with ``store_sharding="sharded"``: each rank keeps the masters and optimizer
state of its own units, fetches broadcast host buffers over gloo and copy them to
the device, and the gradients are reduced to their owners. Rank 1 builds its model
from another seed, with another buffer: the build must broadcast rank 0's weights
and its device buffer (through a host copy on gloo). The trained weights must equal
one rank streaming the whole batch (with the same device tier) and eager PyTorch
(the model resident on the device, torch.optim.AdamW on host fp32 copies, the
tier's parameters updated on the device: tests/test_cuda.py's reference).

The ``cuda`` case needs a GPU (``pytest -m cuda``, or ``scripts/gpu_check.sh``). The
``cpu`` case runs the same script on the CPU everywhere, so the test itself is
checked where no GPU is.

Tolerance: that of tests/test_sharded_clipping.py, the same model, data,
optimizer and steps, for its reason: two ranks sum the per-sample gradients in
another order than one (each half's mean, then the mean of the two), and AdamW
carries the last bits into the weights at the scale of an update. Measured on the
CPU: losses within 9.7e-8 relative, weights within 3.0e-8 (one rank equals eager
bit for bit there). Wrong runs are far outside: rank 1's own initial weights are
up to 0.78 away from rank 0's, and training on one half of each batch moves the
weights 5.7e-2 from eager's.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Deterministic cuBLAS needs this before its first handle (read once per process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

WEIGHT_ATOL = 2e-6
LOSS_RTOL = 1e-5
STEPS, BATCH, WIDTH = 3, 8, 16
WORLD = 2
# A unit (Linear(16, 16)): masters, gradients and AdamW's two moments 4 x 1,088 bytes,
# its 2 step scalars 8 bytes: 4,360 bytes. This budget holds 2 of the 4 units.
TIER_BUDGET = 2 * 4_360

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


class _Scale(nn.Module):
    """Multiplies by a buffer, which lives on the device (the engine broadcasts it)."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, _Scale(torch.rand(WIDTH) + 0.5))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
        for _ in range(STEPS)
    ]


def _full_fp32_products() -> None:
    """Full fp32 products and deterministic kernels (tests/test_cuda.py's reason)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


@pytest.fixture
def full_fp32_products():
    """:func:`_full_fp32_products` in this process, as it was afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    deterministic = torch.are_deterministic_algorithms_enabled()
    _full_fp32_products()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.use_deterministic_algorithms(deterministic)


def _adamw(params, cstorch=None):
    if cstorch is None:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False)
    # torch.optim.AdamW's eps (the reference API's default is 1e-6).
    return cstorch.optim.AdamW(params, lr=1e-2, eps=1e-8, weight_decay=0.01)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, port: int, out: str, device: str, budget: int | None) -> None:
    """One rank of two, joined by the engine from the torchrun environment."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
    )
    import torch.distributed as dist

    import weightstream as cstorch
    from weightstream.runtime import swarm

    torch.set_num_threads(1)
    _full_fp32_products()
    model = _model(seed=rank)  # rank 1 starts elsewhere: the build broadcasts rank 0's
    optimizer = _adamw(model.parameters(), cstorch)
    compiled = cstorch.compile(
        model,
        backend="wse_ws",
        device=device,
        granularity="module",
        store_sharding="sharded",
        device_tier_budget=budget,
    )
    try:
        shards = compiled.engine.store.replicas
        share = BATCH // WORLD
        losses = []
        for x, y in _batches():
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
            loss = F.mse_loss(compiled(x.to(device)), y.to(device))
            loss.backward()  # SwarmX reduces each unit's gradients to its owner
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # A collective on a device tensor (the run command's loss log does the same).
            losses.append(swarm.average(loss.detach()).item())
        state = _state(model)  # collective: the whole model on every rank
        if rank == 0:
            torch.save(state, Path(out, "sharded.pt"))
        record = {
            "backend": str(dist.get_backend()),
            "device": str(compiled.engine.device),
            "sharded": shards.sharded,
            "owned": [n for n, p in model.named_parameters() if shards.owns(p)],
            "tier": sorted(compiled.engine.resident),
            "tier_devices": sorted(
                {
                    str(p.device)
                    for i in compiled.engine.resident
                    for p in compiled.plan.units[i].params
                }
            ),
            "losses": losses,
        }
        compiled.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _two_ranks(out: Path, device: str, budget: int | None) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as env:
        if device == "cuda":
            # One GPU for both ranks, whatever the machine has. In the environment the
            # ranks start with: CUDA reads it once, at its first use (this module's
            # import in each rank asks torch.cuda.is_available()).
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            env.setenv("CUDA_VISIBLE_DEVICES", visible)
        args = (port, str(out), device, budget)
        mp.start_processes(_rank, args=args, nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _one_rank(device: str, budget: int | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process streaming the whole batch (no torchrun environment: no ranks), with
    the same device tier."""
    import weightstream as cstorch

    model = _model(seed=0)
    optimizer = _adamw(model.parameters(), cstorch)
    compiled = cstorch.compile(
        model, backend="wse_ws", device=device, granularity="module", device_tier_budget=budget
    )
    losses = []
    for x, y in _batches():
        loss = F.mse_loss(compiled(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = _state(model)
    compiled.close()
    return state, losses


def _eager(device: str, on_device: frozenset[str] = frozenset()):
    """Eager PyTorch: the model resident on ``device``, AdamW on host fp32 copies; the
    parameters named in ``on_device`` (a device tier's) updated on the device by an
    AdamW of their own, as tests/test_cuda.py's reference does: the device's kernels
    round otherwise than the host's."""
    host = _model(seed=0)
    resident = copy.deepcopy(host).to(device)
    named = list(zip(host.named_parameters(), resident.parameters()))
    pairs = [(h, d) for (n, h), d in named if n not in on_device]
    parts = [[h for h, _ in pairs], [d for (n, _), d in named if n in on_device]]
    optimizers = [_adamw(part) for part in parts if part]
    losses = []
    for x, y in _batches():
        with torch.no_grad():
            for h, d in pairs:
                d.copy_(h)
        loss = F.mse_loss(resident(x.to(device)), y.to(device))
        loss.backward()
        for h, d in pairs:
            h.grad, d.grad = d.grad.cpu(), None
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        for h, d in pairs:
            d.copy_(h)
    return _state(resident), losses


# 8 s each on the CPU, with the slow tests: two ranks sharing one device are an
# accelerator's case.
@pytest.mark.slow
@pytest.mark.parametrize("tier", [False, True], ids=["streamed", "device-tier"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_on_one_device_with_a_sharded_store_equal_one_rank_and_eager(
    tmp_path, device, tier, full_fp32_products
):
    """With ``tier``, a device tier of 2 of the 4 units (TIER_BUDGET) that both ranks hold
    whole, on the device, while the other 2 stay sharded on the host."""
    budget = TIER_BUDGET if tier else None
    records = _two_ranks(tmp_path, device, budget)
    # Joined with gloo alone (on CUDA: two ranks, one GPU), both on the one device.
    assert [r["backend"] for r in records] == ["gloo"] * WORLD
    want_device = "cpu" if device == "cpu" else "cuda:0"
    assert [r["device"] for r in records] == [want_device] * WORLD
    # Sharded: each rank owns some of the units, every parameter has one owner.
    owned = [set(r["owned"]) for r in records]
    names = {n for n, _ in _model(seed=0).named_parameters()}
    assert all(r["sharded"] for r in records)
    # The tier's units (the ends of the order: Note [device tier]) are every rank's.
    tier = {f"{i}.{k}" for i in (0, 6) for k in ("weight", "bias")} if tier else set()
    assert [r["tier"] for r in records] == [[0, 3] if tier else []] * WORLD
    assert [r["tier_devices"] for r in records] == [[want_device] if tier else []] * WORLD
    assert all(owned) and owned[0] & owned[1] == tier and owned[0] | owned[1] == names
    # Both ranks log the same mean loss of the global batch.
    assert records[0]["losses"] == records[1]["losses"]
    got = torch.load(tmp_path / "sharded.pt")
    for what, (want, want_losses) in {
        "one rank": _one_rank(device, budget),
        "eager": _eager(device, frozenset(tier)),
    }.items():
        torch.testing.assert_close(
            torch.tensor(records[0]["losses"]),
            torch.tensor(want_losses),
            rtol=LOSS_RTOL,
            atol=0,
            msg=lambda m, label=f"losses against {what}": f"{label}: {m}",
        )
        assert set(got) == set(want), what
        for key, w in want.items():
            torch.testing.assert_close(
                got[key],
                w,
                rtol=0,
                atol=WEIGHT_ATOL,
                msg=lambda m, label=f"{what} {key}": f"{label}: {m}",
            )

"""A plain PyTorch loop that clips, on a sharded store (Note [changed after the reduce]).

``loss.backward(); clip(...); optimizer.step()`` on 2 ranks, each with half of
the global batch, against eager PyTorch on one process with the whole batch,
torch.optim.AdamW and torch's own clipping. On a sharded store each rank holds
only its units' gradients, so torch's ``clip_grad_norm_`` would clip by one
shard's norm: the step must stop with the error that names the fix and leave
the masters and the optimizer state as they were. The compiled module's
``clip_grad_norm_`` (2-norm and inf-norm) and ``clip_grad_value_`` clip by the
whole model and must match eager; so must torch's function on a replicated
store, where every rank holds every gradient.

Tolerance: that of tests/test_distributed.py and test_data_parallel_api.py,
for their reason (2 ranks sum the per-sample gradients in another order than
one process; clipping and AdamW carry the last bits into the weights at the
scale of an update). Clipping by a shard's norm instead moves these weights
by about 1e-3, far outside it.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

WEIGHT_ATOL = 2e-6
STEPS, BATCH, WIDTH = 3, 8, 16
MAX_NORM = 0.05  # far below the gradients' norm: every step clips

# A unit (Linear(16, 16)) holds 272 parameters: masters, gradients and AdamW's two
# moments 4 x 1,088 bytes, its 2 step scalars 8: 4,360 bytes. The device tier then
# takes 2 of the 4 units, every rank holding them whole (Note [sharded store]).
TIER_BUDGET = 2 * 4_360
PARAMS = 8  # each counted once in the error, a device tier's too

# name -> (store_sharding, clipping, device_tier_budget)
CASES = {
    "sharded-torch": ("sharded", "torch", None),
    "sharded-compiled": ("sharded", "compiled", None),
    "sharded-compiled-inf": ("sharded", "compiled-inf", None),
    "sharded-compiled-value": ("sharded", "compiled-value", None),
    "replicated-torch": ("replicated", "torch", None),
    # torch.optim's own step() does not come through the engine: checked before it
    # (torch's optimizer step pre-hook), stopped as weightstream's; exact with the
    # compiled module's clipping.
    "sharded-torch-optim": ("sharded", "torch", None),
    "sharded-compiled-torch-optim": ("sharded", "compiled", None),
    # Half the units on every rank's device tier, the other half sharded: each
    # gradient counted once in the norm, the tier's changed by torch's clip caught too.
    "sharded-tier-torch": ("sharded", "torch", TIER_BUDGET),
    "sharded-tier-compiled": ("sharded", "compiled", TIER_BUDGET),
    "sharded-tier-compiled-inf": ("sharded", "compiled-inf", TIER_BUDGET),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
        for _ in range(STEPS)
    ]


def _clip(clipping: str, params, compiled=None) -> None:
    if clipping == "torch":
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    elif clipping == "compiled":
        compiled.clip_grad_norm_(MAX_NORM)
    elif clipping == "compiled-inf":
        compiled.clip_grad_norm_(MAX_NORM / 10, norm_type=float("inf"))
    elif clipping == "compiled-value":
        compiled.clip_grad_value_(MAX_NORM / 10)
    else:
        raise AssertionError(clipping)


def _eager(clipping: str) -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch.optim.AdamW and torch's own clipping."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in _batches():
        F.mse_loss(model(x), y).backward()
        params = list(model.parameters())
        if clipping == "compiled-inf":
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM / 10, norm_type=float("inf"))
        elif clipping == "compiled-value":
            torch.nn.utils.clip_grad_value_(params, MAX_NORM / 10)
        else:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(compiled, model, optimizer, clipping: str, rank: int, share: int) -> str | None:
    """The plain loop; the error message that stopped it, or None."""
    for x, y in _batches():
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        F.mse_loss(compiled(x), y).backward()
        _clip(clipping, list(model.parameters()), compiled)
        try:
            optimizer.step()
        except RuntimeError as exc:
            return str(exc)
        optimizer.zero_grad(set_to_none=True)
    return None


def _adamw(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    import weightstream as cstorch

    if name.endswith("-torch-optim"):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # torch.optim.AdamW's eps and weight decay (the reference API's defaults are 1e-6 and 0).
    return cstorch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import weightstream as cstorch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    share = BATCH // world
    record = {}
    try:
        for name, (sharding, clipping, budget) in CASES.items():
            model = _model()
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            # With a tier: built after the engine, so a rank's state of the units another
            # rank owns starts as placeholders, which the tier's placement must replace
            # by the owner's values (ShardedStore.replicate).
            optimizer = _adamw(name, model) if budget is None else None
            compiled = cstorch.compile(
                model,
                backend="wse_ws",
                device="cpu",
                granularity="module",
                store_sharding=sharding,
                device_tier_budget=budget,
            )
            optimizer = optimizer or _adamw(name, model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                error = _train(compiled, model, optimizer, clipping, rank, share)
            unchecked = [str(w.message) for w in caught if "without coming" in str(w.message)]
            state = model.state_dict()  # collective: the whole model on every rank
            unchanged = all(torch.equal(state[k], before[k]) for k in before)
            if rank == 0:
                torch.save(state, Path(out, f"{name}.pt"))
            record[name] = {
                "error": error,
                "tier": sorted(compiled.engine.resident),
                # Every rank's own copy of the tier's units: the same bits on each.
                "tier_values": [
                    v
                    for i in sorted(compiled.engine.resident)
                    for p in compiled.plan.units[i].params
                    for t in (p, *optimizer.state[p].values())
                    for v in t.detach().flatten().tolist()
                ],
                "unchanged": unchanged,
                "unchecked_warnings": unchecked,
                # The optimizer state's values (AdamW's step counts and moments): all
                # zero until a step is applied.
                "optimizer_state": sum(
                    float(v.abs().sum())
                    for entry in optimizer.state.values()
                    for v in entry.values()
                    if isinstance(v, torch.Tensor)
                ),
            }
            compiled.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("clip")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, str(out)), nprocs=2, start_method="spawn")
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", ["sharded-torch", "sharded-tier-torch", "sharded-torch-optim"])
def test_torch_clip_on_a_sharded_store_stops_the_step_with_the_fix_and_changes_nothing(
    two_ranks, name
):
    _, records = two_ranks
    for record in records:  # both ranks stop, the one owning fewer changed gradients too
        got = record[name]
        assert got["error"] is not None
        assert f"{PARAMS} gradient(s) were changed after SwarmX reduced them" in got["error"]
        assert "compiled.clip_grad_norm_" in got["error"]
        assert "store_sharding='replicated'" in got["error"]
        # The first step stopped before any update: masters as built, state untouched.
        assert got["unchanged"] and got["optimizer_state"] == 0


@pytest.mark.parametrize(
    "name",
    [
        "sharded-compiled",
        "sharded-compiled-inf",
        "sharded-compiled-value",
        "sharded-compiled-torch-optim",
        "replicated-torch",
        "sharded-tier-compiled",
        "sharded-tier-compiled-inf",
    ],
)
def test_clipping_by_the_whole_model_on_two_ranks_equals_eager_pytorch(two_ranks, name):
    out, records = two_ranks
    assert all(r[name]["error"] is None and not r[name]["unchanged"] for r in records)
    tiers = [r[name]["tier"] for r in records]
    # the ends of the order (Note [device tier]): the first unit is rank 0's, the last rank 1's
    assert tiers == ([[0, 3], [0, 3]] if "tier" in name else [[], []])
    values = [r[name]["tier_values"] for r in records]
    assert values[0] == values[1] and (len(values[0]) > 0) == ("tier" in name)
    got = torch.load(out / f"{name}.pt")
    want = _eager(CASES[name][1])
    assert set(got) == set(want)
    for key, w in want.items():
        torch.testing.assert_close(got[key], w, rtol=0, atol=WEIGHT_ATOL, msg=key)


def test_a_shards_own_norm_would_be_far_outside_the_tolerance():
    """The test above can fail: clipping each half of the model by its own norm moves
    the weights by orders of magnitude more than WEIGHT_ATOL."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    params = list(model.parameters())
    for x, y in _batches():
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params[:4], MAX_NORM)
        torch.nn.utils.clip_grad_norm_(params[4:], MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    want = _eager("torch")
    worst = max((model.state_dict()[k] - w).abs().max().item() for k, w in want.items())
    assert worst > 100 * WEIGHT_ATOL


def test_no_run_warns_that_a_step_went_unchecked(two_ranks):
    """torch.optim's step is checked like weightstream's (above), so the next forward's
    warning of an update that escaped the check says nothing in any of these runs."""
    _, records = two_ranks
    for record in records:
        assert all(not r["unchecked_warnings"] for r in record.values())

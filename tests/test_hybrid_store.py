"""The disk store's RAM tier (Note [hybrid placement] in runtime/placement.py).

Under ``host_memory_budget`` the disk store keeps in RAM what saves the most
disk traffic a step (masters first, then optimizer state, then gradients) and
the rest in its files; where a tensor lives never changes a bit of the result.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from test_disk_store import CFG, _assert_same_training, _batch, _train

from weightstream.common.pages import is_store_mapped
from weightstream.runtime import placement
from weightstream.runtime.budgets import UPDATE_BYTES_PER_WEIGHT_BYTE


def test_prediction_fills_ram_with_masters_then_state_then_gradients():
    # Three masters of 100, 50 and 10 bytes; 400 bytes of RAM: all masters (160),
    # then AdamW's two moments in parameter order while they fit: 100 + 100 (360),
    # 50 does not fit, 10 + 10 do (380); then gradients: the 10-byte one fits (390).
    got = placement.predict([100, 50, 10], capacity=400)
    assert got.ram == {"master": 160, "state": 220, "grad": 10}
    assert got.disk == {"state": 100, "grad": 150}
    # A byte of state or gradient on disk moves 2 bytes a step, a master 4.
    assert got.disk_bytes_per_step == 2 * 100 + 2 * 150
    none = placement.predict([100, 50, 10], capacity=0)
    assert none.disk_bytes_per_step == 4 * 160 + 2 * 320 + 2 * 160
    assert none.ram_bytes == 0


def test_a_kind_that_partly_fits_is_spread_over_the_units():
    # Eight equal masters, room for four moments of the sixteen: every other
    # master keeps one in RAM (a unit's update reads about the same from the files
    # as the next one's), not the first two masters both.
    got = placement.PlacementPlan(dict.fromkeys(range(8), 10), capacity=8 * 10 + 4 * 10)
    kept = [sum(got._state_left[k]) for k in range(8)]  # bytes granted a master
    assert sum(kept) == 40 and max(kept) == 10
    assert all(sum(kept[i : i + 4]) == 20 for i in range(0, 8, 4))
    # Unequal sizes: never more than the room, and rounding's leftovers are used.
    sizes = [7, 3, 12, 5, 9, 1, 4, 8]
    for room in range(0, sum(sizes) + 1):
        fits = placement.spread(sizes, room)
        held = sum(n for n, f in zip(sizes, fits) if f)
        assert held <= room
        assert all(f or held + n > room for n, f in zip(sizes, fits))


def _largest_unit_bytes(runner) -> int:
    return runner.engine.plan.largest_unit_bytes


def _working_set(runner, prefetch_depth: int = 1) -> int:
    # (depth + 1) units paged in + one unit's update (master, gradient, 2 moments),
    # and on the CPU, whose device memory is host memory, (depth + 1) device
    # copies + one unit's gradients on their way to the store.
    in_flight = prefetch_depth + 1 + UPDATE_BYTES_PER_WEIGHT_BYTE
    on_cpu = prefetch_depth + 1 + 1
    return (in_flight + on_cpu) * _largest_unit_bytes(runner)


@pytest.mark.parametrize("where", ["ram_tier", "hybrid", "files"])
def test_any_placement_trains_bit_for_bit_as_the_ram_store(tmp_path, where):
    ram = _train("ws", steps=3)
    # The budget: the disk tier's working set plus room for everything (RAM
    # tier), for the masters and some state (hybrid), or for nothing (files).
    probe_model, probe, _, _ = _train(
        "ws", steps=1, store="disk", store_dir=str(tmp_path / "probe")
    )
    working = _working_set(probe)
    masters = sum(p.numel() * 4 for p in probe_model.parameters())
    extra = {"ram_tier": 5 * masters, "hybrid": 2 * masters, "files": 0}[where]
    disk = _train(
        "ws", steps=3, store="disk", store_dir=str(tmp_path), host_memory_budget=working + extra
    )
    _assert_same_training(ram, disk)
    model, runner, opt, _ = disk
    store = runner.engine.store.tier
    got = store.placement()
    tensors = [p.data for p in model.parameters()] + [
        v for st in opt.state.values() for v in st.values() if v.dim() > 0
    ]
    in_files = [t for t in tensors if is_store_mapped(t)]
    assert all(store.holds(t) for t in tensors)
    if where == "ram_tier":
        assert not in_files and got.disk_bytes == 0
    elif where == "files":
        assert len(in_files) == len(tensors) and got.ram_bytes == 0
    else:
        assert not any(is_store_mapped(p) for p in model.parameters())  # masters first
        assert 0 < len(in_files) < len(tensors)
        assert got.ram["master"] == masters and got.ram_bytes <= 2 * masters
    # What the store did is what the prediction said (AdamW: two moments each).
    master_bytes = [p.numel() * p.element_size() for p in model.parameters()]
    assert got == placement.predict(master_bytes, store.places.capacity)


def test_default_budget_is_the_available_memory_less_the_margin(tmp_path):
    model, runner, _, _ = _train("ws", steps=1, store="disk", store_dir=str(tmp_path))
    available = placement.available_memory()
    assert available is not None
    capacity = runner.engine.store.tier.places.capacity
    margin = placement.MARGIN_FIXED + placement.MARGIN_FRACTION * placement.total_memory()
    # Measured a moment apart: the available memory moves by a few MiB.
    assert abs(capacity + _working_set(runner) + margin - available) < 256 * 2**20
    # This small model fits whole in the RAM tier.
    assert not any(is_store_mapped(p) for p in model.parameters())
    x, y = _batch(0)
    F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
    assert not any(is_store_mapped(p.grad) for p in model.parameters())
    assert CFG.n_layer == 3


def test_a_sharded_store_gives_the_places_of_other_ranks_masters_to_its_own():
    plan = placement.PlacementPlan({"a": 100, "b": 50, "c": 10}, capacity=400)
    assert [plan.in_ram(k, "master", n) for k, n in (("a", 100), ("b", 50), ("c", 10))] == [
        True,
        True,
        True,
    ]
    # Another rank owns b: its master goes, its state and gradient never come.
    plan.give_back("master", 50, in_ram=True)
    plan.keep_only({"a", "c"})
    # Masters a and c stay (110); state a 100 + 100, c 10 + 10 (330); gradient a
    # (100) no longer fits, c (10) does.
    assert plan.predicted.ram == {"master": 110, "state": 220, "grad": 10}
    assert plan.predicted.disk == {"grad": 100}
    assert plan.in_ram("a", "state", 100) and plan.in_ram("a", "state", 100)
    assert not plan.in_ram("a", "grad", 100) and plan.in_ram("c", "grad", 10)
    assert not plan.in_ram("a", "master", 100)  # made once; a second one goes to a file
    assert plan.actual.ram == {"master": 110, "state": 200, "grad": 10}


def test_ram_given_back_takes_the_masters_in_files_first():
    # Masters a, b, c of 100, 50 and 50 bytes, 150 bytes of RAM: spread over the
    # order, a and c stay there, b goes to a file.
    plan = placement.PlacementPlan({"a": 100, "b": 50, "c": 50}, capacity=150)
    made = [plan.in_ram(k, "master", n) for k, n in (("a", 100), ("b", 50), ("c", 50))]
    assert made == [True, False, True]
    # The device tier takes a's unit before any state is made: its 100 bytes of RAM
    # go first to b's master (on disk it moves 4 bytes a byte a step, state 2), then
    # the state is placed again in the 50 left: one of the four moments of 50.
    plan.give_back("master", 100, in_ram=True)
    plan.keep_only({"b", "c"})
    assert plan.refill([("master", "b", 50)]) == [True]
    assert plan.actual.ram == {"master": 100} and plan.actual.disk == {"master": 0}
    assert plan.predicted.ram == {"master": 100, "state": 50}
    assert plan.predicted.disk == {"state": 150, "grad": 100}
    assert [plan.in_ram(k, "state", 50) for k in "bbcc"].count(True) == 1


def test_ram_given_back_after_the_state_is_made_takes_state_out_of_the_files():
    plan = placement.PlacementPlan({"a": 100, "b": 100, "c": 100}, capacity=400)
    for key in "abc":
        assert plan.in_ram(key, "master", 100)  # all three masters in RAM (300)
    # Six moments of 100 in the 100 left: one in RAM (spread: b's first)
    assert [plan.in_ram(k, "state", 100) for k in "aabbcc"] == [False] * 2 + [True] + [False] * 3
    # b's master leaves (its state stays counted, where it is): 100 bytes back,
    # which the state in the files takes, spread over the order: a's second moment.
    plan.give_back("master", 100, in_ram=True)
    held = [("state", "a", 100), ("state", "a", 100), ("state", "c", 100), ("state", "c", 100)]
    assert plan.refill(held) == [False, True, False, False]
    assert plan.actual.ram == {"master": 200, "state": 200}
    assert plan.actual.disk == {"state": 400}


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_compact_state_is_placed_by_its_own_size(tmp_path, state_dtype):
    """The optimizer counts its state on the meta device before making it, and the store
    plans the RAM tier by those sizes: compact state (half or a quarter of AdamW's fp32
    moments, with int8's block scales) is placed as the store predicted, and more of it
    fits in RAM than AdamW's fp32 moments would."""
    import torch

    import weightstream as cstorch
    from weightstream.models import GPT

    def build(directory, **optimizer):
        torch.manual_seed(0)
        model = GPT(CFG)
        streaming = {"store": "disk", "store_dir": str(tmp_path / directory)}
        runner = cstorch.compile(model, backend="ws", **streaming, host_memory_budget=budget)
        opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, **optimizer)
        return model, runner, opt

    probe = _train("ws", steps=1, store="disk", store_dir=str(tmp_path / "probe"))
    masters = sum(p.numel() * 4 for p in probe[0].parameters())
    budget = _working_set(probe[1]) + masters + masters  # masters, then room for a moment
    _, fp32, _ = build("fp32")
    model, runner, opt = build("compact", state_dtype=getattr(torch, state_dtype))
    places = runner.engine.store.tier.places
    sizes = {
        name: [t.nbytes for t in opt.state[p].values() if t.dim() > 0]
        for name, p in model.named_parameters()
    }
    for kind in ("master", "state"):  # made before any step, where predicted
        assert places.actual.ram.get(kind, 0) == places.predicted.ram.get(kind, 0), kind
        assert places.actual.disk.get(kind, 0) == places.predicted.disk.get(kind, 0), kind
    expected = placement.PlacementPlan(
        {n: p.nbytes for n, p in model.named_parameters()}, places.capacity, state_bytes=sizes
    ).predicted
    assert places.predicted == expected
    # The room holds one of AdamW's fp32 moments a master, which is all of the compact
    # state; planned as two fp32 moments, half of it would have gone to the files.
    assert fp32.engine.store.tier.places.actual.disk.get("state", 0) > 0
    assert places.actual.disk.get("state", 0) == 0 < places.actual.ram["state"]

    # and training on it is the training of the same optimizer in a RAM store
    def two_steps(runner, opt):
        for step in range(2):
            x, y = _batch(step)
            F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()

    two_steps(runner, opt)
    torch.manual_seed(0)
    ram_model = GPT(CFG)
    compact = {"state_dtype": getattr(torch, state_dtype)}
    ram = cstorch.compile(ram_model, backend="ws")
    two_steps(ram, cstorch.optim.AdamW(ram_model.parameters(), lr=3e-3, **compact))
    got = model.state_dict()
    for k, v in ram_model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_state_tensors_of_several_sizes_take_the_ram_the_plan_granted(tmp_path):
    """bf16 masters with int8 state: each master's state is codes (n bytes each moment),
    small block scales and a Kahan buffer (2n). With room for part of it, the RAM tier
    holds exactly the state the plan granted. Before, a grant was a byte count per
    master: the codes and scales used up a Kahan buffer's grant, which then went to the
    files with the rest, and RAM the plan had granted stayed empty."""
    import torch

    import weightstream as cstorch
    from weightstream.models import GPT

    def build(directory, budget):
        torch.manual_seed(0)
        model = GPT(CFG).to(torch.bfloat16)
        store = {"store": "disk", "store_dir": str(tmp_path / directory)}
        runner = cstorch.compile(model, backend="ws", **store, host_memory_budget=budget)
        cstorch.optim.AdamW(model.parameters(), lr=3e-3, state_dtype=torch.int8)
        return runner.engine.store.tier.places

    roomy = build("roomy", 10**8)  # everything in RAM: the kinds' sizes, and the margin
    margin, ram = 10**8 - roomy.capacity, roomy.predicted.ram
    places = build("tight", margin + ram["master"] + ram["state"] // 2)
    assert places.predicted.disk.get("state", 0) > 0 < places.predicted.ram.get("state", 0)
    for where in ("ram", "disk"):
        assert getattr(places.actual, where)["state"] == getattr(places.predicted, where)["state"]

"""The device tier (Note [device tier] in runtime/placement.py): whole unit groups whose
masters, gradients and optimizer state stay on the compute device within
``device_tier_budget``, never streamed, updated there.

The placement rule is checked on hand-made groups; the engine's placement against
the bytes the chosen units really hold; training against eager PyTorch with
torch.optim.AdamW (bit for bit: on the CPU the device is host memory and the same
kernels run on the same values) in every update schedule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.common.pages import is_store_mapped
from weightstream.models import GPT, GPTConfig
from weightstream.runtime.placement import device_tier
from weightstream.runtime.sharding import unit_groups

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4)
STEPS = 4


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (4, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _loss(model, step):
    x, y = _batch(step)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _eager(steps=STEPS):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    for step in range(steps):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _streamed(budget, steps=STEPS, fetched=None, forward_hook=None, **config):
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(
        model, backend="ws", granularity="module", device_tier_budget=budget, **config
    )
    if forward_hook is not None:  # called with the tier at each forward of the model
        model.register_forward_pre_hook(lambda *_: forward_hook(runner.engine.resident))
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if fetched is not None:  # every master a fetch reads
        store = runner.engine.store
        fetch = store.fetch_flat

        def counting(masters, *args):
            fetched.update(id(m) for m in masters)
            return fetch(masters, *args)

        store.fetch_flat = counting
    for step in range(steps):
        _loss(runner, step).backward()
        opt.step()
        opt.zero_grad()
    return model, runner, opt


def _disk_working_set(tmp_path) -> int:
    """The RAM a disk store of the test model needs besides its RAM tier (the least
    host_memory_budget)."""
    from weightstream.runtime.budgets import disk_working_set

    probe = cstorch.compile(GPT(CFG), backend="ws", granularity="module", store="disk",
                            store_dir=str(tmp_path / "probe"))  # fmt: skip
    working = disk_working_set(probe.engine.plan, probe.engine.config, torch.device("cpu"))
    probe.engine.close()
    return working


def _same_as_eager(model, eager, opt=None, eager_opt=None) -> None:
    """The weights (and, given the optimizers, AdamW's moments) bit for bit."""
    state = model.state_dict()
    for k, v in eager.state_dict().items():
        assert torch.equal(state[k], v), k
    if opt is not None:
        ref, got = eager_opt.state_dict()["state"], opt.state_dict()["state"]
        for i in ref:
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ref[i][name], got[i][name]), (i, name)


def _unit_bytes(runner, opt, indices) -> int:
    """Masters, gradients and optimizer state (AdamW's moments and step) of the units
    ``indices``, each parameter once."""
    params = {id(p): p for i in indices for p in runner.plan.units[i].params}.values()
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return sum(2 * p.nbytes for p in params) + sum(t.nbytes for t in state)


# ---- the rule -----------------------------------------------------------------------------


def test_the_rule_fills_the_budget_with_whole_groups():
    # (units, bytes, fetches a step) of 6 units; units 0 and 5 share a parameter
    groups = [([0, 5], 400, 2), ([1], 100, 2), ([2], 100, 2), ([3], 100, 3), ([4], 100, 2)]
    assert device_tier(groups, 0, 6) == set()
    assert device_tier(groups, 10**6, 6) == {0, 1, 2, 3, 4, 5}
    # a recomputed unit (3 fetches) saves the most per byte: first
    assert device_tier(groups, 100, 6) == {3}
    # then the ends of the order: the tied group (0 and 5) does not fit 250, so the
    # next from the ends, unit 1 (the first unit after 0), then 4
    assert device_tier(groups, 250, 6) == {3, 1}
    assert device_tier(groups, 300, 6) == {3, 1, 4}
    # a group is never split: 499 holds the recomputed unit and the tied pair is too big
    # for what is left, so the smaller ones come in instead
    assert device_tier(groups, 499, 6) == {3, 1, 4, 2}
    assert device_tier(groups, 500, 6) == {3, 0, 5}


def test_the_engine_places_groups_within_the_budget():
    _, whole, opt = _streamed(10**9, steps=1)
    units = whole.plan.units
    assert whole.engine.resident == frozenset(range(len(units)))
    groups = unit_groups([u.params for u in units])
    assert any(len(g) > 1 for g in groups)  # the tied embedding and head
    everything = _unit_bytes(whole, opt, range(len(units)))
    for budget in (0, 4096, 20_000, everything // 2, everything - 1, everything):
        _, runner, opt = _streamed(budget, steps=1)
        resident = runner.engine.resident
        held = _unit_bytes(runner, opt, resident)
        assert held <= budget
        for group in groups:  # whole groups only, and none left out that fits
            assert set(group) <= resident or not set(group) & resident
            if not set(group) & resident:
                assert _unit_bytes(runner, opt, group) > budget - held
        assert (len(resident) == len(units)) == (budget == everything)
    assert "device tier: 0 of" in _streamed(0, steps=1)[1].engine.describe_tiers()


# ---- training -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [{}, {"overlap_updates": True}, {"update_in_backward": True}],
    ids=["at_step", "overlapped", "in_backward"],
)
@pytest.mark.parametrize("part", ["some", "all"])
def test_the_device_tier_trains_like_eager_pytorch(config, part):
    eager, eager_opt = _eager()
    budget = 20_000 if part == "some" else 10**9
    fetched: set[int] = set()
    model, runner, opt = _streamed(budget, fetched=fetched, **config)
    resident = runner.engine.resident
    assert resident and (part == "all") == (len(resident) == len(runner.plan.units))
    on_device = {id(p) for i in resident for p in runner.plan.units[i].params}
    assert not fetched & on_device  # the tier's masters were never streamed
    assert fetched or part == "all"
    _same_as_eager(model, eager, opt, eager_opt)


def test_compact_state_on_the_device_tier_equals_it_streamed():
    """bf16 optimizer state (Note [compact optimizer state]) of units on the tier: the
    same kernels as streamed, so the same bits as every unit streamed."""

    def run(budget):
        torch.manual_seed(0)
        model = GPT(CFG)
        runner = cstorch.compile(model, backend="ws", device_tier_budget=budget)
        opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, state_dtype=torch.bfloat16)
        for step in range(STEPS):
            _loss(runner, step).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict(), runner.engine.resident

    streamed, none = run(0)
    placed, resident = run(60_000)
    assert not none and resident
    for k, v in streamed.items():
        assert torch.equal(placed[k], v), k


def test_a_checkpoint_of_the_device_tier_resumes_exactly(tmp_path):
    eager, _ = _eager(steps=6)
    model, runner, opt = _streamed(20_000, steps=3)
    path = tmp_path / "checkpoint_3.mdl"
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    torch.manual_seed(1)  # another initialization: the checkpoint must set everything
    resumed = GPT(CFG)
    runner = cstorch.compile(resumed, backend="ws", granularity="module", device_tier_budget=20_000)
    opt = cstorch.optim.AdamW(resumed.parameters(), lr=3e-3, weight_decay=0.1)
    state = cstorch.load(path)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    for step in range(3, 6):
        _loss(runner, step).backward()
        opt.step()
        opt.zero_grad()
    assert runner.engine.resident
    _same_as_eager(resumed, eager)


def test_recomputed_units_come_first_and_train_exactly():
    eager, _ = _eager()
    model, runner, _ = _streamed(30_000, activation_checkpointing=True)
    resident = runner.engine.resident
    assert resident and resident <= runner.engine.streamer.recompute
    _same_as_eager(model, eager)


def test_the_tier_s_units_are_recomputed_as_the_streamed_ones():
    """activation_checkpointing holds for a unit of the device tier too: its forward runs
    again in the backward, and the graph keeps none of its activations. The room "auto"
    gives the tier is measured with every unit recomputed: on an H200 a 4.9B Llama at
    batch 16 ran out of device memory at the second step when the tier's 26 blocks
    kept theirs (137.95 GiB allocated)."""
    eager, _ = _eager(steps=1)
    model, runner, opt = _streamed(2**40, steps=0, activation_checkpointing=True)
    engine = runner.engine
    _loss(runner, 0)  # the plan
    recomputed = sorted(engine.resident & engine.streamer.recompute)
    assert recomputed and engine.resident == set(range(len(engine.plan.units)))
    calls = {i: 0 for i in recomputed}
    for i in recomputed:
        wrapper = engine.plan.units[i].module.forward  # the streamer's UnitForward
        inner = wrapper.inner

        def counted(*args, _i=i, _inner=inner, **kwargs):
            calls[_i] += 1
            return _inner(*args, **kwargs)

        wrapper.inner = counted
    loss = _loss(runner, 0)
    assert set(calls.values()) == {1}  # the forward
    loss.backward()
    assert set(calls.values()) == {2}  # and its recompute in the backward
    opt.step()
    _same_as_eager(model, eager)


def test_where_the_tier_cannot_be_it_says_so_and_streams():
    with pytest.warns(UserWarning, match="device_tier_budget is ignored.*cbfloat16"):
        _, runner, _ = _streamed(10**9, steps=1, compute_dtype="cbfloat16")
    assert runner.engine.resident == frozenset()
    with pytest.warns(UserWarning, match="device_tier_budget=100 bytes holds no unit"):
        _, runner, _ = _streamed(100, steps=1)
    assert runner.engine.resident == frozenset()


@pytest.mark.parametrize("budget", ["files", "hybrid"])
def test_the_tier_over_a_disk_store_takes_its_units_out_of_the_files(tmp_path, budget):
    """A disk store holds the masters and the optimizer state in its files (or its RAM
    tier) from the engine's construction: the units of the device tier leave it at the
    first call, their files given back, and training stays eager PyTorch's."""
    eager, _ = _eager()
    working = _disk_working_set(tmp_path)
    extra = {"files": 0, "hybrid": 100_000}[budget]
    disk = {"store": "disk", "store_dir": str(tmp_path / "store"),
            "host_memory_budget": working + extra}  # fmt: skip
    alone, streamed, _ = _streamed(0, steps=1, **disk)
    mapped_without = streamed.engine.store.bytes_mapped
    in_ram_without = {n for n, p in alone.named_parameters() if not is_store_mapped(p)}
    streamed.engine.close()
    disk["store_dir"] = str(tmp_path / "store2")
    model, runner, opt = _streamed(60_000, **disk)
    engine = runner.engine
    assert engine.resident
    tier = {id(p) for i in engine.resident for p in runner.plan.units[i].params}
    tensors = [(id(p), p.data, "master") for p in model.parameters()]
    tensors += [(id(p), t, "state") for p, st in opt.state.items() for t in st.values() if t.dim()]
    assert all(engine.store.holds(t) == (pid not in tier) for pid, t, _ in tensors)
    # the files of the tier's masters and state are given back
    assert 0 < engine.store.bytes_mapped < mapped_without
    # The store counts what is where: the tensors in its files and in its RAM tier.
    counted = engine.store.placement()
    for kind in ("master", "state"):
        held = [t for pid, t, k in tensors if k == kind and pid not in tier]
        assert counted.disk.get(kind, 0) == sum(t.nbytes for t in held if is_store_mapped(t))
        assert counted.ram.get(kind, 0) == sum(t.nbytes for t in held if not is_store_mapped(t))
    if budget == "hybrid":  # the RAM the tier gave back holds masters that were in files
        streamed_names = {n for n, p in model.named_parameters() if id(p) not in tier}
        in_ram = {n for n in streamed_names if not is_store_mapped(model.get_parameter(n))}
        assert in_ram_without & streamed_names < in_ram
    _same_as_eager(model, eager)


@pytest.mark.parametrize("part", ["some", "all"])
def test_a_compute_dtype_on_the_device_tier_equals_it_streamed(part):
    """compute_dtype bfloat16: streamed units compute on bf16 copies of their masters; a
    unit of the tier on a bf16 cast of its masters, made in its window, whose gradient
    autograd returns in float32: the same values either way."""

    def run(budget):
        model, runner, _ = _streamed(budget, compute_dtype=torch.bfloat16)
        return model.state_dict(), runner.engine.resident

    streamed, none = run(0)
    placed, resident = run(20_000 if part == "some" else 10**9)
    assert not none and resident
    for k, v in streamed.items():
        assert torch.equal(placed[k], v), k
    fp32 = _streamed(0)[0].state_dict()  # bf16 products did change the training
    assert any(not torch.equal(fp32[k], v) for k, v in streamed.items())


@pytest.mark.parametrize("config", [{}, {"overlap_updates": True}], ids=["at_step", "overlapped"])
def test_auto_places_the_tier_after_the_first_step_and_trains_like_eager(config, monkeypatch):
    """``device_tier_budget="auto"``: the first step streams every unit; before the
    second, the room the device has left after the first step's peak holds the tier, and
    the masters move there with their stepped optimizer state. On the CPU that room is
    nothing (its device is host memory); here it is made 20 kB to move state that exists."""
    from weightstream.runtime.device import DeviceOps

    assert DeviceOps(torch.device("cpu")).tier_room() == 0
    _, cpu, _ = _streamed("auto", steps=2, **config)
    assert cpu.engine.resident == frozenset()
    monkeypatch.setattr(DeviceOps, "tier_room", lambda self: 20_000)
    eager, eager_opt = _eager()
    placed_at: list[frozenset] = []  # the tier at each forward
    model, runner, opt = _streamed("auto", forward_hook=placed_at.append, **config)
    resident = runner.engine.resident
    # placed before the second step's forward
    assert resident and placed_at == [frozenset()] + [resident] * (STEPS - 1)
    _same_as_eager(model, eager, opt, eager_opt)


def test_auto_over_a_disk_store_fills_the_ram_it_gives_back(tmp_path, monkeypatch):
    """Placed after the first step, the tier takes units whose masters and state the
    disk store made; the RAM they held then holds masters of streamed units that were
    in files (Note [hybrid placement]), and training stays eager PyTorch's."""
    from weightstream.runtime.device import DeviceOps

    working = _disk_working_set(tmp_path)
    monkeypatch.setattr(DeviceOps, "tier_room", lambda self: 40_000)
    eager, eager_opt = _eager()
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend="ws", granularity="module", store="disk",
                             store_dir=str(tmp_path / "store"), device_tier_budget="auto",
                             host_memory_budget=working + 150_000)  # fmt: skip
    masters = []  # the store's masters (RAM, files) at each forward
    in_files = []  # the masters in files at each forward

    def count(*_):
        got = runner.engine.store.placement()
        masters.append((got.ram.get("master", 0), got.disk.get("master", 0)))
        in_files.append({id(p) for p in model.parameters() if is_store_mapped(p)})

    model.register_forward_pre_hook(count)
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(STEPS):
        _loss(runner, step).backward()
        opt.step()
        opt.zero_grad()
    tier = {id(p) for i in runner.engine.resident for p in runner.plan.units[i].params}
    moved = sum(p.nbytes for p in model.parameters() if id(p) in tier)
    (ram0, disk0), (ram1, disk1) = masters[0], masters[1]
    assert tier and disk0 > 0 and ram1 + disk1 == ram0 + disk0 - moved
    # Masters in files moved into the RAM the tier gave back.
    assert disk1 < disk0 - sum(p.nbytes for p in model.parameters() if id(p) in tier & in_files[0])
    _same_as_eager(model, eager, opt, eager_opt)


def test_auto_over_a_disk_store_moves_gradients_in_files_into_the_ram_it_gives_back(
    tmp_path, monkeypatch
):
    """With room for every master and all the optimizer state, a disk store keeps part
    of the gradients in files. The RAM the tier gives back after the first step then
    holds some of them: the store's gradient tensors themselves move (``p.grad`` is
    the RAM copy in the next backward), the store counts them where they are, and
    training stays eager PyTorch's."""
    from weightstream.runtime.device import DeviceOps

    working = _disk_working_set(tmp_path)
    monkeypatch.setattr(DeviceOps, "tier_room", lambda self: 40_000)
    eager, eager_opt = _eager()
    torch.manual_seed(0)
    model = GPT(CFG)
    masters = sum(p.nbytes for p in model.parameters())
    # Masters (1x), AdamW's two moments (2x) and a third of the gradients in RAM.
    budget = working + 3 * masters + masters // 3
    runner = cstorch.compile(model, backend="ws", granularity="module", store="disk",
                             store_dir=str(tmp_path / "store"), device_tier_budget="auto",
                             host_memory_budget=budget)  # fmt: skip
    store = runner.engine.store
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    in_files = []  # after each backward: the gradients in files
    for step in range(STEPS):
        _loss(runner, step).backward()
        grads = {id(p): p.grad for p in model.parameters() if store.tier.holds(p.grad)}
        mapped = {pid for pid, g in grads.items() if is_store_mapped(g)}
        in_files.append(mapped)
        counted = store.placement()
        assert counted.disk.get("grad", 0) == sum(grads[pid].nbytes for pid in mapped)
        assert counted.ram.get("grad", 0) == sum(
            g.nbytes for pid, g in grads.items() if pid not in mapped
        )
        assert not counted.disk.get("master") and not counted.disk.get("state")
        opt.step()
        opt.zero_grad()
    tier = {id(p) for i in runner.engine.resident for p in runner.plan.units[i].params}
    assert tier and in_files[0] - tier
    # Gradients of streamed units that were in files are in RAM from the second step on.
    assert in_files[1] < in_files[0] - tier
    assert in_files[1] == in_files[-1]
    _same_as_eager(model, eager, opt, eager_opt)


# 18 s each on 2 cores, with the slow tests: the tier is an accelerator's, and one rank's
# is checked by default.
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicated", "sharded", "sharded_disk"])
def test_two_ranks_with_the_tier_equal_one_rank(tmp_path, monkeypatch, sharding):
    """Data parallel: every rank places the same units. With a replicated store SwarmX
    reduces their gradients where they are; with a sharded one every rank holds the
    tier's units whole (their masters and state broadcast from their owners) and
    all-reduces their gradients, while the rest stays sharded. Clipping at a norm far
    below the gradients' (every step clips) counts each gradient once. The run
    command's two ranks train as its one rank, and the checkpoint gathers both kinds,
    from RAM or from a disk store's files (given back as the tier takes its units)."""
    import yaml
    from test_distributed import WEIGHT_ATOL, _params

    from weightstream.checkpoint import load
    from weightstream.cli.main import main

    monkeypatch.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    runs = {}
    for name, ranks, budget in (("one", [], None), ("two", ["--num_csx", "2"], 60_000)):
        (tmp_path / name).mkdir()
        params = _params(tmp_path / name, "gpt2")
        values = yaml.safe_load(params.read_text())
        values["runconfig"].update(
            store_sharding=sharding.removesuffix("_disk"), device_tier_budget=budget
        )
        if sharding.endswith("_disk"):  # part in RAM, part in files
            values["runconfig"].update(store="disk", host_memory_budget=300_000)
        values["optimizer"]["max_gradient_norm"] = 0.05
        params.write_text(yaml.safe_dump(values))
        out = tmp_path / name / "out"
        assert main(["run", "CPU", "-p", str(params), "-o", str(out), *ranks]) == 0, name
        runs[name] = load(sorted(out.glob("checkpoint_*.mdl"))[-1], map_location="cpu")
    one, two = runs["one"], runs["two"]
    assert one["model"].keys() == two["model"].keys()
    for k, v in one["model"].items():
        # two ranks sum the halves' mean gradients in another order than one rank
        assert torch.allclose(two["model"][k], v, rtol=0, atol=WEIGHT_ATOL), k
    # The moments carry the same reduction-order differences, relative to their size
    # (a placeholder gathered instead of the owner's value would be 0 or garbage).
    moments = one["optimizer"]["state"]
    assert moments.keys() == two["optimizer"]["state"].keys()
    for i, entry in moments.items():
        for key, v in entry.items():
            got = two["optimizer"]["state"][i][key]
            assert got.shape == v.shape and torch.allclose(got, v, rtol=1e-4, atol=1e-9), (i, key)

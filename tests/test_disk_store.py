"""The disk tier of the store (Note [disk tier] in runtime/store.py): training state
in memory-mapped files gives the same bits as the RAM store and as eager PyTorch,
and keeps resident memory under a configured cap while the store is several
times larger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import h5py
import pytest
import torch
import torch.nn.functional as F
from trees import assert_same_tree

import weightstream as cstorch
from weightstream.common.materialize import build_materialized
from weightstream.models import GPT, GPTConfig
from weightstream.models.registry import get_model_spec
from weightstream.runtime.store import DiskStore

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 128, (4, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _train(backend, steps=6, micro_batches=1, clip=True, **streaming):
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(model, backend=backend, **streaming)
    opt = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for mb in range(micro_batches):
            x, y = _batch(step * micro_batches + mb)
            loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten()) / micro_batches
            loss.backward()
            losses.append(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return model, runner, opt, torch.stack(losses)


def _assert_same_training(a, b):
    (ma, _, oa, la), (mb, _, ob, lb) = a, b
    assert torch.equal(la, lb)
    sa, sb = ma.state_dict(), mb.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for i, st in oa.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(v, ob.state_dict()["state"][i][name]), (i, name)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_disk_store_is_bitwise_equal_to_ram_store_and_eager(tmp_path, overlap, micro_batches):
    """GPT with tied embeddings (two uses of one master), gradient clipping,
    gradient accumulation over micro-batches, overlapped or in-place updates."""
    eager = _train("cpu", micro_batches=micro_batches)
    ram = _train("ws", micro_batches=micro_batches, overlap_updates=overlap)
    disk = _train(
        "ws",
        micro_batches=micro_batches,
        overlap_updates=overlap,
        store="disk",
        store_dir=str(tmp_path),
    )
    _assert_same_training(eager, ram)
    _assert_same_training(ram, disk)


def test_disk_store_holds_masters_gradients_and_optimizer_state(tmp_path):
    model, runner, opt, _ = _train("ws", steps=1, clip=False, store="disk", store_dir=str(tmp_path))
    store = runner.engine.store.tier
    assert all(store.holds(p) for p in model.parameters())
    for st in opt.state.values():
        for name, v in st.items():
            if v.dim() > 0:
                assert store.holds(v), name
    # The gradients of the next backward accumulate into the store.
    x, y = _batch(99)
    F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
    assert all(store.holds(p.grad) for p in model.parameters())
    # Files are unlinked once mapped: nothing is left in the directory.
    assert list(tmp_path.iterdir()) == []
    runner.engine.close()
    assert not store.holds(next(model.parameters()))
    assert tmp_path.is_dir()  # a store_dir that was there before stays


def test_a_store_directory_the_store_made_goes_with_it(tmp_path, monkeypatch):
    """store_dir made by the store (a new path, or the default temporary one) is
    removed when the store closes, empty as its unlinked files leave it; a second run
    sharing it makes it again if the first removed it meanwhile, and removes it then."""
    made = tmp_path / "new" / "store"
    _, runner, _, _ = _train("ws", steps=1, clip=False, store="disk", store_dir=str(made))
    _, other, _, _ = _train("ws", steps=1, clip=False, store="disk", store_dir=str(made))
    runner.engine.close()
    assert not made.exists() and (tmp_path / "new").is_dir()
    other.engine.store.tier.scratch((4,), torch.float32, "gather")  # a file after the removal
    assert made.is_dir()  # made again
    other.engine.close()
    assert not made.exists()  # and removed by the store that made it again (2 ranks left it)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _, runner, _, _ = _train("ws", steps=1, clip=False, store="disk")
    assert len(list((tmp_path / "tmp").iterdir())) == 1
    runner.engine.close()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_optimizer_built_before_compile_moves_its_state_into_the_store(tmp_path):
    """torch.optim-style ordering: the optimizer's state exists in RAM before the
    store does; the first step moves it, and the result is unchanged."""

    def run(store):
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = cstorch.optim.Adam(model.parameters(), lr=1e-3)
        kwargs = {"store": "disk", "store_dir": str(tmp_path)} if store else {}
        runner = cstorch.compile(model, backend="ws", **kwargs)
        for step in range(3):
            x, y = _batch(step)
            F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
        return model, runner, opt

    ref_model, _, _ = run(store=False)
    model, runner, opt = run(store=True)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert all(
        runner.engine.store.tier.holds(v)
        for st in opt.state.values()
        for v in st.values()
        if v.dim()
    )


def test_meta_model_is_materialized_in_the_store_by_reset_parameters(tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )
    torch.manual_seed(0)  # reset_parameters draws in module order, as the constructor did
    runner = cstorch.compile(model, backend="ws", store="disk", store_dir=str(tmp_path))
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    out = runner(torch.ones(2, 8))
    assert out.shape == (2, 4) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["gpt2", "llama", "gptj"])
def test_zoo_model_built_on_meta_equals_the_eager_build(tmp_path, name):
    """The zoo's own init rule (scaled projections, tied head, zero biases) draws the
    same numbers in the store as in host memory (the run command's two stores)."""
    spec = get_model_spec(name)
    cfg = spec.config_cls(**spec.presets.get("tiny", dict(n_layer=2, d_model=64, n_head=4)))
    torch.manual_seed(0)
    ref = build_materialized(lambda: spec.build(cfg), "cpu")
    assert not any(p.is_meta for p in ref.parameters())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(cfg)
    runner = cstorch.compile(model, backend="ws", store="disk", store_dir=str(tmp_path))
    assert_same_tree(model.state_dict(), ref.state_dict())
    if name == "gpt2":
        assert model.lm_head.weight is model.wte.weight  # the tie survives materializing
    runner.engine.close()


def test_meta_parameter_without_reset_parameters_waits_for_a_load(tmp_path):
    """No initialization rule: the store gives the parameter storage; running before a
    state dict filled it is an error naming it and the fix, and a load makes it run."""

    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = Raw()
    runner = cstorch.compile(model, backend="ws", store="disk", store_dir=str(tmp_path))
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"parameters 'w' .* no values.* reset_parameters\(\)"):
        runner(x)
    w = torch.arange(16.0).view(4, 4)
    model.load_state_dict({"w": w})
    assert torch.equal(runner(x), x @ w)
    runner.close()


def test_bad_store_settings_name_the_fix():
    with pytest.raises(ValueError, match="store must be one of 'ram', 'disk'"):
        cstorch.compile(GPT(CFG), backend="ws", store="ssd")
    with pytest.raises(ValueError, match="set store='disk'"):
        cstorch.compile(GPT(CFG), backend="ws", store_dir="/tmp/x")
    with pytest.raises(ValueError, match="host_memory_budget must be >= 1"):
        cstorch.compile(GPT(CFG), backend="ws", store="disk", host_memory_budget=-1)


def test_host_memory_budget_too_small_fails_before_any_step(tmp_path):
    model = GPT(CFG)
    with pytest.raises(ValueError, match="more than host_memory_budget"):
        cstorch.compile(
            model, backend="ws", store="disk", store_dir=str(tmp_path), host_memory_budget=1024
        )


def test_full_disk_is_a_clear_error(tmp_path):
    store = DiskStore(tmp_path)
    with pytest.raises(
        OSError,
        match=r"has no room for 4,611,686,018,427,387,904 bytes .* free space there or give another store_dir",
    ):
        # Larger than any disk here: posix_fallocate fails at once.
        store.zeros((2**62,), torch.uint8, "master")
    store.close()


def test_checkpoint_from_the_disk_store_equals_the_ram_store_checkpoint(tmp_path):
    ram_model, _, ram_opt, _ = _train("ws", steps=2)
    disk_model, _, disk_opt, _ = _train(
        "ws", steps=2, store="disk", store_dir=str(tmp_path / "store")
    )
    for name, (model, opt) in {"ram": (ram_model, ram_opt), "disk": (disk_model, disk_opt)}.items():
        cstorch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict()},
            tmp_path / f"{name}.mdl",
        )
    with h5py.File(tmp_path / "ram.mdl") as a, h5py.File(tmp_path / "disk.mdl") as b:
        names = []
        a.visit(names.append)
        for n in names:
            if isinstance(a[n], h5py.Dataset):
                assert a[n][()].tobytes() == b[n][()].tobytes(), n


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    import weightstream as cstorch

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    store, store_dir, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    width, layers = 1024, 24
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    kwargs = dict(granularity="module", prefetch_depth=1)
    if store == "disk":
        kwargs.update(store="disk", store_dir=store_dir, host_memory_budget=budget)
        runner = cstorch.compile(model, backend="ws", **kwargs)
    else:
        model.to_empty(device="cpu")
        for m in model:
            m.reset_parameters()
        runner = cstorch.compile(model, backend="ws", **kwargs)
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, width)
    runner(x)  # compile: fixes the plan (a meta-device trace), no step yet
    baseline = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    losses = []
    for step in range(3):
        loss = runner(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    peak = rss("VmHWM")
    # A checkpoint written from the store, tensor by tensor: its pages go back
    # after each tensor (Note [disk tier]).
    save_baseline = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                 store_dir + "/checkpoint.mdl")
    save_peak = rss("VmHWM")
    print(json.dumps({"baseline": baseline, "peak": peak, "losses": losses,
                      "save_growth": save_peak - save_baseline,
                      "params": sum(p.numel() for p in model.parameters())}))
    """
)


def _rss_run(store, tmp_path, budget):
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, store, str(tmp_path), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_stays_under_the_cap_while_the_store_is_several_times_larger(tmp_path):
    """24 Linear(1024, 1024) units: 4 MiB of weights each, 96 MiB in all; with
    AdamW's moments and the gradients the store holds 384 MiB. The cap is the
    compile-time bound of the disk store: (prefetch_depth 1 + 1) units in flight
    plus one unit's update at 4x its weights, and on the CPU (prefetch_depth 1 + 1)
    device copies and one unit's gradients = 9 units = 36 MiB, so the store is
    10x the cap."""
    unit = 1024 * 1024 * 4 + 1024 * 4  # weight + bias, fp32
    cap = (1 + 1 + 4 + 1 + 1 + 1) * unit
    disk = _rss_run("disk", tmp_path, cap)
    ram = _rss_run("ram", tmp_path, cap)
    store_bytes = 4 * disk["params"] * 4  # masters, gradients, two moments
    assert store_bytes >= 10 * cap
    # Beyond the cap: the activations (8 x 1024 fp32 per layer, 24 layers, well
    # under 1 MiB) and the allocator's slack, 8 MiB in all.
    activations_and_slack = 8 * 2**20
    growth = disk["peak"] - disk["baseline"]
    assert growth <= cap + activations_and_slack, (growth, cap)
    # The RAM store, by contrast, grows by at least the gradients it holds.
    assert ram["peak"] - ram["baseline"] > disk["params"] * 4
    # Same arithmetic, same losses.
    assert disk["losses"] == ram["losses"]
    # Saving the 288 MiB of masters and moments from the disk store holds at
    # most about one tensor (4 MiB) beyond the writer's own buffers.
    assert disk["save_growth"] <= 16 * 2**20, disk["save_growth"]


_WARM_START_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import weightstream as cstorch
    from weightstream.checkpoint.weights import load_weights

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    checkpoint, store_dir, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)])
    runner = cstorch.compile(model, backend="ws", granularity="module", store="disk",
                             store_dir=store_dir, host_memory_budget=budget, init_weights=False)
    baseline = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    load_weights(model, checkpoint)
    peak = rss("VmHWM")
    x = torch.ones(2, 1024)
    out = runner(x)
    print(json.dumps({"growth": peak - baseline, "sum": float(out.detach().sum())}))
    """
)


def test_warm_start_into_the_disk_store_holds_one_tensor_at_a_time(tmp_path):
    """A new process warm-starts a 160 MiB model (40 Linear(1024, 1024)) into a disk
    store whose budget is under a quarter of that (and the training state, with
    gradients and AdamW's moments, 17x it): the load reads, copies and gives back
    one tensor at a time, so RSS grows by at most the budget, the largest tensor
    (4 MiB) and the reader's buffers (16 MiB), never by the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)])
    checkpoint = tmp_path / "weights.mdl"
    cstorch.save({"model": model.state_dict()}, checkpoint)
    unit = 1024 * 1024 * 4 + 1024 * 4
    # The disk store's compile-time bound on the CPU, 36 MiB: (prefetch_depth 1 + 1)
    # units in flight + one unit's update at 4x + 2 device copies + a unit's gradients.
    budget = (1 + 1 + 4 + 1 + 1 + 1) * unit
    weights = 40 * unit
    assert weights >= 4 * budget
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _WARM_START_SCRIPT,
            str(checkpoint),
            str(tmp_path / "s"),
            str(budget),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    largest, reader = 4 * 2**20, 16 * 2**20
    assert got["growth"] <= budget + largest + reader, (got["growth"], budget)
    with torch.no_grad():
        assert got["sum"] == pytest.approx(float(model(torch.ones(2, 1024)).sum()), rel=1e-6)


def test_a_made_store_dir_goes_with_whichever_sharing_store_ends_last(tmp_path):
    """Ranks sharing a store_dir a store made end in any order, and one may hold a file
    for an instant as another ends: the last store done with it removes it (two ranks
    left it behind under load). A store_dir that was there before stays."""
    made = tmp_path / "store"
    first, second = DiskStore(made), DiskStore(made)  # the second finds the first's
    busy = made / "other-rank.tmp"  # a file the other rank has not unlinked yet
    busy.write_bytes(b"x")
    first.close()
    assert made.is_dir()  # not empty: left for the last one
    busy.unlink()
    second.close()
    assert not made.exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    DiskStore(existing).close()
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_a_store_dir_that_is_a_file_is_named_as_one_by_compile(tmp_path):
    """compile() said '[Errno 17] ... give a writable store_dir' (it is writable, it is a
    file); it now says what --validate_only says, and leaves the file as it was."""
    import weightstream as cstorch

    afile = tmp_path / "afile"
    afile.write_text("mine")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"is a file, so the disk store cannot make its directory"):
        cstorch.compile(model, backend="wse_ws", store="disk", store_dir=str(afile / "sub"))
    assert afile.read_text() == "mine"


@pytest.mark.slow  # 14 s on 2 cores: a process of its own, with the slow tests
def test_a_store_dir_made_for_a_store_never_closed_goes_at_exit(tmp_path):
    """A script that trains and exits without compiled.close(): the directory the store
    made held only its mark afterwards; it goes at the interpreter's exit now."""
    store_dir = tmp_path / "store"
    script = (
        "import sys, torch\n"
        "import weightstream as cstorch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))\n"
        f"c = cstorch.compile(m, backend='wse_ws', store='disk', store_dir={str(store_dir)!r})\n"
        "opt = cstorch.optim.AdamW(m.parameters(), lr=1e-3)\n"
        "c(torch.randn(2, 64)).sum().backward()\n"
        "opt.step()\n"
        "assert (c.engine.store.tier.directory / '.weightstream-made').exists()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert not store_dir.exists()
    # A directory the user made is left alone (only its files go, as before).
    store_dir.mkdir()
    subprocess.run([sys.executable, "-c", script.replace("assert (", "assert not (")],
                   check=True, timeout=300)  # fmt: skip
    assert store_dir.exists() and not list(store_dir.iterdir())

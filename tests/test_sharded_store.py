"""The sharded store (Note [sharded store] in runtime/sharding.py) against the replicated one.

Tolerances: those of tests/test_distributed.py, for its reason. A 2-rank run
sums per-rank gradients where one rank sums the whole batch at once, which
moves the last bits of the gradients; AdamW carries that into the weights at
the scale of its update for near-zero gradients. Between the two 2-rank
stores the sums are the same two terms (a + b is commutative), but the
sharded store reduces each use of a unit's weights as it happens in backward
and runs AdamW's foreach kernels over each rank's owned tensors only; the
differences measured are below 1e-8, well inside the same bounds.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml
from test_distributed import LOSS_RTOL, WEIGHT_ATOL, _losses, _params

from weightstream import checkpoint as ckpt
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.sharding import assign_owners
from weightstream.runtime.swarm import REDUCE_IN_FLIGHT

# ---------------------------------------------------------------------- ownership


def test_owners_are_greedy_by_bytes_and_keep_shared_parameters_together():
    def ps(*numels):
        return [torch.nn.Parameter(torch.zeros(n)) for n in numels]

    big, mid, small, tiny = ps(100), ps(60), ps(50), ps(10)
    # Largest first, each to the least loaded rank: 100 -> 0, 60 -> 1, 50 -> 1, 10 -> 0.
    assert assign_owners([small, big, tiny, mid], 2) == [1, 0, 0, 1]
    # Units 0 and 2 share a parameter (a tied embedding): owned together (100 + 10
    # bytes of fp32 = 440 > 60 + 50), so the pair goes first, to rank 0.
    shared = ps(100)
    a, b = [shared[0]], [shared[0], *ps(10)]
    assert assign_owners([a, ps(60)[:1], b, ps(50)[:1]], 2) == [0, 1, 0, 1]
    # One owner (num_wgt_servers 1): everything on rank 0.
    assert assign_owners([big, mid, small], 1) == [0, 0, 0]


def test_config_names_the_bad_sharding_setting():
    with pytest.raises(ValueError, match="store_sharding must be one of"):
        StreamingConfig(store_sharding="zero3")
    with pytest.raises(ValueError, match="num_wgt_servers must be >= 1"):
        StreamingConfig(store_sharding="sharded", num_wgt_servers=0)


# ---------------------------------------------------------------------- run command


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """One rank, two ranks replicated, two ranks sharded: the same GPT run, 6 steps."""
    from weightstream.cli.main import main
    from weightstream.context import start_run

    tmp = tmp_path_factory.mktemp("sharded_runs")
    params = _params(tmp, "gpt2")
    values = yaml.safe_load(params.read_text())
    sharded, replicated = tmp / "gpt2_sharded.yaml", tmp / "gpt2_replicated.yaml"
    for path, how in ((sharded, "sharded"), (replicated, "replicated")):
        values["runconfig"]["store_sharding"] = how
        path.write_text(yaml.safe_dump(values))
    # Each rank's units in a disk store of its own (both in model_dir/store), with
    # a budget that keeps part of them in RAM and the rest in files.
    sharded_disk = tmp / "gpt2_sharded_disk.yaml"
    values["runconfig"].update(store_sharding="sharded", store="disk", host_memory_budget=300_000)
    sharded_disk.write_text(yaml.safe_dump(values))
    runs = {
        "one": tmp / "one",
        "replicated": tmp / "replicated",
        "sharded": tmp / "sharded",
        "sharded_disk": tmp / "sharded_disk",
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp / "cache"))
        mp.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
        for name, p, ranks in (
            ("one", params, []),
            ("replicated", replicated, ["--num_csx", "2"]),
            ("sharded", sharded, ["--num_csx", "2"]),
            ("sharded_disk", sharded_disk, ["--num_csx", "2"]),
        ):
            common = ["run", "CPU", "-p", str(p), "-o", str(runs[name])]
            assert main([*common, *ranks]) == 0, name
            start_run()
    return runs


def _checkpoint(model_dir: Path, step: int) -> dict:
    return ckpt.load(model_dir / f"checkpoint_{step}.mdl", map_location="cpu")


@pytest.mark.parametrize("sharded", ["sharded", "sharded_disk"])
def test_two_ranks_sharded_equal_one_rank_and_two_ranks_replicated(gpt_runs, sharded):
    one, rep, shd = (_losses(gpt_runs[k]) for k in ("one", "replicated", sharded))
    assert len(one) == len(rep) == len(shd) == 6
    torch.testing.assert_close(torch.tensor(shd), torch.tensor(one), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(shd), torch.tensor(rep), rtol=LOSS_RTOL, atol=0)
    w1 = _checkpoint(gpt_runs["one"], 6)["model"]
    ws = _checkpoint(gpt_runs[sharded], 6)["model"]
    assert w1.keys() == ws.keys()
    for k in w1:
        torch.testing.assert_close(ws[k], w1[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    assert [s for s, _ in ckpt.list_checkpoints(gpt_runs[sharded])] == [3, 6]


@pytest.mark.parametrize("step", [3, 6])
def test_sharded_disk_store_writes_the_sharded_ram_stores_checkpoint(gpt_runs, step):
    """The disk tier changes where the shards live, not one bit of what they hold."""
    ram = _checkpoint(gpt_runs["sharded"], step)
    disk = _checkpoint(gpt_runs["sharded_disk"], step)
    assert list(_flatten(ram)) and [k for k, _ in _flatten(ram)] == [k for k, _ in _flatten(disk)]
    for (key, x), (_, y) in zip(_flatten(ram), _flatten(disk)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
    assert not (gpt_runs["sharded_disk"] / "store").exists()  # nothing left, the store's dir too


def _flatten(value, prefix=""):
    """(path, leaf) pairs of a nested checkpoint state, in order."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}/{i}")
    else:
        yield prefix, value


@pytest.mark.parametrize("step", [3, 6])
def test_sharded_checkpoint_equals_the_replicated_one_tensor_by_tensor(gpt_runs, step):
    rep = _checkpoint(gpt_runs["replicated"], step)
    shd = _checkpoint(gpt_runs["sharded"], step)
    for section in ("model", "optimizer"):
        a, b = list(_flatten(rep[section])), list(_flatten(shd[section]))
        # The same layout: the same entries in the same order ...
        assert [k for k, _ in a] == [k for k, _ in b], section
        for (key, x), (_, y) in zip(a, b):
            if isinstance(x, torch.Tensor):
                # ... with whole tensors (no placeholder left) ...
                assert y.untyped_storage().nbytes() >= y.numel() * y.element_size(), key
                assert (x.shape, x.dtype) == (y.shape, y.dtype), key
                # ... equal within the stated tolerance (step counts exactly).
                atol = 0 if key.endswith("/step") else WEIGHT_ATOL
                torch.testing.assert_close(y, x, rtol=0, atol=atol, msg=key)
            else:
                assert x == y, key


# ---------------------------------------------------------------------- memory

# Four equal units, Linear(64, 64) each: weight 64*64 + bias 64 = 4160 fp32
# values = 16,640 bytes per unit, 66,560 bytes of masters in all.
UNIT_BYTES = (64 * 64 + 64) * 4
N_UNITS, N_PARAMS = 4, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes of host storage under the masters and the optimizer state (each storage once)."""
    tensors = [p.data for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gather_and_reload(model, optimizer, shards) -> dict:
    """Read the whole state as a checkpoint does, spoil the owned state, load it back."""
    from weightstream.runtime.sharding import is_placeholder

    # Collective reads: every rank gets the whole state (copied: a file would not
    # share the live tensors).
    model_state = copy.deepcopy(model.state_dict())
    optim_state = copy.deepcopy(optimizer.state_dict())
    owned = [p for p in model.parameters() if shards.owns(p)]
    kept = [p.detach().clone() for p in owned]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in owned]
    with torch.no_grad():
        for p in owned:
            p.add_(1.0)
            optimizer.state[p]["exp_avg"].add_(1.0)
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optim_state)
    whole = [*model_state.values()] + [
        v for entry in optim_state["state"].values() for v in entry.values()
    ]
    return {
        "whole": all(not is_placeholder(t) for t in whole),
        "restored": all(torch.equal(p, k) for p, k in zip(owned, kept))
        and all(torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(owned, moments)),
        "bytes": _store_bytes(model, optimizer),
    }


def _memory_rank(rank: int, world: int, port: int, out: str, store: str = "ram") -> None:
    """Two steps with a replicated and a sharded store on ``world`` ranks; what each
    store keeps, written to ``out/{store}{rank}.json``."""
    import torch.distributed as dist

    import weightstream as cstorch
    from weightstream.common.pages import is_store_mapped

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    disk = {}
    if store.startswith("disk"):
        # "disk_ram": a RAM tier with room for two units' masters, half the model's.
        ram_tier = 2 * UNIT_BYTES if store == "disk_ram" else 0
        disk = dict(
            store="disk",
            store_dir=str(Path(out, "store")),  # one directory for both ranks
            # The disk tier's working set on the CPU (9 units: 2 in flight, an update
            # at 4x, 2 device copies, a unit's gradients) and the RAM tier ("disk": none,
            # all in files).
            host_memory_budget=(1 + 1 + 4 + 1 + 1 + 1) * UNIT_BYTES + ram_tier,
        )
    result = {}
    try:
        for sharding in ("replicated", "sharded"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(N_UNITS)))
            optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
            compiled = cstorch.compile(
                model,
                backend="wse_ws",
                device="cpu",
                granularity="module",
                store_sharding=sharding,
                reduce_bucket_bytes=0,  # a collective per unit: 4 buckets
                **disk,
            )
            reducer, in_flight = compiled.engine.reducer, []
            start = reducer._start

            def counting(b, start=start, reducer=reducer, in_flight=in_flight):
                start(b)
                in_flight.append(len(reducer._in_flight))

            reducer._start = counting
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
            for _ in range(2):
                loss = compiled(x).square().mean()
                loss.backward()  # SwarmX reduces in the backward
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            result[f"{sharding}_in_flight"] = max(in_flight)
            if store == "ram":
                result[sharding] = _store_bytes(model, optimizer)
                if sharding == "sharded":
                    result["reload"] = _gather_and_reload(
                        model, optimizer, compiled.engine.store.replicas
                    )
            else:
                result[sharding] = compiled.engine.store.bytes_mapped
                placed = compiled.engine.store.placement()
                result[f"{sharding}_placed"] = {
                    k: placed.ram.get(k, 0) + placed.disk.get(k, 0) for k in placed.disk
                }
                result[f"{sharding}_in_ram"] = placed.ram
                if sharding == "sharded":
                    # A whole-model read gathers the other rank's tensors into
                    # scratch files of the store, never into memory.
                    state = model.state_dict()
                    owns = compiled.engine.store.replicas.owns
                    owned = {id(p) for p in model.parameters() if owns(p)}
                    others = [t for t in state.values() if id(t) not in owned and t.numel() > 1]
                    result["gathered_on_disk"] = bool(others) and all(map(is_store_mapped, others))
            compiled.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"{store}{rank}.json").write_text(json.dumps(result))


def test_per_rank_store_memory_is_half_with_two_ranks_and_stays_so_after_a_load(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(
        _memory_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = [json.loads((tmp_path / f"ram{r}.json").read_text()) for r in range(2)]
    # AdamW keeps exp_avg and exp_avg_sq (each the size of the master) and a
    # float32 scalar step per parameter: the replicated store holds, on every rank,
    # 3 x 4 x 16,640 + 8 x 4 = 199,712 bytes.
    replicated = 3 * N_UNITS * UNIT_BYTES + N_PARAMS * 4
    assert replicated == 199_712
    # Sharded: each rank owns 2 of the 4 equal units, whole: 3 x 2 x 16,640 =
    # 99,840 bytes, plus the 8 step scalars (kept for every parameter: 32 bytes),
    # plus a 4-byte placeholder for each master and each moment of the 4
    # parameters owned by the other rank (4 x 3 x 4 = 48 bytes): 99,920 bytes,
    # 0.5003 of the replicated store.
    sharded = 3 * (N_UNITS // 2) * UNIT_BYTES + N_PARAMS * 4 + (N_PARAMS // 2) * 3 * 4
    assert sharded == 99_920
    assert [g["replicated"] for g in got] == [replicated, replicated]
    assert [g["sharded"] for g in got] == [sharded, sharded]
    # A checkpoint's state gathered from the shards is whole, and loading it into
    # the sharded store fills the owned tensors only: memory stays at the share.
    assert [g["reload"] for g in got] == [{"whole": True, "restored": True, "bytes": sharded}] * 2
    # At most REDUCE_IN_FLIGHT of the 4 buckets' reductions in flight at once, each
    # holding a flat copy of its gradients (Note [swarm reduce], "Bounded"): before,
    # all 4 were, a whole model's gradients on every rank during the backward.
    assert REDUCE_IN_FLIGHT == 2
    for sharding in ("replicated", "sharded"):
        assert [g[f"{sharding}_in_flight"] for g in got] == [REDUCE_IN_FLIGHT] * 2


@pytest.mark.slow  # 9 s on 2 cores; the sharded disk store's training is checked by default
def test_sharded_disk_store_keeps_half_the_files_on_each_of_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(
        _memory_rank, args=(2, _free_port(), str(tmp_path), "disk"), nprocs=2, start_method="spawn"
    )
    got = [json.loads((tmp_path / f"disk{r}.json").read_text()) for r in range(2)]
    # Files of the training state: masters, gradients and AdamW's two moments,
    # 4 x 16,640 bytes a unit; the scalar step counts stay in memory. Replicated:
    # all 4 units on each rank; sharded: each rank's 2 units, exactly half.
    assert [g["replicated"] for g in got] == [4 * N_UNITS * UNIT_BYTES] * 2 == [266_240] * 2
    assert [g["sharded"] for g in got] == [4 * (N_UNITS // 2) * UNIT_BYTES] * 2
    # The store's placement counts this rank's own tensors only.
    half = (N_UNITS // 2) * UNIT_BYTES
    assert [g["sharded_placed"] for g in got] == [
        {"master": half, "state": 2 * half, "grad": half}
    ] * 2
    assert [g["gathered_on_disk"] for g in got] == [True, True]
    assert not (tmp_path / "store").exists()  # nothing left, the store's directory too


@pytest.mark.slow  # 9 s on 2 cores: with the slow tests
def test_a_sharded_rank_holds_its_masters_in_the_ram_the_others_gave_back(tmp_path):
    """RAM for half the model's masters: placed for the whole model, it held part of
    each rank's; once a rank drops the masters the other owns, it holds all of its own
    (Note [hybrid placement])."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _memory_rank, args=(2, _free_port(), str(tmp_path), "disk_ram"), nprocs=2,
        start_method="spawn",
    )  # fmt: skip
    got = [json.loads((tmp_path / f"disk_ram{r}.json").read_text()) for r in range(2)]
    half = (N_UNITS // 2) * UNIT_BYTES
    assert [g["replicated_in_ram"]["master"] for g in got] == [half] * 2  # half of all four
    assert [g["sharded_in_ram"]["master"] for g in got] == [half] * 2  # all of its two
    assert [g["sharded_placed"]["master"] for g in got] == [half] * 2


@pytest.mark.slow  # 18 s on 2 cores; test_sharded_clipping.py checks it by default
def test_sharded_gradient_clipping_uses_the_whole_models_norm(tmp_path):
    """Clipping at a norm far below the gradients' (every step clips) on 2 sharded
    ranks equals 1 rank: each rank holds only its units' gradients, and a norm of
    one shard would clip differently (by up to the ratio of the shard's norm to
    the whole model's, far outside the tolerance)."""
    from weightstream.cli.main import main
    from weightstream.context import start_run

    values = yaml.safe_load(_params(tmp_path, "gpt2", max_steps=4).read_text())
    values["optimizer"]["max_gradient_norm"] = 0.05
    values["runconfig"]["store_sharding"] = "sharded"
    params = tmp_path / "clipped.yaml"
    params.write_text(yaml.safe_dump(values))
    dirs = {"one": tmp_path / "one", "sharded": tmp_path / "sharded"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path / "cache"))
        mp.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
        for name, ranks in (("one", []), ("sharded", ["--num_csx", "2"])):
            assert main(["run", "CPU", "-p", str(params), "-o", str(dirs[name]), *ranks]) == 0
            start_run()
    one, shd = _losses(dirs["one"]), _losses(dirs["sharded"])
    torch.testing.assert_close(torch.tensor(shd), torch.tensor(one), rtol=LOSS_RTOL, atol=0)
    w1 = _checkpoint(dirs["one"], 4)["model"]
    ws = _checkpoint(dirs["sharded"], 4)["model"]
    for k in w1:
        torch.testing.assert_close(ws[k], w1[k], rtol=0, atol=WEIGHT_ATOL, msg=k)

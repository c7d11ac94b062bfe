"""activation_checkpointing (Note [activation checkpointing] in runtime/recompute.py):
each streaming unit keeps only its inputs and recomputes its forward in its backward.

Exactness: in fp32 on the CPU every run below trains bitwise like eager PyTorch
with the same torch.optim optimizer (the helpers of test_engine, test_engine_hf
and test_disk_store), dropout included. Memory: the activation bytes a forward
leaves alive, and the device weight bytes while a unit is recomputed, are
compared with the arithmetic written out.
"""

from __future__ import annotations

import copy
import gc
import json

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from test_disk_store import _assert_same_training, _train
from test_engine import MODELS, OPTIMIZERS, _assert_same_state, _batch, _loss, _matches_eager, _run
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import weightstream as cstorch
from weightstream.models import GPT, GPTConfig, Llama, LlamaConfig
from weightstream.runtime import recompute

STEPS = 6


def _recomputed(runner) -> list[str]:
    streamer = runner.engine.streamer
    return [u.display_name for u in runner.plan.units if u.index in streamer.recompute]


# ---- exactness -------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_training_matches_eager_bitwise(backend, model_name):
    """Every hazard model of test_engine: tied weights, a module called twice,
    BatchNorm and dropout, frozen parameters, root parameters around nested units."""
    make, kind = MODELS[model_name]
    make_opt = OPTIMIZERS["adamw"]
    ref, _, ref_losses = _run(make, kind, None, make_opt, steps=STEPS)
    kw = {"granularity": "module"} if backend == "ws" else {}
    model, runner, losses = _run(
        make, kind, backend, make_opt, steps=STEPS, activation_checkpointing=True, **kw
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)  # BatchNorm's statistics updated once per forward
    if backend == "ws":
        assert runner.engine.streamer.resident_bytes() == 0
        pinned = {u.display_name for u in runner.plan.units if u.pinned}
        assert set(_recomputed(runner)) == {u.display_name for u in runner.plan.units} - pinned
    else:
        assert runner._checkpointed  # applied, not ignored


def test_nested_units_recompute_inside_the_pinned_root():
    _, runner, _ = _run(
        zoo.RootParams,
        "root",
        "ws",
        OPTIMIZERS["sgd_momentum"],
        steps=1,
        granularity="module",
        activation_checkpointing=True,
    )
    # The root encloses emb and mix: it keeps its own activations (recomputing it
    # would stream the whole forward again); the units inside it recompute.
    assert [u.display_name for u in runner.plan.units if u.pinned] == ["<root>"]
    assert _recomputed(runner) == ["emb", "mix"]


def _gpt_dropout():
    return GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4, dropout=0.2))


def _llama_zoo():
    cfg = LlamaConfig(
        vocab_size=128,
        seq_len=16,
        n_layer=3,
        d_model=32,
        n_head=4,
        n_kv_head=2,
        multiple_of=16,
        attention_dropout=0.1,
    )
    return Llama(cfg)


@pytest.mark.parametrize("make", [_gpt_dropout, _llama_zoo], ids=["gpt", "llama"])
@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_zoo_models_with_dropout_match_eager_bitwise(backend, make):
    """Blocks as units (granularity 'auto' merges each block): the dropout inside a
    block draws the same numbers in the recompute, and later draws are unchanged."""
    make_opt = OPTIMIZERS["adamw"]
    ref, _, ref_losses = _run(make, "lm", None, make_opt, steps=STEPS)
    kw = {"unit_size_target": 100_000} if backend == "ws" else {}
    model, runner, losses = _run(
        make, "lm", backend, make_opt, steps=STEPS, activation_checkpointing=True, **kw
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    if backend == "ws":
        assert [f"blocks.{i}" for i in range(3)] == [
            n for n in _recomputed(runner) if n.startswith("blocks")
        ]


def test_the_recompute_draws_the_same_dropout_mask():
    """What makes the test above exact: the block's dropout runs twice per step (the
    forward, then its recompute in the backward) and draws one mask."""
    torch.manual_seed(0)
    model = _gpt_dropout()
    runner = cstorch.compile(
        model, backend="ws", unit_size_target=100_000, activation_checkpointing=True
    )
    masks = []
    model.blocks[1].drop.register_forward_hook(lambda _m, _i, out: masks.append(out == 0))
    x, y = _batch("lm", 0)
    for _ in range(2):
        _loss(runner(x), y).backward()
    assert len(masks) == 4
    assert masks[0].any() and torch.equal(masks[0], masks[1])
    assert torch.equal(masks[2], masks[3]) and not torch.equal(masks[0], masks[2])


def test_gradient_accumulation_matches_eager():
    _matches_eager(
        "gpt_tied", steps=3, accum=3, granularity="module", activation_checkpointing=True
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_updates_and_disk_store_match_eager(tmp_path, overlap):
    """GPT with tied embeddings, clipping, 2 micro-batches per step."""
    eager = _train("cpu", steps=4, micro_batches=2)
    ram = _train(
        "ws", steps=4, micro_batches=2, overlap_updates=overlap, activation_checkpointing=True
    )
    disk = _train(
        "ws",
        steps=4,
        micro_batches=2,
        overlap_updates=overlap,
        activation_checkpointing=True,
        store="disk",
        store_dir=str(tmp_path),
    )
    _assert_same_training(eager, ram)
    _assert_same_training(eager, disk)


@pytest.mark.parametrize("granularity", ["module", "auto"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_causal_lm_trains_like_eager(name, granularity):
    """transformers' GPT-2 (dropout 0.1 inside each block) and Llama (rotary tables
    passed to every decoder layer as arguments)."""
    pytest.importorskip("transformers")
    from test_engine_hf import _gpt2, _llama

    make = {"gpt2": _gpt2, "llama": _llama}[name]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(
        model,
        backend="ws",
        granularity=granularity,
        unit_size_target=100_000,
        activation_checkpointing=True,
    )
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randint(0, 300, (2, 16), generator=g)
        torch.manual_seed(step)
        expected = ref(input_ids=x, labels=x, use_cache=False).loss
        expected.backward()
        torch.manual_seed(step)
        loss = runner(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        assert torch.equal(loss, expected), step
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    assert len(_recomputed(runner)) == len(runner.plan.units) > 4
    assert runner.engine.streamer.resident_bytes() == 0


def test_bfloat16_compute_recomputes_the_same_casts():
    """compute_dtype bfloat16: no eager equal exists, but the checkpointed run
    does the arithmetic of the plain one, bit for bit."""
    make, kind = MODELS["gpt_tied"]
    kw = {"unit_size_target": 100_000, "compute_dtype": "bfloat16"}
    plain, _, plain_losses = _run(make, kind, "ws", OPTIMIZERS["adamw"], steps=3, **kw)
    model, _, losses = _run(
        make, kind, "ws", OPTIMIZERS["adamw"], steps=3, activation_checkpointing=True, **kw
    )
    assert torch.equal(losses, plain_losses)
    _assert_same_state(model, plain)


def test_exception_in_a_checkpointed_forward_restores_the_masters():
    model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws", activation_checkpointing=True)
    masters = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError):
        runner(torch.randn(4, 100))  # wrong feature size
    assert [id(p) for p in model.parameters()] == masters
    assert runner.engine.streamer.resident_bytes() == 0
    x, y = _batch("fc_mnist", 0)
    _loss(runner(x), y).backward()  # still usable
    assert all(p.grad is not None for p in model.parameters())


# ---- when nothing is recomputed --------------------------------------------------------


@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_no_grad_eval_runs_each_unit_once(backend):
    make, kind = MODELS["norm_dropout"]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(model, backend=backend, activation_checkpointing=True)
    calls = []
    model.fc2.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    x, _ = _batch(kind, 0)
    for m in (ref, runner):
        m.eval()
    with torch.no_grad():
        out, expected = runner(x), ref(x)
    assert torch.equal(out, expected) and out.grad_fn is None
    assert calls == [False]
    if backend == "ws":
        assert _recomputed(runner)  # would recompute with grad enabled
        assert runner.engine.streamer.resident_bytes() == 0


def test_unit_called_outside_the_compiled_forward_recomputes_too():
    """The user calls a submodule of the original model directly (a one-off sequence)."""
    torch.manual_seed(0)
    ref = zoo.gpt_tied()
    torch.manual_seed(0)
    model = zoo.gpt_tied()
    runner = cstorch.compile(
        model, backend="ws", unit_size_target=100_000, activation_checkpointing=True
    )
    x, y = _batch("lm", 0)
    _loss(runner(x), y).backward()  # plans the units: each block one
    assert "blocks.1" in _recomputed(runner)
    _loss(ref(x), y).backward()
    h = torch.randn(4, 16, 32, requires_grad=True)
    h_ref = h.detach().clone().requires_grad_()
    calls = []
    # A module inside the unit: the unit's own hooks run once, around the whole call.
    model.blocks[1].mlp.fc.register_forward_hook(lambda *_: calls.append(1))
    model.blocks[1](h).square().sum().backward()
    ref.blocks[1](h_ref).square().sum().backward()
    assert calls == [1, 1]  # the forward, then its recompute in the backward
    assert torch.equal(h.grad, h_ref.grad)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n
    assert runner.engine.streamer.resident_bytes() == 0


class _Scaled(nn.Module):
    def __init__(self, d_in: int):
        super().__init__()
        self.fc = nn.Linear(d_in, 16)

    def forward(self, x, scale):
        return torch.tanh(self.fc(x) * scale)


class _PassesItsWeight(nn.Module):
    """The root hands its own parameter to its children: their forwards read a weight
    held by the enclosing (pinned) root unit."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((16,), 1.5))
        self.a = _Scaled(20)
        self.b = _Scaled(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.b(self.a(x, self.scale), self.scale))


def test_units_reading_an_enclosing_units_weight_keep_their_activations():
    make = _PassesItsWeight
    ref, _, ref_losses = _run(make, "vec", None, OPTIMIZERS["adamw"], steps=3)
    model, runner, losses = _run(
        make,
        "vec",
        "ws",
        OPTIMIZERS["adamw"],
        steps=3,
        unit_modules=["a", "b"],
        activation_checkpointing=True,
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    assert _recomputed(runner) == ["head"]  # a and b read the root's scale


def test_a_setting_no_unit_can_apply_warns():
    class OnlyReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.full((16,), 1.5))
            self.a = _Scaled(16)

        def forward(self, x):
            return self.a(x, self.scale)

    runner = cstorch.compile(
        OnlyReaders(), backend="ws", unit_modules=["a"], activation_checkpointing=True
    )
    with pytest.warns(UserWarning, match="activation_checkpointing is ignored"):
        runner(torch.randn(4, 16)).sum().backward()


def test_eager_backend_warns_that_it_ignores_the_setting():
    config = cstorch.StreamingConfig(activation_checkpointing=True)
    with pytest.warns(UserWarning, match="activation_checkpointing is ignored by backend 'cpu'"):
        cstorch.compile(zoo.fc_mnist(), backend="cpu", streaming=config)
    with pytest.raises(TypeError, match="only to weight streaming"):
        cstorch.compile(zoo.fc_mnist(), backend="cpu", activation_checkpointing=True)
    with pytest.raises(TypeError, match="it takes activation_checkpointing"):
        cstorch.compile(
            zoo.fc_mnist(), backend="lp", activation_checkpointing=True, prefetch_depth=2
        )


# ---- memory ------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _Stack(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.blocks = nn.ModuleList(_MLP(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _AliveOutputs(TorchDispatchMode):
    """Every storage an operator produced on this thread, by weak reference: what a
    forward leaves alive is what its graph keeps for the backward."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def alive_bytes(self, *exclude: torch.Tensor) -> int:
        gc.collect()
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(
            n for k, (ref, n) in self.storages.items() if not ref.expired() and k not in skip
        )


N, D, B = 4, 32, 8
FP32 = 4


def _activation_bytes(backend, **kw) -> int:
    torch.manual_seed(0)
    model = _Stack(N, D)
    runner = model if backend is None else cstorch.compile(model, backend=backend, **kw)
    x = torch.randn(B, D)
    runner(x).sum().backward()  # plans the units; the next forward is the measured one
    with _AliveOutputs() as alive:
        out = runner(x)
    # The weights' own storage (the transposed views the eager matmuls save) is no activation.
    kept = alive.alive_bytes(out, *model.parameters())
    out.sum().backward()
    return kept


@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_activation_memory_drops_to_the_units_inputs(backend):
    """A stack of N MLP blocks [B, D] -> [B, 4D] -> [B, D], each block a unit.

    Without checkpointing each block keeps fc1's input [B, D], GELU's input
    [B, 4D] and fc2's input [B, 4D] (the first block's input is the caller's x,
    not produced by the forward). With it each block keeps its input only."""
    unit = {"unit_classes": [_MLP]} if backend == "ws" else {}
    eager = _activation_bytes(None)
    plain = _activation_bytes(backend, **unit) if backend == "ws" else eager
    checkpointed = _activation_bytes(backend, activation_checkpointing=True, **unit)
    block_inputs = (N - 1) * B * D * FP32  # 3,072 bytes
    block_insides = N * 2 * B * 4 * D * FP32  # 32,768 bytes
    assert eager == plain == block_inputs + block_insides
    assert checkpointed == block_inputs


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_recompute_holds_one_unit_plus_the_prefetch(depth):
    """Invariant 2 with recomputes, written out: while the backward recomputes a
    block, at most (depth + 1) x the largest unit is resident; with depth 0,
    exactly the block being recomputed. Each step fetches every unit twice: once
    for the forward, once for its recompute."""
    torch.manual_seed(0)
    model = _Stack(N, D)
    runner = cstorch.compile(
        model,
        backend="ws",
        unit_classes=[_MLP],
        prefetch_depth=depth,
        activation_checkpointing=True,
    )
    streamer_of = lambda: runner.engine.streamer  # noqa: E731 (built at the first call)
    seen = []  # (in a backward, resident bytes) each time an fc1 runs

    def probe(_m, _inp, _out):
        in_backward = torch._C._current_graph_task_id() != -1
        seen.append((in_backward, streamer_of().resident_bytes()))

    for block in model.blocks:
        block.fc1.register_forward_hook(probe)
    x = torch.randn(B, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        runner(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        gc.collect()
        assert streamer_of().resident_bytes() == 0
    block_bytes = (D * 4 * D + 4 * D + 4 * D * D + D) * FP32  # 33,408
    plan = runner.plan
    assert plan.largest_unit_bytes == block_bytes and plan.pinned_bytes == 0
    recomputes = [b for in_backward, b in seen if in_backward]
    assert len(recomputes) == 2 * N  # every block, in both steps
    assert all(b <= (depth + 1) * block_bytes for b in recomputes)
    if depth == 0:
        assert recomputes == [block_bytes] * (2 * N)
    assert streamer_of().meter.peak_bytes <= (depth + 1) * block_bytes
    assert streamer_of().meter.total_fetched_bytes == 2 * 2 * N * block_bytes


# ---- installation ------------------------------------------------------------------------


def test_close_restores_the_modules_own_forward_and_copies_stay_plain():
    model = zoo.gpt_tied()
    runner = cstorch.compile(
        model, backend="ws", granularity="module", activation_checkpointing=True
    )
    x, y = _batch("lm", 0)
    _loss(runner(x), y).backward()
    fc = model.blocks[0].mlp.fc
    assert isinstance(fc.forward, recompute.UnitForward)
    # A deep copy (the meta-device trace makes one) runs its own module's forward.
    twin = copy.deepcopy(fc)
    assert twin.forward.__self__ is twin and not isinstance(twin.forward, recompute.UnitForward)
    assert torch.equal(twin(torch.ones(2, 32)), F.linear(torch.ones(2, 32), fc.weight, fc.bias))
    runner.close()
    assert "forward" not in fc.__dict__  # the class's forward again
    lp_model = zoo.fc_mnist()
    lp = cstorch.compile(lp_model, backend="lp", activation_checkpointing=True)
    assert any("forward" in m.__dict__ for m in lp_model.modules())
    lp.close()
    assert not any("forward" in m.__dict__ for m in lp_model.modules())


def test_params_file_key():
    from weightstream.cli.params import RunConfigParams

    rc = RunConfigParams.from_dict({"activation_checkpointing": True})
    assert rc.streaming.activation_checkpointing is True
    assert rc.to_dict()["activation_checkpointing"] is True
    with pytest.raises((TypeError, ValueError), match="activation_checkpointing"):
        RunConfigParams.from_dict({"activation_checkpointing": "sometimes"})


# Layer pipelined with the slow tests (the default suite's 15 minutes).
@pytest.mark.parametrize(
    "mode", ["weight_streaming", pytest.param("layer_pipelined", marks=pytest.mark.slow)]
)
def test_run_command_applies_the_runconfig_key(tmp_path, monkeypatch, mode):
    """runconfig activation_checkpointing: true reaches both execution modes of the
    run command, whose losses equal those of the same run without it."""
    pytest.importorskip("tensorboard")
    import logging

    import params_files as pf

    logging.getLogger("weightstream").handlers.clear()
    calls = []
    library_checkpoint = recompute.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return library_checkpoint(*args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counting)

    def losses(name: str, **runconfig) -> list[float]:
        out = tmp_path / name
        rc = {"max_steps": 3, "execution_mode": mode, **runconfig}
        values = pf.train_tiny_gpt2(out, pf.adamw(1e-3), rc)
        (compile_dir,) = out.glob("ws_*")
        plans[name] = json.loads((compile_dir / "plan.json").read_text())
        return values

    plans: dict[str, dict] = {}
    plain = losses("plain")
    assert calls == []
    checkpointed = losses("checkpointed", activation_checkpointing=True)
    assert calls  # the units' calls ran under the checkpoint
    assert checkpointed == plain
    # The compile estimate prices the recompute: the forward's FLOPs again in the
    # backward of every recomputed unit (the two blocks at least), nothing else.
    again = plans["checkpointed"]["estimate_settings"]["recompute"]
    assert plans["plain"]["estimate_settings"]["recompute"] == []
    units = {u["index"]: u for u in plans["checkpointed"]["units"]}
    assert len(again) >= 2 and set(again) <= set(units)
    # (layer pipelined costs module by module: the units inside the blocks)
    blocks = {i for i, u in units.items() if u["name"].startswith("blocks.")}
    assert blocks and blocks <= set(again)
    for i in again:
        before, after = plans["plain"]["units"][i], units[i]
        assert after["est_overhead_s"] > before["est_overhead_s"]  # its operators again
        if after["fwd_flops"]:
            assert after["est_compute_s"] > before["est_compute_s"]  # its FLOPs again


@pytest.mark.slow  # 25 s on 2 cores; a sharded store's two ranks are exact by default
def test_two_ranks_with_a_sharded_store_recompute_exactly(tmp_path):
    """Data parallel, sharded store: a recompute's fetch is a broadcast from the unit's
    owner, issued inside the backward on every rank in the same order. Same losses
    and weights as the same 2-rank run without checkpointing."""
    pytest.importorskip("tensorboard")
    import yaml
    from test_distributed import _final_weights, _losses, _params

    from weightstream.cli.main import main
    from weightstream.context import start_run

    values = yaml.safe_load(_params(tmp_path, "gpt2", max_steps=3).read_text())
    for name, on in (("plain", False), ("checkpointed", True)):
        values["runconfig"].update(store_sharding="sharded", activation_checkpointing=on)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        out = str(tmp_path / name)
        assert main(["run", "CPU", "-p", str(path), "-o", out, "--num_csx", "2"]) == 0
        start_run()
    assert _losses(tmp_path / "plain") == _losses(tmp_path / "checkpointed")
    a, b = (_final_weights(tmp_path / n, 3) for n in ("plain", "checkpointed"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

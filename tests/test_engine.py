"""The weight-streaming engine against plain eager PyTorch.

Every training comparison runs the same model (same initial weights), the same
batches and the same torch.optim optimizer three ways: eager PyTorch, layer
pipelined (LP) and weight streaming (WS). In fp32 on the CPU the arithmetic is
the same, so losses, final weights and buffers must be bitwise equal.
"""

from __future__ import annotations

import gc
import re

import models as zoo
import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch

STEPS = 20


def _batch(kind: str, step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    if kind == "fc_mnist":
        return torch.randn(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g)
    if kind == "lm":
        x = torch.randint(0, 128, (4, 16), generator=g)
        return x, torch.roll(x, -1, dims=1)
    if kind == "root":
        x = torch.randint(0, 50, (4, 8), generator=g)
        return x, torch.roll(x, -1, dims=1)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(out, y):
    if out.dim() == 3:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


MODELS = {
    "fc_mnist": (zoo.fc_mnist, "fc_mnist"),
    "gpt_tied": (zoo.gpt_tied, "lm"),
    "called_twice": (zoo.CalledTwice, "vec"),
    "norm_dropout": (zoo.NormDropout, "vec"),
    "partly_frozen": (zoo.PartlyFrozen, "vec"),
    "root_params": (zoo.RootParams, "root"),
}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


def _run(make, kind, backend, make_opt, steps=STEPS, accum=1, **compile_kw):
    torch.manual_seed(0)
    model = make()
    runner = model if backend is None else cstorch.compile(model, backend=backend, **compile_kw)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = _batch(kind, step * accum + micro)
            torch.manual_seed(step * 100 + micro)  # dropout draws
            loss = _loss(runner(x), y) / accum
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return model, runner, torch.stack(losses)


def _matches_eager(model_name, opt_name="adamw", steps=STEPS, accum=1, **compile_kw):
    """Streamed training of a zoo model equals eager PyTorch's bit for bit (losses,
    weights, buffers); returns the compiled runner."""
    make, kind = MODELS[model_name]
    ref, _, ref_losses = _run(make, kind, None, OPTIMIZERS[opt_name], steps, accum)
    model, runner, losses = _run(make, kind, "ws", OPTIMIZERS[opt_name], steps, accum, **compile_kw)
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    return runner


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_training_matches_eager_bitwise(backend, model_name, opt_name):
    make, kind = MODELS[model_name]
    make_opt = OPTIMIZERS[opt_name]
    ref, _, ref_losses = _run(make, kind, None, make_opt)
    # granularity="module": one unit per layer, the most streaming the model allows.
    kw = {"granularity": "module"} if backend == "ws" else {}
    model, runner, losses = _run(make, kind, backend, make_opt, **kw)
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)  # weights and buffers (BatchNorm running stats)
    if backend == "ws":
        assert runner.engine.streamer.resident_bytes() == 0


@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_gradient_accumulation_matches_eager(backend):
    make, kind = MODELS["gpt_tied"]
    ref, _, ref_losses = _run(make, kind, None, OPTIMIZERS["adamw"], steps=6, accum=4)
    model, _, losses = _run(make, kind, backend, OPTIMIZERS["adamw"], steps=6, accum=4)
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)


@pytest.mark.parametrize("backend", ["ws", "lp"])
def test_eval_under_no_grad_streams_forward_only(backend):
    make, kind = MODELS["norm_dropout"]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    runner = cstorch.compile(model, backend=backend)
    ref.eval()
    runner.eval()
    assert not model.training  # eval() reaches the original module
    x, _ = _batch(kind, 0)
    with torch.no_grad():
        out = runner(x)
        expected = ref(x)
    assert torch.equal(out, expected)
    assert out.grad_fn is None
    if backend == "ws":
        assert runner.engine.streamer.resident_bytes() == 0
        assert all(p.grad is None for p in model.parameters())


def test_root_and_foreign_parameters_are_streamed():
    model = zoo.RootParams()
    runner = cstorch.compile(model, backend="ws", granularity="module")
    x, y = _batch("root", 0)
    _loss(runner(x), y).backward()
    units = {u.display_name: u for u in runner.plan.units}
    root = units["<root>"]
    # The root's own parameters form a unit pinned for the root's whole forward,
    # and the child weight it reads directly is fetched into that window too.
    assert root.pinned
    assert {id(p) for p in root.params} >= {id(model.scale), id(model.offset), id(model.emb.weight)}
    assert [id(p) for p in root.foreign] == [id(model.emb.weight)]


def test_tied_weights_get_one_summed_gradient():
    torch.manual_seed(0)
    ref = zoo.gpt_tied()
    torch.manual_seed(0)
    model = zoo.gpt_tied()
    runner = cstorch.compile(model, backend="ws", granularity="module")
    x, y = _batch("lm", 0)
    _loss(ref(x), y).backward()
    _loss(runner(x), y).backward()
    assert model.wte.weight is model.lm_head.weight
    assert torch.equal(model.wte.weight.grad, ref.wte.weight.grad)


class _WithUnusedWeight(torch.nn.Module):
    """Each block holds a Linear that its forward never calls."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 8)
            self.unused = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.used(x))

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(20, 8)
        self.blocks = torch.nn.ModuleList([self.Block(), self.Block()])
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_weight_the_loss_does_not_use_gets_no_gradient_and_is_not_stepped():
    """Eager PyTorch leaves such a weight's .grad None and AdamW skips it; a zero
    gradient would decay it and move its moments."""

    def make():
        torch.manual_seed(0)
        return _WithUnusedWeight()

    ref, _, ref_losses = _run(make, "vec", None, OPTIMIZERS["adamw"], steps=3)
    model, runner, losses = _run(
        make, "vec", "ws", OPTIMIZERS["adamw"], steps=3, unit_classes=(_WithUnusedWeight.Block,)
    )
    assert torch.equal(losses, ref_losses)
    _assert_same_state(model, ref)
    x, y = _batch("vec", 0)
    _loss(runner(x), y).backward()
    assert all(b.unused.weight.grad is None for b in model.blocks)
    assert all(b.used.weight.grad is not None for b in model.blocks)


def test_state_dict_reads_and_writes_the_store():
    torch.manual_seed(0)
    model = zoo.gpt_tied()
    runner = cstorch.compile(model, backend="ws")
    x, y = _batch("lm", 0)
    _loss(runner(x), y).backward()
    sd = runner.state_dict()
    assert sd.keys() == model.state_dict().keys()
    zeros = {k: torch.zeros_like(v) for k, v in sd.items()}
    runner.load_state_dict(zeros)
    assert all((p == 0).all() for p in model.parameters())
    with torch.no_grad():
        out = runner(x)
    assert torch.equal(out, torch.zeros_like(out))


def test_parameters_of_compiled_module_are_the_masters():
    model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws")
    assert [id(p) for p in runner.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in runner.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.device.type == "cpu" for p in runner.parameters())


# ---- memory bound ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_device_weight_bytes_stay_within_the_bound(depth):
    """Invariant 2, written out: peak <= (depth + 1) x largest unit + pinned units."""
    torch.manual_seed(0)
    model = zoo.gpt_tied()
    runner = cstorch.compile(model, backend="ws", granularity="module", prefetch_depth=depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch("lm", 0)
    for _ in range(3):
        _loss(runner(x), y).backward()
        opt.step()
        opt.zero_grad()
        gc.collect()
        # Between steps no device copy of any weight exists.
        assert runner.engine.streamer.resident_bytes() == 0

    plan = runner.plan
    streamer = runner.engine.streamer
    fp32 = 4
    # Largest unit of this GPT (vocab 128, d_model 32): the tied embedding
    # (wte and lm_head each fetch it), 128 x 32 fp32 = 16,384 bytes; the MLP
    # input layer is 32 x 128 + 128 = 4,224 params = 16,896 bytes and is larger.
    largest = (32 * 128 + 128) * fp32
    assert plan.largest_unit_bytes == largest
    # The root owns no parameters and nothing reads foreign weights: nothing pinned.
    pinned = 0
    assert plan.pinned_bytes == pinned
    bound = (depth + 1) * largest + pinned
    assert streamer.meter.peak_bytes <= bound
    # and streaming really holds more than one unit when it prefetches
    if depth > 0:
        assert streamer.meter.peak_bytes > largest


def test_pinned_units_are_counted_in_the_bound():
    model = zoo.RootParams()
    runner = cstorch.compile(model, backend="ws", granularity="module", prefetch_depth=1)
    x, y = _batch("root", 0)
    _loss(runner(x), y).backward()
    plan = runner.plan
    fp32 = 4
    emb = 50 * 16 * fp32  # 3,200
    root = (16 + 16) * fp32 + emb  # scale + offset + the emb weight it reads: 3,328
    mix = (16 * 16 + 16) * fp32  # 1,088
    assert plan.pinned_bytes == root
    assert plan.largest_unit_bytes == root
    assert runner.engine.streamer.meter.peak_bytes <= (1 + 1) * root + root
    assert {u.display_name: u.weight_bytes for u in plan.units} == {
        "<root>": root,
        "emb": emb,
        "mix": mix,
    }


def test_weights_are_freed_after_each_unit_window():
    """The device copy of a unit dies when its forward ends (nothing keeps it alive)."""
    model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws", granularity="module", prefetch_depth=0)
    seen = []

    def probe(_m, _inp, _out):
        seen.append(runner.engine.streamer.resident_bytes())

    for layer in (model.net[1], model.net[3], model.net[5]):
        layer.register_forward_hook(probe, prepend=True)  # runs before the streamer's hook
    x, _ = _batch("fc_mnist", 0)
    out = runner(x)
    sizes = [u.weight_bytes for u in runner.plan.units]
    assert seen == sizes  # exactly one unit resident while each layer runs
    assert runner.engine.streamer.resident_bytes() == 0  # none after forward
    out.sum().backward()
    assert runner.engine.streamer.resident_bytes() == 0  # none after backward


# ---- plan and errors ------------------------------------------------------------


def test_auto_granularity_merges_blocks_up_to_the_size_target():
    model = zoo.gpt_tied()
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    runner = cstorch.compile(model, backend="ws", unit_size_target=block_bytes)
    x, _ = _batch("lm", 0)
    runner(x)
    names = [u.display_name for u in runner.plan.units]
    assert names == [
        "wte",
        "wpe",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "ln_f",
        "lm_head",
    ]


def test_explicit_unit_classes_and_names():
    model = zoo.gpt_tied()
    runner = cstorch.compile(
        model, backend="ws", granularity="module", unit_classes=("Block",), unit_modules=["ln_f"]
    )
    names = [u.display_name for u in runner.plan.units]
    assert names[2:6] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with pytest.raises(ValueError, match="unknown module"):
        cstorch.compile(zoo.gpt_tied(), backend="ws", unit_modules=["blocks.9"])


def test_unit_larger_than_budget_fails_before_the_first_step():
    model = zoo.gpt_tied()
    with pytest.raises(ValueError) as info:
        cstorch.compile(model, backend="ws", granularity="module", device_memory_budget=10_000)
    msg = str(info.value)
    assert "'wte'" in msg and "16,384 bytes" in msg and "10,000 bytes" in msg
    assert all(p.grad is None for p in model.parameters())


def test_bound_larger_than_budget_names_the_terms():
    model = zoo.fc_mnist()
    largest = (784 * 256 + 256) * 4
    with pytest.raises(ValueError, match=r"\(prefetch_depth 1 \+ 1\) x largest unit"):
        cstorch.compile(model, backend="ws", granularity="module", device_memory_budget=largest + 1)


def test_bad_backend_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        cstorch.compile(zoo.fc_mnist(), backend="tpu")
    for name in ("WSE_WS", "wse_ws", "ws", "WSE_LP", "lp", "cpu", "gpu"):
        assert name in str(info.value)


@pytest.mark.parametrize("second", ["ws", "lp"])
def test_compiling_a_streamed_module_again_is_refused_until_closed(second):
    """A second compile would hook the module twice; closing the first releases it."""
    torch.manual_seed(0)
    model = zoo.fc_mnist()
    first = cstorch.compile(model, backend="ws")
    x = torch.randn(4, 784)
    with pytest.raises(ValueError, match="compiled for weight streaming already"):
        cstorch.compile(model, backend=second)
    expected = model(x)  # eager, with the first compile's weights
    first.close()
    again = cstorch.compile(model, backend=second)
    torch.testing.assert_close(again(x), expected, rtol=0, atol=0)
    opt = cstorch.optim.SGD(again.parameters(), lr=0.1)  # binds to the new one only
    again(x).sum().backward()
    opt.step()


def test_a_meta_model_in_the_ram_store_is_refused_at_its_first_step(tmp_path):
    """The RAM store keeps a meta model as shapes (to plan it); running it names the fixes,
    and the disk store, which materializes it, runs it."""
    with torch.device("meta"):
        model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws")
    with pytest.raises(RuntimeError, match=r"on the meta device .* store='disk'"):
        runner(torch.randn(4, 784))
    runner.close()
    with torch.device("meta"):
        model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws", store="disk", store_dir=str(tmp_path))
    assert torch.isfinite(runner(torch.randn(4, 784))).all()
    runner.close()


@pytest.mark.parametrize("backend", ["WSE_WS", "wse_ws", "ws", "WSE_LP", "wse_lp", "lp", "cpu"])
def test_backend_names(backend):
    runner = cstorch.compile(zoo.fc_mnist(), backend=backend)
    expected = {
        "ws": cstorch.ExecutionMode.WEIGHT_STREAMING,
        "lp": cstorch.ExecutionMode.LAYER_PIPELINED,
        "cp": cstorch.ExecutionMode.EAGER,
    }[backend.lower().replace("wse_", "")[:2]]
    assert runner.mode is expected


def test_streaming_config_validation():
    with pytest.raises(ValueError, match="prefetch_depth"):
        cstorch.StreamingConfig(prefetch_depth=-1)
    with pytest.raises(ValueError, match="granularity"):
        cstorch.StreamingConfig(granularity="layers")
    with pytest.raises(TypeError, match="only to weight streaming"):
        cstorch.compile(zoo.fc_mnist(), backend="lp", prefetch_depth=2)
    # a params-file key: the answer is the model's dtype, not compute_dtype
    for call in (lambda: cstorch.compile(zoo.fc_mnist(), master_dtype=torch.bfloat16),
                 lambda: cstorch.configure(master_dtype="bfloat16")):  # fmt: skip
        with pytest.raises(TypeError, match=r"model\.to\(torch\.bfloat16\)"):
            call()


def test_exception_in_forward_restores_the_masters():
    model = zoo.fc_mnist()
    runner = cstorch.compile(model, backend="ws")
    masters = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError):
        runner(torch.randn(4, 100))  # wrong feature size
    assert [id(p) for p in model.parameters()] == masters
    assert runner.engine.streamer.resident_bytes() == 0
    x, y = _batch("fc_mnist", 0)
    _loss(runner(x), y).backward()  # still usable


def test_unit_classes_are_honoured_when_an_ancestor_fits_the_unit_size_target():
    """A small transformers Llama fits unit_size_target whole; its decoder layers,
    chosen by class, must still be units of their own under granularity='auto'."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    runner = cstorch.compile(model, backend="ws", unit_classes=["LlamaDecoderLayer"])
    runner(torch.randint(0, 64, (2, 5)))
    names = [u.display_name for u in runner.plan.units]
    layers = [f"model.layers.{i}" for i in range(3)]
    assert [n for n in names if n in layers] == layers, names
    runner.close()
    by_name = cstorch.compile(zoo.gpt_tied(), backend="ws", unit_modules=["blocks.1"])
    assert "blocks.1" in [u.display_name for u in by_name.plan.units]


def test_nested_chosen_units_are_refused_with_a_message():
    with pytest.raises(ValueError, match=re.escape("'blocks.1' and module 'blocks.1.attn'")):
        cstorch.compile(zoo.gpt_tied(), backend="ws", unit_modules=["blocks.1", "blocks.1.attn"])

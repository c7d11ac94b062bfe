"""Compact optimizer state and bf16 masters with Kahan compensation (Notes [compact
optimizer state] and [Kahan summation] in optim/compact.py).

Streamed training with compact state is the same arithmetic as the same optimizer on
the uncompiled model run eagerly, so the two are compared bit for bit; the codecs and
the compensation are checked against independent references (a float32 run, the
written-out code map).
"""

from __future__ import annotations

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from test_optim import run as _run_small  # one optimizer over copies of the params

import weightstream as cstorch
from weightstream.optim.compact import BLOCK, Moment

STEPS = 6


def _batch(step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randint(0, 128, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _model(master_dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.gpt_tied().to(master_dtype)


# Each optimizer with options that reach its weight decay (L2 or decoupled).
FAMILY = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "NAdam": dict(lr=1e-2, weight_decay=0.1),
    "RAdam": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "Adamax": dict(lr=1e-2, weight_decay=0.1),
}


def _optimizer(model, state_dtype, name="AdamW", **kw):
    options = {**FAMILY[name], **kw}
    return getattr(cstorch.optim, name)(model.parameters(), state_dtype=state_dtype, **options)


def _train(runner, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = F.cross_entropy(runner(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _assert_same(model_a, opt_a, model_b, opt_b):
    opt_a.synchronize()  # an overlapped step is complete
    opt_b.synchronize()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for key, value in sa[i].items():
            assert value.dtype == sb[i][key].dtype and torch.equal(value, sb[i][key]), (i, key)


GRID = [
    # (master dtype, state_dtype, store)
    (torch.bfloat16, "float32", "ram"),  # bf16 masters + Kahan
    (torch.bfloat16, "bfloat16", "ram"),  # + bf16 state
    (torch.float32, "int8", "ram"),
    (torch.float32, "bfloat16", "ram"),
    (torch.bfloat16, "int8", "disk"),
    (torch.float32, "int8", "disk"),
]


@pytest.mark.parametrize("master_dtype, state_dtype, store", GRID)
def test_streamed_training_with_compact_state_matches_eager_bitwise(
    tmp_path, master_dtype, state_dtype, store
):
    ref = _model(master_dtype)
    ref_opt = _optimizer(ref, state_dtype)
    ref_losses = _train(ref, ref_opt, STEPS)

    model = _model(master_dtype)
    kw = {"store": "disk", "store_dir": str(tmp_path)} if store == "disk" else {}
    runner = cstorch.compile(model, backend="wse_ws", device="cpu", granularity="module", **kw)
    opt = _optimizer(model, state_dtype)
    losses = _train(runner, opt, STEPS)

    assert torch.equal(losses, ref_losses)
    _assert_same(model, opt, ref, ref_opt)
    state = opt.state[next(model.parameters())]
    assert ("kahan_comp" in state) == (master_dtype == torch.bfloat16)
    if store == "disk":
        tier = runner.engine.store.tier
        assert all(tier.holds(v) for st in opt.state.values() for v in st.values() if v.dim())


def test_overlapped_updates_with_compact_state_match_eager_bitwise():
    ref = _model(torch.bfloat16)
    ref_opt = _optimizer(ref, "int8")
    ref_losses = _train(ref, ref_opt, STEPS)
    model = _model(torch.bfloat16)
    runner = cstorch.compile(model, backend="ws", granularity="module", overlap_updates=True)
    opt = _optimizer(model, "int8")
    assert torch.equal(_train(runner, opt, STEPS), ref_losses)
    _assert_same(model, opt, ref, ref_opt)


@pytest.mark.parametrize(
    "master_dtype, state_dtype", [(torch.bfloat16, "bfloat16"), (torch.float32, "int8")]
)
def test_checkpoint_round_trip_and_exact_resume(tmp_path, master_dtype, state_dtype):
    """N steps, save, M more == a fresh run loading the checkpoint and running M."""
    model = _model(master_dtype)
    runner = cstorch.compile(model, backend="ws", granularity="module")
    opt = _optimizer(model, state_dtype)
    _train(runner, opt, 3)
    path = tmp_path / "ckpt.mdl"
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    straight = _train(runner, opt, 3, first=3)

    resumed = _model(master_dtype)
    runner2 = cstorch.compile(resumed, backend="ws", granularity="module")
    opt2 = _optimizer(resumed, state_dtype)
    saved = cstorch.load(path)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    after_load = opt2.state_dict()["state"]
    for i, st in saved["optimizer"]["state"].items():
        for key, value in st.items():
            assert after_load[i][key].dtype == torch.as_tensor(value).dtype, (i, key)
    again = _train(runner2, opt2, 3, first=3)
    assert torch.equal(straight, again)
    _assert_same(model, opt, resumed, opt2)


# ------------------------------------------------------------------ Kahan summation


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_kahan_keeps_updates_below_half_an_ulp(optimizer):
    """A bfloat16 weight of 1.0 (ulp 2**-7) gets 1000 updates of about 1e-4, each below
    half an ulp: with the compensation it ends within one bf16 ulp of a float32 run of
    the same updates; without it, it never moves."""

    def run(dtype, kahan):
        w = torch.nn.Parameter(torch.ones(64, dtype=dtype))
        if optimizer == "sgd":
            opt = cstorch.optim.SGD([w], lr=1e-4, momentum=0.9, kahan_summation=kahan)
        else:
            opt = cstorch.optim.AdamW([w], lr=1e-4, kahan_summation=kahan)
        g = torch.Generator().manual_seed(0)
        for _ in range(1000):
            w.grad = (torch.rand(64, generator=g) + 0.1).to(dtype)
            opt.step()
        return w.detach().float()

    reference = run(torch.float32, True)  # float32: no buffer, torch's arithmetic
    assert (1 - reference).min() > 0.05  # it moved by many ulps of bf16
    kahan = run(torch.bfloat16, True)
    assert (kahan - reference).abs().max() <= 2**-8  # one bf16 ulp in [0.5, 1)
    assert torch.equal(run(torch.bfloat16, False), torch.ones(64))


def test_kahan_is_a_no_op_for_float32_parameters():
    w = torch.nn.Parameter(torch.ones(8))
    opt = cstorch.optim.AdamW([w], kahan_summation=True)
    assert "kahan_comp" not in opt.state[w]


# ------------------------------------------------------------------ the int8 codec


def test_int8_state_layout_and_bytes():
    w = torch.nn.Parameter(torch.zeros(1000, 3))
    state = cstorch.optim.AdamW([w], state_dtype=torch.int8).state[w]
    blocks = -(-3000 // BLOCK)
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg"].shape == w.shape
    assert state["exp_avg_sq"].dtype == torch.uint8
    assert state["exp_avg_scale"].shape == state["exp_avg_sq_scale"].shape == (blocks,)
    nbytes = sum(v.nbytes for k, v in state.items() if k != "step")
    assert nbytes == 2 * w.numel() + 2 * 4 * blocks


def test_int8_amsgrad_keeps_its_maximum_as_a_root_coded_moment():
    """AMSGrad's running maximum in int8 state: uint8 codes of its root with a scale
    per block, as exp_avg_sq's; the codes of the maximum never fall below those of
    exp_avg_sq in its block where both share a scale."""
    w = torch.nn.Parameter(torch.zeros(1000, 3))
    # beta2 = 0.5: exp_avg_sq decays fast once the gradients shrink, the maximum stays.
    opt = cstorch.optim.AdamW([w], state_dtype=torch.int8, amsgrad=True, betas=(0.9, 0.5))
    state = opt.state[w]
    blocks = -(-3000 // BLOCK)
    assert state["max_exp_avg_sq"].dtype == torch.uint8
    assert state["max_exp_avg_sq"].shape == w.shape
    assert state["max_exp_avg_sq_scale"].shape == (blocks,)
    nbytes = sum(v.nbytes for k, v in state.items() if k != "step")
    assert nbytes == 3 * w.numel() + 3 * 4 * blocks
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 0.01, 0.01, 0.01, 0.01):  # large gradients, then small
        w.grad = torch.randn(w.shape, generator=g) * scale
        opt.step()
    v = state["exp_avg_sq_scale"]
    top = state["max_exp_avg_sq_scale"]
    assert (top >= v).all() and (top > 2 * v).any()


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_int8_amsgrad_streamed_matches_eager_bitwise(master_dtype):
    ref = _model(master_dtype)
    ref_opt = _optimizer(ref, "int8", amsgrad=True)
    ref_losses = _train(ref, ref_opt, STEPS)
    model = _model(master_dtype)
    runner = cstorch.compile(model, backend="ws", granularity="module", overlap_updates=True)
    opt = _optimizer(model, "int8", amsgrad=True)
    assert torch.equal(_train(runner, opt, STEPS), ref_losses)
    _assert_same(model, opt, ref, ref_opt)
    assert all("max_exp_avg_sq_scale" in st for st in opt.state.values())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_compact_amsgrad_tracks_torch_amsgrad(state_dtype):
    """AMSGrad with compact state changes the update by its rounding only: after 20
    steps the parameters are where torch.optim.AdamW(amsgrad=True) takes them, to a
    few percent of how far they moved (measured: 0.6% / 0.6% / 2.7% for int8, plain
    AdamW 20-25% away). Gradients that shrink, with a short beta2, make the maximum
    differ from exp_avg_sq."""
    init, grads = _small_problem()
    grads = [[g * 0.8**k for g in step] for k, step in enumerate(grads)]
    options = {"lr": 1e-2, "betas": (0.9, 0.9), "eps": 1e-6, "weight_decay": 0.0}
    want = _run_small(lambda ps: torch.optim.AdamW(ps, amsgrad=True, **options), init, grads)[0]
    got = _run_small(
        lambda ps: cstorch.optim.AdamW(ps, state_dtype=state_dtype, amsgrad=True, **options),
        init,
        grads,
    )[0]
    plain = _run_small(lambda ps: torch.optim.AdamW(ps, **options), init, grads)[0]
    for w0, w, ours, adam in zip(init, want, got, plain):
        moved = (w - w0).abs().max()
        assert moved > 0.05
        assert (ours - w).abs().max() < 0.05 * moved
        assert (adam - w).abs().max() > 0.1 * moved  # the maximum changed the steps


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "exp_inf"])
def test_int8_codes_follow_the_square_law_map(key):
    """Written out: code q = round(Q sqrt(|x| / blockmax)), value blockmax (q / Q)**2,
    where x is exp_avg, the square root of exp_avg_sq, or exp_inf itself."""
    signed = key == "exp_avg"
    torch.manual_seed(0)
    n = 3 * BLOCK + 17  # a partial last block
    x = torch.randn(n) * torch.logspace(-6, 0, n)
    if not signed:
        x = x.abs()
    q = 127.0 if signed else 255.0
    state = {
        key: torch.zeros(n, dtype=torch.int8 if signed else torch.uint8),
        key + "_scale": torch.zeros(4),
    }
    Moment(state, key).write(torch.cat([x, torch.zeros(4 * BLOCK - n)]), 0, n)
    codes, scales = state[key], state[key + "_scale"]
    for b in range(4):
        block = x[b * BLOCK : (b + 1) * BLOCK]
        top = block.abs().max()
        assert scales[b] == top
        expected = torch.round(q * torch.sqrt(block.abs() / top)) * block.sign()
        if not signed:
            expected = expected.clamp(min=1)  # a non-zero value never gets code 0
        assert torch.equal(codes[b * BLOCK : (b + 1) * BLOCK].float(), expected)
    decoded = Moment(state, key).read(0, n)[:n]
    if key == "exp_avg_sq":
        decoded = decoded.sqrt()  # exp_avg_sq's codes hold the square root of its value
    big = x.abs() > 0.1 * x.abs().max()
    assert ((decoded - x).abs() / x.abs())[big].max() < 2 * (2 / q) * 10**0.5


# ------------------------------------------------------------------ errors


def test_bad_state_dtype_names_the_choices():
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"state_dtype 'int4'.*float32, bfloat16, int8"):
        cstorch.optim.AdamW([w], state_dtype="int4")
    with pytest.raises(TypeError, match="state_dtype must be a torch dtype"):
        cstorch.optim.AdamW([w], state_dtype=8)
    with pytest.raises(ValueError, match="Fix: drop fused"):
        cstorch.optim.AdamW([w], fused=True, state_dtype="bfloat16")
    bf16 = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kahan_summation=False"):
        cstorch.optim.AdamW([bf16], fused=True)


def test_configure_optimizer_takes_state_dtype_by_name():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = cstorch.optim.configure_optimizer("AdamW", [w], learning_rate=1e-3, state_dtype="int8")
    assert opt.state_dtype == torch.int8 and opt.state[w]["exp_avg"].dtype == torch.int8


# ------------------------------------------------------------------ NAdam, RAdam, Adamax

OTHERS = ["NAdam", "RAdam", "Adamax"]  # STEPS = 6 reaches RAdam's rectified branch


def _small_problem(steps=20):
    """Parameters over a chunk's blocks (a partial last block) and random gradients,
    some exactly zero (Adamax's max, int8's zero codes)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (17, 33), (3, BLOCK + 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [
        [torch.randn(s, generator=g) * (torch.rand(s, generator=g) > 0.1) for s in shapes]
        for _ in range(steps)
    ]
    return init, grads


@pytest.mark.parametrize("name", ["Adam", *OTHERS])
@pytest.mark.parametrize("kernel", [False, True], ids=["foreach", "kernel"])
def test_float32_state_matches_torch_optim_bitwise(monkeypatch, name, kernel):
    """state_dtype=float32 on float32 parameters is torch.optim's update bit for bit;
    so is the float32 chunk kernel that compact state and bf16 parameters take
    (forced here onto float32 state): its arithmetic is torch's, in torch's order."""
    import weightstream.optim.adam as adam_module

    if kernel:
        monkeypatch.setattr(adam_module, "is_compact", lambda p, state: True)
    options = dict(FAMILY.get(name, FAMILY["AdamW"]), eps=1e-6)
    init, grads = _small_problem()
    ours, opt = _run_small(
        lambda ps: getattr(cstorch.optim, name)(ps, state_dtype="float32", **options),
        init,
        grads,
    )
    theirs, _ = _run_small(
        lambda ps: getattr(torch.optim, name)(ps, foreach=False, **options), init, grads
    )
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values())


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_compact_state_tracks_float32_state(name, state_dtype):
    """Compact state changes the update by its rounding only: after 20 steps the
    parameters are where float32 state takes them, to a few percent of how far they
    moved."""
    init, grads = _small_problem()
    runs = {
        sd: _run_small(
            lambda ps, sd=sd: getattr(cstorch.optim, name)(ps, state_dtype=sd, **FAMILY[name]),
            init,
            grads,
        )[0]
        for sd in ("float32", state_dtype)
    }
    for w0, want, got in zip(init, runs["float32"], runs[state_dtype]):
        moved = (want - w0).abs().max()
        assert moved > 0.05
        assert (got - want).abs().max() < 0.05 * moved


OTHERS_GRID = [
    # (master dtype, state_dtype)
    (torch.float32, "bfloat16"),
    (torch.float32, "int8"),
    (torch.bfloat16, "float32"),  # bf16 masters + Kahan
    (torch.bfloat16, "int8"),
]


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("master_dtype, state_dtype", OTHERS_GRID)
def test_family_streamed_training_matches_eager_bitwise(name, master_dtype, state_dtype):
    ref = _model(master_dtype)
    ref_opt = _optimizer(ref, state_dtype, name)
    ref_losses = _train(ref, ref_opt, STEPS)

    model = _model(master_dtype)
    runner = cstorch.compile(model, backend="wse_ws", device="cpu", granularity="module")
    opt = _optimizer(model, state_dtype, name)
    assert torch.equal(_train(runner, opt, STEPS), ref_losses)
    _assert_same(model, opt, ref, ref_opt)
    state = opt.state[next(model.parameters())]
    assert ("kahan_comp" in state) == (master_dtype == torch.bfloat16)


@pytest.mark.parametrize("name", OTHERS)
def test_family_checkpoint_round_trip_and_exact_resume(tmp_path, name):
    """bf16 masters with int8 state: codes, scales, the Kahan buffer and NAdam's
    mu_product all round-trip; N steps, save, M more == load and M."""
    model = _model(torch.bfloat16)
    runner = cstorch.compile(model, backend="ws", granularity="module")
    opt = _optimizer(model, "int8", name)
    _train(runner, opt, 3)
    path = tmp_path / "ckpt.mdl"
    cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    straight = _train(runner, opt, 3, first=3)

    resumed = _model(torch.bfloat16)
    runner2 = cstorch.compile(resumed, backend="ws", granularity="module")
    opt2 = _optimizer(resumed, "int8", name)
    saved = cstorch.load(path)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert torch.equal(_train(runner2, opt2, 3, first=3), straight)
    _assert_same(model, opt, resumed, opt2)


@pytest.mark.parametrize(
    "name, moments",
    [
        ("NAdam", {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}),
        ("RAdam", {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}),
        ("Adamax", {"exp_avg": torch.int8, "exp_inf": torch.uint8}),
    ],
)
def test_family_state_layout_and_bytes(name, moments):
    w = torch.nn.Parameter(torch.zeros(1000, 3))
    blocks = -(-3000 // BLOCK)
    state = getattr(cstorch.optim, name)([w], state_dtype=torch.int8).state[w]
    for key, dtype in moments.items():
        assert state[key].dtype == dtype and state[key].shape == w.shape, key
        scale = state[key + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (blocks,), key
    moment_bytes = sum(state[k].nbytes + state[k + "_scale"].nbytes for k in moments)
    assert moment_bytes == 2 * w.numel() + 2 * 4 * blocks
    assert "kahan_comp" not in state

    bf16 = torch.nn.Parameter(torch.zeros(1000, 3, dtype=torch.bfloat16))
    state = getattr(cstorch.optim, name)([bf16], state_dtype="bfloat16").state[bf16]
    assert all(state[k].dtype == torch.bfloat16 and state[k].shape == bf16.shape for k in moments)
    assert not any(k.endswith("_scale") for k in state)
    assert state["kahan_comp"].dtype == torch.bfloat16
    state = getattr(cstorch.optim, name)([bf16], kahan_summation=False).state[bf16]
    assert all(state[k].dtype == torch.float32 for k in moments) and "kahan_comp" not in state


@pytest.mark.parametrize("name", OTHERS)
def test_family_bad_state_format_is_refused_with_fix(name):
    w = torch.nn.Parameter(torch.zeros(4))
    cls = getattr(cstorch.optim, name)
    with pytest.raises(ValueError, match=rf"{name}: state_dtype 'int4'.*float32, bfloat16, int8"):
        cls([w], state_dtype="int4")
    with pytest.raises(TypeError, match=f"{name}: state_dtype must be a torch dtype"):
        cls([w], state_dtype=8)
    with pytest.raises(TypeError, match=f"{name}: kahan_summation must be True or False"):
        cls([w], kahan_summation="yes")


@pytest.mark.parametrize("name", OTHERS)
def test_params_file_state_dtype_reaches_the_family(name):
    from weightstream.optim.params import OptimizerParams

    section = OptimizerParams.from_dict(
        {"optimizer_type": name, "learning_rate": 1e-3, "state_dtype": "bfloat16"}
    )
    w = torch.nn.Parameter(torch.zeros(4))
    opt = cstorch.optim.configure_optimizer(name, [w], **section.optimizer_kwargs())
    assert type(opt).__name__ == name and opt.state_dtype == torch.bfloat16
    assert opt.state[w]["exp_avg"].dtype == torch.bfloat16


# ------------------------------------------------------------------ the run command


def test_run_with_bf16_masters_and_int8_state_resumes_exactly_and_exports_bf16(tmp_path):
    pytest.importorskip("tensorboard")
    import params_files as pf
    from test_run_command import _params

    from weightstream import checkpoint as ckpt
    from weightstream.cli.main import main

    int8 = pf.adamw(3e-3, weight_decay=0.01, state_dtype="int8")
    params = _params(tmp_path, optimizer=int8, master_dtype="bfloat16")
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["run", "CPU", "-p", str(params), "-o", str(whole)]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split), "--max_steps", "4"]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split)]) == 0  # resumes at 4
    a = ckpt.load(whole / "checkpoint_8.mdl", map_location="cpu")
    b = ckpt.load(split / "checkpoint_8.mdl", map_location="cpu")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    weights = [v for k, v in a["model"].items() if k.endswith("weight")]
    assert weights and all(w.dtype == torch.bfloat16 for w in weights)
    state = a["optimizer"]["state"][0]
    assert state["exp_avg"].dtype == torch.int8 and "exp_avg_scale" in state
    assert state["kahan_comp"].dtype == torch.bfloat16
    for i, st in a["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["optimizer"]["state"][i][key]), (i, key)


@pytest.mark.slow  # 8 s on 2 cores; test_state_of_another_format_loads_converted checks by default
def test_run_resumed_with_another_state_dtype_continues_from_the_converted_state(tmp_path):
    """A run saved with int8 state and resumed without state_dtype (float32) trains on
    from the decoded moments (Note [loading another state format]): over steps 5-8 its
    weights move as the whole int8 run's do, to int8 state's rounding (measured: 12% of
    how far they moved; the codes loaded as numbers missed by 100%), and its checkpoint
    holds float32 state without the int8 scales."""
    pytest.importorskip("tensorboard")
    import params_files as pf
    from test_run_command import _params

    from weightstream import checkpoint as ckpt
    from weightstream.cli.main import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    int8 = _params(tmp_path / "a", optimizer=pf.adamw(3e-3, weight_decay=0.01, state_dtype="int8"))
    fp32 = _params(tmp_path / "b", optimizer=pf.adamw(3e-3, weight_decay=0.01))
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["run", "CPU", "-p", str(int8), "-o", str(whole)]) == 0
    assert main(["run", "CPU", "-p", str(int8), "-o", str(split), "--max_steps", "4"]) == 0
    assert main(["run", "CPU", "-p", str(fp32), "-o", str(split)]) == 0  # resumes at 4
    start = ckpt.load(whole / "checkpoint_4.mdl", map_location="cpu")["model"]
    a = ckpt.load(whole / "checkpoint_8.mdl", map_location="cpu")
    b = ckpt.load(split / "checkpoint_8.mdl", map_location="cpu")
    for key, value in a["model"].items():
        moved = (value - start[key]).abs().max()
        assert (b["model"][key] - value).abs().max() <= 0.25 * moved, key
    for st in b["optimizer"]["state"].values():
        assert st["exp_avg"].dtype == torch.float32 and not any("scale" in k for k in st)


def test_master_dtype_is_validated():
    from weightstream.cli.params import RunConfigParams

    with pytest.raises(ValueError, match="master_dtype"):
        RunConfigParams.from_dict({"master_dtype": "int8"})
    assert RunConfigParams.from_dict({}).master_dtype == "float32"


def test_params_state_dtype_is_validated():
    from weightstream.optim.params import OptimizerParams

    with pytest.raises(ValueError, match="state_dtype"):
        OptimizerParams.from_dict({"optimizer_type": "AdamW", "state_dtype": "int4"})
    given = OptimizerParams.from_dict({"optimizer_type": "AdamW", "state_dtype": "bfloat16"})
    assert given.optimizer_kwargs()["state_dtype"] == "bfloat16"


# ------------------------------------------------------- loading another format

FORMATS = ["float32", "bfloat16", "int8"]


@pytest.mark.parametrize("name", ["AdamW", *OTHERS])
@pytest.mark.parametrize("saved", FORMATS)
@pytest.mark.parametrize("loaded", FORMATS)
def test_state_of_another_format_loads_converted(name, saved, loaded):
    """A resume with another state_dtype (Note [loading another state format]): 10 steps
    in one format, its state loaded into the other, 10 more, land where float32 state
    takes the parameters in 20 steps, to the few percent compact state costs. An int8
    code loaded as a number (a moment 100x too large) misses by far more."""
    init, grads = _small_problem(steps=20)
    make = {
        sd: lambda ps, sd=sd: getattr(cstorch.optim, name)(ps, state_dtype=sd, **FAMILY[name])
        for sd in FORMATS
    }
    want, _ = _run_small(make["float32"], init, grads)
    half, first = _run_small(make[saved], init, grads[:10])
    params = [w.clone().requires_grad_(True) for w in half]
    second = make[loaded](params)
    second.load_state_dict(first.state_dict())
    for state in second.state.values():  # no tensor of the saved format is left behind
        assert {k for k, v in state.items() if torch.is_tensor(v) and k.endswith("_scale")} == (
            {f"{k}_scale" for k in state if k.startswith("exp_") and "scale" not in k}
            if loaded == "int8"
            else set()
        )
    for g in grads[10:]:
        for w, grad in zip(params, g):
            w.grad = grad.clone()
        second.step()
    for w0, w, got in zip(init, want, params):
        moved = (w - w0).abs().max()
        assert (got.detach() - w).abs().max() < 0.05 * moved


def test_float32_masters_state_loads_into_bf16_masters_with_a_zero_kahan_buffer():
    """A checkpoint of fp32 masters has no Kahan buffer; bf16 masters resuming from it
    start theirs at zero (no rounding residual known), for SGD and the Adam family."""
    for make in (
        lambda ps: cstorch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: cstorch.optim.AdamW(ps, lr=0.1),
    ):
        w32 = torch.nn.Parameter(torch.randn(300))
        opt32 = make([w32])
        w32.grad = torch.randn(300)
        opt32.step()
        w16 = torch.nn.Parameter(w32.detach().bfloat16())
        opt16 = make([w16])
        opt16.state[w16]["kahan_comp"].fill_(1.0)
        opt16.load_state_dict(opt32.state_dict())
        assert torch.equal(opt16.state[w16]["kahan_comp"], torch.zeros(300, dtype=torch.bfloat16))
        w16.grad = torch.randn(300).bfloat16()
        opt16.step()
        assert torch.isfinite(w16).all()


def test_bf16_masters_state_loaded_into_float32_masters_says_the_kahan_buffer_goes():
    """The other way: float32 masters keep no buffer, so the residuals (below half a bf16
    ulp each) are dropped, and the load says so (it used to be silent)."""
    w16 = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt16 = cstorch.optim.AdamW([w16], lr=1e-3)
    w16.grad = torch.randn(300).bfloat16()
    opt16.step()
    assert opt16.state[w16]["kahan_comp"].abs().sum() > 0
    w32 = torch.nn.Parameter(w16.detach().float())
    opt32 = cstorch.optim.AdamW([w32], lr=1e-3)
    with pytest.warns(UserWarning, match=r"Kahan buffers .* are dropped: these parameters keep "
                      r"none \(float32 masters\)"):  # fmt: skip
        opt32.load_state_dict(opt16.state_dict())
    assert "kahan_comp" not in opt32.state[w32]

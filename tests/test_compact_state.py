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


def _optimizer(model, state_dtype, **kw):
    return cstorch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, **kw
    )


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


def test_checkpoint_of_other_state_dtype_is_refused_with_fix(tmp_path):
    model = _model(torch.float32)
    opt = _optimizer(model, "float32")
    other = _optimizer(_model(torch.float32), "int8")
    with pytest.raises(ValueError, match="exp_avg_scale"):
        other.load_state_dict(opt.state_dict())


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
    with pytest.raises(ValueError, match="amsgrad=False"):
        cstorch.optim.Adam([w], amsgrad=True, state_dtype="int8")
    bf16 = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kahan_summation=False"):
        cstorch.optim.AdamW([bf16], fused=True)


def test_configure_optimizer_takes_state_dtype_by_name():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = cstorch.optim.configure_optimizer("AdamW", [w], learning_rate=1e-3, state_dtype="int8")
    assert opt.state_dtype == torch.int8 and opt.state[w]["exp_avg"].dtype == torch.int8


# ------------------------------------------------------------------ the run command


def _run_params(tmp_path, **runconfig):
    import params_files as pf

    section = pf.text_input(4, 32)
    return pf.write(
        tmp_path / "params.yaml",
        pf.params(
            train_input={**section, "shuffle_seed": 3},
            eval_input=section,
            model=pf.gpt2(2, 32, 32),
            optimizer=pf.adamw(3e-3, weight_decay=0.01, state_dtype="int8"),
            runconfig={
                "max_steps": 6,
                "checkpoint_steps": 3,
                "log_steps": 2,
                "seed": 7,
                "master_dtype": "bfloat16",
                **runconfig,
            },
        ),
    )


def test_run_with_bf16_masters_and_int8_state_resumes_exactly_and_exports_bf16(tmp_path):
    pytest.importorskip("tensorboard")
    from weightstream import checkpoint as ckpt
    from weightstream.cli.main import main

    params = _run_params(tmp_path)
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["run", "CPU", "-p", str(params), "-o", str(whole)]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split), "--max_steps", "3"]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split)]) == 0  # resumes at 3
    a = ckpt.load(whole / "checkpoint_6.mdl", map_location="cpu")
    b = ckpt.load(split / "checkpoint_6.mdl", map_location="cpu")
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

"""An optimizer's state follows its parameters as torch.optim's does (Note [state after a
cast] in optim/optimizer.py), and a state dict of another optimizer is refused.

torch.optim makes state at the first step, so code written for it may build the
optimizer, then cast the model to bf16 or unfreeze parameters; and it makes none for
frozen parameters. The references are torch.optim itself and the same optimizer built
in the order weightstream's own docs give.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_compact_state import _assert_same as _same
from test_compact_state import _batch, _train
from test_compact_state import _model as _compact_model

import weightstream as cstorch


def _model() -> torch.nn.Module:
    return _compact_model(torch.float32)


@pytest.mark.parametrize("streamed", [False, True], ids=["eager", "streamed"])
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_an_optimizer_built_before_the_bf16_cast_gets_the_bf16_state(streamed, state_dtype):
    """Built over fp32 parameters, then the model cast: the first step finds bf16 masters
    and makes their state again (a Kahan buffer, moments of the state_dtype), so the run
    equals one whose optimizer was built after the cast."""
    reference = _model().to(torch.bfloat16)
    ref_opt = cstorch.optim.AdamW(reference.parameters(), lr=1e-2, state_dtype=state_dtype)
    ref_losses = _train(reference, ref_opt, 4)

    model = _model()
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    assert "kahan_comp" not in opt.state[next(model.parameters())]  # fp32 masters then
    model.to(torch.bfloat16)
    runner = cstorch.compile(model, backend="wse_ws", granularity="module") if streamed else model
    assert torch.equal(_train(runner, opt, 4), ref_losses)
    _same(model, opt, reference, ref_opt)
    assert opt.state[next(model.parameters())]["kahan_comp"].dtype == torch.bfloat16


def test_a_cast_after_a_step_is_refused_with_the_fix():
    model = _model()
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    model.to(torch.bfloat16)
    x, y = _batch(1)
    F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    with pytest.raises(TypeError, match=r"changed dtype .*torch.float32 -> torch.bfloat16\) after "
                       r"the optimizer's state took a step\. Fix: cast the model"):  # fmt: skip
        opt.step()


def test_frozen_parameters_get_no_state_and_unfrozen_ones_get_it_as_in_torch():
    """A LoRA-like run: most of the model frozen. No state for the frozen parameters
    (torch.optim makes none), then one unfrozen mid-run gets fresh state at its first
    step; weights and state equal torch.optim.AdamW's bit for bit (fp32, eager)."""
    model, ref = _model(), _model()
    for m in (model, ref):
        for name, p in m.named_parameters():
            p.requires_grad_(name.startswith("blocks.0."))
    options = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)  # eps: the reference's default is ours
    opt = cstorch.optim.AdamW(model.parameters(), **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), **options, foreach=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert set(map(id, opt.state)) == set(map(id, trainable))
    assert len(opt.state_dict()["state"]) == len(trainable)
    assert torch.equal(_train(model, opt, 2), _train(ref, ref_opt, 2))
    for m in (model, ref):
        m.blocks[1].requires_grad_(True)
    assert torch.equal(_train(model, opt, 2), _train(ref, ref_opt, 2))
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in ref_opt.state:
            assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
        else:
            assert p not in opt.state


def _adamw_int8_state() -> dict:
    model = _model()
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3, state_dtype="int8")
    _train(model, opt, 1)
    return opt.state_dict()


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("Lion", {"lr": 1e-4}), ("SGD", {"lr": 1e-2}), ("SGD", {"lr": 1e-2, "momentum": 0.9})],
)
def test_a_state_dict_of_another_optimizer_is_refused(name, kwargs):
    """An AdamW's groups and int8 moments loaded into a Lion would give it AdamW's
    learning rate and moments 100x too large (the codes as numbers); into an SGD, a
    KeyError at its first step. Refused before anything changes."""
    state = _adamw_int8_state()
    model = _model()
    opt = getattr(cstorch.optim, name)(model.parameters(), **kwargs)
    before = opt.state_dict()["state"]
    with pytest.raises(ValueError, match=rf"has hyperparameters \[.*'eps'.*\], which {name} "
                       r"does not have: it was saved by another optimizer\. Fix: construct"):  # fmt: skip
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == kwargs["lr"]
    assert opt.state_dict()["state"].keys() == before.keys()


def test_int8_codes_into_float_state_are_refused():
    """The same hyperparameters, another state format the optimizer does not convert:
    Adamax's exp_avg as int8 codes would load as numbers."""
    model = _model()
    opt = cstorch.optim.Adamax(model.parameters(), lr=1e-3)
    state = opt.state_dict()
    first = next(iter(state["state"].values()))
    first["exp_avg"] = torch.zeros_like(first["exp_avg"], dtype=torch.int8)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 is torch.int8 in the "
                       r"state dict but torch.float32 here"):  # fmt: skip
        cstorch.optim.Adamax(_model().parameters(), lr=1e-3).load_state_dict(state)


def test_a_hyperparameter_the_state_dict_lacks_keeps_this_optimizers_value():
    """A state dict saved before a hyperparameter existed: torch's load would drop the
    key (and the next step fail); this optimizer's value is kept, with a warning."""
    model = _model()
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["weight_decay"]
        group["lr"] = 5e-4
    other = _model()
    fresh = cstorch.optim.AdamW(other.parameters(), lr=1e-3, weight_decay=0.05)
    with pytest.warns(UserWarning, match=r"does not record \['weight_decay'\]; this optimizer's"):
        fresh.load_state_dict(state)
    assert fresh.param_groups[0]["weight_decay"] == 0.05 and fresh.param_groups[0]["lr"] == 5e-4
    _train(other, fresh, 1)  # steps: the group has every key AdamW reads


@pytest.mark.parametrize(("name", "key"), [("SGD", "state_dtype"), ("Lion", "kahan_summation")])
def test_compact_state_asked_of_an_optimizer_without_it_is_an_error(name, key):
    """An ignored key would train at full width what was configured to be compact."""
    w = torch.nn.Parameter(torch.zeros(4))
    value = "int8" if key == "state_dtype" else True
    with pytest.raises(ValueError, match=rf"{name} keeps its state in the parameters' dtype and "
                       rf"takes no {key} .*AdamW.*Fix: remove optimizer\.{key}"):  # fmt: skip
        cstorch.optim.configure_optimizer(name, [w], learning_rate=1e-3, **{key: value})


def test_the_run_command_warns_of_bf16_masters_under_an_optimizer_without_kahan(tmp_path):
    from test_run_command import _params

    from weightstream.cli.main import main

    lion = {"optimizer_type": "Lion", "learning_rate": 1e-4}
    params = _params(tmp_path, optimizer=lion, master_dtype="bfloat16", max_steps=1)
    with pytest.warns(UserWarning, match=r"master_dtype bfloat16 with Lion, which keeps no "
                      r"Kahan buffer .*Fix: master_dtype float32, or an optimizer of the Adam"):  # fmt: skip
        assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "out")]) == 0


def test_a_torch_optim_state_dict_of_the_same_algorithm_loads_and_continues_exactly():
    """torch.optim.AdamW's groups carry its implementation choices (foreach, capturable,
    differentiable, fused), not arithmetic: its state dict loads into cstorch's AdamW,
    and the run goes on as torch's own does, bit for bit."""
    options = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)
    theirs = _model()
    torch_opt = torch.optim.AdamW(theirs.parameters(), **options, foreach=False)
    _train(theirs, torch_opt, 2)
    ours = _model()
    ours.load_state_dict(theirs.state_dict())
    opt = cstorch.optim.AdamW(ours.parameters(), **options)
    with pytest.warns(UserWarning, match=r"does not record \['correct_bias'\]"):
        opt.load_state_dict(torch_opt.state_dict())
    assert not {"foreach", "capturable", "differentiable"} & set(opt.param_groups[0])
    assert torch.equal(_train(ours, opt, 2), _train(theirs, torch_opt, 2))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)

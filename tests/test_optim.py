"""weightstream.optim: exactness against torch.optim and independent references,
defaults, preinitialized state, checkpoints, configure_optimizer, param groups."""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch
from torch import nn

import weightstream as cstorch
from weightstream import optim as wsoptim
from weightstream.optim.configure import is_norm_layer

STEPS = 50
# A scalar, a vector, a matrix and a 3-D tensor (Adafactor factors the last two).
# The larger two have more elements than a SIMD register holds, so the kernels'
# vectorized paths run (they may round differently from the scalar tail loops,
# e.g. a fused multiply-add in `add(b, alpha=s)`).
SHAPES = [(), (7,), (17, 33), (2, 3, 40)]
MATRIX_SHAPES = [(20, 12), (12, 20), (16, 16)]


def make_params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def make_grads(shapes=SHAPES, steps=STEPS, seed=1):
    """Random gradients per step, about 10% of elements exactly zero (Rprop's and
    Adamax's zero branches; sign flips come from the randomness)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for s in shapes:
            g = torch.randn(s, generator=gen)
            g = torch.where(torch.rand(s, generator=gen) < 0.1, torch.zeros(()), g)
            step.append(g)
        out.append(step)
    return out


def run(make_optimizer, init, grad_seq):
    """Run one optimizer over fresh copies of ``init`` on ``grad_seq``."""
    params = [p.clone().requires_grad_(True) for p in init]
    opt = make_optimizer(params)
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def assert_bitwise(actual, expected):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        if not torch.equal(a, e):
            diff = (a - e).abs().max().item()
            raise AssertionError(f"tensor {i} of shape {tuple(a.shape)} differs, max |diff| {diff}")


# --------------------------------------------------------------- vs torch.optim

LR = 0.01
TORCH_CASES = [
    # (weightstream class, torch class, kwargs shared by both)
    ("SGD", "SGD", dict(lr=0.05)),
    ("SGD", "SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("SGD", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", "SGD", dict(lr=0.05, momentum=0.5, weight_decay=0.01, maximize=True)),
    ("SGD", "SGD", dict(lr=0.05, weight_decay=0.1)),
    ("Adam", "Adam", dict(lr=LR, eps=1e-6)),
    ("Adam", "Adam", dict(lr=LR, eps=1e-6, weight_decay=0.1)),
    ("Adam", "Adam", dict(lr=LR, eps=1e-6, amsgrad=True)),
    ("Adam", "Adam", dict(lr=LR, eps=1e-6, betas=(0.8, 0.99), maximize=True, weight_decay=0.05)),
    ("AdamW", "AdamW", dict(lr=LR, eps=1e-6, weight_decay=0.0)),
    ("AdamW", "AdamW", dict(lr=LR, eps=1e-6, weight_decay=0.1)),
    ("AdamW", "AdamW", dict(lr=LR, eps=1e-6, weight_decay=0.1, amsgrad=True)),
    ("AdamW", "AdamW", dict(lr=LR, eps=1e-6, weight_decay=0.1, maximize=True)),
    ("Adadelta", "Adadelta", dict(lr=1.0, eps=1e-6)),
    ("Adadelta", "Adadelta", dict(lr=0.5, rho=0.8, eps=1e-6, weight_decay=0.1)),
    ("Adadelta", "Adadelta", dict(lr=1.0, eps=1e-6, maximize=True)),
    ("Adagrad", "Adagrad", dict(lr=LR, eps=1e-6)),
    ("Adagrad", "Adagrad", dict(lr=LR, eps=1e-6, lr_decay=0.01, initial_accumulator_value=0.1)),
    ("Adagrad", "Adagrad", dict(lr=LR, eps=1e-6, weight_decay=0.1, maximize=True)),
    ("Adamax", "Adamax", dict(lr=LR, eps=1e-6)),
    ("Adamax", "Adamax", dict(lr=LR, eps=1e-6, weight_decay=0.1)),
    ("Adamax", "Adamax", dict(lr=LR, eps=1e-6, maximize=True)),
    ("ASGD", "ASGD", dict(lr=LR)),
    # t0 inside the run, so the averaging branch (mu < 1) runs too.
    ("ASGD", "ASGD", dict(lr=LR, t0=20, lambd=1e-2, alpha=0.5, weight_decay=0.1)),
    ("ASGD", "ASGD", dict(lr=LR, t0=5, maximize=True)),
    ("NAdam", "NAdam", dict(lr=2e-3, eps=1e-8)),
    ("NAdam", "NAdam", dict(lr=2e-3, eps=1e-8, weight_decay=0.1, momentum_decay=1e-2)),
    ("NAdam", "NAdam", dict(lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    ("NAdam", "NAdam", dict(lr=2e-3, maximize=True)),
    # rho_t > 5 from step 6 with beta2=0.999: both RAdam branches run.
    ("RAdam", "RAdam", dict(lr=LR, eps=1e-6)),
    ("RAdam", "RAdam", dict(lr=LR, eps=1e-6, weight_decay=0.1)),
    ("RAdam", "RAdam", dict(lr=LR, eps=1e-6, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RAdam", "RAdam", dict(lr=LR, eps=1e-6, maximize=True)),
    ("RMSprop", "RMSprop", dict(lr=LR)),
    ("RMSprop", "RMSprop", dict(lr=LR, momentum=0.9)),
    ("RMSprop", "RMSprop", dict(lr=LR, centered=True)),
    ("RMSprop", "RMSprop", dict(lr=LR, centered=True, momentum=0.5, weight_decay=0.1)),
    ("RMSprop", "RMSprop", dict(lr=LR, alpha=0.9, eps=1e-6, maximize=True)),
    ("Rprop", "Rprop", dict(lr=LR)),
    ("Rprop", "Rprop", dict(lr=LR, etas=(0.3, 1.5), step_sizes=(1e-3, 0.05))),
    ("Rprop", "Rprop", dict(lr=LR, maximize=True)),
]


@pytest.mark.parametrize(
    "ours,theirs,kwargs", TORCH_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TORCH_CASES)]
)
def test_matches_torch_optim_bitwise(ours, theirs, kwargs):
    # foreach=False is what torch.optim picks by default for CPU tensors (plain eager
    # PyTorch); weightstream runs the same kernels in the same order (Note [matching
    # torch.optim bit for bit] in weightstream/optim/optimizer.py).
    init, grads = make_params(), make_grads()
    got, our_opt = run(lambda ps: getattr(wsoptim, ours)(ps, **kwargs), init, grads)
    want, torch_opt = run(
        lambda ps: getattr(torch.optim, theirs)(ps, foreach=False, **kwargs), init, grads
    )
    assert_bitwise(got, want)
    # The state torch keeps under the same names agrees as well.
    for p_ours, p_torch in zip(
        our_opt.param_groups[0]["params"], torch_opt.param_groups[0]["params"]
    ):
        theirs_state = torch_opt.state[p_torch]
        for key, value in our_opt.state[p_ours].items():
            if key in theirs_state and isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs_state[key].to(value.dtype)), key


def test_adamw_without_bias_correction_matches_written_out_update():
    """correct_bias=False has no torch counterpart: compare with the update written out."""
    lr, (beta1, beta2), eps, wd = 1e-2, (0.9, 0.999), 1e-6, 0.1
    init, grads = make_params(), make_grads()
    got, _ = run(
        lambda ps: wsoptim.AdamW(ps, lr=lr, eps=eps, weight_decay=wd, correct_bias=False),
        init,
        grads,
    )
    params = [p.clone() for p in init]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, g, m_i, v_i in zip(params, step_grads, m, v):
            p.mul_(1 - lr * wd)
            m_i.lerp_(g, 1 - beta1)
            v_i.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m_i, v_i.sqrt().add_(eps), value=-lr)
    assert_bitwise(got, params)


# ------------------------------------------------------- independent references


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(nesterov=False),
        dict(weight_decay=0.1, momentum=0.9),
        dict(adjust_lr_fn="match_rms_adamw", ns_steps=3),
    ],
)
def test_muon_matches_torch_muon(kwargs):
    # torch.optim.Muon (torch >= 2.9) is an independent implementation of the same
    # update; its defaults differ (lr=1e-3, weight_decay=0.1), so pass all of them.
    full = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5)
    full.update(kwargs)
    init, grads = make_params(MATRIX_SHAPES), make_grads(MATRIX_SHAPES)
    got, _ = run(lambda ps: wsoptim.Muon(ps, **full), init, grads)
    want, _ = run(lambda ps: torch.optim.Muon(ps, **full), init, grads)
    assert_bitwise(got, want)


def test_muon_treats_conv_kernels_as_matrices():
    """A 4-D kernel updates like the (out, in*kh*kw) matrix under torch's Muon."""
    shape = (8, 4, 3, 3)
    init, grads = make_params([shape]), make_grads([shape])
    got, _ = run(lambda ps: wsoptim.Muon(ps), init, grads)
    flat_init = [p.reshape(8, 36) for p in init]
    flat_grads = [[g.reshape(8, 36) for g in step] for step in grads]
    full = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5)
    want, _ = run(lambda ps: torch.optim.Muon(ps, **full), flat_init, flat_grads)
    assert_bitwise([got[0].reshape(8, 36)], want)


def test_muon_rejects_vectors_with_fix():
    with pytest.raises(ValueError, match="AdamW"):
        wsoptim.Muon([torch.zeros(3, requires_grad=True)])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=1e-2),
        dict(lr=1e-2, weight_decay=0.1),
        dict(lr=1e-2, scale_parameter=False, decay_rate=-0.5),
        dict(lr=1e-2, scale_parameter=False, weight_decay=0.05, eps=(1e-30, 1e-2)),
    ],
)
def test_adafactor_matches_transformers(kwargs):
    from transformers.optimization import Adafactor as HFAdafactor

    init, grads = make_params(), make_grads()
    got, _ = run(lambda ps: wsoptim.Adafactor(ps, **kwargs), init, grads)
    # transformers defaults to relative_step=True; the reference supports only False.
    want, _ = run(
        lambda ps: HFAdafactor(ps, relative_step=False, warmup_init=False, **kwargs), init, grads
    )
    assert_bitwise(got, want)


def lion_reference(init, grad_seq, lr, betas, weight_decay):
    """Lion as in Chen et al. 2023 (arXiv:2302.06675), Algorithm 2, one tensor at a time:
    c = beta1 m + (1 - beta1) g;  theta -= lr (sign(c) + wd theta);  m = beta2 m + (1 - beta2) g.
    The decay term uses the parameter before the update (theta *= 1 - lr wd first)."""
    beta1, beta2 = betas
    params = [p.clone() for p in init]
    moms = [torch.zeros_like(p) for p in params]
    for grads in grad_seq:
        for theta, g, m in zip(params, grads, moms):
            c = torch.lerp(m, g, 1 - beta1)  # = beta1 m + (1 - beta1) g
            theta.mul_(1 - lr * weight_decay)
            theta.add_(torch.sign(c), alpha=-lr)
            m.copy_(torch.lerp(m, g, 1 - beta2))
    return params


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_paper_algorithm(weight_decay):
    init, grads = make_params(), make_grads()
    got, _ = run(lambda ps: wsoptim.Lion(ps, lr=1e-3, weight_decay=weight_decay), init, grads)
    want = lion_reference(init, grads, lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    assert_bitwise(got, want)


def lamb_reference(init, grad_seq, lr, betas, eps, weight_decay, adam):
    """LAMB (You et al. 2019, arXiv:1904.00962, Algorithm 2) per tensor, in the variant
    of the reference implementation (cybertronai pytorch-lamb): no bias correction,
    phi(z) = min(z, 10), trust ratio 1 when a norm is zero or with adam=True."""
    beta1, beta2 = betas
    params = [p.clone() for p in init]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for grads in grad_seq:
        for x, g, m, v in zip(params, grads, ms, vs):
            m.lerp_(g, 1 - beta1)  # m = beta1 m + (1 - beta1) g
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v = beta2 v + (1 - beta2) g^2
            r = m / (v.sqrt() + eps)
            r.add_(x, alpha=weight_decay)  # r += wd x, one fused op as in the implementation
            x_norm = torch.linalg.vector_norm(x).clamp(0, 10)
            r_norm = torch.linalg.vector_norm(r)
            trust = 1.0
            if not adam and x_norm > 0 and r_norm > 0:
                trust = (x_norm / r_norm).item()
            x.add_(r, alpha=-lr * trust)
    return params


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(weight_decay=0.01), dict(adam=True), dict(betas=(0.8, 0.9))]
)
def test_lamb_matches_paper_algorithm(kwargs):
    full = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, adam=False)
    full.update(kwargs)
    init, grads = make_params(), make_grads()
    # One all-zero parameter exercises the "||x|| == 0 -> trust 1" branch.
    init = [*init, torch.zeros(3)]
    grads = [[*step, torch.full((3,), 0.5)] for step in grads]
    got, _ = run(lambda ps: wsoptim.Lamb(ps, **full), init, grads)
    want = lamb_reference(init, grads, **full)
    assert_bitwise(got, want)


# ------------------------------------------------------------------- defaults

DEFAULTS = {
    "SGD": dict(
        lr=inspect.Parameter.empty,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        maximize=False,
    ),
    "Adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, amsgrad=False),
    "AdamW": dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, correct_bias=True, amsgrad=False
    ),
    "Adadelta": dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, maximize=False),
    "Adafactor": dict(
        lr=inspect.Parameter.empty,
        eps=(1e-30, 1e-3),
        clip_threshold=1.0,
        decay_rate=-0.8,
        beta1=None,
        weight_decay=0,
        scale_parameter=True,
        relative_step=False,
        warmup_init=False,
    ),
    "Adagrad": dict(
        lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-6, maximize=False
    ),
    "Adamax": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, maximize=False),
    "ASGD": dict(lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0, maximize=False),
    "Lamb": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False),
    "Lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0),
    "Muon": dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5),
    "NAdam": dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3),
    "RAdam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0),
    "RMSprop": dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False),
    "Rprop": dict(lr=1e-3, etas=(0.5, 1.2), step_sizes=(1e-6, 50)),
}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_and_argument_order_match_reference_table(name):
    params = list(inspect.signature(getattr(wsoptim, name)).parameters.values())
    assert params[0].name == "params"
    positional = [p for p in params[1:] if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    # The reference arguments come first, in the reference order, with its defaults;
    # torch-only extensions (maximize, decoupled_weight_decay, ...) are keyword-only.
    assert [p.name for p in positional] == list(DEFAULTS[name])
    for p in positional:
        assert p.default == DEFAULTS[name][p.name], p.name


def test_all_fifteen_optimizers_exported():
    assert sorted(n for n in wsoptim.__all__ if n in DEFAULTS) == sorted(DEFAULTS)
    assert len(DEFAULTS) == 15
    for name in DEFAULTS:
        assert issubclass(getattr(wsoptim, name), wsoptim.Optimizer)


# ------------------------------------------------------- state and checkpoints


def build(name, params):
    """Every optimizer with options that create all of its optional state."""
    kwargs = {
        "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1),
        "Adam": dict(amsgrad=True, weight_decay=0.01),
        "AdamW": dict(amsgrad=True, weight_decay=0.01),
        "Adafactor": dict(lr=1e-2, weight_decay=0.01),
        "ASGD": dict(t0=3),
        "Muon": dict(),
        "RMSprop": dict(momentum=0.9, centered=True),
        "Lamb": dict(weight_decay=0.01),
        "Lion": dict(weight_decay=0.01),
    }.get(name, {})
    return getattr(wsoptim, name)(params, **kwargs)


def shapes_for(name):
    return MATRIX_SHAPES if name == "Muon" else SHAPES


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_preinitialize_creates_all_state_before_the_first_step(name):
    shapes = shapes_for(name)
    params = [p.requires_grad_(True) for p in make_params(shapes)]
    opt = build(name, params)
    before = {id(p): {k: (v.shape, v.dtype) for k, v in opt.state[p].items()} for p in params}
    assert all(before[id(p)] for p in params), "every parameter has state at construction"
    tensors = {id(p): dict(opt.state[p]) for p in params}
    for grads in make_grads(shapes, steps=3):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    after = {id(p): {k: (v.shape, v.dtype) for k, v in opt.state[p].items()} for p in params}
    assert after == before, "step() created or reshaped state"
    for p in params:  # updated in place: the host store may hold these tensors
        for key, tensor in tensors[id(p)].items():
            assert opt.state[p][key] is tensor
    names = opt.state_names_to_sparsify()
    assert isinstance(names, list) and all(isinstance(n, str) for n in names)
    for p in params:
        for n in names:
            if n in opt.state[p]:
                assert opt.state[p][n].shape == p.shape, n


class GlobalStepSGD(wsoptim.Optimizer):
    """Minimal user optimizer: plain SGD that reads the global step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr), enable_global_step=True)

    def preinitialize(self):
        pass

    def state_names_to_sparsify(self):
        return []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    step = self.increment_global_step(p)
                    p.sub_(group["lr"] / step * p.grad)


def test_enable_global_step_creates_float32_step_per_parameter():
    params = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    opt = GlobalStepSGD(params)
    for p in params:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.shape == () and step.item() == 0.0
    params[0].grad = torch.ones(2)
    opt.step()
    opt.step()
    assert opt.state[params[0]]["step"].item() == 2.0
    assert opt.state[params[1]]["step"].item() == 0.0, "no grad, no step"
    # Without enable_global_step there is no step state.
    assert "step" not in wsoptim.Lion([torch.ones(2, requires_grad=True)]).state[params[0]]


def test_abstract_methods_must_be_implemented():
    class Incomplete(wsoptim.Optimizer):
        def preinitialize(self):
            pass

    with pytest.raises(TypeError):
        Incomplete([torch.ones(1, requires_grad=True)], {})


def test_tags_are_normalized_to_sets():
    a, b, c = (torch.ones(1, requires_grad=True) for _ in range(3))
    opt = wsoptim.SGD(
        [
            {"params": [a], "tags": "embedding"},
            {"params": [b], "tags": ["x", "y"]},
            {"params": [c]},
        ],
        lr=0.1,
    )
    assert opt.param_groups[0]["tags"] == {"embedding"}
    assert opt.param_groups[1]["tags"] == {"x", "y"}
    assert "tags" not in opt.param_groups[2]
    with pytest.raises(TypeError, match="tags"):
        wsoptim.SGD([{"params": [torch.ones(1)], "tags": 3}], lr=0.1)


def test_add_param_group_creates_state_for_the_new_group_only():
    a = torch.ones(2, requires_grad=True)
    opt = wsoptim.Adam([a])
    a.grad = torch.ones(2)
    opt.step()
    exp_avg = opt.state[a]["exp_avg"].clone()
    b = torch.ones(3, requires_grad=True)
    opt.add_param_group({"params": [b], "lr": 0.5, "tags": ["late"]})
    assert set(opt.state[b]) == {"exp_avg", "exp_avg_sq", "step"}
    assert torch.equal(opt.state[a]["exp_avg"], exp_avg), "existing state kept"
    assert opt.state[a]["step"].item() == 1.0 and opt.param_groups[1]["tags"] == {"late"}


def test_rejects_non_floating_parameters():
    with pytest.raises(TypeError, match="floating-point"):
        wsoptim.Adam([torch.zeros(2, dtype=torch.complex64, requires_grad=True)])


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_state_dict_round_trip_continues_identically(name):
    shapes = shapes_for(name)
    init, grads = make_params(shapes), make_grads(shapes, steps=12)

    def steps(opt, params, grad_seq):
        for step_grads in grad_seq:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()

    straight = [p.clone().requires_grad_(True) for p in init]
    opt = build(name, straight)
    steps(opt, straight, grads)

    first = [p.clone().requires_grad_(True) for p in init]
    opt1 = build(name, first)
    steps(opt1, first, grads[:6])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optimizer": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = [p.clone().requires_grad_(True) for p in saved["params"]]
    opt2 = build(name, resumed)
    state_before = {id(p): dict(opt2.state[p]) for p in resumed}
    opt2.load_state_dict(saved["optimizer"])
    for p in resumed:  # loaded into the preinitialized tensors, dtypes kept
        for key, tensor in state_before[id(p)].items():
            assert opt2.state[p][key] is tensor
    steps(opt2, resumed, grads[6:])
    assert_bitwise([p.detach() for p in resumed], [p.detach() for p in straight])


def test_load_state_dict_with_missing_state_fails_before_changing_anything():
    a = torch.ones(2, requires_grad=True)
    plain = wsoptim.Adam([a], lr=0.1)
    a.grad = torch.ones(2)
    plain.step()
    b = torch.ones(2, requires_grad=True)
    ams = wsoptim.Adam([b], lr=0.5, amsgrad=True)
    before = copy.deepcopy(ams.state_dict())
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        ams.load_state_dict(plain.state_dict())
    after = ams.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())


def test_scheduler_style_lr_change_before_first_step_is_used_by_rprop_and_asgd():
    # torch reads lr at a parameter's first step for Rprop's step sizes and ASGD's eta.
    for name in ("Rprop", "ASGD"):
        init, grads = make_params(), make_grads(steps=5)

        def make(cls):
            def factory(ps):
                opt = cls(ps, lr=0.5)
                opt.param_groups[0]["lr"] = 0.01
                return opt

            return factory

        got, _ = run(make(getattr(wsoptim, name)), init, grads)
        want, _ = run(make(getattr(torch.optim, name)), init, grads)
        assert_bitwise(got, want)


def test_optimizer_rejects_bad_hyperparameters_with_fix():
    p = [torch.ones(1, requires_grad=True)]
    with pytest.raises(ValueError, match="lr must be >= 0"):
        wsoptim.Adam(p, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        wsoptim.Adam(p, betas=(0.9, 1.5))
    with pytest.raises(TypeError, match=r"1\.0e-8"):
        wsoptim.Adam(p, eps="1e-8")
    with pytest.raises(ValueError, match="nesterov"):
        wsoptim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="etas"):
        wsoptim.Rprop(p, etas=(1.5, 1.2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip_threshold=2.0), "clip_threshold=1.0"),
        (dict(beta1=0.9), "beta1=None"),
        (dict(relative_step=True), "relative_step"),
        (dict(warmup_init=True), "warmup_init"),
    ],
)
def test_adafactor_rejects_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wsoptim.Adafactor([torch.ones(2, requires_grad=True)], lr=1e-3, **kwargs)


def test_sparse_gradients_are_rejected_with_fix():
    emb = nn.Embedding(5, 2, sparse=True)
    opt = wsoptim.Adam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse=False"):
        opt.step()


def test_step_runs_closure_with_grad_enabled():
    w = torch.ones(2, requires_grad=True)
    opt = wsoptim.SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 2.0 and torch.allclose(w.detach(), torch.full((2,), 0.8))


# --------------------------------------------------------- configure_optimizer


def params_list():
    return [torch.ones(2, 2, requires_grad=True)]


@pytest.mark.parametrize("name", ["adamw", "ADAMW", "AdamW", "aDaMw"])
def test_configure_optimizer_matches_names_case_insensitively(name):
    opt = wsoptim.configure_optimizer(name, params_list())
    assert type(opt) is wsoptim.AdamW


def test_configure_optimizer_is_reachable_as_cstorch_optim():
    opt = cstorch.optim.configure_optimizer(optimizer_type="SGD", params=params_list(), lr=0.1)
    assert isinstance(opt, cstorch.optim.SGD)


def test_configure_optimizer_learning_rate_and_optim_params():
    opt = wsoptim.configure_optimizer(
        "SGD", params_list(), learning_rate=0.25, optim_params={"momentum": 0.9, "nesterov": True}
    )
    group = opt.param_groups[0]
    assert group["lr"] == 0.25 and group["momentum"] == 0.9 and group["nesterov"] is True
    # A numeric string (PyYAML reads 1e-3 as a string) is a number too.
    assert wsoptim.configure_optimizer("Adam", params_list(), learning_rate="1e-3").param_groups[0][
        "lr"
    ] == pytest.approx(1e-3)
    # A schedule gives a placeholder the scheduler overwrites.
    scheduled = wsoptim.configure_optimizer(
        "AdamW", params_list(), learning_rate=[{"scheduler": "Linear"}]
    )
    assert scheduled.param_groups[0]["lr"] == 0.0
    with pytest.raises(ValueError, match="both 'learning_rate' and 'lr'"):
        wsoptim.configure_optimizer("SGD", params_list(), learning_rate=0.1, lr=0.2)
    with pytest.raises(ValueError, match="optim_params"):
        wsoptim.configure_optimizer(
            "SGD", params_list(), lr=0.1, momentum=0.5, optim_params={"momentum": 0.9}
        )


def test_configure_optimizer_warns_on_unknown_keys_and_drops_them():
    with pytest.warns(UserWarning, match=r"ignoring \['max_gradient_norm', 'foo'\]"):
        opt = wsoptim.configure_optimizer(
            "Lion", params_list(), lr=1e-4, max_gradient_norm=1.0, foo=3
        )
    assert "foo" not in opt.param_groups[0] and "max_gradient_norm" not in opt.defaults
    with pytest.warns(UserWarning, match="Did you mean 'weight_decay' for 'wieght_decay'"):
        wsoptim.configure_optimizer("AdamW", params_list(), lr=1e-4, wieght_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wsoptim.configure_optimizer("Lion", params_list(), lr=1e-4, betas=(0.9, 0.98))


@pytest.mark.parametrize(
    "optimizer,key,replacement",
    [
        ("AdamW", "weight_decay_rate", "weight_decay"),
        ("AdamW", "beta1", "betas"),
        ("Adam", "beta2", "betas"),
        ("Adafactor", "eps1", "eps"),
        ("Adafactor", "eps2", "eps"),
        ("Rprop", "eta1", "etas"),
        ("Rprop", "eta2", "etas"),
        ("Rprop", "step_size_min", "step_sizes"),
        ("Rprop", "step_size_max", "step_sizes"),
    ],
)
def test_configure_optimizer_retired_aliases_name_the_replacement(optimizer, key, replacement):
    with pytest.raises(ValueError, match=rf"'{key}' -> '{replacement}'"):
        wsoptim.configure_optimizer(optimizer, params_list(), lr=1e-3, **{key: 0.5})


def test_adafactor_beta1_is_an_argument_not_a_retired_alias():
    with pytest.raises(ValueError, match="beta1=None"):
        wsoptim.configure_optimizer("Adafactor", params_list(), lr=1e-3, beta1=0.9)


def test_configure_optimizer_unknown_name_lists_valid_names_and_close_matches():
    with pytest.raises(ValueError) as info:
        wsoptim.configure_optimizer("Adamm", params_list())
    message = str(info.value)
    assert "Did you mean 'Adam'" in message
    for name in DEFAULTS:
        assert name in message


class ScaledSignDescentForConfigureTest(wsoptim.Optimizer):
    def __init__(self, params, lr=0.1, scale=1.0):
        super().__init__(params, dict(lr=lr, scale=scale))

    def preinitialize(self):
        pass

    def state_names_to_sparsify(self):
        return []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * group["scale"] * p.grad.sign())


def test_configure_optimizer_finds_user_subclasses():
    opt = wsoptim.configure_optimizer(
        "scaledsigndescentforconfiguretest",
        params_list(),
        learning_rate=0.5,
        optim_params={"scale": 2},
    )
    assert isinstance(opt, ScaledSignDescentForConfigureTest)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["scale"] == 2


# --------------------------------------------------------------- param groups


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.rms = LlamaStyleRMSNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3, bias=False)


def test_param_groups_with_weight_decay_excludes_biases_and_norm_layers():
    model = TinyModel()
    groups = wsoptim.param_groups_with_weight_decay(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    by_id = {id(p): n for n, p in model.named_parameters()}
    decayed = [by_id[id(p)] for p in groups[0]["params"]]
    plain = [by_id[id(p)] for p in groups[1]["params"]]
    assert decayed == ["embed.weight", "proj.weight", "head.weight"]
    assert plain == ["proj.bias", "ln.weight", "ln.bias", "rms.weight", "bn.weight", "bn.bias"]
    # Usable directly, e.g. by configure_optimizer.
    opt = wsoptim.configure_optimizer("AdamW", groups, learning_rate=1e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_norm_layer_detection():
    for module in (
        nn.LayerNorm(2),
        nn.GroupNorm(1, 2),
        nn.InstanceNorm2d(2),
        nn.BatchNorm3d(2),
        LlamaStyleRMSNorm(2),
    ):
        assert is_norm_layer(module)
    if hasattr(nn, "RMSNorm"):
        assert is_norm_layer(nn.RMSNorm(2))
    for module in (nn.Linear(2, 2), nn.Embedding(2, 2), nn.Conv2d(1, 1, 1)):
        assert not is_norm_layer(module)


def test_param_groups_shared_parameter_appears_once():
    model = TinyModel()
    model.head.weight = model.embed.weight.__class__(torch.ones(3, 4))
    model.tied = nn.Linear(4, 3, bias=False)
    model.tied.weight = model.head.weight
    groups = wsoptim.param_groups_with_weight_decay(model, 0.1)
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))

"""The compiled Adam/AdamW kernel of large parameters with compact state (Note [fused
compact kernels] in optim/fused.py): against torch.optim's AdamW in float64 and the
chunked kernel, streamed against eager bit for bit, and the chunks where it cannot be
built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import weightstream as cstorch
from weightstream.optim import fused
from weightstream.optim.compact import BLOCK

N = fused.FUSED_MIN_NUMEL + 77  # past the threshold, not a multiple of anything
N8 = fused.FUSED_MIN_NUMEL + 3 * BLOCK  # int8 state: whole blocks
STEPS = 4
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


@pytest.fixture
def kernels():
    """The module's kernel record as it was (a test may mark it unavailable)."""
    before = fused._KERNELS.unavailable
    yield fused._KERNELS
    fused._KERNELS.unavailable = before


def _problem(n=N):
    g = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(STEPS)]
    return init, grads


def _size(state_dtype) -> int:
    return N8 if state_dtype == torch.int8 else N


def _ours(kernels, chunks: bool, master, state_dtype, name="AdamW"):
    kernels.unavailable = "the chunks, for this test" if chunks else None
    init, grads = _problem(_size(state_dtype))
    p = nn.Parameter(init.to(master))
    opt = getattr(cstorch.optim, name)([p], state_dtype=state_dtype, **HYPER)
    for g in grads:
        p.grad = g.to(master)
        opt.step()
    return p.detach().clone(), opt.state[p]


def _value(p, state) -> torch.Tensor:
    """What a master holds: with its Kahan compensation where it keeps one."""
    comp = state.get("kahan_comp")
    return p.double() + (0 if comp is None else comp.double())


def _count_calls(monkeypatch, kernels) -> list[int]:
    """A one-item list counting the compiled kernel's runs from now on."""
    calls, made = [0], kernels.adam

    def adam(int8):
        kernel = made(int8)

        def counted(*args):
            kernel(*args)
            calls[0] += 1

        return counted

    monkeypatch.setattr(kernels, "adam", adam)
    return calls


def _torch_float64(master, name="AdamW", n=N):
    """torch.optim from the values and gradients ours see (rounded to ``master``)."""
    init, grads = _problem(n)
    p = nn.Parameter(init.to(master).double())
    opt = getattr(torch.optim, name)([p], foreach=False, **HYPER)
    for g in grads:
        p.grad = g.to(master).double()
        opt.step()
    return p.detach()


CASES = [
    (torch.bfloat16, torch.bfloat16),  # bf16 masters + Kahan + bf16 state
    (torch.bfloat16, torch.float32),  # bf16 masters + Kahan
    (torch.float32, torch.bfloat16),  # bf16 state
    (torch.bfloat16, torch.int8),  # bf16 masters + Kahan + int8 state
    (torch.float32, torch.int8),  # int8 state
]
IDS = ["bf16-bf16", "bf16-fp32", "fp32-bf16", "bf16-int8", "fp32-int8"]


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
@pytest.mark.parametrize("master, state_dtype", CASES, ids=IDS)
def test_the_kernel_is_adamw_to_the_rounding_of_its_state(
    kernels, monkeypatch, name, master, state_dtype
):
    """torch.optim in float64 is the reference. The compiled kernel's parameters are
    where the chunked kernel's are, to its float32 last bits: its vector code rounds
    some products apart where the operators fuse them (ATen's lerp, add with alpha
    and addcmul use fused multiply-adds on the CPU)."""
    calls = _count_calls(monkeypatch, kernels)
    compiled, compiled_state = _ours(kernels, False, master, state_dtype, name)
    assert calls == [STEPS], kernels.unavailable  # it was built, and it ran each step
    chunked, chunked_state = _ours(kernels, True, master, state_dtype, name)
    exact = _torch_float64(master, name, _size(state_dtype))
    # Rounding of the state: each of 4 steps' updates (up to lr) by bf16 moments'
    # 2**-8, or float32's; the masters' value with its Kahan buffer keeps ~16 bits.
    bits = {torch.float32: 20, torch.bfloat16: 7, torch.int8: 5}[state_dtype]
    tol = HYPER["lr"] * STEPS * 2**-bits
    tol += 2**-16 * exact.abs().max().item() if master == torch.bfloat16 else 0.0
    for ours, state in ((compiled, compiled_state), (chunked, chunked_state)):
        error = (_value(ours, state) - exact).abs()
        # Adam's L2 term can cancel a gradient to float32's rounding of the decay
        # (0.1 is not a float32), where float64 keeps it at 1e-17: the normalized
        # step of that residual is up to lr (measured: 40 values in a million).
        assert (error > tol).float().mean().item() < 1e-4
        assert error.max().item() < HYPER["lr"] * STEPS
    differ = compiled != chunked
    assert differ.float().mean().item() < 0.01
    ulp = torch.finfo(master).eps * compiled.float().abs()
    rounding = torch.maximum(2 * ulp, torch.tensor(HYPER["lr"] * STEPS * 2 ** -min(bits, 7)))
    assert ((compiled.float() - chunked.float()).abs() <= rounding).all()


class _Wide(nn.Module):
    """A model with one parameter past FUSED_MIN_NUMEL (the embedding)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 272)  # 1,114,112 values
        self.blocks = nn.ModuleList(nn.Linear(272, 272) for _ in range(2))
        self.head = nn.Linear(272, 64)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _wide_run(runner_of, model, state_dtype, steps=3):
    opt = cstorch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, state_dtype=state_dtype
    )
    runner = runner_of(model)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 4096, (4, 16), generator=g)
        y = torch.randint(0, 64, (4, 16), generator=g)
        loss = F.cross_entropy(runner(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    opt.synchronize()
    return torch.stack(losses), opt


@pytest.mark.parametrize(
    "state_dtype, options",
    [
        ("bfloat16", {}),
        ("bfloat16", {"overlap_updates": True}),
        ("int8", {}),
        ("int8", {"store": "disk"}),  # the pager's buffers (Note [explicit disk I/O])
    ],
    ids=["bf16-at-step", "bf16-overlapped", "int8-at-step", "int8-disk"],
)
def test_streamed_training_with_the_kernel_matches_eager_bitwise(
    kernels, monkeypatch, tmp_path, state_dtype, options
):
    def model():
        torch.manual_seed(0)
        return _Wide().to(torch.bfloat16)

    if options.get("store") == "disk":
        options = {**options, "store_dir": str(tmp_path / "store")}
    calls = _count_calls(monkeypatch, kernels)
    eager = model()
    ref_losses, eager_opt = _wide_run(lambda m: m, eager, state_dtype)
    streamed = model()
    losses, opt = _wide_run(
        lambda m: cstorch.compile(m, backend="ws", granularity="module", **options),
        streamed,
        state_dtype,
    )
    assert calls == [6], kernels.unavailable  # the embedding's 3 steps, in each run
    assert torch.equal(losses, ref_losses)
    for (name, a), b in zip(streamed.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(streamed.parameters(), eager.parameters()):
        for key, value in opt.state[a].items():
            assert torch.equal(value, eager_opt.state[b][key]), key


def _fails_to_compile(int8):
    """A kernel whose call fails as torch.compile does without a C++ compiler."""

    def fail(*args):
        raise RuntimeError("no C++ compiler found")

    return fail


def _refused(int8):
    """A kernel torch.compile refuses to make: an option its inductor lacks."""
    raise RuntimeError("Unexpected optimization option no_such_option")


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (_fails_to_compile, "no C\\+\\+ compiler.*g\\+\\+"),
        (_refused, "Unexpected optimization option"),
    ],
)
def test_without_the_kernel_the_chunks_run_and_say_why(kernels, monkeypatch, broken, said):
    """torch.compile fails where there is no C++ compiler, or refuses to make the kernel:
    the step says so once and runs the chunks, which give their own bits."""
    expected, _ = _ours(kernels, True, torch.bfloat16, torch.bfloat16)
    kernels.unavailable = None
    monkeypatch.setattr(kernels, "adam", broken)
    p = nn.Parameter(_problem()[0].to(torch.bfloat16))
    opt = cstorch.optim.AdamW([p], state_dtype=torch.bfloat16, **HYPER)
    with pytest.warns(UserWarning, match=f"could not be built .*{said}"):
        for g in _problem()[1]:
            p.grad = g.to(torch.bfloat16)
            opt.step()
    assert kernels.unavailable is not None
    assert torch.equal(p.detach(), expected)


def test_the_kernel_is_asked_only_for_options_this_torch_knows():
    """torch.compile refuses an option its inductor lacks (torch 2.11 has no
    realize_cpu_opcount_threshold): those the kernel asks for exist here, and an unknown
    one is left out."""
    from torch._inductor import config

    asked = {**fused._RECOMPUTE, "cpp.enable_floating_point_contract_flag": "off"}
    assert fused._known({**asked, "no_such_option": 1, "cpp.no_such_option": 2}) == asked
    assert all(hasattr(config, key) for key in fused._RECOMPUTE)

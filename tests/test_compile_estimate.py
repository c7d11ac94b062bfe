"""Compile-time costs, machine profile, estimate and compile directory (invariant 4).

FLOPs are checked against formulas written out term by term and against
torch's own FlopCounterMode run independently on the real model; activation
bytes against the arithmetic of what each operator saves; the estimate against
a hand-made machine profile with the numbers written out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from weightstream.common.files import write_text_atomic
from weightstream.compiler import hardware as hardware_mod
from weightstream.compiler import machine as machine_mod
from weightstream.compiler import software as software_mod
from weightstream.compiler import timing
from weightstream.compiler import updates as updates_mod
from weightstream.compiler.cost import (
    OUTSIDE_NAME,
    StepCosts,
    UnitCost,
    function_costs,
    unit_costs,
)
from weightstream.compiler.estimate import EstimateSettings, estimate
from weightstream.compiler.machine import load_or_measure
from weightstream.compiler.operators import OP_CLASSES
from weightstream.compiler.profile import MachineProfile, UpdateCost
from weightstream.compiler.report import compile_checksum, load_compile_dir, write_compile_dir
from weightstream.models import GPT, GPTConfig
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.partition import build_plan
from weightstream.runtime.trace import trace_forward

F32 = 4  # bytes per float32 element


def _plan(model, *args, **config):
    return build_plan(model, StreamingConfig(**config), trace_forward(model, args, {}))


class Chain(nn.Module):
    """Linear layers back to back: every FLOP and every saved byte has a formula."""

    def __init__(self, dims, act=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.act = nn.ReLU() if act else None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.act is not None and i < len(self.layers) - 1:
                x = self.act(x)
        return x


DIMS = [8, 16, 32, 4]
B = 5


# ---- FLOPs ---------------------------------------------------------------------------


def test_linear_chain_flops_match_the_formula():
    model = Chain(DIMS)
    x = torch.randn(B, DIMS[0], requires_grad=True)  # so every layer also computes dX
    costs = unit_costs(model, _plan(model, x), (x,), {})
    assert costs.backward_measured
    assert [u.name for u in costs.units] == ["layers.0", "layers.1", "layers.2"]
    assert [u.tensors for u in costs.units] == [2, 2, 2]  # weight and bias, each streamed
    for u, (i, o) in zip(costs.units, itertools.pairwise(DIMS)):
        # forward: addmm = 2*B*in*out (the bias add is not a matmul FLOP)
        assert u.fwd_flops == 2 * B * i * o
        # backward: dX = dY @ W (2*B*out*in) + dW = dY^T @ X (2*out*B*in)
        assert u.bwd_flops == 2 * B * o * i + 2 * o * B * i
    # 8x16, 16x32, 32x4: forward 2*5*(128 + 512 + 128) = 7680, backward twice that
    assert costs.fwd_flops == 7680
    assert costs.bwd_flops == 15360
    assert (costs.outside.fwd_flops, costs.outside.bwd_flops) == (0, 0)


def test_first_layer_without_input_grad_only_computes_the_weight_grad():
    model = Chain(DIMS)
    x = torch.randn(B, DIMS[0])
    costs = unit_costs(model, _plan(model, x), (x,), {})
    first, second = costs.units[0], costs.units[1]
    assert first.bwd_flops == 2 * B * 8 * 16  # dW only: nothing upstream needs dX
    assert second.bwd_flops == 4 * B * 16 * 32


def _per_unit_reference(model, plan, args):
    """FlopCounterMode on the real model, one unit at a time, on its captured inputs."""
    captured = {}

    def grab(index):
        def hook(_mod, inputs):
            captured.setdefault(index, [t.detach().requires_grad_(t.requires_grad) for t in inputs])

        return hook

    handles = [u.module.register_forward_pre_hook(grab(u.index)) for u in plan.units]
    model(*args)
    for h in handles:
        h.remove()
    ref = {}
    for u in plan.units:
        inputs = captured[u.index]
        with FlopCounterMode(display=False) as fwd:
            out = u.module(*inputs)
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.ones_like(out))
        ref[u.index] = (fwd.get_total_flops(), bwd.get_total_flops())
    return ref


def test_gpt_flops_per_unit_match_flop_counter_on_the_real_model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (2, 16))
    plan = _plan(model, idx)
    costs = unit_costs(model, plan, (idx,), {})
    assert costs.backward_measured
    # On the meta device attention takes the math path (bmm, counted); the CPU
    # flash kernel is not in FlopCounterMode's table, so the real run uses the
    # math kernel too: the same products.
    with sdpa_kernel(SDPBackend.MATH):
        ref = _per_unit_reference(model, plan, (idx,))
        with FlopCounterMode(display=False) as whole:
            model(idx).sum().backward()
    model.zero_grad(set_to_none=True)
    for u in costs.units:
        assert (u.fwd_flops, u.bwd_flops) == ref[u.index], u.name
    # Every FLOP of the step lands in exactly one entry.
    assert costs.flops == whole.get_total_flops()
    # A block: qkv 2*BT*C*3C + proj 2*BT*C*C + fc 2*BT*C*4C + proj 2*BT*4C*C (BT=32, C=32)
    # + attention 2 * (2*B*H*T*T*D) (B=2, H=4, T=16, D=8).
    block = costs.units[[u.name for u in costs.units].index("blocks.0")]
    assert block.fwd_flops == 2 * 32 * 32 * (3 * 32 + 32 + 4 * 32 + 4 * 32) + 2 * (
        2 * 2 * 4 * 16 * 16 * 8
    )


@pytest.mark.parametrize(
    "make, args",
    [
        (zoo.RootParams, lambda: (torch.randint(0, 50, (4, 8)),)),
        (zoo.CalledTwice, lambda: (torch.randn(16, 20),)),
        (zoo.PartlyFrozen, lambda: (torch.randn(16, 20),)),
    ],
)
def test_entries_sum_to_the_flop_counter_total(make, args):
    torch.manual_seed(0)
    model = make()
    a = args()
    costs = unit_costs(model, _plan(model, *a), a, {})
    with FlopCounterMode(display=False) as whole:
        model(*a).sum().backward()
    assert costs.flops == whole.get_total_flops() > 0


def test_root_unit_gets_only_what_runs_outside_its_children():
    torch.manual_seed(0)
    model = zoo.RootParams()  # root: h @ emb.weight.t() in its own window, pinned
    idx = torch.randint(0, 50, (4, 8))
    costs = unit_costs(model, _plan(model, idx), (idx,), {})
    by_name = {u.name: u for u in costs.units}
    assert by_name["<root>"].pinned
    # root: [32,16] @ [16,50]; mix: Linear(16,16) on 32 rows
    assert by_name["<root>"].fwd_flops == 2 * 32 * 16 * 50
    assert by_name["mix"].fwd_flops == 2 * 32 * 16 * 16
    assert by_name["emb"].fwd_flops == 0


def test_called_twice_unit_sums_both_calls():
    model = zoo.CalledTwice()
    x = torch.randn(16, 20)
    costs = unit_costs(model, _plan(model, x), (x,), {})
    shared = next(u for u in costs.units if u.name == "shared")
    assert shared.fwd_flops == 2 * (2 * 16 * 32 * 32)


class _NoMetaBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("this operator has no backward on meta")


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return _NoMetaBackward.apply(self.fc(x))


def test_backward_falls_back_to_twice_forward():
    model = _Boom()
    x = torch.randn(3, 6)
    costs = unit_costs(model, _plan(model, x), (x,), {})
    assert not costs.backward_measured and "no backward on meta" in costs.backward_error
    assert costs.units[0].fwd_flops == 2 * 3 * 6 * 6
    assert costs.units[0].bwd_flops == 2 * costs.units[0].fwd_flops


def test_costing_touches_no_real_data_and_no_rng():
    torch.manual_seed(0)
    model = Chain(DIMS, act=True)
    x = torch.randn(B, DIMS[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    unit_costs(model, _plan(model, x), (x,), {})
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu"


# ---- activation bytes ------------------------------------------------------------------


def test_linear_chain_activation_bytes():
    model = Chain(DIMS)
    x = torch.randn(B, DIMS[0])
    costs = unit_costs(model, _plan(model, x), (x,), {})
    # Each Linear saves its input for dW (its weight is re-fetched, not counted);
    # the last output is not saved; the sum loss saves only a shape.
    assert [u.activation_bytes for u in costs.units] == [B * 8 * F32, B * 16 * F32, B * 32 * F32]
    assert costs.outside.activation_bytes == 0


def test_activation_saved_twice_counts_once():
    model = Chain(DIMS, act=True)
    x = torch.randn(B, DIMS[0])
    costs = unit_costs(model, _plan(model, x), (x,), {})
    # ReLU (not a unit: outside) saves its output; the next Linear saves the same
    # tensor: counted once, where it was first saved.
    assert [u.activation_bytes for u in costs.units] == [B * 8 * F32, 0, 0]
    assert costs.outside.activation_bytes == B * 16 * F32 + B * 32 * F32


# ---- operators, their bytes and matmul sizes ----------------------------------------------


def test_operator_counts_bytes_and_matmul_sizes_of_a_chain():
    model = Chain(DIMS, act=True)  # ReLU modules are not units: their work is outside
    x = torch.randn(B, DIMS[0])
    costs = unit_costs(model, _plan(model, x), (x,), {})
    for u, (i, o) in zip(costs.units, itertools.pairwise(DIMS)):
        # forward: t (a view: no bytes) + addmm (a matmul: priced by FLOPs, no bytes)
        assert (u.fwd_ops, u.fwd_mem) == (2, {})
        # the product's effective size: the geometric mean of its two smallest dims
        small, mid, _ = sorted((B, i, o))
        assert u.fwd_matmul == {round((small * mid) ** 0.5): 2 * B * i * o}
        assert sum(u.bwd_matmul.values()) == u.bwd_flops
    first, second, last = costs.units
    # backward of the first layer: dW = mm, and the bias gradient sums dY [B, 16]
    # over the batch: reads B*16*4 bytes, writes 16*4 (nothing upstream needs dX)
    assert first.bwd_mem == {"simple": {B * 16 * F32 + 16 * F32: B * 16 * F32 + 16 * F32}}
    assert second.bwd_mem == {"simple": {B * 32 * F32 + 32 * F32: B * 32 * F32 + 32 * F32}}
    # The last layer's dY is the sum's gradient: a [B, 4] expansion of one element,
    # which reads its storage (4 bytes), not B * 4 elements.
    assert last.bwd_mem == {"simple": {F32 + 4 * F32: F32 + 4 * F32}}
    out = costs.outside
    # forward outside: 2 x relu (in + out) and the loss sum ([B, 4] in, 1 out)
    relu1, relu2, loss = 2 * B * 16 * F32, 2 * B * 32 * F32, B * 4 * F32 + F32
    assert out.fwd_mem == {"simple": {loss: loss, relu1: relu1, relu2: relu2}}
    assert out.fwd_ops == 3
    # backward outside: ones_like (1 in, 1 out) and 2 x threshold_backward (dY, Y in; dX out)
    assert out.bwd_mem == {
        "simple": {2 * F32: 2 * F32, 3 * relu1 // 2: 3 * relu1 // 2, 3 * relu2 // 2: 3 * relu2 // 2}
    }
    assert costs.ops == sum(e.fwd_ops + e.bwd_ops for e in costs.entries)
    assert costs.mem_bytes == sum(e.fwd_mem_bytes + e.bwd_mem_bytes for e in costs.entries)


def test_operator_classes_follow_the_aten_names():
    x = torch.randn(4, 128, requires_grad=True)
    gelu = function_costs(lambda t: F.gelu(t, approximate="tanh"), (x,))
    # gelu: in + out; gelu_backward: dY (the sum's gradient: one expanded element),
    # X in, dX out
    assert gelu.fwd_mem["gelu"] == {2 * 4 * 128 * F32: 2 * 4 * 128 * F32}
    assert gelu.bwd_mem["gelu"] == {F32 + 2 * 4 * 128 * F32: F32 + 2 * 4 * 128 * F32}
    assert set(gelu.fwd_mem) == {"gelu", "simple"}  # the loss's sum is simple
    soft = function_costs(lambda t: torch.log_softmax(t, -1), (x,))
    assert "softmax" in soft.fwd_mem and "softmax" in soft.bwd_mem


def test_attention_counts_as_one_fused_operator_with_its_flops_by_size():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (2, 16))
    costs = unit_costs(model, _plan(model, idx), (idx,), {})
    block = costs.units[[u.name for u in costs.units].index("blocks.0")]
    # B=2, H=4, T=S=16, D=8: the math path's 2 products forward, 4 backward;
    # effective size: the cube root of T * S * D
    fwd_attention = 2 * (2 * 2 * 4 * 16 * 16 * 8)
    n = round((16 * 16 * 8) ** (1 / 3))
    assert block.fwd_attention == {n: fwd_attention}
    assert block.bwd_attention == {n: 2 * fwd_attention}
    for u in costs.units:  # the decomposition's bmm are attention, not matmul FLOPs
        assert sum(u.fwd_matmul.values()) + sum(u.fwd_attention.values()) == u.fwd_flops
        assert sum(u.bwd_matmul.values()) + sum(u.bwd_attention.values()) == u.bwd_flops
    # One operator moving q, k, v and the output forward ([2, 4, 16, 8] each),
    # twice that backward: the same bytes on the "simple" list as a fused kernel.
    qkvo = 4 * 2 * 4 * 16 * 8 * F32
    assert block.fwd_mem["simple"][qkvo] >= qkvo
    assert block.bwd_mem["simple"][2 * qkvo] >= 2 * qkvo
    # FLOP totals are unchanged by the fused view
    assert block.fwd_flops == 2 * 32 * 32 * (3 * 32 + 32 + 4 * 32 + 4 * 32) + fwd_attention


# ---- estimate ------------------------------------------------------------------------------


def _profile(device="cuda:0") -> MachineProfile:
    return MachineProfile(
        device=device,
        device_name="hand-made",
        torch_version=torch.__version__,
        num_threads=1,
        matmul_flops={"float32": 1e9, "bfloat16": 4e9},
        copy_bandwidth=1e8,
        host_memory_bandwidth=4e8,
        disk_write_bandwidth=None,
        disk_read_bandwidth=None,
        disk_dir=None,
    )


def _costs() -> StepCosts:
    small = UnitCost(0, "small", 1000, 1000, 4000, 4000, fwd_flops=2e6, bwd_flops=4e6)
    big = UnitCost(1, "big", 500_000, 500_000, 2_000_000, 2_000_000, fwd_flops=1e6, bwd_flops=2e6)
    outside = UnitCost(-1, OUTSIDE_NAME, fwd_flops=1e5, bwd_flops=2e5)
    return StepCosts([small, big], outside)


def test_estimate_arithmetic_with_prefetch():
    est = estimate(_costs(), _profile(), EstimateSettings(batch_size=8, prefetch_depth=1))
    small, big = est.units
    # small: compute 2e6/1e9 = 2 ms fwd, 4 ms bwd; transfer 4000/1e8 = 40 us fwd,
    # (4000 weights + 4000 grads)/1e8 = 80 us bwd -> compute-bound
    assert small.fwd_compute_s == pytest.approx(2e-3)
    assert small.bwd_compute_s == pytest.approx(4e-3)
    assert small.fwd_transfer_s == pytest.approx(4e-5)
    assert small.bwd_transfer_s == pytest.approx(8e-5)
    # big: compute 1 ms / 2 ms; transfer 2e6/1e8 = 20 ms, 4e6/1e8 = 40 ms -> transfer-bound
    assert (big.fwd_transfer_s, big.bwd_transfer_s) == (pytest.approx(0.02), pytest.approx(0.04))
    assert (small.bound, big.bound) == ("compute", "transfer")
    # Shares of the passes: a unit's work hides the fetch of the next unit of the
    # pass, and the first unit of each pass also waits for its own fetch.
    # forward (small, big): small = 40 us own fetch + max(2 ms work, 20 ms big's fetch);
    # big = max(1 ms, nothing after it)
    assert (small.fwd_s, big.fwd_s) == (pytest.approx(4e-5 + 0.02), pytest.approx(1e-3))
    # backward (big, small): big = 40 ms own fetch + max(2 ms, 80 us small's fetch);
    # small = max(4 ms, nothing)
    assert (big.bwd_s, small.bwd_s) == (pytest.approx(0.04 + 2e-3), pytest.approx(4e-3))
    # update: 28 bytes per trainable parameter over 4e8 B/s
    assert small.update_s == pytest.approx(1000 * 28 / 4e8)
    assert big.update_s == pytest.approx(500_000 * 28 / 4e8)
    assert est.update_s == pytest.approx(0.03507)
    # outside the units: 1e5 and 2e5 FLOPs at 1e9 FLOP/s
    assert (est.outside_fwd_s, est.outside_bwd_s) == (pytest.approx(1e-4), pytest.approx(2e-4))
    step = (4e-5 + 0.02 + 1e-3) + (0.04 + 2e-3 + 4e-3) + (1e-4 + 2e-4) + 0.03507
    assert est.step_s == pytest.approx(step)
    assert est.est_samples_per_sec == pytest.approx(8 / step)
    assert est.compute_s == pytest.approx(2e-3 + 4e-3 + 1e-3 + 2e-3 + 3e-4)
    assert est.transfer_s == pytest.approx(4e-5 + 8e-5 + 0.02 + 0.04)
    assert est.bound == "transfer"
    # Limit: compute 9.3e6/1e9 = 9.3 ms; device link (2 x 2,004,000 weights +
    # 2,004,000 grads)/1e8 = 60.12 ms; host RAM 501,000 x 28/4e8 = 35.07 ms.
    assert est.link_bytes == 6_012_000 and est.host_bytes == 501_000 * 28
    assert est.limit_s == pytest.approx(0.06012)
    assert est.limit_bound == "device link"
    assert est.limit_samples_per_sec == pytest.approx(8 / 0.06012)
    assert est.fraction_of_limit(8 / 0.06012 / 2) == pytest.approx(0.5)


def test_estimate_without_prefetch_adds_compute_and_transfer():
    est = estimate(_costs(), _profile(), EstimateSettings(batch_size=8, prefetch_depth=0))
    step = (2e-3 + 4e-5) + (4e-3 + 8e-5) + (1e-3 + 0.02) + (2e-3 + 0.04) + 3e-4 + 0.03507
    assert est.step_s == pytest.approx(step)


def test_estimate_dtypes_and_cpu_limit():
    settings = EstimateSettings(
        batch_size=8, compute_dtype=torch.bfloat16, transfer_dtype="bfloat16"
    )
    est = estimate(_costs(), _profile("cpu"), settings)
    small, big = est.units
    assert small.fwd_compute_s == pytest.approx(2e6 / 4e9)
    assert big.fwd_transfer_s == pytest.approx(500_000 * 2 / 1e8)
    assert big.bwd_transfer_s == pytest.approx(2 * 500_000 * 2 / 1e8)
    # On the CPU the link is host RAM: copies move 2 x (2*501,000*2 + 501,000*2)
    # bytes, the optimizer 501,000 x 28, all over 4e8 B/s.
    link = 3 * 501_000 * 2
    assert est.limit_bound == "host memory"
    assert est.limit_s == pytest.approx((2 * link + 501_000 * 28) / 4e8)
    with pytest.raises(ValueError, match="float16"):
        estimate(_costs(), _profile(), EstimateSettings(batch_size=8, compute_dtype="float16"))
    with pytest.raises(ValueError, match="batch_size"):
        EstimateSettings(batch_size=0)


def _overhead_profile() -> MachineProfile:
    """A CPU profile with every curve and fixed cost: round numbers to check by hand."""
    return MachineProfile(
        device="cpu",
        device_name="hand-made",
        torch_version=torch.__version__,
        num_threads=1,
        matmul_flops={"float32": 1e9},
        copy_bandwidth=1e8,
        host_memory_bandwidth=4e8,
        disk_write_bandwidth=None,
        disk_read_bandwidth=None,
        disk_dir=None,
        matmul_curve={"10": 2.5e8, "40": 5e8},
        attention_curve={"8": 1e8},
        op_bandwidth={"simple": {"1000": 1e9, "100000": 4e9}, "gelu": {"1000": 2.5e8}},
        op_overhead_fwd_s=1e-5,
        op_overhead_bwd_s=5e-6,
        unit_overhead_s=1e-4,
        param_overhead_s=2e-5,
        stream_call_s=5e-5,
        step_overhead_s=3e-4,
    )


def test_profile_curves_interpolate_log_log():
    m = _overhead_profile()
    # between two points: geometric; n=20 is halfway from 10 to 40 in log n
    assert m.matmul_throughput(20, "float32") == pytest.approx(2.5e8 * 2**0.5)
    assert m.matmul_throughput(5, "float32") == pytest.approx(2.5e8)  # clamped below
    # above the curve: rises (log-linearly) to the peak at 4 x the last size
    assert m.matmul_throughput(80, "float32") == pytest.approx(5e8 * 2**0.5)
    assert m.matmul_throughput(160, "float32") == pytest.approx(1e9)
    assert m.matmul_throughput(0, "float32") == 1e9  # unknown shape: the peak
    assert m.op_throughput("simple", 10_000) == pytest.approx(2e9)
    assert m.op_throughput("gelu", 10**6) == 2.5e8  # one point: the class's figure
    assert m.op_throughput("silu", 1000) == 1e9  # no figure: priced as simple


def test_other_dtypes_priced_by_their_own_speeds():
    """A dtype slower than float32 (bf16 without native instructions) runs its products
    at its own peak wherever float32 is faster, its attention by its own curve, and
    takes a diluted in-situ factor; a faster dtype scales the float32 curves up."""
    m = _overhead_profile()
    m.matmul_flops = {"float32": 1e9, "bfloat16": 2e8, "float16": 4e9}
    m.attention_curves = {"bfloat16": {"8": 5e7}}
    m.in_situ_factor = 1.5
    # bf16: min(its peak, the float32 curve), not the curve x 0.2
    assert m.matmul_throughput(20, "bfloat16") == pytest.approx(2e8)
    assert m.matmul_throughput(5, "bfloat16") == pytest.approx(2e8)
    # fp16 (4x float32's peak): the float32 curve x 4, capped at its peak
    assert m.matmul_throughput(20, "float16") == pytest.approx(4 * 2.5e8 * 2**0.5)
    assert m.matmul_throughput(160, "float16") == pytest.approx(4e9)
    assert m.attention_throughput(8, "bfloat16") == pytest.approx(5e7)  # its own curve
    assert m.attention_throughput(8, "float16") == pytest.approx(4e8)  # float32's x 4
    assert m.attention_throughput(8, "float32") == pytest.approx(1e8)
    assert m.in_situ_compute_factor("float32") == pytest.approx(1.5)
    assert m.in_situ_compute_factor("bfloat16") == pytest.approx(1 + 0.5 * 0.2)
    assert m.in_situ_compute_factor("float16") == pytest.approx(1.5)
    # The estimate uses them: a compute-bound unit in bf16 costs FLOPs / (bf16 peak)
    # x the diluted factor.
    unit = UnitCost(
        0,
        "block",
        numel=10,
        trainable_numel=10,
        weight_bytes=40,
        trainable_bytes=40,
        fwd_flops=2_000_000,
        bwd_flops=4_000_000,
        trainable_tensors=1,
        tensors=1,
    )
    est = estimate(
        StepCosts(units=[unit], outside=UnitCost(-1, "<outside>")),
        m,
        EstimateSettings(batch_size=1, compute_dtype="bfloat16", prefetch_depth=1),
    )
    assert est.units[0].fwd_compute_s == pytest.approx(2e6 / 2e8 * 1.1)


def test_estimate_terms_of_work_overheads_update_and_input():
    unit = UnitCost(
        0,
        "block",
        numel=1000,
        trainable_numel=1000,
        weight_bytes=4000,
        trainable_bytes=4000,
        fwd_flops=4_000_000,
        bwd_flops=8_000_000,
        trainable_tensors=2,
        tensors=2,
        fwd_ops=10,
        bwd_ops=20,
        fwd_mem={"simple": {10_000: 200_000}, "gelu": {1000: 100_000}},
        bwd_mem={"simple": {10_000: 400_000}},
        fwd_matmul={20: 3_000_000},
        bwd_matmul={20: 6_000_000},
        fwd_attention={8: 500_000},
        bwd_attention={8: 1_000_000},
    )
    outside = UnitCost(-1, OUTSIDE_NAME, fwd_ops=3, bwd_ops=4, fwd_mem={"simple": {1000: 1000}})
    update = UpdateCost(spec={}, fixed_s=1e-3, per_tensor_s=1e-4, per_element_s=1e-8)
    settings = EstimateSettings(
        batch_size=4, update=update, input_s=2e-3, step_overhead_s=3e-4, prefetch_depth=1
    )
    est = estimate(StepCosts([unit], outside), _overhead_profile(), settings)
    (u,) = est.units
    mm20 = 2.5e8 * 2**0.5  # matmul throughput at n=20 (see the interpolation test)
    # compute: 3e6 matmul FLOPs at n=20, 5e5 attention FLOPs at 1e8, the other 5e5 at peak
    assert u.fwd_compute_s == pytest.approx(3e6 / mm20 + 5e5 / 1e8 + 5e5 / 1e9)
    assert u.bwd_compute_s == pytest.approx(6e6 / mm20 + 1e6 / 1e8 + 1e6 / 1e9)
    # memory: simple operators of 10 kB at 2e9 B/s, gelu at 2.5e8 B/s
    assert u.fwd_memory_s == pytest.approx(2e5 / 2e9 + 1e5 / 2.5e8)
    assert u.bwd_memory_s == pytest.approx(4e5 / 2e9)
    # overhead: operators x the pass's fixed cost
    assert (u.fwd_overhead_s, u.bwd_overhead_s) == (pytest.approx(1e-4), pytest.approx(1e-4))
    # streaming: the unit's fetches (it is the first unit of both passes) and bookkeeping
    assert (u.fwd_transfer_s, u.bwd_transfer_s) == (pytest.approx(4e-5), pytest.approx(8e-5))
    assert u.fwd_s == pytest.approx(u.fwd_work_s + 4e-5)
    assert u.bwd_s == pytest.approx(u.bwd_work_s + 8e-5)
    # streaming bookkeeping: the unit, and its 2 parameter tensors
    assert u.stream_s == pytest.approx(1e-4 + 2 * 2e-5)
    # update: 2 tensors x 1e-4 + 1000 elements x 1e-8, and the step's fixed 1 ms
    assert u.update_s == pytest.approx(2e-4 + 1e-5)
    assert est.update_s == pytest.approx(1e-3 + 2e-4 + 1e-5)
    # outside: operators only (3 x 10 us, 4 x 5 us) and 1 kB of simple bytes at 1e9 B/s
    assert est.outside_fwd_s == pytest.approx(3e-5 + 1000 / 1e9)
    assert est.outside_bwd_s == pytest.approx(2e-5)
    # the streamed call's own cost, once a step whatever the units
    assert est.stream_call_s == 5e-5
    step = (
        u.fwd_s
        + u.bwd_s
        + u.stream_s
        + 5e-5
        + est.outside_fwd_s
        + est.outside_bwd_s
        + est.update_s
        + 3e-4
    ) + 2e-3
    assert est.step_s == pytest.approx(step)
    assert est.est_samples_per_sec == pytest.approx(4 / step)
    assert est.model_samples_per_sec == pytest.approx(4 / (step - 2e-3))
    assert est.overhead_s == pytest.approx(1e-4 + 1e-4 + 1.4e-4 + 5e-5 + 3e-5 + 2e-5 + 3e-4)
    assert est.memory_s == pytest.approx(u.fwd_memory_s + u.bwd_memory_s + 1e-6)
    assert est.bound == "compute"
    # On the CPU the operators' bytes load host memory too.
    op_bytes = 200_000 + 100_000 + 400_000 + 1000
    assert est.op_bytes == op_bytes
    assert est.limit_s == pytest.approx(
        max(12e6 / 1e9, (2 * (2 * 4000 + 4000) + 1000 * 28 + op_bytes) / 4e8)
    )


def test_in_situ_factor_scales_work_on_data_not_the_update_or_fixed_costs():
    profile = _overhead_profile()
    unit = UnitCost(
        0,
        "block",
        1000,
        1000,
        4000,
        4000,
        fwd_flops=4e6,
        bwd_flops=8e6,
        tensors=2,
        fwd_ops=10,
        bwd_ops=20,
        fwd_mem={"simple": {10_000: 200_000}},
        fwd_matmul={20: 3_000_000},
        bwd_matmul={20: 6_000_000},
    )
    outside = UnitCost(-1, OUTSIDE_NAME, fwd_ops=3, bwd_ops=4)
    update = UpdateCost(spec={}, fixed_s=1e-3, per_tensor_s=1e-4, per_element_s=1e-8)
    settings = EstimateSettings(batch_size=4, update=update, input_s=2e-3, step_overhead_s=3e-4)
    costs = StepCosts([unit], outside)
    one = estimate(costs, profile, settings)
    profile.in_situ_factor = 1.5
    slow = estimate(costs, profile, settings)
    (u1,), (u2,) = one.units, slow.units
    for name in ("fwd_compute_s", "bwd_compute_s", "fwd_memory_s"):
        assert getattr(u2, name) == pytest.approx(1.5 * getattr(u1, name)), name
    # timed after a tiny training step already (Note [update in context])
    assert slow.update_s == one.update_s > 0
    # fixed costs, measured as they occur in a step (Note [in situ])
    for name in ("fwd_overhead_s", "bwd_overhead_s", "stream_s"):
        assert getattr(u2, name) == getattr(u1, name) > 0, name
    assert (slow.outside_fwd_s, slow.stream_call_s) == (one.outside_fwd_s, one.stream_call_s)
    # measured in their own context: transfers, input, the loop's bookkeeping
    assert (u2.fwd_transfer_s, u2.bwd_transfer_s) == (u1.fwd_transfer_s, u1.bwd_transfer_s)
    assert slow.input_s == one.input_s
    grown = sum(u.fwd_compute_s + u.bwd_compute_s + u.fwd_memory_s for u in one.units)
    assert slow.step_s == pytest.approx(one.step_s + 0.5 * grown)


def test_no_operator_is_priced_faster_than_on_operands_larger_than_the_caches():
    profile = _overhead_profile()
    # small operands timed while the caches held them: faster than the large ones
    profile.op_bandwidth = {"simple": {"1000": 8e9, "100000": 2e9}, "gelu": {"1000": 2.5e8}}
    assert profile.cold_op_throughput() == 2e9
    unit = UnitCost(0, "u", fwd_mem={"simple": {1000: 10**6}, "gelu": {1000: 10**5}})
    costs = StepCosts([unit], UnitCost(-1, OUTSIDE_NAME))
    (u,) = estimate(costs, profile, EstimateSettings(batch_size=1)).units
    assert u.fwd_memory_s == pytest.approx(10**6 / 2e9 + 10**5 / 2.5e8)
    profile.op_bandwidth = {}
    assert profile.cold_op_throughput() == profile.host_memory_bandwidth


def test_layer_pipelined_estimate_has_no_transfer_and_no_streaming():
    costs = _costs()
    ws = estimate(costs, _overhead_profile(), EstimateSettings(batch_size=8))
    lp = estimate(
        costs, _overhead_profile(), EstimateSettings(batch_size=8, weight_streaming=False)
    )
    for w, p in zip(ws.units, lp.units):
        assert (p.fwd_transfer_s, p.bwd_transfer_s, p.stream_s) == (0.0, 0.0, 0.0)
        assert (p.fwd_s, p.bwd_s) == (p.fwd_work_s, p.bwd_work_s)
        assert w.stream_s == 1e-4
    assert lp.link_bytes == 0 and lp.transfer_s == 0.0
    assert (ws.stream_call_s, lp.stream_call_s) == (5e-5, 0.0)
    assert lp.step_s < ws.step_s


def test_a_recomputed_unit_does_its_forward_work_again_in_the_backward():
    costs = _costs()
    for weight_streaming in (True, False):
        base = estimate(
            costs, _overhead_profile(), EstimateSettings(8, weight_streaming=weight_streaming)
        )
        settings = EstimateSettings(8, weight_streaming=weight_streaming, recompute=(1,))
        again = estimate(costs, _overhead_profile(), settings)
        for b, a in zip(base.units, again.units):
            extra = b.fwd_work_s if a.index == 1 else 0.0
            assert a.bwd_work_s == pytest.approx(b.bwd_work_s + extra, rel=1e-12)
            assert a.bwd_compute_s == pytest.approx(
                b.bwd_compute_s + (b.fwd_compute_s if a.index == 1 else 0.0), rel=1e-12
            )
            assert (a.fwd_s, a.bwd_transfer_s) == (b.fwd_s, b.bwd_transfer_s)
        assert again.step_s > base.step_s


def test_a_disk_stores_file_traffic_bounds_the_step_from_below():
    costs = _costs()
    machine = dataclasses.replace(_profile(), disk_read_bandwidth=1e8, disk_write_bandwidth=5e7)
    base = estimate(costs, machine, EstimateSettings(batch_size=8))
    forward = sum(u.fwd_s for u in base.units) + base.outside_fwd_s
    assert base.disk_s == 0.0
    # Little traffic: priced and shown, but the step's own work is longer.
    light = EstimateSettings(batch_size=8, disk_read_bytes=10**5, disk_write_bytes=10**5)
    est = estimate(costs, machine, light)
    assert est.disk_s == pytest.approx(1e5 / 1e8 + 1e5 / 5e7)
    assert est.step_s == pytest.approx(base.step_s)
    # Heavy traffic with the masters in RAM: the forward reads no file, so the step
    # is at least the forward and then the traffic (10 + 20 = 30 ms), plus the loop.
    heavy = EstimateSettings(
        batch_size=8, disk_read_bytes=10**6, disk_write_bytes=10**6, input_s=1e-3
    )
    est = estimate(costs, machine, heavy)
    traffic = 1e6 / 1e8 + 1e6 / 5e7
    assert est.disk_s == pytest.approx(traffic)
    assert est.step_s == pytest.approx(max(base.step_s + 1e-3, forward + traffic + 1e-3))
    # Masters in the files: the traffic spans the whole step, the forward included.
    more = dataclasses.replace(
        heavy, disk_read_bytes=10**7, disk_write_bytes=10**7, forward_reads_disk=True
    )
    est = estimate(costs, machine, more)
    assert est.step_s == pytest.approx(10 * traffic + 1e-3)
    assert est.bound == "disk"
    # Without disk figures in the profile the traffic is not priced, and the estimate says so.
    est = estimate(costs, _profile(), more)
    assert est.disk_s == 0.0 and est.step_s == pytest.approx(base.step_s + 1e-3)
    assert any("not priced" in n for n in est.notes)


# ---- checksum and compile directory -------------------------------------------------------


def test_checksum_tracks_structure_batch_and_settings_not_weights():
    torch.manual_seed(0)
    model = Chain(DIMS)
    batch = [((B, 8), torch.float32)]
    settings = {"prefetch_depth": 1, "granularity": "auto"}
    base = compile_checksum(model, batch, settings)
    assert base == compile_checksum(model, batch, dict(reversed(settings.items())))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0).add_(1.0)
    assert compile_checksum(model, batch, settings) == base  # weight values: no change
    torch.manual_seed(1)
    assert compile_checksum(Chain(DIMS), batch, settings) == base  # another init: no change
    assert (
        compile_checksum(model, [torch.empty(B, 8)], settings) == base
    )  # tensor == (shape, dtype)

    assert compile_checksum(model, [((B + 1, 8), torch.float32)], settings) != base
    assert compile_checksum(model, [((B, 8), torch.bfloat16)], settings) != base
    assert compile_checksum(model, batch, {**settings, "prefetch_depth": 2}) != base
    assert compile_checksum(Chain([8, 16, 33, 4]), batch, settings) != base
    assert compile_checksum(Chain(DIMS, act=True), batch, settings) != base
    frozen = Chain(DIMS)
    frozen.layers[0].weight.requires_grad_(False)
    assert compile_checksum(frozen, batch, settings) != base
    tied = Chain([8, 8, 8, 4])
    untied = compile_checksum(tied, batch, settings)
    tied.layers[1].weight = tied.layers[0].weight
    assert compile_checksum(tied, batch, settings) != untied
    with pytest.raises(TypeError, match="checksum"):
        compile_checksum(model, batch, {"x": object()})


def _compiled(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4))
    idx = torch.randint(0, 64, (2, 16))
    plan = _plan(model, idx)
    costs = unit_costs(model, plan, (idx,), {})
    est = estimate(costs, _profile("cpu"), EstimateSettings(batch_size=2))
    settings = {"prefetch_depth": 1, "unit_classes": [nn.Linear]}
    checksum = compile_checksum(model, (idx,), settings)
    path = write_compile_dir(tmp_path, checksum, plan, costs, est, _profile("cpu"), settings)
    return checksum, path, plan, est


def test_compile_dir_written_and_read_back(tmp_path):
    checksum, path, plan, est = _compiled(tmp_path)
    assert path == tmp_path / f"ws_{checksum}"
    assert sorted(p.name for p in path.iterdir()) == ["compile_report.txt", "plan.json"]
    data = load_compile_dir(tmp_path, checksum)
    assert data == json.loads((path / "plan.json").read_text())
    assert data["checksum"] == checksum
    assert data["est_samples_per_sec"] == pytest.approx(est.est_samples_per_sec)
    assert data["settings"] == {
        "prefetch_depth": 1,
        "unit_classes": ["torch.nn.modules.linear.Linear"],
    }
    assert [u["name"] for u in data["units"]] == [u.display_name for u in plan.units]
    unit_keys = {
        "index",
        "name",
        "params",
        "weight_bytes",
        "fwd_flops",
        "bwd_flops",
        "activation_bytes",
        "est_fwd_s",
        "est_bwd_s",
        "est_fwd_transfer_s",
        "est_bwd_transfer_s",
        "est_update_s",
        "pinned",
        "bound",
    }
    assert all(unit_keys <= set(u) for u in data["units"])
    assert data["totals"]["weight_bytes"] == sum(u.weight_bytes for u in plan.units)
    text = (path / "compile_report.txt").read_text()
    for u in plan.units:
        assert f" {u.display_name} " in text
    assert f"est. samples/sec      {est.est_samples_per_sec:.2f}  (bound by {est.bound})" in text


def test_load_compile_dir_misses(tmp_path):
    checksum, path, _, _ = _compiled(tmp_path)
    assert load_compile_dir(tmp_path, "0" * 20) is None  # absent
    text = (path / "plan.json").read_text()
    (path / "plan.json").write_text(text[: len(text) // 2])  # torn
    assert load_compile_dir(tmp_path, checksum) is None
    data = json.loads(text)
    del data["units"]
    (path / "plan.json").write_text(json.dumps(data))  # incomplete
    assert load_compile_dir(tmp_path, checksum) is None
    (path / "plan.json").write_text(text)
    assert load_compile_dir(tmp_path, checksum) is not None
    (path / "compile_report.txt").unlink()  # report missing
    assert load_compile_dir(tmp_path, checksum) is None


# ---- machine profile -------------------------------------------------------------------------


def test_machine_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    first = load_or_measure("cpu", quick=True)
    path = machine_mod.default_path("cpu", quick=True)
    assert path.parent == tmp_path and path.is_file()
    assert first.quick and first.matmul_flops["float32"] > 0
    assert first.copy_bandwidth > 0 and first.host_memory_bandwidth > 0
    assert first.disk_read_bandwidth > 0 and first.disk_write_bandwidth > 0
    # 3 repetitions of each hardware figure, 1 of the software ones with quick sizes;
    # the timed steps of the in-situ proxy
    software = {"op_overhead_fwd", "op_overhead_bwd", "unit_overhead", "param_overhead"}
    software |= {"stream_call", "stream_bandwidth", "step_overhead"}
    for k, s in first.samples.items():
        if k != "in_situ":
            assert len(s) == (1 if k in software else 3), k
    assert len(first.samples["in_situ"]) == timing.QUICK.proxy_steps
    assert 0.5 <= first.in_situ_factor <= 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # probe file removed
    # The fixed costs and curves of the estimate (Note [fixed costs] in software.py).
    assert first.op_overhead_fwd_s > 0 and first.op_overhead_bwd_s > 0
    assert first.unit_overhead_s >= 0 and first.step_overhead_s >= 0
    assert first.param_overhead_s >= 0 and first.stream_call_s >= 0
    assert first.matmul_curve and first.attention_curve
    assert set(first.op_bandwidth) == {"simple", *OP_CLASSES}
    assert first.runtime_digest == machine_mod.runtime_digest()
    assert first.other_load is None or 0 <= first.other_load <= 1

    calls = []

    def fake_measure(device, quick=False, disk_dir=None):
        calls.append(device)
        return first

    monkeypatch.setattr(machine_mod, "measure", fake_measure)
    assert load_or_measure("cpu", quick=True) == first
    assert calls == []  # cache hit: nothing measured
    load_or_measure("cpu", quick=True, remeasure=True)
    assert len(calls) == 1
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="measuring again"):
        load_or_measure("cpu", quick=True)
    assert len(calls) == 2
    assert load_or_measure("cpu", path=tmp_path / "other.json", quick=True) == first
    assert len(calls) == 3 and (tmp_path / "other.json").is_file()


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> MachineProfile:
    """One quick profile for the cache tests below (measured once per module)."""
    path = tmp_path_factory.mktemp("profile") / "machine.json"
    return load_or_measure("cpu", path=path, quick=True)


def _cached(profile: MachineProfile, tmp_path, monkeypatch) -> MachineProfile:
    """``profile`` as the cached profile of a cache directory at ``tmp_path``."""
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    data = {**profile.to_dict(), "disk_dir": str(tmp_path)}
    write_text_atomic(
        machine_mod.default_path("cpu", quick=True), json.dumps(data, indent=2, sort_keys=True)
    )
    return load_or_measure("cpu", quick=True)


def test_a_runtime_change_measures_only_the_software_figures_again(
    tmp_path, monkeypatch, quick_profile
):
    first = _cached(quick_profile, tmp_path, monkeypatch)
    monkeypatch.setattr(machine_mod, "runtime_digest", lambda: "another runtime")
    monkeypatch.setattr(machine_mod, "measure", lambda *a, **k: pytest.fail("hardware measured"))
    monkeypatch.setattr(machine_mod, "wait_for_quiet", lambda timeout: True)  # a quiet machine
    software = []

    def fake_software(device, sizes, copy_bandwidth, calm):
        software.append(device)
        return {
            "op_overhead_fwd_s": 1.0,
            "op_overhead_bwd_s": 2.0,
            "unit_overhead_s": 3.0,
            "step_overhead_s": 4.0,
            "samples": {"op_overhead_fwd": [1.0] * 3},
        }

    monkeypatch.setattr(software_mod, "fixed_costs", fake_software)
    second = load_or_measure("cpu", quick=True)
    assert len(software) == 1
    assert (second.op_overhead_fwd_s, second.unit_overhead_s, second.step_overhead_s) == (
        1.0,
        3.0,
        4.0,
    )
    # the hardware figures are kept, the update costs (software) dropped
    assert second.matmul_flops == first.matmul_flops
    assert second.matmul_curve == first.matmul_curve and second.update_costs == {}
    assert second.runtime_digest == "another runtime"
    assert load_or_measure("cpu", quick=True) == second  # written back: a hit now
    assert len(software) == 1


def test_attention_curve_of_a_dtype_is_measured_on_first_use_and_cached(
    tmp_path, monkeypatch, quick_profile
):
    profile = _cached(quick_profile, tmp_path, monkeypatch)
    assert profile.attention_curves == {}  # measuring the profile times float32 only
    machine_mod.attention_curve_for(profile, "float32")
    assert profile.attention_curves == {}
    machine_mod.attention_curve_for(profile, "bfloat16")
    curve = profile.attention_curves["bfloat16"]
    assert curve and all(v > 0 for v in curve.values())
    size = int(next(iter(curve)))
    assert profile.attention_throughput(size, "bfloat16") == pytest.approx(
        min(curve[str(size)], profile.peak_flops("bfloat16"))
    )
    monkeypatch.setattr(hardware_mod, "attention_curve", lambda *a: pytest.fail("measured twice"))
    reloaded = load_or_measure("cpu", quick=True)  # the cache file holds it now
    assert reloaded.attention_curves == {"bfloat16": curve}
    machine_mod.attention_curve_for(reloaded, "bfloat16")


def test_update_cost_is_measured_once_per_setting_and_cached(tmp_path, monkeypatch, quick_profile):
    profile = _cached(quick_profile, tmp_path, monkeypatch)
    spec = updates_mod.update_spec(
        "SGD", {"learning_rate": [{"scheduler": "Linear"}], "momentum": 0.9}
    )
    assert spec["kwargs"] == {"momentum": 0.9}  # the learning rate does not change the cost
    assert spec["schedule"] is None  # ... but a schedule's step does: it is part of the spec
    schedule = [
        {
            "scheduler": "Linear",
            "initial_learning_rate": 0.0,
            "end_learning_rate": 1.0,
            "total_iters": 2,
        },
        {
            "scheduler": "CosineDecay",
            "initial_learning_rate": 1.0,
            "end_learning_rate": 0.1,
            "total_iters": 10,
        },
    ]
    scheduled = updates_mod.update_spec("SGD", {"momentum": 0.9}, schedule=schedule)
    assert scheduled["schedule"] == schedule and scheduled["schedule"] is not schedule
    assert updates_mod.update_key(scheduled) != updates_mod.update_key(spec)
    assert machine_mod.update_cost(profile, scheduled).fixed_s >= 0  # timed with its scheduler
    # the per-element cost is timed on a tensor the model's size (a power of two)
    assert spec["numel"] is None
    sized = updates_mod.update_spec("SGD", {"momentum": 0.9}, numel=235_146)
    assert sized["numel"] == 2**18
    assert updates_mod.update_spec("SGD", numel=10)["numel"] == 2**14
    assert updates_mod.update_spec("SGD", numel=10**9)["numel"] == 2**22
    cost = machine_mod.update_cost(profile, spec)
    assert cost.per_tensor_s >= 0 and cost.per_element_s >= 0 and cost.fixed_s >= 0
    assert cost.seconds(2, 1000) == pytest.approx(
        cost.fixed_s + 2 * cost.per_tensor_s + 1000 * cost.per_element_s
    )
    monkeypatch.setattr(updates_mod, "measure_update", lambda *a: pytest.fail("measured twice"))
    reloaded = load_or_measure("cpu", quick=True)  # the cache file holds it now
    assert machine_mod.update_cost(reloaded, spec) == cost
    with pytest.warns(UserWarning, match="could not time the optimizer update"):
        monkeypatch.setattr(
            updates_mod, "measure_update", lambda *a: (_ for _ in ()).throw(ValueError("x"))
        )
        assert machine_mod.update_cost(reloaded, {**spec, "optimizer_type": "Nope"}) is None


def test_a_repetition_disturbed_by_other_processes_is_measured_again(monkeypatch):
    shares = iter([0.6, 0.3, 0.1, 0.0])

    class FakeLoad:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fraction = next(shares)
            return False

    monkeypatch.setattr(timing, "OtherLoad", FakeLoad)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    results = iter(["busy", "less busy", "calm", "never reached"])
    calm = timing.Calm(timing.FULL.patience)
    assert calm(lambda: next(results)) == "calm"
    assert not calm.disturbed
    # out of retries: the calmest attempt
    shares = iter([0.9, 0.5, 0.7])
    results = iter(["a", "b", "c"])
    calm = timing.Calm(dataclasses.replace(timing.FULL.patience, retries=2))
    assert calm(lambda: next(results)) == "b"
    assert calm.disturbed and calm.busiest == 0.5


@contextlib.contextmanager
def _competing():
    """A process spinning on each CPU while the block runs: a busy machine, for real."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)  # started and spinning
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


_JUDGED = timing.Patience(retries=1, pause_s=0.0, wait_s=0.0, judged=True)
needs_proc_stat = pytest.mark.skipif(
    not os.path.exists("/proc/stat"), reason="OtherLoad reads /proc/stat"
)


@needs_proc_stat
def test_a_repetition_measured_beside_a_busy_process_is_seen_as_disturbed():
    calm = timing.Calm(_JUDGED)
    with _competing():
        calm(lambda: time.sleep(0.2))  # measured twice (one retry), busy both times
    assert calm.disturbed and calm.busiest > timing.CALM


@pytest.mark.slow  # times a profile beside a busy process: timing-sensitive, with the slow tests
@needs_proc_stat
def test_a_profile_measured_beside_a_busy_process_is_not_trusted(tmp_path, monkeypatch):
    # The quick sizes, judged as a full profile is (Note [quiet timings]).
    monkeypatch.setattr(machine_mod, "QUICK", dataclasses.replace(timing.QUICK, patience=_JUDGED))
    path = tmp_path / "machine.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a thread pool waiting for descheduled workers: slow, not wrong
    try:
        with _competing(), pytest.warns(UserWarning, match="other processes kept the CPUs busy"):
            busy = load_or_measure("cpu", path=path, quick=True)
        assert "hardware" in busy.disturbed
        assert json.loads(path.read_text())["disturbed"] == busy.disturbed  # cached, marked
        calm = dataclasses.replace(busy, disturbed=[])
        calls = []

        def fake_measure(device, quick=False, disk_dir=None):
            calls.append(device)
            return calm

        monkeypatch.setattr(machine_mod, "measure", fake_measure)
        # While the machine is still busy the marked profile serves: a measurement
        # now would be disturbed too.
        monkeypatch.setattr(machine_mod, "wait_for_quiet", lambda timeout: False)
        assert load_or_measure("cpu", path=path, quick=True).disturbed == busy.disturbed
        assert calls == []
        monkeypatch.setattr(machine_mod, "wait_for_quiet", lambda timeout: True)  # quiet now
        assert load_or_measure("cpu", path=path, quick=True) == calm
        assert len(calls) == 1  # the disturbed profile was measured again, not trusted
        assert load_or_measure("cpu", path=path, quick=True) == calm
        assert len(calls) == 1  # ... and the calm one is a cache hit
    finally:
        torch.set_num_threads(threads)


def test_a_profile_whose_software_figures_were_disturbed_measures_them_again(
    tmp_path, monkeypatch, quick_profile
):
    path = tmp_path / "machine.json"
    data = {**quick_profile.to_dict(), "disk_dir": str(tmp_path), "disturbed": ["software"]}
    write_text_atomic(path, json.dumps(data))
    monkeypatch.setattr(machine_mod, "measure", lambda *a, **k: pytest.fail("hardware measured"))
    monkeypatch.setattr(machine_mod, "wait_for_quiet", lambda timeout: True)  # a quiet machine
    software = []

    def fake_software(device, sizes, copy_bandwidth, calm):
        software.append(device)
        return {**{k: v for k, v in data.items() if k.endswith("overhead_s")}, "samples": {}}

    monkeypatch.setattr(software_mod, "fixed_costs", fake_software)
    again = load_or_measure("cpu", path=path, quick=True)
    assert len(software) == 1 and again.disturbed == []
    assert again.matmul_flops == quick_profile.matmul_flops
    assert load_or_measure("cpu", path=path, quick=True) == again  # trusted now
    assert len(software) == 1

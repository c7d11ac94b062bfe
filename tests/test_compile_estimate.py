"""Compile-time costs, the probe, the roofline estimate and the compile directory
(invariant 4).

FLOPs are checked against formulas written out term by term and against
torch's own FlopCounterMode run independently on the real model; activation
and operator bytes against the arithmetic of what each operator saves, reads
and writes; the estimate against a hand-made probe with the numbers written out
(nothing here is timed: timings never go into an assertion).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import models as zoo
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from weightstream.compiler import probe as probe_mod
from weightstream.compiler.cost import (
    EXTRA_FLOP_FORMULAS,
    OUTSIDE_NAME,
    StepCosts,
    UnitCost,
    unit_costs,
)
from weightstream.compiler.estimate import EstimateSettings, estimate
from weightstream.compiler.probe import Probe, load_or_measure
from weightstream.compiler.report import compile_checksum, load_compile_dir, write_compile_dir
from weightstream.models import GPT, GPTConfig
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.partition import build_plan
from weightstream.runtime.store import MMAP_THRESHOLD
from weightstream.runtime.trace import GROUPED_MM, trace_forward

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


class Experts(nn.Module):
    """A mixture-of-experts layer's experts as transformers 5 runs them: one grouped
    product of the tokens, sorted by expert, with each expert's K x N matrix."""

    def __init__(self, groups: int, k: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, k, n))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.weight, offs=offs)


@pytest.mark.skipif(GROUPED_MM is None, reason="this torch has no _grouped_mm")
def test_a_grouped_product_counts_each_tokens_product_with_its_expert():
    """FlopCounterMode has no formula for ``_grouped_mm``, and its fake kernel refuses
    float32 (Note [fake kernels]): without both the experts would count nothing."""
    groups, m, k, n = 4, 12, 8, 8  # rows of 16 bytes in bf16 too, as the kernels require
    model = Experts(groups, k, n)
    x = torch.randn(m, k, requires_grad=True)  # so the backward computes dX and dW
    offs = torch.tensor([3, 5, 9, 12], dtype=torch.int32)  # each expert's last token + 1
    starts = [0, *offs.tolist()[:-1]]
    with FlopCounterMode(display=False) as ref:  # one plain product per expert
        per_expert = [x[a:b] @ model.weight[g] for g, (a, b) in enumerate(zip(starts, offs))]
    torch.testing.assert_close(model(x, offs), torch.cat(per_expert))
    costs = unit_costs(model, _plan(model, x, offs), (x, offs), {})
    assert costs.backward_measured
    assert costs.fwd_flops == ref.get_total_flops() == 2 * m * k * n
    assert costs.bwd_flops == 2 * costs.fwd_flops  # dX = dY W^T and dW = X^T dY, per expert


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
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fwd:
            out = u.module(*inputs)
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as bwd:
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
    # The count runs the CPU's own attention kernel (flash), as the real run does;
    # torch's table lacks its formulas, which cost.py adds from torch's own.
    ref = _per_unit_reference(model, plan, (idx,))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as whole:
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


def test_the_users_hooks_do_not_run_in_the_dry_runs():
    model, calls = Chain(DIMS, act=True), []
    for m in model.modules():
        m.register_forward_pre_hook(lambda *a: calls.append("pre"))
        m.register_forward_hook(lambda *a, **k: calls.append("post"), with_kwargs=True)
        m.register_forward_hook(lambda *a: calls.append("always"), always_call=True)
    x = torch.randn(B, DIMS[0])
    unit_costs(model, _plan(model, x), (x,), {})  # the trace, then the count
    assert calls == []
    model(x)  # the hooks are still the model's own
    assert len(calls) == 3 * len(list(model.modules()))


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


# ---- operators and their bytes ------------------------------------------------------------


def test_operator_counts_and_bytes_of_a_chain():
    model = Chain(DIMS, act=True)  # ReLU modules are not units: their work is outside
    x = torch.randn(B, DIMS[0])
    costs = unit_costs(model, _plan(model, x), (x,), {})
    for u, (i, o) in zip(costs.units, itertools.pairwise(DIMS)):
        # forward: t (a view: no bytes) + addmm (a product: reads x, W, b, writes y)
        assert (u.fwd_ops, u.fwd_bytes) == (2, 0)
        assert [(f, b) for _, f, b in u.fwd_kernels] == [
            (2 * B * i * o, (B * i + i * o + o + B * o) * F32)
        ]
        assert sum(f for _, f, _ in u.bwd_kernels) == u.bwd_flops
    first, second, last = costs.units
    # backward of the first layer: dW = mm, and the bias gradient sums dY [B, 16]
    # over the batch: reads B*16*4 bytes, writes 16*4 (nothing upstream needs dX)
    assert first.bwd_bytes == B * 16 * F32 + 16 * F32
    assert second.bwd_bytes == B * 32 * F32 + 32 * F32
    # The last layer's dY is the sum's gradient: a [B, 4] expansion of one element,
    # which reads its storage (4 bytes), not B * 4 elements.
    assert last.bwd_bytes == F32 + 4 * F32
    out = costs.outside
    # forward outside: 2 x relu (in + out) and the loss sum ([B, 4] in, 1 out)
    relu1, relu2, loss = 2 * B * 16 * F32, 2 * B * 32 * F32, B * 4 * F32 + F32
    assert (out.fwd_bytes, out.fwd_ops) == (loss + relu1 + relu2, 3)
    # backward outside: ones_like (1 in, 1 out) and 2 x threshold_backward (dY, Y in; dX out)
    assert out.bwd_bytes == 2 * F32 + 3 * relu1 // 2 + 3 * relu2 // 2
    assert costs.ops == sum(e.fwd_ops + e.bwd_ops for e in costs.entries)
    assert costs.op_bytes == sum(e.op_bytes for e in costs.entries)


def test_attention_is_the_devices_own_kernel_each_way():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (2, 16))
    costs = unit_costs(model, _plan(model, idx), (idx,), {})
    block = costs.units[[u.name for u in costs.units].index("blocks.0")]
    # B=2, H=4, T=S=16, D=8: the CPU's flash kernel, one operator each way, with
    # torch's own attention formulas
    q = torch.empty(2, 4, 16, 8)
    fwd = [(f, b) for k, f, b in block.fwd_kernels if "flash_attention_for_cpu.default" in k]
    bwd = [(f, b) for k, f, b in block.bwd_kernels if "flash_attention_for_cpu_backward" in k]
    assert [f for f, _ in fwd] == [sdpa_flop_count(q.shape, q.shape, q.shape)]
    assert [f for f, _ in bwd] == [sdpa_backward_flop_count(q.shape, q.shape, q.shape, q.shape)]
    assert fwd[0][1] >= 4 * q.numel() * F32  # q, k, v read, the output written
    assert block.fwd_flops == 2 * 32 * 32 * (3 * 32 + 32 + 4 * 32 + 4 * 32) + fwd[0][0]
    assert sum(f for _, f, _ in block.fwd_kernels) == block.fwd_flops


def test_a_new_output_of_32_mib_or_more_counts_as_fresh_pages():
    # A [4096, 2048] fp32 product is 32 MiB: fresh; its input [4096, 1024] is not.
    model = Chain([1024, 2048, 4])
    x = torch.randn(4096, 1024)
    costs = unit_costs(model, _plan(model, x), (x,), {})
    assert costs.units[0].fresh_bytes == 4096 * 2048 * F32  # its output; no input grad
    # the last layer's backward makes its input's gradient, [4096, 2048]: fresh
    assert costs.units[1].fresh_bytes == 4096 * 2048 * F32


def test_a_disk_stores_mmap_threshold_makes_smaller_outputs_fresh():
    # [512, 128] fp32 is 256 KiB: fresh from a disk store's 128 KiB threshold only.
    model = Chain([64, 128, 4])
    x = torch.randn(512, 64)
    plan = _plan(model, x)
    assert [u.fresh_bytes for u in unit_costs(model, plan, (x,), {}).units] == [0, 0]
    costs = unit_costs(model, plan, (x,), {}, fresh_from=MMAP_THRESHOLD)
    assert [u.fresh_bytes for u in costs.units] == [512 * 128 * F32] * 2


# ---- estimate ------------------------------------------------------------------------------


def _probe(device="cuda:0", **fixed) -> Probe:
    return Probe(
        device=device,
        device_name="hand-made",
        torch_version=torch.__version__,
        num_threads=1,
        matmul_flops={"float32": 1e9, "bfloat16": 4e9},
        memory_bandwidth=1e9,
        host_memory_bandwidth=4e8,
        link_bandwidth=None if device == "cpu" else 1e8,
        **fixed,
    )


def _unit(index=0, **kw) -> UnitCost:
    base = dict(numel=1000, trainable_numel=1000, weight_bytes=4000, trainable_bytes=4000)
    return UnitCost(index, f"u{index}", **{**base, **kw})


def test_a_product_is_priced_at_the_larger_of_its_flops_and_its_bytes():
    # (FLOPs, bytes): 2e6 FLOPs at 1 GFLOP/s = 2 ms against 1 MB at 1 GB/s = 1 ms;
    # 1e5 FLOPs = 0.1 ms against 4 MB = 4 ms
    unit = _unit(
        fwd_kernels=[("k0", 2_000_000, 1_000_000), ("k1", 100_000, 4_000_000)], fwd_flops=2_100_000
    )
    est = estimate(StepCosts([unit], UnitCost(-1, OUTSIDE_NAME)), _probe(), EstimateSettings(1))
    assert est.units[0].compute_s == pytest.approx(2e-3 + 4e-3)


def test_roofline_terms_of_one_unit_written_out():
    """Every term of Note [the roofline] with numbers: a GPU-like probe."""
    unit = _unit(
        fwd_kernels=[("k0", 1_000_000, 0)],
        bwd_kernels=[("k0", 2_000_000, 0)],
        fwd_flops=1_000_000,
        bwd_flops=2_000_000,
        fwd_bytes=3_000_000,
        bwd_bytes=5_000_000,
        activation_bytes=1_000_000,  # not a term: the kernels' timings read them cold
        fresh_bytes=500_000,
        fwd_ops=10,
        bwd_ops=20,
        trainable_tensors=2,
    )
    outside = UnitCost(-1, OUTSIDE_NAME, fwd_bytes=1_000_000, fwd_ops=5)
    probe = _probe(op_s=1e-5, tensor_s=1e-4, step_s=2e-3)
    settings = EstimateSettings(batch_size=4, update_bytes=80, input_s=1e-3)
    est = estimate(StepCosts([unit], outside), probe, settings)
    u = est.units[0]
    assert u.compute_s == pytest.approx(1e-3 + 2e-3)
    # operators' bytes at 1 GB/s; no fresh pages off the CPU
    assert u.memory_s == pytest.approx(3e-3 + 5e-3)
    # 30 operators at 10 us, 2 parameter tensors at 100 us
    assert u.overhead_s == pytest.approx(1e-4 + 2e-4 + 2e-4)
    assert u.update_s == pytest.approx(1000 * 80 / 4e8)  # host memory, 0.2 ms
    assert u.link_s == pytest.approx((2 * 4000 + 4000) / 1e8)  # link, 0.12 ms
    # on a device the operators' overhead hides under the data work (11 ms); link overlaps
    assert u.time_s == pytest.approx(11e-3 + 0.2e-3) and u.bound == "memory"
    assert est.outside.time_s == pytest.approx(1e-3)  # 1 MB; 5 x 10 us hidden under it
    step = u.time_s + 1e-3 + 2e-3 + 1e-3
    assert est.step_s == pytest.approx(step)
    assert est.est_samples_per_sec == pytest.approx(4 / step)
    assert est.model_samples_per_sec == pytest.approx(4 / (step - 1e-3))
    assert est.bound == "memory"
    # without prefetching the link adds; on a CPU the overheads add too and a fetch
    # is a host copy at the memory bandwidth
    serial = estimate(StepCosts([unit], outside), probe, EstimateSettings(4, prefetch_depth=0))
    assert serial.units[0].time_s == pytest.approx(11e-3 + 1000 * 80 / 4e8 + 0.12e-3)
    cpu_probe = _probe("cpu", op_s=1e-5, tensor_s=1e-4, fresh_bandwidth=5e8)
    c = estimate(StepCosts([unit], outside), cpu_probe, settings).units[0]
    assert c.link_s == pytest.approx(2 * 12_000 / 1e9)
    # on the CPU: the fresh pages' 0.5 MB at 0.5 GB/s, and every term in turn
    assert c.memory_s == pytest.approx(3e-3 + 5e-3 + 1e-3)
    assert c.time_s == pytest.approx(12e-3 + 5e-4 + 1000 * 80 / 4e8)


# A call and a byte of each collective, as swarm.collective_costs measures them.
_COLLECTIVES = {"all_reduce": [1e-3, 1e-9], "broadcast": [2e-3, 2e-9], "reduce": [3e-3, 3e-9]}


def test_collectives_of_data_parallel_written_out():
    """The collective term (Note [the roofline]) with numbers: five units of 1 MB of fp32
    gradients on 2 ranks. A replicated store all-reduces them in buckets of 2.5 MB: calls
    at the units that fill one (the 3rd) and at the last; a sharded store broadcasts each
    unit's weights twice from its owner and reduces its gradients to it, and each owner
    updates half the units on average. On the CPU they add to the work; on a GPU they
    overlap it with prefetching, as the link does."""
    mb = 1_000_000
    units = [_unit(i, numel=mb // 4, trainable_numel=mb // 4, weight_bytes=mb, trainable_bytes=mb)
             for i in range(5)]  # fmt: skip
    costs = StepCosts(units, UnitCost(-1, OUTSIDE_NAME))
    base = dict(batch_size=4, update_bytes=80, ranks=2, collectives=_COLLECTIVES)
    replicated = EstimateSettings(**base, reduce_bucket_bytes=int(2.5 * mb))
    cpu = estimate(costs, _probe("cpu"), replicated)
    per_byte = mb * 1e-9
    assert [u.collective_s for u in cpu.units] == pytest.approx(
        [per_byte, per_byte, per_byte + 1e-3, per_byte, per_byte + 1e-3]
    )
    # on the CPU: added to the unit's work (link 2 x 2 MB at 1 GB/s overlaps it)
    work = cpu.units[2].update_s + cpu.units[2].overhead_s + cpu.units[2].memory_s
    assert cpu.units[2].time_s == pytest.approx(work + 2e-3)
    assert cpu.units[2].update_s == pytest.approx(mb / 4 * 80 / 4e8)
    assert cpu.terms["collective"] == pytest.approx(5 * per_byte + 2e-3)

    sharded = estimate(costs, _probe("cpu"), EstimateSettings(**base, sharded=True))
    one = 2 * (2e-3 + mb * 2e-9) + 3e-3 + mb * 3e-9
    assert [u.collective_s for u in sharded.units] == pytest.approx([one] * 5)
    assert sharded.units[0].update_s == pytest.approx(mb / 4 * 80 / 2 / 4e8)
    assert sharded.host_bytes == 5 * (mb // 4) * 80 // 2
    # a GPU streams bf16 weights: the broadcasts carry half the bytes; they overlap the work
    gpu_settings = dataclasses.replace(
        EstimateSettings(**base, sharded=True, transfer_dtype="bfloat16"), update_bytes=8
    )
    gpu = estimate(costs, dataclasses.replace(_probe(), link_bandwidth=1e9), gpu_settings)
    bf16 = 2 * (2e-3 + mb / 2 * 2e-9) + 3e-3 + mb * 3e-9
    u = gpu.units[0]
    assert u.collective_s == pytest.approx(bf16)
    assert u.time_s == pytest.approx(max(u.update_s + u.memory_s, u.link_s, bf16))
    assert u.bound == "collective"
    # the device tier's units are all-reduced on a sharded store too (every rank holds them)
    tiered = estimate(costs, _probe(), EstimateSettings(**base, sharded=True, resident=(0,)))
    assert tiered.units[0].collective_s == pytest.approx(per_byte + 1e-3)  # one bucket, one call
    # one rank: no collective
    alone = estimate(costs, _probe("cpu"), EstimateSettings(4, collectives=_COLLECTIVES))
    assert alone.terms["collective"] == 0


def test_a_timed_kernel_is_priced_at_its_timing():
    unit = _unit(fwd_kernels=[("mm", 2_000_000, 1_000_000), ("gelu", 0, 4_000_000)])
    costs = StepCosts([unit], UnitCost(-1, OUTSIDE_NAME))
    probe = _probe(kernel_s={"mm": 5e-3, "gelu": 7e-3})
    u = estimate(costs, probe, EstimateSettings(1)).units[0]
    # a kernel with FLOPs is compute, one without is memory, each at its timing
    assert (u.compute_s, u.memory_s) == pytest.approx((5e-3, 7e-3))


def test_a_timing_taken_on_a_busy_machine_is_not_used():
    """mm's roofline is 2 ms (2 MFLOP at 1 GFLOP/s): 250 ms is over 100 x that plus 5
    ms, a timing no kernel gives on a quiet machine: priced by the roofline."""
    unit = _unit(fwd_kernels=[("mm", 2_000_000, 1_000_000)])
    costs = StepCosts([unit], UnitCost(-1, OUTSIDE_NAME))
    for timed, priced in ((0.2, 0.2), (0.25, 2e-3)):
        u = estimate(costs, _probe(kernel_s={"mm": timed}), EstimateSettings(1)).units[0]
        assert u.compute_s == pytest.approx(priced)


def test_layer_pipelined_has_no_link_and_updates_in_device_memory():
    unit = _unit(fwd_kernels=[("k0", 1_000_000, 0)], fwd_flops=1_000_000)
    settings = EstimateSettings(batch_size=1, weight_streaming=False, update_bytes=80)
    est = estimate(StepCosts([unit], UnitCost(-1, OUTSIDE_NAME)), _probe(), settings)
    assert est.units[0].link_s == 0 and est.link_bytes == 0
    assert est.units[0].update_s == pytest.approx(1000 * 80 / 1e9)


def test_link_bound_unit_and_transfer_dtype():
    unit = _unit(numel=10**6, trainable_numel=10**6, weight_bytes=4 * 10**6,
                 trainable_bytes=4 * 10**6, fwd_kernels=[('k0', 10**6, 0)], fwd_flops=10**6)  # fmt: skip
    outside = UnitCost(-1, OUTSIDE_NAME)
    est = estimate(StepCosts([unit], outside), _probe(), EstimateSettings(1, update_bytes=0))
    assert est.link_bytes == 12 * 10**6 and est.units[0].bound == "link"
    assert est.units[0].time_s == pytest.approx(0.12)
    half = EstimateSettings(1, update_bytes=0, transfer_dtype="bfloat16")
    assert estimate(StepCosts([unit], outside), _probe(), half).link_bytes == 6 * 10**6
    assert est.limit_bound == "device link"


def test_a_recomputed_unit_does_its_forward_work_again_in_the_backward():
    unit = _unit(fwd_kernels=[("k0", 10**6, 0)], fwd_flops=10**6, fwd_bytes=10**6, fwd_ops=7)
    costs = StepCosts([unit], UnitCost(-1, OUTSIDE_NAME))
    plain = estimate(costs, _probe(op_s=1e-6), EstimateSettings(1)).units[0]
    again = estimate(costs, _probe(op_s=1e-6), EstimateSettings(1, recompute=(0,))).units[0]
    assert again.compute_s == pytest.approx(plain.compute_s + 1e-3)  # 1 MFLOP at 1 GFLOP/s
    assert again.memory_s == pytest.approx(plain.memory_s + 1e-3)  # 1 MB at 1 GB/s
    assert again.overhead_s == pytest.approx(plain.overhead_s + 7e-6)  # 7 operators at 1 us


def test_a_disk_stores_traffic_is_shared_by_the_units_and_overlaps_their_work():
    units = [_unit(0, fwd_kernels=[('k0', 10**5, 0)], fwd_flops=10**5),
             _unit(1, trainable_numel=3000, fwd_kernels=[('k0', 10**5, 0)], fwd_flops=10**5)]  # fmt: skip
    costs = StepCosts(units, UnitCost(-1, OUTSIDE_NAME))
    probe = _probe(disk={"/store": {"read": 1e6, "write": 5e5}})
    settings = EstimateSettings(1, update_bytes=0, disk_read_bytes=10**4,
                                disk_write_bytes=10**4, disk_dir="/store")  # fmt: skip
    est = estimate(costs, probe, settings)
    disk = 10**4 / 1e6 + 10**4 / 5e5  # 30 ms
    assert est.terms["disk"] == pytest.approx(disk)
    assert [u.disk_s for u in est.units] == pytest.approx([disk / 4, 3 * disk / 4])
    assert [u.bound for u in est.units] == ["disk", "disk"]
    unknown = estimate(costs, probe, EstimateSettings(1, disk_read_bytes=1, disk_dir="/other"))
    assert unknown.terms["disk"] == 0 and any("not priced" in n for n in unknown.notes)


def test_estimate_settings_are_checked():
    with pytest.raises(ValueError, match="batch_size"):
        EstimateSettings(0)
    with pytest.raises(ValueError, match="compute_dtype"):
        EstimateSettings(1, compute_dtype="float33")
    with pytest.raises(ValueError, match="no matmul throughput"):
        estimate(StepCosts([_unit()], UnitCost(-1, OUTSIDE_NAME)), _probe(),
                 EstimateSettings(1, compute_dtype="float16"))  # fmt: skip


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
    est = estimate(costs, _probe("cpu"), EstimateSettings(batch_size=2))
    settings = {"prefetch_depth": 1, "unit_classes": [nn.Linear]}
    checksum = compile_checksum(model, (idx,), settings)
    path = write_compile_dir(tmp_path, checksum, plan, costs, est, _probe("cpu"), settings)
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
        "est_compute_s",
        "est_memory_s",
        "est_link_s",
        "est_update_s",
        "est_s",
        "pinned",
        "bound",
    }
    assert all(unit_keys <= set(u) for u in data["units"])
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4))
    assert data["totals"]["weight_bytes"] == sum(p.nbytes for p in model.parameters())
    text = (path / "compile_report.txt").read_text()
    for u in plan.units:
        assert f" {u.display_name} " in text
    assert f"est. samples/sec      {est.est_samples_per_sec:.2f}  (bound by {est.bound})" in text


def test_a_tied_parameter_is_counted_once_in_the_totals_and_the_update(tmp_path):
    """A transformers GPT-2 ties lm_head to wte: both units fetch the weight, but the
    model has it once, and one update and one gradient a step move it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 96, (2, 16))
    plan = _plan(model, idx, unit_size_target=1)
    tied = model.lm_head.weight
    held = [u.name for u in plan.units if any(p is tied for p in u.params)]
    assert held == ["transformer.wte", "lm_head"]
    costs = unit_costs(model, plan, (idx,), {}, lambda out: out.logits.sum())
    unique = sum(p.numel() for p in model.parameters())  # torch's own: each once
    assert sum(u.trainable_numel for u in costs.units) == unique
    assert sum(u.numel for u in costs.units) == unique + tied.numel()
    est = estimate(costs, _probe("cpu"), EstimateSettings(batch_size=2, update_bytes=80))
    assert est.host_bytes == 80 * unique
    path = write_compile_dir(tmp_path, "tied", plan, costs, est, _probe("cpu"), {})
    totals = json.loads((path / "plan.json").read_text())["totals"]
    assert totals["params"] == unique and totals["weight_bytes"] == F32 * unique
    assert f"  parameters            {unique:,} (" in (path / "compile_report.txt").read_text()


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


# ---- the probe -------------------------------------------------------------------------------


def test_the_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    first = load_or_measure("cpu", quick=True)
    path = probe_mod.default_path("cpu", quick=True)
    assert path.parent == tmp_path and path.is_file()
    assert first.quick and first.matmul_flops["float32"] > 0
    assert first.memory_bandwidth > 0 and first.host_memory_bandwidth > 0
    assert first.link_bandwidth is None  # the CPU: no link
    assert first.op_s > 0 and first.tensor_s >= 0 and first.step_s >= 0
    assert first.disk == {} and first.kernel_s == {} and first.fresh_bandwidth > 0

    calls = []

    def fake_measure(device, quick=False):
        calls.append(device)
        return first

    monkeypatch.setattr(probe_mod, "measure", fake_measure)
    assert load_or_measure("cpu", quick=True) == first
    assert calls == []  # cache hit: nothing measured
    # A disk store's directory: its bandwidths measured once, kept in the same file.
    with_disk = load_or_measure("cpu", quick=True, disk_dir=tmp_path / "store")
    assert set(with_disk.disk[str(tmp_path / "store")]) == {"read", "write"}
    assert not (tmp_path / "store").exists()  # measured beside it: the store makes its own
    assert load_or_measure("cpu", quick=True).disk == with_disk.disk and calls == []
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the probe"):
        load_or_measure("cpu", quick=True)
    assert len(calls) == 1


def test_the_disk_probe_takes_at_most_a_quarter_of_the_free_space(tmp_path, monkeypatch, caplog):
    """The probe's file must not take the room the store's state was planned into (a
    20 MiB disk holding 12 MiB of state failed on a 256 MiB probe file); a disk too
    small to probe is left unpriced, with a warning, and the run goes on."""
    import shutil as shutil_mod

    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    written = []
    real = probe_mod.disk_bandwidths
    monkeypatch.setattr(probe_mod, "disk_bandwidths", lambda d, n: written.append(n) or real(d, n))
    free = {"bytes": 40 << 20}
    usage = shutil_mod.disk_usage(tmp_path)
    monkeypatch.setattr(
        probe_mod.shutil, "disk_usage", lambda p: usage._replace(free=free["bytes"])
    )
    # The quick profile's sizes, with the full profile's 256 MiB disk file.
    monkeypatch.setattr(
        probe_mod, "_QUICK", dataclasses.replace(probe_mod._QUICK, disk_bytes=256 << 20)
    )
    probe = load_or_measure("cpu", quick=True, disk_dir=tmp_path / "a")
    assert written == [10 << 20] and str(tmp_path / "a") in probe.disk
    free["bytes"] = 2 << 20
    with caplog.at_level("WARNING", logger="weightstream"):
        probe = load_or_measure("cpu", quick=True, disk_dir=tmp_path / "b")
    assert written == [10 << 20] and str(tmp_path / "b") not in probe.disk
    assert "rates are not measured" in caplog.text and "2,097,152 bytes free" in caplog.text


def test_kernels_are_timed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    model = Chain([16, 32, 4])
    x = torch.randn(64, 16)
    costs = unit_costs(model, _plan(model, x), (x,), {})
    probe = load_or_measure("cpu", quick=True)
    # Each kernel's timing as a quiet machine gives it: a real one of microseconds,
    # taken beside other runs, may land past OUTLIER and be dropped (a fresh clone's CI
    # beside a second test run: 3 of the kernels), which this test is not about.
    timed = []
    monkeypatch.setattr(probe_mod, "_seconds", lambda fn, run_s: timed.append(fn) or 2e-6)
    probe_mod.time_kernels(probe, costs.kernels)
    assert len(timed) == len(costs.kernels)  # each kernel run once
    assert set(probe.kernel_s) == set(costs.kernels) and all(t > 0 for t in probe.kernel_s.values())
    est = estimate(costs, probe, EstimateSettings(1))
    assert est.timed_kernels == f"{len(costs.kernels)} / {len(costs.kernels)}"
    assert load_or_measure("cpu", quick=True).kernel_s == probe.kernel_s  # in the file
    # a kernel too large for the free memory stays untimed: the roofline prices it
    untimed = load_or_measure("cpu", quick=True)
    untimed.kernel_s.clear()
    monkeypatch.setattr(probe_mod, "_free_bytes", lambda device: 0)
    probe_mod.time_kernels(untimed, costs.kernels)
    assert untimed.kernel_s == {}
    assert (
        estimate(costs, untimed, EstimateSettings(1)).timed_kernels == f"0 / {len(costs.kernels)}"
    )
    # a timing taken under load (far over the roofline) is not kept: timed again later
    monkeypatch.undo()
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe_mod, "_seconds", lambda fn, run_s: 10.0)
    probe_mod.time_kernels(untimed, costs.kernels)
    assert untimed.kernel_s == {}


@pytest.mark.parametrize(
    "optimizer, master_dtype, expected",
    [
        ({}, "float32", 80),  # AdamW's foreach update, fp32 (estimate.UPDATE_BYTES)
        # chunked kernels: master r+w and gradient r (3 x 4), two moments r+w
        ({"state_dtype": "bfloat16"}, "float32", 3 * 4 + 2 * 2 * 2),
        ({"state_dtype": "int8"}, "float32", 3 * 4 + 2 * 2 * 1),
        # bf16 masters and gradients, their Kahan buffer r+w
        ({}, "bfloat16", 3 * 2 + 2 * 2 * 4 + 2 * 2),
        ({"state_dtype": "bfloat16", "max_gradient_norm": 1.0}, "bfloat16", 18 + 12),
    ],
)
def test_update_bytes_follow_the_training_state(optimizer, master_dtype, expected):
    from weightstream.cli.params import load_params, parse_params
    from weightstream.compiler.compile_phase import update_bytes

    raw = load_params(Path(__file__).parent.parent / "configs" / "gpt2_tiny_ws.yaml")
    raw["optimizer"].pop("max_gradient_norm", None)  # the file clips; the cases say when
    raw["optimizer"].update(optimizer)
    raw["runconfig"]["master_dtype"] = master_dtype
    assert update_bytes(parse_params(raw, "train")) == expected


def test_the_device_tiers_units_cost_no_link_and_update_on_the_device():
    units = [_unit(0, fwd_kernels=[("k0", 10**6, 0)], fwd_flops=10**6),
             _unit(1, fwd_kernels=[("k0", 10**6, 0)], fwd_flops=10**6)]  # fmt: skip
    costs = StepCosts(units, UnitCost(-1, OUTSIDE_NAME))
    streamed = estimate(costs, _probe(), EstimateSettings(1, update_bytes=80))
    tier = estimate(costs, _probe(), EstimateSettings(1, update_bytes=80, resident=(1,)))
    assert streamed.units[1].link_s > 0 and tier.units[1].link_s == 0
    assert tier.units[0].link_s == streamed.units[0].link_s  # the streamed one unchanged
    assert tier.link_bytes == streamed.link_bytes // 2
    # the update reads and writes device memory (1 GB/s here), not the host's (0.4 GB/s)
    assert tier.units[1].update_s == pytest.approx(1000 * 80 / 1e9)
    assert tier.host_bytes == streamed.host_bytes // 2


def test_the_weight_bound_is_every_weight_in_layer_pipelined_mode(tmp_path):
    """Layer pipelined keeps the whole model on the device: the report's device weight
    bound is the model's weight bytes (it showed the streaming bound of 2 units)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4))
    idx = torch.randint(0, 64, (2, 16))
    plan = _plan(model, idx)
    costs = unit_costs(model, plan, (idx,), {})
    weights = sum(p.nbytes for p in model.parameters())
    for streaming, want in ((True, plan.weight_bound(1)), (False, weights)):
        settings = EstimateSettings(batch_size=2, prefetch_depth=1 if streaming else 0)
        settings = dataclasses.replace(settings, weight_streaming=streaming)
        est = estimate(costs, _probe("cpu"), settings)
        out = tmp_path / str(streaming)
        path = write_compile_dir(out, "x", plan, costs, est, _probe("cpu"), {})
        assert json.loads((path / "plan.json").read_text())["totals"]["weight_bound_bytes"] == want
        text = (path / "compile_report.txt").read_text()
        assert ("every weight resident" in text) is not streaming
    assert plan.weight_bound(1) < weights


def test_recomputed_units_keep_their_inputs_as_torch_utils_checkpoint_does():
    """Under activation checkpointing a recomputed unit keeps its input, not what its
    operators save: the estimate's activations equal the storages a real forward saves
    with every such block under torch.utils.checkpoint (non-reentrant), counted by
    autograd's saved-tensor hooks (the report said the same bytes with and without)."""
    import torch.utils.checkpoint as tuc

    from weightstream.runtime.recompute import recomputed_units

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=3, d_model=32, n_head=4)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (4, 32))
    plan = _plan(model, idx, unit_classes=(type(model.blocks[0]),))
    chosen = recomputed_units(plan, trace_forward(model, (idx,), {}))
    modules = [plan.units[i].module for i in sorted(chosen)]
    assert {id(b) for b in model.blocks} <= {id(m) for m in modules}
    plain = unit_costs(model, plan, (idx,), {}).activation_bytes
    kept = unit_costs(model, plan, (idx,), {}, recompute=chosen).activation_bytes

    def measured(checkpointed: bool) -> int:
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                seen.setdefault(key, t.untyped_storage().nbytes())
            return t

        forwards = [m.forward for m in modules]
        if checkpointed:
            for m, f in zip(modules, forwards):
                m.forward = lambda *a, _f=f, **k: tuc.checkpoint(_f, *a, use_reentrant=False, **k)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(idx).sum()
        finally:
            for m in modules if checkpointed else ():
                del m.forward  # the class's own again
        return sum(seen.values())

    assert kept < plain / 4
    assert plain == measured(False)
    assert kept == measured(True)

"""Step time of weight streaming (WS) and layer pipelined (LP) against eager PyTorch.

Trains the benchmark GPT (6 blocks, d_model 512, 8 heads, seq 256, batch 8,
vocab 4096) with torch.optim.AdamW in the three modes, in fp32 and with bf16
autocast. The modes take turns step by step (eager, LP, WS, eager, ...) so that
machine noise hits all of them alike. Prints min/median/max seconds per step and
the ratios WS/eager and LP/eager of the medians.

``--model hf-llama`` trains a transformers Llama of the same size instead (6
decoder layers, hidden 512, 8 heads, seq 256, batch 8, vocab 4096; the decoder
layer is the streaming unit): the overhead a fine-tune of a Hugging Face model
pays against transformers' own model in eager PyTorch.

    .venv/bin/python benchmarks/ws_step_time.py [--steps 12] [--warmup 2]
        [--model gpt|hf-llama]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from _common import GPT_BENCH as CFG
from _common import GPT_BENCH_BATCH as BATCH
from _common import machine_profile, print_result, summary, train_step_flops

import weightstream as cstorch
from weightstream.models import GPT


def _hf_llama() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.d_model,
        intermediate_size=4 * CFG.d_model,
        num_hidden_layers=CFG.n_layer,
        num_attention_heads=CFG.n_head,
        max_position_embeddings=CFG.seq_len,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def make_runner(mode: str, model_kind: str = "gpt"):
    torch.manual_seed(0)
    model = GPT(CFG) if model_kind == "gpt" else _hf_llama()
    units = getattr(model, "_no_split_modules", None)
    kwargs = {"unit_classes": units} if units and mode == "ws" else {}
    runner = model if mode == "eager" else cstorch.compile(model, backend=mode, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return runner, opt


def logits_of(runner, x: torch.Tensor) -> torch.Tensor:
    # input_ids is also the first positional argument of a transformers causal LM; a
    # compiled GPT (not a GPT instance) takes only positional ones.
    out = runner(x)
    return getattr(out, "logits", out)


def hf_step_flops(x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one forward + backward of the transformers Llama (attention on the CPU
    counted with the formulas torch's registry lacks)."""
    from torch.utils.flop_counter import FlopCounterMode

    from weightstream.compiler.cost import EXTRA_FLOP_FORMULAS

    model = _hf_llama()
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        out = model(input_ids=x).logits
        F.cross_entropy(out.flatten(0, 1).float(), y.flatten()).backward()
    return counter.get_total_flops()


def step(runner, opt, x, y, autocast: bool) -> float:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        logits = logits_of(runner, x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # host sync point: the step is complete
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    name = "GPT" if args.model == "gpt" else "transformers Llama"
    params = sum(p.numel() for p in (GPT(CFG) if args.model == "gpt" else _hf_llama()).parameters())
    print(
        f"{name} {CFG.n_layer} blocks, d_model {CFG.d_model}, seq {CFG.seq_len}, batch {BATCH}, "
        f"vocab {CFG.vocab_size}: {params / 1e6:.1f}M params; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    modes = ["eager", "lp", "ws"]
    profile = machine_profile()
    flops = train_step_flops(CFG, BATCH) if args.model == "gpt" else hf_step_flops(x, y)
    result = {}
    for dtype in args.dtypes.split(","):
        autocast = dtype == "bf16"
        runners = {m: make_runner(m, args.model) for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.warmup + args.steps):
            for m in modes:
                t = step(*runners[m], x, y, autocast)
                if i >= args.warmup:
                    times[m].append(t)
        med = {m: statistics.median(ts) for m, ts in times.items()}
        print(f"\n[{dtype}] seconds per step over {args.steps} steps (min / median / max)")
        for m in modes:
            ts = times[m]
            print(f"  {m:<6} {min(ts):.3f} / {med[m]:.3f} / {max(ts):.3f}")
        # Per-round ratios show the spread of the ratio itself, not only of the times.
        for m in ("lp", "ws"):
            r = sorted(a / b for a, b in zip(times[m], times["eager"]))
            print(
                f"  {m.upper()}/eager median ratio {med[m] / med['eager']:.3f} "
                f"(per-step ratios min {r[0]:.3f} / median {statistics.median(r):.3f} / max {r[-1]:.3f})"
            )
        peak = profile.peak_flops(torch.bfloat16 if autocast else torch.float32)
        limit = flops / peak
        print(
            f"  machine limit: {flops / 1e9:.1f} GFLOP per step at the measured matmul peak "
            f"{peak / 1e9:.0f} GFLOP/s = {limit:.3f} s; WS reaches {limit / med['ws']:.0%} of it"
        )
        r_ws = [a / b for a, b in zip(times["ws"], times["eager"])]
        result[dtype] = {
            m: {"seconds": summary(ts), "fraction_of_limit": limit / med[m]}
            for m, ts in times.items()
        }
        result[dtype]["ws_over_eager"] = med["ws"] / med["eager"]
        result[dtype]["ws_over_eager_per_step"] = summary(r_ws)
        ws = runners["ws"][0]
        print(
            f"  WS plan: {len(ws.plan.units)} units, largest {ws.plan.largest_unit_bytes / 2**20:.1f} MiB, "
            f"peak device weights {ws.engine.streamer.meter.peak_bytes / 2**20:.1f} MiB "
            f"(bound {ws.plan.weight_bound(ws.engine.config.prefetch_depth) / 2**20:.1f} MiB)"
        )
    print_result(
        "ws_step_time", model=args.model, steps=args.steps, flops_per_step=flops, dtypes=result
    )


if __name__ == "__main__":
    main()

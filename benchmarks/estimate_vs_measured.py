"""The compile phase's estimated samples/sec against the run's measured samples/sec.

Runs the real run command, each run in a process of its own as a user's is
(``python -m weightstream.cli.main run CPU ...``), in weight-streaming mode, each
in a fresh temporary model directory: fc_mnist (configs/fc_mnist.yaml), the tiny
GPT-2 (configs/gpt2_tiny_ws.yaml), the tiny Llama preset
(configs/llama_tiny_ws.yaml), the tiny GPT-2 streamed in bfloat16
(gpt2_tiny_bf16) and from a disk store (gpt2_tiny_disk: its state fits in
RAM, what it changes is glibc's mmap threshold, Note [fresh pages]) and, when
asked for (``--models gpt2_small``: 4 steps of 20 s each), GPT-2 small
(configs/gpt2_small.yaml). Each run compiles (the roofline, priced by
the cached probe: ``weightstream.compiler.probe``) and trains ``--steps`` steps
with no checkpoint inside the timed loop; ``performance/performance.json`` gives
both figures. Each run lasts a few seconds: 40 steps of the transformers, 1,500
of fc_mnist, whose step takes 3 ms. The models take turns, ``--repeats`` rounds,
and the table shows every run and the min/median/max of measured / estimate per
model, and of measured / physical limit.

``--ablate`` also prices each model's counted costs with one refinement of the
plain roofline off at a time (the kernels' own timings, the fresh pages, the
fixed costs: Notes [timed kernels], [fresh pages] in compiler/cost.py, [fixed
costs] in compiler/probe.py) and all of them, and sets the median measured rate
against each: what each refinement is worth.

The machines are shared: run it on a quiet one (nothing here detects other
load; a busy neighbour stalls PyTorch's thread pool and the run measures it, not
the model). ``--remeasure`` deletes the cached probe first.

    .venv/bin/python benchmarks/estimate_vs_measured.py [--steps N] [--repeats 3]
        [--models fc_mnist,gpt2_tiny,...] [--remeasure] [--ablate]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _common import print_result, summary

from weightstream.compiler.probe import default_path, load_or_measure

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "fc_mnist": ROOT / "configs" / "fc_mnist.yaml",
    "gpt2_tiny": ROOT / "configs" / "gpt2_tiny_ws.yaml",
    "llama_tiny": ROOT / "configs" / "llama_tiny_ws.yaml",
    "gpt2_small": ROOT / "configs" / "gpt2_small.yaml",
}
DEFAULT_MODELS = "fc_mnist,gpt2_tiny,llama_tiny,gpt2_tiny_bf16,gpt2_tiny_disk"
# Steps per run: a few seconds of each (module docstring).
STEPS = {"fc_mnist": 1500, "gpt2_small": 4}
DEFAULT_STEPS = 40
# Variants: a file of MODELS with keys of its sections changed.
VARIANTS = {
    # Streamed in bfloat16 (autocast): the zoo's full-size files' precision.
    "gpt2_tiny_bf16": ("gpt2_tiny", {"model": {"mixed_precision": True, "fp16_type": "bfloat16"}}),
    "gpt2_tiny_disk": ("gpt2_tiny", {"runconfig": {"store": "disk"}}),
}


def _params_file(name: str, steps: int, work: Path) -> Path:
    base, changes = VARIANTS.get(name, (name, {}))
    raw = yaml.safe_load(MODELS[base].read_text())
    for section, keys in changes.items():
        raw.setdefault(section, {}).update(keys)
    rc = raw.setdefault("runconfig", {})
    rc.update(max_steps=steps, checkpoint_steps=0, log_steps=10**6)
    rc["execution_mode"] = "weight_streaming"
    rc.pop("eval_steps", None)
    params = work / f"{name}.yaml"
    params.write_text(yaml.safe_dump(raw))
    return params


def run_once(name: str, steps: int, work: Path) -> dict:
    """One run of the run command; the figures of its performance.json and plan.json."""
    params = _params_file(name, steps, work)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    command = [sys.executable, "-m", "weightstream.cli.main", "run", "CPU", "-p", str(params)]
    command += ["-m", "train", "-o", str(model_dir)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        out = (done.stdout + done.stderr)[-2000:]
        raise SystemExit(f"{name}: the run command failed ({done.returncode}):\n{out}")
    perf = json.loads((model_dir / "performance" / "performance.json").read_text())
    (compile_dir,) = model_dir.glob("ws_*")
    plan = json.loads((compile_dir / "plan.json").read_text())
    return {
        "est": perf["est_samples_per_sec"],
        "measured": perf["samples_per_sec"],
        "limit": plan["estimate"]["limit_samples_per_sec"],
        "bound": plan["estimate"]["bound"],
    }


# The probe with one refinement of the plain roofline off (module docstring).
ABLATIONS = {
    "no timed kernels": {"kernel_s": {}},
    "no fresh pages": {"fresh_bandwidth": None},
    "no fixed costs": {"op_s": 0.0, "tensor_s": 0.0, "step_s": 0.0},
}
ABLATIONS["plain roofline"] = {k: v for change in ABLATIONS.values() for k, v in change.items()}


def ablated_estimates(name: str, work: Path) -> dict[str, float]:
    """The estimated samples/sec of ``name`` (a compile_only run in this process) and,
    from the same counted costs, with each of ``ABLATIONS``."""
    from weightstream.cli.main import main as ws_main
    from weightstream.compiler import compile_phase

    found, real = {}, compile_phase.estimate

    def estimate(costs, probe, settings):
        found["estimate"] = real(costs, probe, settings).est_samples_per_sec
        for label, change in ABLATIONS.items():
            priced = real(costs, dataclasses.replace(probe, **change), settings)
            found[label] = priced.est_samples_per_sec
        return real(costs, probe, settings)

    params, model_dir = _params_file(name, 1, work), tempfile.mkdtemp(dir=work)
    compile_phase.estimate = estimate
    logging.getLogger("weightstream").disabled = True  # the run's log: the table is the output
    try:
        args = ["run", "CPU", "-p", str(params), "-m", "train", "-o", model_dir, "--compile_only"]
        if ws_main(args) != 0:
            raise SystemExit(f"{name}: the compile_only run failed")
    finally:
        compile_phase.estimate = real
        logging.getLogger("weightstream").disabled = False
    return found


def _stats(values: list[float]) -> str:
    return f"{min(values):6.2f} {statistics.median(values):6.2f} {max(values):6.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps",
        type=int,
        help=f"steps per run (default: {DEFAULT_STEPS}, fc_mnist {STEPS['fc_mnist']})",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated, of {', '.join([*MODELS, *VARIANTS])}",
    )
    ap.add_argument("--remeasure", action="store_true", help="measure the probe again first")
    ap.add_argument(
        "--ablate", action="store_true", help="also each refinement of the roofline off in turn"
    )
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS) + sorted(VARIANTS)}")

    if args.remeasure:
        default_path("cpu").unlink(missing_ok=True)
    probe = load_or_measure("cpu")
    print(
        f"probe of {probe.measured_at}: fp32 peak {probe.matmul_flops['float32'] / 1e9:.0f} "
        f"GFLOP/s, memory {probe.memory_bandwidth / 1e9:.1f} GB/s, {probe.op_s * 1e6:.1f} us per "
        f"operator, {probe.tensor_s * 1e6:.0f} us per parameter tensor, "
        f"{probe.step_s * 1e6:.0f} us per step; {probe.num_threads} threads"
    )
    steps = {n: args.steps or STEPS.get(n, DEFAULT_STEPS) for n in names}
    print(
        f"steps per run: {', '.join(f'{n} {k}' for n, k in steps.items())}; weight streaming, CPU\n"
    )
    head = (
        f"{'model':<11} {'run':>3} {'est_samples_per_sec':>20} {'samples_per_sec':>16} "
        f"{'measured/est':>13} {'measured/limit':>15}  bound"
    )
    print(head)
    print("-" * len(head))
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="ws-estimate-bench-") as tmp:
        for r in range(args.repeats):
            for name in names:
                res = run_once(name, steps[name], Path(tmp))
                results[name].append(res)
                print(
                    f"{name:<11} {r + 1:>3} {res['est']:>20.2f} {res['measured']:>16.2f} "
                    f"{res['measured'] / res['est']:>13.3f} "
                    f"{res['measured'] / res['limit']:>15.3f}  {res['bound']}",
                    flush=True,
                )
    print("\nmeasured / estimate (min median max), measured / physical limit (min median max)")
    for name, runs in results.items():
        ratios = [x["measured"] / x["est"] for x in runs]
        limits = [x["measured"] / x["limit"] for x in runs]
        print(f"  {name:<11} {_stats(ratios)}    {_stats(limits)}")
    ablated = {}
    if args.ablate:
        print("\nmedian measured / estimate, with the estimate's refinements off in turn")
        print(f"  {'model':<15}" + "".join(f"{k:>18}" for k in ["estimate", *ABLATIONS]))
        with tempfile.TemporaryDirectory(prefix="ws-estimate-ablate-") as tmp:
            for name, runs in results.items():
                measured = statistics.median(x["measured"] for x in runs)
                rates = ablated_estimates(name, Path(tmp))
                ablated[name] = {k: measured / v for k, v in rates.items()}
                print(f"  {name:<15}" + "".join(f"{r:>18.3f}" for r in ablated[name].values()))
    print_result(
        "estimate_vs_measured",
        models={
            name: {
                "ratio": summary([x["measured"] / x["est"] for x in runs]),
                "limit": "measured/limit "
                + _stats([x["measured"] / x["limit"] for x in runs]).strip(),
                **({"ablated": ablated[name]} if name in ablated else {}),
            }
            for name, runs in results.items()
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

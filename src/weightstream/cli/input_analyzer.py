"""``weightstream input-analyzer``: can the input pipeline keep up with the model?

    weightstream input-analyzer -p PARAMS.yaml [--max_workers N] [--steps S] [--margin M]

The reference's ``cs_input_analyzer`` (seed 002: "Determine optimal input
workers"). Two numbers are compared:

* the model's consumption: the samples/sec the compile phase estimates for the
  params file's model and training batch when the input costs the training
  process nothing (``model_samples_per_sec`` of its ``plan.json``: the run
  command's own compile, with ``compile_only`` into a scratch directory, on the
  meta device, without training);
* the input pipeline's throughput: the samples/sec the ``train_input``
  pipeline (its data processor's torch DataLoader) delivers to the training
  process with 0, 1, ..., N worker processes (``num_workers``), measured over
  ``--steps`` batches after a warm-up of one batch per worker plus one.

With worker processes the input is produced while the model runs, so a worker
count keeps up when its throughput exceeds the consumption by the margin
(default 20%: the headroom for a noisy machine). Without workers every batch is
produced by the training process itself between two steps, so 0 workers keep
up only when a batch costs at most ``INPUT_BOTTLENECK_FRACTION`` (10%) of the
model's step, the fraction above which a run reports a suspected input
bottleneck. The recommendation is the smallest worker count that keeps up, or,
when none does, the fastest one, with a warning.

The reference calls the setting ``num_workers_per_csx``; here it is
``train_input.num_workers`` (worker processes of the training input's loader).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from weightstream.runtime.performance import INPUT_BOTTLENECK_FRACTION

DEFAULT_MARGIN = 0.2


@dataclass(frozen=True)
class Recommendation:
    num_workers: int
    keeps_up: bool
    reason: str


def keeps_up(
    num_workers: int,
    samples_per_sec: float,
    consumption: float,
    margin: float = DEFAULT_MARGIN,
    serial_fraction: float = INPUT_BOTTLENECK_FRACTION,
) -> bool:
    """Whether ``samples_per_sec`` of input with ``num_workers`` keeps up with ``consumption``."""
    if num_workers == 0:
        # Serial: the batch's time adds to the step's; at most serial_fraction of it.
        return consumption <= serial_fraction * samples_per_sec
    return samples_per_sec >= (1 + margin) * consumption


def recommend_workers(
    throughputs: dict[int, float],
    consumption: float,
    margin: float = DEFAULT_MARGIN,
    serial_fraction: float = INPUT_BOTTLENECK_FRACTION,
) -> Recommendation:
    """The smallest worker count whose throughput keeps up (see :func:`keeps_up`);
    else the fastest one (the smallest count among equals), with ``keeps_up`` False.

    ``throughputs``: worker count -> input samples/sec. ``consumption``: the
    model's estimated samples/sec.
    """
    if not throughputs:
        raise ValueError("recommend_workers needs at least one measured worker count.")
    if consumption <= 0:
        raise ValueError(f"the model's consumption must be > 0 samples/sec, got {consumption}.")
    for workers in sorted(throughputs):
        rate = throughputs[workers]
        if keeps_up(workers, rate, consumption, margin, serial_fraction):
            if workers == 0:
                why = (
                    f"without workers a batch costs {consumption / rate:.0%} of the model's "
                    f"step (at most {serial_fraction:.0%})"
                )
            else:
                why = (
                    f"{workers} worker(s) deliver {rate:.1f} samples/sec, "
                    f"{rate / consumption:.2f} x the model's {consumption:.1f} "
                    f"(at least {1 + margin:.2f} x)"
                )
            return Recommendation(workers, True, why)
    best = max(sorted(throughputs), key=lambda w: throughputs[w])
    rate = throughputs[best]
    if best == 0:
        why = (
            f"no worker count up to {max(throughputs)} keeps up: without workers a batch costs "
            f"{consumption / rate:.0%} of the model's step (more than {serial_fraction:.0%}), "
            "and worker processes deliver less than that (handing a batch over between "
            "processes costs more than making it); training will spend that time on its "
            "input. Make the data processor cheaper or measure more workers (--max_workers)."
        )
    else:
        why = (
            f"no worker count up to {max(throughputs)} keeps up: the fastest, {best}, delivers "
            f"{rate:.1f} samples/sec for a model that consumes {consumption:.1f}; training "
            "will wait for its input. Measure more workers (--max_workers), make the data "
            "processor cheaper, or shard the data."
        )
    return Recommendation(best, False, why)


def format_table(rows: list[dict], consumption: float, margin: float) -> str:
    """The measurement table: one row per worker count (keys of :func:`measure_rows`)."""
    head = (
        f"{'num_workers':>11} {'samples/sec':>12} {'batches/sec':>12} {'startup s':>10} "
        f"{'x model':>8}  keeps up"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = keeps_up(r["num_workers"], r["samples_per_sec"], consumption, margin)
        lines.append(
            f"{r['num_workers']:>11} {r['samples_per_sec']:>12.1f} {r['batches_per_sec']:>12.1f} "
            f"{r['startup_s']:>10.2f} {r['samples_per_sec'] / consumption:>8.2f}  "
            f"{'yes' if ok else 'no'}"
        )
    return "\n".join(lines)


def measure_rows(section: dict, max_workers: int, steps: int) -> list[dict]:
    """The pipeline of ``section`` timed with 0..max_workers workers."""
    from weightstream.data.throughput import measure_input

    rows = []
    for workers in range(max_workers + 1):
        m = measure_input(section, True, workers, steps)
        rows.append(
            {
                "num_workers": workers,
                "samples_per_sec": m.samples_per_sec,
                "batches_per_sec": m.batches / m.seconds if m.seconds > 0 else float("inf"),
                "startup_s": m.startup_s,
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream input-analyzer",
        description="Measure the training input's samples/sec with 0..N loader workers "
        "against the model's estimated consumption and recommend a worker count.",
    )
    parser.add_argument("-p", "--params", required=True, help="params YAML file")
    parser.add_argument(
        "--max_workers", type=int, default=4, help="largest worker count to measure (default 4)"
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="batches timed per worker count (default 50)"
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="throughput headroom over the model's consumption that counts as keeping up "
        f"(default {DEFAULT_MARGIN})",
    )
    parser.add_argument(
        "--target", choices=("CPU", "GPU"), default="CPU", help="the compute device (default CPU)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``weightstream input-analyzer``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.max_workers < 0:
            raise ValueError(f"--max_workers must be >= 0, got {args.max_workers}.")
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}.")
        if args.margin < 0:
            raise ValueError(f"--margin must be >= 0, got {args.margin}.")
        return _analyze(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"weightstream input-analyzer: {exc}", file=sys.stderr)
        return 2


def model_estimate(params_path, target: str = "CPU") -> dict:
    """The ``plan.json`` of the run command's compile of ``params_path`` (``compile_only``,
    into a scratch directory): the estimate the run would report."""
    import json
    import tempfile
    from pathlib import Path

    from weightstream.cli.params import load_params, parse_params
    from weightstream.cli.run import Run

    raw = load_params(params_path)
    with tempfile.TemporaryDirectory(prefix="weightstream-input-analyzer-") as scratch:
        rc = raw.setdefault("runconfig", {})
        rc.update(model_dir=scratch, compile_dir=None, compile_only=True, validate_only=False)
        Run(parse_params(raw, "train"), "train", target).execute()
        plans = list(Path(scratch).glob("ws_*/plan.json"))
        if not plans:
            raise ValueError(
                f"{params_path}: the compile phase made no estimate (its warning says why), "
                "so there is no consumption to compare the input with."
            )
        return json.loads(plans[0].read_text())


def _analyze(args) -> int:
    from weightstream.cli.params import load_params, parse_params

    params = parse_params(load_params(args.params), "train")
    section = params.train_input.to_dict()
    plan = model_estimate(args.params, args.target)
    est, machine = plan["estimate"], plan["machine"]
    consumption = est["model_samples_per_sec"]
    print(f"params: {args.params}")
    print(
        f"model: {params.model.name} ({params.runconfig.execution_mode}), batch size "
        f"{plan['estimate_settings']['batch_size']}, on {machine['device']} "
        f"({machine['device_name']})"
    )
    print(
        f"estimated consumption: {consumption:.1f} samples/sec (step "
        f"{1e3 * (est['step_s'] - est['input_s']):.2f} ms without input, bound by {est['bound']})"
    )
    print(
        f"train_input: {section['data_processor']}, num_workers {section.get('num_workers', 0)} "
        f"in the params file; {args.steps} batches timed per worker count\n"
    )
    rows = measure_rows(section, args.max_workers, args.steps)
    print(format_table(rows, consumption, args.margin))
    rec = recommend_workers(
        {r["num_workers"]: r["samples_per_sec"] for r in rows}, consumption, args.margin
    )
    print()
    if rec.keeps_up:
        print(f"recommended input workers: {rec.num_workers} ({rec.reason})")
    else:
        print(f"warning: {rec.reason}")
        print(f"recommended input workers: {rec.num_workers} (the fastest measured)")
    # The reference's num_workers_per_csx is this setting (the module docstring).
    print(f"  set train_input.num_workers: {rec.num_workers} in {args.params}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

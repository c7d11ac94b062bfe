"""Command-line arguments of ``weightstream run``.

::

    weightstream run {CPU,GPU} -p PARAMS.yaml [-m {train,eval,train_and_eval,eval_all}]
        [-o MODEL_DIR] [--checkpoint_path PATH] [--max_steps N] [--eval_steps N]
        [--compile_only | --validate_only] [--compile_dir DIR] [--num_csx N]
        [--num_wgt_servers N] [--num_workers_per_csx N]
        [--execution_mode {weight_streaming,layer_pipelined}]

Every flag but the target, -p and -m overrides the runconfig key of the same name in
the params file (:func:`weightstream.cli.params.apply_overrides`); a flag that is not
given leaves the file's value (its default is None).
"""

from __future__ import annotations

import argparse
import os

from weightstream.cli.params import (
    EXECUTION_MODES,
    MODES,
    Params,
    apply_overrides,
    load_params,
    parse_params,
)

__all__ = [
    "TARGETS",
    "add_run_arguments",
    "build_run_parser",
    "non_negative_int",
    "params_from_args",
    "positive_int",
]

TARGETS = ("CPU", "GPU")


def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer (1, 2, ...)")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def _target(text: str) -> str:
    name = text.upper()
    if name in TARGETS:
        return name
    if name == "CSX":
        raise argparse.ArgumentTypeError(
            "target CSX (a Cerebras system) is not available here; weightstream runs the same "
            "execution modes on CPU or GPU"
        )
    raise argparse.ArgumentTypeError(
        f"unknown target {text!r}; choose CPU or GPU (case-insensitive)"
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``weightstream run`` to ``parser`` (e.g. a subcommand's)."""
    parser.add_argument(
        "target",
        type=_target,
        metavar="{CPU,GPU}",
        help="device to run on (case-insensitive)",
    )
    parser.add_argument("-p", "--params", required=True, help="params YAML file")
    parser.add_argument(
        "-m", "--mode", choices=MODES, default="train", help="what to run (default: train)"
    )
    parser.add_argument(
        "-o",
        "--model_dir",
        default=None,
        help="directory for checkpoints, logs and the run's params file (default: "
        "runconfig.model_dir of the params file, else 'model_dir')",
    )
    parser.add_argument(
        "--checkpoint_path",
        default=None,
        help="checkpoint to start from (default: the newest in model_dir, when "
        "runconfig.autoload_last_checkpoint is true)",
    )
    parser.add_argument(
        "--max_steps", type=positive_int, default=None, help="train up to this global step"
    )
    parser.add_argument(
        "--eval_steps", type=positive_int, default=None, help="number of evaluation steps"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--compile_only",
        action="store_true",
        default=None,
        help="compile (plan the streaming units and estimate throughput) and stop",
    )
    only.add_argument(
        "--validate_only",
        action="store_true",
        default=None,
        help="check that the model traces and the plan fits, without compiling fully",
    )
    parser.add_argument("--compile_dir", default=None, help="directory of the compile cache")
    parser.add_argument(
        "--num_csx", type=positive_int, default=None, help="number of data-parallel systems"
    )
    parser.add_argument(
        "--num_wgt_servers",
        type=positive_int,
        default=None,
        help="number of weight servers holding the weight store",
    )
    # >= 0 like configure(num_workers_per_csx=...), not >= 1 like the other counts.
    parser.add_argument(
        "--num_workers_per_csx",
        type=non_negative_int,
        default=None,
        help="the reference's input workers per system (>= 0, as in runconfig; worker "
        "processes come from train_input.num_workers)",
    )
    parser.add_argument(
        "--execution_mode",
        choices=EXECUTION_MODES,
        default=None,
        help="weight_streaming (weights streamed layer by layer from the host store) or "
        "layer_pipelined (whole model on the device)",
    )
    return parser


def build_run_parser(prog: str = "weightstream run") -> argparse.ArgumentParser:
    """The parser of ``weightstream run``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train or evaluate a model of the zoo from a params file.",
    )
    return add_run_arguments(parser)


def params_from_args(args: argparse.Namespace) -> Params:
    """Read ``args.params``, apply the command-line overrides and check it for ``args.mode``.

    In a process that torchrun (or ``weightstream launch``) started, ``num_csx`` is the
    world it is one rank of (``WORLD_SIZE``): recorded so, and checked against the
    file's or ``--num_csx`` where they give another number of ranks."""
    raw = apply_overrides(load_params(args.params), args)
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) >= 1:
        runconfig = dict(raw.get("runconfig") or {})
        asked = runconfig.get("num_csx", 1)
        if asked not in (1, int(world)):
            raise ValueError(
                f"runconfig.num_csx is {asked} (the params file or --num_csx), but this "
                f"process is one of {world} ranks (WORLD_SIZE, set by torchrun or weightstream "
                f"launch). Fix: --num_csx {world}, or start {asked} ranks."
            )
        runconfig["num_csx"] = int(world)
        raw = {**raw, "runconfig": runconfig}
    return parse_params(raw, args.mode)

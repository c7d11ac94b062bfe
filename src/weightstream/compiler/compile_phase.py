"""The compile phase of the run command: plan, cost, estimate, report, cache.

The compile directory ``<compile_dir or model_dir>/ws_<checksum>/`` is keyed by
a checksum over the model structure, the batch shape and the settings that
change the plan (``report.py``); a later run with the same checksum reuses it.

The estimate (Note [the roofline] in estimate.py) prices the counted costs with
the probe's rates (``probe.py``: measured once per machine and torch version,
cached; ``WEIGHTSTREAM_QUICK_MACHINE_PROFILE=1`` measures with tiny sizes, for
tests). Besides the model and the machine it needs the step's loss (the task's
on meta labels, as the trainer computes it), the optimizer's bytes per
parameter, a disk store's predicted traffic and, when the training input has no
worker processes, the seconds the input pipeline takes per batch (timed here on
a few batches: it runs serially with every step).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from weightstream.compiler.cost import FRESH_BYTES, unit_costs
from weightstream.compiler.estimate import (
    CLIP_BYTES,
    DEFAULT_UPDATE_BYTES,
    UPDATE_BYTES,
    EstimateSettings,
    estimate,
)
from weightstream.compiler.probe import load_or_measure, time_kernels
from weightstream.compiler.report import compile_checksum, load_compile_dir, write_compile_dir
from weightstream.runtime import swarm
from weightstream.runtime.budgets import predicted_placement
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.partition import Plan, build_plan
from weightstream.runtime.store import MMAP_THRESHOLD

log = logging.getLogger("weightstream")

ENV_QUICK = "WEIGHTSTREAM_QUICK_MACHINE_PROFILE"
INPUT_TIMING_BATCHES = 20  # batches timed for the input term (at most INPUT_TIMING_SECONDS)
INPUT_TIMING_SECONDS = 0.5


def quick_profile() -> bool:
    return os.environ.get(ENV_QUICK) == "1"


def compact_update_bytes(master: torch.dtype, state: torch.dtype) -> int:
    """Bytes an Adam update with compact state or bf16 masters moves per parameter
    (Notes [compact optimizer state], [Kahan summation] in optim/compact.py): its
    chunked kernels' float32 scratch stays in cache, so from memory each value is read
    and written once (the master and each moment read and written, the gradient read,
    a bf16 master's Kahan buffer read and written)."""
    p, moment = master.itemsize, state.itemsize
    return 3 * p + 2 * 2 * moment + (2 * p if p < 4 else 0)


def optimizer_bytes(name: str, momentum: bool, state: torch.dtype, master: torch.dtype) -> int:
    """Bytes an update of optimizer ``name`` (with ``momentum``: SGD's) moves per trainable
    parameter, with moments of ``state``'s dtype and masters of ``master``'s."""
    name = name.lower()
    if name == "sgd" and momentum:
        name = "sgd_momentum"
    if name in ("adam", "adamw") and (state, master) != (torch.float32, torch.float32):
        return compact_update_bytes(master, state)
    return UPDATE_BYTES.get(name, DEFAULT_UPDATE_BYTES)


def update_bytes(params) -> int:
    """Bytes the params file's optimizer update moves per trainable parameter."""
    opt = params.optimizer
    clipped = opt.max_gradient_norm is not None or opt.max_gradient_value is not None
    state = getattr(torch, opt.state_dtype or "float32")
    master = getattr(torch, params.runconfig.master_dtype)
    momentum = bool(opt.optimizer_kwargs().get("momentum"))
    return optimizer_bytes(opt.optimizer_type, momentum, state, master) + (
        CLIP_BYTES if clipped else 0
    )


def settings_of(run) -> dict:
    """The settings a cached compile must match."""
    rc, s = run.rc, run.rc.streaming
    return {
        "execution_mode": rc.execution_mode,
        "device": str(run.device),
        **{k: getattr(s, k) for k in ("prefetch_depth", "unit_size_target", "granularity")},
        "unit_modules": list(s.unit_modules or ()),
        "activation_checkpointing": s.activation_checkpointing,
        "compute_dtype": run._compute_dtype() or "float32",
        "num_csx": rc.num_csx,
        "update_bytes": update_bytes(run.params),
        "store": s.store,
        "device_tier_budget": s.device_tier_budget,
        "input_num_workers": run.params.train_input.num_workers,
    }


def task_loss_fn(task: str, args: tuple) -> Callable:
    """The trainer's loss of one batch (``models.tasks.task_loss``), on meta labels."""
    from weightstream.models.tasks import task_loss

    inputs = args[0]
    shape = inputs.shape if task == "lm" else inputs.shape[:1]
    labels = torch.empty(shape, dtype=torch.long, device="meta")
    batch = {"input_ids" if task == "lm" else "inputs": inputs, "labels": labels}
    return lambda out: task_loss(task, lambda *_a, **_k: out, batch)[0]


def recomputed(compiled, plan: Plan) -> tuple[int, ...]:
    """The units whose forward runs again in the backward: the streamer's choice
    (weight streaming), or those inside a checkpointed module (layer pipelined)."""
    engine = compiled.engine
    if engine is not None and engine.streamer is not None:
        return tuple(sorted(engine.streamer.recompute))
    inside = {id(m) for top in compiled.recomputed_modules for m in top.modules()}
    return tuple(u.index for u in plan.units if id(u.module) in inside)


def input_seconds_per_batch(section: dict, quick: bool = False) -> float:
    """Seconds one batch of ``section`` costs the training process (0 with worker processes)."""
    if int(section.get("num_workers") or 0) > 0:
        return 0.0
    from weightstream.data.throughput import measure_input

    steps = 2 if quick else INPUT_TIMING_BATCHES
    return measure_input(
        section, True, 0, steps, max_seconds=INPUT_TIMING_SECONDS
    ).seconds_per_batch


def _estimate(
    run, compiled, plan: Plan, args: tuple, kwargs: dict, batch_size: int, collectives=None
):
    """Cost the model on ``plan`` for one batch, time the kernels the probe has not met,
    and estimate: (costs, estimate, probe), or None where the forward cannot run on fakes.
    ``collectives``: the ranks' measured costs (``swarm.collective_costs``)."""
    rc, m, quick = run.rc, run.params.model, quick_profile()
    engine = compiled.engine
    placement = _disk_placement(run, compiled, plan)
    compute = (m.fp16_type if m.mixed_precision else None) or "float32"
    settings = EstimateSettings(
        batch_size=batch_size,
        prefetch_depth=rc.streaming.prefetch_depth if run.ws else 0,
        compute_dtype=compute if compute != "cbfloat16" else "float32",
        transfer_dtype=None if compute in ("float32", "cbfloat16") or not run.ws else compute,
        weight_streaming=run.ws,
        update_bytes=update_bytes(run.params),
        input_s=input_seconds_per_batch(run.params.train_input.to_dict(), quick),
        recompute=recomputed(compiled, plan),
        resident=tuple(engine.resident) if engine is not None else (),
        **disk_traffic(placement, rc.streaming.store_dir or Path(rc.model_dir) / "store"),
        ranks=swarm.world_size(),
        sharded=engine is not None and engine.store.sharded,
        collectives=collectives,
        reduce_bucket_bytes=rc.streaming.reduce_bucket_bytes,
    )
    loss_fn = task_loss_fn(run.task, args) if run.task is not None else None
    disk_store = run.ws and rc.streaming.store == "disk"
    return price(compiled._orig_mod, plan, args, kwargs, settings, loss_fn, run.device, disk_store)


def disk_traffic(placement, store_dir) -> dict:
    """The estimate's disk settings of a disk store's ``placement`` (None: in RAM)."""
    reads = placement.disk_reads_per_step if placement is not None else 0
    writes = placement.disk_writes_per_step if placement is not None else 0
    return {
        "disk_read_bytes": reads,
        "disk_write_bytes": writes,
        "disk_dir": str(store_dir) if reads + writes else None,
    }


def price(
    model: torch.nn.Module,
    plan: Plan,
    args: tuple,
    kwargs: dict,
    settings: EstimateSettings,
    loss_fn: Callable | None,
    device: torch.device,
    disk_store: bool,
):
    """Count ``model``'s step on ``plan`` for one batch, time the kernels the probe has not
    met, and estimate (Note [the roofline] in estimate.py): (costs, estimate, probe), or
    None where the forward cannot run on fakes. ``loss_fn``: the step's loss of the
    model's output (None: the sum of the outputs)."""
    quick = quick_profile()
    probe = load_or_measure(device, quick=quick, disk_dir=settings.disk_dir)
    mixed = None if settings.compute_dtype == "float32" else getattr(torch, settings.compute_dtype)
    fresh_from = MMAP_THRESHOLD if disk_store else FRESH_BYTES  # Note [fresh pages] in cost.py
    try:
        costs = unit_costs(
            model,
            plan,
            args,
            kwargs,
            loss_fn,
            probe.device,
            mixed,
            fresh_from,
            recompute=settings.recompute,
        )
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        # A forward with data-dependent Python on tensor values cannot run on fakes.
        warnings.warn(
            "weightstream: no compile estimate: the model's forward does not run on the meta "
            f"device ({type(exc).__name__}: {exc}). Training is unaffected; the run reports "
            "its measured samples/sec without an estimate beside it.",
            stacklevel=3,
        )
        return None
    time_kernels(probe, costs.kernels)
    return costs, estimate(costs, probe, settings), probe


def run(run, compiled, args: tuple, batch_size: int, kwargs: dict | None = None) -> dict:
    """Compile for the model inputs of one batch (``models.tasks.model_inputs`` /
    ``model_kwargs``); returns what the run reports."""
    rc, kwargs, model = run.rc, kwargs or {}, compiled._orig_mod
    root = Path(rc.compile_dir) if rc.compile_dir else run.model_dir
    settings = settings_of(run)
    batch = [(tuple(a.shape), a.dtype) for a in args]
    if kwargs:  # keyword inputs change the trace (a packed batch's mask)
        batch.append({k: (tuple(v.shape), v.dtype) for k, v in sorted(kwargs.items())})
    checksum = compile_checksum(model, batch, settings)
    # The estimate is of one rank's step on its share of the batch; the run's rate, of
    # the global batch: the ranks step side by side. Their collectives are measured
    # first, on every rank alike (collective: a cache seen by one rank only must not
    # leave the others waiting).
    ranks = swarm.world_size()
    collectives = swarm.collective_costs() if ranks > 1 and not rc.validate_only else None
    cached = load_compile_dir(root, checksum)
    if cached is not None:
        log.info("Compile cache hit: %s", root / f"ws_{checksum}")
        return {"est_samples_per_sec": cached["est_samples_per_sec"] * ranks, "cache_hit": True}
    if rc.validate_only:
        plan = compiled.plan
        if plan is not None and plan.trace_refused:
            # The model's forward refused the batch: the first step would stop the same way.
            raise ValueError(
                f"validate_only: the model's forward refused the input batch ({plan.trace_error}); "
                "the first step of a training run would stop the same way. Fix the input or the "
                "model settings it names."
            )
        if plan is not None and not plan.traced:
            log.info(
                "Validation passed: every unit of the plan fits the device budget (the model "
                "does not trace on the meta device: %s; its plan is the module structure's).",
                plan.trace_error,
            )
        else:
            log.info("Validation passed: the model traces and every unit fits the device budget.")
        return {"est_samples_per_sec": None, "cache_hit": False}
    plan = compiled.plan or build_plan(model, StreamingConfig(granularity="module"))
    found = _estimate(run, compiled, plan, args, kwargs, batch_size, collectives)
    if found is None:
        return {"est_samples_per_sec": None, "cache_hit": False}
    costs, est, probe = found
    if ranks > 1:
        est.notes.append(f"one rank's step x {ranks} ranks, its collectives as measured")
    path = root / f"ws_{checksum}"
    if swarm.is_main():  # one writer: rank 0's estimate is the one the run reports
        path = write_compile_dir(root, checksum, plan, costs, est, probe, settings=settings)
    rate, bound = est.est_samples_per_sec * ranks, est.bound
    log.info("Compiled into %s: estimated %.3g samples/sec (bound by %s)", path, rate, bound)
    return {"est_samples_per_sec": rate, "cache_hit": False}


def _disk_placement(run, compiled, plan: Plan):
    """Where the run's disk store places this rank's state: the running store's own
    prediction (a sharded store's share), else, before the store has taken the model
    (compile_only), as a store would place it, unless it may be sharded over ranks.
    None for a store in RAM."""
    streaming = run.rc.streaming
    if not run.ws or streaming.store != "disk":
        return None
    predicted = compiled.engine.store.predicted_placement()
    if predicted is not None or (
        swarm.world_size() > 1 and streaming.store_sharding != "replicated"
    ):
        return predicted
    return predicted_placement(compiled._orig_mod, plan, streaming, run.device)

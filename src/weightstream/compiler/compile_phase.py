"""The compile phase of the run command: plan, cost, estimate, report, cache.

The compile directory ``<compile_dir or model_dir>/ws_<checksum>/`` is keyed by
a checksum over the model structure, the batch shape and the settings that
change the plan; a later run with the same checksum reuses it (a cache hit)
instead of costing the model again.

Set ``WEIGHTSTREAM_QUICK_MACHINE_PROFILE=1`` to measure the machine with tiny
sizes (tests); the profile is measured once per machine and cached (see
:mod:`weightstream.compiler.machine`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from weightstream.compiler.cost import unit_costs
from weightstream.compiler.estimate import EstimateSettings, estimate
from weightstream.compiler.machine import load_or_measure
from weightstream.compiler.partition import build_plan
from weightstream.compiler.report import compile_checksum, load_compile_dir, write_compile_dir
from weightstream.runtime.config import StreamingConfig

log = logging.getLogger("weightstream")


def settings_of(run) -> dict:
    rc = run.rc
    compute = run._compute_dtype()
    return {
        "execution_mode": rc.execution_mode,
        "device": str(run.device),
        "prefetch_depth": rc.prefetch_depth,
        "unit_size_target": rc.unit_size_target,
        "compute_dtype": compute or "float32",
        "num_csx": rc.num_csx,
    }


def run(run, compiled, args: tuple, batch_size: int) -> dict:
    """Compile for ``args`` (the model inputs of one batch); returns what the run reports."""
    rc = run.rc
    model = compiled._orig_mod
    root = Path(rc.compile_dir) if rc.compile_dir else run.model_dir
    settings = settings_of(run)
    checksum = compile_checksum(model, [(tuple(a.shape), a.dtype) for a in args], settings)
    cached = load_compile_dir(root, checksum)
    if cached is not None:
        log.info("Compile cache hit: %s", root / f"ws_{checksum}")
        return {"est_samples_per_sec": cached["est_samples_per_sec"], "cache_hit": True}
    if rc.validate_only:
        # validate_only: the trace and the budget checks ran in prepare(); nothing to write.
        log.info("Validation passed: the model traces and every unit fits the device budget.")
        return {"est_samples_per_sec": None, "cache_hit": False}
    plan = compiled.plan
    if plan is None:  # layer pipelined: cost the model layer by layer all the same
        plan = build_plan(model, StreamingConfig(granularity="module"))
    costs = unit_costs(model, plan, args)
    quick = os.environ.get("WEIGHTSTREAM_QUICK_MACHINE_PROFILE") == "1"
    machine = load_or_measure(run.device, quick=quick)
    compute = settings["compute_dtype"]
    est = estimate(
        costs,
        machine,
        EstimateSettings(
            batch_size=batch_size,
            prefetch_depth=rc.prefetch_depth if run.ws else 0,
            compute_dtype=compute if compute != "cbfloat16" else "float32",
            transfer_dtype=None if compute in ("float32", "cbfloat16") else compute,
        ),
    )
    path = write_compile_dir(root, checksum, plan, costs, est, machine, settings=settings)
    log.info(
        "Compiled into %s: estimated %.2f samples/sec (bound by %s)",
        path,
        est.est_samples_per_sec,
        est.bound,
    )
    return {"est_samples_per_sec": est.est_samples_per_sec, "cache_hit": False}

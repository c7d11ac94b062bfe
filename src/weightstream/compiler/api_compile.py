"""``configure(compile_only=True)`` in a script: its compile directory.

The run command's compile phase (``compile_phase.py``) writes
``<compile_dir or model_dir>/ws_<checksum>/`` before any step. A script written
for the API has no compile phase of its own: its first ``compile_step`` plans
the model for the batch it was given (Note [compile only] in
weightstream/executor.py). In a compile_only run that step also writes the
compile directory, as the reference's compile_only run saves its compiled
artifacts: the plan and the estimate of the same roofline, priced from what
the script has set up by then (the streaming settings, the optimizers built
before the step, a disk store's placement). What a script alone knows is left
out and said in the report's notes: its loss (the model's outputs summed
instead) and its input pipeline.

:func:`compile` is the public ``cstorch.compile``: ``backend.compile`` with
this writer attached to the compiled model (the compiler sits above the
backend, which calls it back).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from weightstream import backend as _backend
from weightstream.context import current_config
from weightstream.executor import outside_the_step
from weightstream.runtime import swarm

log = logging.getLogger("weightstream")


@functools.wraps(_backend.compile)
def compile(model, backend: str = "wse_ws", **kwargs):
    compiled = _backend.compile(model, backend, **kwargs)
    compiled.on_compile_only = write_compile_dir_of_step
    return compiled


def optimizer_update_bytes(optimizers) -> tuple[int, str | None]:
    """Bytes a step's update moves per trainable parameter under ``optimizers`` (weighted
    by their parameters), and a note where it is assumed."""
    from weightstream.compiler.compile_phase import optimizer_bytes
    from weightstream.compiler.estimate import DEFAULT_UPDATE_BYTES

    if not optimizers:
        return DEFAULT_UPDATE_BYTES, (
            "no optimizer was built before the first step: AdamW's update is priced"
        )
    total = count = 0
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            continue
        momentum = any(g.get("momentum") for g in opt.param_groups)
        state = getattr(opt, "state_dtype", torch.float32)
        nbytes = optimizer_bytes(type(opt).__name__, momentum, state, params[0].dtype)
        numel = sum(p.numel() for p in params)
        total, count = total + nbytes * numel, count + numel
    return (round(total / count), None) if count else (DEFAULT_UPDATE_BYTES, None)


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The first dimension of the step's first tensor input."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return 1


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_compile_dir_of_step(compiled, args: tuple, kwargs: dict) -> str:
    """Write the compile directory of ``compiled`` planned for this batch (module
    docstring); what was written, in words. Rank 0 writes; other ranks write nothing.
    (The compile phase is imported here: ``import weightstream`` need not load it.)"""
    from weightstream.compiler.compile_phase import disk_traffic, price, recomputed
    from weightstream.compiler.estimate import EstimateSettings
    from weightstream.compiler.report import (
        compile_checksum,
        load_compile_dir,
        write_compile_dir,
    )
    from weightstream.runtime.config import StreamingConfig
    from weightstream.runtime.partition import build_plan

    config = current_config()
    root = Path(config.compile_dir or config.model_dir)
    engine, model = compiled.engine, compiled._orig_mod
    ws = engine is not None
    streaming = engine.config if ws else StreamingConfig(granularity="module")
    plan = engine.plan if ws else build_plan(model, streaming)
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    compute = _dtype_name(streaming.compute_dtype or own)  # None: the parameters' own
    compute = "float32" if compute == "cbfloat16" else compute
    update, update_note = optimizer_update_bytes(list(engine._optimizers) if ws else [])
    settings = {
        "execution_mode": compiled.mode.value,
        "device": str(compiled.device),
        **{k: getattr(streaming, k) for k in ("prefetch_depth", "unit_size_target", "granularity")},
        "unit_modules": list(streaming.unit_modules or ()),
        "activation_checkpointing": streaming.activation_checkpointing,
        "compute_dtype": compute,
        "num_csx": swarm.world_size(),
        "update_bytes": update,
        "store": streaming.store,
        "device_tier_budget": streaming.device_tier_budget,
    }
    # The batch's tensors, which the checksum takes as their shapes and dtypes (keyword
    # inputs change the trace too: a mask).
    inputs = pytree.tree_leaves((args, dict(sorted(kwargs.items()))))
    batch = [t for t in inputs if isinstance(t, torch.Tensor)]
    checksum = compile_checksum(model, batch, settings)
    if load_compile_dir(root, checksum) is not None:
        return f"its compile directory {root / f'ws_{checksum}'} was already there"
    if not swarm.is_main():
        return "rank 0 writes the compile directory"
    disk_store = ws and streaming.store == "disk"
    placement = engine.store.predicted_placement() if disk_store else None
    estimate_settings = EstimateSettings(
        batch_size=_batch_size(args, kwargs),
        prefetch_depth=streaming.prefetch_depth if ws else 0,
        compute_dtype=compute,
        transfer_dtype=None if compute == "float32" or not ws else compute,
        weight_streaming=ws,
        update_bytes=update,
        recompute=recomputed(compiled, plan),
        resident=tuple(engine.resident) if ws else (),
        **disk_traffic(placement, engine.store.tier.directory if disk_store else None),
    )
    with outside_the_step():  # the probe runs models of its own
        found = price(
            model, plan, args, kwargs, estimate_settings, None, compiled.device, disk_store
        )
    if found is None:
        return "the model's forward does not run on fakes: no compile directory was written"
    costs, est, probe = found
    est.notes += [
        "the script's loss is not known here: the backward of the model's outputs summed is priced",
        "the script's input pipeline is not priced",
        *(["the ranks' collectives are not priced"] if swarm.world_size() > 1 else []),
        *([update_note] if update_note else []),
    ]
    path = write_compile_dir(root, checksum, plan, costs, est, probe, settings=settings)
    return (
        f"its compile directory is {path} (estimated {est.est_samples_per_sec:.3g} "
        f"samples/sec, bound by {est.bound})"
    )

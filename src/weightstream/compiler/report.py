"""The compile directory: ``<root>/ws_<checksum>/`` with ``plan.json`` and ``compile_report.txt``.

The checksum names what the plan depends on: the module structure (qualified
module names and classes, which modules and parameters are shared, parameter
and buffer names, shapes, dtypes, ``requires_grad``), the batch shapes and
dtypes, and the settings that change the plan. Weight values are not part of
it: training changes them and the plan stays valid. A directory with the same
checksum is a cache hit (:func:`load_compile_dir`).

Both files are written atomically (a temporary file renamed over the final
name), the report first and ``plan.json`` last: a directory whose
``plan.json`` is readable and complete was written completely.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from pathlib import Path

import torch

from weightstream.common.files import write_text_atomic
from weightstream.common.units import format_bytes
from weightstream.compiler.cost import StepCosts
from weightstream.compiler.estimate import Estimate
from weightstream.compiler.probe import Probe
from weightstream.runtime.partition import Plan

SCHEMA = 3  # 3: the roofline's terms (Note [the roofline] in estimate.py)
PLAN_FILE = "plan.json"
REPORT_FILE = "compile_report.txt"
_REQUIRED = ("schema", "checksum", "settings", "units", "totals", "estimate", "est_samples_per_sec")


def _canonical(x):
    """A JSON-able, repr-free form of ``x`` (no object addresses: the digest must be stable)."""
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype)}
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, torch.Size):
        return list(x)
    if isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    if isinstance(x, enum.Enum):
        return _canonical(x.value)
    if dataclasses.is_dataclass(x):
        return {
            "__class__": _canonical(type(x)),
            **{f.name: _canonical(getattr(x, f.name)) for f in dataclasses.fields(x)},
        }
    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if _is_shape_dtype(x):  # (shape, dtype): the same as a tensor of that shape
            return {"shape": [int(d) for d in x[0]], "dtype": str(x[1])}
        return [_canonical(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(
        f"cannot include a {type(x).__name__} in the compile checksum; pass tensors, "
        "(shape, dtype) pairs, dtypes, classes, dataclasses or plain JSON values."
    )


def _is_shape_dtype(x) -> bool:
    return (
        len(x) == 2
        and isinstance(x[1], torch.dtype)
        and isinstance(x[0], (list, tuple))
        and all(isinstance(d, int) for d in x[0])
    )


def _structure(model: torch.nn.Module) -> dict:
    first_name: dict[int, str] = {}
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        shared = first_name.setdefault(id(m), name)
        modules.append([name, _canonical(type(m)), shared if shared != name else None])
    first_name.clear()
    params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        tied = first_name.setdefault(id(p), name)
        params.append(
            [name, list(p.shape), str(p.dtype), p.requires_grad, tied if tied != name else None]
        )
    buffers = []
    for mname, m in model.named_modules(remove_duplicate=False):
        for bname, b in m._buffers.items():
            if b is not None:
                full = f"{mname}.{bname}" if mname else bname
                persistent = bname not in m._non_persistent_buffers_set
                buffers.append([full, list(b.shape), str(b.dtype), persistent])
    return {"modules": modules, "parameters": params, "buffers": buffers}


def compile_checksum(model: torch.nn.Module, batch_shapes_and_dtypes, settings: dict) -> str:
    """A stable hex digest of what the plan depends on (not of the weight values).

    ``batch_shapes_and_dtypes``: the example batch (tensors, or ``(shape,
    dtype)`` pairs, in any nesting). ``settings``: the settings that change
    the plan or the estimate (streaming config, batch size, compute dtype...).
    """
    data = {
        "schema": SCHEMA,
        "structure": _structure(model),
        "batch": _canonical(batch_shapes_and_dtypes),
        "settings": _canonical(settings),
    }
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compile_dir_path(root: str | Path, checksum: str) -> Path:
    return Path(root) / f"ws_{checksum}"


def _terms(e) -> dict:
    """An entry's estimated seconds, term by term (``estimate.UnitEstimate``)."""
    return {
        "est_fwd_compute_s": e.fwd_compute_s,
        "est_bwd_compute_s": e.bwd_compute_s,
        "est_fwd_memory_s": e.fwd_memory_s,
        "est_bwd_memory_s": e.bwd_memory_s,
        "est_fwd_overhead_s": e.fwd_overhead_s,
        "est_bwd_overhead_s": e.bwd_overhead_s,
        "est_stream_s": e.stream_s,
        "est_update_s": e.update_s,
        "est_transfer_s": e.transfer_s,
        "est_disk_s": e.disk_s,
        "est_s": e.time_s,
        "bound": e.bound,
    }


def _plan_dict(
    checksum: str, plan: Plan, costs: StepCosts, est: Estimate, probe: Probe, settings: dict | None
) -> dict:
    units = []
    for spec, cost, e in zip(plan.units, costs.units, est.units, strict=True):
        assert spec.index == cost.index == e.index, "costs and estimate follow the plan's order"
        units.append(
            {
                "index": spec.index,
                "name": spec.display_name,
                "module_class": type(spec.module).__name__,
                "params": cost.numel,
                "trainable_params": cost.trainable_numel,
                "weight_bytes": cost.weight_bytes,
                "fwd_flops": cost.fwd_flops,
                "bwd_flops": cost.bwd_flops,
                "activation_bytes": cost.activation_bytes,
                "fwd_ops": cost.fwd_ops,
                "bwd_ops": cost.bwd_ops,
                "op_bytes": cost.op_bytes,
                "trainable_tensors": cost.trainable_tensors,
                "pinned": spec.pinned,
                **_terms(e),
            }
        )
    out = costs.outside
    return {
        "schema": SCHEMA,
        "checksum": checksum,
        "settings": _canonical(settings or {}),
        "estimate_settings": dataclasses.asdict(est.settings),
        "traced": plan.traced,
        "trace_error": plan.trace_error,
        "batch": costs.batch,
        "backward_measured": costs.backward_measured,
        "units": units,
        "outside_units": {
            "fwd_flops": out.fwd_flops,
            "bwd_flops": out.bwd_flops,
            "activation_bytes": out.activation_bytes,
            "fwd_ops": out.fwd_ops,
            "bwd_ops": out.bwd_ops,
            "op_bytes": out.op_bytes,
            **_terms(est.outside),
        },
        "totals": {
            "params": sum(u.numel for u in costs.units),
            "weight_bytes": costs.weight_bytes,
            "fwd_flops": costs.fwd_flops,
            "bwd_flops": costs.bwd_flops,
            "flops": costs.flops,
            "activation_bytes": costs.activation_bytes,
            "ops": costs.ops,
            "op_bytes": costs.op_bytes,
            "largest_unit_bytes": plan.largest_unit_bytes,
            "pinned_bytes": plan.pinned_bytes,
            "weight_bound_bytes": plan.weight_bound(est.settings.prefetch_depth),
        },
        "estimate": {
            "step_s": est.step_s,
            "compute_s": est.compute_s,
            "memory_s": est.memory_s,
            "overhead_s": est.overhead_s,
            "transfer_s": est.transfer_s,
            "update_s": est.update_s,
            "input_s": est.input_s,
            "disk_s": est.disk_s,
            "disk_bytes": est.settings.disk_read_bytes + est.settings.disk_write_bytes,
            "model_samples_per_sec": est.model_samples_per_sec,
            "bound": est.bound,
            "link_bytes": est.link_bytes,
            "host_bytes": est.host_bytes,
            "limit_s": est.limit_s,
            "limit_bound": est.limit_bound,
            "limit_samples_per_sec": est.limit_samples_per_sec,
            "notes": est.notes,
        },
        "est_samples_per_sec": est.est_samples_per_sec,
        "machine": probe.to_dict(),
    }


def _si(x: float, unit: str = "") -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _row(u: dict) -> str:
    """The estimate's columns of one entry."""
    return (
        f"{_ms(u['est_fwd_compute_s'] + u['est_bwd_compute_s']):>9} "
        f"{_ms(u['est_fwd_memory_s'] + u['est_bwd_memory_s']):>9} "
        f"{_ms(u['est_fwd_overhead_s'] + u['est_bwd_overhead_s'] + u['est_stream_s']):>9} "
        f"{_ms(u['est_update_s']):>9} {_ms(u['est_transfer_s']):>9} {_ms(u['est_disk_s']):>9} "
        f"{_ms(u['est_s']):>9}  {u['bound']:<9}"
    )


def _report_text(data: dict) -> str:
    est = data["estimate"]
    es = data["estimate_settings"]
    m = data["machine"]
    name_w = max([len("unit"), len("<outside units>")] + [len(u["name"]) for u in data["units"]])
    head = (
        f"{'#':>3}  {'unit':<{name_w}} {'params':>12} {'weights':>11} {'fwd FLOP':>11} "
        f"{'bwd FLOP':>11} {'activations':>11} {'ops':>6} {'op bytes':>11} {'flop ms':>9} "
        f"{'mem ms':>9} {'ovh ms':>9} {'upd ms':>9} {'link ms':>9} {'disk ms':>9} "
        f"{'time ms':>9}  bound     pinned"
    )
    lines = [
        f"weightstream compile report  ws_{data['checksum']}",
        "",
        f"batch: {data['batch']}  batch_size {es['batch_size']}  compute dtype "
        f"{es['compute_dtype']}  prefetch_depth {es['prefetch_depth']}",
        f"settings: {json.dumps(data['settings'], sort_keys=True)}",
        f"plan: {len(data['units'])} streaming units"
        + ("" if data["traced"] else f" (structural, not traced: {data['trace_error']})"),
        "",
        head,
        "-" * len(head),
    ]
    for u in data["units"]:
        lines.append(
            f"{u['index']:>3}  {u['name']:<{name_w}} {u['params']:>12,} "
            f"{format_bytes(u['weight_bytes']):>11} {_si(u['fwd_flops']):>11} "
            f"{_si(u['bwd_flops']):>11} {format_bytes(u['activation_bytes']):>11} "
            f"{u['fwd_ops'] + u['bwd_ops']:>6} {format_bytes(u['op_bytes']):>11} "
            f"{_row(u)} {'yes' if u['pinned'] else ''}"
        )
    o = data["outside_units"]
    lines.append(
        f"{'':>3}  {'<outside units>':<{name_w}} {'':>12} {'':>11} {_si(o['fwd_flops']):>11} "
        f"{_si(o['bwd_flops']):>11} {format_bytes(o['activation_bytes']):>11} "
        f"{o['fwd_ops'] + o['bwd_ops']:>6} {format_bytes(o['op_bytes']):>11} {_row(o)}"
    )
    t = data["totals"]
    disk = f", disk {_ms(est['disk_s'])} ms" if est["disk_s"] else ""
    lines += [
        "",
        "summary",
        f"  parameters            {t['params']:,} ({format_bytes(t['weight_bytes'])})",
        f"  FLOPs per step        {_si(t['flops'])} (forward {_si(t['fwd_flops'])}, backward "
        f"{_si(t['bwd_flops'])}{'' if data['backward_measured'] else ', 2 x forward'}; "
        "matmul-like operators and attention only)",
        f"  activations kept      {format_bytes(t['activation_bytes'])}",
        f"  device weight bound   {format_bytes(t['weight_bound_bytes'])} ((prefetch_depth + 1) x "
        f"largest unit {format_bytes(t['largest_unit_bytes'])} + pinned "
        f"{format_bytes(t['pinned_bytes'])})",
        f"  operators per step    {t['ops']:,} (moving {format_bytes(t['op_bytes'])})",
        f"  step time             {_ms(est['step_s'])} ms (compute {_ms(est['compute_s'])} ms, "
        f"memory {_ms(est['memory_s'])} ms, overhead {_ms(est['overhead_s'])} ms, "
        f"update {_ms(est['update_s'])} ms, link {_ms(est['transfer_s'])} ms{disk}, "
        f"input {_ms(est['input_s'])} ms)",
        "                        (per unit the larger of work, link and disk with prefetching: "
        "the terms can sum to more)",
        f"  est. samples/sec      {data['est_samples_per_sec']:.2f}  (bound by {est['bound']})",
        f"  model consumes        {est['model_samples_per_sec']:.2f} samples/sec "
        "(the step without its input)",
        f"  physical limit        {est['limit_samples_per_sec']:.2f} samples/sec "
        f"(bound by {est['limit_bound']})",
        "",
        f"probe: {m['device']} ({m['device_name']}), torch {m['torch_version']}, "
        f"{m['num_threads']} threads, measured {m['measured_at']}",
        "  matmul peak  "
        + ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in sorted(m["matmul_flops"].items())),
        f"  memory {_si(m['memory_bandwidth'], 'B/s')}, host memory "
        f"{_si(m['host_memory_bandwidth'], 'B/s')}"
        + (f", link {_si(m['link_bandwidth'], 'B/s')}" if m["link_bandwidth"] else ""),
        f"  fixed costs: {m['op_s'] * 1e6:.1f} us per operator, {m['tensor_s'] * 1e6:.1f} us per "
        f"parameter tensor, {m['step_s'] * 1e6:.0f} us per step",
    ]
    for directory, rates in sorted(m["disk"].items()):
        lines.append(
            f"  disk {directory}: write {_si(rates['write'], 'B/s')}, "
            f"read {_si(rates['read'], 'B/s')}"
        )
    lines += [f"note: {n}" for n in est["notes"]]
    return "\n".join(lines) + "\n"


def write_compile_dir(
    root: str | Path,
    checksum: str,
    plan: Plan,
    costs: StepCosts,
    estimate: Estimate,
    probe: Probe,
    settings: dict | None = None,
) -> Path:
    """Write ``<root>/ws_<checksum>/{compile_report.txt, plan.json}``; return the directory."""
    data = _plan_dict(checksum, plan, costs, estimate, probe, settings)
    directory = compile_dir_path(root, checksum)
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(directory / REPORT_FILE, _report_text(data))
    write_text_atomic(directory / PLAN_FILE, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return directory


def load_compile_dir(root: str | Path, checksum: str) -> dict | None:
    """The ``plan.json`` of a previous compile with this checksum, or None.

    None when the directory or a file is missing, unreadable, of another
    schema or checksum, or incomplete.
    """
    directory = compile_dir_path(root, checksum)
    try:
        with open(directory / PLAN_FILE) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(k not in data for k in _REQUIRED):
        return None
    if data["schema"] != SCHEMA or data["checksum"] != checksum:
        return None
    if not (directory / REPORT_FILE).is_file():
        return None
    return data

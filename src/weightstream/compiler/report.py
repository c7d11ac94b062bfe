"""The compile directory: ``<root>/ws_<checksum>/`` with ``plan.json`` and ``compile_report.txt``.

The checksum names what the plan depends on: the module structure (names,
classes, shared modules and tied parameters, parameter and buffer names, shapes,
dtypes, ``requires_grad``), the batch shapes and dtypes and the settings that
change the plan, not the weight values. A directory with the same checksum is a
cache hit. Both files are written atomically, the report first and ``plan.json``
last: a readable, complete ``plan.json`` means a complete directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from weightstream.common.files import write_text_atomic
from weightstream.common.units import format_bytes
from weightstream.compiler.cost import OUTSIDE_NAME, StepCosts
from weightstream.compiler.estimate import TERMS, Estimate
from weightstream.compiler.probe import Probe
from weightstream.runtime.partition import Plan

SCHEMA = 6  # 6: the collective term
PLAN_FILE = "plan.json"
REPORT_FILE = "compile_report.txt"
_REQUIRED = ("schema", "checksum", "settings", "units", "totals", "estimate", "est_samples_per_sec")
_RATES = (("memory", "memory_bandwidth"), ("host memory", "host_memory_bandwidth"))
_RATES += (("link", "link_bandwidth"), ("fresh pages", "fresh_bandwidth"))
_COST_KEYS = ("fwd_flops", "bwd_flops", "activation_bytes", "ops", "op_bytes", "fresh_bytes")


def _plain(x):
    """``json.dumps``' fallback: a stable form without object addresses (a tensor as its
    ``(shape, dtype)`` pair)."""
    if isinstance(x, torch.Tensor):
        return [list(x.shape), x.dtype]
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    raise TypeError(
        f"cannot include a {type(x).__name__} in the compile checksum; pass tensors, "
        "(shape, dtype) pairs, dtypes, classes or plain JSON values."
    )


def _json(x, **kwargs) -> str:
    return json.dumps(x, default=_plain, sort_keys=True, **kwargs)


def _structure(model: torch.nn.Module) -> dict:
    """Names, classes, shapes, dtypes, ``requires_grad`` and which module or parameter
    is another's (shared modules, tied parameters) by the name it was first met at."""

    def first(seen: dict, obj, name: str):
        return None if seen.setdefault(id(obj), name) == name else seen[id(obj)]

    mods, params = {}, {}
    named = list(model.named_modules(remove_duplicate=False))
    return {
        "modules": [[n, type(m), first(mods, m, n)] for n, m in named],
        "parameters": [
            [n, p.shape, p.dtype, p.requires_grad, first(params, p, n)]
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [
            [f"{mn}.{bn}".lstrip("."), b.shape, b.dtype, bn not in m._non_persistent_buffers_set]
            for mn, m in named
            for bn, b in m._buffers.items()
            if b is not None
        ],
    }


def compile_checksum(model: torch.nn.Module, batch_shapes_and_dtypes, settings: dict) -> str:
    """A stable hex digest of what the plan depends on (not of the weight values).

    ``batch_shapes_and_dtypes``: tensors or ``(shape, dtype)`` pairs in any nesting;
    ``settings``: those that change the plan or the estimate.
    """
    data = [SCHEMA, _structure(model), batch_shapes_and_dtypes, settings]
    return hashlib.sha256(_json(data).encode()).hexdigest()[:20]


def compile_dir_path(root: str | Path, checksum: str) -> Path:
    return Path(root) / f"ws_{checksum}"


def _entry(cost, e) -> dict:
    """An entry's counted costs and its estimated seconds, term by term."""
    terms = {f"est_{k}_s": e.term(k) for k in TERMS}
    return {
        **{k: getattr(cost, k) for k in _COST_KEYS},
        **terms,
        "est_s": e.time_s,
        "bound": e.bound,
    }


def _plan_dict(checksum, plan: Plan, costs: StepCosts, est: Estimate, probe: Probe, settings):
    units = [
        {
            "index": spec.index,
            "name": spec.display_name,
            "module_class": type(spec.module).__name__,
            "params": cost.numel,
            "trainable_params": cost.trainable_numel,
            "weight_bytes": cost.weight_bytes,
            "trainable_tensors": cost.trainable_tensors,
            "pinned": spec.pinned,
            **_entry(cost, e),
        }
        for spec, cost, e in zip(plan.units, costs.units, est.units, strict=True)
    ]
    totals = ("fwd_flops", "bwd_flops", "flops", "activation_bytes", "ops")
    es, params = est.settings, {id(p): p for u in plan.units for p in u.params}  # tied: once
    return {
        "schema": SCHEMA,
        "checksum": checksum,
        "settings": json.loads(_json(settings or {})),
        "estimate_settings": dataclasses.asdict(es),
        "traced": plan.traced,
        "trace_error": plan.trace_error,
        "batch": costs.batch,
        "backward_measured": costs.backward_measured,
        "units": units,
        "outside_units": _entry(costs.outside, est.outside),
        "totals": {
            "params": sum(p.numel() for p in params.values()),
            "weight_bytes": sum(p.nbytes for p in params.values()),
            **{k: getattr(costs, k) for k in (*totals, "op_bytes")},
            "largest_unit_bytes": plan.largest_unit_bytes,
            "pinned_bytes": plan.pinned_bytes,
            # Layer pipelined keeps every weight on the device.
            "weight_bound_bytes": plan.weight_bound(es.prefetch_depth)
            if es.weight_streaming
            else sum(p.nbytes for p in params.values()),
        },
        "estimate": {
            **{f"{k}_s": v for k, v in est.terms.items()},
            **{k: getattr(est, k) for k in ("step_s", "bound", "link_bytes", "host_bytes")},
            **{k: getattr(est, k) for k in ("limit_s", "limit_bound", "limit_samples_per_sec")},
            "disk_bytes": es.disk_read_bytes + es.disk_write_bytes,
            "model_samples_per_sec": est.model_samples_per_sec,
            "timed_kernels": est.timed_kernels,
            "notes": est.notes,
        },
        "est_samples_per_sec": est.est_samples_per_sec,
        "machine": {k: v for k, v in dataclasses.asdict(probe).items() if k != "kernel_s"},
    }


def _si(x: float, unit: str = "") -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


_SHORT = list(zip(("flop", "mem", "ovh", "upd", "link", "disk", "coll"), TERMS, strict=True))
# The table's columns after the unit's name: header, width, the text of an entry.
_COLUMNS = [
    ("params", 12, lambda u: f"{u['params']:,}" if "params" in u else ""),
    ("weights", 11, lambda u: format_bytes(u["weight_bytes"]) if "weight_bytes" in u else ""),
    ("fwd FLOP", 11, lambda u: _si(u["fwd_flops"])),
    ("bwd FLOP", 11, lambda u: _si(u["bwd_flops"])),
    ("activations", 11, lambda u: format_bytes(u["activation_bytes"])),
    ("ops", 6, lambda u: str(u["ops"])),
    ("op bytes", 11, lambda u: format_bytes(u["op_bytes"])),
    *((f"{short} ms", 9, lambda u, k=k: _ms(u[f"est_{k}_s"])) for short, k in _SHORT),
    ("time ms", 9, lambda u: _ms(u["est_s"])),
]


def _report_text(data: dict) -> str:
    est, es, m, t = data["estimate"], data["estimate_settings"], data["machine"], data["totals"]
    w = max([len(OUTSIDE_NAME)] + [len(u["name"]) for u in data["units"]])

    def row(index, name: str, u: dict, last: str) -> str:
        cells = " ".join(f"{text(u):>{width}}" for _, width, text in _COLUMNS)
        return f"{index:>3}  {name:<{w}} {cells}  {last}"

    head = f"{'#':>3}  {'unit':<{w}} " + " ".join(f"{h:>{n}}" for h, n, _ in _COLUMNS)
    head += "  bound     pinned"
    table = [
        row(u["index"], u["name"], u, f"{u['bound']:<9} {'yes' if u['pinned'] else ''}")
        for u in data["units"]
    ]
    table.append(row("", OUTSIDE_NAME, data["outside_units"], data["outside_units"]["bound"]))
    terms = ", ".join(f"{k} {_ms(est[f'{k}_s'])} ms" for k in (*TERMS, "input") if est[f"{k}_s"])
    summary = {
        "parameters": f"{t['params']:,} ({format_bytes(t['weight_bytes'])})",
        "FLOPs per step": f"{_si(t['flops'])} (forward {_si(t['fwd_flops'])}, backward "
        f"{_si(t['bwd_flops'])}{'' if data['backward_measured'] else ', 2 x forward'}; "
        "matmul-like operators and attention only)",
        "activations kept": format_bytes(t["activation_bytes"]),
        "device weight bound": f"{format_bytes(t['weight_bound_bytes'])} ((prefetch_depth + 1) "
        f"x largest unit {format_bytes(t['largest_unit_bytes'])} + pinned "
        f"{format_bytes(t['pinned_bytes'])})"
        if data["estimate_settings"]["weight_streaming"]
        else f"{format_bytes(t['weight_bound_bytes'])} (layer pipelined: every weight resident)",
        "operators per step": f"{t['ops']:,} (moving {format_bytes(t['op_bytes'])}; kernels "
        f"timed by the probe: {est['timed_kernels']})",
        "step time": f"{_ms(est['step_s'])} ms ({terms})\n{'':24}(per unit the larger of "
        "work, link and disk (and an accelerator's collectives) with prefetching: the terms "
        "can sum to more)",
        "est. samples/sec": f"{data['est_samples_per_sec']:.2f}  (bound by {est['bound']})",
        "model consumes": f"{est['model_samples_per_sec']:.2f} samples/sec (the step without "
        "its input)",
        "physical limit": f"{est['limit_samples_per_sec']:.2f} samples/sec (bound by "
        f"{est['limit_bound']})",
    }
    rates = ", ".join(f"{name} {_si(m[k], 'B/s')}" for name, k in _RATES if m[k])
    disks = sorted(m["disk"].items())
    peaks = ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in sorted(m["matmul_flops"].items()))
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
        *table,
        "",
        "summary",
        *(f"  {label:<22}{text}" for label, text in summary.items()),
        "",
        f"probe: {m['device']} ({m['device_name']}), torch {m['torch_version']}, "
        f"{m['num_threads']} threads, measured {m['measured_at']}",
        f"  matmul peak  {peaks}",
        f"  {rates}",
        f"  fixed costs: {m['op_s'] * 1e6:.1f} us per operator, {m['tensor_s'] * 1e6:.1f} us per "
        f"parameter tensor, {m['step_s'] * 1e6:.0f} us per step",
        *(
            f"  disk {d}: {_si(r['write'], 'B/s')} write, {_si(r['read'], 'B/s')} read"
            for d, r in disks
        ),
        *(f"note: {n}" for n in est["notes"]),
    ]
    return "\n".join(lines) + "\n"


def write_compile_dir(root, checksum, plan, costs, estimate, probe, settings=None) -> Path:
    """Write ``<root>/ws_<checksum>/{compile_report.txt, plan.json}``; return the directory."""
    data = _plan_dict(checksum, plan, costs, estimate, probe, settings)
    directory = compile_dir_path(root, checksum)
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(directory / REPORT_FILE, _report_text(data))
    write_text_atomic(directory / PLAN_FILE, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return directory


def load_compile_dir(root: str | Path, checksum: str) -> dict | None:
    """The ``plan.json`` of a previous compile with this checksum, or None when the
    directory or a file is missing, unreadable, of another schema or checksum, or
    incomplete."""
    directory = compile_dir_path(root, checksum)
    try:
        data = json.loads((directory / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(k not in data for k in _REQUIRED):
        return None
    if data["schema"] != SCHEMA or data["checksum"] != checksum:
        return None
    return data if (directory / REPORT_FILE).is_file() else None

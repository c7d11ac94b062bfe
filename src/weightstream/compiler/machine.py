"""What this machine can do, measured once and cached: the denominators of the estimate.

The profile (``profile.MachineProfile``) holds hardware figures (``hardware.py``),
software figures (``software.py``: fixed costs and the in-situ factor) and, measured
when a run first needs them, update costs (``updates.py``) and the attention curve
of its compute dtype, all timed by the rules of ``timing.py`` (Note [quiet timings]).
It is cached as JSON under ``$WEIGHTSTREAM_CACHE_DIR`` (default
``~/.cache/weightstream``) in a file named by a hash of the device name, the torch
version, the thread count and the schema, so another machine, torch or thread
setting measures again, as does a cached profile with a disturbed phase. The software
figures carry a digest of the runtime's sources (``runtime_digest``): when the
runtime changes, or when only they were disturbed, they alone are measured again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import warnings
from pathlib import Path

import torch

from weightstream.common.files import write_text_atomic
from weightstream.compiler import hardware, software, updates
from weightstream.compiler.profile import SCHEMA, MachineProfile, UpdateCost
from weightstream.compiler.timing import (
    FULL,
    QUICK,
    CalmPhases,
    OtherLoad,
    Patience,
    best_curve,
    wait_for_quiet,
)

ENV_CACHE_DIR = "WEIGHTSTREAM_CACHE_DIR"
# The package files whose code the software figures time (Note [fixed costs]).
_RUNTIME_SOURCES = ("runtime", "train", "optim", "amp", "common", "backend.py", "executor.py")
# The in-situ factor is measured over the estimate of the proxy's step: a profile
# calibrated against another estimator is measured again like one of other runtime
# sources (a cached factor of 3.0 from an estimator that priced products
# differently kept pricing every later run).
_ESTIMATOR_SOURCES = (
    "compiler/cost.py",
    "compiler/estimate.py",
    "compiler/operators.py",
    "compiler/profile.py",
    "compiler/software.py",
    "compiler/updates.py",  # how the update costs are timed (Note [update in context])
)
# The phases remeasure_software measures again; another one disturbed: all of them.
_SOFTWARE_PHASES = frozenset({"software", "in_situ"})


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"
    return device.type


def runtime_digest() -> str:
    """A digest of the library sources whose speed the software figures measure, and of
    the estimator the in-situ factor is calibrated against."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in (*_RUNTIME_SOURCES, *_ESTIMATOR_SOURCES):
        path = root / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "weightstream"


def profile_key(device: torch.device | str, quick: bool = False) -> str:
    device = torch.device(device)
    # The schema too: checkouts of different versions sharing one cache directory
    # keep a profile each instead of measuring again over each other's.
    ident = [
        device.type,
        device_name(device),
        torch.__version__,
        torch.get_num_threads(),
        quick,
        SCHEMA,
    ]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def default_path(device: torch.device | str, quick: bool = False) -> Path:
    return default_cache_dir() / f"machine-{profile_key(device, quick)}.json"


# ---- measuring -------------------------------------------------------------------------


def _phases(quick: bool) -> CalmPhases:
    """The phases of one measurement, with the patience of its sizes; not judged where
    other ranks of this run share the host (they measure at the same time and look
    busy to each other: Note [quiet timings])."""
    patience: Patience = (QUICK if quick else FULL).patience
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        patience = dataclasses.replace(patience, judged=False)
    return CalmPhases(patience)


@contextlib.contextmanager
def _private_rng(device: torch.device):
    """Measuring must not move the user's random stream: a forked one, seeded."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        yield


def _warn_disturbed(what: str, then: str) -> None:
    warnings.warn(
        f"weightstream: other processes kept the CPUs busy while {what} was measured, so "
        f"the estimate may be pessimistic; {then} (Note [quiet timings], compiler/timing.py).",
        stacklevel=3,
    )


def measure(
    device: torch.device | str = "cpu", quick: bool = False, disk_dir: str | Path | None = None
) -> MachineProfile:
    """Measure a profile now (no cache). ``disk_dir=None`` skips the disk figures."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes, phases = QUICK if quick else FULL, _phases(quick)
    disk = None if disk_dir is None else Path(disk_dir)
    with _private_rng(device), OtherLoad() as load:
        hw = phases.run(
            "hardware", lambda calm: hardware.measure_hardware(device, sizes, disk, calm)
        )
        fixed = _fixed_costs(device, sizes, hw["copy_bandwidth"], phases)
        # The operators' times less their fixed costs: measured after them.
        hw["op_bandwidth"], hw["attention_curve"] = phases.run(
            "operators", lambda calm: hardware.operator_curves(device, sizes, fixed, calm)
        )
    hw["samples"].update(fixed.pop("samples"))
    profile = MachineProfile(
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        disk_dir=None if disk is None else str(disk),
        runtime_digest=runtime_digest(),
        other_load=load.fraction,
        quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **hw,
        **fixed,
    )
    _measure_in_situ(profile, phases)
    return profile


def remeasure_software(profile: MachineProfile) -> MachineProfile:
    """``profile`` with its software figures measured again (the runtime changed, or
    they were disturbed)."""
    device, phases = torch.device(profile.device), _phases(profile.quick)
    sizes = QUICK if profile.quick else FULL
    with _private_rng(device):
        fixed = _fixed_costs(device, sizes, profile.copy_bandwidth, phases)
    samples = {**profile.samples, **fixed.pop("samples")}
    data = {**profile.to_dict(), **fixed, "samples": samples, "update_costs": {}}
    data.update(runtime_digest=runtime_digest(), in_situ_factor=1.0)
    remeasured = MachineProfile.from_dict(data)
    # The proxy streams through the runtime: its factor is a software figure too.
    _measure_in_situ(remeasured, phases)
    return remeasured


def _fixed_costs(device: torch.device, sizes, link: float, phases: CalmPhases) -> dict:
    return phases.run("software", lambda calm: software.fixed_costs(device, sizes, link, calm))


def _measure_in_situ(profile: MachineProfile, phases: CalmPhases) -> None:
    """``profile.in_situ_factor`` (the proxy is estimated from the other figures, so it
    comes last), then the phases the measurement left disturbed."""
    sizes = QUICK if profile.quick else FULL
    with _private_rng(torch.device(profile.device)):
        profile.in_situ_factor, profile.samples["in_situ"] = phases.run(
            "in_situ", lambda calm: calm(lambda: software.in_situ_factor(profile, sizes))
        )
    profile.disturbed = list(phases.disturbed)
    if profile.disturbed:
        what = f"the machine profile ({', '.join(profile.disturbed)})"
        _warn_disturbed(what, "the next run measures it again")


# ---- the cache --------------------------------------------------------------------------


def _save(profile: MachineProfile, path: str | Path | None) -> None:
    path = Path(path) if path is not None else default_path(profile.device, profile.quick)
    write_text_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=True))


def load(path: str | Path) -> MachineProfile | None:
    """The profile stored at ``path``, or None if absent, unreadable or incomplete."""
    try:
        with open(path) as f:
            return MachineProfile.from_dict(json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        warnings.warn(
            f"weightstream: ignoring the machine profile {str(path)!r} ({exc}); measuring again.",
            stacklevel=3,
        )
        return None


def load_or_measure(
    device: torch.device | str = "cpu",
    path: str | Path | None = None,
    remeasure: bool = False,
    quick: bool = False,
    disk_dir: str | Path | None = None,
) -> MachineProfile:
    """The cached profile of ``device``, measured (and cached) on a miss.

    ``path``: the JSON file (default :func:`default_path`). ``disk_dir``: the
    directory whose disk bandwidth is measured (default: the cache file's
    directory); a cached profile of another directory is a miss. ``quick``:
    tiny sizes (a few milliseconds; for tests), cached under its own key. A
    cached profile measured with other runtime sources, or whose software
    figures alone were disturbed, keeps its hardware figures and measures the
    software ones again; one with other disturbed phases is a miss, unless other
    processes keep the CPUs busy now: then it serves until a quiet run refreshes it.
    """
    device = torch.device(device)
    path = Path(path) if path is not None else default_path(device, quick)
    disk_dir = Path(disk_dir) if disk_dir is not None else path.parent
    if not remeasure:
        cached = load(path)
        if (
            cached is not None
            and cached.device_name == device_name(device)
            and cached.torch_version == torch.__version__
            and cached.num_threads == torch.get_num_threads()
            and cached.quick == quick
            and cached.disk_dir == str(disk_dir)
        ):
            current = cached.runtime_digest == runtime_digest()
            # A disturbed profile is refreshed by the first run that finds the
            # machine quiet; while it is still busy, measuring again would be
            # disturbed too, so the marked profile serves (Note [quiet timings]).
            busy = bool(cached.disturbed) and not wait_for_quiet(0.0)
            if current and (busy or not cached.disturbed):
                return cached
            if busy or _SOFTWARE_PHASES.issuperset(cached.disturbed):
                profile = remeasure_software(cached)
                _save(profile, path)
                return profile
    profile = measure(device, quick=quick, disk_dir=disk_dir)
    _save(profile, path)
    return profile


# ---- figures measured when a run first needs them --------------------------------------


def attention_curve_for(
    profile: MachineProfile, dtype: str, path: str | Path | None = None
) -> None:
    """Measure ``dtype``'s attention curve into ``profile.attention_curves`` if it is not
    there yet (a few seconds; float16 on a CPU, at 3-6 GFLOP/s, takes 30), rewriting
    ``path`` (default: the profile's cache file). Only the dtypes runs compute in
    are measured. float32 has ``attention_curve``. A curve measured while other
    processes kept the CPUs busy is not kept (Note [quiet timings])."""
    if dtype == "float32" or dtype not in profile.matmul_flops or dtype in profile.attention_curves:
        return
    device, sizes = torch.device(profile.device), QUICK if profile.quick else FULL
    fixed = {
        "op_overhead_fwd_s": profile.op_overhead_fwd_s,
        "op_overhead_bwd_s": profile.op_overhead_bwd_s,
        "op_bandwidth": profile.op_bandwidth,
    }
    once = functools.partial(hardware.attention_curve, device, sizes, fixed, getattr(torch, dtype))
    phases = _phases(profile.quick)
    with _private_rng(device):
        try:
            measured = phases.run(
                f"{dtype} attention", lambda calm: best_curve(once, sizes.curve_repeats, calm)
            )
        except (RuntimeError, TypeError):
            measured = {}  # no attention kernel for this dtype here: priced by its products
    if phases.disturbed:
        _warn_disturbed(f"the {dtype} attention curve", "the next run measures it again")
        return
    profile.attention_curves[dtype] = measured
    _save(profile, path)


def update_cost(
    profile: MachineProfile, spec: dict, path: str | Path | None = None
) -> UpdateCost | None:
    """The cost of one optimizer update of ``spec`` (``updates.update_spec``) on this machine.

    Measured the first time (about 0.5 s) and kept in ``profile.update_costs``;
    ``path`` (default: the profile's default cache file) is rewritten with it.
    A cost measured while other processes kept the CPUs busy is used but not kept
    (Note [quiet timings]). None when the optimizer cannot be built from ``spec``
    (the estimate then prices the update by bytes over the host memory
    bandwidth, and says so).
    """
    key = updates.update_key(spec)
    cached = profile.update_costs.get(key)
    if cached is not None:
        return UpdateCost(**cached)
    sizes, phases = QUICK if profile.quick else FULL, _phases(profile.quick)
    try:
        cost = phases.run("update", lambda calm: calm(lambda: updates.measure_update(spec, sizes)))
    except (ValueError, TypeError, RuntimeError) as exc:
        warnings.warn(
            f"weightstream: could not time the optimizer update ({type(exc).__name__}: {exc}); "
            "the estimate prices it by bytes over the host memory bandwidth.",
            stacklevel=2,
        )
        return None
    if phases.disturbed:
        _warn_disturbed("the optimizer update", "the next run measures it again")
        return cost
    profile.update_costs[key] = dataclasses.asdict(cost)
    _save(profile, path)
    return cost

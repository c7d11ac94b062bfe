"""``info`` and ``diff`` of checkpoints (any readable format), one leaf at a time."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightstream.checkpoint.errors import PickleNotAllowedError
from weightstream.checkpoint.opener import open_source
from weightstream.checkpoint.source import LeafInfo
from weightstream.common.units import format_bytes


def info(
    path: str | os.PathLike, *, allow_pickle: bool = False, verify: bool = False
) -> dict[str, Any]:
    """What a checkpoint holds, without reading its data (``verify``: reading every
    leaf back, one at a time).

    Returns a dict with the file's properties (format, format_version,
    library_version, complete, ...), ``file_bytes``, ``num_leaves``,
    ``data_bytes`` (each tied tensor counted once) and ``entries``: one
    :class:`LeafInfo` per leaf (key, kind, shape, dtype, nbytes, storage,
    linked_to). With ``verify``, ``unreadable`` too: (key, the error) for each leaf
    whose data does not read back. ``complete`` is a mark the writer sets once every
    tensor is written; a file cut short after it (a copy stopped part way) keeps the
    mark and loses data, which only a read finds.
    """
    with open_source(path, allow_pickle=allow_pickle, allow_incomplete=True) as source:
        first: dict[Any, str] = {}
        entries: list[LeafInfo] = []
        unreadable: list[tuple[str, str]] = []
        for key in source.keys():
            entry = source.describe(key)
            tie = source.tie(key) if entry.kind == "tensor" else None
            if tie is not None and tie in first and first[tie] != key:
                entry = replace(entry, linked_to=first[tie])
            elif tie is not None:
                first.setdefault(tie, key)
            entries.append(entry)
            if verify and entry.linked_to is None:
                try:
                    source.read(key)  # dropped at once: one leaf in memory at a time
                except PickleNotAllowedError:
                    pass  # readable, and not to be unpickled unasked
                except Exception as exc:
                    unreadable.append((key, f"{type(exc).__name__}: {exc}"))
        result = dict(source.properties())
    if verify:
        result["unreadable"] = unreadable
    result["path"] = str(path)
    result["file_bytes"] = _size(Path(os.fspath(path)))
    result["num_leaves"] = len(entries)
    result["data_bytes"] = sum(e.nbytes for e in entries if e.linked_to is None)
    result["entries"] = entries
    return result


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    if path.name.endswith(".index.json"):
        return sum(p.stat().st_size for p in path.parent.glob("*.safetensors"))
    return path.stat().st_size


def format_info(result: dict[str, Any]) -> str:
    """``info`` as the text the command prints."""
    lines = [f"{result['path']}"]
    for name in ("format", "format_version", "writer", "library_version", "complete", "files"):
        if result.get(name) is not None:
            lines.append(f"  {name}: {result[name]}")
    lines.append(
        f"  leaves: {result['num_leaves']}, data: {format_bytes(result['data_bytes'])}, "
        f"file: {format_bytes(result['file_bytes'])}"
    )
    if "unreadable" in result:
        bad = result["unreadable"]
        lines.append(
            f"  verified: {'every leaf reads back' if not bad else f'{len(bad)} unreadable'}"
        )
        lines += [f"  unreadable {key}: {error}" for key, error in bad[:20]]
        if len(bad) > 20:
            lines.append(f"  ... and {len(bad) - 20} more")
    width = max([len(e.key) for e in result["entries"]] + [3])
    for e in result["entries"]:
        shape = "" if e.shape is None else "x".join(str(d) for d in e.shape) or "scalar"
        extra = f"-> {e.linked_to}" if e.linked_to else e.storage
        lines.append(
            f"  {e.key:<{width}}  {e.kind:<7} {e.dtype or '':<16} {shape:<16} "
            f"{format_bytes(e.nbytes):>10}  {extra}"
        )
    return "\n".join(lines)


@dataclass
class DiffResult:
    """Differences between checkpoints ``a`` and ``b`` (keys in ``a``'s order)."""

    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    kind: list[tuple[str, str, str]] = field(default_factory=list)
    shape: list[tuple[str, Any, Any]] = field(default_factory=list)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)
    values: list[tuple[str, str]] = field(default_factory=list)
    not_compared: list[tuple[str, str]] = field(default_factory=list)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self) if f.name != "same")


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> DiffResult:
    """Compare two checkpoints leaf by leaf (at most two tensors in memory).

    Tensors are equal when bitwise equal (the default), or with ``rtol`` /
    ``atol`` set, when ``torch.allclose`` (NaN equal to NaN).
    """
    result = DiffResult()
    with (
        open_source(a, allow_pickle=allow_pickle) as sa,
        open_source(b, allow_pickle=allow_pickle) as sb,
    ):
        keys_a, keys_b = sa.keys(), sb.keys()
        set_a, set_b = set(keys_a), set(keys_b)
        result.only_in_a = [k for k in keys_a if k not in set_b]
        result.only_in_b = [k for k in keys_b if k not in set_a]
        for key in keys_a:
            if key not in set_b:
                continue
            ia, ib = sa.describe(key), sb.describe(key)
            if ia.kind != ib.kind:
                result.kind.append((key, ia.kind, ib.kind))
                continue
            if ia.kind == "tensor":
                if ia.shape != ib.shape:
                    result.shape.append((key, ia.shape, ib.shape))
                    continue
                if ia.dtype != ib.dtype:
                    result.dtype.append((key, ia.dtype or "", ib.dtype or ""))
                    continue
            try:
                va, vb = sa.read(key), sb.read(key)
            except PickleNotAllowedError:
                result.not_compared.append((key, "pickled value; pass allow_pickle=True"))
                continue
            detail = _difference(va, vb, rtol, atol)
            if detail is None:
                result.same += 1
            else:
                result.values.append((key, detail))
    return result


def _difference(x: Any, y: Any, rtol: float, atol: float) -> str | None:
    """None when equal, else a short description of the difference."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if x.numel() == 0:
            return None
        if rtol == 0 and atol == 0:
            bx = x.detach().contiguous().reshape(-1).view(torch.uint8)
            by = y.detach().contiguous().reshape(-1).view(torch.uint8)
            if torch.equal(bx, by):
                return None
        elif torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return None
        return _tensor_delta(x, y)
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        same = (
            isinstance(x, np.ndarray)
            and isinstance(y, np.ndarray)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.tobytes() == y.tobytes()
        )
        return None if same else "arrays differ"
    if type(x) is not type(y):
        return f"{type(x).__name__} {x!r} vs {type(y).__name__} {y!r}"
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return None
    try:
        equal = bool(x == y)
    except Exception:  # objects whose == is not a bool
        equal = False
    return None if equal else f"{_short(x)} vs {_short(y)}"


def _tensor_delta(x: torch.Tensor, y: torch.Tensor) -> str:
    if x.is_floating_point() or x.is_complex():
        differ = ~((x == y) | (torch.isnan(x) & torch.isnan(y)))
        count = int(differ.sum())
        delta = (x.double() - y.double()).abs() if not x.is_complex() else (x - y).abs()
        finite = delta[torch.isfinite(delta)]
        biggest = float(finite.max()) if finite.numel() else float("nan")
        return f"{count} of {x.numel()} elements differ, max abs difference {biggest:.3g}"
    count = int((x != y).sum())
    return f"{count} of {x.numel()} elements differ"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_diff(result: DiffResult, a: str, b: str) -> str:
    """``diff`` as the text the command prints."""
    if result.identical:
        return f"identical: {result.same} leaves"
    lines = []
    lines += [f"only in {a}: {k}" for k in result.only_in_a]
    lines += [f"only in {b}: {k}" for k in result.only_in_b]
    lines += [f"kind differs: {k}: {x} vs {y}" for k, x, y in result.kind]
    lines += [f"shape differs: {k}: {list(x)} vs {list(y)}" for k, x, y in result.shape]
    lines += [f"dtype differs: {k}: {x} vs {y}" for k, x, y in result.dtype]
    lines += [f"value differs: {k}: {d}" for k, d in result.values]
    lines += [f"not compared: {k}: {d}" for k, d in result.not_compared]
    lines.append(f"{result.same} leaves equal")
    return "\n".join(lines)

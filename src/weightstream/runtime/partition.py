"""Split a model into streaming units: the plan of what is fetched together.

A *slot* is one registration of a parameter on a module (``module._parameters[name]``);
a tied parameter has several slots. A *unit* is a module whose forward window
(from its forward pre-hook to its forward hook) has the device copies of its
parameters swapped into its slots. Every use of a parameter during a forward
must happen inside the window of a unit holding one of its slots (or holding
it as a "foreign" parameter, when a module reads a parameter registered on
another module): that is what the dry-run trace checks.

See Note [streaming units] below for the merge rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.trace import Trace

# Note [streaming units]
# ----------------------
# "auto": walk the module tree from the root. A non-root module that runs
# (was called in the trace, or could be, when there is no trace) and whose
# subtree holds at most unit_size_target bytes of parameters becomes one unit
# covering its whole subtree. Otherwise its own parameters (if any) form a
# "direct" unit and its children are visited. The root never merges, so even a
# small model streams layer by layer. "module": every module that directly owns
# parameters is a direct unit. Parameters registered on modules that never run
# (nn.ParameterList, or a module whose weight is read by its parent) belong to
# the nearest ancestor that runs. A unit whose window encloses another unit's
# window is pinned: it stays resident while its forward runs (the root's own
# parameters, for example). Modules chosen by unit_modules / unit_classes are
# units with their whole subtree under either granularity: their ancestors
# never merge (so "auto" cannot swallow them), and a chosen module inside
# another chosen one is an error.

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass
class Slot:
    module: nn.Module
    name: str
    param: nn.Parameter


@dataclass
class UnitSpec:
    """One streaming unit of the plan."""

    index: int
    name: str  # qualified module name, "" for the root
    module: nn.Module
    slots: list[Slot] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)  # unique, slot order
    foreign: list[nn.Parameter] = field(default_factory=list)  # read, not registered here
    pinned: bool = False  # window encloses other units' windows

    @property
    def display_name(self) -> str:
        return self.name or "<root>"

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class Plan:
    """The units in forward order, and what the plan keeps resident."""

    units: list[UnitSpec]
    traced: bool  # False: built from the module structure only
    trace_error: str | None = None
    # The trace stopped at the model's own check of its inputs (a ValueError or an
    # IndexError: a sequence longer than the model's), which a real step meets too.
    trace_refused: bool = False

    @property
    def largest_unit_bytes(self) -> int:
        return max((u.weight_bytes for u in self.units), default=0)

    @property
    def pinned_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units if u.pinned)

    def weight_bound(self, prefetch_depth: int) -> int:
        """Invariant 2: most weight bytes the device may hold at once.

        (prefetch depth + 1) x the largest unit, plus every pinned unit.
        """
        return (prefetch_depth + 1) * self.largest_unit_bytes + self.pinned_bytes

    def describe(self) -> str:
        lines = [f"{'#':>3}  {'unit':<40} {'params':>12} {'bytes':>12}  notes"]
        first_unit: dict[int, int] = {}  # id(parameter) -> the first unit holding it
        for u in self.units:
            notes = []
            if u.pinned:
                notes.append("pinned while its forward runs")
            if u.foreign:
                notes.append(f"{len(u.foreign)} foreign param(s)")
            # A tied weight is in each unit that uses it, fetched by each: its row counts it
            # again, while a model's parameter count takes it once.
            shared = sorted({first_unit[id(p)] for p in u.params if id(p) in first_unit})
            if shared:
                units = ", ".join(map(str, shared))
                notes.append(f"shares tied weights with unit {units} (counted there too)")
            for p in u.params:
                first_unit.setdefault(id(p), u.index)
            lines.append(
                f"{u.index:>3}  {u.display_name:<40} {u.numel:>12,} {u.weight_bytes:>12,}  "
                + ", ".join(notes)
            )
        return "\n".join(lines)


def _class_matches(module: nn.Module, classes) -> bool:
    for c in classes or ():
        if isinstance(c, str):
            if type(module).__name__ == c:
                return True
        elif isinstance(module, c):
            return True
    return False


def build_plan(model: nn.Module, config: StreamingConfig, trace: Trace | None = None) -> Plan:
    """Partition ``model`` into streaming units (see Note [streaming units])."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=True)}
    parent: dict[int, nn.Module | None] = {id(model): None}
    for m in model.modules():
        for child in m.children():
            parent.setdefault(id(child), m)

    if trace is not None:
        called = trace.called | {id(model)}
    else:
        called = {id(m) for m in model.modules() if not isinstance(m, _CONTAINERS)}

    def runs(m: nn.Module) -> bool:
        return id(m) in called

    def running_ancestor(m: nn.Module) -> nn.Module:
        while not runs(m):
            m = parent[id(m)]
        return m

    # Every slot, attributed to the module that runs when it is used.
    direct: dict[int, list[Slot]] = {}
    for m in model.modules():
        for pname, p in m._parameters.items():
            if p is not None:
                direct.setdefault(id(running_ancestor(m)), []).append(Slot(m, pname, p))

    subtree_bytes: dict[int, int] = {}

    def subtree_params(m: nn.Module) -> dict[int, nn.Parameter]:
        found = {id(s.param): s.param for s in direct.get(id(m), [])}
        for c in m.children():
            found.update(subtree_params(c))
        subtree_bytes[id(m)] = sum(p.numel() * p.element_size() for p in found.values())
        return found

    subtree_params(model)

    explicit = set(config.unit_modules or ())
    unknown = explicit - set(names.values())
    if unknown:
        raise ValueError(
            f"unit_modules names unknown module(s): {', '.join(sorted(unknown))}. "
            "Use qualified names as printed by model.named_modules()."
        )

    def is_forced(m: nn.Module) -> bool:
        return names.get(id(m)) in explicit or _class_matches(m, config.unit_classes)

    # Modules with a chosen unit strictly below them never merge into one unit:
    # the chosen module must stay a unit of its own under every granularity.
    forced_below: dict[int, nn.Module] = {}  # id(ancestor) -> a chosen module below it
    for m in model.modules():
        if is_forced(m):
            a = parent[id(m)]
            while a is not None:
                forced_below.setdefault(id(a), m)
                a = parent[id(a)]

    heads: dict[int, tuple[nn.Module, str]] = {}  # id -> (module, "subtree" | "direct")

    def visit(m: nn.Module, is_root: bool) -> None:
        forced = is_forced(m)
        if forced and id(m) in forced_below:
            inner = forced_below[id(m)]
            raise ValueError(
                f"streaming units conflict: module {names[id(m)] or '<root>'!r} and module "
                f"{names[id(inner)]!r} below it are both chosen as units (unit_modules / "
                "unit_classes), but a unit covers its whole subtree. Choose one of them."
            )
        if forced and not runs(m):
            raise ValueError(
                f"module {names[id(m)] or '<root>'!r} was chosen as a streaming unit but it is "
                "never called in the model's forward; choose a module that runs."
            )
        mergeable = (
            config.granularity == "auto"
            and not is_root
            and runs(m)
            and subtree_bytes[id(m)] <= config.unit_size_target
            and id(m) not in forced_below
        )
        if subtree_bytes[id(m)] > 0 and (forced or mergeable):
            heads[id(m)] = (m, "subtree")
            return
        if direct.get(id(m)):
            heads[id(m)] = (m, "direct")
        for c in m.children():
            visit(c, False)

    visit(model, True)

    def head_of(m: nn.Module) -> nn.Module:
        first = m
        while m is not None:
            h = heads.get(id(m))
            if h is not None and (h[1] == "subtree" or m is first):
                return m
            m = parent[id(m)]
        raise AssertionError("every slot's module is covered by a unit")

    modules_by_id = {id(m): m for m in model.modules()}
    units_by_head: dict[int, UnitSpec] = {}
    for mid, slots in direct.items():
        owner = modules_by_id[mid]
        for s in slots:
            h = head_of(owner)
            u = units_by_head.setdefault(id(h), UnitSpec(0, names[id(h)], h))
            u.slots.append(s)

    if trace is not None:
        _add_foreign_uses(model, trace, units_by_head, names)

    for u in units_by_head.values():
        seen: set[int] = set()
        for p in [s.param for s in u.slots] + u.foreign:
            if id(p) not in seen:
                seen.add(id(p))
                u.params.append(p)

    # Order: first entry in the trace, else module order.
    if trace is not None:
        first_entry: dict[int, int] = {}
        for i, (mid, _) in enumerate(trace.entries):
            first_entry.setdefault(mid, i)
        order = sorted(units_by_head.values(), key=lambda u: first_entry.get(id(u.module), 1 << 30))
    else:
        position = {id(m): i for i, m in enumerate(model.modules())}
        order = sorted(units_by_head.values(), key=lambda u: position[id(u.module)])
    for i, u in enumerate(order):
        u.index = i

    _mark_pinned(model, order, trace, parent)
    return Plan(order, traced=trace is not None)


def _add_foreign_uses(model, trace: Trace, units_by_head: dict, names: dict) -> None:
    """Parameters used outside every window that holds one of their slots."""
    slot_heads: dict[int, set[int]] = {}
    for hid, u in units_by_head.items():
        for s in u.slots:
            slot_heads.setdefault(id(s.param), set()).add(hid)
    modules = {id(m): m for m in model.modules()}
    params = {id(p): p for p in model.parameters()}
    for pid, stacks in trace.uses.items():
        holders = slot_heads.get(pid, set())
        for stack in stacks:
            if holders.intersection(stack):
                continue
            # Innermost open module that is a unit; else the innermost open module.
            target = next((mid for mid in reversed(stack) if mid in units_by_head), None)
            if target is None:
                if not stack:
                    continue  # used outside the model's forward: not streamed
                target = stack[-1]
                units_by_head[target] = UnitSpec(0, names[target], modules[target])
            u = units_by_head[target]
            if all(q is not params[pid] for q in u.foreign):
                u.foreign.append(params[pid])
            holders = holders | {target}
            slot_heads[pid] = holders


def _mark_pinned(model, units: list[UnitSpec], trace: Trace | None, parent: dict) -> None:
    unit_ids = {id(u.module) for u in units}
    if trace is not None:
        enclosing: set[int] = set()
        for mid, stack in trace.entries:
            if mid in unit_ids:
                enclosing.update(s for s in stack if s in unit_ids)
        for u in units:
            u.pinned = id(u.module) in enclosing
        return
    for u in units:
        m = u.module
        u.pinned = any(id(d) in unit_ids for d in m.modules() if d is not m)

"""No run state in module globals (design.md: "keep shared state in explicit context
objects, not module globals"; Note [run context] in weightstream/context.py).

Every module under src/weightstream is read as source (ast: nothing is imported) and
its module-level mutable state is listed:

* a module-level name bound to a mutable value: a dict, list or set display or
  comprehension, or a call of a mutable container's constructor (``dict()``,
  ``defaultdict(...)``, ``collections.*``, ``threading.local()``, ``WeakSet()``,
  ``WeakKeyDictionary()``, ``ContextVar(...)``, a queue ...);
* a ``global`` statement in a function (a module name rebound at run time).

Constant tables are not state: a name in capitals (``_UPPER`` too) bound to a
mutable value that no function of the package mutates (no item assignment or
deletion, no mutating method called on it, here or through ``module.NAME``) is
a table filled at import and only read afterwards. Capital names holding tuples
or frozensets are not even listed (immutable), nor are dunders (``__all__``).

Anything else must be in ``ALLOWED`` with the reason it is not run state; keep
the list short, and move run state into the run context (or an object that owns
it) instead of adding to it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "weightstream"

# (module, name) -> why it is not run state.
ALLOWED: dict[tuple[str, str], str] = {
    ("weightstream.context", "_run"): (
        "the one holder of the current run context (Note [run context]): the run state "
        "itself, rebound only by start_run() and run_configuration()"
    ),
    ("weightstream.data.processors", "DATA_PROCESSORS"): (
        "registry filled at import by the @_register decorators of the module's own "
        "processors; a constant table after import"
    ),
    ("weightstream.data.processors", "_KEYS"): (
        "the keys of each DATA_PROCESSORS entry, filled by the same decorator at import; "
        "a constant table after import"
    ),
    ("weightstream.models.registry", "MODELS"): (
        "registry filled at import by register_model() calls of the zoo's modules; a "
        "constant table after import"
    ),
    ("weightstream.data.processors", "_ENCODED"): (
        "memo of one tokenized corpus keyed by the files' identity (path, mtime, size) and "
        "the settings: a pure function of its key, whatever run asks"
    ),
    ("weightstream.checkpoint.kernel", "_broken"): (
        "the C library functions this kernel lacks (ENOSYS): a fact about the process's "
        "kernel, the same for every run"
    ),
    ("weightstream.common.pages", "_read_mappings"): (
        "the live copy-on-write checkpoint mappings of the process's address space, each "
        "entry removed when its mapping dies (weakref.finalize): mirrors memory, not a run"
    ),
    ("weightstream.data.streaming", "_watch"): (
        "ContextVar set and reset by the `with watching()` block around one input_fn call "
        "(Note [rank share]): scoped to that call and thread, empty outside it"
    ),
    ("weightstream.optim.binding", "_placing"): (
        "ContextVar set and reset by the `with placing_state()` block of one optimizer's "
        "construction (Note [engine binding]): scoped to that call and thread"
    ),
}

# Final names of calls that build a mutable object (module prefix ignored).
MUTABLE_CALLS = frozenset(
    {
        "dict",
        "list",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "ChainMap",
        "UserDict",
        "UserList",
        "local",  # threading.local
        "WeakSet",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "ContextVar",
        "Queue",
        "SimpleQueue",
        "LifoQueue",
        "PriorityQueue",
    }
)
# Methods that change a dict, list, set or deque in place.
MUTATORS = frozenset(
    {
        "append",
        "appendleft",
        "extend",
        "extendleft",
        "insert",
        "add",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "popleft",
        "clear",
        "remove",
        "discard",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
        "set",  # ContextVar.set
        "put",
    }
)
CONSTANT_NAME = re.compile(r"_*[A-Z][A-Z0-9_]*\Z")
DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


@dataclass(frozen=True)
class Finding:
    module: str
    name: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.name}: {self.what}"


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, DISPLAYS):
        return True
    return isinstance(value, ast.Call) and _call_name(value.func) in MUTABLE_CALLS


def _module_statements(body: list[ast.stmt]):
    """Statements run at import: the module's, and those of its top-level if/try/with/for."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield stmt
        for field in ("body", "orelse", "finalbody"):
            yield from _module_statements(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            yield from _module_statements(handler.body)


def _bindings(stmt: ast.stmt):
    """(name, value) pairs a module-level assignment binds."""
    if isinstance(stmt, ast.Assign):
        targets, value = stmt.targets, stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        targets, value = [stmt.target], stmt.value
    else:
        return
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id, value
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                if isinstance(t, ast.Name):
                    yield t.id, v


def _refers_to(node: ast.expr) -> str | None:
    """The name an expression refers to: ``NAME`` or ``module.NAME``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def mutated_in_functions(tree: ast.Module) -> set[str]:
    """Names (or ``x.NAME`` attributes) that code inside functions changes in place."""
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                name = _refers_to(node.value)
            elif isinstance(node, ast.AugAssign):
                name = _refers_to(node.target)
            elif isinstance(node, ast.Attribute) and node.attr in MUTATORS:
                # x.append(...), and a bound mutator handed on (weakref.finalize(d.pop)).
                name = _refers_to(node.value)
            else:
                continue
            if name is not None:
                found.add(name)
    return found


def module_state(source: str, module: str, mutated_elsewhere: frozenset[str] = frozenset()):
    """The findings of one module's source (see the module docstring)."""
    tree = ast.parse(source)
    mutated = mutated_in_functions(tree) | mutated_elsewhere
    findings = []
    for stmt in _module_statements(tree.body):
        for name, value in _bindings(stmt):
            if name.startswith("__") and name.endswith("__"):
                continue
            if not _is_mutable(value):
                continue
            if CONSTANT_NAME.match(name) and name not in mutated:
                continue  # a constant table: filled at import, only read afterwards
            what = "mutable value: " + ast.unparse(value)[:60]
            if CONSTANT_NAME.match(name):
                what = "constant-style name changed by a function: " + ast.unparse(value)[:60]
            findings.append(Finding(module, name, stmt.lineno, what))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                findings.append(Finding(module, name, node.lineno, "global statement"))
    return findings


def _modules() -> dict[str, ast.Module]:
    sources = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        sources[".".join(parts)] = path.read_text()
    return sources


def package_state() -> list[Finding]:
    sources = _modules()
    # A constant table changed from another module (``processors.TABLE[k] = v``).
    everywhere = set()
    for source in sources.values():
        everywhere |= mutated_in_functions(ast.parse(source))
    found = []
    for module, source in sources.items():
        found += module_state(source, module, frozenset(everywhere))
    return found


def test_no_module_level_run_state_outside_the_allow_list():
    findings = package_state()
    unexplained = sorted({str(f) for f in findings if (f.module, f.name) not in ALLOWED})
    assert not unexplained, (
        "module-level mutable state (design.md: keep shared state in explicit context "
        "objects); move run state into the run context (weightstream/context.py) or an "
        "object that owns it, or, if it is not run state, add it to ALLOWED with the "
        "reason:\n" + "\n".join(unexplained)
    )
    stale = sorted(set(ALLOWED) - {(f.module, f.name) for f in findings})
    assert not stale, f"ALLOWED lists what is no longer there; remove: {stale}"


def test_allow_list_stays_short_and_explained():
    assert len(ALLOWED) <= 12, "move run state into the run context instead"
    assert all(len(reason) > 40 for reason in ALLOWED.values())


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("_cache = {}\n", ["_cache"]),
        ("_cache: dict[str, int] = dict()\n", ["_cache"]),
        ("import functools\n_seen = set()\n", ["_seen"]),
        ("from collections import defaultdict\n_by = defaultdict(list)\n", ["_by"]),
        ("import collections\n_recent = collections.deque(maxlen=3)\n", ["_recent"]),
        ("import threading\n_tls = threading.local()\n", ["_tls"]),
        ("import weakref\n_live = weakref.WeakSet()\n", ["_live"]),
        ("_squares = [i * i for i in range(3)]\n", ["_squares"]),
        ("try:\n    _late = {}\nexcept ImportError:\n    pass\n", ["_late"]),
        ("_n = 0\ndef bump():\n    global _n\n    _n += 1\n", ["_n"]),
        # A capital name is a constant only while nothing changes it.
        ("CACHE = {}\ndef remember(k, v):\n    CACHE[k] = v\n", ["CACHE"]),
        ("SEEN = set()\ndef see(x):\n    SEEN.add(x)\n", ["SEEN"]),
        # Not state: constant tables, immutable values, dunders, class and function locals.
        ("TABLE = {'a': 1}\ndef get(k):\n    return TABLE[k]\n", []),
        ("_NAMES = ('a', 'b')\nKEYS = frozenset({'a'})\n", []),
        ("__all__ = ['f']\n", []),
        ("def f():\n    cache = {}\n    cache[1] = 2\n", []),
        ("class C:\n    def __init__(self):\n        self.cache = {}\n", []),
    ],
)
def test_the_checker_flags_module_level_mutable_state(source, flagged):
    assert [f.name for f in module_state(source, "synthetic")] == flagged


def test_a_constant_table_changed_from_another_module_is_state():
    other = "import table\ndef put(k):\n    table.TABLE[k] = 1\n"
    elsewhere = frozenset(mutated_in_functions(ast.parse(other)))
    assert [f.name for f in module_state("TABLE = {}\n", "table", elsewhere)] == ["TABLE"]

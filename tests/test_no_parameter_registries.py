"""No module-level state keyed by parameter id (Note [engine binding]).

The runtime used to be reached through process-wide tables keyed by
``id(param)``; every path now holds its engine explicitly. This scans the
package's source for module-level assignments of mutable mappings and for
module-level tables indexed by ``id(...)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "weightstream"

_MUTABLE_MAPPINGS = {
    "dict",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "defaultdict",
    "OrderedDict",
    "WeakSet",
    "set",
}


def _module_level_tables(tree: ast.Module) -> set[str]:
    """Names bound at module level to a mutable mapping or set."""
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if value is None:
            continue
        mutable = isinstance(value, (ast.Dict, ast.Set, ast.DictComp, ast.SetComp))
        if isinstance(value, ast.Call):
            func = value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            mutable = name in _MUTABLE_MAPPINGS
        if mutable:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _indexed_by_id(tree: ast.Module, tables: set[str]) -> list[str]:
    """Uses like ``TABLE[id(p)]`` / ``TABLE.get(id(p))`` of a module-level table."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            table, key = node.value.id, node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.args
        ):
            table, key = node.func.value.id, node.args[0]
        if (
            key is not None
            and table in tables
            and isinstance(key, ast.Call)
            and getattr(key.func, "id", None) == "id"
        ):
            found.append(f"{table}[id(...)] at line {node.lineno}")
    return found


def test_no_module_level_table_is_keyed_by_parameter_id():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for use in _indexed_by_id(tree, _module_level_tables(tree)):
            offenders.append(f"{path.relative_to(SRC)}: {use}")
    assert offenders == [], offenders


def test_the_scan_finds_such_a_table():
    """The scan itself: the registry this replaced is found."""
    old = (
        "import weakref\n"
        "_updater_of: weakref.WeakValueDictionary = weakref.WeakValueDictionary()\n"
        "def updater_for(p):\n"
        "    return _updater_of.get(id(p))\n"
    )
    tree = ast.parse(old)
    assert _indexed_by_id(tree, _module_level_tables(tree)) == ["_updater_of[id(...)] at line 4"]


def test_no_lower_layer_looks_up_the_runtime():
    """optim, amp and checkpoint reach the engine through the optimizer's binding only."""
    for package in ("optim", "amp", "checkpoint", "data"):
        for path in sorted((SRC / package).rglob("*.py")):
            text = path.read_text()
            assert "weightstream.runtime" not in text, path.relative_to(SRC)

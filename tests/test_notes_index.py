"""The index of Notes in docs/architecture.md is generated from the sources and committed:
it must be current, and every Note referenced must be defined exactly once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "notes_index", ROOT / "scripts" / "notes_index.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_index_is_what_the_sources_give():
    assert _tool().main(["--check"]) == 0, "Fix: python scripts/notes_index.py"


def test_definitions_of_each_form_are_found_and_references_counted(tmp_path):
    (tmp_path / "a.py").write_text(
        '"""Doc.\n\nNote [first]\n------------\nThe first Note. More text.\n"""\n'
        "# Note [second]\n# --------------\n# * Label. The second one, in comments.\n"
    )
    (tmp_path / "b.py").write_text(
        '"""Doc.\n\nNote [third]: a paragraph (with e.g. a stop) that opens. Then more.\n\n'
        'Note [fourth]\n    Indented paragraph here (long enough to be one).\n"""\n'
        "x = 1  # see Note [first] and Note [third]; Note [first] again\n"
    )
    notes = {n.name: n for n in _tool().find_notes(tmp_path)}
    assert {n: (v.form, v.refs) for n, v in notes.items()} == {
        "first": ("A", 2),
        "second": ("A", 0),
        "third": ("C", 1),
        "fourth": ("D", 0),
    }
    # Sentences up to the first that makes 40 characters: a bullet's label is not one.
    assert notes["first"].summary == "The first Note. More text."
    assert notes["second"].summary == "Label. The second one, in comments."
    assert notes["third"].summary == "a paragraph (with e.g. a stop) that opens."


def test_a_reference_to_no_note_or_a_second_definition_fails(tmp_path):
    (tmp_path / "a.py").write_text("# see Note [nowhere]\n")
    with pytest.raises(SystemExit, match="defined nowhere"):
        _tool().find_notes(tmp_path)
    (tmp_path / "a.py").write_text("# Note [twice]\n# -----\n# x.\n# Note [twice]\n# -----\n")
    with pytest.raises(SystemExit, match="defined twice"):
        _tool().find_notes(tmp_path)

"""docs/params.md is generated from the params schema and committed: it must be current."""

from __future__ import annotations

from pathlib import Path

from weightstream.cli import params_doc


def test_params_reference_page_is_generated_and_current():

    page = Path(__file__).resolve().parents[1] / "docs" / "params.md"
    assert page.read_text(encoding="utf-8") == params_doc.render(), (
        "docs/params.md is not current. Fix: python -m weightstream.cli.params_doc"
    )
    assert params_doc.main(["--check", "--path", str(page)]) == 0

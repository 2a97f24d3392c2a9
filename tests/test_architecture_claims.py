"""docs/architecture.md's rules are each checked by a test, and each architecture test is a rule the page states.

The page's table "What the tests check on this page" names, for each claim, the tests that fail when the code breaks
it. This file fails when a named test is gone (the claim would be unchecked), when a test of tests/test_architecture*.py
is named nowhere (a rule the page does not state), or when a layering rule of test_architecture.py is not in the table.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
TESTS = ROOT / "tests"
TITLE = "### What the tests check on this page"


def claims_table(text: str) -> list[tuple[str, list[str]]]:
    """(claim, ["file.py::test_name", ...]) for each row of the page's table of checked claims."""
    if TITLE not in text:
        return []
    section = text.split(TITLE, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) == 2 and cells[0] != "claim":
            rows.append((cells[0], re.findall(r"`([\w./]+\.py::\w+)`", cells[1])))
    return rows


def functions_of(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def missing_checks(text: str) -> list[str]:
    """The page's named checks that are not a test function of tests/ (a claim naming none counts as missing)."""
    missing = []
    for claim, checks in claims_table(text):
        if not checks:
            missing.append(f"(nothing, for {claim[:60]!r})")
        for check in checks:
            file, name = check.split("::")
            if not (TESTS / file).is_file() or name not in functions_of(TESTS / file):
                missing.append(check)
    return missing


def test_every_claim_names_tests_that_exist():
    assert len(claims_table(PAGE.read_text())) >= 20, f"{PAGE}: no table under {TITLE!r}"
    assert missing_checks(PAGE.read_text()) == []


def test_every_architecture_test_is_a_claim_of_the_page():
    named = {check for _, checks in claims_table(PAGE.read_text()) for check in checks}
    unnamed = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_architecture*.py")) if path != Path(__file__)
               for name in sorted(functions_of(path)) if f"{path.name}::{name}" not in named]
    assert not unnamed, f"tests not named in {PAGE.name}'s table {TITLE!r}: {unnamed}"


def test_every_layering_rule_is_stated_on_the_page():
    from test_architecture import RULES

    stated = " ".join(claim for claim, _ in claims_table(PAGE.read_text()))
    assert [rule for rule in RULES if rule not in stated] == []


def test_the_check_sees_a_claim_whose_test_is_gone():
    page = (f"{TITLE}\n\n| claim | checked by |\n|---|---|\n| a rule | `test_architecture.py::test_nothing_like_it` |\n"
            "| a kept rule | `test_architecture.py::test_layering` |\n| an unchecked rule | by reading |\n")
    assert missing_checks(page) == ["test_architecture.py::test_nothing_like_it", "(nothing, for 'an unchecked rule')"]

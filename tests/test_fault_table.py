"""The fault table of docs/run-directory.md ("The tests that hold these faults") names, for each
fault, the test that reproduces it: every test named there exists, so a renamed or deleted test
cannot leave a row that claims a proof it no longer has."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADING = "### The tests that hold these faults"


def table_rows() -> list[str]:
    text = (ROOT / "docs" / "run-directory.md").read_text()
    part = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    return [line for line in part.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_every_fault_row_names_tests_that_exist():
    rows = table_rows()
    assert len(rows) >= 22
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.split(" | ")[-1])
        assert named, f"a row without a test: {row}"
        for path, name in named:
            tree = ast.parse((ROOT / path).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{path} has no test {name} (row: {row[:60]}...)"

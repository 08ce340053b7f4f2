"""The test suite's own shape (CONTRIBUTING.md): a test module only tests, and what tests share is in tests/support.

pytest imports the modules of tests/unit, tests/distributed and tests/e2e (folders without __init__.py) by their
basename, so a second module of the same name stops collection, and `from tests.unit.test_x import y` loads
test_x a second time under another name (its fixtures and module state twice).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TEST_MODULE = re.compile(r"(^|\.)test_\w+(\.|$)")
ROOTLESS = ("unit", "distributed", "e2e")  # no __init__.py: modules are imported by basename


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth, as written (`from x import y` gives x and x.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_module_of_the_suite_imports_a_test_module():
    offenders = {str(path.relative_to(TESTS)): sorted(m for m in imported_modules(path) if TEST_MODULE.search(m))
                 for path in sorted(TESTS.rglob("*.py"))}
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_imported_modules_sees_imports_at_any_depth(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom tests.unit import test_a\n\ndef f():\n    from tests.e2e.test_b import c\n")
    mods = imported_modules(probe)
    assert {"os", "tests.unit.test_a", "tests.e2e.test_b"} <= mods
    assert {m for m in mods if TEST_MODULE.search(m)} == {"tests.unit.test_a", "tests.e2e.test_b",
                                                          "tests.e2e.test_b.c"}


def test_test_module_basenames_are_unique_where_pytest_imports_them_by_basename():
    seen: dict[str, list[str]] = {}
    for folder in ROOTLESS:
        assert not (TESTS / folder / "__init__.py").exists(), folder
        for path in (TESTS / folder).glob("test_*.py"):
            seen.setdefault(path.name, []).append(folder)
    assert {name: folders for name, folders in seen.items() if len(folders) > 1} == {}

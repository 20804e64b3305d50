"""One unit, one job, checked: no class in mxload/ over MAX_CLASS_LINES lines, no function or
method over MAX_FUNCTION_LINES (docstrings and comments count: what a reader reads)."""
from __future__ import annotations

import ast
import pathlib

import pytest

import mxload

pytestmark = pytest.mark.timeout(30)

MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def oversized(source: str, where: str) -> list[str]:
    """'where:line kind name (n lines)' of every class and function in `source` over the limits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", MAX_FUNCTION_LINES
        else:
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > limit:
            found.append(f"{where}:{node.lineno} {kind} {node.name} ({lines} lines, at most {limit})")
    return found


def test_no_class_or_function_in_mxload_is_over_its_size():
    root = pathlib.Path(mxload.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 40, "the walk found mxload's modules"
    found = [hit for path in sources for hit in oversized(path.read_text(), str(path.relative_to(root)))]
    assert not found, "split these (one unit, one job):\n" + "\n".join(found)


def test_the_check_finds_a_planted_oversized_class_and_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    long_function = "def f():\n" + "".join(f"    y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    found = oversized(f"class Big:\n{body}\n{long_function}\ndef g():\n    return 1\n", "planted.py")
    assert found == [f"planted.py:1 class Big ({MAX_CLASS_LINES + 1} lines, at most {MAX_CLASS_LINES})",
                     f"planted.py:{MAX_CLASS_LINES + 3} function f ({MAX_FUNCTION_LINES + 1} lines, at most "
                     f"{MAX_FUNCTION_LINES})"]

"""``store/`` keeps every function at most 50 lines (issue 24's done-criterion).

Read with ``ast`` from the source: a function's lines run from its ``def`` (decorators
excluded) to its last statement, nested functions counted in their parent too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

STORE = Path(__file__).resolve().parents[2] / "ec_s3" / "store"
MAX_LINES = 50


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")


def _all_functions(root: Path) -> Iterator[tuple[str, int]]:
    for path in sorted(root.rglob("*.py")):
        for name, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
            yield f"{path.relative_to(root).with_suffix('')}:{name}", lines


def long_functions(root: Path = STORE) -> dict[str, int]:
    return {name: lines for name, lines in _all_functions(root) if lines > MAX_LINES}


def test_no_store_function_is_over_50_lines() -> None:
    assert long_functions() == {}, f"split these (over {MAX_LINES} lines)"


def test_the_scan_reads_the_store() -> None:
    """An empty answer above means short functions, not a scan that saw none."""
    seen = dict(_all_functions(STORE))
    assert len(seen) > 100 and len({name.split(":")[0] for name in seen}) > 10


def test_the_rule_catches_a_long_function(tmp_path: Path) -> None:
    """A method of 51 lines (nested in a class) is reported with its length; one of
    exactly 50 is not."""
    def method(name: str, statements: int) -> str:
        return f"    def {name}(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(statements))

    (tmp_path / "mod.py").write_text("class C:\n" + method("long", MAX_LINES) + method("short", MAX_LINES - 1))
    assert long_functions(tmp_path) == {"mod:C.long": MAX_LINES + 1}

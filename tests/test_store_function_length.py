"""``store/`` keeps every function at most 50 lines (issue 24's done-criterion).

Read with ``ast`` from the source: a function's lines run from its ``def`` (decorators
excluded) to its last statement, nested functions counted in their parent too.
``ALLOWED`` names the over-long functions that are waiting for their owner's split
(``module:qualified name``); empty it as they land, never add to it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

STORE = Path(__file__).resolve().parents[1] / "ec_s3" / "store"
MAX_LINES = 50
ALLOWED: frozenset[str] = frozenset()


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")


def long_functions() -> dict[str, int]:
    found = {}
    for path in sorted(STORE.rglob("*.py")):
        for name, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
            if lines > MAX_LINES:
                found[f"{path.relative_to(STORE).with_suffix('')}:{name}"] = lines
    return found


def test_no_store_function_is_over_50_lines() -> None:
    over = {name: n for name, n in long_functions().items() if name not in ALLOWED}
    assert not over, f"split these (over {MAX_LINES} lines): {over}"


def test_the_allowlist_holds_only_functions_still_over_the_limit() -> None:
    assert ALLOWED <= set(long_functions()), "remove from ALLOWED what is short now"


def test_the_rule_catches_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    tree = ast.parse(f"class C:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ').rstrip()}\n")
    ((name, node),) = _functions(tree)
    assert name == "C.f" and node.end_lineno - node.lineno + 1 > MAX_LINES  # type: ignore[attr-defined]

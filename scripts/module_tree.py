"""Regenerate the module tree in CONTRIBUTING.md from the modules' own docstrings.

The folder tree is the architecture: each line is a module and the first sentence of
its docstring (what it owns). tests/test_layout.py fails when CONTRIBUTING.md's tree
is out of date; run this to fix it:

    .venv/bin/python scripts/module_tree.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ec_s3"
START, END = "<!-- tree:start -->", "<!-- tree:end -->"
WIDTH = 30


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = (match.group(1) if match else text).rstrip(".").replace("``", "")
    sentence = re.sub(r":[a-z]+:`~?\.?([^`]+)`", r"\1", sentence)  # Sphinx roles read as plain names
    return sentence if len(sentence) <= 96 else sentence[:95].rsplit(" ", 1)[0] + " …"


def tree() -> str:
    lines = ["ec_s3/"]
    top = sorted(p for p in PKG.glob("*.py"))
    packages = sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    for path in top:
        lines.append(f"  {path.name:<{WIDTH}}{first_sentence(path)}")
    for pkg in packages:
        lines.append(f"  {pkg.name + '/':<{WIDTH}}{first_sentence(pkg / '__init__.py')}")
        for path in sorted(pkg.glob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            lines.append(f"    {path.name:<{WIDTH - 2}}{first_sentence(path)}")
    return "\n".join(lines)


def block() -> str:
    return f"{START}\n```\n{tree()}\n```\n{END}"


def main() -> None:
    doc = ROOT / "CONTRIBUTING.md"
    text = doc.read_text()
    start, end = text.index(START), text.index(END) + len(END)
    doc.write_text(text[:start] + block() + text[end:])
    print(f"wrote the module tree ({tree().count(chr(10)) + 1} lines) to {doc}")


if __name__ == "__main__":
    main()

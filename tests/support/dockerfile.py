"""deploy/Dockerfile read as its stages (tests/deploy/test_deploy.py, tests/test_packaging.py)."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile"


def dockerfile_stages(text: str) -> dict[str, list[str]]:
    """The Dockerfile's stages by name, each its instructions (continuations joined)."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [])
        current.append(line)
    return stages

"""Regenerate the configuration table in docs/config.md from ec_s3.config (the single
source of every key's type, default and meaning). tests/test_config.py fails when the
table there differs from this one; run this to fix it:

    .venv/bin/python scripts/config_table.py
"""

from __future__ import annotations

from pathlib import Path

from ec_s3.config import config_keys

HEADER = "| key | default | meaning |"
DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def table() -> str:
    rows = [HEADER, "|---|---|---|"] + [f"| `{k}` | `{d}` | {doc} |" for k, d, doc in config_keys()]
    return "\n".join(rows)


def main() -> None:
    text = DOC.read_text()
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    end = len(text) if end == -1 else end
    DOC.write_text(text[:start] + table() + text[end:])
    print(f"wrote {len(config_keys())} keys to {DOC}")


if __name__ == "__main__":
    main()

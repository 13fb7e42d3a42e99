"""Regenerate the configuration table in README.md from ec_s3.config (the single
source of every key's type, default and meaning). tests/test_config.py fails when a
key is missing from the README; run this to fix it:

    .venv/bin/python scripts/readme_config_table.py
"""

from __future__ import annotations

from pathlib import Path

from ec_s3.config import config_keys

HEADER = "| key | default | meaning |"


def main() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    rows = [HEADER, "|---|---|---|"] + [f"| `{k}` | `{d}` | {doc} |" for k, d, doc in config_keys()]
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    end = len(text) if end == -1 else end
    readme.write_text(text[:start] + "\n".join(rows) + text[end:])
    print(f"wrote {len(rows) - 2} keys to {readme}")


if __name__ == "__main__":
    main()

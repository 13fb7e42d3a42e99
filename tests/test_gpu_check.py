"""bench/gpu_check.py (``python -m bench.gpu_check``) is run on a GPU host that has
neither vLLM nor a registry, by whoever is lent one: it must not rot between those
sessions. Its CPU dry run on a simulated bare host goes through the same ec-s3 code
(publisher, codec, staging, the worker's staged load) with the CUDA branches off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_a_bare_host(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run-cpu", "--quick", "--simulate-bare-host",
         "--no-plot", "--out-dir", str(tmp_path), "--sizes-mib", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert result["problems"] == [] and result["exit_code"] == 0
    assert result["round_trips"] and all(r["bit_exact"] for r in result["round_trips"])
    assert result["imports"]["vllm_imported"] is False

"""bench/run_all.py renders only results as current as the code they measured: a result
records the sha256 of each file it measured (bench/benchlib.py), and the renderer
leaves out, names and fails on any result whose files have changed since."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import benchlib as bl
from bench import run_all

REPO = Path(__file__).resolve().parents[2]
# A bench's result, written as a bench writes it: by a process that loaded ec-s3 code.
WRITE = ("import sys, pathlib, ec_s3.blob.codec\n"
         "from bench import benchlib as bl\n"
         "bl.write_json('gil', {'params': {'quick': True}, 'sizes': []}, pathlib.Path(sys.argv[1]))\n")


def _write_result(out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", WRITE, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "gil.json").read_text())


def test_a_result_records_the_ec_s3_code_it_loaded_and_renders_while_that_code_is_unchanged(tmp_path: Path) -> None:
    d = _write_result(tmp_path)
    assert d["sources"]["ec_s3/blob/codec.py"] == bl.file_sha256(REPO / "ec_s3/blob/codec.py")
    assert "bench/benchlib.py" not in d["sources"]  # the harness: its edits change no measurement
    c = run_all.collect(tmp_path, ["gil"])
    assert c["refused"] == [] and len(c["shown"]) == 1


def test_a_result_older_than_a_file_it_measured_is_refused_and_the_render_fails(tmp_path: Path) -> None:
    d = _write_result(tmp_path)
    d["sources"]["ec_s3/blob/codec.py"] = "0" * 16  # as if codec.py changed after the run
    (tmp_path / "gil.json").write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, "-m", "bench.run_all", "--summary-only", "--out-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "stale: gil.json is older than ec_s3/blob/codec.py" in proc.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "stale: gil.json is older than ec_s3/blob/codec.py" in summary and "4. GIL" not in summary


def test_a_result_without_hashes_or_whose_file_is_gone_is_stale() -> None:
    assert run_all.stale("x", {}) == ["stale: x.json records no source hashes (written before bench/benchlib.py "
                                      "recorded them)"]
    assert run_all.stale("x", {"sources": {"ec_s3/gone.py": "0" * 16}}) == [
        "stale: x.json measured ec_s3/gone.py, which is gone"]


def test_importing_every_bench_leaves_the_environment_alone() -> None:
    """run_all's render imports each bench for its rows; a bench that set its env at
    import (VLLM_LOGGING_LEVEL=WARNING) changed the test process's environment, and
    every vLLM server a later test started lost its INFO lines (test_signals failed on
    CI for a log line it waits for). Failed before: VLLM_LOGGING_LEVEL was set."""
    code = ("import importlib, os\n"
            "before = dict(os.environ)\n"
            "from bench import run_all\n"
            "for name in run_all.BENCHES:\n"
            "    importlib.import_module(f'bench.{name}')\n"
            "after = dict(os.environ)\n"
            "print(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"

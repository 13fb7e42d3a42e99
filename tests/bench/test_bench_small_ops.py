"""bench/small_ops.py: ratios pair each ec-s3 repeat with obstore's of the same repeat,
and a short real run against SeaweedFS measures every operation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import small_ops as so

REPO = Path(__file__).resolve().parents[2]


def _rep(cpu: float, wall: float) -> dict[str, dict[str, float]]:
    return {op: {"client_cpu_ms": cpu, "wall_ms": wall, "server_cpu_ms": 0.1} for op in so.OPS}


def test_ratios_are_per_repeat_medians_against_obstore() -> None:
    # Repeat 1 ran on a busy host (everything 3x): per-repeat ratios stay 1.5x, a ratio of
    # medians would not.
    runs = {"8": {"ec-s3": [_rep(0.6, 1.0), _rep(1.8, 3.0), _rep(0.6, 1.0)],
                  "obstore": [_rep(0.4, 1.0), _rep(1.2, 3.0), _rep(0.4, 2.0)]}}
    s = so.summarize(runs)
    e = s["8"]["ec-s3"]["put"]
    assert e["client_cpu_ms"] == pytest.approx(0.6) and e["client_cpu_ms_vs_obstore"] == pytest.approx(1.5)
    assert e["wall_ms_vs_obstore"] == pytest.approx(1.0)
    assert "client_cpu_ms_vs_obstore" not in s["8"]["obstore"]["put"]
    row, sig = so.measurement_rows({"blob_bytes": 16 * 1024 + 200, "summary": s,
                                    "signing": {"ec_s3_ms": 0.02, "botocore_ms": 0.08}})
    assert row[1] == "16 KiB x8" and row[2] == "1.50x (0.60 ms), 1.50x (0.60 ms), 1.50x (0.60 ms)"
    assert sig[2] == "0.25x (0.020 vs 0.080 ms)"
    assert so.measurement_rows(None) == [] and so.measurement_rows({"summary": {}}) == []


@pytest.mark.timeout(300)
def test_a_short_run_measures_every_operation(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.small_ops", "--ops", "12", "--repeats", "1",
                          "--concurrency", "2", "--out-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads((tmp_path / "small_ops.json").read_text())
    assert d["blob_bytes"] > 16 * 1024
    for op in so.OPS:
        e = d["summary"]["2"]["ec-s3"][op]
        assert e["client_cpu_ms"] > 0 and e["wall_ms"] > 0, (op, e)
    assert 0 < d["signing"]["ec_s3_ms"] and 0 < d["signing"]["botocore_ms"]

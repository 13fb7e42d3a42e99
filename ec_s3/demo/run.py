"""``ec-s3 demo``: encode / prefill-decode disaggregation through S3, end to end, checked.

What it does (about two minutes on a 2-core CPU host, nothing to download):

1. S3: starts an embedded SeaweedFS on loopback (or uses ``--endpoint-url``), makes the
   bucket, and uses a fresh key prefix for this run.
2. Model: builds the tiny offline LLaVA of :mod:`ec_s3.sandbox.tiny_model` (random weights) in a
   cache dir, or uses ``--model``.
3. Baseline: one plain vLLM server (no EC connector at all) answers the demo's chat
   requests; it is stopped before the next phase.
4. EPD: an encoder server (``ec_producer``), a prefill/decode server (``ec_consumer``)
   and the ec-s3 proxy in front of them answer the same requests, in the same order
   and concurrency.
5. Summary: per request the latency and where the image was encoded, what moved
   through the bucket, the connector's lookups / waits / fallbacks (from the servers'
   ``/metrics``), and whether every answer equals the baseline's (token ids and
   logprobs at temperature 0). Exit status 0 only if they all do.

Why the baseline runs on its own server, before the EPD servers: the consumer looks
every image up in the bucket (``lookup: always``), so it can never produce a
"non-disaggregated" answer once the encoder has published; a server without any
``ec_transfer_config`` can. Running it in its own phase keeps at most two engines
alive at once (memory on a CPU host, GPU memory with ``--model``) for one extra
engine load, and running it first means a broken model fails fast and
``--keep-running`` can leave the EPD stack up at the end.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import io
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.sandbox.vllm_server import (
    CPU_OFFLINE_ENV,
    TINY_MODEL_ARGS,
    LoadProgress,
    MetricSamples,
    ServerError,
    VllmServer,
    ec_transfer_config,
    scrape_metrics,
    stop_all,
    wait_all_ready,
)

__all__ = [
    "ChatResult",
    "DemoRequest",
    "build_parser",
    "chat_body",
    "compare_results",
    "default_schedule",
    "image_data_url",
    "main",
    "post_chat",
    "run_schedule",
]

QUESTIONS = ("What is in this picture?", "Describe the image in one sentence.")
DEFAULT_BUCKET = "ec-s3-demo"
DEFAULT_MAX_TOKENS = 8
WARMUP_SEED = 0  # the image of each phase's warm-up request (not in the schedule)

# Metric families of the connector (vLLM prefixes them with "vllm:"). Absent ones print n/a.
M = "vllm:ec_s3_"
M_UPLOADED, M_UPLOADED_BYTES = M + "blobs_uploaded_total", M + "bytes_uploaded_total"
M_DOWNLOADED, M_DOWNLOADED_BYTES = M + "blobs_downloaded_total", M + "bytes_downloaded_total"
M_LOADED, M_LOOKUPS = M + "blobs_loaded_total", M + "lookups_total"
M_FALLBACKS, M_UNAVAILABLE = M + "fallbacks_local_total", M + "requests_unavailable_total"
M_INVALID, M_UPLOAD_FAILURES, M_RETRIES = M + "invalid_blobs_total", M + "upload_failures_total", M + "retries_total"
M_UPLOAD_S, M_DOWNLOAD_S = M + "upload_seconds", M + "download_seconds"
P = "ec_s3_proxy_"


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class DemoRequest:
    """One chat request of the schedule: an image (by seed) and a question."""

    index: int  # 1-based, stable across phases
    step: int  # requests of one step are sent concurrently, steps one after another
    image_seed: int
    question: str

    @property
    def image_label(self) -> str:
        return f"img-{self.image_seed}"


def default_schedule(seeds: Sequence[int] = (1, 2, 3, 4)) -> list[list[DemoRequest]]:
    """6 requests over 4 images: two alone, two at once, then the first two images again
    with the other question (the consumer already holds those encoder outputs)."""
    a, b, c, d = seeds
    plan = [[(a, 0)], [(b, 1)], [(c, 0), (d, 1)], [(a, 1)], [(b, 0)]]
    schedule: list[list[DemoRequest]] = []
    n = 0
    for step, reqs in enumerate(plan, 1):
        row = []
        for seed, q in reqs:
            n += 1
            row.append(DemoRequest(n, step, seed, QUESTIONS[q]))
        schedule.append(row)
    return schedule


@functools.lru_cache(maxsize=64)
def image_data_url(seed: int) -> str:
    """A ``data:`` URL of the PNG of :func:`ec_s3.tiny_model.make_test_image` (seed)."""
    from ec_s3.sandbox.tiny_model import make_test_image

    buf = io.BytesIO()
    make_test_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def chat_body(model: str, image_seed: int, question: str, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, Any]:
    """A greedy OpenAI chat request with one image whose answer carries token ids and
    their logprobs (vLLM's ``return_tokens_as_token_ids``)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(image_seed)}},
            {"type": "text", "text": question},
        ]}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }


@dataclass
class ChatResult:
    """What came back for one chat request."""

    status: int
    latency_s: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def post_chat(base_url: str, body: Mapping[str, Any], *, timeout: float = 180.0,
              request_id: str | None = None) -> ChatResult:
    """POST ``/v1/chat/completions``; never raises for HTTP or connection errors."""
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(f"{base_url.rstrip('/')}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our servers
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read() if exc.fp is not None else b""
        return ChatResult(int(exc.code), time.monotonic() - started, error=raw.decode("utf-8", "replace")[:300])
    except (OSError, ValueError) as exc:
        return ChatResult(0, time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")
    latency = time.monotonic() - started
    try:
        payload = json.loads(raw)
        choice = payload["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        token_ids = [int(str(t["token"]).split(":", 1)[1]) for t in content]
        logprobs = [float(t["logprob"]) for t in content]
        text = (choice.get("message") or {}).get("content") or ""
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return ChatResult(status, latency, error=f"unexpected answer ({type(exc).__name__}: {exc})")
    return ChatResult(status, latency, token_ids, logprobs, text)


def compare_results(got: ChatResult, want: ChatResult, tolerance: float = 0.0) -> tuple[bool, str]:
    """(equal, one-word verdict): equal token ids and logprobs within ``tolerance``."""
    if not got.ok or not want.ok:
        return False, "error"
    if got.token_ids != want.token_ids:
        return False, "DIFFERENT tokens"
    if len(got.logprobs) != len(want.logprobs):
        return False, "DIFFERENT logprobs"
    diff = max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)), default=0.0)
    if diff == 0.0:
        return True, "identical"
    if diff <= tolerance:
        return True, f"equal (max |dlogprob| {diff:.1e})"
    return False, f"DIFFERENT logprobs (max |d| {diff:.1e})"


def run_schedule(
    base_url: str,
    model: str,
    schedule: Sequence[Sequence[DemoRequest]],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout: float = 180.0,
    id_prefix: str = "ec-s3-demo",
    after_step: Callable[[int, list[DemoRequest]], None] | None = None,
) -> dict[int, ChatResult]:
    """Send the schedule to ``base_url`` (steps in order, a step's requests at once);
    ``after_step(step, requests)`` runs when a step's answers are all in."""
    results: dict[int, ChatResult] = {}
    run_id = secrets.token_hex(3)
    with ThreadPoolExecutor(max_workers=max((len(s) for s in schedule), default=1)) as pool:
        for reqs in schedule:
            futures = {
                r.index: pool.submit(post_chat, base_url, chat_body(model, r.image_seed, r.question,
                                                                    max_tokens=max_tokens),
                                     timeout=timeout, request_id=f"{id_prefix}-{run_id}-{r.index}")
                for r in reqs
            }
            for index, fut in futures.items():
                results[index] = fut.result()
            if after_step is not None and reqs:
                after_step(reqs[0].step, list(reqs))
    return results


# --------------------------------------------------------------------------- metrics
@dataclass
class _Snapshot:
    producer: MetricSamples
    consumer: MetricSamples
    proxy: MetricSamples
    blobs: frozenset[str] | None = None  # blob keys under the run's prefix (bucket listing)


def _delta(after: MetricSamples, before: MetricSamples, name: str, **labels: str) -> float | None:
    a = after.get(name, **labels)
    if a is None:
        return None
    return a - (before.get(name, **labels) or 0.0)


def _fmt_num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:g}"


def _fmt_bytes(v: float | None) -> str:
    if v is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def _settle(scrape: Callable[[], _Snapshot], wait_s: float = 1.5, every_s: float = 0.25) -> _Snapshot:
    """Scrape until two reads agree (stats reach /metrics with the engine's next output)."""
    deadline = time.monotonic() + wait_s
    snap = scrape()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        nxt = scrape()
        if all(_only_counters(getattr(nxt, r)).samples == _only_counters(getattr(snap, r)).samples
               for r in ("producer", "consumer")):
            return nxt
        snap = nxt
    return snap


_COUNTER_NAMES = frozenset({M_UPLOADED, M_DOWNLOADED, M_LOADED, M_LOOKUPS, M_FALLBACKS, M_UNAVAILABLE, M_INVALID})


def _only_counters(m: MetricSamples) -> MetricSamples:
    """The connector counters only (other vLLM families change on every scrape)."""
    return MetricSamples(tuple(s for s in m.samples if s[0] in _COUNTER_NAMES), ok=m.ok)


# --------------------------------------------------------------------------- output
class _Out:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.t0 = time.monotonic()

    def __call__(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ec-s3 demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run encode / prefill-decode disaggregation through S3 end to end: an encoder vLLM\n"
            "server publishes image encoder outputs to a bucket, a prefill/decode server loads\n"
            "them instead of encoding, the ec-s3 proxy routes between them; every answer is\n"
            "compared with a plain (non-disaggregated) vLLM server. Exit 0 only if all match.\n"
            "\n"
            "Without options everything is local: an embedded SeaweedFS S3 server and a tiny\n"
            "offline LLaVA with random weights (about 2 minutes on a 2-core CPU)."
        ),
        epilog=(
            "S3: with --endpoint-url the credentials come from the standard AWS chain\n"
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...); they are passed to the\n"
            "servers through the environment, never on a command line. Each run writes under a\n"
            "fresh prefix and deletes its blobs at the end (--keep-blobs keeps them).\n"
            "\n"
            "--model: the encoder and prefill/decode servers run at the same time, so on one GPU\n"
            "give each a share, e.g. --vllm-arg=--gpu-memory-utilization=0.4 (use the = form, or\n"
            "quote several: --vllm-arg='--max-model-len 4096 --enforce-eager')."
        ),
    )
    s3 = p.add_argument_group("S3")
    s3.add_argument("--endpoint-url", default=os.environ.get("EC_S3_ENDPOINT_URL"),
                    help="S3/MinIO endpoint (default $EC_S3_ENDPOINT_URL; unset: start an embedded SeaweedFS)")
    s3.add_argument("--bucket", default=None,
                    help=f"bucket, created if missing (default $EC_S3_BUCKET or {DEFAULT_BUCKET})")
    s3.add_argument("--prefix", default=None,
                    help="key prefix for the blobs (default ec-s3-demo/<run id>: a fresh one per run)")
    s3.add_argument("--extra-config", default=None, metavar="JSON",
                    help='more ec_connector_extra_config keys, e.g. \'{"region": "eu-west-1"}\'')
    s3.add_argument("--keep-blobs", action="store_true", help="do not delete this run's blobs at the end")
    m = p.add_argument_group("model and servers")
    m.add_argument("--model", default=None,
                   help="model dir or id to serve instead of the tiny LLaVA (uses your vLLM and GPU)")
    m.add_argument("--tiny-model-dir", type=Path, default=None,
                   help="where the tiny LLaVA is built/reused (default $XDG_CACHE_HOME/ec-s3/tiny-llava)")
    m.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument(s) for every vLLM server (repeatable, shell-split)")
    m.add_argument("--load-timeout", type=float, default=600.0, metavar="S",
                   help="how long the servers may take to load (default 600)")
    m.add_argument("--log-dir", type=Path, default=None,
                   help="server logs (default: a temp dir, removed after a successful run)")
    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"per answer (default {DEFAULT_MAX_TOKENS})")
    r.add_argument("--logprob-tolerance", type=float, default=0.0, metavar="X",
                   help="largest |logprob difference| still counted as a match (default 0: identical)")
    r.add_argument("--request-timeout", type=float, default=180.0, metavar="S", help="per request (default 180)")
    p.add_argument("--keep-running", action="store_true",
                   help="leave the encoder, prefill/decode and proxy running after the summary (Ctrl-C stops)")
    return p


def _cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME")
    return Path(base) if base else Path.home() / ".cache"


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM / SIGHUP raise KeyboardInterrupt like Ctrl-C, so that every ``finally``
    (servers, proxy, S3) runs; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, h)


def main(argv: list[str] | None = None) -> int:
    """``ec-s3 demo``; returns 0 only if every disaggregated answer equals the baseline's."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    extra: dict[str, Any] = {}
    if args.extra_config:
        try:
            extra = json.loads(args.extra_config)
            if not isinstance(extra, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            parser.print_usage(sys.stderr)
            print(f"ec-s3 demo: error: --extra-config: {exc}", file=sys.stderr)
            return 2
    out = _Out(sys.stdout)
    try:
        with _signals_interrupt():
            return _Demo(args, extra, out).run()
    except KeyboardInterrupt:
        out("\nec-s3 demo: interrupted; every server it started has been stopped")
        return 130


class _Demo:
    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], out: _Out) -> None:
        self.args = args
        self.extra = extra
        self.out = out
        self.schedule = default_schedule()
        self.requests = [r for step in self.schedule for r in step]
        self.timings: dict[str, float] = {}
        self.vllm_args = [a for raw in args.vllm_arg for a in shlex.split(raw)]

    # ------------------------------------------------------------------ phases
    def run(self) -> int:
        out, args = self.out, self.args
        out("ec-s3 demo: encoder -> S3 -> prefill/decode, checked against a plain vLLM server")
        with contextlib.ExitStack() as stack:
            log_dir = self._log_dir()
            try:
                store, extra_config, env = self._s3(stack)
                model, server_args, server_env = self._model()
                env = {**server_env, **env}
                baseline = self._baseline(model, server_args, env, log_dir)
                if baseline is None:
                    return self._fail(log_dir)
                results, snaps, final, servers, proxy = self._epd(
                    stack, store, model, server_args, env, extra_config, log_dir)
                blobs = self._list_blobs(store, extra_config["prefix"])
                if not args.keep_running:
                    t = time.monotonic()
                    stop_all(servers)
                    proxy.stop()
                    self.timings["shutdown"] = time.monotonic() - t
                ok = self._summary(baseline, results, snaps, final, blobs, extra_config["prefix"])
                if args.keep_running and all(s.is_running() for s in servers):
                    self._keep_running(servers, proxy, model)
                if not args.keep_blobs:
                    self._delete_blobs(store, extra_config["prefix"])
            except ServerError as exc:
                out(f"\nec-s3 demo: FAILED: {exc}")
                return self._fail(log_dir)
            except Exception as exc:  # noqa: BLE001 - S3 setup errors get a message, not a traceback
                from ec_s3.config import ConfigError
                from ec_s3.sandbox.embedded_s3 import EmbeddedS3Error
                from ec_s3.store.client import StoreError

                if not isinstance(exc, (ConfigError, EmbeddedS3Error, StoreError)):
                    raise
                hint = ("pass --endpoint-url (and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) for your own S3"
                        if isinstance(exc, EmbeddedS3Error)
                        else "check the endpoint, bucket and credentials with `ec-s3 check`")
                out(f"\nec-s3 demo: FAILED: {type(exc).__name__}: {exc}\n  fix: {hint}")
                return self._fail(log_dir)
            if ok and args.log_dir is None:
                shutil.rmtree(log_dir, ignore_errors=True)
            elif not ok:
                out(f"  server logs: {log_dir}")
            return 0 if ok else 1

    def _fail(self, log_dir: Path) -> int:
        if any(log_dir.iterdir()):
            self.out(f"  server logs: {log_dir}")
        elif self.args.log_dir is None:
            with contextlib.suppress(OSError):
                log_dir.rmdir()
        return 1

    def _log_dir(self) -> Path:
        if self.args.log_dir is not None:
            self.args.log_dir.mkdir(parents=True, exist_ok=True)
            return self.args.log_dir
        return Path(tempfile.mkdtemp(prefix="ec-s3-demo-logs-"))

    def _step(self, n: int, text: str) -> None:
        self.out(f"\n[{n}/5] {text}")

    def _s3(self, stack: contextlib.ExitStack) -> tuple[Any, dict[str, Any], dict[str, str]]:
        """(store for listing, the servers' ec_connector_extra_config, their env)."""
        from ec_s3.config import ECS3Config
        from ec_s3.store.client import S3Store

        args, out = self.args, self.out
        t = time.monotonic()
        bucket = args.bucket or os.environ.get("EC_S3_BUCKET") or DEFAULT_BUCKET
        prefix = args.prefix or f"ec-s3-demo/{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        env: dict[str, str] = {}
        store_extra: dict[str, Any] = {}
        if args.endpoint_url:
            endpoint, where = args.endpoint_url, f"S3 endpoint {args.endpoint_url}"
        else:
            from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server

            self._step(1, "S3: starting an embedded SeaweedFS server on loopback")
            server = EmbeddedS3Server()
            stack.callback(server.stop)
            server.start()
            endpoint, where = server.endpoint_url, f"embedded SeaweedFS at {server.endpoint_url}"
            creds = server.credentials
            # Servers get them in their environment; this process in its own config.
            env = {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
            store_extra = {"access_key_id": creds.access_key_id, "secret_access_key": creds.secret_access_key}
        if args.endpoint_url:
            self._step(1, f"S3: using {where}")
        extra_config = {**self.extra, "bucket": bucket, "endpoint_url": endpoint, "prefix": prefix}
        config = ECS3Config.from_extra_config({**extra_config, **store_extra})
        store = S3Store(config)
        stack.callback(store.close, 5.0)
        store.run(store.create_bucket_async(), timeout=60)
        self.timings["s3"] = time.monotonic() - t
        out(f"      {where}; bucket {bucket}, prefix {prefix} ({self.timings['s3']:.1f} s)")
        return store, extra_config, env

    def _model(self) -> tuple[str, list[str], dict[str, str]]:
        args, out = self.args, self.out
        t = time.monotonic()
        if args.model:
            self._step(2, f"model: {args.model} (your vLLM install and device)")
            self.timings["model"] = 0.0
            return str(args.model), list(self.vllm_args), {}
        from ec_s3.sandbox.tiny_model import build_tiny_llava, read_manifest

        dst = args.tiny_model_dir or _cache_home() / "ec-s3" / "tiny-llava"
        self._step(2, "model: tiny offline LLaVA-1.5 (random weights; outputs are gibberish, but exact)")
        had = read_manifest(dst) is not None
        path = build_tiny_llava(Path(dst))
        self.timings["model"] = time.monotonic() - t
        out(f"      {path} ({'reused' if had else 'built'} in {self.timings['model']:.1f} s)")
        return str(path), [*TINY_MODEL_ARGS, *self.vllm_args], dict(CPU_OFFLINE_ENV)

    def _baseline(self, model: str, server_args: list[str], env: dict[str, str],
                  log_dir: Path) -> dict[int, ChatResult] | None:
        out = self.out
        t = time.monotonic()
        self._step(3, "baseline: one plain vLLM server (no EC connector), the same requests")
        # No ec_transfer_config and no S3 credentials: this server cannot touch the bucket.
        server = VllmServer(model, name="baseline", args=server_args,
                            env={**env, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
                            log_path=log_dir / "baseline.log")
        with server:
            wait_all_ready([server], self.args.load_timeout, progress=LoadProgress())
            warm = self._warm_up(server.url, model)
            t_req = time.monotonic()
            results = run_schedule(server.url, model, self.schedule, max_tokens=self.args.max_tokens,
                                   timeout=self.args.request_timeout, id_prefix="baseline")
            self.timings["baseline_requests"] = time.monotonic() - t_req
        self.timings["baseline"] = time.monotonic() - t
        bad = [i for i, r in results.items() if not r.ok]
        out(f"      warm-up request {warm.latency_s:.1f} s; {len(results)} requests in "
            f"{self.timings['baseline_requests']:.2f} s; server stopped ({self.timings['baseline']:.0f} s for the phase)")
        if bad:
            for i in bad:
                out(f"      request {i} failed: HTTP {results[i].status}: {results[i].error}")
            return None
        return results

    def _warm_up(self, url: str, model: str) -> ChatResult:
        """One request with an image outside the schedule: the first image request of a
        fresh server is seconds slower (processor and encoder warm-up), which would
        otherwise land on whichever request comes first. Its counts are excluded."""
        result = post_chat(url, chat_body(model, WARMUP_SEED, QUESTIONS[0], max_tokens=self.args.max_tokens),
                           timeout=self.args.request_timeout, request_id=f"warm-up-{secrets.token_hex(3)}")
        if not result.ok:
            raise ServerError(f"the warm-up request to {url} failed: HTTP {result.status}: {result.error}")
        return result

    def _nudge(self, url: str, model: str) -> None:
        """A text-only request, so that an engine runs one more step (and reports stats)."""
        post_chat(url, {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                        "max_tokens": 1, "temperature": 0.0}, timeout=self.args.request_timeout)

    def _epd(self, stack: contextlib.ExitStack, store: Any, model: str, server_args: list[str],
             env: dict[str, str], extra_config: dict[str, Any], log_dir: Path,
             ) -> tuple[dict[int, ChatResult], dict[int, _Snapshot], _Snapshot, list[VllmServer], Any]:
        from ec_s3.proxy.server import ProxyConfig, ProxyThread

        out, args = self.out, self.args
        t = time.monotonic()
        self._step(4, "EPD: encoder (ec_producer) + prefill/decode (ec_consumer) + ec-s3 proxy")
        producer = VllmServer(model, name="encoder", args=server_args, env=env,
                              ec_transfer_config=ec_transfer_config("ec_producer", extra_config),
                              log_path=log_dir / "encoder.log")
        consumer = VllmServer(model, name="prefill-decode", args=server_args, env=env,
                              ec_transfer_config=ec_transfer_config("ec_consumer", extra_config),
                              log_path=log_dir / "prefill-decode.log")
        servers = [producer, consumer]
        for s in servers:
            stack.callback(s.stop)
            s.start()
        wait_all_ready(servers, args.load_timeout, progress=LoadProgress())
        proxy = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0))
        stack.callback(proxy.stop)
        proxy.start()
        out(f"      encoder {producer.url}, prefill/decode {consumer.url}, proxy {proxy.url}")
        # Through the proxy: warms the encoder, the upload, the fetch and prefill/decode.
        warm = self._warm_up(proxy.url, model)

        def scrape() -> _Snapshot:
            return _Snapshot(producer.metrics(), consumer.metrics(), scrape_metrics(f"{proxy.url}/metrics"))

        snaps: dict[int, _Snapshot] = {}

        def count_blobs() -> frozenset[str] | None:
            listed = self._list_blobs(store, extra_config["prefix"])
            return None if listed is None else frozenset(o.key for o in listed)

        snaps[0] = _settle(scrape)
        snaps[0].blobs = count_blobs()

        def after_step(step: int, reqs: list[DemoRequest]) -> None:
            snaps[step] = _settle(scrape)
            snaps[step].blobs = count_blobs()

        t_req = time.monotonic()
        results = run_schedule(proxy.url, model, self.schedule, max_tokens=args.max_tokens,
                               timeout=args.request_timeout, id_prefix="epd", after_step=after_step)
        self.timings["epd_requests"] = time.monotonic() - t_req
        # The producer reports an upload with its next engine step; uploads end after the
        # request's last step, so give it one (a text-only request) before the final read.
        self._nudge(producer.url, model)
        final = _settle(lambda: _Snapshot(producer.metrics(), consumer.metrics(),
                                          scrape_metrics(f"{proxy.url}/metrics")))
        self.timings["epd"] = time.monotonic() - t
        out(f"      warm-up request {warm.latency_s:.1f} s; {len(results)} requests in "
            f"{self.timings['epd_requests']:.2f} s")
        return results, snaps, final, servers, proxy

    # ------------------------------------------------------------------ S3 listing
    def _list_blobs(self, store: Any, prefix: str) -> list[Any] | None:
        async def collect() -> list[Any]:
            return [o async for o in store.list_async(prefix.rstrip("/") + "/")]

        try:
            objects = store.run(collect(), timeout=60)
        except Exception as exc:  # noqa: BLE001 - a listing failure is reported, not fatal
            self.out(f"      (could not list the bucket: {exc})")
            return None
        return [o for o in objects if o.key.endswith(".safetensors") and f"/{PROBE_NAMESPACE}/" not in o.key]

    def _delete_blobs(self, store: Any, prefix: str) -> None:
        async def collect() -> list[str]:
            return [o.key async for o in store.list_async(prefix.rstrip("/") + "/")]

        with contextlib.suppress(Exception):
            keys = store.run(collect(), timeout=60)
            if keys:
                store.run(store.delete_many_async(keys), timeout=60)

    # ------------------------------------------------------------------ summary
    def _summary(self, baseline: dict[int, ChatResult], results: dict[int, ChatResult],
                 snaps: dict[int, _Snapshot], final: _Snapshot, blobs: list[Any] | None, prefix: str) -> bool:
        out, args = self.out, self.args
        self._step(5, "summary")
        rows: list[list[str]] = []
        matches = 0
        for step_reqs in self.schedule:
            step = step_reqs[0].step
            enc, pd = self._where(step_reqs, snaps.get(step - 1), snaps.get(step))
            for k, r in enumerate(step_reqs):
                got, want = results[r.index], baseline[r.index]
                same, verdict = compare_results(got, want, args.logprob_tolerance)
                matches += same
                rows.append([
                    str(r.index),
                    f"{step}{'*' if len(step_reqs) > 1 else ''}",
                    r.image_label,
                    f"{1000 * got.latency_s:.0f}" if got.ok else f"HTTP {got.status}",
                    f"{1000 * want.latency_s:.0f}",
                    enc if k == 0 else '"',
                    pd if k == 0 else '"',
                    str(len(got.token_ids)),
                    verdict,
                ])
        header = ["req", "step", "image", "EPD ms", "base ms", "encoder (via proxy)",
                  "prefill/decode took it from", "tokens", "vs baseline"]
        out("")
        for line in _table(rows, header, right={0, 3, 4, 7}):
            out("  " + line)
        out("  * = sent at once; a step's encoder / prefill-decode cells count the whole step")
        out("    (deltas of the proxy's and the servers' /metrics and of the bucket listing)")

        distinct = len({r.image_seed for r in self.requests})
        base = snaps.get(0)
        if base is None:
            base = _Snapshot(MetricSamples(), MetricSamples(), MetricSamples())
        p, c, x = final.producer, final.consumer, final.proxy
        bp, bc, bx = base.producer, base.consumer, base.proxy

        def dp(name: str, **labels: str) -> float | None:
            return _delta(p, bp, name, **labels)

        def dc(name: str, **labels: str) -> float | None:
            return _delta(c, bc, name, **labels)

        def dx(name: str, **labels: str) -> float | None:
            return _delta(x, bx, name, **labels)

        def mean_ms(after: MetricSamples, before: MetricSamples, name: str) -> str:
            total, count = _delta(after, before, name + "_sum"), _delta(after, before, name + "_count")
            return "n/a" if total is None or not count else f"{1000 * total / count:.1f} ms"

        out("")
        out("  totals of the 6 requests (the warm-up request excluded):")
        new_blobs = None
        if blobs is None:
            out("  bucket      : n/a (listing failed)")
        else:
            known = base.blobs or frozenset()
            fresh = [o for o in blobs if o.key not in known]
            new_blobs = len(fresh)
            flag = "" if new_blobs == distinct else "   <-- expected one per distinct image"
            out(f"  bucket      : {new_blobs} new blobs, {_fmt_bytes(sum(o.size for o in fresh))} under {prefix}/ "
                f"for {distinct} distinct images{flag} (+{len(blobs) - new_blobs} from the warm-up)")
        uploaded, loaded, downloaded = dp(M_UPLOADED), dc(M_LOADED), dc(M_DOWNLOADED)
        unreported = "  (a worker-side counter: this vLLM executor does not report it)"
        out(f"  encoder     : uploaded {_fmt_num(uploaded)} blobs / {_fmt_bytes(dp(M_UPLOADED_BYTES))}"
            f", mean upload {mean_ms(p, bp, M_UPLOAD_S)}, upload failures {_fmt_num(dp(M_UPLOAD_FAILURES))}"
            f", retries {_fmt_num(dp(M_RETRIES))}"
            + (unreported if uploaded is not None and new_blobs and uploaded < new_blobs else ""))
        hit, miss, tmo = (dc(M_LOOKUPS, outcome=o) for o in ("hit", "miss", "timeout"))
        out(f"  prefill/dec : lookups hit {_fmt_num(hit)} / miss {_fmt_num(miss)} (polls while waiting included)"
            f" / timeout {_fmt_num(tmo)}; downloaded {_fmt_num(downloaded)} blobs / "
            f"{_fmt_bytes(dc(M_DOWNLOADED_BYTES))} (mean {mean_ms(c, bc, M_DOWNLOAD_S)})")
        out(f"                loaded {_fmt_num(loaded)} encoder outputs instead of encoding"
            + (unreported if loaded is not None and downloaded and loaded < downloaded else "")
            + f"; local fallbacks {_fmt_num(dc(M_FALLBACKS))}; requests failed for want of a blob "
            f"{_fmt_num(dc(M_UNAVAILABLE))}; invalid blobs {_fmt_num(dc(M_INVALID))}")
        without = dx(P + "items_without_params_total")
        out(f"  proxy       : {_fmt_num(dx(P + 'requests_total'))} requests, "
            f"{_fmt_num(dx(P + 'mm_items_total'))} media items; encoder answers ok "
            f"{_fmt_num(dx(P + 'encoder_requests_total', outcome='ok'))}, items sent without params "
            f"{_fmt_num(without if without is not None else (0.0 if x.ok else None))}")
        ok_all = matches == len(self.requests)
        out(f"  outputs     : {matches}/{len(self.requests)} answers equal to the non-disaggregated run "
            f"(token ids and logprobs, temperature 0)")
        t = self.timings
        wall = self.out.elapsed()
        parts = [f"S3 {t.get('s3', 0):.1f} s", f"model {t.get('model', 0):.1f} s",
                 f"baseline phase {t.get('baseline', 0):.0f} s", f"EPD phase {t.get('epd', 0):.0f} s"]
        if "shutdown" in t:
            parts.append(f"shutdown {t['shutdown']:.0f} s")
        out(f"  wall time   : {wall:.0f} s ({', '.join(parts)})")
        out("")
        out("PASS: the disaggregated answers equal the baseline's" if ok_all
            else "FAIL: some disaggregated answers differ from the baseline's")
        return ok_all

    def _where(self, reqs: list[DemoRequest], before: _Snapshot | None,
               after: _Snapshot | None) -> tuple[str, str]:
        """(what the encoder did, where prefill/decode got the encoder output) for one
        step, from the deltas of the proxy's and the consumer's /metrics and of the
        bucket listing; "n/a" where a source is missing."""
        n = len(reqs)
        if before is None or after is None:
            return "n/a", "n/a"
        # Encoder side: params the proxy got back, and new blobs in the bucket (an
        # encoder that finds an image's blob already there skips encoding it).
        ok = _delta(after.proxy, before.proxy, P + "encoder_requests_total", outcome="ok")
        without = _delta(after.proxy, before.proxy, P + "items_without_params_total") or 0.0
        enc = ["n/a" if ok is None else f"{int(ok)}/{n} params"]
        if after.blobs is not None and before.blobs is not None:
            new = len(after.blobs - before.blobs)
            enc.append(f"{new} new blob{'s' if new != 1 else ''}")
        # Prefill/decode side: fetched (downloaded, or loaded where the worker's
        # counter is reported), encoded locally (promise not kept, or no params),
        # or neither: the image was still in its own encoder cache.
        fetched_src = [v for v in (_delta(after.consumer, before.consumer, M_LOADED),
                                   _delta(after.consumer, before.consumer, M_DOWNLOADED)) if v is not None]
        if not fetched_src:
            if ok is None:
                return ", ".join(enc), "n/a"
            guess = f"{'encoder params' if ok else ''}{', ' if ok and without else ''}"
            guess += f"{int(without)} without params (encoded locally)" if without else ""
            return ", ".join(enc), guess + " (no connector metrics)"
        fetched = int(max(fetched_src))
        local = int((_delta(after.consumer, before.consumer, M_FALLBACKS) or 0.0) + without)
        cached = max(0, n - fetched - local)

        def count(k: int) -> str:
            return "" if n == 1 else f"{k}x "

        pd = []
        if fetched:
            pd.append(f"{count(fetched)}fetched from S3")
        if local:
            pd.append(f"{count(local)}encoded locally")
        if cached:
            pd.append(f"{count(cached)}own encoder cache")
        return ", ".join(enc), ", ".join(pd) or "n/a"

    # ------------------------------------------------------------------ keep running
    def _keep_running(self, servers: list[VllmServer], proxy: Any, model: str) -> None:
        out = self.out
        out("")
        out(f"--keep-running: proxy {proxy.url} (encoder {servers[0].url}, prefill/decode {servers[1].url})")
        out(f"  try: curl -s {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        out(f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": [{{\"type\": "
            f"\"image_url\", \"image_url\": {{\"url\": \"<data: or http URL>\"}}}}]}}]}}'")
        out("  Ctrl-C stops everything.")
        while all(s.is_running() for s in servers):
            time.sleep(1.0)
        out("a server exited; stopping the rest")


if __name__ == "__main__":
    raise SystemExit(main())

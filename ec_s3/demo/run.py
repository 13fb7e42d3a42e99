"""``ec-s3 demo``: encode / prefill-decode disaggregation through S3, end to end, checked.

Phases: S3 (embedded SeaweedFS or ``--endpoint-url``), the tiny offline model (or
``--model``), a plain baseline server, then the EPD stack behind the proxy (or, with
``--topology aggregated``, two ``ec_both`` servers), and a summary whose exit status says
whether every answer equals the baseline's. Owns the command line and the phases;
everything it starts is stopped on every exit. Does not own the chat requests
(:mod:`ec_s3.demo.chat`), the summaries or the servers (:mod:`ec_s3.sandbox`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ec_s3.cli.listing import key_root, list_objects_async
from ec_s3.demo.chat import (
    BATCHING_TOLERANCE,
    DEFAULT_MAX_TOKENS,
    QUESTIONS,
    ChatResult,
    DemoRequest,
    chat_body,
    default_schedule,
    post_chat,
    run_schedule,
)
from ec_s3.demo.fleet_report import FleetSnapshot, FleetWindows, print_fleet_summary, settle_fleet
from ec_s3.demo.report import Out, Windows, print_summary, run_blobs, settle, settle_answered
from ec_s3.demo.timing import Snapshot
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.metrics import scrape_metrics
from ec_s3.sandbox.procgroup import interrupt_on_signals
from ec_s3.sandbox.vllm_server import (
    LoadProgress,
    ServerError,
    VllmServer,
    ec_transfer_config,
    start_all,
    stop_all,
    wait_all_ready,
)

__all__ = ["build_parser", "main"]

DEFAULT_BUCKET = "ec-s3-demo"
WARMUP_SEED = 0  # the image of each phase's warm-up request (not in the schedule)
FLEET_SEEDS = (5, 6)  # published by the encoder before the schedule, as if for another front
CPU_ENCODE_TIMEOUT_S = 30.0  # the proxy's encoder limit with the offline tiny model on CPU cores
EPD, AGGREGATED = "epd", "aggregated"  # --topology


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
            "--topology aggregated: instead of encoder + prefill/decode, two ec_both servers\n"
            "(each encodes, publishes what it encodes, loads what the other published) behind\n"
            "the proxy with affinity routing; the summary shows what each server encoded and\n"
            "loaded, and that each distinct image was encoded once across the fleet.\n"
            "\n"
            "Without options everything is local: an embedded SeaweedFS S3 server and a tiny\n"
            "offline Qwen2.5-VL with random weights (a few minutes on a 2-core CPU)."
        ),
        epilog=(
            "S3: with --endpoint-url the credentials come from the standard AWS chain\n"
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...); they are passed to the\n"
            "servers through the environment, never on a command line. Each run writes under a\n"
            "fresh prefix and deletes its blobs at the end (--keep-blobs keeps them).\n"
            "\n"
            "--model: the encoder and prefill/decode servers (or the two aggregated servers) run at\n"
            "the same time, so on one GPU give each a share, e.g.\n"
            "--vllm-arg=--gpu-memory-utilization=0.4 (use the = form, or\n"
            "quote several: --vllm-arg='--max-model-len 4096 --enforce-eager')."
        ),
    )
    _add_groups(p)
    p.add_argument("--keep-running", action="store_true",
                   help="leave the phase-4 servers and the proxy running after the summary (Ctrl-C stops)")
    return p


def _add_groups(p: argparse.ArgumentParser) -> None:
    """The S3, model-and-servers and requests flags."""
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
                   help="model dir or id to serve instead of the tiny model (uses your vLLM and GPU)")
    m.add_argument("--tiny-model", choices=["qwen", "llava"], default="qwen",
                   help="the offline stand-in when --model is not given: a tiny Qwen2.5-VL with 1024² photos "
                        "(the model family EPD serves; default), or a tiny LLaVA-1.5 with small fixed-size images")
    m.add_argument("--tiny-model-dir", type=Path, default=None,
                   help="where the tiny model is built/reused (default $XDG_CACHE_HOME/ec-s3/tiny-qwen, /tiny-llava with --tiny-model llava)")
    m.add_argument("--topology", choices=[EPD, AGGREGATED], default=EPD,
                   help="epd (default): an encoder (ec_producer), a prefill/decode server (ec_consumer) and the "
                        "proxy; aggregated: two ec_both servers on one bucket (each its own staging dir) behind the "
                        "proxy with affinity routing and no encoder")
    m.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument(s) for every vLLM server (repeatable, shell-split)")
    m.add_argument("--load-timeout", type=float, default=600.0, metavar="S",
                   help="how long the servers may take to load (default 600)")
    m.add_argument("--log-dir", type=Path, default=None,
                   help="server logs (default: a temp dir, removed after a successful run)")
    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"per answer (default {DEFAULT_MAX_TOKENS})")
    r.add_argument("--logprob-tolerance", type=float, default=BATCHING_TOLERANCE, metavar="X",
                   help="largest |logprob difference| of equal token ids still counted as a match "
                        f"(default {BATCHING_TOLERANCE:g}: batching noise; 0: identical)")
    r.add_argument("--request-timeout", type=float, default=180.0, metavar="S", help="per request (default 180)")


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
    out = Out(sys.stdout)
    try:
        with interrupt_on_signals():
            return _Demo(args, extra, out).run()
    except KeyboardInterrupt:
        out("\nec-s3 demo: interrupted; every server it started has been stopped")
        return 130


class _Demo:
    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], out: Out) -> None:
        self.args = args
        self.extra = extra
        self.bucket_lookup: dict[str, Any] | None = None  # set by _s3
        self.out = out
        self.schedule = default_schedule(fleet_seeds=FLEET_SEEDS)
        self.timings: dict[str, float] = {}
        self.vllm_args = [a for raw in args.vllm_arg for a in shlex.split(raw)]
        # Photos of a real size for Qwen-VL and real models; the tiny LLaVA takes 112 px.
        self.photo = args.model is not None or args.tiny_model == "qwen"

    # ------------------------------------------------------------------ phases
    def run(self) -> int:
        out, args = self.out, self.args
        if args.topology == AGGREGATED:
            out("ec-s3 demo: two aggregated servers (ec_both) sharing S3, checked against a plain vLLM server")
        else:
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
                if args.topology == AGGREGATED:
                    ok, servers, proxy = self._aggregated(
                        stack, store, model, server_args, env, extra_config, log_dir, baseline)
                else:
                    results, windows, servers, proxy = self._epd(
                        stack, store, model, server_args, env, extra_config, log_dir)
                    blobs = run_blobs(store, extra_config["prefix"], self.out)
                    if not args.keep_running:
                        self._stop(servers, proxy)
                    self._step(5, "summary")
                    ok = print_summary(out, self.schedule, baseline, results, windows, blobs,
                                       extra_config["prefix"], self.timings, args.logprob_tolerance, parallel=True)
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

    def _stop(self, servers: list[VllmServer], proxy: Any) -> None:
        t = time.monotonic()
        stop_all(servers)
        proxy.stop()
        self.timings["shutdown"] = time.monotonic() - t

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
        from ec_s3.config import ECS3Config, Secret
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
            # Secret objects: these never leave this process (no command line, no log).
            store_extra = {"access_key_id": Secret(creds.access_key_id), "secret_access_key": Secret(creds.secret_access_key)}
        if args.endpoint_url:
            self._step(1, f"S3: using {where}")
        extra_config = {**self.extra, "bucket": bucket, "endpoint_url": endpoint, "prefix": prefix}
        # The proxy HEADs the bucket for images other fronts published (bucket_lookup).
        self.bucket_lookup = {**extra_config, **store_extra}
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
        from ec_s3.sandbox.tiny_model import HEAVY_VISION, build_tiny_llava, default_model_dir, read_manifest
        from ec_s3.sandbox.tiny_qwen import build_tiny_qwen, default_qwen_dir
        from ec_s3.sandbox.vllm_server import QWEN_MODEL_ARGS

        if args.tiny_model == "qwen":
            dst = args.tiny_model_dir or default_qwen_dir()
            self._step(2, "model: tiny offline Qwen2.5-VL, 1024² photos of 1,225 image tokens (random weights; "
                          "outputs are gibberish, but exact)")
            had = read_manifest(dst) is not None
            path = build_tiny_qwen(Path(dst))
            server_args = [*QWEN_MODEL_ARGS, *self.vllm_args]
        else:
            dst = args.tiny_model_dir or default_model_dir()
            self._step(2, "model: tiny offline LLaVA-1.5 with a heavier vision tower (random weights; "
                          "outputs are gibberish, but exact)")
            had = read_manifest(dst) is not None
            path = build_tiny_llava(Path(dst), shape=HEAVY_VISION)  # rebuilt if dst holds another shape
            server_args = [*HEAVY_VISION.server_args(), *self.vllm_args]
        self.timings["model"] = time.monotonic() - t
        out(f"      {path} ({'reused' if had else 'built'} in {self.timings['model']:.1f} s)")
        return str(path), server_args, dict(CPU_OFFLINE_ENV)

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
            out(f"      baseline: {server.placement}")
            wait_all_ready([server], self.args.load_timeout, progress=LoadProgress())
            warm = self._warm_up(server.url, model)
            t_req = time.monotonic()
            results = run_schedule(server.url, model, self.schedule, max_tokens=self.args.max_tokens,
                                   timeout=self.args.request_timeout, id_prefix="baseline", photo=self.photo)
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

    def _encode_timeout_s(self) -> float:
        """The proxy's whole-encoder-request limit. The default (4 s) is sized for a GPU
        encoder; the offline tiny model encodes on one CPU core, 1.8-3.4 s per 1024² photo
        on a 2-core host, and the demo sends two fresh photos at once: past 4 s the second
        went to prefill/decode without params and was encoded there."""
        from ec_s3.proxy.config import ProxyConfig

        return ProxyConfig.encode_timeout_s if self.args.model else CPU_ENCODE_TIMEOUT_S

    def _warm_up(self, url: str, model: str) -> ChatResult:
        """One request with an image outside the schedule: the first image request of a
        fresh server is seconds slower (processor and encoder warm-up), which would
        otherwise land on whichever request comes first. Its counts are excluded."""
        result = post_chat(url, chat_body(model, WARMUP_SEED, QUESTIONS[0], max_tokens=self.args.max_tokens,
                                             photo=self.photo),
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
             ) -> tuple[dict[int, ChatResult], Windows, list[VllmServer], Any]:
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
        # Planned together, each worker on cores of its own (CPU hosts): prefill/decode
        # first, so that on 2 cores the encoder's worker gets core 1, as measured.
        start_all([consumer, producer])
        out(f"      encoder: {producer.placement}; prefill/decode: {consumer.placement}")
        wait_all_ready(servers, args.load_timeout, progress=LoadProgress())
        # bucket_lookup: the fleet images (published for another front) are found in the
        # bucket and go to prefill/decode marked present, with no encoder request.
        proxy = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0,
                                        dispatch="parallel", bucket_lookup=self.bucket_lookup,
                                        encode_timeout_s=self._encode_timeout_s()))
        stack.callback(proxy.stop)
        proxy.start()
        out(f"      encoder {producer.url}, prefill/decode {consumer.url}, proxy {proxy.url}")
        # Through the proxy: warms the encoder, the upload, the fetch and prefill/decode.
        warm = self._warm_up(proxy.url, model)

        def scrape() -> Snapshot:
            return Snapshot(producer.metrics(), consumer.metrics(), scrape_metrics(f"{proxy.url}/metrics"))

        def flush() -> Snapshot:
            # The producer reports an upload with its next engine step, and uploads end
            # after the request's last step: give it one (a text-only request).
            self._nudge(producer.url, model)
            return settle(scrape)

        self._publish_for_another_front(producer.url, model, store, extra_config["prefix"])
        windows = Windows()
        windows.flushed[0] = flush()
        listed = run_blobs(store, extra_config["prefix"], self.out)
        windows.flushed[0].blobs = None if listed is None else frozenset(o.key for o in listed)

        def after_step(step: int, reqs: list[DemoRequest]) -> None:
            # vLLM's request times first: the nudge's own request would count too.
            windows.answered[step] = settle_answered(scrape, windows.flushed[step - 1], len(reqs))
            windows.flushed[step] = flush()

        results = self._run_phase_schedule(proxy.url, model, "epd", after_step, t,
                                           f"warm-up request {warm.latency_s:.1f} s")
        return results, windows, servers, proxy

    def _run_phase_schedule(self, url: str, model: str, phase: str,
                            after_step: Callable[[int, list[DemoRequest]], None], started: float, warm_up: str,
                            id_prefix: str | None = None) -> dict[int, ChatResult]:
        """The schedule through ``url`` (the phase's proxy); records the phase's timings
        under ``phase`` and prints them after ``warm_up`` (what its warm-up took)."""
        t_req = time.monotonic()
        results = run_schedule(url, model, self.schedule, max_tokens=self.args.max_tokens,
                               timeout=self.args.request_timeout, id_prefix=id_prefix or phase,
                               after_step=after_step, photo=self.photo)
        self.timings[f"{phase}_requests"] = time.monotonic() - t_req
        self.timings[phase] = time.monotonic() - started
        self.out(f"      {warm_up}; {len(results)} requests in {self.timings[f'{phase}_requests']:.2f} s "
                 "(metric scrapes between steps included)")
        return results

    def _publish_for_another_front(self, encoder_url: str, model: str, store: Any, prefix: str) -> None:
        """The encoder encodes and publishes :data:`FLEET_SEEDS` as the proxy of another
        front would have it do (the same content names, the item alone, one token), and
        this waits until their blobs are listed: prefill/decode has never seen them."""
        from ec_s3.proxy.media import encoder_body, find_media_items
        from ec_s3.proxy.naming import name_media

        before = len(run_blobs(store, prefix, self.out) or [])
        for seed in FLEET_SEEDS:
            body = name_media(chat_body(model, seed, QUESTIONS[0], photo=self.photo), give_uuids=True)
            for item in find_media_items(body):
                r = post_chat(encoder_url, encoder_body(body, item), timeout=self.args.request_timeout,
                              request_id=f"other-front-{seed}-{secrets.token_hex(3)}")
                if not r.ok:
                    raise ServerError(f"the encoder failed img-{seed} for the other front: HTTP {r.status}: {r.error}")
        self._wait_listed([encoder_url], model, store, prefix, before + len(FLEET_SEEDS),
                          f"the encoder's blobs of {len(FLEET_SEEDS)} images for another front")
        self.out(f"      the encoder published img-{', img-'.join(map(str, FLEET_SEEDS))} for another front "
                 "(in the bucket; new to prefill/decode)")

    def _aggregated(self, stack: contextlib.ExitStack, store: Any, model: str, server_args: list[str],
                    env: dict[str, str], extra_config: dict[str, Any], log_dir: Path,
                    baseline: dict[int, ChatResult]) -> tuple[bool, list[VllmServer], Any]:
        """Phase 4 and the summary of ``--topology aggregated``: (every answer equal to the
        baseline's, the two servers, the proxy)."""
        from ec_s3.proxy.server import ProxyConfig, ProxyThread

        out, args, prefix = self.out, self.args, extra_config["prefix"]
        t = time.monotonic()
        self._step(4, "aggregated: two ec_both servers on one bucket + ec-s3 proxy (affinity routing, no encoder)")
        servers: dict[str, VllmServer] = {}
        for name in ("A", "B"):
            # A private staging area each (mkdtemp makes it 0o700), as on two hosts: the
            # default (/dev/shm) is one host's, and both servers would share it.
            staging = tempfile.mkdtemp(prefix=f"ec-s3-demo-staging-{name.lower()}-")
            stack.callback(shutil.rmtree, staging, True)  # registered first: runs after the stop
            config = ec_transfer_config("ec_both", {**extra_config, "staging_dir": staging})
            servers[name] = VllmServer(model, name=f"server-{name.lower()}", args=server_args, env=env,
                                       ec_transfer_config=config, log_path=log_dir / f"server-{name.lower()}.log")
            stack.callback(servers[name].stop)
        fleet = list(servers.values())
        start_all(fleet)
        out(f"      server A: {servers['A'].placement}; server B: {servers['B'].placement}")
        wait_all_ready(fleet, args.load_timeout, progress=LoadProgress())
        proxy_config = ProxyConfig(encoder_urls=[], pd_urls=[s.url for s in fleet], port=0)
        urls = dict(zip(servers, proxy_config.pd_urls))  # as the proxy spells them: its metrics' labels
        proxy = ProxyThread(proxy_config)
        stack.callback(proxy.stop)
        proxy.start()
        out(f"      server A {urls['A']}, server B {urls['B']}, proxy {proxy.url}")
        # Each server directly (the proxy would warm one): a fresh server's first image
        # request is seconds slower. Both encode img-0; it is outside the counted window.
        warm = [self._warm_up(s.url, model) for s in fleet]

        def scrape() -> FleetSnapshot:
            return FleetSnapshot({n: s.metrics() for n, s in servers.items()}, scrape_metrics(f"{proxy.url}/metrics"))

        def flush() -> FleetSnapshot:
            for s in fleet:  # a server reports its uploads with its next engine step: give each one
                self._nudge(s.url, model)
            return settle_fleet(scrape)

        start = flush()
        listed = run_blobs(store, prefix, out)
        start.blobs = None if listed is None else frozenset(o.key for o in listed)
        published = self._publish_through_holders(servers, urls, model, store, prefix)
        windows = FleetWindows(start, flush())

        def after_step(step: int, reqs: list[DemoRequest]) -> None:
            windows.steps[step] = flush()

        results = self._run_phase_schedule(proxy.url, model, "aggregated", after_step, t,
                                           f"warm-up requests {warm[0].latency_s:.1f} s (A), "
                                           f"{warm[1].latency_s:.1f} s (B)", id_prefix="fleet")
        blobs = run_blobs(store, prefix, out)
        if not args.keep_running:
            self._stop(fleet, proxy)
        self._step(5, "summary")
        ok = print_fleet_summary(out, self.schedule, baseline, results, windows, urls, published, blobs, prefix,
                                 self.timings, args.logprob_tolerance)
        return ok, fleet, proxy

    def _publish_through_holders(self, servers: dict[str, VllmServer], urls: dict[str, str], model: str,
                                 store: Any, prefix: str) -> dict[int, str]:
        """Each image of :data:`FLEET_SEEDS` is sent to the server that ranks first for it
        (the proxy's rendezvous order over the same URLs), as another front of this fleet
        would have routed it: that server encodes and publishes it. Waits until the blobs
        are listed; returns seed -> server name. Not through a fixed server: the other one,
        sent the image later, would encode it again (module docstring)."""
        from ec_s3.proxy.media import find_media_items
        from ec_s3.proxy.naming import name_media
        from ec_s3.proxy.routing import rendezvous_order, route_key

        names = list(urls)
        before = len(run_blobs(store, prefix, self.out) or [])
        published: dict[int, str] = {}
        for seed in FLEET_SEEDS:
            # Named as the proxy names it (content uuids): the same identifier, hence blob key.
            body = name_media(chat_body(model, seed, QUESTIONS[0], max_tokens=self.args.max_tokens, photo=self.photo),
                              give_uuids=True)
            key = route_key(find_media_items(body))
            if key is None:
                raise ServerError(f"img-{seed}: the request has no media item to route by")
            name = names[rendezvous_order(key, [urls[n] for n in names])[0]]
            r = post_chat(servers[name].url, body, timeout=self.args.request_timeout,
                          request_id=f"other-front-{seed}-{secrets.token_hex(3)}")
            if not r.ok:
                raise ServerError(f"server {name} failed img-{seed} for another front: HTTP {r.status}: {r.error}")
            published[seed] = name
        self._wait_listed([s.url for s in servers.values()], model, store, prefix, before + len(FLEET_SEEDS),
                          f"the blobs of the {len(FLEET_SEEDS)} images published for another front")
        self.out("      published " + ", ".join(f"img-{s} through server {n}" for s, n in published.items())
                 + " for another front of this fleet (each through the server that ranks first for it)")
        return published

    def _wait_listed(self, urls: list[str], model: str, store: Any, prefix: str, count: int,
                     what: str, timeout_s: float = 60.0) -> None:
        """Until the run's prefix lists ``count`` blobs, giving the servers at ``urls``
        engine steps (uploads are reported and finished with them)."""
        deadline = time.monotonic() + timeout_s
        while len(run_blobs(store, prefix, self.out) or []) < count:
            if time.monotonic() > deadline:
                raise ServerError(f"{what} were not in the bucket after {timeout_s:.0f} s")
            for url in urls:
                self._nudge(url, model)
            time.sleep(0.2)

    def _delete_blobs(self, store: Any, prefix: str) -> None:
        try:
            keys = [o.key for o in store.run(list_objects_async(store, key_root(prefix)), timeout=60)]
            if keys:
                store.run(store.delete_many_async(keys), timeout=60)
        except Exception as exc:  # noqa: BLE001 - the answers are in; leftovers are reported, not fatal
            endpoint = f" --endpoint-url {store.config.endpoint_url}" if store.config.endpoint_url else ""
            self.out(f"  could not delete this run's blobs ({type(exc).__name__}: {exc}); delete them with "
                     f"`ec-s3 gc --bucket {store.bucket}{endpoint} --prefix {prefix} --older-than 0s`")

    # ------------------------------------------------------------------ keep running
    def _keep_running(self, servers: list[VllmServer], proxy: Any, model: str) -> None:
        out = self.out
        roles = ("server A", "server B") if self.args.topology == AGGREGATED else ("encoder", "prefill/decode")
        out("")
        out(f"--keep-running: proxy {proxy.url} ({roles[0]} {servers[0].url}, {roles[1]} {servers[1].url})")
        out(f"  try: curl -s {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        out(f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": [{{\"type\": "
            f"\"image_url\", \"image_url\": {{\"url\": \"<data: or http URL>\"}}}}]}}]}}'")
        out("  Ctrl-C stops everything.")
        while all(s.is_running() for s in servers):
            time.sleep(1.0)
        out("a server exited; stopping the rest")


if __name__ == "__main__":
    raise SystemExit(main())
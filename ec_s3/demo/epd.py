"""Phase 4 of ``ec-s3 demo`` (``--topology epd``, the default) and its summary.

Owns the EPD stack: an encoder (``ec_producer``), a prefill/decode server
(``ec_consumer``) and the ec-s3 proxy in front of them, the images the encoder publishes
for another front before the schedule, and the scrapes around each step. Does not own
the other topology (:mod:`ec_s3.demo.aggregated`), the summary's lines
(:mod:`ec_s3.demo.report`) nor the servers (:mod:`ec_s3.sandbox.vllm_server`).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import time
from typing import Any

from ec_s3.demo.chat import QUESTIONS, ChatResult, DemoRequest, chat_body, post_chat
from ec_s3.demo.context import FLEET_SEEDS, DemoContext, Setup
from ec_s3.demo.report import Windows, print_summary, run_blobs, settle, settle_answered
from ec_s3.demo.timing import Snapshot
from ec_s3.sandbox.metrics import scrape_metrics
from ec_s3.sandbox.vllm_server import (
    LoadProgress,
    ServerError,
    VllmServer,
    ec_transfer_config,
    start_all,
    wait_all_ready,
)

__all__ = ["CPU_ENCODE_TIMEOUT_S", "encode_timeout_s", "run_epd"]

CPU_ENCODE_TIMEOUT_S = 30.0  # the proxy's encoder limit with the offline tiny model on CPU cores


def run_epd(demo: DemoContext, stack: contextlib.ExitStack, setup: Setup,
            baseline: dict[int, ChatResult]) -> tuple[bool, list[VllmServer], Any]:
    """Phase 4 and the summary of ``--topology epd``: (every answer equal to the
    baseline's, the encoder and prefill/decode servers, the proxy)."""
    t = time.monotonic()
    demo.step(4, "EPD: encoder (ec_producer) + prefill/decode (ec_consumer) + ec-s3 proxy")
    producer, consumer, proxy = _start(demo, stack, setup)
    # Through the proxy: warms the encoder, the upload, the fetch and prefill/decode.
    warm = demo.warm_up(proxy.url, setup.model)
    results, windows = _measured_schedule(demo, setup, producer, consumer, proxy, t,
                                          f"warm-up request {warm.latency_s:.1f} s")
    servers = [producer, consumer]
    blobs = run_blobs(setup.store, setup.prefix, demo.out)
    if not demo.args.keep_running:
        demo.stop(servers, proxy)
    demo.step(5, "summary")
    ok = print_summary(demo.out, demo.schedule, baseline, results, windows, blobs,
                       setup.prefix, demo.timings, demo.args.logprob_tolerance, parallel=True)
    return ok, servers, proxy


def encode_timeout_s(args: argparse.Namespace) -> float:
    """The proxy's whole-encoder-request limit. The default (4 s) is sized for a GPU
    encoder; the offline tiny model encodes on one CPU core, 1.8-3.4 s per 1024² photo
    on a 2-core host, and the demo sends two fresh photos at once: past 4 s the second
    went to prefill/decode without params and was encoded there."""
    from ec_s3.proxy.config import ProxyConfig

    return ProxyConfig.encode_timeout_s if args.model else CPU_ENCODE_TIMEOUT_S


def _start(demo: DemoContext, stack: contextlib.ExitStack, setup: Setup) -> tuple[VllmServer, VllmServer, Any]:
    """(encoder, prefill/decode, proxy): started, loaded, and stopped when ``stack`` closes."""
    from ec_s3.proxy.server import ProxyConfig, ProxyThread

    producer = VllmServer(setup.model, name="encoder", args=setup.server_args, env=setup.env,
                          ec_transfer_config=ec_transfer_config("ec_producer", setup.extra_config),
                          log_path=setup.log_dir / "encoder.log")
    consumer = VllmServer(setup.model, name="prefill-decode", args=setup.server_args, env=setup.env,
                          ec_transfer_config=ec_transfer_config("ec_consumer", setup.extra_config),
                          log_path=setup.log_dir / "prefill-decode.log")
    servers = [producer, consumer]
    for s in servers:
        stack.callback(s.stop)
    # Planned together, each worker on cores of its own (CPU hosts): prefill/decode
    # first, so that on 2 cores the encoder's worker gets core 1, as measured.
    start_all([consumer, producer])
    demo.out(f"      encoder: {producer.placement}; prefill/decode: {consumer.placement}")
    wait_all_ready(servers, demo.args.load_timeout, progress=LoadProgress())
    # bucket_lookup: the fleet images (published for another front) are found in the
    # bucket and go to prefill/decode marked present, with no encoder request.
    proxy = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0,
                                    dispatch="parallel", bucket_lookup=demo.bucket_lookup,
                                    encode_timeout_s=encode_timeout_s(demo.args)))
    stack.callback(proxy.stop)
    proxy.start()
    demo.out(f"      encoder {producer.url}, prefill/decode {consumer.url}, proxy {proxy.url}")
    return producer, consumer, proxy


def _measured_schedule(demo: DemoContext, setup: Setup, producer: VllmServer, consumer: VllmServer, proxy: Any,
                       started: float, warm_up: str) -> tuple[dict[int, ChatResult], Windows]:
    """The fleet images published, then the schedule through the proxy with the three
    servers' metrics settled before the first step and after each."""
    model, store, prefix = setup.model, setup.store, setup.prefix

    def scrape() -> Snapshot:
        return Snapshot(producer.metrics(), consumer.metrics(), scrape_metrics(f"{proxy.url}/metrics"))

    def flush() -> Snapshot:
        # The producer reports an upload with its next engine step, and uploads end
        # after the request's last step: give it one (a text-only request).
        demo.nudge(producer.url, model)
        return settle(scrape)

    _publish_for_another_front(demo, producer.url, model, store, prefix)
    windows = Windows()
    windows.flushed[0] = flush()
    listed = run_blobs(store, prefix, demo.out)
    windows.flushed[0].blobs = None if listed is None else frozenset(o.key for o in listed)

    def after_step(step: int, reqs: list[DemoRequest]) -> None:
        # vLLM's request times first: the nudge's own request would count too.
        windows.answered[step] = settle_answered(scrape, windows.flushed[step - 1], len(reqs))
        windows.flushed[step] = flush()

    results = demo.run_phase_schedule(proxy.url, model, "epd", after_step, started, warm_up)
    return results, windows


def _publish_for_another_front(demo: DemoContext, encoder_url: str, model: str, store: Any, prefix: str) -> None:
    """The encoder encodes and publishes :data:`FLEET_SEEDS` as the proxy of another
    front would have it do (the same content names, the item alone, one token), and
    this waits until their blobs are listed: prefill/decode has never seen them."""
    from ec_s3.proxy.media import encoder_body, find_media_items
    from ec_s3.proxy.naming import name_media

    before = len(run_blobs(store, prefix, demo.out) or [])
    for seed in FLEET_SEEDS:
        body = name_media(chat_body(model, seed, QUESTIONS[0], photo=demo.photo), give_uuids=True)
        for item in find_media_items(body):
            r = post_chat(encoder_url, encoder_body(body, item), timeout=demo.args.request_timeout,
                          request_id=f"other-front-{seed}-{secrets.token_hex(3)}")
            if not r.ok:
                raise ServerError(f"the encoder failed img-{seed} for the other front: HTTP {r.status}: {r.error}")
    demo.wait_listed([encoder_url], model, store, prefix, before + len(FLEET_SEEDS),
                     f"the encoder's blobs of {len(FLEET_SEEDS)} images for another front")
    demo.out(f"      the encoder published img-{', img-'.join(map(str, FLEET_SEEDS))} for another front "
             "(in the bucket; new to prefill/decode)")

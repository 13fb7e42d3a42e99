"""Repeated images never reach an encoder, through real servers: SeaweedFS, an encoder
vLLM server (ec_producer), a prefill/decode vLLM server (ec_consumer) and two ec-s3
proxies in front of them. Slow (two engine loads); one test, one stack, three parts:

(a) a hit skips the encoder: a repeat through the proxy that saw the encoder's answer
    makes no encoder request (the proxy's and the encoder server's own counts unchanged);
(b) two proxies: an image the encoder published for another front is found by the
    second proxy's HEAD (``bucket_lookup``) and loaded by prefill/decode from the bucket,
    no encoder request;
(c) a deleted blob falls back: the second proxy knows img-c is in the bucket (its HEAD
    found it), then the blob is deleted (gc, a lifecycle rule); the request still
    answers, prefill/decode encodes the item locally at once (one counted fallback, well
    under promised_wait_s), and the proxy forgets the entry: the next request goes to
    the encoder again.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ec_s3.blob.format import identifier_digest
from ec_s3.config import ECS3Config
from ec_s3.demo.chat import chat_body, post_chat
from ec_s3.proxy.media import encoder_body, find_media_items
from ec_s3.proxy.naming import name_media
from ec_s3.proxy.server import ProxyConfig, ProxyThread
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.metrics import MetricSamples, scrape_metrics
from ec_s3.sandbox.vllm_server import TINY_MODEL_ARGS, LoadProgress, VllmServer, ec_transfer_config, start_all, \
    stop_all, wait_all_ready
from ec_s3.store.client import S3Store

PREFIX = "skip"
PROMISED_WAIT_S = 30.0
P = "ec_s3_proxy_"
Q = "What is in this picture?"
SEED_WARM, SEED_A, SEED_B, SEED_C = 70, 71, 72, 73


def _enc_requests(m: MetricSamples) -> float:
    return m.get(P + "encoder_requests_total") or 0.0


def _served(server: VllmServer) -> float:
    """Requests the server's front end finished (vLLM's own count)."""
    return server.metrics().get("vllm:e2e_request_latency_seconds_count") or 0.0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_repeats_skip_the_encoder_and_a_deleted_blob_falls_back(
    s3_endpoint: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    creds = s3_endpoint.credentials
    bucket = f"skip-{secrets.token_hex(6)}"
    store_extra = {"bucket": bucket, "endpoint_url": s3_endpoint.url, "prefix": PREFIX,
                   "access_key_id": creds.access_key_id, "secret_access_key": creds.secret_access_key}
    store = S3Store(ECS3Config.from_extra_config(store_extra, environ={}))
    store.run(store.create_bucket_async(), timeout=30)
    model = str(tiny_model_dir)
    env = {**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    extra = {"bucket": bucket, "endpoint_url": s3_endpoint.url, "prefix": PREFIX, "retry_base_delay_s": 0.01,
             "retry_max_delay_s": 0.2, "promised_wait_s": PROMISED_WAIT_S}
    producer = VllmServer(model, name="producer", args=TINY_MODEL_ARGS, env=env, log_path=tmp_path / "producer.log",
                          ec_transfer_config=ec_transfer_config("ec_producer", extra))
    consumer = VllmServer(model, name="consumer", args=TINY_MODEL_ARGS, env=env, log_path=tmp_path / "consumer.log",
                          ec_transfer_config=ec_transfer_config("ec_consumer", extra))
    proxies: list[ProxyThread] = []

    def blobs() -> set[str]:
        async def collect() -> set[str]:
            return {o.key async for o in store.list_async(f"{PREFIX}/") if o.key.endswith(".safetensors")
                    and "/_ec_s3_probe/" not in o.key}
        return store.run(collect(), timeout=60)

    def wait_blobs(n: int) -> set[str]:
        deadline = time.monotonic() + 120
        while len(found := blobs()) < n and time.monotonic() < deadline:
            post_chat(producer.url, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
            time.sleep(0.2)
        assert len(found) >= n, f"{len(found)} blobs, wanted {n}; logs in {tmp_path}"
        return found

    def publish_for_another_front(seed: int) -> None:
        body = name_media(chat_body(model, seed, Q), give_uuids=True)
        for item in find_media_items(body):
            assert post_chat(producer.url, encoder_body(body, item)).ok

    def consumer_count(name: str, want: float | None = None) -> float:
        """A connector counter of the consumer; with ``want``, once it reached it (stats reach
        /metrics with the engine's next steps), or at a deadline."""
        deadline = time.monotonic() + 15
        while True:
            value = consumer.metrics().get(f"vllm:ec_s3_{name}_total") or 0.0
            if want is None or value >= want or time.monotonic() > deadline:
                return value
            post_chat(consumer.url, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
            time.sleep(0.2)

    def proxy_learned(proxy: ProxyThread, entries: int, encoder_requests: int) -> MetricSamples:
        """Once ``proxy`` handled its encoders' answers: under parallel dispatch the client's
        answer can come back before them (CI: the repeat was sent before A remembered it)."""
        deadline = time.monotonic() + 30
        while True:
            m = scrape_metrics(f"{proxy.url}/metrics")
            done = (m.get(P + "known_entries") or 0) >= entries and _enc_requests(m) >= encoder_requests
            if done or time.monotonic() > deadline:
                assert done, m.by_name
                return m
            time.sleep(0.1)

    try:
        start_all([consumer, producer])
        wait_all_ready([consumer, producer], 900, progress=LoadProgress(sys.stderr, prefix="  skip "))
        a = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0,
                                    known_settle_s=0.0)).start()
        proxies.append(a)
        # Time is not the property here: with the default 0.25 s, a HEAD on a CI host whose two
        # engines spin after each step came back late (CI: ``assert set() == {0}`` in part c).
        b = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0,
                                    known_settle_s=0.0, bucket_lookup=store_extra,
                                    bucket_lookup_timeout_s=10.0)).start()
        proxies.append(b)
        # Warm-up through both proxies (B learns the model's key space from its encoder's answer).
        assert post_chat(a.url, chat_body(model, SEED_WARM, Q)).ok
        assert post_chat(b.url, chat_body(model, SEED_WARM + 100, Q)).ok
        wait_blobs(2)
        proxy_learned(a, 1, 1)
        proxy_learned(b, 1, 1)

        # (a) a hit skips the encoder.
        first = post_chat(a.url, chat_body(model, SEED_A, Q))
        assert first.ok, first
        wait_blobs(3)
        enc_before, served_before = _enc_requests(proxy_learned(a, 2, 2)), _served(producer)
        again = post_chat(a.url, chat_body(model, SEED_A, "Describe the image in one sentence."))
        assert again.ok and len(again.token_ids) == 8, again
        m = scrape_metrics(f"{a.url}/metrics")
        assert _enc_requests(m) == enc_before and m.get(P + "encoder_skips_total", source="answer") == 1
        assert _served(producer) == served_before  # the encoder server saw no request

        # (b) a second proxy learns through the bucket: img-b was published for another front.
        publish_for_another_front(SEED_B)
        wait_blobs(4)
        downloaded = consumer_count("blobs_downloaded")
        enc_before, served_before = _enc_requests(scrape_metrics(f"{b.url}/metrics")), _served(producer)
        r = post_chat(b.url, chat_body(model, SEED_B, Q))
        assert r.ok and len(r.token_ids) == 8, r
        m = scrape_metrics(f"{b.url}/metrics")
        assert m.get(P + "encoder_skips_total", source="bucket") == 1 and _enc_requests(m) == enc_before
        assert _served(producer) == served_before
        assert consumer_count("blobs_downloaded", downloaded + 1) == downloaded + 1  # prefill/decode loaded it from the bucket

        # (c) a deleted blob: B found img-c in the bucket (its HEAD, as for a request), then gc took it.
        publish_for_another_front(SEED_C)
        wait_blobs(5)
        body = name_media(chat_body(model, SEED_C, Q), give_uuids=True)
        items = find_media_items(body)
        _, found = asyncio.run_coroutine_threadsafe(
            b.proxy.known_params(body, items, may_look=True), b._loop).result(10)
        assert found == {0}, scrape_metrics(f"{b.url}/metrics").by_name.get(P + "bucket_lookups_total")
        (uuid,) = [i.part["uuid"] for i in items]
        gone = [k for k in blobs() if k.endswith(f"/{identifier_digest(uuid)}.safetensors")]
        assert len(gone) == 1
        store.run(store.delete_async(gone[0]), timeout=30)
        fallbacks, missing = consumer_count("fallbacks_local"), consumer_count("present_missing")
        enc_before = _enc_requests(scrape_metrics(f"{b.url}/metrics"))
        t = time.monotonic()
        r = post_chat(b.url, chat_body(model, SEED_C, Q))
        took = time.monotonic() - t
        assert r.ok and len(r.token_ids) == 8 and all(lp <= 0.0 for lp in r.logprobs), r
        assert took < PROMISED_WAIT_S / 3, f"{took:.1f} s: the consumer waited for a blob marked present"
        assert consumer_count("fallbacks_local", fallbacks + 1) == fallbacks + 1
        assert consumer_count("present_missing", missing + 1) == missing + 1
        m = scrape_metrics(f"{b.url}/metrics")
        assert _enc_requests(m) == enc_before
        assert m.get(P + "known_forgotten_total", reason="missing") == 1
        # Forgotten: the next request for img-c HEADs (a miss) and goes to the encoder.
        r = post_chat(b.url, chat_body(model, SEED_C, "Describe the image in one sentence."))
        assert r.ok
        m = scrape_metrics(f"{b.url}/metrics")
        assert _enc_requests(m) == enc_before + 1
        print(f"\nskip e2e: deleted-blob request {1000 * took:.0f} ms", file=sys.stderr)
    finally:
        for proxy in proxies:
            proxy.stop()
        stop_all([producer, consumer])
        store.close(timeout=5.0)

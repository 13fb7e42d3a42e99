"""Cache-affinity routing against least-loaded routing, in one interleaved run (issue 32).

Two aggregated vLLM servers (``ec_both``: encoder + prefill/decode, the tiny Qwen2.5-VL of
:mod:`ec_s3.sandbox.tiny_qwen`, one core each, one SeaweedFS bucket) behind two
``ec-s3 proxy`` instances with no encoder, one per ``--route`` policy. Each policy gets its
own hot set of 1024² photos (:data:`HOT` per policy, distinct seeds, so neither warms the
other's images) and serves blocks of :data:`BLOCK` requests drawn uniformly from it,
:data:`CONCURRENCY` at a time; the policies' blocks alternate, and each block's deltas of
the servers' ``/metrics`` belong to its policy. Per policy: GETs (blobs fetched from the
bucket), items encoded (uploads started: an ``ec_both`` server encodes and publishes every
miss), bucket lookups that hit, and the latency of a 1-token answer (its TTFT, as nothing
streams).

Each server's front-end processor cache is bounded (:data:`PROCESSOR_CACHE_GB`, about ten
such photos, below the hot set) as a fleet's hot set outgrows one server's caches; prefix
caching is off (a repeated image would otherwise skip the encoder through the KV cache).

    python -m bench.affinity [--quick] [--blocks N] [--concurrency C] [--out-dir D]

Owns this bench: the workload, the deltas, ``bench/results/affinity.json``. Does not own the
servers (:mod:`ec_s3.sandbox.vllm_server`) nor the routing (:mod:`ec_s3.proxy.routing`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import statistics
import time
from typing import Any

from bench import benchlib as bl

POLICIES = ("least-loaded", "affinity")
HOT = 16
BLOCK = 16
CONCURRENCY = 2
PROCESSOR_CACHE_GB = 0.25
# (series, labels) per reported counter, summed over both servers.
COUNTERS = {"gets": ("vllm:ec_s3_blobs_downloaded_total", {}),
            "encoded": ("vllm:ec_s3_uploads_started_total", {}),
            "lookup_hits": ("vllm:ec_s3_lookups_total", {"outcome": "hit"}),
            "lookup_misses": ("vllm:ec_s3_lookups_total", {"outcome": "miss"}),
            "blobs_loaded": ("vllm:ec_s3_blobs_loaded_total", {}),
            "requests": ("vllm:request_success_total", {})}


def photo_url(seed: int) -> str:
    from ec_s3.sandbox.tiny_qwen import photo_jpeg

    return "data:image/jpeg;base64," + base64.b64encode(photo_jpeg(seed)).decode()


def scrape(servers: list[Any]) -> dict[str, float]:
    samples = [s.metrics() for s in servers]
    return {k: sum(m.get(name, **labels) or 0.0 for m in samples) for k, (name, labels) in COUNTERS.items()}


async def run_block(url: str, model: str, photos: list[str], picks: list[int], concurrency: int) -> list[float]:
    """``picks`` (indices into ``photos``) through the proxy at ``url``, ``concurrency`` at
    a time; each latency (s)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    out: list[float] = []

    async def one(session: aiohttp.ClientSession, n: int, i: int) -> None:
        body = {"model": model, "max_tokens": 1, "temperature": 0.0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": photos[i]}},
                    {"type": "text", "text": f"Question {n}: what is in the picture?"}]}]}
        async with sem:
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}")
            out.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(one(session, n, i) for n, i in enumerate(picks)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(p)
    p.add_argument("--blocks", type=int, default=None, help="blocks per policy (default 8; --quick 3)")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY, help=f"requests at once (default {CONCURRENCY})")
    args = p.parse_args()
    blocks = args.blocks or (3 if args.quick else 8)
    if blocks < 1:
        p.error("--blocks: must be >= 1")
    if args.concurrency < 1:
        p.error("--concurrency: must be >= 1")
    bl.setup_env()
    from ec_s3.proxy.config import ProxyConfig
    from ec_s3.proxy.server import ProxyThread
    from ec_s3.sandbox.env import CPU_OFFLINE_ENV
    from ec_s3.sandbox.tiny_qwen import build_tiny_qwen, default_qwen_dir
    from ec_s3.sandbox.vllm_server import QWEN_MODEL_ARGS, VllmServer, ec_transfer_config, start_all, stop_all, \
        wait_all_ready

    model = str(build_tiny_qwen(default_qwen_dir()))
    photos = {pol: [photo_url(1000 * (k + 1) + i) for i in range(HOT)] for k, pol in enumerate(POLICIES)}
    rng = random.Random(32)
    cores = sorted(os.sched_getaffinity(0))
    server_args = [*QWEN_MODEL_ARGS, "--no-enable-prefix-caching", "--mm-processor-cache-gb", str(PROCESSOR_CACHE_GB)]
    with bl.s3_endpoint("affinity") as ep:
        bucket = bl.create_bucket(ep)
        env = {**CPU_OFFLINE_ENV, **bl.BENCH_ENV, "AWS_ACCESS_KEY_ID": ep.access_key_id,
               "AWS_SECRET_ACCESS_KEY": ep.secret_access_key}
        extra = {"bucket": bucket, "endpoint_url": ep.url, "prefix": "bench-affinity"}
        servers = [VllmServer(model, name=f"both-{n}", args=server_args, env=env, cpus=[cores[n % len(cores)]],
                              ec_transfer_config=ec_transfer_config("ec_both", extra)) for n in range(2)]
        proxies: dict[str, Any] = {}
        try:
            start_all(servers)
            wait_all_ready(servers, 900)
            bl.log("affinity: 2 ec_both servers ready")
            for pol in POLICIES:
                proxies[pol] = ProxyThread(ProxyConfig(encoder_urls=[], pd_urls=[s.url for s in servers], port=0,
                                                       route=pol)).start()
            per: dict[str, dict[str, Any]] = {pol: {"latency_s": [], "blocks": []} for pol in POLICIES}
            for b in range(blocks):
                for pol in (POLICIES if b % 2 == 0 else POLICIES[::-1]):
                    picks = [rng.randrange(HOT) for _ in range(BLOCK)]
                    before = scrape(servers)
                    lat = asyncio.run(run_block(proxies[pol].url, model, photos[pol], picks, args.concurrency))
                    time.sleep(1.0)  # uploads finish after the answer: let their counters land
                    after = scrape(servers)
                    delta = {k: after[k] - before[k] for k in COUNTERS}
                    per[pol]["latency_s"] += lat
                    per[pol]["blocks"].append({**delta, "median_ms": 1e3 * statistics.median(lat)})
                    bl.log(f"affinity: block {b} {pol}: {delta} median {1e3 * statistics.median(lat):.0f} ms")
            for pol in POLICIES:
                per[pol]["route_picks"] = {o: proxies[pol].proxy.metrics.get("ec_s3_proxy_route_picks_total", outcome=o)
                                           for o in ("affinity", "spill", "no_media")}
        finally:
            for proxy in proxies.values():
                proxy.stop()
            stop_all(servers)
    summary: dict[str, Any] = {}
    for pol in POLICIES:
        lat = per[pol]["latency_s"]
        tot = {k: sum(blk[k] for blk in per[pol]["blocks"]) for k in COUNTERS}
        summary[pol] = {**tot, "ttft_median_ms": 1e3 * statistics.median(lat),
                        "ttft_p90_ms": 1e3 * bl.pct(lat, 0.9), "route_picks": per[pol].get("route_picks")}
    rows = [[pol, *(f"{summary[pol][k]:.0f}" for k in COUNTERS), f"{summary[pol]['ttft_median_ms']:.0f}",
             f"{summary[pol]['ttft_p90_ms']:.0f}"] for pol in POLICIES]
    print(bl.table(["route", *COUNTERS, "TTFT p50 ms", "p90 ms"], rows, title="affinity vs least-loaded"))
    config = {"hot": HOT, "block": BLOCK, "blocks": blocks, "concurrency": args.concurrency,
              "processor_cache_gb": PROCESSOR_CACHE_GB}
    bl.write_json("affinity", {"config": config, "summary": summary,
                               "per_block": {p: per[p]["blocks"] for p in POLICIES}}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

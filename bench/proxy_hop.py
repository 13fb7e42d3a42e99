"""The ``ec-s3 proxy`` hop alone: what the proxy adds to a chat request with one image
over a client that calls the encoder and then prefill/decode itself.

Both upstreams are instant fakes (aiohttp servers answering fixed bodies), so the
difference is the proxy: one more HTTP hop, parsing the request, the encoder's body,
merging the params and the prefill/decode body. The client's own bodies for the direct
calls are built before timing (a baseline with no JSON work). Proxy, fakes and client
share one event loop in one process: the numbers are the proxy's own cost, not a
deployment's scheduling (bench/e2e.py --part stack measures the served stack).
Media sizes: a 56x56 PNG data URL (~11 KB, the tests' images) and ~1.5 MB (a
data URL of a photo), interleaved, ratio-free: milliseconds added per request.

    .venv/bin/python bench/proxy_hop.py [--quick] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

PARAMS = {"f" * 64: {"key": "k" * 80, "item_indices": [0], "size_bytes": 4200}}
ANSWER = json.dumps({"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()


async def _serve(answer: bytes) -> tuple[Any, str]:
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def measure(media_bytes: list[int], n: int) -> dict[str, Any]:
    import aiohttp

    from ec_s3.demo.chat import chat_body
    from ec_s3.proxy.media import encoder_body, find_media_items
    from ec_s3.proxy.server import EPDProxy, ProxyConfig

    enc_runner, enc_url = await _serve(json.dumps({"choices": [], "ec_transfer_params": PARAMS}).encode())
    pd_runner, pd_url = await _serve(ANSWER)
    proxy = await EPDProxy(ProxyConfig(encoder_urls=[enc_url], pd_urls=[pd_url], port=0,
                                       max_body_bytes=64 << 20)).start()
    out: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession() as cs:
            bodies = {}
            for size in media_bytes:
                body = chat_body("m", 1, "What is in this picture?")
                url = body["messages"][0]["content"][0]["image_url"]["url"]
                body["messages"][0]["content"][0]["image_url"]["url"] = url + "A" * max(0, size - len(url))
                (item,) = find_media_items(body)
                bodies[size] = (json.dumps(body).encode(), json.dumps(encoder_body(body, item)).encode(),
                                json.dumps({**body, "ec_transfer_params": PARAMS}).encode())

            async def post(url: str, data: bytes) -> None:
                async with cs.post(f"{url}/v1/chat/completions", data=data,
                                   headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()

            async def via(size: int) -> float:
                t = time.perf_counter()
                await post(proxy.url, bodies[size][0])
                return time.perf_counter() - t

            async def direct(size: int) -> float:
                t = time.perf_counter()
                await post(enc_url, bodies[size][1])
                await post(pd_url, bodies[size][2])
                return time.perf_counter() - t

            for size in media_bytes:
                for _ in range(10):
                    await via(size)
                    await direct(size)
            lat: dict[int, dict[str, list[float]]] = {s: {"proxy": [], "direct": []} for s in media_bytes}
            cpu: dict[int, float] = {s: 0.0 for s in media_bytes}
            for i in range(n):
                for size in media_bytes:
                    for who in (("proxy", "direct") if i % 2 == 0 else ("direct", "proxy")):
                        c0 = time.process_time()
                        lat[size][who].append(await (via(size) if who == "proxy" else direct(size)))
                        if who == "proxy":
                            cpu[size] += time.process_time() - c0
            for size in media_bytes:
                p, d = statistics.median(lat[size]["proxy"]), statistics.median(lat[size]["direct"])
                out[str(size)] = {"media_bytes": size, "proxy_s": bl.summary(lat[size]["proxy"]),
                                  "direct_s": bl.summary(lat[size]["direct"]), "hop_s": p - d,
                                  "cpu_per_proxied_request_s": cpu[size] / n}
    finally:
        await proxy.stop()
        await enc_runner.cleanup()
        await pd_runner.cleanup()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--requests", type=int, default=None, help="requests per media size and path")
    parser.add_argument("--media-bytes", type=int, nargs="+", default=[11_000, 1_500_000])
    args = parser.parse_args()
    bl.setup_env()
    n = args.requests or (60 if args.quick else 300)
    result = asyncio.run(measure(args.media_bytes, n))
    bl.write_json("proxy_hop", {"params": {"requests": n, "media_bytes": args.media_bytes, "quick": args.quick},
                                "sizes": result}, args.out_dir)
    print(bl.table(["media", "via proxy p50 ms", "direct p50 ms", "hop ms", "CPU per proxied request ms"],
                   [[f"{r['media_bytes'] / 1e3:.0f} kB", r["proxy_s"]["median"] * 1e3, r["direct_s"]["median"] * 1e3,
                     r["hop_s"] * 1e3, r["cpu_per_proxied_request_s"] * 1e3] for r in result.values()],
                   title=f"ec-s3 proxy hop, instant upstreams, one loop ({n} requests per cell)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

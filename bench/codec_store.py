"""Codec and store throughput against their baselines, measured in one run.

* codec: ec-s3 encode/decode of a bf16 tensor vs ``safetensors.torch.save/load``;
* store: ec-s3 ``S3Store`` PUT/GET vs raw aioboto3 with botocore defaults, same server.

Machines here are shared and noisy, so the result is the ratio within one run.
Starts its own SeaweedFS unless ``--endpoint-url`` is given (with ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` in the environment). Writes JSON to ``--out``.

    .venv/bin/python bench/codec_store.py --sizes-mb 8 32 --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aioboto3
import safetensors.torch
import torch

from ec_s3.blob.codec import BlobExpectation, BlobMeta, decode_blob, encode_blob
from ec_s3.config import ECS3Config
from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials
from ec_s3.store.client import S3Store

MB = 1_000_000


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "mb_per_s": nbytes / med / MB,
    }


def bench_codec(size_mb: int, repeats: int) -> dict[str, Any]:
    width = 4096
    rows = size_mb * MB // (width * 2)
    x = torch.randn(rows, width).to(torch.bfloat16)
    meta = BlobMeta("bench", torch.bfloat16, (rows, width), "ns", "p")
    blob = encode_blob(x, meta)
    stock = safetensors.torch.save({"ec_cache": x})
    expect = BlobExpectation("bench", "ns", torch.bfloat16, rows, width, max_bytes=1 << 34)
    n = x.numel() * 2
    out = {
        "ec_s3_encode": _summary(_timed(lambda: encode_blob(x, meta), repeats), n),
        "safetensors_save": _summary(_timed(lambda: safetensors.torch.save({"ec_cache": x}), repeats), n),
        "ec_s3_decode": _summary(_timed(lambda: decode_blob(blob, expect).tensor, repeats), n),
        "safetensors_load": _summary(_timed(lambda: safetensors.torch.load(stock)["ec_cache"], repeats), n),
    }
    out["encode_speedup"] = out["safetensors_save"]["median_s"] / out["ec_s3_encode"]["median_s"]
    out["decode_speedup"] = out["safetensors_load"]["median_s"] / out["ec_s3_decode"]["median_s"]
    return out


async def _raw_round_trip(session: aioboto3.Session, url: str, bucket: str, data: bytes, repeats: int) -> tuple[list[float], list[float]]:
    puts, gets = [], []
    async with session.client("s3", endpoint_url=url, region_name="us-east-1") as client:
        for i in range(repeats):
            key = f"raw/{len(data)}/{i}"
            started = time.perf_counter()
            await client.put_object(Bucket=bucket, Key=key, Body=data)
            puts.append(time.perf_counter() - started)
            started = time.perf_counter()
            resp = await client.get_object(Bucket=bucket, Key=key)
            await resp["Body"].read()
            gets.append(time.perf_counter() - started)
    return puts, gets


def bench_store(url: str, creds: S3Credentials, size_mb: int, repeats: int) -> dict[str, Any]:
    bucket = "bench"
    config = ECS3Config.from_extra_config(
        {"bucket": bucket, "endpoint_url": url, "access_key_id": creds.access_key_id,
         "secret_access_key": creds.secret_access_key, "max_blob_bytes": 1 << 34},
        environ={},
    )
    store = S3Store(config)
    store.run(store.create_bucket_async())
    data = bytearray(os.urandom(size_mb * MB))
    puts, gets = [], []
    for i in range(repeats):
        key = f"ec/{size_mb}/{time.time_ns()}/{i}"
        started = time.perf_counter()
        store.run(store.put_async(key, data))
        puts.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.run(store.get_async(key))
        gets.append(time.perf_counter() - started)
    session = aioboto3.Session(aws_access_key_id=creds.access_key_id, aws_secret_access_key=creds.secret_access_key)
    raw_puts, raw_gets = store.background.run(_raw_round_trip(session, url, bucket, bytes(data), repeats))
    store.close()
    n = len(data)
    out = {
        "ec_s3_put": _summary(puts, n),
        "raw_aioboto3_put": _summary(raw_puts, n),
        "ec_s3_get": _summary(gets, n),
        "raw_aioboto3_get": _summary(raw_gets, n),
    }
    out["put_speedup"] = out["raw_aioboto3_put"]["median_s"] / out["ec_s3_put"]["median_s"]
    out["get_speedup"] = out["raw_aioboto3_get"]["median_s"] / out["ec_s3_get"]["median_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "codec_store.json")
    args = parser.parse_args()

    server = None
    if args.endpoint_url:
        url = args.endpoint_url
        creds = S3Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    else:
        print("starting SeaweedFS ...", file=sys.stderr)
        server = EmbeddedS3Server().start()
        url, creds = server.endpoint_url, server.credentials
    results: dict[str, Any] = {"sizes_mb": args.sizes_mb, "repeats": args.repeats, "codec": {}, "store": {}}
    try:
        for size in args.sizes_mb:
            print(f"codec {size} MB ...", file=sys.stderr)
            results["codec"][str(size)] = bench_codec(size, args.repeats)
            print(f"store {size} MB ...", file=sys.stderr)
            results["store"][str(size)] = bench_store(url, creds, size, args.repeats)
    finally:
        if server is not None:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"{'size':>6} {'measure':<22} {'ec-s3 MB/s':>11} {'baseline MB/s':>14} {'ratio':>6}")
    for size in args.sizes_mb:
        c, s = results["codec"][str(size)], results["store"][str(size)]
        rows = [
            ("encode vs st.save", c["ec_s3_encode"], c["safetensors_save"], c["encode_speedup"]),
            ("decode vs st.load", c["ec_s3_decode"], c["safetensors_load"], c["decode_speedup"]),
            ("PUT vs raw aioboto3", s["ec_s3_put"], s["raw_aioboto3_put"], s["put_speedup"]),
            ("GET vs raw aioboto3", s["ec_s3_get"], s["raw_aioboto3_get"], s["get_speedup"]),
        ]
        for name, ours, base, ratio in rows:
            print(f"{size:>4}MB {name:<22} {ours['mb_per_s']:>11.0f} {base['mb_per_s']:>14.0f} {ratio:>5.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

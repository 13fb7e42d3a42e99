"""``ec-s3 bench``: a quick PUT/GET throughput and latency check through the store.

Owns the transfer check (random blobs PUT, read back, compared, deleted under the
probe area), its latency summary and its printing. Does not own the benchmarks of
``bench/`` (which compare clients and code paths), nor retries (the store's).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.common import Outcome, Progress, add_command, format_bytes, no_progress, opened_store
from ec_s3.cli.console import EXIT_FAIL, EXIT_OK, ProgressBar, fail, json_out, out, print_diagnosis, where
from ec_s3.cli.listing import key_root
from ec_s3.store.client import S3Store

__all__ = ["TransferReport", "latency_summary", "register", "transfer_check", "transfer_check_async"]

T = TypeVar("T")


@dataclasses.dataclass
class TransferReport(Outcome):
    size_bytes: int
    count: int
    concurrency: int
    put_latencies_ms: list[float] = dataclasses.field(default_factory=list)
    get_latencies_ms: list[float] = dataclasses.field(default_factory=list)
    put_wall_s: float = 0.0
    get_wall_s: float = 0.0
    # The untimed first request (a HEAD): the client's start-up and the first connection,
    # which a process pays once and which would otherwise skew a short run's PUT rate.
    first_request_ms: float = 0.0
    verified: bool = False  # every GET returned the bytes PUT
    cleaned_up: bool = False

    @property
    def put_mib_s(self) -> float:
        return _rate(self.size_bytes * len(self.put_latencies_ms), self.put_wall_s)

    @property
    def get_mib_s(self) -> float:
        return _rate(self.size_bytes * len(self.get_latencies_ms), self.get_wall_s)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ok=self.ok, put_mib_s=self.put_mib_s, get_mib_s=self.get_mib_s,
                 put=latency_summary(self.put_latencies_ms), get=latency_summary(self.get_latencies_ms))
        return d


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / (1 << 20) / seconds if seconds > 0 else 0.0


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {"min": ordered[0], "p50": pct(50), "p90": pct(90), "max": ordered[-1],
            "mean": sum(ordered) / len(ordered)}


async def _timed_each(phase: str, keys: list[str], call: Callable[[str], Awaitable[T]], sem: asyncio.Semaphore,
                      latencies_ms: list[float], progress: Progress) -> list[T]:
    """``call`` on every key, at most ``sem``'s count at once, each one timed."""
    done = 0
    progress(phase, 0, len(keys))

    async def one(key: str) -> T:
        nonlocal done
        async with sem:
            t0 = time.perf_counter()
            result = await call(key)
            latencies_ms.append((time.perf_counter() - t0) * 1000.0)
            done += 1
            progress(phase, done, len(keys))
            return result

    return list(await asyncio.gather(*(one(k) for k in keys)))


async def transfer_check_async(store: S3Store, size_bytes: int, count: int, *, concurrency: int = 1,
                               progress: Progress | None = None, key_prefix: str | None = None) -> TransferReport:
    if size_bytes < 1 or count < 1 or concurrency < 1:
        raise ValueError("size_bytes, count and concurrency must be >= 1")
    progress = progress or no_progress
    report = TransferReport(size_bytes=size_bytes, count=count, concurrency=concurrency)
    base = key_prefix or (f"{key_root(store.config.prefix)}{PROBE_NAMESPACE}/"
                          f"bench-{int(time.time())}-{secrets.token_hex(4)}")
    keys = [f"{base}/{i:04d}.bin" for i in range(count)]
    body = bytearray(os.urandom(size_bytes))
    sem = asyncio.Semaphore(concurrency)
    written: list[str] = []

    async def put(key: str) -> None:
        await store.put_async(key, body)
        written.append(key)

    async def get(key: str) -> bool:
        # bytearray == memoryview is one memcmp; memoryview == bytearray unpacks and
        # compares byte by byte, on the loop and inside the timed phase: at 8 in
        # flight that cost, not the GETs, set the reported rate.
        return body == await store.get_async(key)

    op = "HEAD"
    try:
        t0 = time.perf_counter()
        await store.head_async(keys[0])
        report.first_request_ms = (time.perf_counter() - t0) * 1000.0
        op, t0 = "PUT", time.perf_counter()
        await _timed_each("put", keys, put, sem, report.put_latencies_ms, progress)
        report.put_wall_s = time.perf_counter() - t0
        op, t0 = "GET", time.perf_counter()
        report.verified = all(await _timed_each("get", keys, get, sem, report.get_latencies_ms, progress))
        report.get_wall_s = time.perf_counter() - t0
        if not report.verified:
            report.error = "a GET returned different bytes than were PUT"
    except Exception as exc:  # noqa: BLE001
        report.record_failure(exc, store.config, op=op)
    finally:
        if written:
            try:
                await store.delete_many_async(written)
                report.cleaned_up = True
            except Exception as exc:  # noqa: BLE001
                report.error = report.error or f"could not delete the bench objects under {base}/: {exc}"
        else:
            report.cleaned_up = True
    return report


def transfer_check(store: S3Store, size_bytes: int, count: int, *, concurrency: int = 1,
                   progress: Progress | None = None, key_prefix: str | None = None) -> TransferReport:
    """PUT then GET ``count`` random blobs of ``size_bytes`` through ``store`` (``concurrency``
    at a time), verify the bytes, delete them, and report latencies and MiB/s."""
    return store.run(transfer_check_async(store, size_bytes, count, concurrency=concurrency,
                                          progress=progress, key_prefix=key_prefix), None)


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    if args.size_mb <= 0 or args.count < 1 or args.concurrency < 1:
        return fail("--size-mb must be > 0, --count and --concurrency >= 1")
    with opened_store(args) as store:
        size = max(1, int(args.size_mb * (1 << 20)))
        if not args.json:
            out(f"bench {where(store.config)}: {args.count} x {format_bytes(size)}, "
                f"concurrency {args.concurrency}")
        with ProgressBar.for_args(args) as progress:
            report = transfer_check(store, size, args.count, concurrency=args.concurrency, progress=progress)
        if args.json:
            json_out(report.to_dict())
            return EXIT_OK if report.ok else EXIT_FAIL
        for name, lat, rate in (("PUT", report.put_latencies_ms, report.put_mib_s),
                                ("GET", report.get_latencies_ms, report.get_mib_s)):
            if not lat:
                continue
            s = latency_summary(lat)
            out(f"  {name}  {rate:8.1f} MiB/s   latency ms: p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  "
                f"min {s['min']:.1f}  max {s['max']:.1f}")
        out(f"  first request {report.first_request_ms:.1f} ms (client start-up and first connection; not in the rates)")
        out(f"  verified {report.verified}; bench objects deleted: {report.cleaned_up}")
        if not report.ok:
            if report.diagnosis is not None:
                print_diagnosis(report.diagnosis)
            else:
                out(f"FAIL: {report.error}")
            return EXIT_FAIL
        return EXIT_OK


def register(sub: Any) -> None:
    p = add_command(
        sub, "bench", help="quick PUT/GET throughput and latency check", func=run,
        description="PUT then GET --count random blobs of --size-mb MiB under <prefix>/_ec_s3_probe/, "
                    "verify the bytes, print MiB/s and latencies, and delete them.",
        namespace_help="(unused by bench)",
    )
    p.add_argument("--size-mb", type=float, default=8.0, help="MiB per blob (default 8)")
    p.add_argument("--count", type=int, default=5, help="number of blobs (default 5)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1: per-request latency)")

"""Transfer throughput producer -> store -> consumer: ec-s3's S3Store vs raw clients.

For each blob size (a fresh SeaweedFS each, so its memory stays small) and each
concurrency, every client PUTs the same encoded blob under ``n`` keys with ``c``
transfers in flight, then GETs them back into memory, then deletes them. Clients:

* ``ec-s3``: ``S3Store.put_async`` of an encoded blob and ``S3Store.get_async`` into a
  buffer (what ``BlobPublisher`` and ``ItemFetcher`` do), default ec-s3 config;
* ``boto-default``: raw aioboto3 with botocore defaults (``put_object``, ``get_object`` + ``read``);
* ``boto-tuned``: raw aioboto3 with payload signing off, checksums ``when_required``, 64 connections;
* ``obstore``: the Rust ``object_store`` client (``unsigned_payload``, its default
  multipart PUT for large bodies, single GET).

Then, over an emulated link (``ec_s3.sandbox.netem``: ``loopback`` only relays,
``standard`` and ``express`` add S3's first byte and bandwidth caps), the time of one
GET of one blob (1 in flight) of a size the reader knows: ec-s3 (``ec-s3-unsized``:
without the size), obstore's parallel 2 MiB ranges, and the limit (first byte + size ÷
the NIC's rate), every client in the same run.

Retired by issue 35 (git history has them): raw aiohttp, a BufferedProtocol GET, vLLM's
``ECExampleConnector``. Clients run on one asyncio loop thread, rotated per repeat. CPU:
this process's ``process_time`` (all threads) and the server's, per GiB moved.

    .venv/bin/python -m bench.transfer [--quick] [--sizes-mib 1 8 32 64] [--concurrency 1 8 32]
        [--links loopback standard express] [--link-sizes-mib 10 34]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

if __name__ == "__main__":  # a run, before vLLM is imported; imported for run_all's rows, os.environ stays
    bl.setup_env()

import torch  # noqa: E402

from ec_s3.blob.codec import BlobMeta, encode_blob  # noqa: E402
from ec_s3.sandbox.netem import PROFILES, NetEm, limit_s  # noqa: E402
from ec_s3.store.client import S3Store  # noqa: E402

WIDTH = 4096  # bf16 rows of 8 KiB
MEASURES = ["ec_s3/sandbox/netem.py"]  # the link, in a process of its own
OBSTORE_RANGE = 2 * bl.MiB


# --------------------------------------------------------------------------- clients


class Client:
    name = "?"

    async def setup(self) -> None: ...

    async def put(self, key: str, body: Any) -> None:
        raise NotImplementedError

    async def get(self, key: str) -> int:
        raise NotImplementedError

    async def delete(self, key: str) -> None: ...

    async def close(self) -> None: ...


class EcS3Client(Client):
    name = "ec-s3"

    def __init__(self, ep: bl.Endpoint, bucket: str) -> None:
        self.store = S3Store(ep.config(bucket, max_blob_bytes=1 << 31))

    async def put(self, key: str, body: Any) -> None:
        await self.store.put_async(key, body)

    async def get(self, key: str) -> int:
        buf = await self.store.get_async(key)
        return len(buf)

    async def delete(self, key: str) -> None:
        await self.store.delete_async(key)

    async def get_sized(self, key: str, size: int) -> int:
        return len(await self.store.get_async(key, expected_size=size))


class BotoClient(Client):
    def __init__(self, ep: bl.Endpoint, bucket: str, tuned: bool) -> None:
        self.name = "boto-tuned" if tuned else "boto-default"
        self.ep, self.bucket, self.tuned = ep, bucket, tuned
        self._stack: Any = None

    async def setup(self) -> None:
        import contextlib

        import aioboto3
        from aiobotocore.config import AioConfig

        session = aioboto3.Session(aws_access_key_id=self.ep.access_key_id, aws_secret_access_key=self.ep.secret_access_key)
        config = AioConfig(s3={"addressing_style": "path", "payload_signing_enabled": False},
                           request_checksum_calculation="when_required", response_checksum_validation="when_required",
                           max_pool_connections=64) if self.tuned else None
        self._stack = contextlib.AsyncExitStack()
        self.client = await self._stack.enter_async_context(
            session.client("s3", endpoint_url=self.ep.url, region_name="us-east-1", config=config))

    async def put(self, key: str, body: Any) -> None:
        await self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    async def get(self, key: str) -> int:
        resp = await self.client.get_object(Bucket=self.bucket, Key=key)
        async with resp["Body"] as stream:
            data = await stream.read()
        return len(data)

    async def delete(self, key: str) -> None:
        await self.client.delete_object(Bucket=self.bucket, Key=key)

    async def close(self) -> None:
        await self._stack.aclose()


class ObstoreClient(Client):
    name = "obstore"

    def __init__(self, ep: bl.Endpoint, bucket: str) -> None:
        from obstore.store import S3Store as ObS3Store

        self.store = ObS3Store(bucket, endpoint=ep.url, access_key_id=ep.access_key_id,
                               secret_access_key=ep.secret_access_key, region="us-east-1",
                               virtual_hosted_style_request=False, unsigned_payload=True,
                               client_options={"allow_http": True, "pool_max_idle_per_host": "64"})

    async def put(self, key: str, body: Any) -> None:
        import obstore

        await obstore.put_async(self.store, key, body)

    async def get(self, key: str) -> int:
        import obstore

        result = await obstore.get_async(self.store, key)
        data = await result.bytes_async()
        return len(memoryview(data))

    async def delete(self, key: str) -> None:
        import obstore

        await obstore.delete_async(self.store, key)

    async def get_sized(self, key: str, size: int) -> int:
        """Parallel ranges of a known size, what obstore's users do across a network."""
        import obstore

        parts = await asyncio.gather(*(obstore.get_range_async(self.store, key, start=s, end=min(s + OBSTORE_RANGE, size))
                                       for s in range(0, size, OBSTORE_RANGE)))
        return sum(len(memoryview(p)) for p in parts)


# --------------------------------------------------------------------------- measurement


async def _run_ops(client: Client, op: str, keys: list[str], body: Any, conc: int) -> int:
    sem = asyncio.Semaphore(conc)
    moved = 0

    async def one(key: str) -> None:
        nonlocal moved
        async with sem:
            if op == "put":
                await client.put(key, body)
                moved += len(memoryview(body)) if body is not None else 0
            elif op == "get":
                n = await client.get(key)  # not `moved += await ...`: that reads moved before awaiting
                moved += n
            else:
                await client.delete(key)

    await asyncio.gather(*(one(k) for k in keys))
    return moved


def run_cell(bg: Any, ep: bl.Endpoint, client: Client, size: int, conc: int, n_obj: int, body: Any, tag: str) -> dict[str, Any]:
    keys = [f"bench/{client.name}/{tag}/{i:04d}" for i in range(n_obj)]
    out: dict[str, Any] = {}
    for op in ("put", "get"):
        with bl.Meter(ep) as m:
            moved = bg.run(_run_ops(client, op, keys, body, conc), timeout=900)
        expect = n_obj * size
        if moved != expect:
            raise RuntimeError(f"{client.name} {op}: moved {moved} bytes, expected {expect}")
        gib = expect / bl.GiB
        out[op] = {"wall_s": m.wall, "mib_per_s": expect / bl.MiB / m.wall, "client_cpu_s_per_gib": m.cpu / gib,
                   "client_rusage_cpu_s_per_gib": m.rusage_cpu / gib,
                   "server_cpu_s_per_gib": None if m.server_cpu is None else m.server_cpu / gib}
    bg.run(_run_ops(client, "delete", keys, None, 16), timeout=300)
    return out


def make_clients(ep: bl.Endpoint, bucket: str, names: list[str]) -> list[Client]:
    makers = {
        "ec-s3": lambda: EcS3Client(ep, bucket),
        "boto-default": lambda: BotoClient(ep, bucket, tuned=False),
        "boto-tuned": lambda: BotoClient(ep, bucket, tuned=True),
        "obstore": lambda: ObstoreClient(ep, bucket),
    }
    clients = []
    for name in names:
        try:
            clients.append(makers[name]())
        except ImportError as exc:
            bl.log(f"skipping {name}: {exc}")
    return clients


def bench_size(size_mib: int, concs: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from ec_s3.loop import shared_loop

    blob = _blob(size_mib)
    size = len(blob)
    body_bytes = bytes(blob)  # raw clients get immutable bytes (what aioboto3 users pass)
    result: dict[str, Any] = {"blob_bytes": size, "cells": {}}
    with bl.s3_endpoint(f"xfer{size_mib}") as ep:
        bucket = bl.create_bucket(ep)
        bg = shared_loop()
        clients = make_clients(ep, bucket, args.clients)
        for c in clients:
            bg.run(c.setup(), timeout=120)
            # warm-up: connections, credentials, code paths
            bg.run(_run_ops(c, "put", [f"warm/{c.name}"], blob if c.name.startswith("ec-s3") else body_bytes, 1), timeout=120)
            bg.run(_run_ops(c, "get", [f"warm/{c.name}"], None, 1), timeout=120)
            bg.run(_run_ops(c, "delete", [f"warm/{c.name}"], None, 1), timeout=120)
        for conc in concs:
            if size_mib * conc > args.max_inflight_mib:
                bl.log(f"  {size_mib} MiB x{conc}: skipped ({size_mib * conc} MiB in flight > --max-inflight-mib)")
                continue
            n_obj = max(conc, math.ceil(args.min_bytes_mib * bl.MiB / size))
            n_obj = math.ceil(n_obj / conc) * conc
            cell: dict[str, list[dict[str, Any]]] = {}
            for rep in range(args.repeats):
                order = clients[rep % len(clients):] + clients[: rep % len(clients)]
                for c in order:
                    body = blob if c.name.startswith("ec-s3") else body_bytes
                    r = run_cell(bg, ep, c, size, conc, n_obj, body, f"{conc}-{rep}")
                    cell.setdefault(c.name, []).append(r)
            rss = ep.server_rss()
            result["cells"][str(conc)] = {"n_objects": n_obj, "runs": cell, "server_rss_after": rss}
            msg = ", ".join(f"{name} {statistics.median(r['put']['mib_per_s'] for r in runs):.0f}/"
                            f"{statistics.median(r['get']['mib_per_s'] for r in runs):.0f}"
                            for name, runs in cell.items())
            bl.log(f"  {size_mib} MiB x{conc} (n={n_obj}) PUT/GET MiB/s: {msg}; server RSS {(rss or 0) / bl.MiB:.0f} MiB")
        for c in clients:
            bg.run(c.close(), timeout=60)
            if isinstance(c, EcS3Client):
                c.store.close()
    return result


def _blob(size_mib: int) -> memoryview:
    rows = size_mib * bl.MiB // (WIDTH * 2)
    tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
    return encode_blob(tensor, BlobMeta("bench", torch.bfloat16, (rows, WIDTH), "ns", "p"))


def bench_links(args: argparse.Namespace) -> dict[str, Any]:
    """GET ms of one blob per link profile, size and client (every client per repeat, rotated)."""
    from ec_s3.loop import shared_loop

    bg, out = shared_loop(), {}
    with bl.s3_endpoint("xferlink") as ep:
        bucket = bl.create_bucket(ep)
        loader = EcS3Client(ep, bucket)
        sizes = {}
        for mib in args.link_sizes_mib:
            blob = _blob(mib)
            sizes[mib] = len(blob)
            bg.run(loader.put(f"link/{mib}", blob), timeout=120)
        loader.store.close()
        for name in args.links:
            profile = PROFILES[name]
            with NetEm(ep.url, profile) as link:
                lep = dataclasses.replace(ep, url=link.endpoint_url)
                clients: list[Any] = [EcS3Client(lep, bucket), ObstoreClient(lep, bucket), EcS3Client(lep, bucket)]
                clients[2].name, clients[2].get_sized = "ec-s3-unsized", lambda key, _size, c=clients[2]: c.get(key)
                cells: dict[str, Any] = {}
                for mib, size in sizes.items():
                    times: dict[str, list[float]] = {c.name: [] for c in clients}
                    for rep in range(1 + args.link_repeats):  # the first: warm-up (connections, code paths)
                        for c in clients[rep % len(clients):] + clients[: rep % len(clients)]:
                            started = time.perf_counter()
                            if bg.run(c.get_sized(f"link/{mib}", size), timeout=120) != size:
                                raise RuntimeError(f"{c.name}: a short GET of link/{mib}")
                            if rep:
                                times[c.name].append((time.perf_counter() - started) * 1000)
                    cells[str(mib)] = {"blob_bytes": size, "limit_ms": limit_s(profile, size) * 1000,
                                       "ms": {n: statistics.median(t) for n, t in times.items()}, "runs_ms": times}
                    bl.log(f"  {name} GET {mib} MiB ms: " + ", ".join(f"{n} {statistics.median(t):.1f}"
                                                                     for n, t in times.items())
                           + f", limit {limit_s(profile, size) * 1000:.1f}")
                for c in clients:
                    if isinstance(c, EcS3Client):
                        c.store.close()
            out[name] = {"profile": dataclasses.asdict(profile), "cells": cells}
    return out


def goal_rows(d: dict[str, Any] | None) -> list[dict[str, str]]:
    """bench/run_all.py's goal rows: GETs over each link (issue 42), and loopback vs the best raw client."""
    rows = []
    for name, link in (d or {}).get("links", {}).items():
        for mib, cell in link["cells"].items():
            ms, limit = cell["ms"], cell["limit_ms"]
            vs_ob = ms["ec-s3"] / ms["obstore"]
            vs_limit = ms["ec-s3"] / limit if limit else None
            ok = vs_ob <= 1.15 and (vs_limit is None or vs_limit <= 1.5)
            rows.append({"goal": "1c. GET over a link", "case": f"{mib} MiB, {name}, 1 in flight, size known",
                         "result": f"ec-s3 {ms['ec-s3']:.1f} ms; obstore ranges {ms['obstore']:.1f} ms ({vs_ob:.2f}x)"
                                   + (f"; limit {limit:.1f} ms ({vs_limit:.2f}x)" if limit else "")
                                   + f"; ec-s3 without the size {ms['ec-s3-unsized']:.1f} ms",
                         "target": "<= 1.15x obstore" + (", <= 1.5x the limit" if limit else ""),
                         "status": "met" if ok else "MISSED", "why": "" if ok else "issue 42"})
    gets = [(cell, r["get"]["ec_s3_vs_best_raw"]) for cell, r in (d or {}).get("summary", {}).items()
            if "ec_s3_vs_best_raw" in r.get("get", {})]
    if gets:
        worst = min(gets, key=lambda x: x[1])
        rows.append({"goal": "1c. GET on loopback", "case": f"every cell ({len(gets)}), MiB x in flight",
                     "result": f"worst {worst[1]:.2f}x the best raw client ({worst[0]})", "target": ">= 0.9x",
                     "status": "met" if worst[1] >= 0.9 else "MISSED", "why": "" if worst[1] >= 0.9 else "issue 42"})
    return rows


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per (size, conc, client, op) and ratios vs the best raw client."""
    raw = ("boto-default", "boto-tuned", "obstore")
    out: dict[str, Any] = {}
    for size, sres in results.items():
        for conc, cres in sres["cells"].items():
            row: dict[str, Any] = {}
            for op in ("put", "get"):
                med = {name: {"mib_per_s": statistics.median(r[op]["mib_per_s"] for r in runs),
                              "mib_per_s_min": min(r[op]["mib_per_s"] for r in runs),
                              "mib_per_s_max": max(r[op]["mib_per_s"] for r in runs),
                              "client_cpu_s_per_gib": statistics.median(r[op]["client_cpu_s_per_gib"] for r in runs),
                              "server_cpu_s_per_gib": _median_or_none([r[op]["server_cpu_s_per_gib"] for r in runs])}
                       for name, runs in cres["runs"].items()}
                best = max((n for n in raw if n in med), key=lambda n: med[n]["mib_per_s"], default=None)
                entry: dict[str, Any] = {"clients": med, "best_raw": best}
                if best and "ec-s3" in med:
                    entry["ec_s3_vs_best_raw"] = med["ec-s3"]["mib_per_s"] / med[best]["mib_per_s"]
                    # per-repeat paired ratios, for the spread
                    ours = [r[op]["mib_per_s"] for r in cres["runs"]["ec-s3"]]
                    theirs = [r[op]["mib_per_s"] for r in cres["runs"][best]]
                    per = [a / b for a, b in zip(ours, theirs)]
                    entry["ec_s3_vs_best_raw_range"] = [min(per), max(per)]
                if "boto-default" in med and "ec-s3" in med:
                    entry["ec_s3_vs_boto-default"] = med["ec-s3"]["mib_per_s"] / med["boto-default"]["mib_per_s"]
                row[op] = entry
            out[f"{size}x{conc}"] = row
    return out


def _median_or_none(vals: list[Any]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def print_tables(summ: dict[str, Any]) -> None:
    for op in ("put", "get"):
        rows = []
        for cell, r in summ.items():
            e = r[op]
            c = e["clients"]
            raw = e.get("best_raw") or ""
            rows.append([cell, c.get("ec-s3", {}).get("mib_per_s"), e.get("best_raw"), c.get(raw, {}).get("mib_per_s"),
                         e.get("ec_s3_vs_best_raw"), e.get("ec_s3_vs_boto-default"),
                         *(c.get(n, {}).get("client_cpu_s_per_gib") for n in ("ec-s3", raw)),
                         c.get("ec-s3", {}).get("server_cpu_s_per_gib")])
        print(bl.table(
            ["MiB x conc", "ec-s3 MiB/s", "best raw", "raw MiB/s", "vs best (goal>=0.9)", "vs boto-def",
             "ec-s3 CPU-s/GiB", "raw CPU-s/GiB", "server CPU-s/GiB"],
            rows, title=f"{op.upper()} throughput (medians; ratio = ec-s3 / baseline)"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--min-bytes-mib", type=int, default=None, help="bytes moved per measurement (at least)")
    parser.add_argument("--max-inflight-mib", type=int, default=None,
                        help="skip cells with more than this in flight (bounds client and SeaweedFS memory)")
    parser.add_argument("--clients", nargs="+",
                        default=["ec-s3", "boto-default", "boto-tuned", "obstore"])
    parser.add_argument("--links", nargs="*", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--link-sizes-mib", type=int, nargs="+", default=[10, 34])
    parser.add_argument("--link-repeats", type=int, default=5)
    args = parser.parse_args()
    q = args.quick
    args.sizes_mib = args.sizes_mib or ([1, 8, 32] if q else [1, 8, 32, 64])
    args.concurrency = args.concurrency or ([1, 8] if q else [1, 8, 32])
    args.repeats = args.repeats or (2 if q else 3)
    args.min_bytes_mib = args.min_bytes_mib or (16 if q else 32)
    args.max_inflight_mib = args.max_inflight_mib or (128 if q else 256)

    results: dict[str, Any] = {}
    started = time.monotonic()
    for size in args.sizes_mib:
        bl.log(f"transfer: {size} MiB blobs, concurrency {args.concurrency}, {args.repeats} repeats")
        results[str(size)] = bench_size(size, args.concurrency, args)
    summ = summarize(results)
    links = bench_links(args) if args.links else {}
    bl.write_json("transfer", {"links": links, "params": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
                               "elapsed_s": time.monotonic() - started, "summary": summ, "raw": results,
                               "goal": "ec-s3 >= 0.9x the best raw client (PUT and GET)"}, args.out_dir)
    print_tables(summ)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Transfer throughput producer -> store -> consumer: ec-s3's S3Store vs raw clients.

For each blob size (a fresh SeaweedFS each, so its memory stays small) and each
concurrency, every client PUTs the same encoded blob under ``n`` keys with ``c``
transfers in flight, then GETs them back into memory, then deletes them. Clients:

* ``ec-s3``: ``S3Store.put_async`` of an encoded blob and ``S3Store.get_async`` into a
  buffer (what ``BlobPublisher`` and ``ItemFetcher`` do), default ec-s3 config;
* ``ec-s3-botocore``: the same with ``data_path: botocore``, every request through
  aiobotocore (what ec-s3 did before its direct data path);
* ``boto-default``: raw aioboto3 with botocore defaults (``put_object``, ``get_object`` + ``read``);
* ``boto-tuned``: raw aioboto3 with payload signing off, checksums ``when_required``, 64 connections;
* ``obstore``: the Rust ``object_store`` client (``unsigned_payload``, its default
  multipart PUT for large bodies, single GET).

Retired by issue 35 (git history has them): raw aiohttp, a BufferedProtocol GET, vLLM's
``ECExampleConnector``. Clients run on one asyncio loop thread, rotated per repeat. CPU:
this process's ``process_time`` (all threads) and the server's, per GiB moved.

    .venv/bin/python -m bench.transfer [--quick] [--sizes-mib 1 8 32 64] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
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
from ec_s3.store.client import S3Store  # noqa: E402

WIDTH = 4096  # bf16 rows of 8 KiB


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

    def __init__(self, ep: bl.Endpoint, bucket: str, data_path: str = "direct") -> None:
        if data_path != "direct":
            self.name = f"ec-s3-{data_path}"
        self.store = S3Store(ep.config(bucket, max_blob_bytes=1 << 31, data_path=data_path))

    async def put(self, key: str, body: Any) -> None:
        await self.store.put_async(key, body)

    async def get(self, key: str) -> int:
        buf = await self.store.get_async(key)
        return len(buf)

    async def delete(self, key: str) -> None:
        await self.store.delete_async(key)


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
        "ec-s3-botocore": lambda: EcS3Client(ep, bucket, "botocore"),
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

    rows = size_mib * bl.MiB // (WIDTH * 2)
    tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
    blob = encode_blob(tensor, BlobMeta("bench", torch.bfloat16, (rows, WIDTH), "ns", "p"))
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
                for base in ("boto-default", "ec-s3-botocore"):
                    if base in med and "ec-s3" in med:
                        entry[f"ec_s3_vs_{base}"] = med["ec-s3"]["mib_per_s"] / med[base]["mib_per_s"]
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
                         e.get("ec_s3_vs_best_raw"), e.get("ec_s3_vs_boto-default"), e.get("ec_s3_vs_ec-s3-botocore"),
                         *(c.get(n, {}).get("client_cpu_s_per_gib") for n in ("ec-s3", "ec-s3-botocore", raw)),
                         c.get("ec-s3", {}).get("server_cpu_s_per_gib")])
        print(bl.table(
            ["MiB x conc", "ec-s3 MiB/s", "best raw", "raw MiB/s", "vs best (goal>=0.9)", "vs boto-def",
             "vs ec-s3-botocore", "ec-s3 CPU-s/GiB", "ec-s3-botocore CPU-s/GiB", "raw CPU-s/GiB", "server CPU-s/GiB"],
            rows, title=f"{op.upper()} throughput (medians; ratio = ec-s3 / baseline)"))


def plot(summ: dict[str, Any], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    cells = list(summ)
    names = ["ec-s3", "ec-s3-botocore", "boto-default", "boto-tuned", "obstore"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, op in enumerate(("put", "get")):
        ax = axes[0][col]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [summ[c][op]["clients"].get(name, {}).get("mib_per_s", 0) for c in cells]
            lo = [y - summ[c][op]["clients"].get(name, {}).get("mib_per_s_min", y) for c, y in zip(cells, ys)]
            hi = [summ[c][op]["clients"].get(name, {}).get("mib_per_s_max", y) - y for c, y in zip(cells, ys)]
            ax.bar([x + i * width for x in range(len(cells))], ys, width, yerr=[lo, hi], label=name, capsize=2)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cells))], [c.replace("x", " MiB\nx") for c in cells], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("MiB/s, log scale (median, bars: min-max)")
        ax.set_title(f"{op.upper()} throughput by blob size x concurrency")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ratios = [summ[c][op].get("ec_s3_vs_best_raw") or 0 for c in cells]
        ax.bar(range(len(cells)), ratios, color="tab:blue")
        ax.axhline(0.9, color="red", ls="--", label="goal 0.9x")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(cells)), [c.replace("x", " MiB\nx") for c in cells], fontsize=7)
        ax.set_ylabel("ec-s3 / best raw client")
        ax.set_title(f"{op.upper()}: ec-s3 vs best raw client (same run)")
        ax.legend(fontsize=7)
    bl.save_fig(fig, "transfer", out_dir)


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
                        default=["ec-s3", "ec-s3-botocore", "boto-default", "boto-tuned", "obstore"])
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
    bl.write_json("transfer", {"params": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
                               "elapsed_s": time.monotonic() - started, "summary": summ, "raw": results,
                               "goal": "ec-s3 >= 0.9x the best raw client (PUT and GET)"}, args.out_dir)
    print_tables(summ)
    if not args.no_plot:
        plot(summ, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-request cost of small S3 requests: what ec-s3 pays per HEAD, PUT and GET of a blob
the size this host's goodput runs move (the tiny LLaVA's 64 x 128 bf16 image, 16 KiB),
against obstore (the Rust ``object_store`` client) in the same run (issue 26 item 3:
where the time goes, per-request CPU on the I/O thread).

For each client and concurrency: ``--ops`` HEADs of missing keys (the producer's and the
consumer's lookup of a new item), PUTs of the blob under new keys (``If-None-Match: *``
for ec-s3, obstore's create mode: both conditional), then GETs of them. Clients:
``ec-s3`` and ``obstore``, rotated per repeat, on one asyncio loop. Per operation: this
process's CPU (all threads; the clients run nothing else), wall time and the S3 server's
CPU. Ratios: ec-s3 over obstore, per repeat, then the median. And the CPU of one request's
SigV4 signature, ec-s3's (:mod:`ec_s3.store.sigv4`) against botocore's ``S3SigV4Auth``,
which signed every request before ec-s3 signed its own.

    .venv/bin/python -m bench.small_ops [--quick] [--size-kib 16] [--ops 300] [--concurrency 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from bench import benchlib as bl

OPS = ("head", "put", "get")
WIDTH = 128  # the tiny LLaVA's hidden size (bench/goodput.py's HEAVY_VISION)


class EcS3Ops:
    def __init__(self, ep: bl.Endpoint, bucket: str) -> None:
        from ec_s3.store.client import S3Store

        self.name = "ec-s3"
        self.store = S3Store(ep.config(bucket))

    async def head(self, key: str) -> None:
        if await self.store.head_async(key) is not None:
            raise RuntimeError(f"{self.name}: {key} should be missing")

    async def put(self, key: str, body: Any) -> None:
        await self.store.put_async(key, body)

    async def get(self, key: str) -> int:
        return len(await self.store.get_async(key))

    def close(self) -> None:
        self.store.close()


class ObstoreOps:
    name = "obstore"

    def __init__(self, ep: bl.Endpoint, bucket: str) -> None:
        from bench.transfer import ObstoreClient  # the same store settings as the throughput bench

        self.store = ObstoreClient(ep, bucket).store

    async def head(self, key: str) -> None:
        import obstore

        try:
            await obstore.head_async(self.store, key)
        except FileNotFoundError:
            return
        raise RuntimeError(f"obstore: {key} should be missing")

    async def put(self, key: str, body: Any) -> None:
        import obstore

        await obstore.put_async(self.store, key, body, mode="create")

    async def get(self, key: str) -> int:
        import obstore

        result = await obstore.get_async(self.store, key)
        return len(memoryview(await result.bytes_async()))

    def close(self) -> None: ...


async def _ops(client: Any, op: str, keys: list[str], body: Any, conc: int) -> None:
    sem = asyncio.Semaphore(conc)
    size = len(memoryview(body))

    async def one(key: str) -> None:
        async with sem:
            if op == "head":
                await client.head(key + "-missing")
            elif op == "put":
                await client.put(key, body)
            elif await client.get(key) != size:
                raise RuntimeError(f"{client.name}: GET {key} returned the wrong size")

    await asyncio.gather(*(one(k) for k in keys))


def _cell(bg: Any, ep: bl.Endpoint, client: Any, body: Any, keys: list[str], conc: int) -> dict[str, dict[str, float]]:
    out = {}
    for op in OPS:
        with bl.Meter(ep) as m:
            bg.run(_ops(client, op, keys, body, conc), timeout=600)
        n = len(keys)
        out[op] = {"client_cpu_ms": 1e3 * m.cpu / n, "wall_ms": 1e3 * m.wall / n,
                   "server_cpu_ms": None if m.server_cpu is None else 1e3 * m.server_cpu / n}
    return out


def signing_cost(n: int = 2000) -> dict[str, float]:
    """CPU per signature (ms) of the direct path's SigV4 and of botocore's S3SigV4Auth,
    which it replaced, for one PUT's headers: the part of a request's client CPU that
    signing is."""
    import datetime

    from ec_s3.store.sigv4 import signed_headers
    from tests.support.botocore_sigv4 import botocore_signed_headers

    url = "http://127.0.0.1:8333/bucket/bench/ns/0123456789abcdef.safetensors"
    headers = {"If-None-Match": "*", "Content-Type": "application/octet-stream", "Content-Length": "16680",
               "x-amz-meta-ec-s3-crc32": "deadbeef", "x-amz-meta-ec-s3-write": "0123456789abcdef",
               "Accept-Encoding": "identity"}
    creds = {"access_key": "AKIDEXAMPLE", "secret_key": "secret", "token": None, "region": "us-east-1"}
    now = datetime.datetime.now(datetime.timezone.utc)

    def ours() -> None:
        signed_headers("PUT", url, headers, **creds, now=now)

    def botocores() -> None:
        botocore_signed_headers("PUT", url, headers, **creds)

    out = {}
    for name, fn in (("ec-s3", ours), ("botocore", botocores), ("ec-s3 again", ours)):
        with bl.Meter() as m:
            for _ in range(n):
                fn()
        out[name] = 1e3 * m.cpu / n
    return {"ec_s3_ms": min(out["ec-s3"], out["ec-s3 again"]), "botocore_ms": out["botocore"]}


def make_clients(ep: bl.Endpoint, bucket: str) -> list[Any]:
    clients: list[Any] = [EcS3Ops(ep, bucket)]
    try:
        clients.append(ObstoreOps(ep, bucket))
    except ImportError as exc:
        bl.log(f"small_ops: no obstore ({exc}): pip install -e '.[bench]'; ratios need it")
    return clients


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ec_s3.blob.codec import BlobMeta, encode_blob
    from ec_s3.loop import shared_loop

    rows = max(1, args.size_kib * 1024 // (WIDTH * 2))
    tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
    blob = encode_blob(tensor, BlobMeta("bench", torch.bfloat16, (rows, WIDTH), "ns", "p"))
    raw = bytes(blob)  # obstore gets immutable bytes
    runs: dict[str, dict[str, list[dict[str, dict[str, float]]]]] = {}
    with bl.s3_endpoint("smallops") as ep:
        bucket = bl.create_bucket(ep)
        bg = shared_loop()
        clients = make_clients(ep, bucket)
        try:
            for c in clients:  # warm-up: connections, credentials, code paths
                body = raw if c.name == "obstore" else blob
                _cell(bg, ep, c, body, [f"warm/{c.name}/{i}" for i in range(8)], 8)
            for conc in args.concurrency:
                for rep in range(args.repeats):
                    for c in clients[rep % len(clients):] + clients[: rep % len(clients)]:
                        keys = [f"ops/{c.name}/{conc}/{rep}/{i:05d}" for i in range(args.ops)]
                        r = _cell(bg, ep, c, raw if c.name == "obstore" else blob, keys, conc)
                        runs.setdefault(str(conc), {}).setdefault(c.name, []).append(r)
                bl.log(f"small_ops: x{conc}: " + "; ".join(
                    f"{name} " + "/".join(f"{statistics.median(r[op]['client_cpu_ms'] for r in rs):.2f}" for op in OPS)
                    for name, rs in runs[str(conc)].items()) + " ms client CPU per HEAD/PUT/GET")
        finally:
            for c in clients:
                c.close()
    return {"blob_bytes": len(blob), "ops": args.ops, "repeats": args.repeats, "runs": runs,
            "summary": summarize(runs), "signing": signing_cost(), "environment": bl.environment()}


def summarize(runs: dict[str, dict[str, list[dict[str, dict[str, float]]]]]) -> dict[str, Any]:
    """Per concurrency, client and operation: medians over repeats, and for ec-s3's clients
    the median over repeats of their ratio to obstore's (same repeat)."""
    out: dict[str, Any] = {}
    for conc, by_client in runs.items():
        base = by_client.get("obstore")
        for name, rs in by_client.items():
            for op in OPS:
                e: dict[str, Any] = {k: statistics.median(r[op][k] for r in rs)
                                     for k in ("client_cpu_ms", "wall_ms") if rs}
                if base is not None and name != "obstore":
                    for k in ("client_cpu_ms", "wall_ms"):
                        e[f"{k}_vs_obstore"] = statistics.median(
                            r[op][k] / b[op][k] for r, b in zip(rs, base) if b[op][k] > 0)
                out.setdefault(conc, {}).setdefault(name, {})[op] = e
    return out


def print_table(d: dict[str, Any]) -> None:
    rows = []
    for conc, by_client in d["summary"].items():
        for name, ops in by_client.items():
            for op, e in ops.items():
                rows.append([f"x{conc}", name, op, f"{e['client_cpu_ms']:.2f}", f"{e['wall_ms']:.2f}",
                             f"{e['client_cpu_ms_vs_obstore']:.2f}x" if "client_cpu_ms_vs_obstore" in e else "-",
                             f"{e['wall_ms_vs_obstore']:.2f}x" if "wall_ms_vs_obstore" in e else "-"])
    print(bl.table(["in flight", "client", "op", "client CPU ms/op", "wall ms/op", "CPU vs obstore", "wall vs obstore"],
                   rows, title=f"small requests, {d['blob_bytes']} B blobs, {d['ops']} ops x {d['repeats']} repeats"))
    sig = d["signing"]
    print(f"SigV4 per request: ec-s3 {sig['ec_s3_ms']:.3f} ms CPU, botocore's S3SigV4Auth {sig['botocore_ms']:.3f} ms")


def measurement_rows(d: dict[str, Any] | None) -> list[list[Any]]:
    """Rows of run_all's "every measurement" table."""
    if not d or not d.get("summary"):
        return []
    rows = []
    for conc, by_client in d["summary"].items():
        e = by_client.get("ec-s3") or {}
        if all("client_cpu_ms_vs_obstore" in e.get(op, {}) for op in OPS):
            rows.append(["2b. small requests: ec-s3 / obstore client CPU per HEAD, PUT, GET",
                         f"{d['blob_bytes'] // 1024} KiB x{conc}",
                         ", ".join(f"{e[op]['client_cpu_ms_vs_obstore']:.2f}x ({e[op]['client_cpu_ms']:.2f} ms)"
                                   for op in OPS), "-", ""])
    sig = d.get("signing")
    if sig:
        rows.append(["2b. small requests: SigV4 CPU per request, ec-s3 / botocore's S3SigV4Auth", "one PUT's headers",
                     f"{sig['ec_s3_ms'] / sig['botocore_ms']:.2f}x ({sig['ec_s3_ms']:.3f} vs {sig['botocore_ms']:.3f} ms)",
                     "-", ""])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--size-kib", type=int, default=16)
    parser.add_argument("--ops", type=int, default=None, help="operations per client, op and repeat (default 300, quick 100)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=None, help="default 3, quick 2")
    args = parser.parse_args()
    bl.setup_env()
    args.ops = args.ops or (100 if args.quick else 300)
    args.repeats = args.repeats or (2 if args.quick else 3)
    d = run(args)
    print_table(d)
    bl.write_json("small_ops", d, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Profile one client's PUT or GET path with cProfile (everything on one asyncio loop
in the main thread, so cProfile sees it all), to find where ec-s3 spends CPU.

    .venv/bin/python bench/profile_clients.py --client ec-s3 --op get --size-mib 1 --n 64 --conc 8
    .venv/bin/python bench/profile_clients.py --client boto-default --op get --size-mib 1 --n 64 --conc 8

Clients are bench/transfer.py's (``ec-s3``, ``ec-s3-botocore``: the store with
``data_path: botocore``, ``boto-default``, ``boto-tuned``, ``obstore``, ``aiohttp``).

Prints the top functions by cumulative and by own time, and the CPU-seconds per GiB;
``--out`` also writes the pstats text to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.setup_env()

import torch  # noqa: E402

from ec_s3.blob.codec import BlobMeta, encode_blob  # noqa: E402
from transfer import WIDTH, make_clients  # noqa: E402


async def _ops(client, op, keys, body, conc):
    sem = asyncio.Semaphore(conc)

    async def one(k):
        async with sem:
            if op == "put":
                await client.put(k, body)
            elif op == "get":
                await client.get(k)
            else:
                await client.delete(k)

    await asyncio.gather(*(one(k) for k in keys))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--client", default="ec-s3")
    p.add_argument("--op", choices=["put", "get"], default="get")
    p.add_argument("--size-mib", type=int, default=1)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--conc", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    rows = args.size_mib * bl.MiB // (WIDTH * 2)
    tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
    blob = encode_blob(tensor, BlobMeta("bench", torch.bfloat16, (rows, WIDTH), "ns", "p"))
    body = blob if args.client.startswith("ec-s3") else bytes(blob)
    keys = [f"prof/{i}" for i in range(args.n)]
    with bl.s3_endpoint("prof") as ep:
        bucket = bl.create_bucket(ep)
        (client,) = make_clients(ep, bucket, tensor, [args.client])

        async def run() -> tuple[float, float, float]:
            await client.setup()
            await _ops(client, "put", keys[:2], body, 1)  # warm-up
            await _ops(client, "get", keys[:2], None, 1)
            if args.op == "get":
                await _ops(client, "put", keys, body, args.conc)
            prof = cProfile.Profile()
            c0, w0 = time.process_time(), time.perf_counter()
            prof.enable()
            await _ops(client, args.op, keys, None if args.op == "get" else body, args.conc)
            prof.disable()
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            await client.close()
            if hasattr(client, "store"):  # ec-s3: its pools live on this loop, close them here
                await client.store._aclose(2.0)
            run.prof = prof  # type: ignore[attr-defined]
            return cpu, wall, 0.0

        cpu, wall, _ = asyncio.run(run())
        prof = run.prof  # type: ignore[attr-defined]
    gib = args.n * len(blob) / bl.GiB
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    head = (f"{args.client} {args.op} {args.size_mib} MiB x{args.n} conc {args.conc}: "
            f"{args.n * len(blob) / bl.MiB / wall:.0f} MiB/s, {cpu / gib:.2f} CPU-s/GiB (under cProfile)\n")
    text = head + buf.getvalue()
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

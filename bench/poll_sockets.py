"""Poll sockets: connections opened and sockets left in TIME_WAIT while a consumer waits
1 s for a promised blob, polling a missing key (each GET a 404) at the scheduler's
schedule (``ec_s3.connector.admission.promise_poll_interval``), over http and https.

Each case talks to SeaweedFS through a front of its own on loopback (tests/support/tls.py's
relay; for https it terminates TLS with a certificate of a private CA made here), which counts the
connections it accepts; TIME_WAIT sockets are counted from ``/proc/net/tcp*`` on the
front's port after the wait. ec-s3's direct GET path (store/recv.py) and its botocore
path (aiobotocore's pool: the baseline) run in the same run, interleaved per repeat.
Before issue 18 item 5 every 404 on the direct path closed its connection (a new TCP
and, over https, TLS handshake per poll).

    .venv/bin/python -m bench.poll_sockets [--quick] [--repeats 3] [--wait-s 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

bl.setup_env()
from tests.support.tls import PrivateCA, TLSFront, make_private_ca  # noqa: E402

PATHS = ("direct", "botocore")
SCHEMES = ("http", "https")


class CountingFront(TLSFront):
    """tests/support/tls.py's relay, counting the connections it accepts; plain TCP
    when ``context`` is None."""

    accepted = 0

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await super()._relay(reader, writer)


def time_wait(port: int) -> int:
    """Sockets in TIME_WAIT with ``port`` at either end (loopback: both ends are ours)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "06" and port in (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)):
                count += 1
    return count


def one_wait(ep: bl.Endpoint, bucket: str, path: str, scheme: str, ca: PrivateCA, wait_s: float) -> dict[str, Any]:
    from ec_s3.connector.admission import promise_poll_interval
    from ec_s3.store.client import ObjectNotFound, S3Store

    front = CountingFront(ep.url, ca.server_context() if scheme == "https" else None).start()  # type: ignore[arg-type]
    tls = {"ca_bundle": str(ca.ca_path)} if scheme == "https" else {}
    store = S3Store(ep.config(bucket, endpoint_url=f"{scheme}://127.0.0.1:{front.port}", data_path=path,
                              max_attempts=1, **tls))
    try:
        store.run(store._get_client(), timeout=30)  # the client's build is not the wait's cost
        gets, per_get = 0, []
        started = time.monotonic()
        while (waited := time.monotonic() - started) < wait_s:
            t0 = time.monotonic()
            try:
                store.run(store.get_async(f"promised-{gets}"), timeout=30)
            except ObjectNotFound:
                pass
            per_get.append(time.monotonic() - t0)
            gets += 1
            time.sleep(max(0.0, t0 + promise_poll_interval(waited) - time.monotonic()))
    finally:
        store.close()
        front.stop()
    time.sleep(0.2)  # closes settle into TIME_WAIT
    return {"gets": gets, "connections": front.accepted, "time_wait": time_wait(front.port),
            "ms_per_404": bl.summary([t * 1e3 for t in per_get])["median"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--wait-s", type=float, default=1.0)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    samples: dict[str, list[dict[str, Any]]] = {f"{s}/{p}": [] for s in SCHEMES for p in PATHS}
    with bl.s3_endpoint("pollsock") as ep, tempfile.TemporaryDirectory() as tmp:
        bucket = bl.create_bucket(ep)
        ca = make_private_ca(Path(tmp))
        for r in range(repeats):
            order = [(s, p) for s in SCHEMES for p in PATHS]
            for scheme, path in order[r % len(order):] + order[: r % len(order)]:  # rotated per repeat
                result = one_wait(ep, bucket, path, scheme, ca, args.wait_s)
                bl.log(f"{scheme}/{path}: {result}")
                samples[f"{scheme}/{path}"].append(result)
    summary: dict[str, Any] = {}
    for case, rows in samples.items():
        summary[case] = {k: bl.summary([row[k] for row in rows]) for k in ("gets", "connections", "time_wait", "ms_per_404")}
    for scheme in SCHEMES:
        d, b = summary[f"{scheme}/direct"], summary[f"{scheme}/botocore"]
        summary[f"{scheme}/direct"]["ms_per_404_vs_botocore"] = d["ms_per_404"]["median"] / b["ms_per_404"]["median"]
    print(bl.table(["case", "GETs", "connections", "TIME_WAIT", "ms per 404", "vs botocore"],
                   [[c, s["gets"]["median"], s["connections"]["median"], s["time_wait"]["median"],
                     f"{s['ms_per_404']['median']:.2f}", f"{s.get('ms_per_404_vs_botocore', 1.0):.2f}x"]
                    for c, s in summary.items()], title=f"a {args.wait_s:g} s promise wait, {repeats} repeats"))
    bl.write_json("poll_sockets", {"wait_s": args.wait_s, "repeats": repeats, "summary": summary,
                                   "samples": samples, "environment": bl.environment()}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

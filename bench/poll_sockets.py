"""Poll sockets: connections opened and sockets left in TIME_WAIT while a consumer waits
1 s for a promised blob, polling a missing key (each GET a 404) at the scheduler's
schedule (``ec_s3.connector.scheduler.promise_poll_interval``), over http and https.

Each case talks to SeaweedFS through a front of its own on loopback (a byte relay; for
https it terminates TLS with a certificate of a CA made here), which counts the
connections it accepts; TIME_WAIT sockets are counted from ``/proc/net/tcp*`` on the
front's port after the wait. ec-s3's direct GET path (store/recv.py) and its botocore
path (aiobotocore's pool: the baseline) run in the same run, interleaved per repeat.
Before issue 18 item 5 every 404 on the direct path closed its connection (a new TCP
and, over https, TLS handshake per poll).

The TLS front is written here (a few lines of asyncio) rather than taken from
tests/support: that fixture was not on main when this bench was written.

    .venv/bin/python bench/poll_sockets.py [--quick] [--repeats 3] [--wait-s 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.setup_env()

PATHS = ("direct", "botocore")
SCHEMES = ("http", "https")


def make_tls(tmp: Path) -> tuple[ssl.SSLContext, Path]:
    """A CA and a server certificate for 127.0.0.1: (server context, CA file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ec-s3 bench CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_file, cert_file, key_file = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context, ca_file


class Front:
    """A relay on its own thread and loop: accepts on a fresh port (TLS or not),
    opens one upstream connection per accepted one, counts what it accepted."""

    def __init__(self, upstream: str, context: ssl.SSLContext | None) -> None:
        parts = urlsplit(upstream)
        self._up = (parts.hostname, parts.port)
        self._context = context
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self._context))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection(*self._up)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)


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


def one_wait(ep: bl.Endpoint, bucket: str, path: str, scheme: str, tls: tuple[ssl.SSLContext, Path],
             wait_s: float) -> dict[str, Any]:
    from ec_s3.connector.scheduler import promise_poll_interval
    from ec_s3.store.client import ObjectNotFound, S3Store

    front = Front(ep.url, tls[0] if scheme == "https" else None)
    extra = {"data_path": path, "max_attempts": 1}
    if scheme == "https":
        extra["ca_bundle"] = str(tls[1])
    try:
        config = ep.config(bucket, endpoint_url=f"{scheme}://127.0.0.1:{front.port}", **extra)
    except Exception:  # noqa: BLE001 - no ca_bundle key (before issue 18 item 1): not verified
        extra.pop("ca_bundle", None)
        config = ep.config(bucket, endpoint_url=f"{scheme}://127.0.0.1:{front.port}", verify_tls=False, **extra)
    store = S3Store(config)
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
        front.close()
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
        tls = make_tls(Path(tmp))
        for r in range(repeats):
            order = [(s, p) for s in SCHEMES for p in PATHS]
            for scheme, path in order[r % len(order):] + order[: r % len(order)]:  # rotated per repeat
                result = one_wait(ep, bucket, path, scheme, tls, args.wait_s)
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

"""A network in user space: a TCP proxy, in a process of its own, that gives a loopback
S3 server a real link's first-byte delay, round trips and bandwidth
(``python -m ec_s3.sandbox.netem`` or :class:`NetEm`).

Owns the profiles (:data:`PROFILES`), the proxy's pacing, and its process. Does not own
the S3 server behind it (:mod:`.embedded_s3`), what is measured through it, nor faults
per request (``tests/support/faultproxy.py``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["PROFILES", "LinkProfile", "NetEm", "limit_s"]

_CHUNK = 256 * 1024
# How far behind its virtual clock a connection may fall and catch up: a sleep wakes up
# late by about a millisecond, and without this credit every late wake-up would be lost
# from the rate.
_CATCH_UP_S = 0.003


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One link. Rates are bytes per second; 0 means unlimited."""

    name: str
    first_byte_s: float = 0.0
    rtt_s: float = 0.0  # added once per new connection, to its first answer
    conn_bytes_per_s: float = 0.0
    nic_bytes_per_s: float = 0.0
    tail_fraction: float = 0.0  # of answers, stalled tail_s more (their connection only, not the NIC)
    tail_s: float = 0.0

    def with_tail(self, fraction: float, seconds: float) -> LinkProfile:
        return dataclasses.replace(self, name=f"{self.name}+tail", tail_fraction=fraction, tail_s=seconds)


#: S3 Standard (AWS: small requests "tens of milliseconds"; its CRT client plans for
#: ~50 MB/s a connection), S3 Express One Zone (single-digit milliseconds), and a proxy
#: that only relays (what the proxy itself costs).
PROFILES: dict[str, LinkProfile] = {
    "loopback": LinkProfile("loopback"),
    "standard": LinkProfile("standard", first_byte_s=0.020, rtt_s=0.020, conn_bytes_per_s=90e6,
                            nic_bytes_per_s=1.25e9),
    "express": LinkProfile("express", first_byte_s=0.004, rtt_s=0.004, conn_bytes_per_s=200e6,
                           nic_bytes_per_s=1.25e9),
}


def limit_s(profile: LinkProfile, nbytes: int) -> float:
    """The fastest one object of ``nbytes`` can arrive: one first byte, then the NIC's
    rate (what enough parallel connections reach)."""
    rate = profile.nic_bytes_per_s or profile.conn_bytes_per_s
    return profile.first_byte_s + (nbytes / rate if rate else 0.0)


class _Pace:
    """A rate as a virtual clock: the time the bytes reserved so far have left."""

    def __init__(self, rate: float) -> None:
        self.rate, self.free_at = rate, 0.0

    def reserve(self, now: float, n: int) -> float:
        if not self.rate:
            return now
        self.free_at = max(self.free_at, now - _CATCH_UP_S) + n / self.rate
        return self.free_at


class _Proxy:
    def __init__(self, profile: LinkProfile, upstream: tuple[str, int], seed: int | None) -> None:
        self.profile, self.upstream = profile, upstream
        self.random = random.Random(seed)
        self.nic = {"up": _Pace(profile.nic_bytes_per_s), "down": _Pace(profile.nic_bytes_per_s)}
        self.answers = 0  # requests answered, reported when the proxy stops

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstream)
        except OSError:
            cwriter.transport.abort()
            return
        state = {"request_end": 0.0, "answered": True, "new": True}
        conn = {"up": _Pace(self.profile.conn_bytes_per_s), "down": _Pace(self.profile.conn_bytes_per_s)}
        up = asyncio.ensure_future(self._pipe(creader, uwriter, "up", conn["up"], state))
        down = asyncio.ensure_future(self._pipe(ureader, cwriter, "down", conn["down"], state))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            for writer in (uwriter, cwriter):
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str, conn: _Pace,
                    state: dict) -> None:
        p, loop = self.profile, asyncio.get_running_loop()
        while data := await reader.read(_CHUNK):
            now = loop.time()
            if way == "up":
                state["answered"] = False
                state["request_end"] = now
            elif not state["answered"]:  # the first byte of an answer
                state["answered"] = True
                self.answers += 1
                due = state["request_end"] + p.first_byte_s
                if state["new"]:
                    due += p.rtt_s
                    state["new"] = False
                if p.tail_fraction and self.random.random() < p.tail_fraction:
                    due += p.tail_s
                # Wait here, then book the paces: booked from its due time, a first byte
                # (a 2 s stall most of all) held up every connection on the shared NIC.
                if (wait := due - now) > 0:
                    await asyncio.sleep(wait)
                now = loop.time()
                conn.free_at = max(conn.free_at, now)
            due = max(conn.reserve(now, len(data)), self.nic[way].reserve(now, len(data)))
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()  # the other way may still be talking (a half-closed connection)


async def _serve(profile: LinkProfile, upstream: tuple[str, int], port: int, seed: int | None) -> None:
    proxy = _Proxy(profile, upstream, seed)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        # Until the owner goes: it holds our stdin.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(json.dumps({"requests": proxy.answers}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="http://host:port of the server")
    parser.add_argument("--profile", default="standard", help=f"one of {', '.join(PROFILES)}, or a JSON LinkProfile")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    profile = PROFILES.get(args.profile) or LinkProfile(**json.loads(args.profile))
    parts = urlsplit(args.upstream)
    serve = _serve(profile, (parts.hostname or "127.0.0.1", parts.port or 80), args.port, args.seed)
    try:
        import uvloop  # a third of the CPU per byte relayed: the proxy must not be the bottleneck
    except ImportError:
        asyncio.run(serve)
    else:
        uvloop.run(serve)
    return 0


class NetEm:
    """The proxy in a process of its own, for ``with NetEm(url, "standard") as link:
    ... link.endpoint_url``; it ends when this object stops (or its owner dies: it
    reads its stdin to the end). After :meth:`stop`, :attr:`requests` is how many
    requests it answered."""

    def __init__(self, upstream_url: str, profile: str | LinkProfile = "standard", *, seed: int | None = None) -> None:
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self._upstream, self._seed = upstream_url, seed
        self._proc: subprocess.Popen[str] | None = None
        self.port = self.requests = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NetEm:
        spec = json.dumps(dataclasses.asdict(self.profile))
        cmd = [sys.executable, "-m", "ec_s3.sandbox.netem", self._upstream, "--profile", spec]
        if self._seed is not None:
            cmd += ["--seed", str(self._seed)]
        root = str(Path(__file__).resolve().parents[2])  # this ec_s3, wherever the caller runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the port, once it listens ("" if it died)
        if not line:
            self.stop()
            raise RuntimeError(f"netem did not start (exit {self._proc.poll()})")
        self.port = int(json.loads(line)["port"])
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            assert proc.stdout is not None
            with contextlib.suppress(ValueError):
                self.requests = int(json.loads(proc.stdout.readline() or "{}").get("requests", 0))
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> NetEm:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())

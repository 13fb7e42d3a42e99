"""A raw HTTP/1.1 server on loopback that answers each request with scripted bytes.

For the answers a real S3 server never sends (a wrong Content-Range, a chunked 200, an
interim 1xx, a trickled body) to a whole store, which talks to it
from the store's own loop thread: this server runs on its own thread. The n-th request
(counted over all connections, from 0) gets ``script(n, head)``: bytes to send, or a
callable that gets the socket and writes (and sleeps) as it likes. Does not parse more
than a request head; request bodies are not expected (GETs).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any, Union

Answer = Union[bytes, Callable[[socket.socket], object]]
Script = Callable[[int, bytes], Answer]


class ScriptedHTTP:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # close() does not wake a blocked accept(): poll
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()
        self._thread.join(5)

    def __enter__(self) -> ScriptedHTTP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self.connections += 1
                self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                with self._lock:
                    n = len(self.requests)
                    self.requests.append(head)
                answer = self.script(n, head)
                if callable(answer):
                    answer(conn)
                else:
                    conn.sendall(answer)
        except OSError:
            pass
        finally:
            conn.close()


def header(head: bytes, name: bytes) -> bytes | None:
    """The value of request header ``name`` (case-insensitive) in ``head``, or None."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def answer(status: bytes, headers: list[bytes], body: bytes) -> bytes:
    """An HTTP/1.1 answer: ``status`` (``b"206 Partial Content"``), header lines, body."""
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def get_bytes(store: Any, key: str = "k") -> bytes:
    """``store.get_async(key)`` run to its end, as bytes."""
    return bytes(store.run(store.get_async(key), timeout=30))


def serve_range(head: bytes, data: bytes, etag: bytes | None = b'"v1"') -> bytes:
    """What an S3 server answers to the GET ``head`` for an object of bytes ``data``: a
    206 of its ``Range``, or a 200 of everything without one; ``ETag: etag`` unless None."""
    tags = [b"ETag: " + etag] if etag is not None else []
    asked = header(head, b"Range")
    if asked is None:
        return answer(b"200 OK", [b"Content-Length: %d" % len(data), *tags], data)
    first, last = (int(v) for v in asked[len(b"bytes="):].split(b"-"))
    last = min(last, len(data) - 1)
    return answer(b"206 Partial Content", [b"Content-Range: bytes %d-%d/%d" % (first, last, len(data)),
                                           b"Content-Length: %d" % (last - first + 1), *tags], data[first : last + 1])

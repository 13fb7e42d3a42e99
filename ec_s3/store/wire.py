"""The blob requests: HEAD, PUT, UploadPart and GET, signed here, sent on ec-s3's aiohttp pool.

Owns the aiohttp session of these requests (pool, timeouts, TLS and proxy as the aiobotocore
client's), object URLs, signing with the store's credentials (:mod:`.sigv4`; never logged or
kept), GET bodies through :mod:`.recv` when no proxy is used, and turning an answer into
headers or a typed error (:func:`.error_map.from_status`). Does not own the credential chain,
the endpoint and the other S3 operations (:mod:`.connection`), retries, the concurrency bound,
the breaker, CRC metadata, ranges and multipart orchestration (:mod:`.client`).
"""

from __future__ import annotations

import contextlib
import html
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import aiohttp.payload
from botocore.httpsession import ProxyConfiguration
from botocore.utils import get_environ_proxies
from yarl import URL

from ec_s3.config import ECS3Config
from ec_s3.store.body import BufferChain
from ec_s3.store.connection import Credentials
from ec_s3.store.error_map import from_status
from ec_s3.store.errors import StoreConfigError, StoreError, StoreUnavailable
from ec_s3.store.http1 import is_error_status
from ec_s3.store.recv import RecvAnswer, RecvPool
from ec_s3.store.sigv4 import signed_headers
from ec_s3.store.tls import Trust, ssl_context

__all__ = ["DirectWire", "GetAnswer", "collect_chunks", "fill_from_chunks", "object_url"]

# aiobotocore's keep-alive (its DEFAULT_KEEPALIVE_TIMEOUT): idle pooled connections
# close after this, before a server's own idle timeout can race a reuse.
_KEEPALIVE_S = 12.0
# An error body is a small XML document; anything longer is not worth reading.
_ERROR_BODY_LIMIT = 64 * 1024
# The StreamReader pauses the socket above 2x this; 64 KiB (aiohttp's default) pauses
# and resumes it dozens of times per MiB.
_READ_BUFSIZE = 1 << 20
_CODE_RE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE_RE = re.compile(rb"<Message>([^<]{0,1024})</Message>")


class _ChainPayload(aiohttp.payload.Payload):
    """A :class:`BufferChain` as an aiohttp body: its buffers are written one after the
    other, never joined (a blob is a header plus the encoder output's own memory)."""

    _autoclose = True

    def __init__(self, chain: BufferChain) -> None:
        super().__init__(chain, content_type="application/octet-stream")
        self._size = len(chain)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a blob body is bytes, not text")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        left = len(self._value) if content_length is None else content_length
        # An empty first write sends the request head alone: aiohttp coalesces the head
        # with the first chunk, and on Python 3.11 that is a b"".join, a copy of the
        # whole body (~0.25 ms per MiB, a third of a 1 MiB PUT's client CPU).
        await writer.write(b"")
        for view in self._value.views:
            if left <= 0:
                return
            part = view if len(view) <= left else view[:left]
            await writer.write(part)
            left -= len(part)


def _virtual_hosted(style: str, custom_endpoint: bool, bucket: str) -> bool:
    """botocore's choice (``args.py`` and its S3 endpoint rules): ``auto`` addresses the
    bucket as a host name only on AWS's own endpoints, and only a bucket that is one DNS
    label (no dots: a TLS wildcard certificate covers one level); with an
    ``endpoint_url`` (MinIO, SeaweedFS, ...) ``auto`` means path style."""
    if style == "virtual":
        return True
    if style == "path" or custom_endpoint:
        return False
    return "." not in bucket


def object_url(endpoint_url: str, bucket: str, key: str, addressing_style: str, *, custom_endpoint: bool) -> str:
    """The URL of ``key``, percent-encoded as S3 signs it (``/`` and ``~`` kept).
    ``endpoint_url`` is the one the client resolved (a region's on AWS);
    ``custom_endpoint`` says whether the configuration named it."""
    parts = urlsplit(endpoint_url)
    path = parts.path.rstrip("/")
    quoted = quote(key, safe="/~")
    if _virtual_hosted(addressing_style, custom_endpoint, bucket):
        return f"{parts.scheme}://{bucket}.{parts.netloc}{path}/{quoted}"
    return f"{parts.scheme}://{parts.netloc}{path}/{bucket}/{quoted}"


class DirectWire:
    """The four blob requests of one store, on its own connection pool.

    Built on the store's loop once the aiobotocore client exists: its endpoint and
    region, and the credentials :func:`.connection.open_client` resolved, are what this
    signs with. :meth:`close` on the same loop.
    """

    def __init__(self, config: ECS3Config, client: Any, credentials: Credentials, trust: Trust) -> None:
        self._bucket = config.bucket
        self._style = config.addressing_style
        self._custom_endpoint = config.endpoint_url is not None
        self._endpoint = str(client.meta.endpoint_url)
        self._region = str(client.meta.region_name)
        # The client's own credential object, not a frozen copy: refreshable credentials
        # (instance role, SSO, credential_process) rotate under it.
        self._credentials = credentials
        base = self.url("")
        proxies = ProxyConfiguration(proxies=get_environ_proxies(base))
        self._proxy = proxies.proxy_url_for(base)
        self._proxy_headers = proxies.proxy_headers_for(self._proxy) if self._proxy else None
        https = urlsplit(base).scheme == "https"
        # The CA the client was given (connection.resolve_endpoint), never one of our own.
        context = ssl_context(trust) if https else None
        connect, read = config.connect_timeout_s, config.read_timeout_s
        # GET bodies into the caller's buffer, no bytes objects between (recv.py);
        # through a proxy they stay on aiohttp (recv.py does not speak to proxies).
        self._recv: RecvPool | None = None
        if self._proxy is None:
            self._recv = RecvPool(base, limit=config.max_pool_connections, connect_timeout_s=connect,
                                  read_timeout_s=read, keepalive_s=_KEEPALIVE_S,
                                  ssl_context=context)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=config.max_pool_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S,
                ssl=context if context is not None and trust.verify else False,
            ),
            # connect bounds DNS, the TCP/TLS handshake *and* the wait for a pooled
            # connection (see connection.BoundedPoolSession): never wait forever.
            timeout=aiohttp.ClientTimeout(sock_connect=connect, sock_read=read, connect=connect + read),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            read_bufsize=_READ_BUFSIZE,
        )

    def __repr__(self) -> str:  # no credentials, no proxy userinfo
        return f"DirectWire(endpoint={self._endpoint!r}, bucket={self._bucket!r}, addressing_style={self._style!r})"

    @property
    def recv_pool(self) -> RecvPool | None:
        """The GET pool reading into callers' buffers; None through a proxy."""
        return self._recv

    def url(self, key: str, query: str = "") -> str:
        url = object_url(self._endpoint, self._bucket, key, self._style, custom_endpoint=self._custom_endpoint)
        return f"{url}?{query}" if query else url

    def _object_url(self, op: str, key: str, query: str = "") -> str:
        if not key:
            # botocore refuses an empty key before sending; here it would address the bucket.
            raise StoreConfigError(op, key, "an object key must not be empty")
        return self.url(key, query)

    async def close(self) -> None:
        try:
            if self._recv is not None:
                await self._recv.close()
        finally:
            await self._session.close()

    # ------------------------------------------------------------------ requests
    async def head(self, key: str) -> Mapping[str, str]:
        """The headers of ``key``; a typed error for anything but 200."""
        async with self._request("HEAD", "HEAD", key, {}) as resp:
            return resp.headers

    async def put(
        self, op: str, key: str, body: BufferChain, headers: dict[str, str], query: str = ""
    ) -> Mapping[str, str]:
        """PUT ``body`` (a single PUT, or with ``query`` an UploadPart); the answer's headers."""
        # No ``Expect: 100-continue`` (botocore sends one over 1 MB): waiting for the
        # server's go-ahead made 8 MiB PUTs 1.3-1.6x slower on SeaweedFS, and neither
        # obstore nor raw clients ask. Early refusals (412, 403) of bodies up to a part
        # still arrive as answers (tests/store/test_store_wire.py), and multipart uploads ask
        # with a HEAD before sending any part.
        headers = {**headers, "Content-Length": str(len(body))}
        async with self._request(op, "PUT", key, headers, query=query, data=_ChainPayload(body)) as resp:
            return resp.headers

    @contextlib.asynccontextmanager
    async def get(self, key: str, first: int, last: int | None, if_match: str | None = None) -> AsyncIterator[GetAnswer]:
        """A 200/206 answer to ``Range: bytes=first-last`` (no Range when ``last`` is
        None; ``If-Match: if_match`` when given), its body unread; released on exit."""
        headers = {**({"Range": f"bytes={first}-{last}"} if last is not None else {}),
                   **({"If-Match": if_match} if if_match else {})}
        if self._recv is None:
            async with self._request("GET", "GET", key, headers) as resp:
                yield _AiohttpAnswer(resp, key)
            return
        url = self._object_url("GET", key)
        parts = urlsplit(url)
        # Signed with the Host it is sent with (botocore drops a default port, as here).
        default = {"http": 80, "https": 443}[parts.scheme]
        host = parts.netloc[: -len(f":{default}")] if parts.port == default else parts.netloc
        signed = await self._sign("GET", url, {**headers, "Host": host})
        async with self._recv.get(parts.path, signed, "GET", key) as answer:
            if is_error_status(answer.status):
                raise await _recv_error("GET", key, answer)
            yield _RecvGetAnswer(answer)

    @contextlib.asynccontextmanager
    async def _request(
        self, op: str, method: str, key: str, headers: dict[str, str], *, query: str = "", data: Any = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        url = self._object_url(op, key, query)
        signed = await self._sign(method, url, headers)
        resp = await self._session.request(
            method, URL(url, encoded=True), headers=signed, data=data, allow_redirects=False,
            proxy=self._proxy, proxy_headers=self._proxy_headers,
        )
        # A connection goes back to the pool only after a body read to its end; any
        # other way out (an error answer, a short body, our caller's exception,
        # cancellation) closes it, so it can never stay pinned.
        try:
            if is_error_status(resp.status):
                raise await _error(op, key, resp)
            yield resp
        except BaseException:
            resp.close()
            raise
        else:
            resp.release()

    async def _sign(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        frozen = await self._credentials.get_frozen_credentials()  # refreshes refreshable credentials
        return signed_headers(method, url, {**headers, "Accept-Encoding": "identity"}, access_key=frozen.access_key,
                              secret_key=frozen.secret_key, token=frozen.token, region=self._region)


async def _error(op: str, key: str, resp: aiohttp.ClientResponse) -> StoreError:
    """The typed error of a non-2xx answer, from its status and the S3 ``<Code>`` of
    its XML body (read up to a bound: the connection is closed afterwards anyway)."""
    body = b""
    if op != "HEAD":
        try:
            while len(body) < _ERROR_BODY_LIMIT:
                chunk = await resp.content.read(_ERROR_BODY_LIMIT - len(body))
                if not chunk:
                    break
                body += chunk
        except (aiohttp.ClientError, TimeoutError):  # the status alone still says enough
            body = b""
    return _typed_error(op, key, resp.status, resp.reason or "", body, resp.headers.get("Retry-After"))


class GetAnswer:
    """A GET's answer (recv pool or aiohttp): its status and headers, and its body read into a buffer."""

    status: int
    headers: Mapping[str, str]

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` with the whole body (``len(out)`` is its length); a short or
        long body is a transient error."""
        raise NotImplementedError

    async def read_to_end(self, limit: int) -> bytes:
        """The whole body of an answer of unknown length (a chunked 200); over
        ``limit`` bytes is a transient error."""
        raise NotImplementedError


class _RecvGetAnswer(GetAnswer):
    def __init__(self, answer: RecvAnswer) -> None:
        self._answer = answer
        self.status, self.headers = answer.status, answer.headers

    async def read_into(self, out: memoryview) -> None:
        await self._answer.read_into(out)

    async def read_to_end(self, limit: int) -> bytes:
        return await self._answer.read_to_end(limit)


class _AiohttpAnswer(GetAnswer):
    def __init__(self, resp: aiohttp.ClientResponse, key: str) -> None:
        self._resp, self._key = resp, key
        self.status, self.headers = resp.status, resp.headers

    async def read_into(self, out: memoryview) -> None:
        await fill_from_chunks(_chunks(self._resp), out, self._key)

    async def read_to_end(self, limit: int) -> bytes:
        return await collect_chunks(_chunks(self._resp), limit, self._key)


async def _recv_error(op: str, key: str, answer: RecvAnswer) -> StoreError:
    """As :func:`_error`, for an answer of the recv pool (closed afterwards)."""
    try:
        body = await answer.read_error_body(_ERROR_BODY_LIMIT)
    except StoreError:  # the status alone still says enough
        body = b""
    return _typed_error(op, key, answer.status, answer.reason, body, answer.headers.get("Retry-After"))


def _typed_error(op: str, key: str, status: int, reason: str, body: bytes, retry_after: str | None) -> StoreError:
    code = _CODE_RE.search(body)
    message = _MESSAGE_RE.search(body)
    return from_status(
        op, key, status,
        html.unescape(code.group(1).decode("utf-8", "replace")) if code else None,
        html.unescape(message.group(1).decode("utf-8", "replace")) if message else reason,
        retry_after=retry_after,
    )


async def _chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """A response body's chunks as the socket delivered them."""
    while True:
        chunk, end_of_http_chunk = await resp.content.readchunk()
        if chunk:
            yield chunk
        elif not end_of_http_chunk:  # an empty chunk at a chunked body's boundary is not its end
            return


async def fill_from_chunks(chunks: AsyncIterator[bytes], out: memoryview, key: str) -> None:
    """Copy a streamed GET body into ``out`` chunk by chunk, as the client received them
    (no joining, no intermediate buffer); a body shorter or longer than ``out`` (its
    Content-Length) is a transient error."""
    pos, size = 0, len(out)
    async for chunk in chunks:
        end = pos + len(chunk)
        if end > size:
            raise StoreUnavailable("GET", key, "body longer than Content-Length")
        out[pos:end] = chunk
        pos = end
    if pos != size:
        raise StoreUnavailable("GET", key, f"body ended after {pos} of {size} bytes")


async def collect_chunks(chunks: AsyncIterator[bytes], limit: int, key: str) -> bytes:
    """A streamed body of unknown length (a chunked answer), joined; more than
    ``limit`` bytes is a transient error."""
    data = bytearray()
    async for chunk in chunks:
        data += chunk
        if len(data) > limit:
            raise StoreUnavailable("GET", key, f"body of unknown length over {limit} bytes")
    return bytes(data)

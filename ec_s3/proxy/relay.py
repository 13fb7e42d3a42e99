"""A begun prefill/decode answer relayed to the client: whole, or SSE chunk by chunk.

Owns what the client gets of p/d's answer: its headers less hop-by-hop ones, a 502 for an
answer that shows a misconfigured fleet, OpenAI's shape for a 5xx that is not JSON, an
error event when the stream breaks, and cutting off a client that accepts nothing for
``send_timeout_s``. It does not own sending to p/d or its retries (:mod:`.pd`), reading
the answer's start (:mod:`.answer`) or what a p/d answer may carry (:mod:`.roles`).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.front import error_response
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.roles import screen_answer
from ec_s3.proxy.skips import EncoderSkips
from ec_s3.proxy.upstreams import Warner

__all__ = ["Relay"]

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length", "Date", "Server",
    )
)


class Relay:
    """Relays p/d answers to clients; what an answer says of the bucket goes to ``skips``."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics, warner: Warner, skips: EncoderSkips) -> None:
        self.config = config
        self.metrics = metrics
        self.warner = warner
        self.skips = skips

    async def finish(self, request: web.Request, answer: PdAnswer, request_id: str) -> web.StreamResponse:
        """Relay a begun PD answer to the client (SSE chunk by chunk), then free it."""
        try:
            self.skips.learn_from_answer(answer)
            if screen_answer(answer):  # also keeps ec_transfer_params from the client
                url = answer.upstream.url
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=url, reason="producer_answer")
                self.warner.warn((url, "producer_answer"),
                                 "ec-s3 proxy: request %s: prefill/decode %s answered like an encoder (no tokens, "
                                 "ec_transfer_params): is it an ec_producer? check --pd-url and --encoder-url",
                                 request_id, url)
                return error_response(502, "prefill/decode server misconfigured", "BadGateway")
            return await self._relay(request, answer, request_id)
        finally:
            answer.close()

    async def _relay(self, request: web.Request, answer: PdAnswer, request_id: str) -> web.StreamResponse:
        resp = answer.resp
        assert resp is not None
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
        out_headers.setdefault("X-Request-Id", request_id)
        if not answer.stream:
            return self._whole(answer, out_headers, request_id)
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        out.headers["Cache-Control"] = "no-cache"
        try:
            await out.prepare(request)
            await self._stream(request, out, answer, request_id)
            await self._send(request, out, None)
        except ConnectionResetError:
            self.metrics.inc("ec_s3_proxy_client_disconnects_total")
            logger.info("ec-s3 proxy: request %s: client went away mid-stream", request_id)
            resp.close()
            return out
        except asyncio.CancelledError:
            self.metrics.inc("ec_s3_proxy_client_disconnects_total")
            raise
        resp.release()
        return out

    def _whole(self, answer: PdAnswer, out_headers: dict[str, str], request_id: str) -> web.Response:
        """A non-streamed answer, read whole already (:meth:`PdAnswer.read_start`)."""
        resp = answer.resp
        assert resp is not None
        if resp.status >= 500 and not _is_error_json(answer.first):
            # A server error that is not vLLM's JSON (a gateway's page, a crash): the
            # client gets OpenAI's shape all the same, the log gets what was said.
            self.warner.warn(
                (answer.upstream.url, "not_json"),
                "ec-s3 proxy: request %s: prefill/decode %s answered HTTP %d with a body that is not an "
                "OpenAI error: %r", request_id, answer.upstream.url, resp.status, answer.first[:200],
            )
            kept = {k: v for k, v in out_headers.items() if k.lower() in ("retry-after", "x-request-id")}
            return error_response(resp.status, f"prefill/decode server error (HTTP {resp.status})",
                                  "ServiceUnavailable" if resp.status == 503 else "InternalServerError", kept)
        return web.Response(status=resp.status, body=answer.first, headers=out_headers)

    async def _stream(self, request: web.Request, out: web.StreamResponse, answer: PdAnswer, request_id: str) -> None:
        """The stream's chunks to the client, as they come; a stream that breaks ends with an
        error event (a client that leaves raises ConnectionResetError)."""
        resp = answer.resp
        assert resp is not None
        try:
            if answer.first:
                await self._send(request, out, answer.first)
            async for chunk in resp.content.iter_any():
                await self._send(request, out, chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Status and headers are gone already: end the stream with an error event,
            # in the shape vLLM uses for errors inside a stream.
            reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "disconnected"
            self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=answer.upstream.url, reason=reason)
            logger.warning(
                "ec-s3 proxy: request %s: prefill/decode stream broke: %s", request_id, exc.__class__.__name__
            )
            resp.close()
            event = {"error": {"message": f"upstream stream broke ({reason})", "type": "BadGateway", "code": 502}}
            await self._send(request, out, f"data: {json.dumps(event)}\n\n".encode())

    async def _send(self, request: web.Request, out: web.StreamResponse, data: bytes | None) -> None:
        """Write ``data`` to the client (None: the end); a client that accepts nothing for
        ``send_timeout_s`` is cut off, as if it had left (ConnectionResetError)."""
        try:
            async with asyncio.timeout(self.config.send_timeout_s):
                await (out.write(data) if data is not None else out.write_eof())
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client accepted nothing within send_timeout_s") from None


def _is_error_json(data: bytes) -> bool:
    """Whether ``data`` is an OpenAI-style error body (``{"error": {...}}``)."""
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    return isinstance(payload, dict) and isinstance(payload.get("error"), dict)

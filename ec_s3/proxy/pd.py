"""One request sent to prefill/decode, up to the start of its answer, and what a failure means.

Owns :meth:`PdSender.begin`: the pick (least busy or affinity), the next instance when one
refuses the connection, one more try of a generation vLLM refused (with the media of
metadata-only items), and the client's 502 or 504 on a timeout or a broken connection. It
does not own the order of sends or encoder-failure resends (:mod:`.dispatch`), reading an
answer's start (:mod:`.answer`) nor relaying it (:mod:`.relay`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.front import error_response
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.sessions import UpstreamSessions
from ec_s3.proxy.upstreams import Pool, Upstream, Warner

__all__ = ["PdSender"]

# What a client is told when PD fails: the upstream's URL goes to the log only.
_PD_UNAVAILABLE = "prefill/decode server unavailable"
_PD_TIMEOUT = "prefill/decode server did not answer in time"


class PdSender:
    """Sends a request to a prefill/decode instance of ``pool`` on ``sessions.pd``."""

    def __init__(self, config: ProxyConfig, pool: Pool, sessions: UpstreamSessions, metrics: ProxyMetrics,
                 warner: Warner) -> None:
        self.config = config
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.warner = warner

    async def begin(
        self, data: bytes, headers: dict[str, str], *, stream: bool, retry_data: bytes | None = None,
        route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> PdAnswer | web.Response:
        """Send to the least busy PD, or under ``route="affinity"`` the one ``route_key``
        (:func:`~ec_s3.proxy.routing.route_key`) ranks first within the load bound (one
        that refuses the connection, so nothing was sent, is skipped for the next) and
        read the start of its answer: the whole body, or for a 200 stream its first
        events (:meth:`PdAnswer.read_start`), so nothing has
        reached the client yet when this returns (parallel dispatch may still drop the
        answer and send again). The :class:`PdAnswer` holds the upstream until it is
        relayed (:mod:`.relay`) or closed; errors come back as the client's error answer.
        HTTP errors are relayed as they are, except that a generation vLLM's engine
        refused before any token is sent once more (:mod:`.answer` says why), as
        ``retry_data`` when given (the request with its media instead of metadata-only
        parts, whose blobs p/d could not get: :mod:`.embeds`), calling ``on_retry`` first."""
        answer = await self._send(data, headers, stream=stream, route_key=route_key)
        if isinstance(answer, PdAnswer) and answer.failed_generation():
            answer.close()
            reason = "failed_generation" if retry_data is None else "metadata_only_failed"
            self.metrics.inc("ec_s3_proxy_pd_retries_total", upstream=answer.upstream.url, reason=reason)
            logger.info(
                "ec-s3 proxy: request %s: prefill/decode %s refused it before any token (vLLM's retryable "
                "finish_reason 'error': its multimodal cache drifted, or it could not get an item's encoder "
                "output); sending it once more%s", headers["X-Request-Id"], answer.upstream.url,
                "" if retry_data is None else " with the media of its metadata-only items",
            )
            if on_retry is not None:
                on_retry()
            answer = await self._send(data if retry_data is None else retry_data, headers, stream=stream,
                                      route_key=route_key)
        return answer

    async def _send(
        self, data: bytes, headers: dict[str, str], *, stream: bool, route_key: str | None
    ) -> PdAnswer | web.Response:
        """One try of :meth:`begin`: the next instance while one refuses the connection."""
        tried: list[Upstream] = []
        while True:
            upstream = self.pool.acquire(tried, allow_down=True, key=route_key)
            if upstream is None:
                break
            tried.append(upstream)
            answer = await self._post(upstream, data, headers, stream=stream)
            if answer is not None:
                return answer
        self.warner.warn(
            ("pd", "none_reachable"),
            "ec-s3 proxy: request %s: no prefill/decode instance reachable (tried %s)",
            headers["X-Request-Id"], ", ".join(u.url for u in tried) or "none",
        )
        return error_response(502, _PD_UNAVAILABLE, "BadGateway")

    async def _post(
        self, upstream: Upstream, data: bytes, headers: dict[str, str], *, stream: bool
    ) -> PdAnswer | web.Response | None:
        """Send to ``upstream`` (held by the caller's acquire) and read its answer's start;
        None when it refused the connection (nothing was sent: the next may take it)."""
        session = self.sessions.pd
        assert session is not None
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.read_timeout_s)
        answer = PdAnswer(self.pool, upstream, stream)
        try:
            try:
                answer.resp = await session.post(
                    f"{upstream.url}/v1/chat/completions", data=data,
                    headers={**headers, "Content-Type": "application/json"}, timeout=timeout,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                answer.close()
                self.pool.mark_down(upstream)
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="unreachable")
                self.warner.warn(
                    (upstream.url, "unreachable"),
                    "ec-s3 proxy: prefill/decode %s unreachable: %s", upstream.url, exc,
                )
                return None
            self.pool.mark_up(upstream)
            self.metrics.inc("ec_s3_proxy_pd_responses_total", upstream=upstream.url, status=str(answer.resp.status))
            answer.stream = stream and answer.resp.status == 200
            await answer.read_start()
            return answer
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            answer.close()
            return self._failed(upstream, exc, headers["X-Request-Id"])
        except BaseException:  # cancelled (the client left, or parallel dispatch dropped it)
            answer.close()  # aborts the PD's work
            raise

    def _failed(self, upstream: Upstream, exc: BaseException, request_id: str) -> web.Response:
        """The client's answer when prefill/decode timed out (504) or broke off (502)."""
        cfg = self.config
        if isinstance(exc, asyncio.TimeoutError):
            self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="timeout")
            self.warner.warn(
                (upstream.url, "timeout"),
                "ec-s3 proxy: request %s: prefill/decode %s did not answer within total_timeout_s=%s "
                "(or was silent for read_timeout_s=%s)",
                request_id, upstream.url, cfg.total_timeout_s, cfg.read_timeout_s,
            )
            return error_response(504, _PD_TIMEOUT, "GatewayTimeout")
        self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="disconnected")
        self.warner.warn(
            (upstream.url, "disconnected"),
            "ec-s3 proxy: request %s: prefill/decode %s failed: %s: %s",
            request_id, upstream.url, exc.__class__.__name__, exc,
        )
        return error_response(502, _PD_UNAVAILABLE, "BadGateway")

"""The proxy's routes other than chat: ``/health``, ``/v1/models`` and ``/metrics``.

Owns probing the upstreams for ``/health`` (one probe at a time, its answer cached for
``health_cache_s`` and given while the next probe runs), what ``/health`` shows to whom, asking p/d for ``/v1/models`` and
serving the metrics. It does not own the roles' check (:mod:`.fleet`), the metrics
themselves (:mod:`.metrics`) or the chat route (:mod:`.chat`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.fleet import Fleet
from ec_s3.proxy.front import authorized, error_response, request_id, upstream_headers
from ec_s3.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ProxyMetrics
from ec_s3.proxy.sessions import UpstreamSessions
from ec_s3.proxy.upstreams import Pool

__all__ = ["StatusRoutes"]


class StatusRoutes:
    """The handlers of ``/health``, ``/v1/models`` and ``/metrics``."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics, pds: Pool, fleet: Fleet,
                 sessions: UpstreamSessions) -> None:
        self.config = config
        self.metrics = metrics
        self.pds = pds
        self.fleet = fleet
        self.sessions = sessions
        # /health: the last answer (loop time, status, body) and the probe running now.
        self._health_answer: tuple[float, int, dict[str, Any]] | None = None
        self._health_probe: asyncio.Task[tuple[int, dict[str, Any]]] | None = None

    def cancel_probe(self) -> None:
        """Cancel the /health probe running now, if any (its sessions are closing)."""
        if self._health_probe is not None:
            self._health_probe.cancel()

    async def models(self, request: web.Request) -> web.StreamResponse:
        """From the first PD (in configured order) that answers 200."""
        if not authorized(self.config, request):
            return error_response(401, "invalid or missing API key", "AuthenticationError")
        session = self.sessions.pd
        assert session is not None
        headers = upstream_headers(self.config, request, request_id(request))
        timeout = aiohttp.ClientTimeout(
            total=self.config.health_timeout_s * 5, sock_connect=self.config.connect_timeout_s
        )
        first_answer: tuple[int, bytes, str] | None = None
        for upstream in self.pds.members:
            try:
                async with session.get(f"{upstream.url}/v1/models", headers=headers, timeout=timeout) as resp:
                    body = await resp.read()
                    ctype = resp.headers.get("Content-Type", "application/json")
                    if resp.status == 200:
                        return web.Response(status=200, body=body, headers={"Content-Type": ctype})
                    first_answer = first_answer or (resp.status, body, ctype)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        if first_answer is not None:
            status, body, ctype = first_answer
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})
        return error_response(503, "no prefill/decode instance answered /v1/models", "ServiceUnavailable")

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one PD answers its /health; encoders are reported, not
        required (without them requests are still served, encoded by the consumer). The
        answer is reused for ``health_cache_s``, and calls that arrive while a probe runs
        share it: a flood of /health calls costs the upstreams one probe each per period.
        Past that, the last answer is still given while its successor's probe runs (for at
        most ``health_timeout_s`` more): a slow upstream must not make the proxy's own
        /health slow (Kubernetes gives a probe 1 s by default)."""
        loop = asyncio.get_running_loop()
        cached = self._health_answer
        age = loop.time() - cached[0] if cached is not None else None
        if cached is not None and age < self.config.health_cache_s:
            return self._health_response(request, cached[1], cached[2])
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self._probe_upstreams())
        stale_limit = self.config.health_cache_s + self.config.health_timeout_s
        if cached is not None and self.config.health_cache_s > 0 and age < stale_limit:
            return self._health_response(request, cached[1], cached[2])
        # Shielded: a caller that leaves does not cancel the probe the others wait for.
        status, body = await asyncio.shield(self._health_probe)
        return self._health_response(request, status, body)

    def _health_response(self, request: web.Request, status: int, body: dict[str, Any]) -> web.Response:
        """The upstreams' URLs and states only to who holds the key, with protect_status."""
        if self.config.protect_status and not authorized(self.config, request):
            body = {"status": body["status"]}
        return web.json_response(body, status=status)

    async def _probe_upstreams(self) -> tuple[int, dict[str, Any]]:
        """One /health probe of every upstream, on the probes' own pool; never raises."""
        session = self.sessions.health
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)

        async def probe(url: str) -> bool:
            try:
                async with session.get(f"{url}/health", timeout=timeout) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
            except Exception:  # a bug must not fail every waiter's /health
                logger.exception("ec-s3 proxy: /health probe of %s failed inside the proxy", url)
                return False

        pd_urls, enc_urls = self.config.pd_urls, self.config.encoder_urls
        results = await asyncio.gather(*(probe(u) for u in pd_urls), *(probe(u) for u in enc_urls))
        pd = dict(zip(pd_urls, results[: len(pd_urls)], strict=True))
        enc = dict(zip(enc_urls, results[len(pd_urls):], strict=True))
        answer = self._judge(pd, enc)
        self._health_answer = (asyncio.get_running_loop().time(), *answer)
        return answer

    def _judge(self, pd: dict[str, bool], enc: dict[str, bool]) -> tuple[int, dict[str, Any]]:
        """/health's status and body from the probes' results (``pd``, ``enc``: URL → up)."""
        # An upstream in the wrong role (:mod:`.fleet`) is reported down: it gets no requests.
        for kind, found in (("pd", pd), ("encoder", enc)):
            for url in found:
                check = self.fleet.of(url, kind)
                if check is not None and check.state == "wrong":
                    found[url] = False
        ok = any(pd.values())
        # Requests are served without encoders (p/d encodes), but not as the fleet meant.
        status = "unavailable" if not ok else "degraded" if not all(enc.values()) else "ok"
        checks = {"encoders": {c.url: c.as_json() for c in self.fleet.checks if c.kind == "encoder"},
                  "prefill_decode": {c.url: c.as_json() for c in self.fleet.checks if c.kind == "pd"}}
        return 200 if ok else 503, {"status": status, "prefill_decode": pd, "encoders": enc, "roles": checks}

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """The proxy's metrics, as Prometheus text (only to who holds the key, with protect_status)."""
        if self.config.protect_status and not authorized(self.config, request):
            return error_response(401, "invalid or missing API key", "AuthenticationError")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

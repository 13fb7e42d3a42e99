"""The proxy's aiohttp application: chat requests, the relay, ``/health``, ``/metrics``.

Per chat request it names the media items (:mod:`.naming`), finds them (:mod:`.media`)
and hands the request to its dispatch (:mod:`.dispatch`): *parallel* (the default) sends
each distinct item alone to an encoder (``ec_role: ec_producer``) and, at the same time,
the request with those items marked pending to a prefill/decode instance (``ec_role:
ec_consumer``); *serial* waits for the encoders and forwards their merged
``ec_transfer_params``. Either way it relays p/d's answer (SSE streams chunk by chunk).

The flow follows vLLM's example proxy (``examples/online_serving/disaggregated_encoder/
disagg_epd_proxy.py``) with these deliberate differences:

* an encoder that is down, slow or failing never fails the client's request: its items
  simply get no params (or lose their pending mark) and the consumer encodes them
  locally (the media stay in the forwarded request for exactly that reason);
* the encoders' ``ec_transfer_params`` (or the pending marks) reach p/d, and a client's
  ``uuid`` is never passed on as is (:mod:`.naming`);
* upstream pools are bounded and every timeout is configurable;
* what one client can cost is bounded (media items per request, requests in flight,
  body size, connections, the time to send a head and a body, the bytes of all bodies
  in flight: :mod:`.edge`), every upstream read has a deadline, and every error the
  proxy answers itself is an OpenAI-style JSON body that names no upstream (the log
  does).

Owns the HTTP side: handlers, sessions, sending to one encoder or one p/d, relaying,
error answers, and :class:`ProxyThread`. It does not own the order of sends
(:mod:`.dispatch`), reading or rewriting bodies (:mod:`.media`, :mod:`.naming`),
which items skip the encoder (:mod:`.skips`), reading the start of an answer
(:mod:`.answer`), choosing an upstream (:mod:`.upstreams`), the listening socket and
reading bodies (:mod:`.edge`), the byte budget (:mod:`.limits`), settings
(:mod:`.config`) or the command line (:mod:`.main`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.client_embeds import ClientEmbedsRefused, EmbedsRules, check_client_embeds
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.dispatch import dispatch_parallel, dispatch_serial
from ec_s3.proxy.edge import BodyRefused, EdgeSite, body_deadline, read_body
from ec_s3.proxy.fleet import Check, Fleet, FleetMisconfigured
from ec_s3.proxy.limits import ByteBudget
from ec_s3.proxy.media import BodyError, MediaItem, TooManyItems, find_media_items, parse_body
from ec_s3.proxy.naming import name_media
from ec_s3.proxy.roles import screen_answer
from ec_s3.proxy.skips import EncoderSkips
from ec_s3.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ProxyMetrics
from ec_s3.proxy.upstreams import Pool, Upstream, Warner

# ProxyConfig is re-exported: callers build one and hand it to EPDProxy / ProxyThread.
__all__ = ["PROXY_KEY", "EPDProxy", "PdAnswer", "ProxyConfig", "ProxyThread", "create_app"]

# What a client is told when PD fails: the upstream's URL goes to the log only.
_PD_UNAVAILABLE = "prefill/decode server unavailable"
_PD_TIMEOUT = "prefill/decode server did not answer in time"
# A request body at least this large is parsed and named off the event loop: its JSON
# work would stall every other request (~2 ms per MB here).
_OFFLOAD_BYTES = 1024 * 1024
# What a client's X-Request-Id may be to be passed on (it becomes vLLM's request id and is
# logged); any other is replaced by one of the proxy's.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")
# After an answer to a body it did not read whole (408, 413, 415, 503), aiohttp reads on and
# drops what still comes this long, so that the client can read the answer, then closes.
_LINGER_S = 2.0
_BODY_ERROR_TYPES = {408: "RequestTimeout", 413: "RequestEntityTooLarge", 415: "UnsupportedMediaType",
                     503: "ServiceUnavailable"}
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length", "Date", "Server",
    )
)


# --------------------------------------------------------------------------- proxy
class EPDProxy:
    """The proxy's state (upstream pools, HTTP sessions, metrics) and its aiohttp server.

    In-process use::

        proxy = EPDProxy(ProxyConfig(encoder_urls=[...], pd_urls=[...], port=0))
        await proxy.start()          # binds; proxy.url is then e.g. http://127.0.0.1:41234
        ...
        await proxy.stop()

    or ``async with EPDProxy(config) as proxy: ...``; from synchronous code use
    :class:`ProxyThread`; from another process run ``python -m ec_s3.proxy`` (``main``).
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.encoders = Pool("encoder", config.encoder_urls, self.metrics, config.down_cooldown_s)
        self.pds = Pool("pd", config.pd_urls, self.metrics, config.down_cooldown_s,
                        route=config.route, balance=config.route_balance)
        self._warner = Warner()
        # Each upstream's role, checked at start and, for those not up yet, in the background.
        self.fleet = Fleet(config.encoder_urls, config.pd_urls)
        # Chat requests between arrival and the end of their answer (max_in_flight).
        self._chat_in_flight = 0
        # Memory of the request bodies in flight (edge.read_body charges each request).
        self.budget = ByteBudget(config.body_budget_bytes)
        # /health: the last answer (loop time, status, body) and the probe running now.
        self._health_answer: tuple[float, int, dict[str, Any]] | None = None
        self._health_probe: asyncio.Task[tuple[int, dict[str, Any]]] | None = None
        self._health_session: aiohttp.ClientSession | None = None
        self._site: EdgeSite | None = None
        self.metrics.set("ec_s3_proxy_requests_in_flight", 0)
        self._encoder_session: aiohttp.ClientSession | None = None
        self._pd_session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        # Encoder requests that outlive their chat request (parallel dispatch: p/d
        # answered first); each ends within encode_timeout_s, or at stop().
        self._background: set[asyncio.Task[Any]] = set()
        self.skips = EncoderSkips(config, self.metrics, self._warner)
        # What the encoders publish per modality: the check of a trusted client's tensors.
        self.embeds_rules = EmbedsRules()
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[_json_errors])
        app[PROXY_KEY] = self
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_endpoint)
        app.cleanup_ctx.append(self._sessions_ctx)
        return app

    async def _sessions_ctx(self, app: web.Application) -> Any:
        """Two sessions, so that encoder traffic can never take the PD's connections, and a
        small third one for /health's probes, so that they never queue behind either."""
        cfg = self.config

        def connector(n_upstreams: int) -> aiohttp.TCPConnector:
            return aiohttp.TCPConnector(
                limit=cfg.max_connections_per_upstream * max(n_upstreams, 1),
                limit_per_host=cfg.max_connections_per_upstream,
                keepalive_timeout=cfg.keepalive_timeout_s,
            )

        # auto_decompress=False: bodies are relayed byte for byte with their encoding.
        self._encoder_session = aiohttp.ClientSession(connector=connector(len(cfg.encoder_urls)))
        self._pd_session = aiohttp.ClientSession(connector=connector(len(cfg.pd_urls)), auto_decompress=False)
        n_upstreams = len(cfg.pd_urls) + len(cfg.encoder_urls)
        self._health_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=2 * n_upstreams, limit_per_host=2, keepalive_timeout=cfg.keepalive_timeout_s))
        try:
            yield
        finally:
            if self._health_probe is not None:
                self._health_probe.cancel()
            await self._encoder_session.close()
            await self._pd_session.close()
            await self._health_session.close()

    async def start(self) -> EPDProxy:
        """Bind ``config.host:config.port`` (port 0: any free port) and serve."""
        if self._runner is not None:
            raise RuntimeError("proxy already started")
        # handler_cancellation: a client that hangs up cancels its handler, which closes
        # the upstream connection, so the PD aborts generating for nobody.
        # keepalive_timeout: aiohttp runs it from a connection's start and from each
        # answer until the next head is complete: the head deadline (:mod:`.edge`).
        # auto_decompress=False: no body is inflated (encoded ones are refused).
        # lingering_time: what aiohttp waits, reading and dropping, for the rest of a body
        # that was refused (aiohttp's 10 s would let a slow client hold its socket longer).
        # The lookup client first: its config (env:/file: secrets) is resolved again
        # here, and a failure must leave no port bound (no stop() follows a failed start).
        self.skips.open()
        cfg = self.config
        handler_args: dict[str, Any] = {"access_log": None, "keepalive_timeout": float(cfg.header_timeout_s),
                                        "auto_decompress": False, "lingering_time": _LINGER_S}
        runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=float(cfg.shutdown_timeout_s),
                               **handler_args)
        try:
            await runner.setup()
            try:
                await self._check_fleet()
            except BaseException:
                await runner.cleanup()
                raise
            site = EdgeSite(runner, cfg.host, cfg.port, max_connections=cfg.max_connections,
                            handler_args=handler_args, warner=self._warner)
            try:
                await site.start()
            except BaseException:
                await runner.cleanup()
                raise
        except BaseException:
            await self.skips.close()
            raise
        self._runner = runner
        self._site = site
        self._port = int(runner.addresses[0][1])
        logger.info(
            "ec-s3 proxy: listening on %s (encoders: %s; prefill/decode: %s)",
            self.url, ", ".join(self.config.encoder_urls) or "none", ", ".join(self.config.pd_urls),
        )
        return self

    async def _check_fleet(self) -> None:
        """The upstreams' roles (:mod:`.fleet`): refuse to start when one is wrong; check
        those that do not answer yet in the background."""
        cfg = self.config
        if not cfg.startup_check_s:
            return
        assert self._health_session is not None
        headers = {"Authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        await self.fleet.check(self._health_session, headers, cfg.startup_check_s)
        if self.fleet.wrong():
            raise FleetMisconfigured(self.fleet.describe_wrong())
        for check in self.fleet.checks:
            if check.state == "ok":
                logger.info("ec-s3 proxy: %s %s checked: %s%s", check.kind, check.url,
                            check.role or "no EC role reported", f" at {check.namespace}" if check.namespace else "")
            else:
                logger.warning("ec-s3 proxy: %s %s not checked yet (%s)%s", check.kind, check.url, check.detail,
                               "; checking again in the background" if check.state == "unreachable" else "")
        self.fleet.warn_mismatch()
        self.fleet.watch(self._health_session, headers, cfg.startup_check_s, self._found_wrong)

    def _found_wrong(self, check: Check) -> None:
        """An upstream that came up after the start is in the wrong role: never used."""
        pool = self.encoders if check.kind == "encoder" else self.pds
        for member in pool.members:
            if member.url == check.url:
                member.wrong = True
        logger.error("ec-s3 proxy: %s %s %s; it gets no requests (fix the flag and restart the proxy)",
                     "--encoder-url" if check.kind == "encoder" else "--pd-url", check.url, check.detail)

    def detach(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Let ``tasks`` run on after their request (an encoder's upload still serves
        later requests); they are cancelled at :meth:`stop`."""
        for task in tasks:
            if not task.done():
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        await self.fleet.stop()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self.skips.close()

    async def __aenter__(self) -> EPDProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("proxy not started")
        return self._port

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # ---------------------------------------------------------------- helpers
    def _authorized(self, request: web.Request) -> bool:
        if self.config.api_key is None:
            return True
        got = request.headers.get("Authorization", "")
        # A header's bytes that are not UTF-8 arrive as surrogates: compare them, never fail.
        return hmac.compare_digest(got.encode("utf-8", "surrogateescape"), f"Bearer {self.config.api_key}".encode())

    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        """What upstreams are told: the request id and the upstreams' key. A client's
        Authorization is passed on only when the proxy checks none itself: a key the
        proxy checks is the proxy's, and never leaves it."""
        cfg = self.config
        headers = {"X-Request-Id": request_id}
        if cfg.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {cfg.upstream_api_key}"
        elif cfg.api_key is None and cfg.pass_authorization and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    def _reject(self, status: int, reason: str, message: str, kind: str, **headers: str) -> web.Response:
        self.metrics.inc("ec_s3_proxy_rejected_total", reason=reason)
        return _error(status, message, kind, headers)

    # ---------------------------------------------------------------- chat
    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "AuthenticationError")
        cfg = self.config
        try:
            # The body first, within its deadline and its share of the byte budget (held
            # until the answer ends); a request takes a slot only once its body is in, so
            # a slow client holds a connection and bytes, never a slot.
            async with read_body(request, self.budget, max_bytes=cfg.max_body_bytes,
                                 deadline=body_deadline(cfg.body_timeout_s)) as raw:
                limit = cfg.max_in_flight
                if self._chat_in_flight >= limit:
                    return self._reject(
                        503, "overloaded", f"the server is handling its limit of {limit} requests; retry shortly",
                        "ServiceUnavailable", **{"Retry-After": "1"},
                    )
                self._chat_in_flight += 1
                self.metrics.set("ec_s3_proxy_requests_in_flight", self._chat_in_flight)
                try:
                    return await self._chat(request, raw)
                finally:
                    self._chat_in_flight -= 1
                    self.metrics.set("ec_s3_proxy_requests_in_flight", self._chat_in_flight)
        except BodyRefused as exc:
            self._warner.warn(("client", exc.reason), "ec-s3 proxy: %s %s: answered %d: %s",
                              request.method, request.path, exc.status, exc)
            extra = {"Retry-After": "1"} if exc.status == 503 else {}
            resp = self._reject(exc.status, exc.reason, str(exc), _BODY_ERROR_TYPES[exc.status], **extra)
            resp.force_close()  # what is left of the body is not read
            return resp

    async def _chat(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        cfg = self.config
        request_id = _request_id(request)
        headers = self._upstream_headers(request, request_id)
        try:
            if len(raw) >= _OFFLOAD_BYTES:
                parsed = await asyncio.to_thread(self._read_request, raw)
            else:
                parsed = self._read_request(raw)
            if parsed is None:
                # Not ours to judge: the PD answers a malformed request with its own error.
                self.metrics.inc("ec_s3_proxy_requests_total", kind="unparsed")
                return await self.forward_to_pd(request, raw, headers, stream=False)
            body, named, items = parsed
            parallel = cfg.dispatch == "parallel" and cfg.forward_params
            stream = body.get("stream") is True
            kind = "multimodal" if items else "text"
            self.metrics.inc("ec_s3_proxy_requests_total", kind=kind)
            if items:
                self.metrics.inc("ec_s3_proxy_mm_items_total", len(items))
            if parallel and items and self.config.encoder_urls:
                return await dispatch_parallel(self, request, named, items, headers, stream=stream)
            return await dispatch_serial(self, request, raw, body, named, items, headers, stream=stream)
        except TooManyItems as exc:
            return self._reject(400, "too_many_items", str(exc), "BadRequestError")
        except ClientEmbedsRefused as exc:
            self._warner.warn(("client", "client_embeds"), "ec-s3 proxy: request %s: refused: %s", request_id, exc)
            return self._reject(400, "client_embeds", str(exc), "BadRequestError")
        except BodyError as exc:
            return self._reject(400, "bad_body", str(exc), "BadRequestError")
        except RecursionError:
            # Nesting the parser accepted, too deep for a later step (a key's JSON, say).
            self._warner.warn(("client", "nested"), "ec-s3 proxy: request %s: body nested too deeply", request_id)
            return self._reject(400, "bad_body", "request body is nested too deeply", "BadRequestError")

    def _read_request(self, raw: bytes) -> tuple[dict[str, Any], dict[str, Any], list[MediaItem]] | None:
        """The body parsed, its media named and found (None: not a JSON object); pure, so
        it may run in a thread."""
        cfg = self.config
        body = parse_body(raw)
        if body is None:
            return None
        check_client_embeds(body, trusted=cfg.trust_client_embeds, rules=self.embeds_rules)
        parallel = cfg.dispatch == "parallel" and cfg.forward_params
        named = name_media(body, give_uuids=parallel, limit=cfg.max_items_per_request,
                           trust_embeds=cfg.trust_client_embeds)
        return body, named, find_media_items(named, cfg.max_items_per_request)

    async def encode_one(self, payload: bytes, headers: dict[str, str], request_id: str) -> dict[str, Any] | None:
        """Send one item to the least busy encoder; its ``ec_transfer_params``, or None
        when it failed (logged and counted, never raised)."""
        assert self._encoder_session is not None
        cfg = self.config
        upstream = self.encoders.acquire()
        if upstream is None:
            self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream="none", outcome="skipped")
            return None
        timeout = aiohttp.ClientTimeout(total=cfg.encode_timeout_s, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.read_timeout_s)
        started = time.monotonic()
        outcome, detail = "error", ""
        try:
            async with self._encoder_session.post(
                f"{upstream.url}/v1/chat/completions", data=payload, headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:200]
                    outcome, detail = "http_error", f"HTTP {resp.status}: {text}"
                    return None
                payload = await resp.json(content_type=None)
            self.encoders.mark_up(upstream)
            params = payload.get("ec_transfer_params") if isinstance(payload, dict) else None
            if not isinstance(params, dict) or not params:
                outcome, detail = "no_params", "answer carried no ec_transfer_params (is it an ec_producer?)"
                return None
            outcome = "ok"
            self.embeds_rules.learn(params)
            return params
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self.encoders.mark_down(upstream)
            outcome, detail = "unreachable", f"{exc.__class__.__name__}: {exc}"
        except asyncio.TimeoutError:
            outcome, detail = "timeout", f"no answer within encode_timeout_s={cfg.encode_timeout_s:g}"
        except (aiohttp.ClientError, ValueError, RecursionError) as exc:  # RecursionError: a too-deep answer
            outcome, detail = "error", f"{exc.__class__.__name__}: {str(exc)[:200]}"
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left: not the encoder's failure
            raise
        finally:
            self._encoder_done(upstream, outcome, detail, started, request_id)
        return None

    def _encoder_done(self, upstream: Upstream, outcome: str, detail: str, started: float, request_id: str) -> None:
        """An encoder request ended: its upstream released, counted, and a failure logged."""
        self.encoders.release(upstream)
        self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream=upstream.url, outcome=outcome)
        self.metrics.inc("ec_s3_proxy_encoder_seconds_total", time.monotonic() - started, upstream=upstream.url)
        if outcome not in ("ok", "cancelled"):
            self._warner.warn(
                (upstream.url, outcome),
                "ec-s3 proxy: request %s: encoder %s failed (%s); the item goes to prefill/decode "
                "without params and is encoded there",
                request_id, upstream.url, detail,
            )

    # ---------------------------------------------------------------- known items
    async def known_params(
        self, body: dict[str, Any], items: list[MediaItem], *, may_look: bool
    ) -> tuple[dict[str, Any], set[int]]:
        """See :meth:`EncoderSkips.known_params`."""
        return await self.skips.known_params(body, items, may_look=may_look)

    def remember(self, body: dict[str, Any], item: MediaItem, params: dict[str, Any] | None) -> None:
        """See :meth:`EncoderSkips.remember`."""
        self.skips.remember(body, item, params)

    async def forward_to_pd(
        self, request: web.Request, data: bytes, headers: dict[str, str], *, stream: bool,
        retry_data: bytes | None = None, route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Send to a PD (:meth:`pd_begin`) and relay its answer."""
        answer = await self.pd_begin(data, headers, stream=stream, retry_data=retry_data, route_key=route_key,
                                     on_retry=on_retry)
        if isinstance(answer, web.Response):
            return answer
        return await self.pd_finish(request, answer, headers["X-Request-Id"])

    async def pd_begin(
        self, data: bytes, headers: dict[str, str], *, stream: bool, retry_data: bytes | None = None,
        route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> PdAnswer | web.Response:
        """Send to the least busy PD, or under ``route="affinity"`` the one ``route_key``
        (:func:`~ec_s3.proxy.routing.route_key`) ranks first within the load bound (one
        that refuses the connection, so nothing was sent, is skipped for the next) and read the start of its answer: the whole body,
        or for a 200 stream its first events (:meth:`PdAnswer.read_start`), so nothing has
        reached the client yet when this returns (parallel dispatch may still drop the
        answer and send again). The :class:`PdAnswer` holds the upstream until
        :meth:`pd_finish` or its ``close``; errors come back as the client's error answer.
        HTTP errors are relayed as they are, except that a generation vLLM's engine
        refused before any token is sent once more (:mod:`.answer` says why), as
        ``retry_data`` when given (the request with its media instead of metadata-only
        parts, whose blobs p/d could not get: :mod:`.embeds`), calling ``on_retry`` first."""
        answer = await self._pd_send(data, headers, stream=stream, route_key=route_key)
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
            answer = await self._pd_send(data if retry_data is None else retry_data, headers, stream=stream,
                                         route_key=route_key)
        return answer

    async def _pd_send(
        self, data: bytes, headers: dict[str, str], *, stream: bool, route_key: str | None
    ) -> PdAnswer | web.Response:
        """One try of :meth:`pd_begin`."""
        assert self._pd_session is not None
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.read_timeout_s)
        send_headers = {**headers, "Content-Type": "application/json"}
        tried: list[Upstream] = []
        while True:
            upstream = self.pds.acquire(tried, allow_down=True, key=route_key)
            if upstream is None:
                break
            tried.append(upstream)
            answer = PdAnswer(self.pds, upstream, stream)
            try:
                try:
                    answer.resp = await self._pd_session.post(
                        f"{upstream.url}/v1/chat/completions", data=data, headers=send_headers, timeout=timeout
                    )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # Nothing reached this instance: the next one may take the request.
                    answer.close()
                    self.pds.mark_down(upstream)
                    self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="unreachable")
                    self._warner.warn(
                        (upstream.url, "unreachable"),
                        "ec-s3 proxy: prefill/decode %s unreachable: %s", upstream.url, exc,
                    )
                    continue
                self.pds.mark_up(upstream)
                self.metrics.inc("ec_s3_proxy_pd_responses_total", upstream=upstream.url, status=str(answer.resp.status))
                answer.stream = stream and answer.resp.status == 200
                await answer.read_start()
                return answer
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                answer.close()
                return self._pd_failed(upstream, exc, headers["X-Request-Id"])
            except BaseException:  # cancelled (the client left, or parallel dispatch dropped it)
                answer.close()  # aborts the PD's work
                raise
        self._warner.warn(
            ("pd", "none_reachable"),
            "ec-s3 proxy: request %s: no prefill/decode instance reachable (tried %s)",
            headers["X-Request-Id"], ", ".join(u.url for u in tried) or "none",
        )
        return _error(502, _PD_UNAVAILABLE, "BadGateway")

    def _pd_failed(self, upstream: Upstream, exc: BaseException, request_id: str) -> web.Response:
        """The client's answer when prefill/decode timed out (504) or broke off (502)."""
        cfg = self.config
        if isinstance(exc, asyncio.TimeoutError):
            self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="timeout")
            self._warner.warn(
                (upstream.url, "timeout"),
                "ec-s3 proxy: request %s: prefill/decode %s did not answer within total_timeout_s=%s "
                "(or was silent for read_timeout_s=%s)",
                request_id, upstream.url, cfg.total_timeout_s, cfg.read_timeout_s,
            )
            return _error(504, _PD_TIMEOUT, "GatewayTimeout")
        self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="disconnected")
        self._warner.warn(
            (upstream.url, "disconnected"),
            "ec-s3 proxy: request %s: prefill/decode %s failed: %s: %s",
            request_id, upstream.url, exc.__class__.__name__, exc,
        )
        return _error(502, _PD_UNAVAILABLE, "BadGateway")

    async def pd_finish(self, request: web.Request, answer: PdAnswer, request_id: str) -> web.StreamResponse:
        """Relay a begun PD answer to the client (SSE chunk by chunk), then free it."""
        try:
            self.skips.learn_from_answer(answer)
            if screen_answer(answer):  # also keeps ec_transfer_params from the client
                url = answer.upstream.url
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=url, reason="producer_answer")
                self._warner.warn((url, "producer_answer"),
                                  "ec-s3 proxy: request %s: prefill/decode %s answered like an encoder (no tokens, "
                                  "ec_transfer_params): is it an ec_producer? check --pd-url and --encoder-url",
                                  request_id, url)
                return _error(502, "prefill/decode server misconfigured", "BadGateway")
            return await self._relay(request, answer, request_id)
        finally:
            answer.close()

    async def _relay(self, request: web.Request, answer: PdAnswer, request_id: str) -> web.StreamResponse:
        resp = answer.resp
        assert resp is not None
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
        out_headers.setdefault("X-Request-Id", request_id)
        if not answer.stream:
            if resp.status >= 500 and not _is_error_json(answer.first):
                # A server error that is not vLLM's JSON (a gateway's page, a crash): the
                # client gets OpenAI's shape all the same, the log gets what was said.
                self._warner.warn(
                    (answer.upstream.url, "not_json"),
                    "ec-s3 proxy: request %s: prefill/decode %s answered HTTP %d with a body that is not an "
                    "OpenAI error: %r", request_id, answer.upstream.url, resp.status, answer.first[:200],
                )
                kept = {k: v for k, v in out_headers.items() if k.lower() in ("retry-after", "x-request-id")}
                return _error(resp.status, f"prefill/decode server error (HTTP {resp.status})",
                              "ServiceUnavailable" if resp.status == 503 else "InternalServerError", kept)
            return web.Response(status=resp.status, body=answer.first, headers=out_headers)
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        out.headers["Cache-Control"] = "no-cache"
        try:
            await out.prepare(request)
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

    # ---------------------------------------------------------------- other routes
    async def _models(self, request: web.Request) -> web.StreamResponse:
        """From the first PD (in configured order) that answers 200."""
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "AuthenticationError")
        assert self._pd_session is not None
        headers = self._upstream_headers(request, _request_id(request))
        timeout = aiohttp.ClientTimeout(
            total=self.config.health_timeout_s * 5, sock_connect=self.config.connect_timeout_s
        )
        first_answer: tuple[int, bytes, str] | None = None
        for upstream in self.pds.members:
            try:
                async with self._pd_session.get(f"{upstream.url}/v1/models", headers=headers, timeout=timeout) as resp:
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
        return _error(503, "no prefill/decode instance answered /v1/models", "ServiceUnavailable")

    async def _health(self, request: web.Request) -> web.Response:
        """200 while at least one PD answers its /health; encoders are reported, not
        required (without them requests are still served, encoded by the consumer). The
        answer is reused for ``health_cache_s``, and calls that arrive while a probe runs
        share it: a flood of /health calls costs the upstreams one probe each per period."""
        loop = asyncio.get_running_loop()
        cached = self._health_answer
        if cached is not None and loop.time() - cached[0] < self.config.health_cache_s:
            return self._health_response(request, cached[1], cached[2])
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self._probe_upstreams())
        # Shielded: a caller that leaves does not cancel the probe the others wait for.
        status, body = await asyncio.shield(self._health_probe)
        return self._health_response(request, status, body)

    def _health_response(self, request: web.Request, status: int, body: dict[str, Any]) -> web.Response:
        """The upstreams' URLs and states only to who holds the key, with protect_status."""
        if self.config.protect_status and not self._authorized(request):
            body = {"status": body["status"]}
        return web.json_response(body, status=status)

    async def _probe_upstreams(self) -> tuple[int, dict[str, Any]]:
        """One /health probe of every upstream, on the probes' own pool; never raises."""
        assert self._health_session is not None
        session = self._health_session
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
        answer = (200 if ok else 503, {"status": status, "prefill_decode": pd, "encoders": enc, "roles": checks})
        self._health_answer = (asyncio.get_running_loop().time(), *answer)
        return answer

    async def _metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.config.protect_status and not self._authorized(request):
            return _error(401, "invalid or missing API key", "AuthenticationError")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def _is_error_json(data: bytes) -> bool:
    """Whether ``data`` is an OpenAI-style error body (``{"error": {...}}``)."""
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    return isinstance(payload, dict) and isinstance(payload.get("error"), dict)


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is short and plain (it becomes vLLM's request id
    and is logged), else one of the proxy's."""
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.fullmatch(given) else f"ecs3-{uuid.uuid4().hex}"


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body, as vLLM answers its own errors."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error the proxy itself answers is an OpenAI-style JSON body: aiohttp's own
    (404, 405, ...) are converted, and a bug is a logged traceback plus a plain 500,
    never a traceback to the client."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kept = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return _error(exc.status, exc.reason, exc.__class__.__name__.removeprefix("HTTP"), kept)
    except ConnectionResetError:  # the client left; nobody to answer
        raise
    except Exception:
        proxy = request.app[PROXY_KEY]
        proxy.metrics.inc("ec_s3_proxy_internal_errors_total")
        logger.exception("ec-s3 proxy: %s %s failed inside the proxy (a bug; please report it)",
                         request.method, request.path)
        return _error(500, "internal proxy error", "InternalServerError")


PROXY_KEY: web.AppKey[EPDProxy] = web.AppKey("ec_s3_proxy", EPDProxy)


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (for ``web.run_app`` or aiohttp's test client);
    its upstream sessions open on the app's startup and close on its cleanup, and
    ``app[PROXY_KEY]`` is its :class:`EPDProxy` (metrics, pools). Serve it with
    ``handler_cancellation=True`` (as :meth:`EPDProxy.start` does) so that a client that
    hangs up also hangs up on the PD. The listening side's bounds (``max_connections``,
    ``header_timeout_s``, no inflated bodies: :mod:`.edge`) come with :meth:`EPDProxy.start`
    only; an app served otherwise has the body deadline and byte budget alone."""
    return EPDProxy(config).app


# --------------------------------------------------------------------------- threads
class ProxyThread:
    """The proxy on its own event loop in a daemon thread, for synchronous callers
    (demos, tests driving real vLLM servers)::

        with ProxyThread(ProxyConfig(encoder_urls=[...], pd_urls=[...], port=0)) as proxy:
            requests.post(f"{proxy.url}/v1/chat/completions", json=...)
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.proxy = EPDProxy(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ec-s3-proxy", daemon=True)

    def start(self, timeout: float = 30.0) -> ProxyThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    @property
    def url(self) -> str:
        return self.proxy.url

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

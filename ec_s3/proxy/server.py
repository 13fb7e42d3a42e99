"""The proxy's aiohttp application: :class:`EPDProxy`, :func:`create_app` and :class:`ProxyThread`.

Owns what one proxy holds (pools, sessions, metrics, known items, encoder requests that
outlive their chat request), binding, the start-up role check, stopping, and the calls
dispatch makes (:class:`~ec_s3.proxy.dispatch.Sender`), each handed to its module. It
does not own a route's work (:mod:`.chat`, :mod:`.status`), the sends (:mod:`.encode`,
:mod:`.pd`), relaying (:mod:`.relay`) or their order (:mod:`.dispatch`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.chat import ChatRoute
from ec_s3.proxy.client_embeds import EmbedsRules
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.edge import EdgeSite
from ec_s3.proxy.encode import EncoderSender
from ec_s3.proxy.fleet import Check, Fleet, FleetMisconfigured
from ec_s3.proxy.front import json_errors
from ec_s3.proxy.limits import ByteBudget
from ec_s3.proxy.media import MediaItem
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.pd import PdSender
from ec_s3.proxy.relay import Relay
from ec_s3.proxy.sessions import UpstreamSessions
from ec_s3.proxy.skips import EncoderSkips
from ec_s3.proxy.status import StatusRoutes
from ec_s3.proxy.upstreams import Pool, Warner

# ProxyConfig is re-exported: callers build one and hand it to EPDProxy / ProxyThread.
__all__ = ["PROXY_KEY", "EPDProxy", "PdAnswer", "ProxyConfig", "ProxyThread", "create_app"]

# After an answer to a body it did not read whole (408, 413, 415, 503), aiohttp reads on and
# drops what still comes this long, so that the client can read the answer, then closes.
_LINGER_S = 2.0


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
        # Memory of the request bodies in flight (edge.read_body charges each request).
        self.budget = ByteBudget(config.body_budget_bytes)
        self._site: EdgeSite | None = None
        self.metrics.set("ec_s3_proxy_requests_in_flight", 0)
        self.sessions = UpstreamSessions(config)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        # Encoder requests that outlive their chat request (parallel dispatch: p/d
        # answered first); each ends within encode_timeout_s, or at stop().
        self._background: set[asyncio.Task[Any]] = set()
        self.skips = EncoderSkips(config, self.metrics, self._warner)
        # What the encoders publish per modality: the check of a trusted client's tensors.
        self.embeds_rules = EmbedsRules()
        # Each concern its own object; this one holds them and the lifecycle.
        self.encoder_sender = EncoderSender(config, self.encoders, self.sessions, self.metrics, self._warner,
                                            self.embeds_rules)
        self.pd_sender = PdSender(config, self.pds, self.sessions, self.metrics, self._warner)
        self.relay = Relay(config, self.metrics, self._warner, self.skips)
        self.status = StatusRoutes(config, self.metrics, self.pds, self.fleet, self.sessions)
        self.chat = ChatRoute(self, self.budget, self._warner, self.embeds_rules)
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[json_errors(self.metrics)])
        app[PROXY_KEY] = self
        app.router.add_post("/v1/chat/completions", self.chat.handle)
        app.router.add_get("/v1/models", self.status.models)
        app.router.add_get("/health", self.status.health)
        app.router.add_get("/metrics", self.status.metrics_endpoint)
        app.cleanup_ctx.append(self._sessions_ctx)
        return app

    async def _sessions_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """The upstream sessions (:mod:`.sessions`), open while the app runs."""
        self.sessions.open()
        try:
            yield
        finally:
            self.status.cancel_probe()
            await self.sessions.close()

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
        session = self.sessions.health
        assert session is not None
        headers = {"Authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        await self.fleet.check(session, headers, cfg.startup_check_s)
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
        self.fleet.watch(session, headers, cfg.startup_check_s, self._found_wrong)

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

    # ---------------------------------------------------------------- what dispatch calls (dispatch.Sender)
    async def encode_one(self, payload: bytes, headers: dict[str, str], request_id: str) -> dict[str, Any] | None:
        """See :meth:`EncoderSender.encode_one`."""
        return await self.encoder_sender.encode_one(payload, headers, request_id)

    async def pd_begin(
        self, data: bytes, headers: dict[str, str], *, stream: bool, retry_data: bytes | None = None,
        route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> PdAnswer | web.Response:
        """See :meth:`PdSender.begin`."""
        return await self.pd_sender.begin(data, headers, stream=stream, retry_data=retry_data, route_key=route_key,
                                          on_retry=on_retry)

    async def pd_finish(self, request: web.Request, answer: PdAnswer, request_id: str) -> web.StreamResponse:
        """See :meth:`Relay.finish`."""
        return await self.relay.finish(request, answer, request_id)

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

    async def known_params(
        self, body: dict[str, Any], items: list[MediaItem], *, may_look: bool
    ) -> tuple[dict[str, Any], set[int]]:
        """See :meth:`EncoderSkips.known_params`."""
        return await self.skips.known_params(body, items, may_look=may_look)

    def remember(self, body: dict[str, Any], item: MediaItem, params: dict[str, Any] | None) -> None:
        """See :meth:`EncoderSkips.remember`."""
        self.skips.remember(body, item, params)


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

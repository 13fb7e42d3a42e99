"""``ec-s3 proxy``: an OpenAI-compatible front for encode / prefill-decode disaggregation.

Per chat request it finds the multimodal items in ``messages``, sends each distinct item
alone to an encoder instance (``ec_role: ec_producer``, items spread over the encoders
and encoded in parallel), merges the ``ec_transfer_params`` the encoders answer with,
and forwards the original request plus those params to a prefill/decode instance
(``ec_role: ec_consumer``), relaying its answer (SSE streams chunk by chunk).

The flow follows vLLM's example proxy (``examples/online_serving/disaggregated_encoder/
disagg_epd_proxy.py``) with three deliberate differences:

* an encoder that is down, slow or failing never fails the client's request: its items
  simply get no params and the consumer encodes them locally (the media stay in the
  forwarded request for exactly that reason);
* the encoders' ``ec_transfer_params`` are merged into the forwarded request (vLLM's
  example discards them: its shared-storage connector does not need them);
* upstream pools are bounded and every timeout is configurable.

The proxy never interprets identifiers: the consumer matches the merged params to its
own items. It only forwards what changes an item's identifier or blob key
(``model``, ``cache_salt``, ``mm_processor_kwargs``, ``media_io_kwargs``) with each item.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from ec_s3.log import logger

__all__ = [
    "PROXY_KEY", "EPDProxy", "ProxyConfig", "ProxyThread",
    "build_parser", "config_from_args", "create_app", "find_media_items", "main", "merge_params",
]

# Content-part types whose media an encoder turns into an encoder output. Embeddings
# (image_embeds, ...) are not encoded by anyone, so they are left alone.
MEDIA_PART_KEYS: dict[str, str] = {
    "image_url": "image_url",
    "input_image": "image_url",  # Responses-API style part
    "image_pil": "image_pil",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
    "video_url": "video_url",
}
# Every content part that becomes one of vLLM's multimodal items (mm_features), in
# message order; used to number items the way the consumer's request does.
_EMBED_PART_TYPES = frozenset({"image_embeds", "audio_embeds", "video_embeds"})
# Request fields that change an item's identifier (processor kwargs, decoded media) or
# its blob key (cache_salt): the encoder must see them to publish what the consumer
# will look for.
ENCODER_CARRIED_FIELDS = ("model", "cache_salt", "mm_processor_kwargs", "media_io_kwargs")

_WARN_INTERVAL_S = 10.0
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length", "Date", "Server",
    )
)


# --------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; validated on construction, URLs normalised.

    ``encoder_urls`` may be empty (every request then goes straight to PD, which still
    finds what the fleet already published when its ``lookup`` is ``always``).
    Timeouts are seconds; ``total_timeout_s=None`` lets a PD answer (a long stream)
    take as long as it takes.
    """

    encoder_urls: Sequence[str]
    pd_urls: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 8000
    # TCP connect to any upstream.
    connect_timeout_s: float = 5.0
    # Whole encoder request, connect included; past it the item is left to the consumer.
    encode_timeout_s: float = 30.0
    # Whole PD exchange including the streamed body; None: no limit.
    total_timeout_s: float | None = None
    # Each upstream's /health probe of GET /health.
    health_timeout_s: float = 2.0
    # Idle upstream connections are dropped after this; keep it below the upstream's own
    # keep-alive (uvicorn's default is 5 s, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) so a
    # request is never written onto a connection the server is closing.
    keepalive_timeout_s: float = 4.0
    # Connection pool bound per upstream instance (requests beyond it queue in the proxy).
    max_connections_per_upstream: int = 256
    # An upstream that refused a connection is skipped for this long.
    down_cooldown_s: float = 5.0
    # Keep the media in the forwarded request (so the consumer can encode locally). False
    # drops the media of items an encoder published *and* that carry a client ``uuid``
    # (the only parts vLLM accepts without data); the PD then needs them in its processor
    # cache, else it answers an error, which is passed through.
    forward_media: bool = True
    # Forward the client's Authorization header upstream (unless upstream_api_key is set).
    pass_authorization: bool = True
    # Bearer token sent to every upstream instead of the client's (vLLM --api-key).
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    # Bearer token clients must present on /v1/* (None: no check).
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # Largest request body accepted (base64 media is big); larger ones get 413.
    max_body_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder_urls", _normalise_urls(self.encoder_urls, "encoder_urls"))
        object.__setattr__(self, "pd_urls", _normalise_urls(self.pd_urls, "pd_urls"))
        if not self.pd_urls:
            raise ValueError("pd_urls: at least one prefill/decode URL is required")
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port: {self.port!r} is not a TCP port")
        for name in ("connect_timeout_s", "encode_timeout_s", "health_timeout_s", "keepalive_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name}: must be > 0")
        if self.total_timeout_s is not None and not self.total_timeout_s > 0:
            raise ValueError("total_timeout_s: must be > 0 or None")
        if self.down_cooldown_s < 0:
            raise ValueError("down_cooldown_s: must be >= 0")
        if self.max_connections_per_upstream < 1:
            raise ValueError("max_connections_per_upstream: must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes: must be >= 1024")


def _normalise_urls(urls: Iterable[str] | str, name: str) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = [urls]
    out: list[str] = []
    for raw in urls:
        for url in str(raw).split(","):
            url = url.strip().rstrip("/")
            if not url:
                continue
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"{name}: {url!r} is not an http(s)://host:port URL")
            if url not in out:
                out.append(url)
    return tuple(out)


# --------------------------------------------------------------------------- metrics
class _Metrics:
    """Counters and gauges rendered as Prometheus text; single-threaded (one loop)."""

    _HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "ec_s3_proxy_requests_total": ("counter", "Chat requests received, by whether they held media."),
        "ec_s3_proxy_mm_items_total": ("counter", "Media items seen in chat requests."),
        "ec_s3_proxy_items_without_params_total": ("counter", "Media items forwarded without encoder params."),
        "ec_s3_proxy_encoder_requests_total": ("counter", "Encoder requests by upstream and outcome."),
        "ec_s3_proxy_encoder_seconds_total": ("counter", "Time spent in encoder requests."),
        "ec_s3_proxy_pd_responses_total": ("counter", "PD answers relayed, by upstream and HTTP status."),
        "ec_s3_proxy_pd_failures_total": ("counter", "PD exchanges that failed below HTTP, by reason."),
        "ec_s3_proxy_client_disconnects_total": ("counter", "Clients gone before their answer was relayed."),
        "ec_s3_proxy_in_flight": ("gauge", "Requests outstanding per upstream."),
        "ec_s3_proxy_upstream_up": ("gauge", "0 while an upstream is skipped after refusing a connection."),
    }

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self._values[key] = self._values.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels: str) -> float:
        """Sum of every series of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self._values.items() if n == name and want <= set(ls))

    def render(self) -> str:
        lines: list[str] = []
        for name, (kind, doc) in self._HELP.items():
            series = sorted((ls, v) for (n, ls), v in self._values.items() if n == name)
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")
            for ls, v in series:
                label_text = ",".join(f'{k}="{_escape_label(val)}"' for k, val in ls)
                lines.append(f"{name}{{{label_text}}} {v:g}" if label_text else f"{name} {v:g}")
        return "\n".join(lines) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Warner:
    """One warning per (upstream, kind) per interval, with the count it held back: a dead
    encoder under load must not flood the log."""

    def __init__(self, interval_s: float = _WARN_INTERVAL_S) -> None:
        self._interval = interval_s
        self._state: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, key: tuple[str, str], msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, held = self._state.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._state[key] = (last, held + 1)
            return
        self._state[key] = (now, 0)
        if held:
            msg += " (%d similar suppressed)"
            args = (*args, held)
        logger.warning(msg, *args)


# --------------------------------------------------------------------------- upstreams
class _Upstream:
    """One encoder or PD instance with its load and its refuse-to-connect cooldown."""

    __slots__ = ("down_until", "in_flight", "role", "url")

    def __init__(self, role: str, url: str) -> None:
        self.role = role
        self.url = url
        self.in_flight = 0
        self.down_until = 0.0

    def up(self, now: float) -> bool:
        return now >= self.down_until


class _Pool:
    """Least-outstanding-requests choice with round-robin among ties, skipping instances
    in cooldown; the pick is counted at once so that the items of one request, picked
    back to back, land on different instances."""

    def __init__(self, role: str, urls: Sequence[str], metrics: _Metrics, cooldown_s: float) -> None:
        self.role = role
        self.members = [_Upstream(role, u) for u in urls]
        self._metrics = metrics
        self._cooldown_s = cooldown_s
        self._rr = itertools.count()
        for m in self.members:
            metrics.set("ec_s3_proxy_in_flight", 0, role=role, upstream=m.url)
            metrics.set("ec_s3_proxy_upstream_up", 1, role=role, upstream=m.url)

    def acquire(self, exclude: Iterable[_Upstream] = (), *, allow_down: bool = False) -> _Upstream | None:
        excluded = set(map(id, exclude))
        now = time.monotonic()
        candidates = [m for m in self.members if id(m) not in excluded and m.up(now)]
        if not candidates and allow_down:
            candidates = [m for m in self.members if id(m) not in excluded]
        if not candidates:
            return None
        start = next(self._rr) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        chosen = min(rotated, key=lambda m: m.in_flight)
        chosen.in_flight += 1
        self._metrics.set("ec_s3_proxy_in_flight", chosen.in_flight, role=self.role, upstream=chosen.url)
        return chosen

    def release(self, member: _Upstream) -> None:
        member.in_flight -= 1
        self._metrics.set("ec_s3_proxy_in_flight", member.in_flight, role=self.role, upstream=member.url)

    def mark_down(self, member: _Upstream) -> None:
        member.down_until = time.monotonic() + self._cooldown_s
        self._metrics.set("ec_s3_proxy_upstream_up", 0, role=self.role, upstream=member.url)

    def mark_up(self, member: _Upstream) -> None:
        if member.down_until:
            member.down_until = 0.0
            self._metrics.set("ec_s3_proxy_upstream_up", 1, role=self.role, upstream=member.url)


# --------------------------------------------------------------------------- items
@dataclasses.dataclass
class _Item:
    """One distinct media part of a request and where it occurs among its mm items."""

    part: dict[str, Any]
    indices: list[int]


def find_media_items(body: dict[str, Any]) -> list[_Item]:
    """The distinct media parts of ``messages`` (identical parts once, with every index).

    Indices number all multimodal parts (embeddings included) in message order, which
    is how the consumer numbers its ``mm_features``; they replace the encoder's
    ``item_indices`` (always 0: it saw one item). Parts whose media is null (a ``uuid``
    reference to the PD's processor cache) are not sent to encoders: nothing to encode.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    by_key: dict[str, _Item] = {}
    index = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            media_key = _media_key(part)
            if media_key is None:
                if part.get("type") in _EMBED_PART_TYPES:
                    index += 1
                continue
            if part.get(media_key) not in (None, "", {}):
                key = json.dumps(part, sort_keys=True, separators=(",", ":"))
                item = by_key.get(key)
                if item is None:
                    by_key[key] = _Item(part, [index])
                else:
                    item.indices.append(index)
            index += 1
    return list(by_key.values())


def _media_key(part: dict[str, Any]) -> str | None:
    """The field holding a part's media, as vLLM's parser finds it (``type``, or for
    untyped / uuid-carrying parts the first media field present), else None."""
    part_type = part.get("type")
    if isinstance(part_type, str) and part_type in MEDIA_PART_KEYS and part.get("uuid") is None:
        return MEDIA_PART_KEYS[part_type]
    if part_type is None or part.get("uuid") is not None:
        for key in ("image_url", "image_pil", "audio_url", "input_audio", "video_url"):
            if key in part:
                return key
    return None


def merge_params(results: Sequence[tuple[_Item, dict[str, Any] | None]]) -> dict[str, Any]:
    """Union of the encoders' ``ec_transfer_params`` (keyed by identifier); an identifier
    answered twice keeps the first entry with the union of item indices."""
    merged: dict[str, Any] = {}
    for item, params in results:
        for ident, entry in (params or {}).items():
            if isinstance(entry, dict) and "item_indices" in entry:
                entry = {**entry, "item_indices": list(item.indices)}
            if ident not in merged:
                merged[ident] = entry
            elif isinstance(merged[ident], dict) and isinstance(entry, dict) and "item_indices" in entry:
                seen = merged[ident].setdefault("item_indices", [])
                seen.extend(i for i in entry["item_indices"] if i not in seen)
    return merged


# --------------------------------------------------------------------------- proxy
class EPDProxy:
    """The proxy's state (upstream pools, HTTP sessions, metrics) and its aiohttp server.

    In-process use::

        proxy = EPDProxy(ProxyConfig(encoder_urls=[...], pd_urls=[...], port=0))
        await proxy.start()          # binds; proxy.url is then e.g. http://127.0.0.1:41234
        ...
        await proxy.stop()

    or ``async with EPDProxy(config) as proxy: ...``; from synchronous code use
    :class:`ProxyThread`; from another process run ``python -m ec_s3.proxy.server`` (``main``).
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = _Metrics()
        self.encoders = _Pool("encoder", config.encoder_urls, self.metrics, config.down_cooldown_s)
        self.pds = _Pool("pd", config.pd_urls, self.metrics, config.down_cooldown_s)
        self._warner = _Warner()
        self._encoder_session: aiohttp.ClientSession | None = None
        self._pd_session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app[PROXY_KEY] = self
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_endpoint)
        app.cleanup_ctx.append(self._sessions_ctx)
        return app

    async def _sessions_ctx(self, app: web.Application) -> Any:
        """Two sessions, so that encoder traffic can never take the PD's connections."""
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
        try:
            yield
        finally:
            await self._encoder_session.close()
            await self._pd_session.close()

    async def start(self) -> EPDProxy:
        """Bind ``config.host:config.port`` (port 0: any free port) and serve."""
        if self._runner is not None:
            raise RuntimeError("proxy already started")
        # handler_cancellation: a client that hangs up cancels its handler, which closes
        # the upstream connection, so the PD aborts generating for nobody.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        logger.info(
            "ec-s3 proxy: listening on %s (encoders: %s; prefill/decode: %s)",
            self.url, ", ".join(self.config.encoder_urls) or "none", ", ".join(self.config.pd_urls),
        )
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

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
        return hmac.compare_digest(got.encode(), f"Bearer {self.config.api_key}".encode())

    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.config.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        elif self.config.pass_authorization and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    # ---------------------------------------------------------------- chat
    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "AuthenticationError")
        raw = await request.read()
        request_id = request.headers.get("X-Request-Id") or f"ecs3-{uuid.uuid4().hex}"
        headers = self._upstream_headers(request, request_id)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            # Not ours to judge: the PD answers a malformed request with its own error.
            self.metrics.inc("ec_s3_proxy_requests_total", kind="unparsed")
            return await self._forward_to_pd(request, raw, headers, stream=False)

        items = find_media_items(body)
        stream = body.get("stream") is True
        self.metrics.inc("ec_s3_proxy_requests_total", kind="multimodal" if items else "text")
        if not items and "ec_transfer_params" not in body:
            return await self._forward_to_pd(request, raw, headers, stream=stream)

        params: dict[str, Any] = {}
        if items:
            self.metrics.inc("ec_s3_proxy_mm_items_total", len(items))
            results = await self._encode_all(body, items, headers, request_id)
            params = merge_params(results)
            missing = sum(1 for _, p in results if not p)
            if missing:
                self.metrics.inc("ec_s3_proxy_items_without_params_total", missing)
            if not self.config.forward_media:
                body = _strip_published_media(body, results)
            logger.debug(
                "ec-s3 proxy: request %s: %d media item(s), %d published by encoders",
                request_id, len(items), len(items) - missing,
            )
        forwarded = dict(body)
        # The proxy owns this field: a client-sent one is dropped, never trusted.
        forwarded.pop("ec_transfer_params", None)
        if params:
            forwarded["ec_transfer_params"] = params
        data = json.dumps(forwarded, separators=(",", ":")).encode()
        return await self._forward_to_pd(request, data, headers, stream=stream)

    async def _encode_all(
        self, body: dict[str, Any], items: list[_Item], headers: dict[str, str], request_id: str
    ) -> list[tuple[_Item, dict[str, Any] | None]]:
        """One encoder request per distinct item, all in parallel; never raises for an
        encoder's sake (an item without params is encoded by the consumer)."""
        carried = {k: body[k] for k in ENCODER_CARRIED_FIELDS if k in body}
        tasks = []
        for n, item in enumerate(items):
            enc_body = {
                **carried,
                "messages": [{"role": "user", "content": [item.part]}],
                "max_tokens": 1,
                "stream": False,
            }
            enc_headers = {**headers, "X-Request-Id": f"{request_id}-enc{n}"}
            tasks.append(self._encode_one(enc_body, enc_headers, request_id))
        # Every task picks its encoder before its first await, all in this tick, so the
        # picks see each other's load and the items spread over the encoders.
        outcomes = await asyncio.gather(*tasks)
        return list(zip(items, outcomes, strict=True))

    async def _encode_one(
        self, body: dict[str, Any], headers: dict[str, str], request_id: str
    ) -> dict[str, Any] | None:
        assert self._encoder_session is not None
        cfg = self.config
        upstream = self.encoders.acquire()
        if upstream is None:
            self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream="none", outcome="skipped")
            return None
        timeout = aiohttp.ClientTimeout(total=cfg.encode_timeout_s, sock_connect=cfg.connect_timeout_s)
        started = time.monotonic()
        outcome, detail = "error", ""
        try:
            async with self._encoder_session.post(
                f"{upstream.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout
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
            return params
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self.encoders.mark_down(upstream)
            outcome, detail = "unreachable", f"{exc.__class__.__name__}: {exc}"
        except asyncio.TimeoutError:
            outcome, detail = "timeout", f"no answer within encode_timeout_s={cfg.encode_timeout_s:g}"
        except (aiohttp.ClientError, ValueError) as exc:
            outcome, detail = "error", f"{exc.__class__.__name__}: {exc}"
        finally:
            self.encoders.release(upstream)
            self.metrics.inc("ec_s3_proxy_encoder_requests_total", upstream=upstream.url, outcome=outcome)
            self.metrics.inc("ec_s3_proxy_encoder_seconds_total", time.monotonic() - started, upstream=upstream.url)
            if outcome != "ok":
                self._warner.warn(
                    (upstream.url, outcome),
                    "ec-s3 proxy: request %s: encoder %s failed (%s); the item goes to prefill/decode "
                    "without params and is encoded there",
                    request_id, upstream.url, detail,
                )
        return None

    async def _forward_to_pd(
        self, request: web.Request, data: bytes, headers: dict[str, str], *, stream: bool
    ) -> web.StreamResponse:
        """Send to the least busy PD; one that refuses the connection (nothing was sent)
        is skipped for the next. HTTP errors are relayed as they are."""
        assert self._pd_session is not None
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, sock_connect=cfg.connect_timeout_s)
        send_headers = {**headers, "Content-Type": "application/json"}
        tried: list[_Upstream] = []
        last_error = ""
        while True:
            upstream = self.pds.acquire(tried, allow_down=True)
            if upstream is None:
                break
            tried.append(upstream)
            resp: aiohttp.ClientResponse | None = None
            try:
                try:
                    resp = await self._pd_session.post(
                        f"{upstream.url}/v1/chat/completions", data=data, headers=send_headers, timeout=timeout
                    )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # Nothing reached this instance: the next one may take the request.
                    self.pds.mark_down(upstream)
                    self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="unreachable")
                    last_error = f"{upstream.url}: {exc}"
                    self._warner.warn(
                        (upstream.url, "unreachable"),
                        "ec-s3 proxy: prefill/decode %s unreachable: %s", upstream.url, exc,
                    )
                    continue
                self.pds.mark_up(upstream)
                self.metrics.inc("ec_s3_proxy_pd_responses_total", upstream=upstream.url, status=str(resp.status))
                return await self._relay(
                    request, resp, upstream.url, headers["X-Request-Id"], stream=stream and resp.status == 200
                )
            except asyncio.TimeoutError:
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="timeout")
                return _error(504, f"prefill/decode {upstream.url} did not answer in time", "GatewayTimeout")
            except aiohttp.ClientError as exc:
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream.url, reason="disconnected")
                logger.warning(
                    "ec-s3 proxy: prefill/decode %s failed: %s: %s", upstream.url, exc.__class__.__name__, exc
                )
                return _error(502, f"prefill/decode {upstream.url} failed: {exc.__class__.__name__}", "BadGateway")
            finally:
                self.pds.release(upstream)
                if resp is not None:
                    resp.close()  # no-op once released; aborts the PD's work if we were cancelled
        return _error(502, f"no prefill/decode instance reachable ({last_error})", "BadGateway")

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, upstream_url: str, request_id: str, *, stream: bool
    ) -> web.StreamResponse:
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
        out_headers.setdefault("X-Request-Id", request_id)
        if not stream:
            body = await resp.read()
            resp.release()
            return web.Response(status=resp.status, body=body, headers=out_headers)
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        out.headers["Cache-Control"] = "no-cache"
        try:
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # Status and headers are gone already: end the stream with an error event,
                # in the shape vLLM uses for errors inside a stream.
                reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "disconnected"
                self.metrics.inc("ec_s3_proxy_pd_failures_total", upstream=upstream_url, reason=reason)
                logger.warning(
                    "ec-s3 proxy: request %s: prefill/decode stream broke: %s", request_id, exc.__class__.__name__
                )
                resp.close()
                event = {"error": {"message": f"upstream stream broke ({reason})", "type": "BadGateway", "code": 502}}
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
            await out.write_eof()
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

    # ---------------------------------------------------------------- other routes
    async def _models(self, request: web.Request) -> web.StreamResponse:
        """From the first PD (in configured order) that answers 200."""
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "AuthenticationError")
        assert self._pd_session is not None
        headers = self._upstream_headers(request, request.headers.get("X-Request-Id") or f"ecs3-{uuid.uuid4().hex}")
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
        required (without them requests are still served, encoded by the consumer)."""
        assert self._pd_session is not None and self._encoder_session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)

        async def probe(session: aiohttp.ClientSession, url: str) -> bool:
            try:
                async with session.get(f"{url}/health", timeout=timeout) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        pd_urls, enc_urls = self.config.pd_urls, self.config.encoder_urls
        results = await asyncio.gather(
            *(probe(self._pd_session, u) for u in pd_urls), *(probe(self._encoder_session, u) for u in enc_urls)
        )
        pd = dict(zip(pd_urls, results[: len(pd_urls)], strict=True))
        enc = dict(zip(enc_urls, results[len(pd_urls):], strict=True))
        ok = any(pd.values())
        return web.json_response(
            {"status": "ok" if ok else "unavailable", "prefill_decode": pd, "encoders": enc}, status=200 if ok else 503
        )

    async def _metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8")


def _strip_published_media(
    body: dict[str, Any], results: Sequence[tuple[_Item, dict[str, Any] | None]]
) -> dict[str, Any]:
    """``forward_media=False``: null the media of parts that an encoder published and that
    carry a ``uuid`` (vLLM's form for a part without data); every other part is kept."""
    # Identical parts were merged into one item: match parts by value.
    published = [item.part for item, params in results if params and item.part.get("uuid") is not None]
    if not published:
        return body
    messages = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        new_content = []
        for part in content:
            key = _media_key(part) if isinstance(part, dict) else None
            if key is not None and part in published:
                part = {**part, key: None}
            new_content.append(part)
        messages.append({**message, "content": new_content})
    return {**body, "messages": messages}


def _error(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error body, as vLLM answers its own errors."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


PROXY_KEY: web.AppKey[EPDProxy] = web.AppKey("ec_s3_proxy", EPDProxy)


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (for ``web.run_app`` or aiohttp's test client);
    its upstream sessions open on the app's startup and close on its cleanup, and
    ``app[PROXY_KEY]`` is its :class:`EPDProxy` (metrics, pools). Serve it with
    ``handler_cancellation=True`` (as :meth:`EPDProxy.start` does) so that a client that
    hangs up also hangs up on the PD."""
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


# --------------------------------------------------------------------------- CLI
class _Defaults:
    """ProxyConfig's field defaults by attribute, for the help texts."""

    def __getattr__(self, name: str) -> Any:
        return {f.name: f.default for f in dataclasses.fields(ProxyConfig)}[name]


def build_parser(prog: str = "ec-s3 proxy") -> argparse.ArgumentParser:
    d = _Defaults()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "OpenAI-compatible EPD proxy: sends each media item of a chat request to an encoder "
            "(ec_producer), then the request plus the encoders' ec_transfer_params to a "
            "prefill/decode instance (ec_consumer). Encoder failures never fail a request."
        ),
    )
    p.add_argument("--encoder-url", "--encode-servers-urls", dest="encoder_urls", action="append", default=[],
                   metavar="URL", help="encoder instance base URL; repeat or comma-separate (none: all go to PD)")
    p.add_argument("--pd-url", "--prefill-decode-servers-urls", dest="pd_urls", action="append", default=[],
                   metavar="URL", required=True, help="prefill/decode instance base URL; repeat or comma-separate")
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"port to bind, 0 for any (default {d.port})")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S",
                   help=f"TCP connect timeout to upstreams (default {d.connect_timeout_s:g})")
    p.add_argument("--encode-timeout", type=float, default=d.encode_timeout_s, metavar="S",
                   help=f"whole encoder request; past it the item is encoded by PD (default {d.encode_timeout_s:g})")
    p.add_argument("--total-timeout", type=float, default=0.0, metavar="S",
                   help="whole PD exchange including a stream; 0 = no limit (default 0)")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s, metavar="S",
                   help=f"per-upstream /health probe (default {d.health_timeout_s:g})")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s, metavar="S",
                   help="drop idle upstream connections after this; keep below the upstreams' keep-alive "
                        f"(VLLM_HTTP_TIMEOUT_KEEP_ALIVE, default 5) (default {d.keepalive_timeout_s:g})")
    p.add_argument("--max-connections-per-upstream", type=int, default=d.max_connections_per_upstream, metavar="N",
                   help=f"connection pool bound per upstream instance (default {d.max_connections_per_upstream})")
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown_s, metavar="S",
                   help=f"skip an upstream this long after it refused a connection (default {d.down_cooldown_s:g})")
    p.add_argument("--no-forward-media", dest="forward_media", action="store_false",
                   help="null the media of uuid-carrying items an encoder published (PD must have them cached)")
    p.add_argument("--api-key", default=os.environ.get("EC_S3_PROXY_API_KEY"),
                   help="bearer token clients must send (default $EC_S3_PROXY_API_KEY; unset: none)")
    p.add_argument("--upstream-api-key", default=os.environ.get("EC_S3_PROXY_UPSTREAM_API_KEY"),
                   help="bearer token sent upstream instead of the client's (default $EC_S3_PROXY_UPSTREAM_API_KEY)")
    p.add_argument("--no-pass-authorization", dest="pass_authorization", action="store_false",
                   help="do not forward the client's Authorization header upstream")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N",
                   help=f"largest request body accepted (default {d.max_body_bytes})")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        encoder_urls=args.encoder_urls,
        pd_urls=args.pd_urls,
        host=args.host,
        port=args.port,
        connect_timeout_s=args.connect_timeout,
        encode_timeout_s=args.encode_timeout,
        total_timeout_s=args.total_timeout or None,
        health_timeout_s=args.health_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connections_per_upstream=args.max_connections_per_upstream,
        down_cooldown_s=args.down_cooldown,
        forward_media=args.forward_media,
        pass_authorization=args.pass_authorization,
        upstream_api_key=args.upstream_api_key or None,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
    )


async def _serve(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    proxy = EPDProxy(config)
    await proxy.start()
    try:
        await stop.wait()
    finally:
        logger.info("ec-s3 proxy: shutting down")
        await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    """``ec-s3 proxy`` / ``python -m ec_s3.proxy.server``: serve until SIGINT or SIGTERM."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        config = config_from_args(args)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(args.log_level)
    try:
        asyncio.run(_serve(config))
    except OSError as exc:  # e.g. the port is taken
        logger.error("ec-s3 proxy: cannot serve on %s:%s: %s", config.host, config.port, exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``POST /v1/chat/completions``: a chat request read, checked and handed to its dispatch.

Owns the route's order: the client's key, its body (:mod:`.edge`), a slot of
``max_in_flight``, parsing and naming (off the event loop for a large body), the choice of
parallel or serial dispatch, and the 400, 408, 413, 415 and 503 answers to what the client
sent. It does not own the sends or their order (:mod:`.dispatch`, :mod:`.encode`,
:mod:`.pd`), reading bodies (:mod:`.media`, :mod:`.naming`) or relaying (:mod:`.relay`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from ec_s3.proxy.client_embeds import ClientEmbedsRefused, EmbedsRules, check_client_embeds
from ec_s3.proxy.dispatch import Sender, dispatch_parallel, dispatch_serial
from ec_s3.proxy.edge import BodyRefused, body_deadline, read_body
from ec_s3.proxy.front import authorized, error_response, request_id, upstream_headers
from ec_s3.proxy.limits import ByteBudget
from ec_s3.proxy.media import BodyError, MediaItem, TooManyItems, find_media_items, parse_body
from ec_s3.proxy.naming import name_media
from ec_s3.proxy.upstreams import Warner

__all__ = ["ChatRoute"]

# A request body at least this large is parsed and named off the event loop: its JSON
# work would stall every other request (~2 ms per MB here).
_OFFLOAD_BYTES = 1024 * 1024
_BODY_ERROR_TYPES = {408: "RequestTimeout", 413: "RequestEntityTooLarge", 415: "UnsupportedMediaType",
                     503: "ServiceUnavailable"}


class ChatRoute:
    """The chat route of one proxy (``proxy``: what dispatch sends through); ``in_flight``
    counts its requests between arrival and the end of their answer (``max_in_flight``)."""

    def __init__(self, proxy: Sender, budget: ByteBudget, warner: Warner, embeds_rules: EmbedsRules) -> None:
        self.proxy = proxy
        self.config = proxy.config
        self.metrics = proxy.metrics
        # Memory of the request bodies in flight (edge.read_body charges each request).
        self.budget = budget
        self.warner = warner
        # What the encoders publish per modality: the check of a trusted client's tensors.
        self.embeds_rules = embeds_rules
        self.in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The route's handler: the key, the body, a slot, then :meth:`_chat`."""
        if not authorized(self.config, request):
            return error_response(401, "invalid or missing API key", "AuthenticationError")
        cfg = self.config
        try:
            # The body first, within its deadline and its share of the byte budget (held
            # until the answer ends); a request takes a slot only once its body is in, so
            # a slow client holds a connection and bytes, never a slot.
            async with read_body(request, self.budget, max_bytes=cfg.max_body_bytes,
                                 deadline=body_deadline(cfg.body_timeout_s)) as raw:
                limit = cfg.max_in_flight
                if self.in_flight >= limit:
                    return self._reject(
                        503, "overloaded", f"the server is handling its limit of {limit} requests; retry shortly",
                        "ServiceUnavailable", **{"Retry-After": "1"},
                    )
                self.in_flight += 1
                self.metrics.set("ec_s3_proxy_requests_in_flight", self.in_flight)
                try:
                    return await self._chat(request, raw)
                finally:
                    self.in_flight -= 1
                    self.metrics.set("ec_s3_proxy_requests_in_flight", self.in_flight)
        except BodyRefused as exc:
            self.warner.warn(("client", exc.reason), "ec-s3 proxy: %s %s: answered %d: %s",
                             request.method, request.path, exc.status, exc)
            extra = {"Retry-After": "1"} if exc.status == 503 else {}
            resp = self._reject(exc.status, exc.reason, str(exc), _BODY_ERROR_TYPES[exc.status], **extra)
            resp.force_close()  # what is left of the body is not read
            return resp

    def _reject(self, status: int, reason: str, message: str, kind: str, **headers: str) -> web.Response:
        self.metrics.inc("ec_s3_proxy_rejected_total", reason=reason)
        return error_response(status, message, kind, headers)

    async def _chat(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        cfg = self.config
        rid = request_id(request)
        headers = upstream_headers(cfg, request, rid)
        try:
            if len(raw) >= _OFFLOAD_BYTES:
                parsed = await asyncio.to_thread(self._read_request, raw)
            else:
                parsed = self._read_request(raw)
            if parsed is None:
                # Not ours to judge: the PD answers a malformed request with its own error.
                self.metrics.inc("ec_s3_proxy_requests_total", kind="unparsed")
                return await self.proxy.forward_to_pd(request, raw, headers, stream=False)
            body, named, items = parsed
            parallel = cfg.dispatch == "parallel" and cfg.forward_params
            stream = body.get("stream") is True
            kind = "multimodal" if items else "text"
            self.metrics.inc("ec_s3_proxy_requests_total", kind=kind)
            if items:
                self.metrics.inc("ec_s3_proxy_mm_items_total", len(items))
            if parallel and items and cfg.encoder_urls:
                return await dispatch_parallel(self.proxy, request, named, items, headers, stream=stream)
            return await dispatch_serial(self.proxy, request, raw, body, named, items, headers, stream=stream)
        except TooManyItems as exc:
            return self._reject(400, "too_many_items", str(exc), "BadRequestError")
        except ClientEmbedsRefused as exc:
            self.warner.warn(("client", "client_embeds"), "ec-s3 proxy: request %s: refused: %s", rid, exc)
            return self._reject(400, "client_embeds", str(exc), "BadRequestError")
        except BodyError as exc:
            return self._reject(400, "bad_body", str(exc), "BadRequestError")
        except RecursionError:
            # Nesting the parser accepted, too deep for a later step (a key's JSON, say).
            self.warner.warn(("client", "nested"), "ec-s3 proxy: request %s: body nested too deeply", rid)
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

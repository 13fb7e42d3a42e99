"""How a chat request with media travels: serial or parallel dispatch.

Owns the order of sends, serial (encoders first, their ``ec_transfer_params`` merged into
the p/d request) or parallel (p/d at the same time, its items marked pending), the resend
(at most one per failed item; one with the media for a missing blob) and when items skip
the encoder or go metadata-only (:mod:`.skips`, :mod:`.embeds` say which). Does not own
sending one request (:mod:`.encode`, :mod:`.pd`), relaying (:mod:`.relay`), naming
(:mod:`.naming`) or body rewriting (:mod:`.media`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.media import (
    MediaItem,
    dump_body,
    encoder_payload,
    merge_params,
    splice_params,
    strip_media,
    strip_published_media,
)
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.embeds import metadata_only_body, resend_body
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.fleet import Fleet
from ec_s3.proxy.naming import pending_params
from ec_s3.proxy.routing import route_key

if TYPE_CHECKING:
    from ec_s3.proxy.skips import EncoderSkips

__all__ = ["Answer", "Sender", "dispatch_parallel", "dispatch_serial"]


class Answer(Protocol):
    """A p/d answer begun and not yet relayed (:class:`ec_s3.proxy.answer.PdAnswer`)."""

    def close(self) -> None: ...


class Sender(Protocol):
    """What dispatch needs of the proxy (:class:`ec_s3.proxy.server.EPDProxy`): sending
    one item to an encoder, and beginning, finishing or wholly forwarding a p/d answer."""

    config: ProxyConfig
    metrics: ProxyMetrics
    skips: EncoderSkips
    fleet: Fleet

    async def encode_one(self, payload: bytes, headers: dict[str, str], request_id: str) -> dict[str, Any] | None: ...

    async def pd_begin(
        self, data: bytes, headers: dict[str, str], *, stream: bool, retry_data: bytes | None = None,
        route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> Any: ...

    async def pd_finish(self, request: web.Request, answer: Any, request_id: str) -> web.StreamResponse: ...

    async def forward_to_pd(
        self, request: web.Request, data: bytes, headers: dict[str, str], *, stream: bool,
        retry_data: bytes | None = None, route_key: str | None = None, on_retry: Callable[[], None] | None = None,
    ) -> web.StreamResponse: ...

    def detach(self, tasks: list[asyncio.Task[Any]]) -> None: ...

    async def known_params(
        self, body: dict[str, Any], items: list[MediaItem], *, may_look: bool
    ) -> tuple[dict[str, Any], set[int]]: ...

    def remember(self, body: dict[str, Any], item: MediaItem, params: dict[str, Any] | None) -> None: ...


def _encode_tasks(
    proxy: Sender, body: dict[str, Any], items: list[MediaItem], headers: dict[str, str]
) -> list[asyncio.Task[dict[str, Any] | None]]:
    """One encoder request per item, started now. Payloads are serialised first, so a
    body too deep to serialise is refused before any POST; every task picks its encoder
    before its first await, all in one tick, so the picks see each other's load."""
    request_id = headers["X-Request-Id"]
    payloads = [encoder_payload(body, item) for item in items]
    tasks = []
    for n, payload in enumerate(payloads):
        enc_headers = {**headers, "X-Request-Id": f"{request_id}-enc{n}", "Content-Type": "application/json"}
        task = asyncio.ensure_future(proxy.encode_one(payload, enc_headers, request_id))
        task.add_done_callback(lambda t, item=items[n]: _remember(proxy, body, item, t))
        tasks.append(task)
    return tasks


def _remember(proxy: Sender, body: dict[str, Any], item: MediaItem, task: asyncio.Task[Any]) -> None:
    """The encoder answered: its blob is on its way, and later requests need no encoder."""
    if not task.cancelled() and task.exception() is None and _kept(task.result()):
        proxy.remember(body, item, task.result())


async def _split_known(
    proxy: Sender, body: dict[str, Any], items: list[MediaItem], *, may_look: bool
) -> tuple[dict[str, Any], list[MediaItem], list[MediaItem]]:
    """(params of the items known to be in the bucket, those items, the rest)."""
    if not items:
        return {}, [], []
    present, found = await proxy.known_params(body, items, may_look=may_look)
    return present, [i for n, i in enumerate(items) if n in found], [i for n, i in enumerate(items) if n not in found]


async def dispatch_serial(
    proxy: Sender, request: web.Request, raw: bytes, original: dict[str, Any], body: dict[str, Any],
    items: list[MediaItem], headers: dict[str, str], *, stream: bool,
) -> web.StreamResponse:
    """Encoders first, then p/d with their merged params. ``original`` is the client's
    parsed ``raw``; ``body`` is it named (:func:`~.naming.name_media`)."""
    route = route_key(items)
    present, known, items = await _split_known(proxy, body, items, may_look=False)
    params: dict[str, Any] = dict(present)
    if known and not proxy.config.forward_media:
        body = strip_media(body, [item.part for item in known])
    if items:
        results = list(zip(items, await _gather(_encode_tasks(proxy, body, items, headers)), strict=True))
        params.update(merge_params(results))
        missing = sum(1 for _, p in results if not p)
        if missing:
            proxy.metrics.inc("ec_s3_proxy_items_without_params_total", missing)
        if not proxy.config.forward_media:
            body = strip_published_media(body, results)
        logger.debug(
            "ec-s3 proxy: request %s: %d media item(s), %d published by encoders",
            headers["X-Request-Id"], len(items), len(items) - missing,
        )
    if not proxy.config.forward_params:
        params = {}  # vLLM's example-proxy contract: PD sees the client's request only
    slim = _metadata_only(proxy, body, [*known, *items], params, params)
    if slim is not None:
        return await proxy.forward_to_pd(request, slim.data, headers, stream=stream, retry_data=slim.retry,
                                         route_key=route, on_retry=slim.forget)
    if not params and body is original and "ec_transfer_params" not in body:
        return await proxy.forward_to_pd(request, raw, headers, stream=stream, route_key=route)  # nothing to change
    if params and body is original:
        # The client's bytes plus the params: the media are not serialised again.
        spliced = splice_params(raw, body, params)
        if spliced is not None:
            return await proxy.forward_to_pd(request, spliced, headers, stream=stream, route_key=route)
    return await proxy.forward_to_pd(request, _pd_payload(body, params), headers, stream=stream, route_key=route)


async def _gather(tasks: list[asyncio.Task[Any]]) -> list[Any]:
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # no-op when done; a cancelled request stops its encoders


def _pd_payload(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    forwarded = dict(body)
    # The proxy owns this field: a client-sent one is dropped, never trusted.
    forwarded.pop("ec_transfer_params", None)
    if params:
        forwarded["ec_transfer_params"] = params
    return dump_body(forwarded)


class _Slim:
    """A p/d payload with metadata-only items, its resend with their media under fresh
    uuids (:func:`~.embeds.resend_body`), and what to forget when the resend goes."""

    def __init__(self, proxy: Sender, body: dict[str, Any], slim: dict[str, Any], items: list[MediaItem],
                 params: dict[str, Any]) -> None:
        self.data = _pd_payload(slim, params)
        self.retry = _pd_payload(*resend_body(body, items, params))
        self._proxy, self._body, self._items = proxy, body, items

    def forget(self) -> None:
        """p/d could not get these items' blobs: later requests must not send them
        metadata-only, nor marked present, again."""
        self._proxy.skips.forget(self._body, self._items)


def _metadata_only(
    proxy: Sender, body: dict[str, Any], items: list[MediaItem], entries: dict[str, Any], params: dict[str, Any]
) -> _Slim | None:
    """p/d's payload (``body`` with ``params``) with ``items`` sent metadata-only where
    their entry in ``entries`` allows (:func:`~.embeds.metadata_only_body`), with its
    resend; None when no item is."""
    if proxy.config.metadata_only and entries:
        slim, slimmed = metadata_only_body(body, items, entries)
        if slimmed:
            proxy.metrics.inc("ec_s3_proxy_metadata_only_items_total", len(slimmed))
            return _Slim(proxy, body, slim, slimmed, params)
    return None


def _kept(params: dict[str, Any] | None) -> bool:
    """Whether an encoder's answer means its blob is on its way: a producer whose store
    is down answers without keys (it promises nothing)."""
    return bool(params) and any(isinstance(e, dict) and "key" in e for e in params.values())  # type: ignore[union-attr]


async def dispatch_parallel(
    proxy: Sender, request: web.Request, body: dict[str, Any], items: list[MediaItem],
    headers: dict[str, str], *, stream: bool,
) -> web.StreamResponse:
    """Encoders and p/d at once; p/d sent again without the marks of items whose encoder
    failed, for as long as its answer has not begun (module docstring)."""
    request_id = headers["X-Request-Id"]
    route = route_key(items)
    present, known, items = await _split_known(proxy, body, items, may_look=True)
    encodes = _encode_tasks(proxy, body, items, headers)
    # One turn of the loop: every encoder request has picked its encoder, and those
    # that found none (all down) are done already: their items are never marked.
    try:
        await asyncio.sleep(0)
    except BaseException:  # the client left already
        await _stop(encodes)
        raise
    marked = {n for n, task in enumerate(encodes) if not task.done() or _kept(task.result())}
    unmarked = len(items) - len(marked)
    if unmarked:
        proxy.metrics.inc("ec_s3_proxy_items_without_params_total", unmarked)
    begin = _pd_starter(proxy, body, known, items, present, headers, stream=stream, route=route)
    attempt = await _until_pd_answers(proxy, begin, encodes, marked, request_id)
    answer = attempt.result()
    if isinstance(answer, web.Response):
        return answer
    return await proxy.pd_finish(request, answer, request_id)


def _pd_starter(
    proxy: Sender, body: dict[str, Any], known: list[MediaItem], items: list[MediaItem], present: dict[str, Any],
    headers: dict[str, str], *, stream: bool, route: str | None,
) -> Callable[[set[int]], asyncio.Task[Answer | web.Response]]:
    """What begins one p/d attempt, with the ``items`` numbered in its argument marked
    pending (and, unless ``forward_media``, those and the ``known`` ones without media)."""

    def begin(marked: set[int]) -> asyncio.Task[Answer | web.Response]:
        stripped = [*(item.part for item in known), *(items[n].part for n in marked)]
        pd_body = body if proxy.config.forward_media else strip_media(body, stripped)
        params = {**present, **pending_params(items, marked, proxy.fleet.encoders_namespace)}
        slim = _metadata_only(proxy, pd_body, known, present, params)
        if slim is None:
            return asyncio.ensure_future(proxy.pd_begin(_pd_payload(pd_body, params), headers, stream=stream,
                                                        route_key=route))
        return asyncio.ensure_future(proxy.pd_begin(slim.data, headers, stream=stream, retry_data=slim.retry,
                                                    route_key=route, on_retry=slim.forget))

    return begin


async def _until_pd_answers(
    proxy: Sender, begin: Callable[[set[int]], asyncio.Task[Answer | web.Response]],
    encodes: list[asyncio.Task[dict[str, Any] | None]], marked: set[int], request_id: str,
) -> asyncio.Task[Answer | web.Response]:
    """The p/d attempt whose answer began, begun again without the marks of items whose
    encoder failed before that; encoders still running then are detached. On any exit
    by exception nothing stays open."""
    attempt = begin(marked)
    try:
        while True:
            await asyncio.wait({attempt, *(t for t in encodes if not t.done())}, return_when=asyncio.FIRST_COMPLETED)
            if attempt.done():
                break
            failed = {n for n in marked if encodes[n].done() and not _kept(encodes[n].result())}
            if failed:
                marked -= failed
                proxy.metrics.inc("ec_s3_proxy_items_without_params_total", len(failed))
                proxy.metrics.inc("ec_s3_proxy_pd_resends_total")
                logger.info(
                    "ec-s3 proxy: request %s: %d encoder(s) failed before prefill/decode answered; sending it "
                    "again without their pending marks (prefill/decode encodes those items)", request_id, len(failed),
                )
                await _drop(attempt)
                attempt = begin(marked)
        proxy.detach(encodes)  # p/d's answer no longer waits on them; their uploads serve later requests
    except BaseException:  # the client left (or a bug): nothing may stay open
        await _stop(encodes)
        await _drop(attempt)
        raise
    return attempt


async def _stop(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()  # no-op when done
    await asyncio.wait(tasks)


async def _drop(attempt: asyncio.Task[Any]) -> None:
    """Cancel a p/d attempt and free what it holds (its answer, if it had begun)."""
    attempt.cancel()
    await asyncio.wait({attempt})
    if not attempt.cancelled() and attempt.exception() is None:
        result = attempt.result()
        if not isinstance(result, web.Response):
            result.close()

"""What every route shares: the client's key, the request id, upstream headers, error answers.

Owns the client key check, the X-Request-Id rule, the upstream headers and the
OpenAI-style error bodies (:func:`error_response`; :func:`json_errors` makes aiohttp's own
errors and a bug's one too). It does not own any route (:mod:`.chat`, :mod:`.status`),
relaying (:mod:`.relay`), sending (:mod:`.encode`, :mod:`.pd`) or the app (:mod:`.server`).
"""

from __future__ import annotations

import hmac
import re
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ec_s3.log import logger
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.metrics import ProxyMetrics

__all__ = ["authorized", "error_response", "json_errors", "request_id", "upstream_headers"]

# What a client's X-Request-Id may be to be passed on (it becomes vLLM's request id and is
# logged); any other is replaced by one of the proxy's.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")


def authorized(config: ProxyConfig, request: web.Request) -> bool:
    """Whether ``request`` carries the proxy's client key (always, when it has none)."""
    if config.api_key is None:
        return True
    got = request.headers.get("Authorization", "")
    # A header's bytes that are not UTF-8 arrive as surrogates: compare them, never fail.
    return hmac.compare_digest(got.encode("utf-8", "surrogateescape"), f"Bearer {config.api_key}".encode())


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is short and plain (it becomes vLLM's request id
    and is logged), else one of the proxy's."""
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.fullmatch(given) else f"ecs3-{uuid.uuid4().hex}"


def upstream_headers(config: ProxyConfig, request: web.Request, request_id: str) -> dict[str, str]:
    """What upstreams are told: the request id and the upstreams' key. A client's
    Authorization is passed on only when the proxy checks none itself: a key the
    proxy checks is the proxy's, and never leaves it."""
    headers = {"X-Request-Id": request_id}
    if config.upstream_api_key is not None:
        headers["Authorization"] = f"Bearer {config.upstream_api_key}"
    elif config.api_key is None and config.pass_authorization and "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return headers


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body, as vLLM answers its own errors."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def json_errors(metrics: ProxyMetrics) -> Middleware:
    """The middleware that makes every error the proxy itself answers an OpenAI-style JSON
    body: aiohttp's own (404, 405, ...) are converted, and a bug is a logged traceback plus
    a plain 500 (counted in ``metrics``), never a traceback to the client."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kept = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
            return error_response(exc.status, exc.reason, exc.__class__.__name__.removeprefix("HTTP"), kept)
        except ConnectionResetError:  # the client left; nobody to answer
            raise
        except Exception:
            metrics.inc("ec_s3_proxy_internal_errors_total")
            logger.exception("ec-s3 proxy: %s %s failed inside the proxy (a bug; please report it)",
                             request.method, request.path)
            return error_response(500, "internal proxy error", "InternalServerError")

    return middleware

"""The aiobotocore S3 client of one store: credentials, timeouts, signing, pool.

Owns how a client is built from an :class:`~ec_s3.config.ECS3Config`. Why not
botocore's defaults: over plain HTTP botocore SHA-256-signs every body and computes
CRC checksums on every PUT and GET, which triples client CPU on the 2-core hosts this
runs on; retries are off here because the store does its own (a budget bounds the
time a caller can wait). Does not own requests, retries or errors
(:mod:`ec_s3.store.client`, :mod:`ec_s3.store.errors`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession

from ec_s3.config import ECS3Config

__all__ = ["open_client"]


class BoundedPoolSession(AIOHTTPSession):
    """aiobotocore's aiohttp session with a deadline on getting a connection.

    aiobotocore hands aiohttp only ``sock_connect`` and ``sock_read`` timeouts. aiohttp
    bounds its wait for a free pooled connection (and DNS) by ``ClientTimeout.connect``
    alone, which stays unset: once every pooled connection is held, the next request
    waits forever, and so does every request after it. Here that wait is bounded by
    connect + read timeout; running out raises aiohttp's ``ConnectionTimeoutError``,
    which the store reports as :class:`~ec_s3.store.errors.StoreUnreachable`.
    """

    def __init__(self, *args: Any, timeout: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, timeout=timeout, **kwargs)
        connect, read = timeout if isinstance(timeout, (list, tuple)) else (timeout, timeout)
        if connect is not None and read is not None:
            # _timeout is what aiobotocore passes to its aiohttp.ClientSession.
            self._timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=read, connect=connect + read)


async def open_client(config: ECS3Config, stack: contextlib.AsyncExitStack) -> Any:
    """A new S3 client for ``config``, closed when ``stack`` closes. Does no I/O."""
    session = aioboto3.Session(
        aws_access_key_id=config.access_key_id.reveal() if config.access_key_id else None,
        aws_secret_access_key=config.secret_access_key.reveal() if config.secret_access_key else None,
        aws_session_token=config.session_token.reveal() if config.session_token else None,
        region_name=config.region,
    )
    boto_config = AioConfig(
        region_name=config.region,
        signature_version="s3v4",
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        max_pool_connections=config.max_pool_connections,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
        http_session_cls=BoundedPoolSession,
    )
    return await stack.enter_async_context(
        session.client("s3", endpoint_url=config.endpoint_url, config=boto_config, verify=config.verify_tls)
    )

"""Concurrent requests of one store operation that succeed or fail together.

Owns :func:`all_or_none`, used by the parallel ranged GETs and the parts of a multipart
upload. Does not own the requests themselves (:mod:`ec_s3.store.client`,
:mod:`ec_s3.store.multipart`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["all_or_none"]

T = TypeVar("T")


async def all_or_none(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; on the first failure (or cancellation) cancel the
    others and wait for them, so none still writes into a caller's buffer, or uploads a
    part of an aborted upload, after this returns."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

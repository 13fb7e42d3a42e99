"""Multipart uploads of the S3 store, and the incomplete uploads they can leave behind.

Owns one blob's multipart upload (create, parts in parallel, a conditional Complete), what
the store concludes from Complete's answer, the aborts (in the background, bounded) and the
listing and aborting of stale incomplete uploads (for ``ec-s3 gc --uploads``). Does not own
the request loop, its retries, the breaker or the concurrency bound
(:class:`ec_s3.store.client.S3Store`, reached through :class:`UploadingStore`), nor the data
path a part travels (:mod:`ec_s3.store.transport`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from ec_s3.log import logger
from ec_s3.store.body import BufferChain
from ec_s3.store.error_map import to_store_error
from ec_s3.store.errors import ObjectNotFound, StoreError, StoreUnavailable
from ec_s3.store.settings import StoreConfig
from ec_s3.store.tasks import all_or_none
from ec_s3.store.transport import Transport

__all__ = ["IncompleteUpload", "UploadingStore", "abort_upload_async", "list_uploads_async", "put_multipart"]

T = TypeVar("T")

#: Rounds of abort attempts (each one the store's own ``max_attempts`` retries) before
#: the upload is left to gc; between rounds the wait grows from ``retry_max_delay_s``.
_ABORT_ROUNDS = 3
_UPLOADS_PAGE = 1000  # the ListMultipartUploads maximum


class UploadingStore(Protocol):
    """What this module needs of :class:`ec_s3.store.client.S3Store`."""

    config: StoreConfig
    bucket: str
    stats: Any

    async def head_async(self, key: str) -> object | None: ...

    async def _call(self, op: str, key: str, fn: Callable[[Transport], Awaitable[T]]) -> T: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class _Completion(enum.Enum):
    CREATED = "created"
    EXISTS = "exists"  # 412: another writer's object is there
    CONFLICT = "conflict"  # 409: start a new upload, never retry this one
    GONE = "gone"  # 404 NoSuchUpload: completed by someone (maybe us) or aborted


@dataclasses.dataclass(frozen=True)
class IncompleteUpload:
    key: str
    upload_id: str
    initiated: float  # epoch seconds


async def put_multipart(store: UploadingStore, key: str, view: BufferChain, metadata: dict[str, str]) -> bool:
    """Upload ``view`` as ``key`` in parts; True when this call created the object,
    False when it was already there (a 412, or a HEAD after a 409 / NoSuchUpload)."""
    for round_ in (1, 2):
        completion = await _upload_once(store, key, view, metadata)
        if completion is _Completion.CREATED:
            return True
        if completion is _Completion.EXISTS or await store.head_async(key) is not None:
            return False
        logger.info("ec-s3: multipart upload of %s ended %s and the object is absent; %s",
                    key, completion.value, "starting over" if round_ == 1 else "giving up")
    raise StoreUnavailable("CompleteMultipartUpload", key,
                           "two uploads in a row met a conflicting write or lost their upload id")


async def _upload_once(store: UploadingStore, key: str, view: BufferChain, metadata: dict[str, str]) -> _Completion:
    async def _create(t: Transport) -> str:
        resp = await t.client.create_multipart_upload(
            Bucket=store.bucket, Key=key, Metadata=metadata, ContentType="application/octet-stream",
            **t.checksum_args(),
        )
        return str(resp["UploadId"])

    upload_id = await store._call("CreateMultipartUpload", key, _create)
    try:
        step = store.config.multipart_part_bytes
        parts = await all_or_none([_upload_part(store, key, upload_id, i + 1, view.slice(start, start + step))
                                   for i, start in enumerate(range(0, len(view), step))])
        completion = await _complete(store, key, upload_id, parts)
    except BaseException:
        store.spawn(_abort_in_background(store, key, upload_id))
        raise
    if completion is not _Completion.CREATED:
        # After a NoSuchUpload too: one request answering 404 where the upload is gone,
        # and no leftover where a gateway said so of an upload it still holds.
        store.spawn(_abort_in_background(store, key, upload_id))
    return completion


async def _upload_part(store: UploadingStore, key: str, upload_id: str, number: int,
                       chunk: BufferChain) -> dict[str, Any]:
    return await store._call("UploadPart", key, lambda t: t.put_part(key, upload_id, number, chunk))


async def _complete(store: UploadingStore, key: str, upload_id: str, parts: list[dict[str, Any]]) -> _Completion:
    async def _send(t: Transport) -> _Completion:
        try:
            await t.client.complete_multipart_upload(
                Bucket=store.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)}, IfNoneMatch="*",
            )
        except Exception as exc:  # noqa: BLE001 - mapped; anything else goes to the store's loop
            error = to_store_error("CompleteMultipartUpload", key, exc)
            # Decided here, inside the attempt: the store's loop would retry a 409
            # ConditionalRequestConflict (a throttling-like code) with this upload id.
            if error is not None and error.status == 412:
                return _Completion.EXISTS
            if error is not None and error.status == 409:
                return _Completion.CONFLICT
            if error is not None and error.code == "NoSuchUpload":
                return _Completion.GONE
            raise
        return _Completion.CREATED

    return await store._call("CompleteMultipartUpload", key, _send)


async def abort_upload_async(store: UploadingStore, key: str, upload_id: str) -> None:
    """Abort one upload (the store's retries apply); an upload already gone is no error."""

    try:
        await store._call("AbortMultipartUpload", key,
                          lambda t: t.client.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=upload_id))
    except ObjectNotFound:
        return  # 404 NoSuchUpload: completed or aborted already


async def _abort_in_background(store: UploadingStore, key: str, upload_id: str) -> None:
    """Abort with bounded retries; never raises (it runs detached from any caller)."""
    delay = max(store.config.retry_max_delay_s, 0.01)
    for round_ in range(1, _ABORT_ROUNDS + 1):
        try:
            await abort_upload_async(store, key, upload_id)
            return
        except StoreError as exc:
            error: StoreError = exc
        except Exception as exc:  # noqa: BLE001 - a detached task must not die with a traceback
            error = StoreUnavailable("AbortMultipartUpload", key, f"{type(exc).__name__}: {exc}")
        if not error.transient or round_ == _ABORT_ROUNDS:
            break
        await asyncio.sleep(delay)
        delay *= 4
    store.stats.abandoned_uploads += 1
    logger.warning("ec-s3: could not abort the multipart upload %s of %s (%s); its parts stay in the bucket "
                   "until `ec-s3 gc --uploads` or the lifecycle rule aborts it", upload_id, key, error.reason)


async def list_uploads_async(store: UploadingStore, prefix: str) -> AsyncIterator[IncompleteUpload]:
    """Every incomplete multipart upload under ``prefix``, page by page."""
    markers: dict[str, str] = {}
    while True:
        async def _list(t: Transport, markers: dict[str, str] = markers) -> dict[str, Any]:
            return await t.client.list_multipart_uploads(Bucket=store.bucket, Prefix=prefix,
                                                       MaxUploads=_UPLOADS_PAGE, **markers)

        page = await store._call("ListMultipartUploads", prefix, _list)
        for item in page.get("Uploads") or []:
            initiated = item.get("Initiated")
            yield IncompleteUpload(key=str(item["Key"]), upload_id=str(item["UploadId"]),
                                   initiated=initiated.timestamp() if initiated else 0.0)
        key_marker, id_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
        if not page.get("IsTruncated") or not (key_marker or id_marker):
            return
        markers = {"KeyMarker": str(key_marker or ""), "UploadIdMarker": str(id_marker or "")}

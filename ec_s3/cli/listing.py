"""Listing a bucket the way the commands need it: whole prefixes, one page, or the
namespaces (first key segments) under ``<prefix>/``.

Owns the walk over ListObjectsV2 pages and what a key's namespace is; ``*_async``
variants are for code on the store's loop. Does not own what is done with the objects,
nor retries or errors (the store's).
"""

from __future__ import annotations

from typing import Any

from ec_s3.cli.common import Progress, no_progress
from ec_s3.store.client import ObjectInfo, S3Store

__all__ = [
    "key_root",
    "list_namespaces",
    "list_namespaces_async",
    "list_objects",
    "list_objects_async",
    "list_page",
    "namespace_of",
]

_LIST_TIMEOUT_S = None  # listing a large prefix takes as long as it takes; requests time out singly


def key_root(prefix: str) -> str:
    """``<prefix>/`` with exactly one slash, whatever the operator typed."""
    return prefix.strip("/") + "/"


def namespace_of(prefix: str, key: str) -> str:
    """The namespace segment of ``key`` under ``prefix`` (``""`` for objects right under it)."""
    root = key_root(prefix)
    rest = key[len(root):] if key.startswith(root) else key
    return rest.split("/", 1)[0] if "/" in rest else ""


async def list_page(store: S3Store, prefix: str, *, max_keys: int = 1000, delimiter: str | None = None,
                    token: str | None = None) -> dict[str, Any]:
    """One raw ListObjectsV2 page (``Contents``, ``CommonPrefixes``, continuation)."""
    async def _list(transport: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": store.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        return await transport.client.list_objects_v2(**kwargs)

    return await store._call("LIST", prefix, _list)


async def list_objects_async(store: S3Store, prefix: str, progress: Progress | None = None) -> list[ObjectInfo]:
    progress = progress or no_progress
    found: list[ObjectInfo] = []
    async for info in store.list_async(prefix):
        found.append(info)
        if len(found) % 1000 == 0:
            progress("listing", len(found), None)
    progress("listing", len(found), None)
    return found


def list_objects(store: S3Store, prefix: str, progress: Progress | None = None) -> list[ObjectInfo]:
    """Every object under ``prefix`` (a key prefix, usually ``<prefix>/`` or ``<prefix>/<ns>/``)."""
    return store.run(list_objects_async(store, prefix, progress), _LIST_TIMEOUT_S)


async def list_namespaces_async(store: S3Store, prefix: str) -> list[str]:
    root, token, found = key_root(prefix), None, []
    while True:
        page = await list_page(store, root, delimiter="/", token=token)
        for cp in page.get("CommonPrefixes") or []:
            ns = str(cp["Prefix"])[len(root):].strip("/")
            if ns:
                found.append(ns)
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return found


def list_namespaces(store: S3Store, prefix: str) -> list[str]:
    """The namespaces (first key segments) under ``<prefix>/``, probe area included."""
    return store.run(list_namespaces_async(store, prefix), _LIST_TIMEOUT_S)

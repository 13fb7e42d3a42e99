"""Which media items skip the encoder: the proxy's table of items in the bucket, kept up
to date from encoder answers, prefill/decode answers and (opt-in) HEADs of the fleet's bucket.

Owns the table's use (:meth:`EncoderSkips.known_params`), the lookup client's lifecycle,
the key space per model (learned from encoder answers: the namespace is the producers' to
derive) and the ``known`` and ``bucket_lookups`` metrics. It does not own the table's
bounds and expiry (:mod:`.known`), the order of sends (:mod:`.dispatch`) or HTTP (:mod:`.server`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from ec_s3.blob.format import MISSING_REPORT, PRESENT_MARK
from ec_s3.blob.keys import KeySpace, probe_key
from ec_s3.blob.placeholder import read_placeholder
from ec_s3.log import logger
from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.known import KnownBlobs, item_ref, keyspace_of
from ec_s3.proxy.media import MediaItem, dump_body
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.upstreams import Warner

if TYPE_CHECKING:
    from ec_s3.store.transport import ObjectInfo

__all__ = ["EncoderSkips"]

# Models whose key space is remembered (one per model name the encoders answered for).
_MAX_KEYSPACES = 64


class EncoderSkips:
    """The known-items table and the optional bucket lookups of one proxy (one loop)."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics, warner: Warner) -> None:
        self.config = config
        self.metrics = metrics
        self._warner = warner
        self.known = KnownBlobs(config.known_max_entries, config.known_max_bytes, config.known_ttl_s,
                                config.known_settle_s)
        # Read at each scrape: the table's own numbers, never a copy that could lag.
        metrics.mirror("ec_s3_proxy_known_entries", lambda: {(): len(self.known)})
        metrics.mirror("ec_s3_proxy_known_forgotten_total",
                       lambda: {(reason,): n for reason, n in self.known.forgotten.items()})
        # Opt-in HEADs (bucket_lookup): the store, its key prefix, and per model the key
        # space its encoders' answers showed.
        self._bucket: Any = None
        self._bucket_prefix = ""
        self._keyspaces: dict[str, KeySpace] = {}

    def open(self) -> None:
        """Create the lookup client (``bucket_lookup``), warming it in the background."""
        if self.config.bucket_lookup is None or self._bucket is not None:
            return
        from ec_s3.config import ECS3Config
        from ec_s3.store.client import S3Store

        store_config = ECS3Config.from_extra_config(dict(self.config.bucket_lookup))
        self._bucket, self._bucket_prefix = S3Store(store_config), store_config.prefix
        # The first lookup must not pay for the credential chain, the client and a
        # handshake: within bucket_lookup_timeout_s that would send the item to an encoder.
        self._bucket.warm_up(probe_key(store_config.prefix))

    async def close(self) -> None:
        if self._bucket is not None:
            bucket, self._bucket = self._bucket, None
            await asyncio.to_thread(bucket.close, 2.0)

    async def known_params(
        self, body: dict[str, Any], items: list[MediaItem], *, may_look: bool
    ) -> tuple[dict[str, Any], set[int]]:
        """The ``ec_transfer_params`` of the items known to be in the bucket, and their
        indices in ``items``: those need no encoder. With ``may_look`` (parallel dispatch:
        items named by content) and ``bucket_lookup``, the others are looked up with a
        HEAD first, all at once, for at most ``bucket_lookup_timeout_s``."""
        if not self.known.enabled or not self.config.forward_params:
            return {}, set()
        now = time.monotonic()
        params: dict[str, Any] = {}
        found: set[int] = set()
        heads: list[tuple[int, str, str, str]] = []  # (index, ref, key, identifier)
        space = self._keyspaces.get(str(body.get("model")))
        for n, item in enumerate(items):
            ref = item_ref(body, item)
            known = self.known.get(ref, now)
            if known is not None:
                params.update(known.params(item.indices, now))
                found.add(n)
                self.metrics.inc("ec_s3_proxy_encoder_skips_total", source=known.source)
                continue
            name = item.part.get("uuid")
            if (may_look and self._bucket is not None and space is not None and isinstance(name, str)
                    and "mm_processor_kwargs" not in body):
                # Without processor kwargs vLLM's identifier is the uuid itself.
                salt = body.get("cache_salt")
                key = space.key_for(name, cache_salt=salt if isinstance(salt, str) else None)
                heads.append((n, ref, key, name))
        if heads:
            for (n, ref, key, name), hit in zip(heads, await self._head_all([k for _, _, k, _ in heads]), strict=True):
                if hit is not None:
                    placeholder = read_placeholder(hit.metadata)
                    self.known.remember_present(ref, key, name, placeholder=placeholder)
                    params[name] = {**(placeholder or {}), PRESENT_MARK: True, "item_indices": list(items[n].indices)}
                    found.add(n)
                    self.metrics.inc("ec_s3_proxy_encoder_skips_total", source="bucket")
        return params, found

    async def _head_all(self, keys: list[str]) -> list[ObjectInfo | None]:
        """What a HEAD of each key found (None: not in the bucket); a failed or late
        HEAD counts as not found (the item then goes to an encoder, which is always right)."""
        store = self._bucket
        try:
            futures = [asyncio.wrap_future(store.submit(store.head_async(k))) for k in keys]
        except Exception as exc:  # noqa: BLE001 - the store is closing: the encoders get the items
            self.metrics.inc("ec_s3_proxy_bucket_lookups_total", len(keys), outcome="error")
            self._warner.warn(("bucket", "error"), "ec-s3 proxy: bucket lookup failed: %s", exc)
            return [None] * len(keys)
        done, pending = await asyncio.wait(futures, timeout=self.config.bucket_lookup_timeout_s)
        for f in pending:
            f.cancel()
        if pending:
            self._warner.warn(
                ("bucket", "timeout"),
                "ec-s3 proxy: %d bucket lookup(s) took longer than bucket_lookup_timeout_s (%g s); their items "
                "went to encoders. Check the store's latency from this host, or raise --bucket-lookup-timeout",
                len(pending), self.config.bucket_lookup_timeout_s,
            )
        out: list[ObjectInfo | None] = []
        for f in futures:
            hit: ObjectInfo | None = None
            if f in pending:
                outcome = "timeout"
            elif f.exception() is not None:
                outcome = "error"
                self._warner.warn(("bucket", "error"), "ec-s3 proxy: bucket lookup failed: %s", f.exception())
            else:
                hit = f.result()
                outcome = "hit" if hit is not None else "miss"
            self.metrics.inc("ec_s3_proxy_bucket_lookups_total", outcome=outcome)
            out.append(hit)
        return out

    def remember(self, body: dict[str, Any], item: MediaItem, params: dict[str, Any] | None) -> None:
        """An encoder answered for ``item`` of ``body``: its blob is (about to be) in the bucket."""
        if not params or not self.known.enabled or not self.config.forward_params:
            return
        if self.known.remember_answer(item_ref(body, item), params) and self._bucket is not None:
            model = str(body.get("model"))
            if model not in self._keyspaces and len(self._keyspaces) < _MAX_KEYSPACES:
                key = next(e["key"] for e in params.values() if isinstance(e, dict) and "key" in e)
                space = keyspace_of(key, self._bucket_prefix)
                if space is not None:
                    self._keyspaces[model] = space

    def forget(self, body: dict[str, Any], items: list[MediaItem]) -> None:
        """Prefill/decode could not get these items of ``body`` sent metadata-only (their
        request is resent with the media): forget them, so that no later request relies
        on their blobs before an encoder answers for them again."""
        forgotten = sum(self.known.forget_ref(item_ref(body, item), "resent") for item in items)
        logger.info("ec-s3 proxy: prefill/decode could not get %d metadata-only item(s); forgot %d entries",
                    len(items), forgotten)

    def learn_from_answer(self, answer: PdAnswer) -> None:
        """A non-streamed answer whose consumer found blobs marked present missing lists
        their keys (``ec_transfer_params``): forget them, and keep the list from the client."""
        if answer.stream or answer.resp is None or answer.resp.status != 200:
            return
        if MISSING_REPORT.encode() not in answer.first:
            return
        try:
            payload = json.loads(answer.first)
            params = payload.get("ec_transfer_params")
            keys = params.pop(MISSING_REPORT)
        except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
            return
        if isinstance(keys, list):
            forgotten = self.known.forget_keys(keys)
            logger.info("ec-s3 proxy: prefill/decode found %d blob(s) marked present missing; forgot %d entries",
                        len(keys), forgotten)
        payload["ec_transfer_params"] = params or None
        answer.first = dump_body(payload)

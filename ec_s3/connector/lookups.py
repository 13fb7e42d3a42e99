"""The scheduler's lookups: starting the ones admission decided on the I/O loop, and
applying their results to the items, with what a blob must be for the request that
reads it.

Owns the fetcher, the count of lookups running, what a lookup validates and how many
bytes it asks for, and the counters and log lines of a result. Does not own deciding
which items to look up (:mod:`ec_s3.connector.admission`), which requests a result
serves or pins (:mod:`ec_s3.connector.scheduler`), nor the GETs (:mod:`ec_s3.transfer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_s3.blob.codec import BlobExpectation
from ec_s3.blob.format import MAX_HEADER_BYTES
from ec_s3.config import ECS3Config
from ec_s3.connector.items import Item, ItemState, ItemTable, Outcome, classify
from ec_s3.connector.model import ModelInfo
from ec_s3.connector.transfer_params import Promise
from ec_s3.log import logger
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.fetcher import ItemFetcher
from ec_s3.transfer.staging import StagingArea

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec

__all__ = ["Lookups", "misfit"]


class Lookups:
    def __init__(self, store: S3Store, staging: StagingArea | None, counters: Counters, model: ModelInfo,
                 config: ECS3Config, items: ItemTable) -> None:
        self.fetcher = ItemFetcher(store, staging, counters)
        self.running = 0  # lookups running on the I/O loop
        self._staging = staging
        self._counters = counters
        self._model = model
        self._config = config
        self._items = items

    def start(self, item: Item, feature: MultiModalFeatureSpec, now: float, promise: Promise | None) -> None:
        item.start_lookup(now)
        expect = expected_size = None
        if self._staging is not None:  # what is staged is validated first
            # Not its rows: those are the asking request's (a client sets them, e.g. with
            # a metadata-only item's grid), and one request's wrong count must not make
            # the blob invalid for every other; misfit checks them per request.
            expect = BlobExpectation(
                identifier=feature.identifier,
                namespace=self._model.keyspace.namespace,
                dtype=self._model.dtype,
                width=self._model.width_for(feature.modality),
                max_bytes=self._config.max_blob_bytes,
            )
            expected_size = self._expected_size(feature, promise)
        self._counters.inc("lookups_started")
        self.running += 1
        self.fetcher.start(item.key, expect, expected_size)

    def _expected_size(self, feature: MultiModalFeatureSpec, promise: Promise | None) -> int | None:
        """The blob's size as the encoder promised it, else at most this request's
        placeholders of the model's width plus a header: the GET asks every range at
        once (a wrong guess costs one more round trip, never a wrong blob)."""
        if promise is not None and promise.size_bytes is not None:
            return promise.size_bytes
        width = self._model.width_for(feature.modality)
        if width is None:
            return None
        rows = feature.mm_position.get_num_embeds()  # the client's grid: bounded like any blob
        return min(rows * width * self._model.dtype.itemsize + MAX_HEADER_BYTES, self._config.max_blob_bytes)

    def apply(self, now: float) -> list[tuple[Item, Outcome]]:
        """Apply the finished lookups to their items: each (item, outcome) of an item still
        looked for. A result nobody waits for any more gives its staged slot back."""
        results = self.fetcher.drain()
        if not results:
            return []
        applied = []
        for key, result in results:
            self.running -= 1
            item = self._items.get(key)
            if item is None or not item.looking:
                staged = classify(result).staged
                if staged is not None and self._staging is not None:
                    self._staging.discard(staged.slot.name)
                continue
            outcome = item.apply(result, now)
            if outcome.counter is not None:
                self._counters.inc(outcome.counter)
            if outcome.state is ItemState.FAILED and not outcome.transient and (
                    item.attempts == 1 or item.attempts % 50 == 0):
                # Outages are logged once by the store's circuit breaker; other
                # failures (403, bad requests) once per item, then every 50 attempts.
                logger.warning("ec-s3: lookup of %s failed: %s (attempt %d)", key, outcome.reason, item.attempts)
            applied.append((item, outcome))
        if self._staging is not None:
            self._counters.set_gauge("staged_bytes", self._staging.used)
        return applied


def misfit(feature: MultiModalFeatureSpec, item: Item | None, model: ModelInfo) -> str:
    """Why a staged blob cannot serve this request's ``feature`` ("" when it fits):
    a blob is validated against the request that started its lookup, and a client
    may reuse a uuid for an image of another size. vLLM would gather it for this
    request's placeholders at once and stop the engine."""
    staged = item.staged if item is not None else None
    if staged is None:
        return ""
    rows, width = feature.mm_position.get_num_embeds(), model.width_for(feature.modality)
    if staged.shape[0] == rows and (width is None or staged.shape[-1] == width):
        return ""
    return f"the staged blob is {list(staged.shape)} but this request has {rows} placeholders of width {width}"

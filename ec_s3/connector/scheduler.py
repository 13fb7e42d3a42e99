"""Scheduler-role part of ECS3Connector.

Every method here runs on vLLM's engine loop and answers from memory: lookups,
downloads and validation run on ec-s3's I/O loop (:mod:`ec_s3.transfer.fetcher`), and their
results are picked up at the next call. That is also why transfers are driven from
here and not from the workers: a step that schedules no tokens never reaches the
worker-side connector, so a deferred request would otherwise wait forever.

Per item (one key in the bucket) the state moves LOOKING → STAGED (consumer: blob
fetched into shared staging and validated), PRESENT (producer: it exists), MISSING,
INVALID, ERROR or NO_SPACE. A request is deferred while an item it needs is being
looked up, within a per-item wait budget; when the budget runs out or the blob is
bad it falls back to local encoding if it still carries the media, or is reported
through ``take_unavailable_requests`` so vLLM fails just that request.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

from ec_s3.blob.codec import BlobExpectation, BlobLayout, BlobMeta
from ec_s3.config import ECS3Config
from ec_s3.transfer.fetcher import Failed, FetchResult, Invalid, ItemFetcher, Missing, NoSpace, Present, Staged
from ec_s3.log import logger
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.connector.model import ModelInfo, host_id
from ec_s3.transfer.staging import StagingArea, StagingSlot
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import S3Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ECS3Scheduler"]

_PROMISE_POLL_MAX_S = 1.0
# A promise usually arrives before its upload is visible: re-poll soon, then back off.
_PROMISE_POLL_BASE_S = 0.005
_PRUNE_EVERY_STEPS = 256


class ItemState(enum.Enum):
    LOOKING = "looking"
    STAGED = "staged"
    PRESENT = "present"
    MISSING = "missing"
    INVALID = "invalid"
    ERROR = "error"
    NO_SPACE = "no_space"


_RETRYABLE = (ItemState.MISSING, ItemState.ERROR, ItemState.NO_SPACE, ItemState.INVALID)


@dataclasses.dataclass
class _Item:
    key: str
    identifier: str
    state: ItemState = ItemState.LOOKING
    checked_at: float = 0.0
    attempts: int = 0
    reason: str = ""
    staged: Staged | None = None
    outage: bool = False  # last lookup failed because the store is down


@dataclasses.dataclass(frozen=True)
class _Promise:
    """What a producer's ``ec_transfer_params`` says about one item, once checked."""

    key: str
    size_bytes: int | None


class _Unavailable(Exception):
    """An item a request needs from the store cannot be had."""


class ECS3Scheduler:
    def __init__(self, vllm_config: VllmConfig, config: ECS3Config, model: ModelInfo, counters: Counters) -> None:
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self._config = config
        self._model = model
        self._counters = counters
        self._is_producer = bool(ec_config.is_ec_producer)
        self._is_consumer = bool(ec_config.is_ec_consumer)
        self._store = S3Store.shared(config)
        self._staging = StagingArea(config.staging_dir, config.staging_bytes) if self._is_consumer else None
        self._fetcher = ItemFetcher(self._store, self._staging, counters)
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self._host = host_id()

        self._items: dict[str, _Item] = {}
        self._key_of: dict[str, str] = {}  # identifier -> key of the request being scheduled
        self._hits: set[str] = set()  # identifiers answered True by has_cache_item this step
        self._deadlines: dict[tuple[str, str], float] = {}
        self._local: dict[str, set[str]] = {}  # req_id -> identifiers to encode locally
        self._pins: dict[str, dict[str, StagingSlot]] = {}
        self._promises: dict[str, dict[str, _Promise]] = {}
        self._requests: dict[str, Request] = {}
        self._loads: list[LoadSpec] = []
        self._unavailable: set[str] = set()
        self._steps = 0
        self._retries_reported = 0
        self._in_flight: set[str] = set()  # keys with a lookup running on the I/O loop

    # ------------------------------------------------------------------ admission
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._apply_results()
        now = time.monotonic()
        req_id = request.request_id
        self._requests[req_id] = request
        promises = self._promises_of(request)
        ready = True
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            if feature.identifier in self._local.get(req_id, ()):
                continue
            try:
                ready &= self._admit(request, feature, promises.get(feature.identifier), now)
            except _Unavailable as exc:
                if not self._fall_back(request, feature, str(exc)):
                    return False
        return ready

    def _admit(self, request: Request, feature: MultiModalFeatureSpec, promise: _Promise | None, now: float) -> bool:
        """True when ``feature`` needs no more waiting: staged, present, or to be
        encoded locally. Raises :class:`_Unavailable` when a promise cannot be kept."""
        ident, req_id = feature.identifier, request.request_id
        key = promise.key if promise else self._model.keyspace.key_for(ident, cache_salt=request.cache_salt)
        self._key_of[ident] = key
        if promise is None and self._config.lookup == "promised":
            return True
        item = self._items.get(key)
        if item is not None and self._usable(item) and self._hold(req_id, ident, item):
            self._deadlines.pop((req_id, ident), None)
            return True
        budget = self._config.promised_wait_s if promise else self._config.lookup_wait_s
        deadline = self._deadlines.setdefault((req_id, ident), now + budget)
        if item is None or (item.state in _RETRYABLE and now >= item.checked_at + self._retry_after(item, promise)):
            item = self._start(key, feature, item)
        if item.state is ItemState.LOOKING:
            if now < deadline:
                return False
            if promise:
                raise _Unavailable(f"the blob did not arrive within promised_wait_s={budget:g}s")
            self._counters.inc("lookup_timeouts")
            self._local.setdefault(req_id, set()).add(ident)
            return True
        if promise is None:
            return True  # a miss (or a failed lookup): the encoder runs locally
        if item.state is ItemState.INVALID:
            raise _Unavailable(f"the stored blob is invalid ({item.reason})")
        if item.state is ItemState.ERROR and item.outage:
            raise _Unavailable(f"the store is unavailable ({item.reason})")
        if now < deadline:
            return False
        raise _Unavailable(f"the blob was still {item.state.value} ({item.reason}) after promised_wait_s={budget:g}s")

    def _usable(self, item: _Item) -> bool:
        if self._is_consumer:
            return item.state is ItemState.STAGED
        return item.state is ItemState.PRESENT

    def _hold(self, req_id: str, ident: str, item: _Item) -> bool:
        """Pin a staged item's slot for this request (once); False if it was evicted."""
        if not self._is_consumer:
            return True
        assert self._staging is not None and item.staged is not None
        pins = self._pins.setdefault(req_id, {})
        if ident in pins:
            return not pins[ident].evicted or self._forget(item)
        if not self._staging.pin(item.staged.slot):
            return self._forget(item)
        pins[ident] = item.staged.slot
        return True

    def _forget(self, item: _Item) -> bool:
        self._items.pop(item.key, None)
        return False

    def _retry_after(self, item: _Item, promise: _Promise | None) -> float:
        if item.state is ItemState.NO_SPACE:
            return _PROMISE_POLL_BASE_S
        if promise is not None:
            return min(_PROMISE_POLL_MAX_S, _PROMISE_POLL_BASE_S * 2 ** max(0, item.attempts - 1))
        return self._config.negative_cache_ttl_s

    def _start(self, key: str, feature: MultiModalFeatureSpec, item: _Item | None) -> _Item:
        if item is None:
            item = self._items[key] = _Item(key=key, identifier=feature.identifier)
        item.state = ItemState.LOOKING
        expect = None
        if self._is_consumer:
            expect = BlobExpectation(
                identifier=feature.identifier,
                namespace=self._model.keyspace.namespace,
                dtype=self._model.dtype,
                rows=feature.mm_position.get_num_embeds(),
                width=self._model.width_for(feature.modality),
                max_bytes=self._config.max_blob_bytes,
            )
        self._counters.inc("lookups_started")
        self._in_flight.add(key)
        self._fetcher.start(key, expect)
        return item

    def _fall_back(self, request: Request, feature: MultiModalFeatureSpec, why: str) -> bool:
        """Encode locally if the request still carries the media (True); otherwise
        record it for ``take_unavailable_requests`` (False)."""
        req_id, ident = request.request_id, feature.identifier
        self._deadlines.pop((req_id, ident), None)
        if feature.data is not None:
            self._local.setdefault(req_id, set()).add(ident)
            self._counters.inc("fallbacks_local")
            log = logger.debug if self._store.breaker.is_open else logger.warning
            log("ec-s3: request %s item %s: %s; encoding it locally", req_id, ident[:64], why)
            return True
        self._unavailable.add(req_id)
        self._counters.inc("requests_unavailable")
        logger.error(
            "ec-s3: request %s needs item %s from the store but %s, and it carries no media to "
            "encode locally; failing the request (a retry re-runs the encoder)", req_id, ident[:64], why,
        )
        return False

    def _promises_of(self, request: Request) -> dict[str, _Promise]:
        """Checked promises of ``ec_transfer_params``; anything malformed or pointing
        outside this namespace is ignored with one warning per request."""
        cached = self._promises.get(request.request_id)
        if cached is not None:
            return cached
        promises: dict[str, _Promise] = {}
        raw = getattr(request, "ec_transfer_params", None)
        if raw is not None and not isinstance(raw, dict):
            logger.warning("ec-s3: request %s: ignoring ec_transfer_params of type %s", request.request_id, type(raw).__name__)
            raw = None
        features = {f.identifier: f for f in request.mm_features}
        problems: list[str] = []
        for ident, entry in (raw or {}).items():
            if not isinstance(entry, dict) or "key" not in entry:
                continue  # not an ec-s3 promise (another connector's, or metadata only)
            feature = features.get(ident) if isinstance(ident, str) else None
            problem = self._check_promise(request, feature, entry)
            if problem:
                problems.append(f"{str(ident)[:32]!r}: {problem}")
                continue
            size = entry.get("size_bytes")
            promises[ident] = _Promise(key=entry["key"], size_bytes=size if isinstance(size, int) else None)
        if problems:
            self._counters.inc("promises_ignored", len(problems))
            logger.warning(
                "ec-s3: request %s: ignoring invalid ec_transfer_params entries: %s",
                request.request_id, "; ".join(problems[:5]),
            )
        self._promises[request.request_id] = promises
        return promises

    def _check_promise(self, request: Request, feature: MultiModalFeatureSpec | None, entry: dict[str, Any]) -> str:
        if feature is None:
            return "no such item in the request"
        key = entry.get("key")
        if key != self._model.keyspace.key_for(feature.identifier, cache_salt=request.cache_salt):
            return "key is not this item's key in this namespace (producer uses another model, prefix or namespace?)"
        shape = entry.get("shape")
        if shape is not None:
            rows, width = feature.mm_position.get_num_embeds(), self._model.width_for(feature.modality)
            if (
                not isinstance(shape, list) or len(shape) != 2 or not all(type(d) is int for d in shape)
                or shape[0] != rows or (width is not None and shape[1] != width)
            ):
                return f"shape {shape!r} does not match ({rows}, {width})"
        dtype = entry.get("dtype")
        if dtype is not None and dtype != str(self._model.dtype).removeprefix("torch."):
            return f"dtype {dtype!r} is not the model's"
        size = entry.get("size_bytes")
        if size is not None and (type(size) is not int or not 0 < size <= self._config.max_blob_bytes):
            return "size_bytes out of range"
        return ""

    # ------------------------------------------------------------------ results
    def _apply_results(self) -> None:
        results = self._fetcher.drain()
        if not results:
            return
        now = time.monotonic()
        for key, result in results:
            self._in_flight.discard(key)
            item = self._items.get(key)
            if item is None:
                if isinstance(result, Staged) and self._staging is not None:
                    self._staging.discard(result.slot.name)
                continue
            item.checked_at, item.attempts = now, item.attempts + 1
            item.state, item.reason = _state_of(result)
            item.staged = result if isinstance(result, Staged) else None
            item.outage = isinstance(result, Failed) and result.outage
            if isinstance(result, Failed):
                self._counters.inc("store_errors")
                # Outages are logged once by the store's circuit breaker; other
                # failures (403, bad requests) once per item, then every 50 attempts.
                if not result.transient and (item.attempts == 1 or item.attempts % 50 == 0):
                    logger.warning("ec-s3: lookup of %s failed: %s (attempt %d)", key, result.reason, item.attempts)
            elif isinstance(result, (Staged, Present)):
                self._counters.inc("lookups_hit")
            elif isinstance(result, Missing):
                self._counters.inc("lookups_miss")  # one per 404, polls of a promise included
        if self._staging is not None:
            self._counters.set_gauge("staged_bytes", self._staging.used)

    # ------------------------------------------------------------------ vLLM hooks
    def has_cache_item(self, identifier: str) -> bool:
        key = self._key_of.get(identifier)
        item = self._items.get(key) if key is not None else None
        if item is None or not self._usable(item):
            return False
        if self._is_consumer:
            assert self._staging is not None and item.staged is not None
            if not self._staging.touch(item.staged.slot):
                self._forget(item)
                return False
        self._hits.add(identifier)
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if not self._is_consumer:
            return
        ident = request.mm_features[index].identifier
        if ident not in self._hits:
            return  # vLLM encodes this one itself
        item = self._items.get(self._key_of.get(ident, ""))
        if item is None or item.staged is None or not self._hold(request.request_id, ident, item):
            # has_cache_item said yes a moment ago, so the worker must still get it:
            # it falls back to fetching from S3 itself.
            logger.warning("ec-s3: staged item %s vanished before dispatch", ident[:64])
            return
        staged = item.staged
        self._loads.append(
            LoadSpec(
                identifier=ident, key=item.key, path=staged.slot.path, data_offset=staged.data_offset,
                nbytes=staged.slot.nbytes, dtype=staged.dtype, shape=staged.shape, host=self._host,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECS3ConnectorMetadata:
        if self._in_flight and not scheduler_output.total_num_scheduled_tokens:
            # The engine has nothing to run but our transfers, and its loop does not
            # sleep between steps: without this it would keep the GIL from the I/O
            # thread that runs them (measured: 5-14x longer time-to-schedulable).
            time.sleep(0)
        meta = ECS3ConnectorMetadata(loads=self._loads)
        if self._staging is not None:
            slots = {p.identifier: p for p in self._loads}
            for pins in self._pins.values():
                for ident, slot in pins.items():
                    if ident in slots:
                        self._staging.mark_dispatched(slot)
            self._staging.advance_step()
        self._loads = []
        self._hits.clear()
        if self._is_producer:
            for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
                request = self._requests.get(req_id)
                if request is None or not request.cache_salt:
                    continue  # the worker derives unsalted keys itself
                for index in input_ids:
                    ident = request.mm_features[index].identifier
                    meta.save_keys[ident] = self._model.keyspace.key_for(ident, cache_salt=request.cache_salt)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune()
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, ECS3WorkerMetadata):
            return
        for ident in meta.failed_loads:
            item = self._items.get(self._key_of.get(ident, ""))
            if item is not None and item.staged is not None and self._staging is not None:
                logger.error("ec-s3: a worker could not read staged item %s; dropping it", ident[:64])
                self._staging.discard(item.staged.slot.name)
                self._forget(item)

    def update_state_after_free(self, request: Request, index: int) -> None:
        ident = request.mm_features[index].identifier
        slot = self._pins.get(request.request_id, {}).pop(ident, None)
        if slot is not None and self._staging is not None:
            self._staging.unpin(slot)

    def take_unavailable_requests(self) -> set[str]:
        if not self._unavailable:
            return set()
        failed, self._unavailable = self._unavailable, set()
        return failed

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        for slot in self._pins.pop(req_id, {}).values():
            if self._staging is not None:
                self._staging.unpin(slot)
        for feature in request.mm_features:
            self._deadlines.pop((req_id, feature.identifier), None)
        self._local.pop(req_id, None)
        self._promises.pop(req_id, None)
        self._requests.pop(req_id, None)
        if not self._is_producer:
            return False, None
        return False, self._transfer_params(request) or None

    def _transfer_params(self, request: Request) -> dict[str, dict[str, Any]]:
        """vLLM's per-item metadata plus what a consumer needs to fetch and check
        each blob: key, dtype, shape and the blob's size in bytes."""
        items = collect_ec_item_metadata(request.mm_features, self._resolver)
        dtype = self._model.dtype
        for ident, entry in items.items():
            feature = request.mm_features[entry["item_indices"][0]]
            entry.setdefault("modality", feature.modality)  # vLLM 0.32 omits it; 0.33 adds it
            entry["key"] = self._model.keyspace.key_for(ident, cache_salt=request.cache_salt)
            entry["dtype"] = str(dtype).removeprefix("torch.")
            width = self._model.width_for(feature.modality)
            if width is not None:
                shape = (feature.mm_position.get_num_embeds(), width)
                entry["shape"] = list(shape)
                layout = BlobLayout.plan(
                    BlobMeta(ident, dtype, shape, self._model.keyspace.namespace, self._model.engine_id)
                )
                entry["size_bytes"] = layout.total_nbytes
        return items

    def take_store_retries(self) -> int:
        """Retries of this process's store since the last call (for metrics)."""
        total = self._store.stats.retries
        delta, self._retries_reported = total - self._retries_reported, total
        return delta

    # ------------------------------------------------------------------ upkeep
    def _prune(self) -> None:
        """Forget old misses and errors so the table stays small."""
        now = time.monotonic()
        horizon = max(self._config.negative_cache_ttl_s, _PROMISE_POLL_MAX_S) * 4
        for key in [
            k for k, it in self._items.items()
            if it.state in _RETRYABLE and now - it.checked_at > horizon
        ]:
            del self._items[key]
        live = {f.identifier for r in self._requests.values() for f in r.mm_features}
        for ident in [i for i in self._key_of if i not in live and self._key_of[i] not in self._items]:
            del self._key_of[ident]

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
        self._store.close(timeout=1.0)


def _state_of(result: FetchResult) -> tuple[ItemState, str]:
    if isinstance(result, Staged):
        return ItemState.STAGED, ""
    if isinstance(result, Present):
        return ItemState.PRESENT, ""
    if isinstance(result, Missing):
        return ItemState.MISSING, "not found"
    if isinstance(result, Invalid):
        return ItemState.INVALID, result.reason
    if isinstance(result, NoSpace):
        return ItemState.NO_SPACE, "staging area full"
    assert isinstance(result, Failed)
    return ItemState.ERROR, result.reason

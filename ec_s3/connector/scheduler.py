"""Scheduler-role part of ECS3Connector: which items a request waits for, which are hits.

Every method here runs on vLLM's engine loop and answers from memory: lookups,
downloads and validation run on ec-s3's I/O loop (:mod:`ec_s3.transfer.fetcher`), and their
results are picked up at the next call. That is also why transfers are driven from
here and not from the workers: a step that schedules no tokens never reaches the
worker-side connector, so a deferred request would otherwise wait forever.

A request is deferred while an item it needs is being looked up, within a per-item
wait budget; when the budget runs out or the blob is bad it falls back to local
encoding if it still carries the media, or is reported through
``take_unavailable_requests`` so vLLM fails just that request. A consumer answers "hit"
only for a blob staged on this host, pinned, and only while its workers can read the
staging area (:mod:`ec_s3.connector.topology`): vLLM gathers a hit's embedding in the
same step, and a worker that cannot deliver it would stop the engine.

Owns admission and hit decisions, retry timing and the per-step load list. Does not own
the item state machine and its bounded table (:mod:`ec_s3.connector.items`), the
``ec_transfer_params`` format (:mod:`ec_s3.connector.transfer_params`), transfers
(:mod:`ec_s3.transfer`) or the S3 protocol (:mod:`ec_s3.store`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

from ec_s3.blob.codec import BlobExpectation
from ec_s3.config import ECS3Config
from ec_s3.connector.items import (
    PRODUCER_CAPACITY,
    RETRYABLE,
    Item,
    ItemState,
    ItemTable,
    RequestState,
    consumer_capacity,
)
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.connector.metrics import ECS3Stats, open_stats_reader, scheduler_stats
from ec_s3.connector.model import ModelInfo, describe_role, host_id
from ec_s3.connector.preflight import check_engine_start
from ec_s3.connector.topology import Topology, WorkerReach
from ec_s3.connector.transfer_params import Promise, build_transfer_params, read_promises
from ec_s3.log import logger
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.fetcher import Failed, ItemFetcher, Missing, Present, Staged
from ec_s3.transfer.staging import StagingArea, StagingSlot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ECS3Scheduler"]

# Polling a promised blob that is not visible yet. The schedule depends on how long
# the request has waited, never on how many polls the item had (an item outlives
# requests): back to back, at most one GET in flight per item and at least
# _POLL_DENSE_INTERVAL_S between starts, for the first _POLL_DENSE_S (small blobs land
# then); after that every _POLL_FRACTION of the time waited so far, so a blob is picked
# up within ~5% of its own upload time, capped at _POLL_CAP_S. Cost per waiting item:
# <= 1 GET per max(2 ms, one 404 round trip) for 100 ms (<= 50), then ~20 per tenfold
# of the wait: ~50-100 GETs for a 1 s wait, ~130 for the 5 s default promised_wait_s.
_POLL_DENSE_S = 0.1
_POLL_DENSE_INTERVAL_S = 0.002
_POLL_FRACTION = 0.05
_POLL_CAP_S = 0.25
# An invalid blob stays invalid (blobs are written once), and a store that answered an
# error is not helped by being asked every 2 ms (its client already retried): those
# answers are polled again no sooner than this after they came.
_FAILED_POLL_MIN_S = 0.05
# Staging had no room (pinned slots hold it, or the blob is larger than it): that
# lasts, so back off further. Each attempt is a GET, and the failed allocation evicts
# unpinned staged blobs that other requests may be about to use.
_NO_SPACE_BASE_S = 0.05
_NO_SPACE_MAX_S = 2.0
_PRUNE_EVERY_STEPS = 256


def promise_poll_interval(waited_s: float) -> float:
    """Seconds from the start of one poll of a promised blob to the start of the next,
    for a request that has waited ``waited_s`` for it."""
    if waited_s < _POLL_DENSE_S:
        return _POLL_DENSE_INTERVAL_S
    return min(_POLL_CAP_S, _POLL_FRACTION * waited_s)


class _Unavailable(Exception):
    """An item a request needs from the store cannot be had."""


class ECS3Scheduler:
    def __init__(self, vllm_config: VllmConfig, config: ECS3Config, model: ModelInfo, counters: Counters) -> None:
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self._is_producer = bool(ec_config.is_ec_producer)
        self._is_consumer = bool(ec_config.is_ec_consumer)
        # A producer that is no consumer has no use for the bytes: for an item whose
        # media it has, the bucket's answer only decides whether the encoder can be
        # skipped, so it must not delay the encoder (producer_lookup_wait_s).
        self._encodes_first = self._is_producer and not self._is_consumer
        check_engine_start(vllm_config, config, producer=self._is_producer, consumer=self._is_consumer)
        self._config = config
        self._model = model
        self._counters = counters
        self._store = S3Store.shared(config)
        self._staging = StagingArea(config.staging_dir, config.staging_bytes) if self._is_consumer else None
        self._fetcher = ItemFetcher(self._store, self._staging, counters)
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self._host = host_id()
        # Producers never send loads to their workers: only a consumer must know.
        self._topology = (
            Topology.from_vllm(vllm_config, self._host) if self._is_consumer else Topology(WorkerReach.LOCAL, self._host)
        )

        self._items = ItemTable(consumer_capacity(config.staging_bytes) if self._is_consumer else PRODUCER_CAPACITY)
        self._requests: dict[str, RequestState] = {}
        # This step's hits: identifier -> the item answered for (until build_connector_meta).
        self._hits: dict[str, Item] = {}
        self._loads: list[tuple[LoadSpec, StagingSlot]] = []
        self._unavailable: set[str] = set()
        self._looking = 0  # lookups running on the I/O loop
        self._steps = 0
        self._retries_reported = 0
        self._worker_stats = open_stats_reader(config, vllm_config, self._store.background)
        describe_role("scheduler", vllm_config, config, model)

    # ------------------------------------------------------------------ admission
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._apply_results()
        now = time.monotonic()
        state = self._state_of(request)
        ready = True
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            if feature.identifier in state.local:
                continue
            try:
                ready &= self._admit(state, feature, now)
            except _Unavailable as exc:
                if not self._fall_back(state, feature, str(exc)):
                    return False
        return ready

    def _state_of(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            promises = read_promises(request, self._model, self._config.max_blob_bytes, self._counters)
            state = self._requests[request.request_id] = RequestState(request=request, promises=promises)
        return state

    def _admit(self, state: RequestState, feature: MultiModalFeatureSpec, now: float) -> bool:
        """True when ``feature`` needs no more waiting: staged, present, or to be
        encoded locally. Raises :class:`_Unavailable` when a promise cannot be kept."""
        request, ident = state.request, feature.identifier
        promise = state.promises.get(ident)
        if self._is_consumer and not self._topology.workers_read_staging:
            self._items.point(ident, None)
            if promise is None and feature.data is not None:
                return True  # nobody promised it: vLLM encodes it, as for a miss
            raise _Unavailable("this engine's workers cannot read its staging area (they run on another host)")
        key = promise.key if promise else self._model.keyspace.key_for(ident, cache_salt=request.cache_salt)
        item = self._items.get(key)
        self._items.point(ident, item)
        if item is not None:
            state.use(ident, item)
        # Without media the store is the only source: vLLM cannot encode the item, and
        # an item it schedules for encoding without data stops the engine at the gather.
        local_ok = feature.data is not None
        encode_first = self._encodes_first and local_ok
        if encode_first:
            promise = None  # a producer with the media encodes it rather than wait for anyone's upload
        if promise is None and local_ok and self._config.lookup == "promised":
            return True
        if item is not None and item.state is ItemState.PRESENT and now - item.checked_at > self._config.present_ttl_s:
            # Seen long ago: gc or a lifecycle rule may have deleted it since. Look
            # again; if it is gone, the encoder runs and the publisher uploads it anew.
            self._items.drop(item)
            item = None
        if item is not None and self._usable(item):
            if self._hold(state, ident, item):
                self._stop_waiting(state, ident, now)
                return True
            item = None  # its slot is gone: look it up again
        self._check_fits(promise)
        if promise:
            budget = self._config.promised_wait_s
        elif encode_first:
            budget = self._config.producer_lookup_wait_s
        else:
            budget = self._config.lookup_wait_s
        # The budget's kind is fixed for a request (its promise, this engine's role).
        since = state.waiting_since.setdefault(ident, now)
        deadline = since + budget
        if item is None:
            item = self._items.add(key, ident)
            self._items.point(ident, item)
            state.use(ident, item)
            self._start(item, feature, now)
        elif item.state in RETRYABLE and now >= self._next_lookup_at(item, promise, now - since):
            self._start(item, feature, now)
        if item.looking:
            if now < deadline:
                return False
            if encode_first:
                # The HEAD goes on in the background: its answer is kept for the
                # next request of this item; this one is encoded now.
                if budget:
                    self._counters.inc("lookup_timeouts")
                self._stop_waiting(state, ident, now)
                state.local.add(ident)
                return True
            if promise:
                self._counters.inc("promise_timeouts")
                raise _Unavailable(f"the blob did not arrive within promised_wait_s={budget:g}s")
            self._counters.inc("lookup_timeouts")
            if not local_ok:
                raise _Unavailable(f"its lookup did not finish within lookup_wait_s={budget:g}s")
            state.local.add(ident)
            return True
        if promise is None:
            if not local_ok:
                raise _Unavailable(f"nobody promised it and the bucket lookup came back {item.state.value}")
            return True  # a miss (or a failed lookup): the encoder runs locally
        if item.state is ItemState.INVALID:
            raise _Unavailable(f"the stored blob is invalid ({item.reason})")
        if item.state is ItemState.FAILED and item.outage:
            raise _Unavailable(f"the store is unavailable ({item.reason})")
        if now < deadline:
            return False
        self._counters.inc("promise_timeouts")
        raise _Unavailable(f"the blob was still {item.state.value} ({item.reason}) after promised_wait_s={budget:g}s")

    def _check_fits(self, promise: Promise | None) -> None:
        if self._staging is not None and promise is not None and promise.size_bytes is not None:
            if promise.size_bytes > self._staging.capacity:
                raise _Unavailable(
                    f"the blob ({promise.size_bytes} bytes) is larger than staging_bytes={self._staging.capacity}"
                )

    def _usable(self, item: Item) -> bool:
        if self._is_consumer:
            return item.state is ItemState.STAGED
        return item.state is ItemState.PRESENT

    def _hold(self, state: RequestState, ident: str, item: Item) -> bool:
        """Pin ``item``'s staging slot for this request (consumers); False, and the
        item is forgotten, if staging evicted it meanwhile."""
        if not self._is_consumer:
            return True
        assert self._staging is not None
        slot = item.slot
        assert slot is not None
        pinned = state.pins.get(ident)
        if pinned is slot and not slot.evicted:
            return True
        if pinned is not None:  # evicted, or a slot of an earlier lookup of this item
            self._staging.unpin(state.pins.pop(ident))
        if self._staging.pin(slot):
            state.pins[ident] = slot
            return True
        self._items.drop(item)
        return False

    def _next_lookup_at(self, item: Item, promise: Promise | None, waited: float) -> float:
        """When a finished lookup of ``item`` (a retryable answer) may run again, for a
        request that has waited ``waited`` seconds for it."""
        if item.state is ItemState.NO_SPACE:
            return item.checked_at + min(_NO_SPACE_MAX_S, _NO_SPACE_BASE_S * 2 ** max(0, item.repeats - 1))
        if promise is None:
            return item.checked_at + self._config.negative_cache_ttl_s
        if item.state is ItemState.MISSING:
            return item.started_at + promise_poll_interval(waited)
        # Invalid or failed: the answer stands for a while (a blob is written once).
        return item.checked_at + max(_FAILED_POLL_MIN_S, promise_poll_interval(waited))

    def _start(self, item: Item, feature: MultiModalFeatureSpec, now: float) -> None:
        item.start_lookup(now)
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
        self._looking += 1
        self._fetcher.start(item.key, expect)

    def _stop_waiting(self, state: RequestState, ident: str, now: float) -> None:
        """End ``ident``'s wait (served or given up); a promised item's wait is observed."""
        since = state.waiting_since.pop(ident, None)
        if since is not None and ident in state.promises and not self._encodes_first:
            self._counters.observe("promise_wait_seconds", max(0.0, now - since))

    def _fall_back(self, state: RequestState, feature: MultiModalFeatureSpec, why: str) -> bool:
        """Encode locally if the request still carries the media (True); otherwise
        record it for ``take_unavailable_requests`` (False)."""
        req_id, ident = state.request.request_id, feature.identifier
        self._stop_waiting(state, ident, time.monotonic())
        if feature.data is not None:
            state.local.add(ident)
            self._counters.inc("fallbacks_local")
            quiet = self._store.breaker.is_open or not self._topology.workers_read_staging
            (logger.debug if quiet else logger.warning)(
                "ec-s3: request %s item %s: %s; encoding it locally", req_id, ident[:64], why
            )
            return True
        self._unavailable.add(req_id)
        self._counters.inc("requests_unavailable")
        logger.error(
            "ec-s3: request %s needs item %s from the store but %s, and it carries no media to "
            "encode locally; failing the request (a retry re-runs the encoder)", req_id, ident[:64], why,
        )
        return False

    # ------------------------------------------------------------------ results
    def _apply_results(self) -> None:
        results = self._fetcher.drain()
        if not results:
            return
        now = time.monotonic()
        for key, result in results:
            self._looking -= 1
            item = self._items.get(key)
            if item is None or not item.looking:
                if isinstance(result, Staged) and self._staging is not None:
                    self._staging.discard(result.slot.name)
                continue
            item.apply(result, now)
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
            if isinstance(result, Staged):
                # Pin it for the requests waiting on it now, so that no other
                # allocation evicts it before they are admitted again.
                for req_id in list(item.users):
                    state = self._requests.get(req_id)
                    if state is not None and not self._hold(state, item.identifier, item):
                        break
        if self._staging is not None:
            self._counters.set_gauge("staged_bytes", self._staging.used)

    # ------------------------------------------------------------------ vLLM hooks
    def has_cache_item(self, identifier: str) -> bool:
        item = self._items.current(identifier)
        if item is None or not self._usable(item):
            return False
        if self._is_consumer:
            assert self._staging is not None and item.slot is not None
            if not self._topology.workers_read_staging:
                return False
            if not self._staging.touch(item.slot):
                self._items.drop(item)
                return False
        self._hits[identifier] = item
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if not self._is_consumer:
            return
        feature = request.mm_features[index]
        ident = feature.identifier
        item = self._hits.get(ident)
        if item is None:
            return  # vLLM encodes this one itself
        staged = item.staged
        assert staged is not None  # a hit is a staged item
        state = self._requests.get(request.request_id)
        if state is None or not self._hold(state, ident, item):
            # has_cache_item said yes a moment ago (and touched the slot), so this
            # should not happen; the load still goes out: a worker that cannot read
            # the slot fetches the blob from S3 and reports it.
            logger.warning("ec-s3: staged item %s could not be pinned before dispatch", ident[:64])
        spec = LoadSpec(
            identifier=ident, key=item.key, path=staged.slot.path, data_offset=staged.data_offset,
            nbytes=staged.slot.nbytes, dtype=staged.dtype, shape=staged.shape, host=self._host,
            request_id=request.request_id, input_index=index, has_media=feature.data is not None,
        )
        self._loads.append((spec, staged.slot))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECS3ConnectorMetadata:
        if self._looking and not scheduler_output.total_num_scheduled_tokens:
            # The engine has nothing to run but our transfers, and its loop does not
            # sleep between steps: without this it would keep the GIL from the I/O
            # thread that runs them (bench/scheduler_cost.py measures the difference).
            time.sleep(0)
        meta = ECS3ConnectorMetadata(loads=[spec for spec, _ in self._loads])
        if self._loads:
            meta.encoder_inputs = scheduler_output.scheduled_encoder_inputs
        if self._staging is not None:
            for _, slot in self._loads:
                self._staging.mark_dispatched(slot)
            self._staging.advance_step()
        self._loads = []
        self._hits.clear()
        if self._is_producer:
            # Every item of a request's first step: the worker publishes those vLLM
            # serves from its own encoder cache (save_caches never fires for them), so
            # a blob deleted since (gc) or never uploaded (an outage) is published again;
            # the publisher skips what it published within present_ttl_s.
            # Items a HEAD found in the bucket are left out: nothing to publish again.
            for new_req in scheduler_output.scheduled_new_reqs:
                state = self._requests.get(new_req.req_id)
                if state is not None:
                    for feature in state.request.mm_features:
                        key = self._model.keyspace.key_for(feature.identifier, cache_salt=state.request.cache_salt)
                        if not self._known_present(key):
                            meta.save_keys[feature.identifier] = key
            for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
                state = self._requests.get(req_id)
                if state is None or not state.request.cache_salt:
                    continue  # the worker derives unsalted keys itself
                for index in input_ids:
                    ident = state.request.mm_features[index].identifier
                    meta.save_keys[ident] = self._model.keyspace.key_for(ident, cache_salt=state.request.cache_salt)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune()
        return meta

    def _known_present(self, key: str) -> bool:
        item = self._items.peek(key)
        return (
            item is not None and item.state is ItemState.PRESENT
            and time.monotonic() - item.checked_at <= self._config.present_ttl_s
        )

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, ECS3WorkerMetadata):
            return
        self._topology.learn(meta.hosts)
        for ident in meta.failed_loads:
            item = self._items.current(ident)
            if item is not None and item.slot is not None and self._staging is not None:
                logger.error("ec-s3: a worker could not read staged item %s; dropping it", ident[:64])
                self._staging.discard(item.slot.name)
                self._items.drop(item)

    def update_state_after_free(self, request: Request, index: int) -> None:
        state = self._requests.get(request.request_id)
        slot = state.pins.pop(request.mm_features[index].identifier, None) if state is not None else None
        if slot is not None and self._staging is not None:
            self._staging.unpin(slot)

    def take_unavailable_requests(self) -> set[str]:
        if not self._unavailable:
            return set()
        failed, self._unavailable = self._unavailable, set()
        return failed

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            if self._staging is not None:
                for slot in state.pins.values():
                    self._staging.unpin(slot)
            state.pins.clear()
            state.release()
        if not self._is_producer:
            return False, None
        # A producer whose store is down (circuit open) cannot keep a promise: sending
        # none lets consumers encode at once instead of waiting out promised_wait_s.
        promise = not self._store.breaker.is_open
        if not promise:
            self._counters.inc("promises_withheld")
        return False, build_transfer_params(request, self._model, self._resolver, promise=promise) or None

    # ------------------------------------------------------------------ metrics
    def take_stats(self) -> ECS3Stats | None:
        self._counters.set_gauge("breaker_open", 1.0 if self._store.breaker.is_open else 0.0)
        return scheduler_stats(self._counters, self.take_store_retries(), self._worker_stats)

    def take_store_retries(self) -> int:
        """Retries of this process's store since the last call (for metrics)."""
        total = self._store.stats.retries
        delta, self._retries_reported = total - self._retries_reported, total
        return delta

    # ------------------------------------------------------------------ upkeep
    def _prune(self) -> None:
        """Forget old misses and errors, and staged items whose slot staging evicted;
        the table's LRU bound does the rest."""
        now = time.monotonic()
        horizon = max(self._config.negative_cache_ttl_s, _POLL_CAP_S, _NO_SPACE_MAX_S) * 4
        for item in self._items:
            if item.users:
                continue
            stale = item.state in RETRYABLE and now - item.checked_at > horizon
            gone = item.slot is not None and item.slot.evicted
            if stale or gone:
                self._items.drop(item)

    def close(self) -> None:
        if self._worker_stats is not None:
            self._worker_stats.close()
        if self._staging is not None:
            self._staging.close()
        self._store.close(timeout=1.0)

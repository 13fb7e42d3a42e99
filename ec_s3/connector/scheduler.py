"""Scheduler-role part of ECS3Connector: which items a request waits for, which are hits.

Runs on vLLM's engine loop and answers from memory; lookups run on the I/O loop
(:mod:`ec_s3.connector.lookups`). Owns applying admission decisions (item table, counters),
which requests a lookup's result serves, the hit answers, tenants' keys and the per-step
load list. Does not own the admission rules (:mod:`~.admission`), the item state machine
(:mod:`~.items`), running lookups (:mod:`~.lookups`), staging pins (:mod:`~.pins`), what a
producer publishes (:mod:`~.publishing`), transfers or the S3 protocol.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

from ec_s3.blob.format import MISSING_REPORT
from ec_s3.config import ECS3Config
from ec_s3.connector.admission import (LATER, NO_SPACE_MAX_S, POLL_CAP_S, Action, Admission, AggregatedAdmission, Ask,
                                       ConsumerAdmission, Decision, ProducerAdmission, answer_outcome)
from ec_s3.connector.items import (PRODUCER_CAPACITY, RETRYABLE, Item, ItemState, ItemTable, RequestState,
                                   consumer_capacity)
from ec_s3.connector.lookups import Lookups, misfit
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.connector.metrics import LOOKUP_OUTCOMES, ECS3Stats, open_stats_reader, scheduler_stats
from ec_s3.connector.model import ModelInfo, carries_media, describe_role, host_id
from ec_s3.connector.pins import StagingPins
from ec_s3.connector.preflight import check_engine_start
from ec_s3.connector.publishing import PublishLedger
from ec_s3.connector.settle import CounterWatch
from ec_s3.connector.topology import Topology, WorkerReach
from ec_s3.connector.transfer_params import build_transfer_params, probe_answer, read_promises
from ec_s3.log import logger
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.staging import StagingArea, StagingSlot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ECS3Scheduler"]

_PRUNE_EVERY_STEPS = 256
# The longest an engine step that scheduled nothing waits for a lookup's result while
# requests wait for blobs: its loop does not sleep between steps, and spinning kept the
# GIL from the I/O thread that runs those lookups (measured by a TTFT bench since retired). A result ends the
# wait at once; a new request waits this long at most before its first schedule.
_IDLE_WAIT_S = 0.001


def _role_parts(vllm_config: VllmConfig, config: ECS3Config, host: str, *, producer: bool,
                consumer: bool) -> tuple[StagingArea | None, Topology, ItemTable, Admission]:
    """The role is chosen here, once: a consumer stages blobs for its workers (and must
    know whether they can read them); a producer only asks the bucket."""
    if consumer:
        staging = StagingArea(config.staging_dir, config.staging_bytes)
        admission = AggregatedAdmission if producer else ConsumerAdmission
        return (staging, Topology.from_vllm(vllm_config, host), ItemTable(consumer_capacity(config.staging_bytes)),
                admission(config, staging.capacity))
    return None, Topology(WorkerReach.LOCAL, host), ItemTable(PRODUCER_CAPACITY), ProducerAdmission(config)


class ECS3Scheduler:
    def __init__(self, vllm_config: VllmConfig, config: ECS3Config, model: ModelInfo, counters: Counters) -> None:
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self._is_producer = bool(ec_config.is_ec_producer)
        self._role = str(ec_config.ec_role)
        consumer = bool(ec_config.is_ec_consumer)
        check_engine_start(vllm_config, config, producer=self._is_producer, consumer=consumer)
        self._config = config
        self._model = model
        self._counters = counters
        self._store = S3Store.shared(config)
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self._host = host_id()
        self._staging, self._topology, self._items, self._admission = _role_parts(
            vllm_config, config, self._host, producer=self._is_producer, consumer=consumer)
        self._lookups = Lookups(self._store, self._staging, counters, model, config, self._items)
        self._pins = StagingPins(self._staging)
        self._requests: dict[str, RequestState] = {}
        # This step's hits: (request id, identifier) -> the item answered for (until
        # build_connector_meta).
        self._hits: dict[tuple[str, str], Item] = {}
        # The request of the last ensure_cache_available: vLLM asks has_cache_item
        # right after it, for that request (see has_cache_item).
        self._asking: RequestState | None = None
        # Requests deferred for blobs, oldest first: the first is the senior (the one
        # request that may hold staged slots while it waits; see _release_partial).
        self._waiting: dict[str, None] = {}
        # Producer (and ec_both): what this engine's workers publish, under which keys.
        self._ledger = PublishLedger(self._requests, model, self._resolver, self._known_present)
        self._loads: list[tuple[LoadSpec, StagingSlot]] = []
        self._unavailable: set[str] = set()
        self._deferred = False  # a request waited for a blob in this step's schedule
        self._steps = 0
        self._worker_stats = open_stats_reader(config, vllm_config, self._store.background)
        self._watch = CounterWatch(self._worker_stats, counters)
        describe_role("scheduler", vllm_config, config, model)

    # ------------------------------------------------------------------ admission
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._apply_results()
        now = time.monotonic()
        state = self._asking = self._state_of(request)
        ready = True
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            if feature.identifier in state.local:
                continue
            decision = self._admit(state, feature, now)
            if decision.action is Action.WAIT:
                ready, self._deferred = False, True
            elif decision.action is Action.UNAVAILABLE and not self._fall_back(state, feature, decision.reason):
                return False
        if ready:
            self._waiting.pop(request.request_id, None)
        else:
            self._waiting.setdefault(request.request_id)
            self._release_partial(state)
        return ready

    def _release_partial(self, state: RequestState) -> None:
        """The hold-and-wait rule (:mod:`ec_s3.connector.pins`): a deferred request that
        is not the senior pins its slots only once it has them all."""
        if next(iter(self._waiting)) != state.request.request_id:
            self._pins.release_all(state)

    def _state_of(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            promises = read_promises(request, self._model, self._config.max_blob_bytes, self._counters)
            state = self._requests[request.request_id] = RequestState(request=request, promises=promises)
            if self._is_producer:
                self._ledger.track(request)
        return state

    def _admit(self, state: RequestState, feature: MultiModalFeatureSpec, now: float) -> Decision:
        """Decide what ``feature`` needs (:mod:`ec_s3.connector.admission`) and apply
        it; the caller waits (WAIT) or falls back (UNAVAILABLE) per the decision returned."""
        identifier = feature.identifier
        promise = state.promises.get(identifier)
        key = promise.key if promise else self._model.keyspace.key_for(identifier, cache_salt=state.request.cache_salt)
        decision = self._decide(state, feature, key, self._items.peek(key), now)
        if decision.gone:
            state.gone.add(key)
        if decision.action is Action.HIT:
            misfit_why = misfit(feature, self._items.peek(key), self._model)
            if misfit_why:
                decision = Decision(Action.UNAVAILABLE, uses_item=False, reason=misfit_why, outcome="error")
        if not decision.uses_item:
            self._pins.unuse(state, identifier)
            self._items.point(identifier, None)
            self._settle(state, identifier, decision, now)
            return decision
        item = self._track(state, identifier, self._items.get(key))
        if decision.action is Action.HIT:
            assert item is not None
            if self._hold(state, identifier, item):
                self._served(state, identifier, item, now)
                return decision
            decision = self._decide(state, feature, key, None, now)  # its slot is gone: look it up again
        elif decision.renew and item is not None:
            self._items.drop(item)
        if decision.clock:
            state.waiting_since.setdefault(identifier, now)
        if decision.lookup:
            item = self._items.peek(key)
            if item is None:  # none yet, or forgotten just now
                item = self._items.add(key, identifier)
                self._track(state, identifier, item)
            self._lookups.start(item, feature, now, state.promises.get(identifier))
        if decision.outcome == LATER:
            item = self._items.peek(key)
            if item is not None and item.looking:
                item.unawaited.add(state.request.request_id)
            elif item is not None:
                self._decided(state, identifier, answer_outcome(item.state))
        self._settle(state, identifier, decision, now)
        return decision

    def _served(self, state: RequestState, identifier: str, item: Item, now: float) -> None:
        """A hit, held: the request's wait ends, and a producer's own key keeps its promise."""
        self._stop_waiting(state, identifier, now)
        self._decided(state, identifier, "hit")
        if self._is_producer and item.key == self._model.keyspace.key_for(identifier, cache_salt=state.request.cache_salt):
            # Its own key holds the blob: its promise holds, even where vLLM then serves it
            # from an output encoded from another tenant's media (that request's miss was
            # answered first) and never asks has_cache_item.
            state.saved.add(identifier)

    def _decide(self, state: RequestState, feature: MultiModalFeatureSpec, key: str, item: Item | None,
                now: float) -> Decision:
        identifier = feature.identifier
        return self._admission.decide(Ask(
            item=item, promise=state.promises.get(identifier), has_media=self._carries_media(feature),
            since=state.waiting_since.get(identifier), now=now, workers_read_staging=self._topology.workers_read_staging,
            published_at=self._ledger.published_at(key),
        ))

    def _carries_media(self, feature: MultiModalFeatureSpec) -> bool:
        """Whether vLLM could encode ``feature`` here: it holds media (or embeddings),
        not only the placeholder metadata of a metadata-only item (``{"type":
        "image_embeds", "image_embeds": {"image_grid_thw": ...}}``, which an EC consumer
        accepts). vLLM runs the encoder on a metadata-only item if asked to, gets no
        embedding, and its engine dies (``Expected number of multimodal embeddings to
        match number of input items``): such an item is served from the store or its
        request fails alone."""
        return carries_media(feature, self._resolver.fields_for(feature.modality))

    def _track(self, state: RequestState, identifier: str, item: Item | None) -> Item | None:
        """``item`` is the one admitted for ``identifier`` now (for has_cache_item), and the
        request uses it."""
        self._items.point(identifier, item)
        if item is not None:
            state.use(identifier, item)
        return item

    def _settle(self, state: RequestState, identifier: str, decision: Decision, now: float) -> None:
        """What the decision leaves behind: its counter, and an item vLLM encodes itself."""
        if decision.counter is not None:
            self._counters.inc(decision.counter)
        if decision.outcome != LATER:
            self._decided(state, identifier, decision.outcome)
        if decision.action is Action.ENCODE_LOCALLY:
            self._stop_waiting(state, identifier, now)
            state.local.add(identifier)
            self._pins.unuse(state, identifier)

    def _decided(self, state: RequestState, identifier: str, outcome: str | None) -> None:
        """Count what the request's lookup of ``identifier`` decided, once per request
        and item (lookups_total{outcome}); polls are counted apart (polls_*)."""
        if outcome is None or identifier in state.decided:
            return
        state.decided.add(identifier)
        self._counters.inc(LOOKUP_OUTCOMES[outcome])

    def _hold(self, state: RequestState, identifier: str, item: Item) -> bool:
        """Pin ``item``'s staging slot for this request; False, and the item is
        forgotten, if staging evicted it meanwhile."""
        if self._pins.hold(state, identifier, item):
            return True
        self._items.drop(item)
        return False

    def _stop_waiting(self, state: RequestState, identifier: str, now: float) -> None:
        """End ``identifier``'s wait (served or given up); a promised item's wait is observed."""
        since = state.waiting_since.pop(identifier, None)
        if since is not None and identifier in state.promises and self._admission.observes_promise_wait:
            self._counters.observe("promise_wait_seconds", max(0.0, now - since))

    def _fall_back(self, state: RequestState, feature: MultiModalFeatureSpec, why: str) -> bool:
        """Encode locally if the request still carries the media (True); otherwise
        record it for ``take_unavailable_requests`` (False)."""
        req_id, identifier = state.request.request_id, feature.identifier
        self._stop_waiting(state, identifier, time.monotonic())
        if self._carries_media(feature):
            state.local.add(identifier)
            self._pins.unuse(state, identifier)
            self._counters.inc("fallbacks_local")
            quiet = self._store.breaker.is_open or not self._topology.workers_read_staging
            (logger.debug if quiet else logger.warning)(
                "ec-s3: request %s item %s: %s; encoding it locally", req_id, identifier[:64], why
            )
            return True
        self._unavailable.add(req_id)
        self._counters.inc("requests_unavailable")
        logger.error(
            "ec-s3: request %s needs item %s from the store but %s, and it carries no media to "
            "encode locally; failing the request (a retry re-runs the encoder)", req_id, identifier[:64], why,
        )
        return False

    # ------------------------------------------------------------------ results
    def _apply_results(self) -> None:
        for item, outcome in self._lookups.apply(time.monotonic()):
            if item.unawaited:  # requests that went on without this answer: it is their outcome
                decided = answer_outcome(outcome.state)
                for req_id in item.unawaited:
                    waiter = self._requests.get(req_id)
                    if waiter is not None:
                        self._decided(waiter, item.identifier, decided)
                    elif decided is not None:  # finished meanwhile
                        self._counters.inc(LOOKUP_OUTCOMES[decided])
                item.unawaited.clear()
            if outcome.staged is not None:
                # Pin it for the senior request waiting on it (see _release_partial),
                # so that no other allocation evicts it before it is admitted again.
                # Users are the requests that will read it: one that encodes it
                # itself, or whose encoder output vLLM freed, stopped using it.
                senior = next(iter(self._waiting), None)
                if senior in item.users:
                    state = self._requests.get(senior)
                    if state is not None:
                        self._hold(state, item.identifier, item)

    # ------------------------------------------------------------------ vLLM hooks
    def has_cache_item(self, identifier: str) -> bool:
        """Whether the asking request's own item (its key: its cache_salt) is a hit.

        vLLM passes only the identifier, which tenants may share; the request is the
        one of the last ``ensure_cache_available``: both of vLLM's scheduling loops
        call ``_try_schedule_encoder_inputs`` (which asks this) right after that
        request's own ``ensure_cache_available`` (``v1/core/sched/scheduler.py`` in
        vLLM 0.34: running loop, ensure at 847, then ``_try_schedule_encoder_inputs`` at
        893; waiting loop, ``_ec_transfer_pending`` at 1286 and 1310, then 1430; the
        question at 2239; 0.32 and 0.33 make the same calls in the same order). The test
        rig's ``OrderProbe`` fails a test when a vLLM asks otherwise. From 0.33 a waiting
        request left with no tokens after this question is skipped and the loop goes on
        (0.32 stops): a yes then stays unused
        that step (``_hits`` is cleared in ``build_connector_meta``)."""
        state = self._asking
        if state is None or identifier in state.local:
            return False
        item = state.items.get(identifier)
        if item is None or item.state is not self._admission.hit_state:
            return False
        if self._is_producer:
            self._ledger.skipped_after_hit(identifier, item.key)
            state.saved.add(identifier)
        if self._staging is not None:
            assert item.slot is not None
            if not self._topology.workers_read_staging:
                return False
            if not self._staging.touch(item.slot):
                self._items.drop(item)
                return False
        self._hits[(state.request.request_id, identifier)] = item
        self._decided(state, identifier, "hit")
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        item = self._hits.get((request.request_id, identifier))
        staged = item.staged if item is not None else None
        if item is None or staged is None:
            return  # vLLM encodes this one itself, or (a producer's hit) skips it: nothing to load
        state = self._requests.get(request.request_id)
        if state is None or not self._hold(state, identifier, item):
            # has_cache_item said yes a moment ago (and touched the slot), so this
            # should not happen; the load still goes out: a worker that cannot read
            # the slot fetches the blob from S3 and reports it.
            logger.warning("ec-s3: staged item %s could not be pinned before dispatch", identifier[:64])
        spec = LoadSpec(
            identifier=identifier, key=item.key, path=staged.slot.path, data_offset=staged.data_offset,
            nbytes=staged.slot.nbytes, dtype=staged.dtype, shape=staged.shape, host=self._host,
            handle=staged.slot.handle, inode=staged.slot.inode,
            request_id=request.request_id, input_index=index, has_media=self._carries_media(feature),
        )
        self._loads.append((spec, staged.slot))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECS3ConnectorMetadata:
        if (self._lookups.running or self._deferred) and not scheduler_output.total_num_scheduled_tokens:
            # The engine has nothing to run but requests waiting for our transfers.
            self._lookups.fetcher.wait_for_result(_IDLE_WAIT_S)
        self._deferred = False
        encoded = sum(len(inputs) for inputs in scheduler_output.scheduled_encoder_inputs.values())
        if encoded:
            self._counters.inc("items_encoded", encoded)
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
            meta.save_keys = self._ledger.save_keys(scheduler_output)
            meta.save_metadata = self._ledger.save_metadata(meta.save_keys)
            if self._staging is not None:
                self._ledger.note_published(meta.save_keys)
        self._watch.note_step(bool(scheduler_output.total_num_scheduled_tokens or encoded))
        if meta.loads or meta.save_keys:
            meta.watch = self._watch.watch()  # its worker counters must reach /metrics
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
        for identifier in meta.failed_loads:
            item = self._items.current(identifier)
            if item is not None and item.slot is not None and self._staging is not None:
                logger.error("ec-s3: a worker could not read staged item %s; dropping it", identifier[:64])
                slot = item.slot
                for req_id in list(item.users):
                    state = self._requests.get(req_id)
                    if state is not None and state.pins.get(identifier) is slot:
                        self._pins.unuse(state, identifier)  # nobody reads a discarded slot
                self._staging.discard(slot)
                self._items.drop(item)

    def update_state_after_free(self, request: Request, index: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None:  # vLLM freed its output: the request no longer reads the slot
            self._pins.unuse(state, request.mm_features[index].identifier)

    def take_unavailable_requests(self) -> set[str]:
        if not self._unavailable:
            return set()
        failed, self._unavailable = self._unavailable, set()
        return failed

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        gone: dict[str, Any] = {}
        self._waiting.pop(request.request_id, None)
        if self._asking is state:
            self._asking = None
        if state is not None:
            self._pins.release_all(state)
            state.release()
            if state.gone:
                # The proxy reads this from the answer and forgets those blobs.
                gone = {MISSING_REPORT: sorted(state.gone)}
        probe = probe_answer(request, self._role, self._model)
        if not self._is_producer:
            return False, {**gone, **probe} or None
        withhold = self._ledger.finish(request, state)
        # A producer whose store is down (circuit open) cannot keep a promise: sending
        # none lets consumers encode at once instead of waiting out promised_wait_s.
        promise = not self._store.breaker.is_open
        if not promise or withhold:
            self._counters.inc("promises_withheld")
        params = build_transfer_params(request, self._model, self._resolver, promise=promise, withhold=withhold)
        return False, {**params, **gone, **probe} or None

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> list[str]:
        """Broken rules of staging slots and their pins (:meth:`StagingPins.violations`;
        tests and the chaos soak call it after every step, vLLM never does)."""
        return self._pins.violations(self._requests)

    # ------------------------------------------------------------------ metrics
    def has_pending_push_work(self) -> bool:
        """Keep an idle engine stepping until its workers' counters are in (settle.py)."""
        return self._watch.pending()

    def take_stats(self) -> ECS3Stats | None:
        self._counters.set_gauge("breaker_open", 1.0 if self._store.breaker.is_open else 0.0)
        self._counters.pull(self._store.stats)
        return scheduler_stats(self._counters, self._worker_stats)

    # ------------------------------------------------------------------ upkeep
    def _prune(self) -> None:
        """Forget old misses and errors, and staged items whose slot staging evicted;
        the table's LRU bound does the rest."""
        now = time.monotonic()
        horizon = max(self._config.negative_cache_ttl_s, POLL_CAP_S, NO_SPACE_MAX_S) * 4
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

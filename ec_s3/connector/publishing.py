"""A producer scheduler's ledger of what its workers publish, under which keys.

vLLM keys its encoder cache by identifier, which tenants share; blob keys add the
``cache_salt``. Owns which live requests hold each identifier, whose media vLLM last
encoded it from, which identifiers vLLM skips after a bucket hit, hence each step's keys
and the promises to withhold. Does not own uploads (:mod:`ec_s3.transfer.publisher`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver, collect_ec_item_metadata

from ec_s3.blob.format import PLACEHOLDER_METADATA_KEY
from ec_s3.blob.placeholder import placeholder_json
from ec_s3.connector.items import PRODUCER_CAPACITY, RequestState
from ec_s3.connector.model import ModelInfo

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["PublishLedger"]

V = TypeVar("V")


def _bounded_put(table: dict[str, V], key: str, value: V) -> None:
    """Insert ``key`` newest last; the oldest goes once the table outgrows the item table."""
    table.pop(key, None)
    table[key] = value
    while len(table) > PRODUCER_CAPACITY:
        del table[next(iter(table))]


class PublishLedger:
    def __init__(self, requests: Mapping[str, RequestState], model: ModelInfo,
                 resolver: PlaceholderMetadataResolver, known_present: Callable[[str], bool]) -> None:
        self._requests = requests  # the scheduler's live requests (read only)
        self._model = model
        self._resolver = resolver
        self._known_present = known_present  # key -> a HEAD found it in the bucket lately
        # Live requests by identifier (their keys are published together).
        self._by_identifier: dict[str, set[str]] = {}
        # Identifiers vLLM skips for every request because of a bucket hit under one
        # key (its encoder cache is keyed by identifier) -> that key.
        self._skipped: dict[str, str] = {}
        # Identifier -> the cache_salt of the request whose media vLLM last encoded it
        # from. vLLM shares one encoder output among every request with the identifier,
        # tenants included (a client may reuse a uuid for another image): it is
        # published only under keys of that tenant, never under another's.
        self._encoded_for: dict[str, str | None] = {}
        # ec_both: key -> when this engine last published it, so that a repeat waits
        # for its GET (AggregatedAdmission).
        self._published: dict[str, float] = {}

    def track(self, request: Request) -> None:
        """A new live request: its identifiers will be published with its key."""
        for feature in request.mm_features:
            self._by_identifier.setdefault(feature.identifier, set()).add(request.request_id)

    def skipped_after_hit(self, identifier: str, key: str) -> None:
        """vLLM skips ``identifier``'s encoder for every request while its encoder cache
        holds it: a request under another key then has nothing published."""
        _bounded_put(self._skipped, identifier, key)

    def published_at(self, key: str) -> float | None:
        return self._published.get(key)

    def note_published(self, save_keys: Mapping[str, list[str]]) -> None:
        """ec_both: remember what this step's workers publish (their upload starts now)."""
        now = time.monotonic()
        for keys in save_keys.values():
            for key in keys:
                _bounded_put(self._published, key, now)

    def save_keys(self, scheduler_output: SchedulerOutput) -> dict[str, list[str]]:
        """Identifier -> every key this step's workers publish it under (tenants may
        share an identifier; each promises its own key)."""
        keys: dict[str, list[str]] = {}

        def add(identifier: str, state: RequestState) -> None:
            key = self._model.keyspace.key_for(identifier, cache_salt=state.request.cache_salt)
            listed = keys.setdefault(identifier, [])
            if key not in listed:
                listed.append(key)
            state.saved.add(identifier)

        # An identifier encoded in this step is published under the key of every live
        # request of the same tenant that has it: vLLM encodes it once for all of them.
        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            salt = state.request.cache_salt
            for index in input_ids:
                identifier = state.request.mm_features[index].identifier
                self._skipped.pop(identifier, None)
                _bounded_put(self._encoded_for, identifier, salt)
                for other in self._by_identifier.get(identifier, ()):
                    other_state = self._requests.get(other)
                    if other_state is not None and other_state.request.cache_salt == salt:
                        add(identifier, other_state)
        # Every item of a request's first step that vLLM encoded for this tenant: the
        # worker publishes those vLLM serves from its own encoder cache (save_caches
        # never fires for them), so a blob deleted since (gc) or never uploaded (an
        # outage) is published again; the publisher skips what it published within
        # present_ttl_s. Items a HEAD found in the bucket are left out: nothing to
        # publish again; so are those vLLM skips after a bucket hit (its cache holds no
        # tensor), and those encoded from another tenant's media (their promise is
        # withheld).
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is None:
                continue
            salt = state.request.cache_salt
            for feature in state.request.mm_features:
                identifier = feature.identifier
                if identifier in self._skipped or self._encoded_for.get(identifier, salt) != salt:
                    continue
                key = self._model.keyspace.key_for(identifier, cache_salt=salt)
                if identifier not in state.saved and not self._known_present(key):
                    add(identifier, state)
        return keys

    def save_metadata(self, save_keys: Mapping[str, list[str]]) -> dict[str, dict[str, str]]:
        """The object metadata to store with each blob of this step: its placeholder
        metadata (e.g. Qwen-VL's grid), which lets a proxy that finds the blob by HEAD
        send prefill/decode a metadata-only part (ec_s3/proxy/embeds.py). Only for
        models that declare placeholder fields, and only for items of a live request
        (their data holds the values)."""
        out: dict[str, dict[str, str]] = {}
        for identifier in save_keys:
            feature = self._live_feature(identifier)
            if feature is None or not self._resolver.fields_for(feature.modality):
                continue
            entry = collect_ec_item_metadata([feature], self._resolver).get(identifier) or {}
            # vllm 0.32's entry has no "modality" (0.33 adds it): the feature's.
            text = placeholder_json({**entry, "modality": feature.modality})
            if text is not None:
                out[identifier] = {PLACEHOLDER_METADATA_KEY: text}
        return out

    def _live_feature(self, identifier: str) -> MultiModalFeatureSpec | None:
        for req_id in self._by_identifier.get(identifier, ()):
            state = self._requests.get(req_id)
            for feature in state.request.mm_features if state is not None else ():
                if feature.identifier == identifier:
                    return feature
        return None

    def finish(self, request: Request, state: RequestState | None) -> set[str]:
        """The request is done: forget it, and return the identifiers whose promise it
        must withhold (nothing was published under its key for them)."""
        withhold: set[str] = set()
        for feature in request.mm_features:
            identifier = feature.identifier
            users = self._by_identifier.get(identifier)
            if users is not None:
                users.discard(request.request_id)
                if not users:
                    del self._by_identifier[identifier]
            if state is None or identifier in state.saved:
                continue
            skipped_for = self._skipped.get(identifier)
            if skipped_for is not None and skipped_for != self._model.keyspace.key_for(
                    identifier, cache_salt=request.cache_salt):
                # A bucket hit under another key made vLLM skip it for this request
                # too: nothing is published under this request's key, so no promise.
                withhold.add(identifier)
            elif self._encoded_for.get(identifier, request.cache_salt) != request.cache_salt:
                # vLLM served it from an output encoded from another tenant's media:
                # never published under this request's key, so no promise.
                withhold.add(identifier)
        return withhold

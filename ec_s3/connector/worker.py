"""Worker-role part of ECS3Connector.

Loading maps the staged file the scheduler validated and copies the tensor to the device
(:mod:`ec_s3.transfer.device`); only an unreadable slot makes it GET the blob itself,
bounded by ``remote_load_timeout_s``, and no exception escapes a load (vLLM would stop
on an encoder cache miss). Saving hands outputs to the publisher (first TP rank only).
Owns the worker side of each step. Does not own background transfers or device copies
(:mod:`ec_s3.transfer`), the S3 protocol or admission decisions.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import TYPE_CHECKING

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from ec_s3.blob.codec import BlobExpectation, decode_blob
from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.blob.keys import probe_key
from ec_s3.connector.metrics import ECS3Stats, open_stats_writer
from ec_s3.connector.model import ModelInfo, describe_role, host_id
from ec_s3.transfer.device import DeviceLoader
from ec_s3.transfer.publisher import BlobPublisher
from ec_s3.transfer.spool import Spool
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import S3Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ECS3Worker"]

# What _load returns when vLLM will encode the item in this step instead.
_ENCODE_LOCALLY = object()
# A fetch the step gave up on is cancelled on the loop; this much longer is allowed for
# the cancellation to land before the step stops waiting for it regardless.
_CANCEL_GRACE_S = 1.0


class ECS3Worker:
    def __init__(self, vllm_config: VllmConfig, config: ECS3Config, model: ModelInfo, counters: Counters) -> None:
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self._config = config
        self._model = model
        self._counters = counters
        self._is_producer = bool(ec_config.is_ec_producer)
        self._is_consumer = bool(ec_config.is_ec_consumer)
        self._store: S3Store | None = None
        self._publisher: BlobPublisher | None = None
        self._failed_loads: set[str] = set()
        self._host = host_id()
        self._host_reported = False
        self._warned_remote = False
        self._warned_reopen = False
        self._device: torch.device | None = None
        self._device_loader = DeviceLoader()
        if self._is_producer and _is_publishing_rank():
            spool = None
            if config.spool_dir:
                spool = Spool(config.spool_dir, config.spool_max_bytes, config.spool_retry_s, self._get_store(), counters,
                              owns=model.keyspace.owns)
                spool.start()
            self._publisher = BlobPublisher(
                self._get_store(), config, namespace=model.keyspace.namespace,
                producer=model.engine_id, counters=counters, spool=spool,
            )
        self._stats_writer = None
        if _is_publishing_rank():
            # The first worker of the engine speaks for all (ranks hold the same outputs
            # and load the same items); see ec_s3.connector.metrics.
            store = self._get_store()
            self._stats_writer = open_stats_writer(config, vllm_config, counters, store.background, [store.stats])
            if self._stats_writer is not None and self._publisher is not None:
                # The scheduler side waits for a snapshot with no upload in flight
                # (ec_s3.connector.settle): say so as soon as the last one is done.
                self._stats_writer.uploads_pending = lambda: self._publisher.pending if self._publisher else 0
                self._publisher.on_idle = self._stats_writer.flush_soon
        if self._publisher is not None:
            # The first upload must not pay for creating the client and its connection.
            self._get_store().warm_up(probe_key(config.prefix))
        describe_role("worker", vllm_config, config, model)

    def _get_store(self) -> S3Store:
        if self._store is None:
            self._store = S3Store.shared(self._config)
        return self._store

    # ------------------------------------------------------------------ saving
    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], identifier: str, metadata: ECConnectorMetadata | None
    ) -> None:
        if self._publisher is None:
            return
        tensor = encoder_cache.get(identifier)
        if tensor is None:
            return
        ours = isinstance(metadata, ECS3ConnectorMetadata)
        save_keys = metadata.save_keys if ours else {}
        stored = metadata.save_metadata.get(identifier) if ours else None
        # Each tenant's request promised its own key (cache_salt): publish under all.
        for key in save_keys.get(identifier) or [self._model.keyspace.key_for(identifier)]:
            self._publisher.publish(identifier, tensor, key, object_metadata=stored)

    def start_save_caches(
        self, encoder_cache: dict[str, torch.Tensor] | None, metadata: ECConnectorMetadata | None
    ) -> None:
        """Publish items of this step that vLLM already had cached (it will not call
        ``save_caches`` for them); the publisher skips what it already sent.

        vLLM calls this first in a producer's step and ``build_connector_worker_meta``
        last, always: the step's saves are queued in between and handed to the I/O loop
        in one wake-up at the end (a wake-up costs the step a GIL hand-off)."""
        if self._publisher is not None:
            self._publisher.defer_wakeups()
        if encoder_cache is None or not isinstance(metadata, ECS3ConnectorMetadata):
            return
        for identifier in metadata.save_keys:
            if identifier in encoder_cache:
                self.save_caches(encoder_cache, identifier, metadata)

    # ------------------------------------------------------------------ loading
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], metadata: ECConnectorMetadata | None) -> None:
        if not isinstance(metadata, ECS3ConnectorMetadata):
            return
        for spec in metadata.loads:
            if spec.identifier in encoder_cache:
                continue
            tensor = self._load(spec, metadata.encoder_inputs)
            if tensor is _ENCODE_LOCALLY:
                continue
            if tensor is None:
                logger.error(
                    "ec-s3: item %s could not be loaded from staging or S3; vLLM will stop on an encoder "
                    "cache miss for it. The scheduler only answers hits its workers can read, so check "
                    "that nothing else deletes files in staging_dir and that the store is reachable",
                    spec.identifier[:64],
                )
                continue
            assert isinstance(tensor, torch.Tensor)
            encoder_cache[spec.identifier] = tensor
            self._counters.inc("blobs_loaded")
            if self._publisher is not None:
                self._publisher.mark_present(spec.key)

    def _load(self, spec: LoadSpec, encoder_inputs: dict[str, list[int]] | None) -> torch.Tensor | object | None:
        """The tensor for ``spec``; :data:`_ENCODE_LOCALLY` when vLLM will encode it in
        this step instead; None when nothing worked. Never raises."""
        try:
            device = self._target_device()
            if spec.host == self._host:
                try:
                    return self._device_loader.load_slot(spec, device, functools.partial(self._reopened, spec))
                except Exception as exc:  # noqa: BLE001 - any failure here has a fallback
                    self._failed_loads.add(spec.identifier)
                    self._counters.inc("staging_read_failures")
                    logger.error(
                        "ec-s3: cannot read staged item %s from %s (%s); %s. This should not happen: check "
                        "that staging_dir is not cleaned by another process.", spec.identifier[:64], spec.path, exc,
                        "encoding it in this step" if self._can_encode(spec, encoder_inputs) else "fetching it from S3",
                    )
                    if self._encode_locally(spec, encoder_inputs):
                        return _ENCODE_LOCALLY
            else:
                # The scheduler believed its workers share its host: tell it otherwise.
                self._host_reported = False
                if not self._warned_remote:
                    self._warned_remote = True
                    logger.warning(
                        "ec-s3: this worker is on another host than its scheduler, so it fetches encoder "
                        "outputs from S3 itself inside the model step; the scheduler stops answering hits "
                        "once it hears of it"
                    )
            tensor = self._load_remote(spec, device)
            if tensor is None and self._encode_locally(spec, encoder_inputs):
                return _ENCODE_LOCALLY
            return tensor
        except Exception:  # noqa: BLE001 - an exception here would stop the engine
            self._failed_loads.add(spec.identifier)
            logger.exception("ec-s3: unexpected error loading %s", spec.identifier[:64])
            return _ENCODE_LOCALLY if self._encode_locally(spec, encoder_inputs) else None

    def _reopened(self, spec: LoadSpec) -> None:
        self._counters.inc("staging_reopened")
        if not self._warned_reopen:
            self._warned_reopen = True
            logger.warning(
                "ec-s3: staged item %s was gone from %s (or replaced there), so it was read through the "
                "scheduler's open file instead. Another process deletes files in staging_dir: exclude it from "
                "tmp cleaners, or point staging_dir at a directory of its own (counted in "
                "vllm:ec_s3_staging_reopened_total; said once)", spec.identifier[:64], spec.path,
            )

    @staticmethod
    def _can_encode(spec: LoadSpec, encoder_inputs: dict[str, list[int]] | None) -> bool:
        return encoder_inputs is not None and spec.has_media and bool(spec.request_id) and spec.input_index >= 0

    def _encode_locally(self, spec: LoadSpec, encoder_inputs: dict[str, list[int]] | None) -> bool:
        """Have vLLM encode ``spec``'s item in this step: it runs the encoder on the
        step's encoder inputs after ``start_load_caches`` (see ``encoder_inputs`` in
        :class:`ECS3ConnectorMetadata`). False when the request carries no media."""
        if not self._can_encode(spec, encoder_inputs):
            return False
        assert encoder_inputs is not None
        inputs = encoder_inputs.setdefault(spec.request_id, [])
        if spec.input_index not in inputs:
            inputs.append(spec.input_index)
        self._counters.inc("loads_encoded_locally")
        return True

    def _load_remote(self, spec: LoadSpec, device: torch.device) -> torch.Tensor | None:
        """GET and validate the blob inside the model step: one store call (its attempts
        are the only retries), cancelled after ``remote_load_timeout_s``. The time the
        step waited is counted (``remote_load_seconds``), and so is each outcome."""
        store = self._get_store()
        expect = BlobExpectation(
            identifier=spec.identifier, namespace=self._model.keyspace.namespace,
            dtype=getattr(torch, spec.dtype), rows=spec.shape[0], width=spec.shape[-1],
            max_bytes=self._config.max_blob_bytes,
        )
        budget = self._config.remote_load_timeout_s
        started = time.monotonic()
        future = None
        try:
            future = store.submit(asyncio.wait_for(store.get_async(spec.key, expected_size=spec.nbytes), budget))
            decoded = decode_blob(future.result(budget + _CANCEL_GRACE_S), expect)
        except Exception as exc:  # noqa: BLE001 - TLS, credentials, anything: never into vLLM
            self._failed_loads.add(spec.identifier)
            self._counters.inc("remote_load_failures")
            logger.error(
                "ec-s3: could not fetch %s for this worker within remote_load_timeout_s=%gs: %s: %s",
                spec.key, budget, type(exc).__name__, exc,
            )
            return None
        finally:
            if future is not None:
                future.cancel()  # a no-op once done
            self._counters.inc("remote_load_seconds", time.monotonic() - started)
        self._counters.inc("remote_loads")
        return self._device_loader.to_device(decoded.tensor, device)

    def _target_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            kind = current_platform.device_type
            if current_platform.is_cuda_alike():
                self._device = torch.device(f"{kind}:{current_platform.current_device()}")
            else:
                self._device = torch.device(kind)
        return self._device

    def build_connector_worker_meta(self, metadata: ECConnectorMetadata | None = None) -> ECS3WorkerMetadata | None:
        if self._publisher is not None:
            self._publisher.wake()  # the end of the step: hand its saves to the loop
        if isinstance(metadata, ECS3ConnectorMetadata) and metadata.watch and self._stats_writer is not None:
            # After this step's saves were queued and its loads counted (settle.py).
            self._stats_writer.mark_step(metadata.watch)
        if not self._is_consumer or (self._host_reported and not self._failed_loads):
            return None
        failed, self._failed_loads = self._failed_loads, set()
        self._host_reported = True
        return ECS3WorkerMetadata(failed_loads=failed, hosts={self._host})

    def take_stats(self) -> ECS3Stats | None:
        """Nothing: worker counters reach vLLM through the scheduler side (shared memory),
        whether or not this vLLM version asks workers; asking twice would count twice."""
        return None

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self._publisher is not None:
            if self._publisher.pending:
                # Said before the wait, so an operator sees why the worker's exit is slow.
                logger.info("ec-s3: flushing %d pending uploads before exit (up to %.0f s, shutdown_timeout_s)",
                            self._publisher.pending, self._config.shutdown_timeout_s)
            pending, abandoned = self._publisher.shutdown(self._config.shutdown_timeout_s)
            if pending:
                logger.info(
                    "ec-s3: %d uploads were pending at shutdown: %d abandoned%s", pending, abandoned,
                    f", the rest uploaded or spooled to {self._config.spool_dir}" if self._config.spool_dir else "",
                )
        if self._stats_writer is not None:
            self._stats_writer.close()  # after the publisher: its last counts are in
        if self._store is not None:
            self._store.close(timeout=1.0)


@functools.cache
def _is_publishing_rank() -> bool:
    """Only the first tensor-parallel rank uploads (every rank holds the same output).
    Asked once per process: the rank of a worker never changes."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - parallel state not initialised (tests, single process)
        return os.environ.get("RANK", "0") in ("0", "")

"""ECS3Connector: vLLM's encoder-cache connector API over an S3 bucket.

A thin façade, as vLLM's Mooncake connector is: each process role gets one part,
:class:`~ec_s3.scheduler.ECS3Scheduler` in the scheduler process and
:class:`~ec_s3.worker.ECS3Worker` in each worker, and every public method delegates to
the part of its role. Load it with::

    --ec-transfer-config '{"ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3",
                           "ec_role": "ec_producer",
                           "ec_connector_extra_config": {"bucket": "...", "endpoint_url": "..."}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.connector.metrics import ECS3PromMetrics, ECS3Stats
from ec_s3.connector.messages import ECS3ConnectorMetadata
from ec_s3.connector.model import ModelInfo
from ec_s3.connector.preflight import run_startup_checks
from ec_s3.connector.scheduler import ECS3Scheduler
from ec_s3.transfer.counters import Counters
from ec_s3.connector.worker import ECS3Worker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ECS3Connector"]

# Worker-role counters of this process. vLLM's V1 model runner never collects worker
# stats, so the scheduler-role connector in the same process (UniProc executor)
# reports them until vLLM collects them itself (model runner V2 claims them).
_WORKER_COUNTERS: list[Counters] = []


class ECS3Connector(ECConnectorBase):
    """S3-backed encoder cache for encode / prefill / decode disaggregation."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self.config = ECS3Config.from_extra_config(ec_config.ec_connector_extra_config)
        self.model = ModelInfo.from_vllm(vllm_config, self.config)
        self.counters = Counters()
        self._scheduler: ECS3Scheduler | None = None
        self._worker: ECS3Worker | None = None
        self._closed = False
        if role == ECConnectorRole.SCHEDULER:
            # Once per engine, before any traffic: a bad bucket or credentials fail
            # here with a message that says what to fix.
            run_startup_checks(self.config, producer=self.is_producer, consumer=self.is_consumer)
            if self.is_producer and not getattr(vllm_config, "shutdown_timeout", 0):
                logger.warning(
                    "ec-s3: vLLM runs with --shutdown-timeout 0, so on SIGTERM it kills the engine at "
                    "once and uploads still pending are lost%s; start producers with "
                    "--shutdown-timeout %d (and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS >= that)",
                    " (spool_dir keeps only what already failed)" if self.config.spool_dir else "",
                    int(self.config.shutdown_timeout_s) + 2,
                )
            self._scheduler = ECS3Scheduler(vllm_config, self.config, self.model, self.counters)
        elif role == ECConnectorRole.WORKER:
            self._worker = ECS3Worker(vllm_config, self.config, self.model, self.counters)
            _WORKER_COUNTERS.append(self.counters)
        else:  # pragma: no cover
            raise ValueError(f"unknown EC connector role: {role}")
        logger.info(
            "ec-s3: %s connector (%s) for s3://%s/%s endpoint=%s",
            role.name.lower(), ec_config.ec_role, self.config.bucket, self.model.keyspace.root,
            self.config.endpoint_url or "aws",
        )

    # ------------------------------------------------------------------ worker side
    def _metadata(self) -> ECS3ConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, ECS3ConnectorMetadata) else None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._metadata()
        if meta is not None:
            self._worker.start_load_caches(encoder_cache, meta)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_caches(encoder_cache, mm_hash, self._metadata())

    def start_save_caches(self, **kwargs: Any) -> None:
        assert self._worker is not None
        meta, encoder_cache = self._metadata(), kwargs.get("encoder_cache")
        if meta is not None and encoder_cache is not None:
            self._worker.start_save_caches(encoder_cache, meta)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_connector_worker_meta()

    # ------------------------------------------------------------------ scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self._scheduler is not None
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, index)

    def update_state_after_free(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        assert self._scheduler is not None
        return self._scheduler.take_unavailable_requests()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ------------------------------------------------------------------ metrics
    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self._worker is not None:
            self.counters.claimed = True
            stats = ECS3Stats(data=self.counters.take_delta())
        else:
            stats = ECS3Stats(data=self.counters.take_delta())
            assert self._scheduler is not None
            stats.data["counters"]["retries"] = self._scheduler.take_store_retries()
            for counters in _WORKER_COUNTERS:
                if not counters.claimed:
                    stats.aggregate(ECS3Stats(data=counters.take_delta()))
            if not stats.data["counters"]["retries"]:
                del stats.data["counters"]["retries"]
        return None if stats.is_empty() else stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return ECS3Stats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECS3PromMetrics:
        return ECS3PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
            if self.counters in _WORKER_COUNTERS:
                _WORKER_COUNTERS.remove(self.counters)
        if self._scheduler is not None:
            self._scheduler.close()

"""ECS3Connector: vLLM's encoder-cache connector API over an S3 bucket.

A switchboard: :class:`~ec_s3.connector.scheduler.ECS3Scheduler` in the scheduler
process, :class:`~ec_s3.connector.worker.ECS3Worker` in each worker, every method
delegating in one line. Owns the mapping of vLLM's hooks to the roles and what both share
(config, model facts, counters). Does not own any behaviour. How to load it: README.md
and docs/config.md.
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
from ec_s3.connector.metrics import ECS3PromMetrics, ECS3Stats
from ec_s3.connector.model import ModelInfo
from ec_s3.connector.scheduler import ECS3Scheduler
from ec_s3.connector.worker import ECS3Worker
from ec_s3.loop import shared_loop
from ec_s3.transfer.counters import Counters

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ECS3Connector"]


class ECS3Connector(ECConnectorBase):
    """S3-backed encoder cache for encode / prefill / decode disaggregation."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None
        self.config = ECS3Config.from_extra_config(ec_config.ec_connector_extra_config)
        self.model = ModelInfo.from_vllm(vllm_config, self.config)
        shared_loop().set_cpus(self.config.io_cpu_set())
        self.counters = Counters()
        self._scheduler: ECS3Scheduler | None = None
        self._worker: ECS3Worker | None = None
        self._part: ECS3Scheduler | ECS3Worker  # this process role's part (`_role` is vLLM's)
        self._closed = False
        self._bound = False  # between vLLM's bind_connector_metadata and clear_connector_metadata
        if role == ECConnectorRole.SCHEDULER:
            self._part = self._scheduler = ECS3Scheduler(vllm_config, self.config, self.model, self.counters)
        elif role == ECConnectorRole.WORKER:
            self._part = self._worker = ECS3Worker(vllm_config, self.config, self.model, self.counters)
        else:  # pragma: no cover
            raise ValueError(f"unknown EC connector role: {role}")

    # ------------------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound = True

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._bound = False

    def _metadata(self) -> ECConnectorMetadata | None:
        """This step's metadata through vLLM's accessor; None outside the bind/clear
        window (``save_caches`` is a public hook: a runner may call it there)."""
        return self._get_connector_metadata() if self._bound else None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_caches(encoder_cache, self._metadata())

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        # vLLM passes the item identifier by this keyword (its older name for it).
        assert self._worker is not None
        self._worker.save_caches(encoder_cache, mm_hash, self._metadata())

    def start_save_caches(self, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_save_caches(kwargs.get("encoder_cache"), self._metadata())

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_connector_worker_meta(self._metadata())

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

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ------------------------------------------------------------------ metrics
    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        return self._part.take_stats()

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
        if not self._closed:
            self._closed = True
            self._part.close()

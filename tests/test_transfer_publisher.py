"""The publisher ends every upload uploaded, spooled, or dropped with a count and a log
line, whatever the store raises, and its in-flight budget always comes back. Faults
come from a real server (wrong credentials), a closed endpoint, a request botocore
refuses to send and a stopped I/O loop."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable

import pytest
import torch

from ec_s3.config import ECS3Config
from ec_s3.loop import BackgroundLoop
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.publisher import BlobPublisher


@pytest.fixture(params=["direct", "botocore"])
def make_config(request: pytest.FixtureRequest, make_config: Callable[..., ECS3Config]) -> Callable[..., ECS3Config]:
    """Every test here runs on both data paths (``data_path``): the direct one and the escape hatch."""
    return functools.partial(make_config, data_path=request.param)

MiB = 1 << 20


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(store: S3Store, config: ECS3Config) -> tuple[BlobPublisher, Counters]:
    counters = Counters()
    return BlobPublisher(store, config, namespace="ns", producer="p", counters=counters), counters


def _tensor() -> torch.Tensor:
    return torch.ones(64, 128, dtype=torch.bfloat16)


def test_unexpected_store_error_is_counted_and_frees_the_budget(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    """botocore refuses the request (an empty key) with an exception that is not a
    StoreError: the upload must still end counted and logged, the key retryable."""
    publisher, counters = _publisher(make_store(), make_config(max_inflight_bytes=MiB))
    assert publisher.publish("img", _tensor(), "")
    assert publisher.flush(15) == 0
    assert publisher.budget.used == 0
    assert counters.get("upload_failed") == 1
    assert publisher.publish("img", _tensor(), "")  # forgotten, so a later save tries again
    assert publisher.flush(15) == 0 and publisher.budget.used == 0


def test_wrong_credentials_drop_counted_and_free_the_budget(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    config = make_config(secret_access_key="wrong", max_inflight_bytes=MiB)
    publisher, counters = _publisher(make_store(secret_access_key="wrong"), config)
    for i in range(3):
        assert publisher.publish(f"img{i}", _tensor(), f"k/{i}")
    assert publisher.flush(15) == 0
    assert publisher.budget.used == 0 and counters.get("upload_failed") == 3


def test_closed_endpoint_drops_counted_and_frees_the_budget(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    publisher, counters = _publisher(make_store(url, max_attempts=2), make_config(url, max_inflight_bytes=MiB))
    assert publisher.publish("img", _tensor(), "k/x")
    assert publisher.flush(15) == 0
    assert publisher.budget.used == 0 and counters.get("upload_failed") == 1


def test_publish_after_the_loop_stopped_neither_raises_nor_leaks(make_config: Callable[..., ECS3Config]) -> None:
    """A save after the I/O loop is gone (shutdown) used to raise into the model step
    and keep its bytes booked, so a later flush waited for an upload that never ran."""
    config = make_config(max_inflight_bytes=MiB)
    loop = BackgroundLoop("test-io")
    store = S3Store(config, loop=loop)
    publisher, counters = _publisher(store, config)
    loop.stop()
    assert publisher.publish("img", _tensor(), "k/late") is False
    assert publisher.budget.used == 0 and publisher.pending == 0
    assert counters.get("upload_failed") == 1

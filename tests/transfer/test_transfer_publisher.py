"""The publisher ends every upload uploaded, spooled, or dropped with a count and a log
line, whatever the store raises, and its in-flight pool always comes back. Faults
come from a real server (wrong credentials), a closed endpoint, a request the store
refuses to send, a stalled store (fault proxy) and a stopped I/O loop.

Memory and step cost: uploads hold pool buffers (reused), not the encoder outputs, and
a batch of saves wakes the I/O loop once."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ec_s3.config import ECS3Config
from ec_s3.loop import BackgroundLoop
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.blob.codec import BlobExpectation, decode_blob
from ec_s3.transfer.publisher import BlobPublisher
from support.faultproxy import FaultProxy


MiB = 1 << 20


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(store: S3Store, config: ECS3Config, **kw: Any) -> tuple[BlobPublisher, Counters]:
    counters = Counters()
    return BlobPublisher(store, config, namespace="ns", producer="p", counters=counters, **kw), counters


def _tensor() -> torch.Tensor:
    return torch.ones(64, 128, dtype=torch.bfloat16)


def test_unexpected_store_error_is_counted_and_frees_the_pool(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    """The store refuses the request (an empty key) before sending it: the upload must
    still end counted and logged, the key retryable."""
    publisher, counters = _publisher(make_store(), make_config(max_inflight_bytes=MiB))
    assert publisher.publish("img", _tensor(), "")
    assert publisher.flush(15) == 0
    assert publisher.pool.used == 0
    assert counters.get("upload_failed") == 1
    assert publisher.publish("img", _tensor(), "")  # forgotten, so a later save tries again
    assert publisher.flush(15) == 0 and publisher.pool.used == 0


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "buffered"])
def test_wrong_credentials_drop_counted_and_free_the_pool(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], copy: bool
) -> None:
    config = make_config(secret_access_key="wrong", max_inflight_bytes=MiB)
    publisher, counters = _publisher(make_store(secret_access_key="wrong"), config, copy_cpu_outputs=copy)
    for i in range(3):
        assert publisher.publish(f"img{i}", _tensor(), f"k/{i}")
    assert publisher.flush(15) == 0
    assert publisher.pool.used == 0 and counters.get("upload_failed") == 3
    assert publisher.pool.allocations <= 3 and publisher.pool.held <= MiB


def test_closed_endpoint_drops_counted_and_frees_the_pool(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    publisher, counters = _publisher(make_store(url, max_attempts=2), make_config(url, max_inflight_bytes=MiB))
    assert publisher.publish("img", _tensor(), "k/x")
    assert publisher.flush(15) == 0
    assert publisher.pool.used == 0 and counters.get("upload_failed") == 1


def test_publish_after_the_loop_stopped_neither_raises_nor_leaks(make_config: Callable[..., ECS3Config]) -> None:
    """A save after the I/O loop is gone (shutdown) used to raise into the model step
    and keep its bytes booked, so a later flush waited for an upload that never ran."""
    config = make_config(max_inflight_bytes=MiB)
    loop = BackgroundLoop("test-io")
    store = S3Store(config, loop=loop)
    publisher, counters = _publisher(store, config)
    loop.stop()
    assert publisher.publish("img", _tensor(), "k/late") is False
    assert publisher.pool.used == 0 and publisher.pending == 0
    assert counters.get("upload_failed") == 1


def test_cpu_outputs_are_sent_in_place_on_a_loan_of_the_bound(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    """By default a CPU tensor is uploaded from its own memory: the pool lends room, no
    buffer, and counts exactly what is held."""
    config = make_config(fault_proxy.endpoint_url, max_inflight_bytes=4 * MiB, read_timeout_s=30)
    publisher, counters = _publisher(make_store(fault_proxy.endpoint_url, read_timeout_s=30), config)
    fault_proxy.set_stall(True, methods=["PUT"])
    for i in range(3):
        assert publisher.publish(f"id{i}", torch.full((256, 1024), float(i)).to(torch.bfloat16), f"k/{i}")
    fault_proxy.wait_until(lambda c: c.held_now >= 3, timeout_s=15)
    pool = publisher.pool
    assert pool.allocations == 0 and pool.used == pool.held
    assert 3 * 512 * 1024 < pool.used < 3 * (512 + 16) * 1024  # data plus a bounded header room
    fault_proxy.set_stall(False)
    assert publisher.flush(30) == 0 and pool.used == pool.held == 0
    assert counters.get("blobs_uploaded") == 3


def test_buffered_uploads_hold_pool_buffers_not_the_encoder_outputs(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    """The buffer path (pinned on CUDA; on CPU with copy_cpu_outputs): while PUTs stall,
    the saved tensors are gone once copied, the pool holds at most max_inflight_bytes,
    and the blobs arrive intact once the store answers again."""
    config = make_config(fault_proxy.endpoint_url, max_inflight_bytes=4 * MiB, read_timeout_s=30)
    publisher, counters = _publisher(make_store(fault_proxy.endpoint_url, read_timeout_s=30), config,
                                     copy_cpu_outputs=True)
    fault_proxy.set_stall(True, methods=["PUT"])
    arrays: list[weakref.ref[np.ndarray]] = []
    for i in range(4):
        array = np.full((256, 1024), i, dtype=np.float16)  # 512 KiB; its tensor shares this memory
        arrays.append(weakref.ref(array))
        assert publisher.publish(f"id{i}", torch.from_numpy(array), f"k/{i}")
        del array
    fault_proxy.wait_until(lambda c: c.held_now >= 4, timeout_s=15)
    gc.collect()
    assert [r() is None for r in arrays] == [True] * 4, "an encoder output is kept alive during its upload"
    pool = publisher.pool
    assert 0 < pool.used <= pool.held <= 4 * MiB and pool.allocations == 4
    fault_proxy.set_stall(False)
    assert publisher.flush(30) == 0 and pool.used == 0
    assert counters.get("blobs_uploaded") == 4
    store = make_store()
    for i in range(4):
        blob = decode_blob(store.run(store.get_async(f"k/{i}")), BlobExpectation(f"id{i}", "ns"))
        assert torch.equal(blob.tensor, torch.full((256, 1024), i, dtype=torch.float16))


@pytest.mark.parametrize(
    "identifier", ["\U0001f600" * 256, "\x01" * 1024, "x" * 5000, ""], ids=["astral", "control", "long", "empty"]
)
def test_the_header_always_fits_the_room_the_step_reserved(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], identifier: str
) -> None:
    """The step reserves header room before the loop plans the header: the worst JSON
    escaping of a stored identifier must fit, and the blob must decode."""
    store = make_store()
    publisher, counters = _publisher(store, make_config(max_inflight_bytes=4 * MiB), copy_cpu_outputs=True)
    x = torch.arange(64 * 128, dtype=torch.float32).reshape(64, 128)
    assert publisher.publish(identifier, x, "k/h")
    assert publisher.flush(15) == 0 and counters.get("blobs_uploaded") == 1, counters.snapshot()
    blob = decode_blob(store.run(store.get_async("k/h")), BlobExpectation(identifier, "ns"))
    assert torch.equal(blob.tensor, x)


def test_buffers_are_reused_from_one_upload_to_the_next(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    """One buffer serves a dozen uploads: pinned memory is pinned once, not per blob."""
    publisher, counters = _publisher(make_store(), make_config(max_inflight_bytes=8 * MiB), copy_cpu_outputs=True)
    for i in range(12):
        assert publisher.publish(f"id{i}", torch.full((256, 1024), float(i)).to(torch.bfloat16), f"k/{i}")
        assert publisher.flush(15) == 0
    assert counters.get("blobs_uploaded") == 12
    assert publisher.pool.allocations == 1 and publisher.pool.used == 0


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "buffered"])
def test_shutdown_with_stalled_uploads_gives_every_buffer_back(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], fault_proxy: FaultProxy, copy: bool
) -> None:
    config = make_config(fault_proxy.endpoint_url, max_inflight_bytes=4 * MiB, read_timeout_s=30)
    publisher, counters = _publisher(make_store(fault_proxy.endpoint_url, read_timeout_s=30), config,
                                     copy_cpu_outputs=copy)
    fault_proxy.set_stall(True, methods=["PUT"])
    for i in range(3):
        assert publisher.publish(f"id{i}", _tensor(), f"k/{i}")
    fault_proxy.wait_until(lambda c: c.held_now >= 3, timeout_s=15)
    pending, abandoned = publisher.shutdown(0.2)
    assert (pending, abandoned) == (3, 3)
    assert publisher.pending == 0 and publisher.pool.used == 0 and publisher.pool.held == 0


class _CountingCallSoon:
    """Counts the callbacks handed to a loop (each one wakes its thread), then passes them on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, loop: Any) -> None:
        self.calls = 0
        self._call_soon = loop.call_soon
        monkeypatch.setattr(loop, "call_soon", self)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.calls += 1
        self._call_soon(fn, *args)


def test_saves_queued_while_a_wakeup_is_pending_share_it(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop is busy: eight saves post one wake-up, not eight."""
    store = make_store()
    publisher, counters = _publisher(store, make_config(max_inflight_bytes=8 * MiB))
    gate, busy = threading.Event(), threading.Event()
    store.background.call_soon(lambda: (busy.set(), gate.wait(10)))
    assert busy.wait(10)
    counting = _CountingCallSoon(monkeypatch, store.background)
    try:
        for i in range(8):
            assert publisher.publish(f"id{i}", _tensor(), f"k/{i}")
    finally:
        gate.set()
    assert counting.calls == 1
    assert publisher.flush(15) == 0 and counters.get("blobs_uploaded") == 8


def test_a_producer_step_of_many_saves_wakes_the_loop_once(
    tiny_model_dir: Path, extra_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's producer step: start_save_caches, save_caches per item, then
    build_connector_worker_meta. The I/O loop is woken once, at the end."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_s3.connector.facade import ECS3Connector
    from ec_s3.connector.messages import ECS3ConnectorMetadata
    from ec_s3.sandbox.vllm_server import ec_transfer_config
    from support.vllm_rig import make_vllm_config

    conn = ECS3Connector(make_vllm_config(tiny_model_dir, ec_transfer_config("ec_producer", extra_config())),
                         ECConnectorRole.WORKER)
    try:
        publisher = conn._worker._publisher  # noqa: SLF001
        assert publisher is not None
        counting = _CountingCallSoon(monkeypatch, publisher._store.background)  # noqa: SLF001
        cache = {f"img{i}": torch.full((64, 128), float(i)).to(torch.bfloat16) for i in range(6)}
        conn.bind_connector_metadata(ECS3ConnectorMetadata())
        conn.start_save_caches(encoder_cache=cache)
        for identifier in cache:
            conn.save_caches(cache, identifier)
        assert counting.calls == 0, "a save woke the loop inside the step"
        conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        assert counting.calls == 1
        assert publisher.flush(30) == 0 and conn.counters.get("blobs_uploaded") == 6
    finally:
        conn.shutdown()


def test_importable_without_s3_client_libraries() -> None:
    """A GPU host with torch only (tests/test_gpu_path.py) imports the publisher as is."""
    code = (
        "import sys\n"
        "for name in ('aiohttp', 'aiobotocore', 'aioboto3', 'botocore', 'boto3', 'vllm'):\n"
        "    sys.modules[name] = None\n"
        "from ec_s3.transfer.publisher import BlobPublisher\n"
        "assert 'ec_s3.store.client' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_buffer_a_device_copy_may_still_write_into_is_never_lent_again(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    """An upload that ends (cancelled, failed) before its device->host copy completed
    gives its room back but not its buffer: lending it again could let the copy
    overwrite the next blob."""
    from ec_s3.transfer.publisher import _Job

    class PendingEvent:
        def query(self) -> bool:
            return False

    publisher, _ = _publisher(make_store(), make_config(max_inflight_bytes=4 * MiB))
    pool = publisher.pool
    buf = pool.try_acquire(MiB)
    assert buf is not None
    job = _Job("img", "k/x", _tensor(), 16384, 8192, buf)
    job.event = PendingEvent()
    with publisher._idle:  # noqa: SLF001 - as publish counts it
        publisher._pending += 1  # noqa: SLF001
    publisher._settle(job)  # noqa: SLF001
    assert pool.used == 0 and pool.held == 0 and publisher.pending == 0
    again = pool.try_acquire(MiB)
    assert again is not None and again is not buf


def test_an_upload_that_fails_over_to_the_spool_gives_its_buffer_back(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], tmp_path: Path
) -> None:
    """The store is unreachable: the blob (the buffer's bytes) is spooled intact, and the
    buffer serves the next upload."""
    from ec_s3.transfer.spool import Spool

    url = f"http://127.0.0.1:{_closed_port()}"
    store = make_store(url, max_attempts=1)
    counters = Counters()
    spool = Spool(str(tmp_path / "spool"), 64 * MiB, 60.0, store, counters, owns=lambda key: True)
    publisher = BlobPublisher(store, make_config(url, max_inflight_bytes=4 * MiB), namespace="ns", producer="p",
                              counters=counters, spool=spool, copy_cpu_outputs=True)
    for i in range(3):
        assert publisher.publish(f"img{i}", torch.full((64, 128), float(i)).to(torch.bfloat16), f"k/{i}")
        assert publisher.flush(30) == 0
    assert counters.get("blobs_spooled") == 3 and counters.get("upload_failed") == 0
    assert publisher.pool.used == 0 and publisher.pool.allocations == 1
    files = sorted((tmp_path / "spool").iterdir())
    assert len(files) == 3
    for i in range(3):  # each file ends with its own blob's data, not a later one's
        want = torch.full((64, 128), float(i)).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        assert any(f.read_bytes().endswith(want) for f in files)

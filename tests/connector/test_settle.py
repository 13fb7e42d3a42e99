"""An idle engine steps until its workers' counters are in, and no longer (issue 41 item 4).

The watch (ec_s3/connector/settle.py) over a real shared-stats file: the writer
reports the step it has counted and its uploads in flight; the real-server check is
tests/e2e/test_metrics_idle.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ec_s3.connector.settle import CounterWatch
from ec_s3.loop import BackgroundLoop
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.shared_stats import SharedStatsReader, SharedStatsWriter
from support.ec_harness import drive, make_node


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(tmp_path: Path) -> tuple[Counters, SharedStatsWriter, SharedStatsReader]:
    counters = Counters()
    writer = SharedStatsWriter(str(tmp_path), "engine", counters)
    return counters, writer, SharedStatsReader(str(tmp_path), "engine")


def test_pending_until_the_marked_step_has_no_upload_in_flight_and_its_counts_are_taken(tmp_path: Path) -> None:
    worker, writer, reader = _pair(tmp_path)
    inflight = [0]
    writer.uploads_pending = lambda: inflight[0]
    writer.flush(force=True)
    reader.collect()
    clock = Clock()
    sched = Counters()
    watch = CounterWatch(reader, sched, clock=clock)
    assert not watch.pending()  # nothing watched yet

    step = watch.watch()  # a step that queued an upload
    assert step == 1 and watch.pending()  # the worker has not reported that step
    inflight[0] = 1
    writer.mark_step(step)
    writer.flush(force=True)
    reader.collect()
    assert reader.progress.step == 1 and watch.pending()  # its upload is in flight
    watch.note_step(scheduled_anything=False)

    worker.inc("blobs_uploaded")
    inflight[0] = 0
    writer.flush(force=True)
    reader.collect()
    assert watch.pending()  # settled, but the increment has not gone to vLLM yet
    assert reader.take_delta()["counters"] == {"blobs_uploaded": 1.0}
    assert not watch.pending()
    assert sched.get("settle_steps") == 1
    watch.note_step(scheduled_anything=False)  # not watching: not counted
    assert sched.get("settle_steps") == 1
    writer.close()


def test_an_upload_that_never_ends_stops_the_stepping_after_max_s(tmp_path: Path) -> None:
    _, writer, reader = _pair(tmp_path)
    writer.uploads_pending = lambda: 1  # an outage: the upload keeps retrying
    clock = Clock()
    watch = CounterWatch(reader, Counters(), max_s=5.0, clock=clock)
    writer.mark_step(watch.watch())
    writer.flush(force=True)
    reader.collect()
    assert watch.pending()
    clock.now += 4.9
    assert watch.pending()
    clock.now += 0.2
    assert not watch.pending() and not watch.pending()
    writer.close()


def test_no_worker_file_means_nothing_to_wait_for(tmp_path: Path) -> None:
    reader = SharedStatsReader(str(tmp_path), "engine")
    reader.collect()
    watch = CounterWatch(reader, Counters())
    watch.watch()
    assert watch.pending()  # no collection since the step: a worker's file may be new
    reader.collect()
    assert not watch.pending()
    assert CounterWatch(None, Counters()).watch() == 0  # no reader: steps are not numbered


@pytest.mark.timeout(60)
def test_a_marked_step_and_an_idle_publisher_reach_the_reader_within_tens_of_ms(tmp_path: Path) -> None:
    """The worker flushes at once when a step is marked or its uploads are done, and a
    hurried reader collects every 10 ms: not the 0.5 s / 0.25 s of their periodic
    rounds."""
    worker, writer, reader = _pair(tmp_path)
    inflight = [1]
    writer.uploads_pending = lambda: inflight[0]
    loop = BackgroundLoop("test-settle")
    try:
        writer.flush_periodically(loop, every_s=30.0)
        reader.collect_periodically(loop, every_s=30.0)
        time.sleep(0.1)  # both periodic rounds ran once and now sleep 30 s
        watch = CounterWatch(reader, Counters())
        started = time.monotonic()
        writer.mark_step(watch.watch())
        while reader.progress.step < 1:
            assert time.monotonic() - started < 2.0, "the marked step did not arrive"
            time.sleep(0.002)
        worker.inc("blobs_uploaded")
        inflight[0] = 0
        writer.flush_soon()  # what the publisher's on_idle does
        while watch.pending():
            reader.take_delta()  # what vLLM's step does
            assert time.monotonic() - started < 2.0, "still pending"
            time.sleep(0.002)
        elapsed = time.monotonic() - started
        assert elapsed < 0.5, elapsed
    finally:
        reader.close()
        writer.close()
        loop.stop()


def _shipped(node: Any, name: str) -> float:
    """``name``'s increments in the EC stats vLLM's scheduler shipped with its outputs."""
    total = 0.0
    for step in node.driver.steps:
        for eco in step.engine_core_outputs.values():
            data = eco.scheduler_stats.ec_connector_stats if eco.scheduler_stats is not None else None
            total += (data or {}).get("counters", {}).get(name, 0.0)
    return total


@pytest.mark.rig
@pytest.mark.timeout(120)
def test_vllms_scheduler_steps_a_producer_until_its_uploads_are_shipped(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]],
) -> None:
    """vLLM's real Scheduler stops stepping (``has_requests``) only once the worker's
    uploads are in the stats it shipped; no test-side flush or collection."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="promised"), log_stats=True)
    try:
        node.driver.add("p1", ["img-a", "img-b"])
        finished = drive(node.driver)
        assert "p1" in finished
        steps_at_finish = finished["p1"].step
        assert not node.driver.scheduler.has_requests()
        assert _shipped(node, "blobs_uploaded") == 2
        settle = _shipped(node, "settle_steps")
        extra = len(node.driver.steps) - 1 - steps_at_finish
        print(f"\nrig: {extra} steps after the request finished, {settle:.0f} counted as settle steps")
        assert 0 < settle <= extra
    finally:
        node.close()

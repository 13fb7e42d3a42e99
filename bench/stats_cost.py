"""Stats cost: wall time of the scheduler-side stats call that vLLM makes on its engine
thread every step (``get_ec_connector_stats``: the scheduler's own counters plus its
workers' counters from shared memory, ``ec_s3.connector.metrics.scheduler_stats``).

Loads, each in the same run: quiet; a CPU-bound thread in the process (it takes the
GIL whenever the call lets go of it, e.g. in a syscall); 300 other files in
``staging_dir``; a worker's writer stuck mid-update (odd sequence) plus the busy thread.
A writer flushes new counters every 20 ms throughout (but the stuck one), as a busy
worker would. Baseline in the same run: the same loop calling a function that does
nothing (the timer's own cost under that load). Goal: p99 < 0.2 ms at every load.

    .venv/bin/python -m bench.stats_cost [--quick] [--calls 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import benchlib as bl

bl.setup_env()

from ec_s3.connector.metrics import scheduler_stats  # noqa: E402
from ec_s3.loop import BackgroundLoop  # noqa: E402
from ec_s3.transfer import shared_stats  # noqa: E402
from ec_s3.transfer.counters import Counters  # noqa: E402

LOADS = ("quiet", "busy_thread", "crowded_staging_dir", "stuck_writer_and_busy_thread")
GOAL_P99_US = 200.0


@contextmanager
def _busy_thread(enabled: bool) -> Iterator[None]:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join(5)


def _route(staging: str, loop: BackgroundLoop) -> tuple[Any, Any, Counters]:
    """A worker's writer and the scheduler's reader, placed and driven as the connector
    does (older layouts, without ``stats_dir``/``collect_periodically``, also run)."""
    directory = Path(staging)
    if hasattr(shared_stats, "stats_dir"):
        directory = shared_stats.stats_dir(staging)
        directory.mkdir(mode=0o700)
    counters = Counters()
    writer = shared_stats.SharedStatsWriter(str(directory), "bench", counters)
    reader = shared_stats.SharedStatsReader(str(directory), "bench")
    if hasattr(reader, "collect_periodically"):
        reader.collect_periodically(loop)
    return writer, reader, counters


def _time_calls(fn: Callable[[], Any], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
        time.sleep(0.0005)  # an engine step between two calls
    return times


def run_load(load: str, calls: int) -> dict[str, Any]:
    loop = BackgroundLoop("bench-io")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as staging:
        if load == "crowded_staging_dir":
            for i in range(300):
                (Path(staging) / f"other-{i}").write_bytes(b"x")
        writer, reader, counters = _route(staging, loop)
        stuck = load.startswith("stuck_writer")
        if stuck:
            counters.inc("blobs_loaded")
            writer.flush(force=True)
            writer._closed = True  # no more flushes; it keeps its lock, as a live writer would
            shared_stats._HEADER.pack_into(writer._map, 0, 7, 0)
        else:
            writer.flush_periodically(loop, every_s=0.02)
        mine = Counters()
        with _busy_thread("busy_thread" in load):
            time.sleep(0.1)
            baseline = _time_calls(lambda: None, calls)
            measured = _time_calls(lambda: scheduler_stats(mine, reader), calls)
        writer._closed = False
        writer.close()
        if hasattr(reader, "close"):
            reader.close()
    loop.stop()
    return {"call_us": bl.summary(measured), "baseline_us": bl.summary(baseline)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=bl.RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")  # run_all passes it; nothing to plot
    args = parser.parse_args()
    calls = args.calls or (500 if args.quick else 2000)
    loads = {}
    for load in LOADS:
        loads[load] = r = run_load(load, calls)
        bl.log(f"{load}: p50 {r['call_us']['median']:.1f} us, p99 {r['call_us']['p99']:.1f} us, "
               f"max {r['call_us']['max']:.0f} us (empty call p99 {r['baseline_us']['p99']:.1f} us)")
    worst = max(r["call_us"]["p99"] for r in loads.values())
    rows = [[load, f"{r['call_us']['median']:.1f}", f"{r['call_us']['p99']:.1f}", f"{r['call_us']['max']:.0f}",
             f"{r['baseline_us']['p99']:.1f}"] for load, r in loads.items()]
    print(bl.table(["load", "p50 us", "p99 us", "max us", "empty call p99 us"], rows))
    bl.write_json("stats_cost", {"mode": "quick" if args.quick else "full", "calls": calls, "loads": loads,
                                 "worst_p99_us": worst, "goal_p99_us": GOAL_P99_US}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

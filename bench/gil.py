"""GIL interference (issue #13 goal 4): how much a pure-Python "model step" slows down
in the same process while ec-s3 moves blobs at full speed on its I/O thread.

Owns: one measurement per blob size, three phases per repeat, rotated (interleaved):

* ``alone``: the step loop only (the baseline);
* ``upload``: the producer worker's path: ``BlobPublisher.publish`` of fresh CPU
  tensors (what ``save_caches`` calls), keeping ``--depth`` uploads in flight;
* ``download``: the consumer scheduler's path (``connector/scheduler.py``): ``ItemFetcher.start``
  (GET into a /dev/shm ``StagingArea`` slot, full validation), ``drain()`` once per step,
  ``--depth`` fetches in flight; a staged slot is discarded at once (its worker would load it).

The step (:class:`Step`: a Python loop calibrated to ``--step-ms`` of CPU, plus a small
torch op) splits its wall time into CPU, run-queue time (waiting for a core) and the
rest: GIL waits, since it does no I/O. Transfers start between steps, outside the timed
region (their cost on the engine thread is ``engine_cost.py``'s). Reported per size:

* slowdown: median step wall with transfers / alone - 1 (spread: per-repeat ratios);
* GIL cost: mean GIL wait per step / mean step (CPU + GIL wait) alone: the slowdown a
  host with a free core would see (a GPU server). Mean, not median: see ``gil_cost``;
* GIL waits per step, throughput, step time lost and GIL wait seconds per GiB moved.

Goal: slowdown <= 5% (on a shared 2-core host the wall slowdown is dominated by other
processes and the S3 server taking the core; the GIL cost is the part ec-s3 owns).

Does not own: the S3 server (SeaweedFS, fresh per size, on the same cores: it shows as
run-queue time, not as GIL waits), nor vLLM (the step is a stand-in; no engine runs).

    .venv/bin/python -m bench.gil [--quick] [--sizes-mib 1 8 32] [--reps 5] [--phase-s 1.5] [--depth 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

if __name__ == "__main__":  # a run, before vLLM is imported; imported for run_all's rows, os.environ stays
    bl.setup_env()

import torch  # noqa: E402

WIDTH = 4096
GOAL = 0.05
PHASES = ("alone", "upload", "download")


# --------------------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True)
class StepSample:
    wall: float  # what the request pays
    cpu: float  # this thread on a core
    queued: float  # runnable, waiting for a core (other threads and processes)
    blocked: float  # neither: waiting for the GIL (the step does no I/O)
    gil_waits: int  # voluntary context switches

    @property
    def unqueued(self) -> float:
        """The step as a host with a free core would see it: CPU + GIL waits."""
        return self.cpu + self.blocked


class Step:
    """A pure-Python loop of ``n`` iterations plus one small matmul (which releases the
    GIL, as model code does), timed with the kernel's per-thread accounting
    (``/proc/self/task/<tid>/schedstat``: CPU and run-queue time) so that waiting for
    the GIL can be told from waiting for a core on a busy host."""

    def __init__(self, step_ms: float) -> None:
        self.a = torch.randn(128, 128)
        self.b = torch.randn(128, 128)
        self._sched = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        self.n = 1000
        self.run()
        # Twice (the first guess includes the matmul), by CPU time so that a busy host
        # does not shrink the step's work; the least disturbed of five runs.
        for _ in range(2):
            per_iter = min(self.run().cpu for _ in range(5)) / self.n
            self.n = max(1000, int(step_ms / 1e3 / per_iter))

    def _stat(self) -> tuple[float, int, int]:
        # CPU from the thread clock (schedstat's CPU field lags by up to a tick); the
        # run-queue delay is accounted at each switch-in, so it is current when we run.
        queued_ns = int(os.pread(self._sched, 128, 0).split()[1])
        return time.thread_time(), queued_ns, resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw

    def run(self) -> StepSample:
        c0, q0, v0 = self._stat()
        t0 = time.perf_counter()
        acc = 0
        for i in range(self.n):
            acc += i * i % 7
        torch.mm(self.a, self.b)
        wall = time.perf_counter() - t0
        c1, q1, v1 = self._stat()
        cpu, queued = c1 - c0, (q1 - q0) / 1e9
        return StepSample(wall, cpu, queued, max(0.0, wall - cpu - queued), v1 - v0)

    def close(self) -> None:
        os.close(self._sched)


# --------------------------------------------------------------------------- transfers


class Traffic:
    """Keeps ``depth`` uploads or downloads in flight through ec-s3's own classes;
    ``feed`` is called between steps from the step's thread, as vLLM's hooks are."""

    def __init__(self, ep: bl.Endpoint, size_mib: int, depth: int) -> None:
        from ec_s3.blob.codec import BlobExpectation
        from ec_s3.store.client import S3Store
        from ec_s3.transfer.counters import Counters
        from ec_s3.transfer.fetcher import Failed, Invalid, ItemFetcher, Missing, NoSpace, Staged
        from ec_s3.transfer.publisher import BlobPublisher
        from ec_s3.transfer.staging import StagingArea

        self._staged_type = Staged
        self._bad_types = (Failed, Invalid, Missing, NoSpace)
        self.depth = depth
        self.rows = size_mib * bl.MiB // (WIDTH * 2)
        blob = size_mib * bl.MiB + 64 * 1024
        bucket = bl.create_bucket(ep)
        self.config = ep.config(bucket, max_inflight_bytes=max(bl.GiB, 4 * depth * blob))
        self.store = S3Store(self.config)
        self.counters = Counters()
        self.publisher = BlobPublisher(self.store, self.config, namespace="gil", producer="bench", counters=self.counters)
        self.staging = StagingArea(tempfile.gettempdir() if not Path("/dev/shm").is_dir() else "/dev/shm",
                                   (2 * depth + 2) * blob)
        self.fetcher = ItemFetcher(self.store, self.staging, self.counters)
        # Fresh encoder outputs, one more than can be in flight (vLLM frees each after its step).
        self.pool = [torch.randn(self.rows, WIDTH).to(torch.bfloat16) for _ in range(depth + 1)]
        self.uploaded: list[str] = []
        self._seq = 0
        # Blobs to download, uploaded once; depth + 2 so a key is never fetched twice at once.
        self.download_keys: dict[str, Any] = {}
        for i in range(depth + 2):
            ident = f"dl-{size_mib}-{i}"
            key = f"gil/{ident}.safetensors"
            self.publisher.publish(ident, self.pool[i % len(self.pool)], key)
            self.download_keys[key] = BlobExpectation(identifier=ident, namespace="gil", dtype=torch.bfloat16,
                                                      rows=self.rows, width=WIDTH, max_bytes=self.config.max_blob_bytes)
        if self.publisher.flush(300) != 0 or self.counters.get("blobs_uploaded") != depth + 2:
            raise RuntimeError(f"could not upload the download set: {self.counters}")
        self.in_flight: set[str] = set()
        self.bad: list[str] = []

    # upload: publish until `depth` are pending
    def feed_upload(self) -> None:
        while self.publisher.pending < self.depth:
            self._seq += 1
            ident = f"up-{self._seq}"
            key = f"gil/{ident}.safetensors"
            self.uploaded.append(key)
            self.publisher.publish(ident, self.pool[self._seq % len(self.pool)], key)

    # download: drain finished fetches, start new ones until `depth` are in flight
    def feed_download(self) -> None:
        for key, result in self.fetcher.drain():
            self.in_flight.discard(key)
            if isinstance(result, self._staged_type):
                self.staging.discard(result.slot.name)
            elif isinstance(result, self._bad_types):
                self.bad.append(f"{key}: {result}")
        for key, expect in self.download_keys.items():
            if len(self.in_flight) >= self.depth:
                break
            if key not in self.in_flight:  # its slot from the last fetch was discarded when drained
                self.in_flight.add(key)
                self.fetcher.start(key, expect)

    def settle(self) -> None:
        """Let what is in flight finish (not timed), then free server space."""
        if self.publisher.flush(300) != 0:
            raise RuntimeError("uploads did not finish in 300 s")
        deadline = time.monotonic() + 300
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
            for key, result in self.fetcher.drain():
                self.in_flight.discard(key)
                if isinstance(result, self._staged_type):
                    self.staging.discard(result.slot.name)
        if self.uploaded:
            self.store.run(self.store.delete_many_async(self.uploaded), timeout=120)
            self.uploaded.clear()

    def moved(self) -> float:
        return self.counters.get("bytes_uploaded") + self.counters.get("bytes_downloaded")

    def completed(self) -> float:
        return self.counters.get("blobs_uploaded") + self.counters.get("blobs_downloaded")

    def close(self) -> None:
        self.publisher.flush(30)
        self.store.close(timeout=2)
        self.staging.close()


# --------------------------------------------------------------------------- one size


def bench_size(size_mib: int, step_ms: float, reps: int, phase_s: float, depth: int, min_transfers: int) -> dict[str, Any]:
    steps: dict[str, list[StepSample]] = {p: [] for p in PHASES}
    moved = {p: 0.0 for p in PHASES}
    duration = {p: 0.0 for p in PHASES}
    meters: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    per_rep: dict[str, list[float]] = {"upload": [], "download": []}
    with bl.s3_endpoint(f"gil{size_mib}") as ep:
        traffic = Traffic(ep, size_mib, depth)
        step: Step | None = None
        try:
            step = Step(step_ms)
            feeds = {"alone": None, "upload": traffic.feed_upload, "download": traffic.feed_download}
            for r in range(reps):
                rep_median: dict[str, float] = {}
                for phase in PHASES[r % 3:] + PHASES[: r % 3]:
                    feed = feeds[phase]
                    warm_end = time.monotonic() + min(0.2, phase_s / 4)
                    while time.monotonic() < warm_end:  # transfers ramp up; not counted
                        if feed:
                            feed()
                        step.run()
                    samples: list[StepSample] = []
                    moved0, done0 = traffic.moved(), traffic.completed()
                    with bl.Meter(ep) as meter:
                        t0 = time.monotonic()
                        # At least phase_s, and (with transfers) until min_transfers completed,
                        # so that a slow store still gives a throughput; at most 10 x phase_s.
                        while (elapsed := time.monotonic() - t0) < phase_s or (
                            feed and traffic.completed() - done0 < min_transfers and elapsed < 10 * phase_s
                        ):
                            if feed:
                                feed()
                            samples.append(step.run())
                    moved[phase] += traffic.moved() - moved0
                    duration[phase] += meter.wall
                    meters[phase].append({"wall_s": meter.wall, "cpu_s": meter.cpu, "server_cpu_s": meter.server_cpu,
                                          "steps": len(samples), "transfers": traffic.completed() - done0})
                    steps[phase] += samples
                    rep_median[phase] = statistics.median(x.wall for x in samples)
                    traffic.settle()
                for phase in per_rep:
                    per_rep[phase].append(rep_median[phase] / rep_median["alone"])
            bad = list(traffic.bad)
        finally:
            if step is not None:
                step.close()
            traffic.close()

    def med(phase: str, field: str) -> float:
        return statistics.median(getattr(x, field) if field != "unqueued" else x.unqueued for x in steps[phase])

    out: dict[str, Any] = {
        "size_mib": size_mib, "reps": reps, "phase_s": phase_s, "depth": depth, "python_iters_per_step": step.n,
        "step_s": {p: {f: bl.summary([getattr(x, f) for x in steps[p]]) for f in ("wall", "cpu", "queued", "blocked")}
                   for p in PHASES},
        "gil_waits_per_step": {p: statistics.fmean(x.gil_waits for x in steps[p]) for p in PHASES},
        "meters": meters, "transfer_problems": bad[:20],
    }
    alone = med("alone", "wall")
    for phase in ("upload", "download"):
        with_ = med(phase, "wall")
        gib = moved[phase] / bl.GiB
        n = len(steps[phase])
        out[phase] = {
            "slowdown": with_ / alone - 1,
            "slowdown_min": min(per_rep[phase]) - 1, "slowdown_max": max(per_rep[phase]) - 1,
            "per_rep_ratios": per_rep[phase],
            # As a host with a free core would see it: CPU + GIL waits, run-queue time left out.
            "slowdown_unqueued": med(phase, "unqueued") / med("alone", "unqueued") - 1,
            "gil_wait_s_mean": statistics.fmean(x.blocked for x in steps[phase]),
            # GIL waits are bursty (most steps none, some a whole switch interval), so the
            # median hides them; a step loop's throughput pays the mean.
            "gil_cost": statistics.fmean(x.blocked for x in steps[phase])
            / statistics.fmean(x.unqueued for x in steps["alone"]),
            "gil_wait_s_alone_mean": statistics.fmean(x.blocked for x in steps["alone"]),
            "cpu_ratio": med(phase, "cpu") / med("alone", "cpu"),
            "gib_moved": gib, "mib_per_s": moved[phase] / bl.MiB / duration[phase] if duration[phase] else None,
            # step time lost per GiB moved (wall, and GIL waits only)
            "step_s_lost_per_gib": (with_ - alone) * n / gib if gib else None,
            "gil_wait_s_per_gib": sum(x.blocked for x in steps[phase]) / gib if gib else None,
        }
        o = out[phase]
        bl.log(f"gil {size_mib} MiB {phase}: step {with_ * 1e3:.2f} vs {alone * 1e3:.2f} ms alone -> "
               f"{o['slowdown'] * 100:+.1f}% [{o['slowdown_min'] * 100:+.1f}..{o['slowdown_max'] * 100:+.1f}]; "
               f"GIL cost {o['gil_cost'] * 100:.1f}% ({o['gil_wait_s_mean'] * 1e3:.3f} ms/step); "
               f"{o['mib_per_s'] or 0:.0f} MiB/s")
    if bad:
        bl.log(f"gil {size_mib} MiB: {len(bad)} transfers did not succeed, e.g. {bad[0]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None, help="rotated alone/upload/download repeats per size")
    parser.add_argument("--phase-s", type=float, default=None, help="seconds per phase")
    parser.add_argument("--step-ms", type=float, default=3.0, help="step time alone (pure Python + one small matmul)")
    parser.add_argument("--depth", type=int, default=4, help="transfers kept in flight")
    parser.add_argument("--min-transfers", type=int, default=None,
                        help="a transfer phase lasts until this many completed (default 2 x depth; at most 10 x phase)")
    args = parser.parse_args()
    q = args.quick
    sizes = args.sizes_mib or ([1, 8] if q else [1, 8, 32])
    reps = args.reps or (3 if q else 5)
    phase_s = args.phase_s or (0.6 if q else 1.5)
    torch.set_num_threads(1)  # the step's matmul stays on its thread: this measures the GIL, not a thread pool
    started = time.monotonic()
    results: list[dict[str, Any]] = []

    def save() -> None:
        bl.write_json("gil", {
            "params": {"sizes_mib": sizes, "reps": reps, "phase_s": phase_s, "step_ms": args.step_ms,
                       "depth": args.depth, "min_transfers": args.min_transfers or 2 * args.depth, "quick": q, "switch_interval_s": sys.getswitchinterval()},
            "elapsed_s": time.monotonic() - started,
            "goal": f"step slowdown <= {GOAL:.0%} while ec-s3 uploads or downloads at full speed",
            "sizes": results,
        }, args.out_dir)

    for size in sizes:
        bl.log(f"gil: {size} MiB blobs, {reps} x {len(PHASES)} phases of {phase_s} s")
        results.append(bench_size(size, args.step_ms, reps, phase_s, args.depth, args.min_transfers or 2 * args.depth))
        save()
    rows = []
    for r in results:
        for phase in ("upload", "download"):
            o = r[phase]
            rows.append([
                f"{r['size_mib']} MiB", phase, r["step_s"]["alone"]["wall"]["median"] * 1e3,
                r["step_s"][phase]["wall"]["median"] * 1e3,
                f"{o['slowdown'] * 100:+.1f}% [{o['slowdown_min'] * 100:+.1f}..{o['slowdown_max'] * 100:+.1f}]",
                f"{o['gil_cost'] * 100:.1f}% ({o['gil_wait_s_mean'] * 1e3:.2f} ms)",
                f"{r['gil_waits_per_step'][phase]:.2f} ({r['gil_waits_per_step']['alone']:.2f})",
                o["mib_per_s"], o["gil_wait_s_per_gib"], o["step_s_lost_per_gib"],
                "yes" if o["slowdown"] <= GOAL else "NO", "yes" if o["gil_cost"] <= GOAL else "NO",
            ])
    print(bl.table(["blob", "traffic", "step alone ms", "step with ms", "slowdown (median) [per-rep]",
                    "GIL cost (mean wait/step)", "GIL waits/step (alone)", "MiB/s moved", "GIL wait s/GiB",
                    "step s lost/GiB", f"slowdown <= {GOAL:.0%}", f"GIL cost <= {GOAL:.0%}"], rows,
                   title="Python step slowdown while ec-s3 transfers (same process, interleaved phases)"))
    return 0


def goal_rows(d: dict[str, Any] | None) -> list[dict[str, str]]:
    """bench/run_all.py's goal rows from ``gil.json``: the GIL cost per direction."""
    g = "4. GIL interference"
    rows = []
    for phase in ("upload", "download"):
        rs = [(r["size_mib"], r[phase]) for r in (d or {}).get("sizes", []) if phase in r]
        if not rs:
            continue
        worst = max(rs, key=lambda x: x[1]["gil_cost"])
        slow = max(rs, key=lambda x: x[1]["slowdown"])
        ok = worst[1]["gil_cost"] <= GOAL
        per_gib = ", ".join(f"{m} MiB {o['step_s_lost_per_gib']:.2f} s/GiB" for m, o in rs)
        rows.append({
            "goal": g, "case": f"Python step while ec-s3 {phase}s ({', '.join(str(m) for m, _ in rs)} MiB)",
            "result": f"GIL cost up to {worst[1]['gil_cost'] * 100:.1f}% ({worst[0]} MiB); wall slowdown up to "
                      f"{slow[1]['slowdown'] * 100:+.0f}%; step time lost {per_gib}",
            "target": f"GIL cost <= {GOAL:.0%}", "status": "met" if ok else "MISSED",
            "why": "" if ok else f"worst at {worst[0]} MiB: per request the I/O thread runs Python (signing, "
                   "headers, validation, the result hand-off) while the step waits for the GIL; close: fewer, larger "
                   "requests, or that work outside the GIL"})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

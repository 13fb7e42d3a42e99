"""Engine-thread cost (issue #13 goal 3): what ec-s3's scheduler-side connector costs
vLLM's engine thread, in two parts, each against a baseline in the same run.

``scheduler``: wall and thread-CPU time of every scheduler-side connector call vLLM
makes (the stats call ``get_ec_connector_stats`` included: vLLM makes it every step)
while its real Scheduler (tests/support/vllm_rig) runs rounds of requests with 1-3
images each: promised by a producer (``ec_transfer_params``, blob in the bucket),
stored but not promised (``lookup: always``), missing (encoded locally) or repeated;
with 0, 50 and 200 ms of store latency (a first byte held by ec_s3.sandbox.netem). Baselines: the same
mix through vLLM's ``ECExampleConnector`` (files on local disk), and ec-s3 at 0 ms.
Goal: p99 < 100 us for every method, independent of latency.

``stats``: the stats call alone (own counters plus the workers' from shared memory,
``ec_s3.connector.metrics.scheduler_stats``) under loads the mix does not make: a
CPU-bound thread in the process (it takes the GIL whenever the call lets go), 300
other files in ``staging_dir``, and a worker's writer stuck mid-update plus the busy
thread; a writer flushes every 20 ms meanwhile (but the stuck one). Baseline: an empty
call timed the same way under the same load. Goal: p99 < 200 us at every load.

    .venv/bin/python -m bench.engine_cost [--quick] [--latencies-ms 0 50 200] [--rounds 8] [--calls 2000]
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import benchlib as bl

if __name__ == "__main__":  # a run, before vLLM is imported; imported for run_all's rows, os.environ stays
    bl.setup_env()

import torch  # noqa: E402

METHODS = ("ensure_cache_available", "has_cache_item", "update_state_after_alloc", "build_connector_meta",
           "update_connector_output", "take_unavailable_requests", "update_state_after_free", "request_finished",
           "get_ec_connector_stats")
ROWS, WIDTH = 16, 128  # the tiny model's image: 16 tokens x hidden 128
IDLE_META = "build_connector_meta@idle_step"  # a step that schedules no tokens
SCHED_GOAL_US, STATS_GOAL_US = 100.0, 200.0
STATS_LOADS = ("quiet", "busy_thread", "crowded_staging_dir", "stuck_writer_and_busy_thread")


class CallTimer:
    """Wraps a connector instance's scheduler-side methods to time every call, and the
    scheduler's own ``schedule`` / ``update_from_output`` for context."""

    def __init__(self, connector: Any, scheduler: Any) -> None:
        self.times: dict[str, list[float]] = {m: [] for m in METHODS}
        # CPU time of the calling thread per call: wall >> cpu means the call waited
        # (for the GIL held by ec-s3's I/O thread, or for a core on a busy machine).
        self.cpu_times: dict[str, list[float]] = {m: [] for m in METHODS}
        self.step_times: dict[str, list[float]] = {"schedule": [], "update_from_output": []}
        for name in METHODS:
            setattr(connector, name, self._wrap(self.times[name], getattr(connector, name), self.cpu_times[name]))
        # build_connector_meta on a step that schedules nothing may yield the GIL on
        # purpose (ec-s3 then lets its I/O thread run): kept apart from busy steps.
        self.times[IDLE_META], self.cpu_times[IDLE_META] = [], []
        busy = connector.build_connector_meta
        idle = self._wrap(self.times[IDLE_META], busy.__wrapped__, self.cpu_times[IDLE_META])

        def build_connector_meta(scheduler_output: Any) -> Any:
            fn = busy if scheduler_output.total_num_scheduled_tokens else idle
            return fn(scheduler_output)

        connector.build_connector_meta = build_connector_meta
        for name in self.step_times:
            setattr(scheduler, name, self._wrap(self.step_times[name], getattr(scheduler, name)))

    @staticmethod
    def _wrap(sink: list[float], fn: Any, cpu_sink: list[float] | None = None) -> Any:
        perf, cpu = time.perf_counter, time.thread_time

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            c0 = cpu()
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(perf() - t0)
                if cpu_sink is not None:
                    cpu_sink.append(cpu() - c0)

        return timed


def put_blob(store: Any, keyspace: Any, ident: str) -> None:
    from ec_s3.blob.codec import BlobMeta, encode_blob
    from tests.support.vllm_rig import fake_encoder_output

    t = fake_encoder_output(ident, ROWS)
    blob = encode_blob(t, BlobMeta(ident, torch.bfloat16, (ROWS, WIDTH), keyspace.namespace, "bench"))
    store.run(store.put_async(keyspace.key_for(ident), blob), timeout=60)


def make_mix(tag: str, rounds: int, per_round: int, rng: random.Random) -> list[list[tuple[str, list[str], set[str]]]]:
    """Per round, a list of (request_id, identifiers, promised identifiers)."""
    out = []
    seen: list[str] = []
    for r in range(rounds):
        reqs = []
        for j in range(per_round):
            idents, promised = [], set()
            for k in range(rng.choice((1, 2, 3))):
                kind = rng.choices(("promised", "stored", "miss", "repeat"), weights=(5, 2, 2, 2))[0]
                if kind == "repeat" and seen:
                    ident = rng.choice(seen)
                    kind = "promised" if ident.startswith(f"{tag}-promised") else "other"
                else:
                    kind = "promised" if kind == "repeat" else kind
                    ident = f"{tag}-{kind}-{r}-{j}-{k}"
                if ident in idents:
                    continue
                idents.append(ident)
                if kind == "promised":
                    promised.add(ident)
            seen.extend(idents)
            reqs.append((f"{tag}-r{r}-{j}", idents, promised))
        out.append(reqs)
    return out


def run_mix(driver: Any, mix: list, params_for: Any, timeout_s: float, arrivals_per_step: int = 2) -> dict[str, Any]:
    """Add each round's requests a few per step, drive until all done; returns counts."""
    from tests.support.ec_harness import drive

    t0 = time.monotonic()
    for round_reqs in mix:
        pending = list(round_reqs)
        while pending:
            for rid, idents, promised in pending[:arrivals_per_step]:
                driver.add(rid, idents, ec_transfer_params=params_for(promised) or None)
            pending = pending[arrivals_per_step:]
            driver.step()
        drive(driver, timeout_s=timeout_s)
    return {"wall_s": time.monotonic() - t0, "steps": len(driver.steps)}


def bench_ec_s3(ep: bl.Endpoint, bucket: str, model_dir: Path, latency_ms: int, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.ec_harness import make_node

    from ec_s3.sandbox.netem import LinkProfile, NetEm
    from ec_s3.store.client import S3Store

    tag = f"L{latency_ms}"
    mix = make_mix(tag, args.rounds, args.requests_per_round, random.Random(args.seed))  # same mix per latency
    link = NetEm(ep.url, LinkProfile("latency", first_byte_s=latency_ms / 1000.0)).start()  # its own process
    store = S3Store(ep.config(bucket))
    node = None
    try:
        extra = ep.extra(bucket, endpoint_url=link.endpoint_url, lookup="always", lookup_wait_s=5.0, promised_wait_s=30.0)
        node = make_node(model_dir, "ec_consumer", extra)
        keyspace = node.scheduler_connector.model.keyspace
        idents = {i for rnd in mix for _, ids, _ in rnd for i in ids}
        for ident in idents:
            if "-promised-" in ident or "-stored-" in ident:
                put_blob(store, keyspace, ident)

        def params_for(promised: set[str]) -> dict[str, Any]:
            return {i: {"key": keyspace.key_for(i), "shape": [ROWS, WIDTH], "dtype": "bfloat16"} for i in promised}

        timer = CallTimer(node.scheduler_connector, node.driver.scheduler)
        info = run_mix(node.driver, mix, params_for, timeout_s=120)
        counters = node.scheduler_connector.counters
        info.update({"encoded_locally": len(node.sim.encoded),
                     "loaded_from_store": node.worker.counters.get("blobs_loaded"),
                     "lookups_hit": counters.get("lookups_hit"), "lookups_miss": counters.get("lookups_miss"),
                     "requests": sum(len(r) for r in mix)})
        result = {"calls": timer.times, "cpu": timer.cpu_times, "steps": timer.step_times, "info": info}
    finally:
        if node is not None:
            node.close()
        store.close()
        link.stop()
    info["proxy_requests"] = link.requests  # node set-up's included
    return result


def bench_example(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same mix through vLLM's ECExampleConnector (consumer): promised/stored items
    are files on local disk, misses are encoded."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
    from safetensors.torch import save_file

    from ec_s3.sandbox.vllm_server import ec_transfer_config
    from tests.support.vllm_rig import ECWorkerSim, SchedulerDriver, fake_encoder_output, make_scheduler, make_vllm_config

    mix = make_mix("EX", args.rounds, args.requests_per_round, random.Random(args.seed))
    root = Path(tempfile.mkdtemp(prefix="ecb-example-sched-", dir="/tmp"))
    try:
        for ident in {i for rnd in mix for _, ids, _ in rnd for i in ids}:
            if "-promised-" in ident or "-stored-" in ident:
                (root / ident).mkdir(parents=True, exist_ok=True)
                save_file({"ec_cache": fake_encoder_output(ident, ROWS)}, str(root / ident / "encoder_cache.safetensors"))
        ec = ec_transfer_config("ec_consumer", {"shared_storage_path": str(root)},
                                connector="ECExampleConnector", module_path=None)
        vllm_config = make_vllm_config(model_dir, ec)
        scheduler = make_scheduler(vllm_config)
        sim = ECWorkerSim(ECExampleConnector(vllm_config, ECConnectorRole.WORKER))
        driver = SchedulerDriver(scheduler, sim)  # first, as make_node does: the timer wraps its order probe
        timer = CallTimer(scheduler.ec_connector, scheduler)
        info = run_mix(driver, mix, lambda promised: {}, timeout_s=120)
        info.update({"encoded_locally": len(sim.encoded), "requests": sum(len(r) for r in mix)})
        return {"calls": timer.times, "cpu": timer.cpu_times, "steps": timer.step_times, "info": info}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, r in raw.items():
        steps = len(r["steps"]["schedule"]) or 1
        conn_total = sum(t * 1e6 for ts in r["calls"].values() for t in ts)
        sched_total = sum(t * 1e6 for ts in r["steps"].values() for t in ts)
        every = {k: [t * 1e6 for m, ts in r[k].items() if m != IDLE_META for t in ts] for k in ("calls", "cpu")}
        out[label] = {
            "per_method_us": {m: bl.summary([t * 1e6 for t in ts]) for m, ts in r["calls"].items()},
            "all_calls_us": bl.summary(every["calls"]),
            "per_method_thread_cpu_us": {m: bl.summary([t * 1e6 for t in ts]) for m, ts in r["cpu"].items()},
            "all_calls_thread_cpu_us": bl.summary(every["cpu"]),
            "schedule_us": bl.summary([t * 1e6 for t in r["steps"]["schedule"]]),
            "update_from_output_us": bl.summary([t * 1e6 for t in r["steps"]["update_from_output"]]),
            "connector_us_per_step": conn_total / steps,
            # connector calls run inside schedule()/update_from_output(), so this is a share of them
            "connector_share_of_scheduler_time": conn_total / sched_total if sched_total else None,
            "info": r["info"],
        }
    return out


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


def _time_calls(fn: Callable[[], Any], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
        time.sleep(0.0005)  # an engine step between two calls
    return times


def stats_load(load: str, calls: int) -> dict[str, Any]:
    from ec_s3.connector.metrics import scheduler_stats
    from ec_s3.loop import BackgroundLoop
    from ec_s3.transfer import shared_stats
    from ec_s3.transfer.counters import Counters

    loop = BackgroundLoop("bench-io")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as staging:
        if load == "crowded_staging_dir":
            for i in range(300):
                (Path(staging) / f"other-{i}").write_bytes(b"x")
        # a worker's writer and the scheduler's reader, placed and driven as the connector does
        directory = shared_stats.stats_dir(staging)
        directory.mkdir(mode=0o700)
        counters = Counters()
        writer = shared_stats.SharedStatsWriter(str(directory), "bench", counters)
        reader = shared_stats.SharedStatsReader(str(directory), "bench")
        reader.collect_periodically(loop)
        if load.startswith("stuck_writer"):
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
        reader.close()
    loop.stop()
    return {"call_us": bl.summary(measured), "baseline_us": bl.summary(baseline)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--latencies-ms", type=int, nargs="+", default=[0, 50, 200])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests-per-round", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1, help="request mix (the same for every run)")
    parser.add_argument("--calls", type=int, default=None, help="stats calls per load (default 2000, quick 500)")
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (3 if q else 8)
    args.requests_per_round = args.requests_per_round or (8 if q else 12)
    calls = args.calls or (500 if q else 2000)

    from ec_s3.sandbox.tiny_model import build_tiny_llava

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    started = time.monotonic()
    bl.log("engine_cost: ECExampleConnector baseline")
    raw = {"example-connector": bench_example(model_dir, args)}
    with bl.s3_endpoint("engine") as ep:
        bucket = bl.create_bucket(ep)
        for lat in args.latencies_ms:
            bl.log(f"engine_cost: ec-s3 with {lat} ms store latency, {args.rounds} rounds x {args.requests_per_round} requests")
            raw[f"ec-s3@{lat}ms"] = bench_ec_s3(ep, bucket, model_dir, lat, args)
    summ = summarize(raw)
    base0 = summ[f"ec-s3@{args.latencies_ms[0]}ms"]["all_calls_us"]["p99"]
    for label, s in summ.items():
        busy = {m: v for m, v in s["per_method_us"].items() if v.get("n") and m != IDLE_META}
        s["worst_method"], s["max_method_p99_us"] = max(((m, v["p99"]) for m, v in busy.items()), key=lambda x: x[1])
        s["p99_vs_0ms"] = s["all_calls_us"]["p99"] / base0
    stats = {}
    for load in STATS_LOADS:
        stats[load] = r = stats_load(load, calls)
        bl.log(f"stats call, {load}: p99 {r['call_us']['p99']:.1f} us (empty call {r['baseline_us']['p99']:.1f} us)")
    bl.write_json("engine_cost", {
        "params": {"latencies_ms": args.latencies_ms, "rounds": args.rounds,
                   "requests_per_round": args.requests_per_round, "stats_calls": calls, "quick": q},
        "elapsed_s": time.monotonic() - started,
        "goal": f"scheduler-side calls p99 < {SCHED_GOAL_US:.0f} us per method at every store latency; "
                f"the stats call p99 < {STATS_GOAL_US:.0f} us at every load",
        "scheduler": summ, "stats": stats,
    }, args.out_dir)
    print_tables(summ, stats)
    return 0


def print_tables(summ: dict[str, Any], stats: dict[str, Any]) -> None:
    labels = list(summ)
    rows: list[list[Any]] = []
    for m in (*METHODS, IDLE_META):
        v = [summ[label]["per_method_us"].get(m, {}) for label in labels]
        rows.append([m] + [f"{x['median']:.1f} / {x['p99']:.1f} (n={x['n']})" if x.get("n") else "-" for x in v])
    for name, key in (("ALL", "all_calls_us"), ("ALL thread-CPU", "all_calls_thread_cpu_us"), ("schedule()", "schedule_us")):
        rows.append([name] + [f"{summ[label][key]['median']:.1f} / {summ[label][key]['p99']:.1f}" for label in labels])
    print(bl.table(["method: p50 / p99 us"] + labels, rows,
                   title=f"Scheduler-side connector calls (goal: p99 < {SCHED_GOAL_US:.0f} us; ALL excludes {IDLE_META})"))
    print(bl.table(["load", "p50 us", "p99 us", "max us", "empty call p99 us"],
                   [[load, r["call_us"]["median"], r["call_us"]["p99"], r["call_us"]["max"], r["baseline_us"]["p99"]]
                    for load, r in stats.items()], title=f"Stats call (goal: p99 < {STATS_GOAL_US:.0f} us)"))


def goal_rows(d: dict[str, Any] | None) -> list[dict[str, str]]:
    """bench/run_all.py's goal rows from ``engine_cost.json``."""
    g, rows = "3. engine thread", []
    for label, s in ((d or {}).get("scheduler") or {}).items():
        if not label.startswith("ec-s3"):
            continue
        ok = s["max_method_p99_us"] < SCHED_GOAL_US
        idle = s["per_method_us"][IDLE_META]
        rows.append({"goal": g, "case": f"scheduler-side calls, store latency {label.split('@')[1]}",
                     "result": f"worst method p99 {s['max_method_p99_us']:.0f} us ({s['worst_method']}); all calls p99 "
                               f"{s['all_calls_us']['p99']:.0f} us, {s['p99_vs_0ms']:.2f}x of 0 ms"
                               + (f"; idle-step build_connector_meta p99 {idle['p99']:.0f} us (yields the GIL by design)"
                                  if idle.get("n") else ""),
                     "target": f"p99 < {SCHED_GOAL_US:.0f} us", "status": "met" if ok else "MISSED",
                     "why": "" if ok else _why_slow(s)})
    for load, r in ((d or {}).get("stats") or {}).items():
        ok = r["call_us"]["p99"] < STATS_GOAL_US
        rows.append({"goal": g, "case": f"stats call, {load.replace('_', ' ')}",
                     "result": f"p99 {r['call_us']['p99']:.0f} us (empty call {r['baseline_us']['p99']:.0f} us)",
                     "target": f"p99 < {STATS_GOAL_US:.0f} us", "status": "met" if ok else "MISSED",
                     "why": "" if ok else f"max {r['call_us']['max']:.0f} us; an empty call timed the same way: "
                            f"p99 {r['baseline_us']['p99']:.0f} us, max {r['baseline_us']['max']:.0f} us"})
    return rows


def _why_slow(s: dict[str, Any]) -> str:
    """Whether the slowest method worked or waited: its thread CPU against its wall time."""
    m = s["worst_method"]
    wall, cpu = s["per_method_us"][m]["p99"], s["per_method_thread_cpu_us"][m]["p99"]
    return (f"{m}: thread CPU p99 {cpu:.0f} us of {wall:.0f} us wall: "
            + ("mostly waiting (for the GIL, held by ec-s3's I/O thread, or for a core)" if cpu < wall / 2
               else "mostly its own work"))


if __name__ == "__main__":
    raise SystemExit(main())

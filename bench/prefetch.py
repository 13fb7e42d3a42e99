"""Prefetch effectiveness: what the scheduler-side prefetch into shared-memory staging
saves the model step, and what it costs the request.

For each blob size, with vLLM's real Scheduler and the worker-role connector
(tests/ec_harness), a consumer request arrives with a promise for a blob in the bucket:

* **worker load**: time in the worker's ``start_load_caches`` for the staged item (it
  maps the staging file and copies the tensor; no network) vs the same ``LoadSpec``
  with a foreign ``host``, which makes ``ECS3Worker`` fetch from S3 synchronously in
  the step (the multi-node path, the baseline);
* **time to schedulable**: from ``add_request`` until ``schedule()`` first schedules the
  request, minus the same for a request needing no lookup (baseline), vs a raw
  ``S3Store.get_async`` of the same blob (measured alternately before and after).
  Twice: with the engine loop yielding the GIL between steps (``time.sleep(0)``), and
  spinning without a pause as EngineCore's busy loop does while it has requests (the
  scheduler thread then holds the GIL and ec-s3's I/O thread gets it only every
  ``sys.getswitchinterval()`` = 5 ms).
Blob width is 32768 bf16 (so a 64 MiB blob is 1024 image tokens of the tiny model).

    .venv/bin/python -m bench.prefetch [--quick] [--sizes-mib 1 8 32 64] [--samples 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

bl.setup_env()

import torch  # noqa: E402

WIDTH = 32768


class Probe:
    """Times the worker's start_load_caches (and keeps its LoadSpecs) and records when
    schedule() returns."""

    def __init__(self, worker: Any, scheduler: Any) -> None:
        self.load_times: list[tuple[float, list[Any]]] = []
        self.schedule_returned = 0.0
        orig_load, orig_sched = worker.start_load_caches, scheduler.schedule

        def start_load_caches(encoder_cache: Any, **kw: Any) -> None:
            meta = worker._get_connector_metadata()  # noqa: SLF001
            loads = list(getattr(meta, "loads", []))
            t0 = time.perf_counter()
            orig_load(encoder_cache, **kw)
            if loads:
                self.load_times.append((time.perf_counter() - t0, loads))

        def schedule(*a: Any, **kw: Any) -> Any:
            out = orig_sched(*a, **kw)
            self.schedule_returned = time.perf_counter()
            return out

        worker.start_load_caches = start_load_caches
        scheduler.schedule = schedule


def time_to_scheduled(node: Any, probe: Probe, rid: str, idents: list[str], rows: int, params: dict | None,
                      yield_gil: bool, timeout_s: float = 120.0) -> float:
    driver = node.driver
    req = driver.make_request(rid, idents, num_image_tokens=rows, ec_transfer_params=params)
    t0 = time.perf_counter()
    driver.add_request(req)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        so = driver.step()
        if so is not None and rid in so.num_scheduled_tokens:
            return probe.schedule_returned - t0
        if yield_gil:
            time.sleep(0)  # only yields the GIL; EngineCore's busy loop does not even do that
    raise TimeoutError(f"{rid} not scheduled within {timeout_s}s")


def finish(node: Any) -> None:
    from tests.support.ec_harness import drive

    drive(node.driver, timeout_s=120)


def bench_size(node: Any, probe: Probe, store: Any, size_mib: int, samples: int) -> dict[str, Any]:
    from ec_s3.blob.codec import BlobMeta, encode_blob
    from ec_s3.connector.messages import ECS3ConnectorMetadata

    keyspace = node.scheduler_connector.model.keyspace
    rows = size_mib * bl.MiB // (WIDTH * 2)
    raw_get, staged, remote, remote_ok = [], [], [], []
    tts: dict[bool, list[float]] = {True: [], False: []}
    tts_base: dict[bool, list[float]] = {True: [], False: []}
    for i in range(samples):
        tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
        for yield_gil in (True, False):
            ident = f"pf{size_mib}-{i}-{int(yield_gil)}-{time.time_ns()}"
            blob = encode_blob(tensor, BlobMeta(ident, torch.bfloat16, (rows, WIDTH), keyspace.namespace, "bench"))
            key = keyspace.key_for(ident)
            store.run(store.put_async(key, blob), timeout=120)
            params = {ident: {"key": key, "shape": [rows, WIDTH], "dtype": "bfloat16"}}

            def get() -> None:
                t0 = time.perf_counter()
                buf = store.run(store.get_async(key), timeout=120)
                raw_get.append(time.perf_counter() - t0)
                assert len(buf) == len(blob)

            if yield_gil and i % 2 == 0:
                get()
            # baseline: the same request shape, nothing to look up (encoded locally)
            tts_base[yield_gil].append(time_to_scheduled(node, probe, f"base-{ident}", [f"local-{ident}"], rows, None, yield_gil))
            finish(node)
            probe.load_times.clear()
            tts[yield_gil].append(time_to_scheduled(node, probe, f"req-{ident}", [ident], rows, params, yield_gil))
            finish(node)
            if yield_gil and i % 2 == 1:
                get()
            (load_s, loads), = probe.load_times
            staged.append(load_s)
            if not yield_gil:
                store.run(store.delete_async(key), timeout=60)
                continue
            # baseline: the worker fetches the same blob from S3 itself (LoadSpec from another host)
            spec = dataclasses.replace(loads[0], host="bench-other-host")
            node.worker.bind_connector_metadata(ECS3ConnectorMetadata(loads=[spec]))
            cache: dict[str, torch.Tensor] = {}
            t0 = time.perf_counter()
            node.worker.start_load_caches(cache)
            remote.append(time.perf_counter() - t0)
            node.worker.clear_connector_metadata()
            probe.load_times.clear()
            remote_ok.append(bool(ident in cache and torch.equal(cache[ident], tensor)))
            store.run(store.delete_async(key), timeout=60)
    extra = [a - b for a, b in zip(tts[True], tts_base[True])]
    extra_spin = [a - b for a, b in zip(tts[False], tts_base[False])]
    out = {
        "size_mib": size_mib,
        "rows": rows,
        "blob_bytes": len(blob),
        "raw_get_s": bl.summary(raw_get),
        "time_to_scheduled_s": bl.summary(tts[True]),
        "time_to_scheduled_baseline_s": bl.summary(tts_base[True]),
        "extra_time_to_scheduled_s": bl.summary(extra),
        "time_to_scheduled_spin_s": bl.summary(tts[False]),
        "time_to_scheduled_spin_baseline_s": bl.summary(tts_base[False]),
        "extra_time_to_scheduled_spin_s": bl.summary(extra_spin),
        "ratio_extra_tts_spin_to_raw_get": statistics.median(extra_spin) / statistics.median(raw_get),
        "worker_load_staged_s": bl.summary(staged),
        "worker_load_remote_s": bl.summary(remote),
        "remote_load_correct": all(remote_ok),
        "ratio_staged_to_remote_load": statistics.median(staged) / statistics.median(remote),
        "ratio_extra_tts_to_raw_get": statistics.median(extra) / statistics.median(raw_get),
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()
    q = args.quick
    sizes = args.sizes_mib or ([1, 8, 32] if q else [1, 8, 32, 64])
    samples = args.samples or (3 if q else 6)

    from tests.support.ec_harness import make_node

    from ec_s3.store.client import S3Store
    from ec_s3.sandbox.tiny_model import build_tiny_llava

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    results: dict[str, Any] = {}
    started = time.monotonic()
    with bl.s3_endpoint("prefetch") as ep:
        bucket = bl.create_bucket(ep)
        extra = ep.extra(bucket, lookup="promised", encoder_output_width=WIDTH, promised_wait_s=60,
                         staging_bytes=4 * max(sizes) * bl.MiB + 64 * bl.MiB)
        node = make_node(model_dir, "ec_consumer", extra, max_model_len=2048, max_num_batched_tokens=2048)
        store = S3Store(ep.config(bucket))
        probe = Probe(node.worker, node.driver.scheduler)
        try:
            bench_size(node, probe, store, 1, 1)  # warm-up
            for size in sizes:
                bl.log(f"prefetch: {size} MiB x{samples}")
                results[str(size)] = r = bench_size(node, probe, store, size, samples)
                bl.log(f"  worker load staged {r['worker_load_staged_s']['median'] * 1e3:.2f} ms vs remote "
                       f"{r['worker_load_remote_s']['median'] * 1e3:.2f} ms; extra time-to-scheduled "
                       f"{r['extra_time_to_scheduled_s']['median'] * 1e3:.1f} ms vs raw GET {r['raw_get_s']['median'] * 1e3:.1f} ms")
        finally:
            node.close()
            store.close()
    bl.write_json("prefetch", {
        "params": {"sizes_mib": sizes, "samples": samples, "width": WIDTH, "quick": q},
        "elapsed_s": time.monotonic() - started,
        "sizes": results,
    }, args.out_dir)
    rows = []
    for size, r in results.items():
        rows.append([
            f"{size} MiB", r["worker_load_staged_s"]["median"] * 1e3, r["worker_load_remote_s"]["median"] * 1e3,
            r["ratio_staged_to_remote_load"], r["raw_get_s"]["median"] * 1e3,
            r["extra_time_to_scheduled_s"]["median"] * 1e3, r["ratio_extra_tts_to_raw_get"],
            r["extra_time_to_scheduled_spin_s"]["median"] * 1e3, r["ratio_extra_tts_spin_to_raw_get"],
        ])
    print(bl.table(
        ["blob", "worker load staged ms", "worker fetches itself ms", "staged / self-fetch", "raw GET ms",
         "extra TTS ms (loop yields GIL)", "/ raw GET", "extra TTS ms (loop spins)", "/ raw GET"],
        rows, title="Prefetch effectiveness (medians)",
    ))
    if not args.no_plot:
        plot(results, args.out_dir)
    return 0


def plot(results: dict[str, Any], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    sizes = [int(s) for s in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, ax in (
        ("worker_load_staged_s", "worker start_load_caches: staged", a1),
        ("worker_load_remote_s", "worker start_load_caches: fetches from S3", a1),
        ("raw_get_s", "raw S3Store GET", a2),
        ("extra_time_to_scheduled_s", "extra time to scheduled, loop yields the GIL", a2),
        ("extra_time_to_scheduled_spin_s", "extra time to scheduled, loop spins (EngineCore-like)", a2),
    ):
        med = [results[str(s)][key]["median"] * 1e3 for s in sizes]
        lo = [m - results[str(s)][key]["p10"] * 1e3 for s, m in zip(sizes, med)]
        hi = [results[str(s)][key]["p90"] * 1e3 - m for s, m in zip(sizes, med)]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    for ax, title in ((a1, "Time in the model step (worker)"), (a2, "Request: time until schedulable")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("blob size (MiB)")
        ax.set_ylabel("ms (median, bars p10-p90)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    bl.save_fig(fig, "prefetch", out_dir)


if __name__ == "__main__":
    raise SystemExit(main())

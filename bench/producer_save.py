"""Producer step cost: ``save_caches`` time per call vs the time for the same blob to
be uploaded and visible in the store (HEAD 200), through the real ECS3Connector
(worker role, producer), for several blob sizes.

Per size, paired samples: run the connector calls of one producer step as vLLM does
(``start_save_caches``, ``save_caches``, ``build_connector_worker_meta``) and time
``save_caches`` and the whole bracket (what the model step pays; the I/O loop is woken
at the end of the bracket, once), then wait for the publisher to finish the upload
(``flush``: the PUT was acknowledged) and check with one HEAD that the blob is visible.
Then a burst: one step saving several images back to back (uploads competing with the
step for the GIL), timed per ``save_caches`` and for the bracket.
Baseline in the same run: vLLM's ``ECExampleConnector.save_caches`` (synchronous
safetensors write to local disk) for the same tensor.

Goal: median ``save_caches`` <= 1% of the upload time (the step bracket is reported
beside it). Starts its own SeaweedFS.

    .venv/bin/python -m bench.producer_save [--quick] [--sizes-mib 1 8 32 64] [--samples 10]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

bl.setup_env()

import torch  # noqa: E402

WIDTH = 4096


def _step(conn: Any, outputs: dict[str, Any], cpu: list[float] | None = None) -> tuple[list[float], float]:
    """One producer step's connector calls, as vLLM's EC context runs them for new
    requests; returns the time of each ``save_caches`` and of the whole bracket (and
    appends each call's thread CPU time to ``cpu``: wall >> CPU means the call waited,
    e.g. for the GIL). As in vLLM, the scheduler's metadata carries the keys of a new
    request's items (computed in the scheduler process, not timed here) and the encoder
    cache gets each output between ``start_save_caches`` and its ``save_caches``."""
    from ec_s3.connector.messages import ECS3ConnectorMetadata

    meta = ECS3ConnectorMetadata(save_keys={ident: [conn.model.keyspace.key_for(ident)] for ident in outputs})
    cache: dict[str, Any] = {}
    saves = []
    t0 = time.perf_counter()
    conn.bind_connector_metadata(meta)
    conn.start_save_caches(encoder_cache=cache)
    for ident, tensor in outputs.items():
        cache[ident] = tensor  # the encoder ran
        c0, s0 = time.thread_time(), time.perf_counter()
        conn.save_caches(cache, ident)
        saves.append(time.perf_counter() - s0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    conn.get_finished(set())
    conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return saves, time.perf_counter() - t0


def bench_size(conn: Any, example: Any, store: Any, size_mib: int, samples: int, burst: int) -> dict[str, Any]:
    keyspace = conn.model.keyspace
    publisher = conn._worker._publisher  # noqa: SLF001 - the bench waits for uploads; vLLM never does
    rows = size_mib * bl.MiB // (WIDTH * 2)
    save, save_cpu, step, ack, visible, example_save = [], [], [], [], [], []
    for i in range(samples):
        tensor = torch.randn(rows, WIDTH).to(torch.bfloat16)
        ident = f"s{size_mib}-{i}-{time.time_ns()}"
        t0 = time.perf_counter()
        (one,), bracket = _step(conn, {ident: tensor}, save_cpu)
        if publisher.flush(120) != 0:
            raise RuntimeError("upload did not finish in 120 s")
        t2 = time.perf_counter()
        if store.run(store.head_async(keyspace.key_for(ident)), timeout=30) is None:
            raise RuntimeError(f"blob {ident} not visible after its upload finished")
        t3 = time.perf_counter()
        save.append(one)
        step.append(bracket)
        ack.append(t2 - t0)
        visible.append(t3 - t0)
        # Baseline: the seed connector's synchronous save of the same tensor.
        t0 = time.perf_counter()
        example.save_caches({ident: tensor}, ident)
        example_save.append(time.perf_counter() - t0)
        shutil.rmtree(Path(example._storage_path) / ident, ignore_errors=True)  # noqa: SLF001
    tensors = {f"b{size_mib}-{j}-{time.time_ns()}": torch.randn(rows, WIDTH).to(torch.bfloat16) for j in range(burst)}
    wakeups = getattr(publisher, "wakeups", None)  # absent before the publisher counted them
    burst_costs, burst_step = _step(conn, tensors)
    burst_wakeups = None if wakeups is None else publisher.wakeups - wakeups
    t0 = time.perf_counter()
    publisher.flush(300)
    burst_drain = time.perf_counter() - t0
    del tensors
    out = {
        "size_mib": size_mib,
        "samples": samples,
        "save_caches_s": bl.summary(save),
        "save_caches_thread_cpu_s": bl.summary(save_cpu),
        "step_bracket_s": bl.summary(step),
        "upload_ack_s": bl.summary(ack),
        "upload_visible_s": bl.summary(visible),
        "example_connector_save_s": bl.summary(example_save),
        "burst": {"calls": burst, "save_caches_s": bl.summary(burst_costs), "step_bracket_s": burst_step,
                  "loop_wakeups": burst_wakeups,
                  "drain_after_burst_s": burst_drain},
        "ratio_save_to_upload": statistics.median(save) / statistics.median(ack),
        "ratio_step_to_upload": statistics.median(step) / statistics.median(ack),
        "ratio_save_to_upload_per_sample_max": max(s / a for s, a in zip(save, ack)),
        "ratio_burst_save_to_upload": statistics.median(burst_costs) / statistics.median(ack) if burst_costs else None,
        "ratio_save_to_example_save": statistics.median(save) / statistics.median(example_save),
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--samples", type=int, default=None, help="paired save/upload samples per size")
    parser.add_argument("--burst-mib", type=int, default=None, help="bytes saved back-to-back in the burst")
    args = parser.parse_args()
    q = args.quick
    sizes = args.sizes_mib or ([1, 8, 32] if q else [1, 8, 32, 64])
    samples = args.samples or (5 if q else 10)
    burst_mib = args.burst_mib or (64 if q else 256)

    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    from ec_s3.connector.facade import ECS3Connector
    from ec_s3.connector.messages import ECS3ConnectorMetadata
    from ec_s3.store.client import S3Store
    from ec_s3.sandbox.tiny_model import build_tiny_llava
    from ec_s3.sandbox.vllm_server import ec_transfer_config
    from tests.support.vllm_rig import make_vllm_config

    model_dir = build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava")
    example_dir = Path(tempfile.mkdtemp(prefix="ecb-example-save-", dir="/tmp"))
    results: dict[str, Any] = {}
    started = time.monotonic()
    with bl.s3_endpoint("save") as ep:
        bucket = bl.create_bucket(ep)
        burst_max = max(2, burst_mib // min(sizes))
        extra = ep.extra(bucket, lookup="promised", max_inflight_bytes=(burst_mib + 2 * max(sizes) + 8) * bl.MiB)
        conn = ECS3Connector(
            make_vllm_config(model_dir, ec_transfer_config("ec_producer", extra)),
            ECConnectorRole.WORKER,
        )
        conn.bind_connector_metadata(ECS3ConnectorMetadata())
        example = ECExampleConnector(
            make_vllm_config(model_dir, ec_transfer_config("ec_producer", {"shared_storage_path": str(example_dir)},
                                                           connector="ECExampleConnector", module_path=None)),
            ECConnectorRole.WORKER,
        )
        store = S3Store(ep.config(bucket))
        try:
            # warm-up: client, connections, code paths
            bench_size(conn, example, store, 1, 2, 0)
            for size in sizes:
                burst = min(burst_max, max(2, burst_mib // size))
                bl.log(f"producer_save: {size} MiB x{samples} samples, burst of {burst}")
                results[str(size)] = r = bench_size(conn, example, store, size, samples, burst)
                bl.log(f"  save_caches median {r['save_caches_s']['median'] * 1e6:.0f} us (step bracket "
                       f"{r['step_bracket_s']['median'] * 1e6:.0f} us), upload {r['upload_ack_s']['median'] * 1e3:.1f} ms "
                       f"-> {r['ratio_save_to_upload'] * 100:.3f}% ({r['ratio_step_to_upload'] * 100:.3f}%)")
        finally:
            conn.shutdown()
            store.close()
            shutil.rmtree(example_dir, ignore_errors=True)

    ok = all(r["ratio_save_to_upload"] <= 0.01 for r in results.values())
    bl.write_json("producer_save", {
        "params": {"sizes_mib": sizes, "samples": samples, "burst_mib": burst_mib, "width": WIDTH, "quick": q},
        "elapsed_s": time.monotonic() - started,
        "goal": "median save_caches <= 1% of upload time (PUT acknowledged, then HEAD 200)",
        "goal_met": ok,
        "sizes": results,
    }, args.out_dir)
    rows = []
    for size, r in results.items():
        rows.append([
            f"{size} MiB", r["save_caches_s"]["median"] * 1e6, r["save_caches_s"]["p90"] * 1e6,
            r["save_caches_thread_cpu_s"]["median"] * 1e6,
            r["step_bracket_s"]["median"] * 1e6, r["step_bracket_s"]["p90"] * 1e6,
            r["burst"]["save_caches_s"].get("median", float("nan")) * 1e6, r["burst"]["step_bracket_s"] * 1e6,
            r["upload_ack_s"]["median"] * 1e3, r["upload_visible_s"]["median"] * 1e3,
            r["ratio_save_to_upload"] * 100, r["ratio_step_to_upload"] * 100, r["ratio_save_to_example_save"],
        ])
    print(bl.table(
        ["blob", "save_caches med us", "p90 us", "its thread CPU us", "step med us", "step p90 us", "burst save med us", "burst step us",
         "upload ms", "visible ms", "save/upload % (goal<=1)", "step/upload %", "vs example save"],
        rows, title="Producer step cost (ratio = ec-s3 save_caches / baseline, medians)",
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
    for key, label in (("save_caches_s", "ec-s3 save_caches"), ("upload_ack_s", "upload until acknowledged"),
                       ("upload_visible_s", "until HEAD 200"), ("example_connector_save_s", "ECExampleConnector.save_caches")):
        med = [results[str(s)][key]["median"] * 1e3 for s in sizes]
        lo = [m - results[str(s)][key]["p10"] * 1e3 for s, m in zip(sizes, med)]
        hi = [results[str(s)][key]["p90"] * 1e3 - m for s, m in zip(sizes, med)]
        a1.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("blob size (MiB)")
    a1.set_ylabel("ms per blob (median, bars p10-p90)")
    a1.set_title("Producer: step cost vs upload time")
    a1.legend(fontsize=7)
    a2.bar([str(s) for s in sizes], [results[str(s)]["ratio_save_to_upload"] * 100 for s in sizes])
    a2.axhline(1.0, color="red", ls="--", label="goal 1%")
    a2.set_xlabel("blob size (MiB)")
    a2.set_ylabel("save_caches / upload time (%)")
    a2.set_title("save_caches as a share of the upload")
    a2.legend(fontsize=7)
    bl.save_fig(fig, "producer_save", out_dir)


if __name__ == "__main__":
    raise SystemExit(main())

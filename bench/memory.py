"""Producer memory under a stalled store: peak RSS vs ``max_inflight_bytes``.

``BlobPublisher`` (what ``save_caches`` uses) publishes fresh encoder outputs while
every PUT to the store is held by a fault proxy (tests/faultproxy.py ``set_stall``),
so nothing ever leaves. Each configuration runs in a fresh process (so the allocator
starts clean) and the proxy in another one (its buffered request bodies must not
count in our RSS). The saving thread drops its reference to each tensor after the
save, as vLLM frees its encoder cache.

Shown: RSS growth (peak minus the level before the saves) per configuration, against
``max_inflight_bytes`` and against what the saves would hold unbounded (saves x blob).
Goal: growth <= 1.2x max_inflight_bytes, independent of the number of saves.

Two axes separate ec-s3's memory from the allocator's: ``--encoders`` ``cast`` makes
each output as ``randn(fp32).to(bf16)`` (a freed temporary twice the output's size next
to every output held: glibc keeps those holes) and ``direct`` makes it in bf16;
``--variants`` ``in-place`` is the publisher's CPU default (the tensor's own memory is
uploaded, the pool lends room) and ``buffered`` copies each output into a pool buffer on
the loop (``copy_cpu_outputs``, the pinned path's layout on CPU).

    .venv/bin/python -m bench.memory [--quick] [--budgets-mib 64 256 512] [--blob-mib 8] [--saves-x 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

WIDTH = 4096


# --------------------------------------------------------------------------- one configuration


def run_config(ep_json: str, budget_mib: int, blob_mib: int, saves: int, mode: str, encoder: str = "cast",
               variant: str = "in-place") -> dict[str, Any]:
    """In a fresh process: publish ``saves`` blobs while PUTs stall; report RSS."""
    bl.setup_env()
    import torch

    from ec_s3.transfer.publisher import BlobPublisher
    from ec_s3.transfer.counters import Counters
    from ec_s3.store.client import S3Store

    ep = bl.Endpoint(**json.loads(ep_json))
    proxy = bl.ProxyProcess(ep.url)
    store = None
    try:
        bucket = bl.create_bucket(ep)
        over = {"endpoint_url": proxy.url, "max_inflight_bytes": budget_mib * bl.MiB, "backpressure": mode,
                "read_timeout_s": 120.0}
        config = ep.config(bucket, **over)
        store = S3Store(config)
        counters = Counters()
        pub = BlobPublisher(store, config, namespace="ns", producer="bench", counters=counters,
                            copy_cpu_outputs=variant == "buffered")
        rows = blob_mib * bl.MiB // (WIDTH * 2)

        def encoder_output() -> torch.Tensor:
            if encoder == "direct":
                return torch.randn(rows, WIDTH, dtype=torch.bfloat16)
            return torch.randn(rows, WIDTH).to(torch.bfloat16)

        # warm-up: client, connections, code paths, one tensor of the size
        pub.publish("warm", encoder_output(), "warm")
        assert pub.flush(60) == 0
        proxy.stall_put()
        time.sleep(0.2)
        rss0 = bl.proc_rss_bytes()
        done = threading.Event()
        stop = threading.Event()
        accepted = [0]

        def save_all() -> None:
            for i in range(saves):
                if stop.is_set():
                    break  # measured; no need to upload the rest
                t = encoder_output()  # a fresh encoder output
                accepted[0] += bool(pub.publish(f"id{i}", t, f"k/{i}"))
                del t  # vLLM frees its encoder cache entry
            done.set()

        with bl.RssSampler(0.005) as sampler:
            sampler.peak = rss0 or 0
            saver = threading.Thread(target=save_all, daemon=True)
            t0 = time.monotonic()
            saver.start()
            # Until the saver finished (drop) or stopped making progress (block: waiting for room).
            last, still = -1, 0.0
            while not done.is_set() and time.monotonic() - t0 < 120:
                time.sleep(0.1)
                if accepted[0] == last:
                    still += 0.1
                    if still >= 1.5:
                        break
                else:
                    last, still = accepted[0], 0.0
            time.sleep(1.0)  # let the loop build the bodies of what it accepted
            stalled_rss = bl.proc_rss_bytes() or 0
            held = proxy.counters()["held"]
        peak_stalled = sampler.peak
        budget_used_peak = pub.pool.peak
        blocked = not done.is_set()
        stop.set()
        proxy.release()
        done.wait(300)
        left = pub.flush(300)
        after = bl.proc_rss_bytes() or 0
        blob_bytes = rows * WIDTH * 2
        return {
            "budget_mib": budget_mib, "blob_mib": blob_mib, "saves": saves, "mode": mode, "encoder": encoder,
            "variant": variant, "pool_held_peak_bytes": pub.pool.peak, "pool_allocations": pub.pool.allocations,
            "rss_before": rss0, "rss_stalled": stalled_rss, "rss_peak_stalled": peak_stalled, "rss_after_release": after,
            "growth_bytes": peak_stalled - (rss0 or 0),
            "growth_vs_budget": (peak_stalled - (rss0 or 0)) / (budget_mib * bl.MiB),
            "growth_vs_unbounded": (peak_stalled - (rss0 or 0)) / (saves * blob_bytes),
            "accepted_while_stalled": accepted[0] if blocked else None,
            "saves_blocked": blocked,
            "budget_peak_bytes": budget_used_peak,
            "puts_held_by_proxy": held,
            "dropped": counters.get("upload_dropped"),
            "uploaded_after_release": counters.get("blobs_uploaded") - 1,
            "left_after_flush": left,
        }
    finally:
        if store is not None:
            store.close(timeout=2)
        proxy.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--budgets-mib", type=int, nargs="+", default=None)
    parser.add_argument("--blob-mib", type=int, default=8)
    parser.add_argument("--saves-x", type=float, nargs="+", default=None,
                        help="saves per configuration, as multiples of budget/blob")
    parser.add_argument("--modes", nargs="+", default=None, choices=["block", "drop"])
    parser.add_argument("--allocators", nargs="+", default=None, choices=["default", "fixed-mmap-threshold"],
                        help="glibc malloc as is, or with MALLOC_MMAP_THRESHOLD_=128KiB (freed blobs go back to the OS: "
                             "separates ec-s3's live bytes from allocator retention)")
    parser.add_argument("--encoders", nargs="+", default=None, choices=["cast", "direct"],
                        help="how the stand-in encoder makes an output: fp32 then cast (a freed temporary per output), "
                             "or bf16 directly")
    parser.add_argument("--variants", nargs="+", default=None, choices=["in-place", "buffered"],
                        help="publisher on CPU: upload the tensor in place (default) or copy it into a pool buffer")
    parser.add_argument("--config-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config_child:
        print(json.dumps(run_config(**json.loads(args.config_child))), flush=True)
        return 0
    q = args.quick
    budgets = args.budgets_mib or ([64, 256] if q else [64, 256, 512])
    saves_x = args.saves_x or ([4] if q else [2, 4])
    modes = args.modes or (["block"] if q else ["block", "drop"])
    allocators = args.allocators or (["default"] if q else ["default", "fixed-mmap-threshold"])
    encoders = args.encoders or ["cast", "direct"]
    variants = args.variants or ["in-place", "buffered"]

    runs: list[dict[str, Any]] = []
    started = time.monotonic()

    def save() -> None:  # after every configuration, so a time limit keeps what was measured
        bl.write_json("memory", {
            "params": {"budgets_mib": budgets, "blob_mib": args.blob_mib, "saves_x": saves_x, "modes": modes,
                       "allocators": allocators, "encoders": encoders, "variants": variants, "quick": q},
            "elapsed_s": time.monotonic() - started,
            "goal": "RSS growth <= 1.2x max_inflight_bytes, independent of the number of saves",
            "runs": runs,
        }, args.out_dir)

    with bl.s3_endpoint("memory") as ep:
        ep_json = json.dumps({"url": ep.url, "access_key_id": ep.access_key_id, "secret_access_key": ep.secret_access_key})
        plan = [(a, m, b, x, encoders[0], variants[0]) for a in allocators for m in modes for b in budgets
                for x in saves_x
                if (m == modes[0] and (a == "default" or x == saves_x[-1])) or (a == "default" and x == saves_x[-1])]
        # the drop mode and the allocator diagnostic need one point per budget; so do the
        # other encoder stand-ins and publisher variants (block, default malloc, most saves)
        plan += [("default", modes[0], b, saves_x[-1], e, v) for e in encoders for v in variants for b in budgets
                 if (e, v) != (encoders[0], variants[0])]
        for alloc, mode, budget, x, encoder, variant in plan:
            saves = max(1, int(round(x * budget / args.blob_mib)))
            bl.log(f"memory: {mode}, {alloc} malloc, {encoder} encoder, {variant}, max_inflight {budget} MiB, "
                   f"{saves} saves of {args.blob_mib} MiB")
            child = json.dumps({"ep_json": ep_json, "budget_mib": budget, "blob_mib": args.blob_mib,
                                "saves": saves, "mode": mode, "encoder": encoder, "variant": variant})
            env = dict(os.environ)
            if alloc != "default":
                env["MALLOC_MMAP_THRESHOLD_"] = "131072"
            proc = subprocess.run(bl.module_command("bench.memory", "--config-child", child), capture_output=True,
                                  text=True, timeout=600, env=env, cwd=bl.REPO)
            if proc.returncode != 0:
                bl.log(f"  failed:\n{proc.stderr[-3000:]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["allocator"] = alloc
            runs.append(r)
            save()
            bl.log(f"  RSS +{r['growth_bytes'] / bl.MiB:.0f} MiB = {r['growth_vs_budget']:.2f} x budget "
                   f"({r['growth_vs_unbounded']:.2f} x unbounded); held PUTs {r['puts_held_by_proxy']}")
    save()
    rows = [[r["mode"], r["allocator"], r["encoder"], r["variant"], r["budget_mib"], r["saves"],
             r["saves"] * r["blob_mib"], r["growth_bytes"] / bl.MiB, r["growth_vs_budget"], r["growth_vs_unbounded"],
             r["budget_peak_bytes"] / bl.MiB, r["dropped"]]
            for r in runs]
    print(bl.table(["mode", "malloc", "encoder", "publisher", "max_inflight MiB", "saves", "unbounded MiB",
                    "RSS growth MiB", "growth / budget", "growth / unbounded", "budget peak MiB", "dropped"], rows,
                   title="Producer RSS under a stalled store (peak growth)"))
    if not args.no_plot:
        plot(runs, args.out_dir)
    return 0


def plot(runs: list[dict[str, Any]], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    if plt is None or not runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    def label(r: dict[str, Any]) -> tuple[str, str, str, str]:
        return r["mode"], r.get("allocator", "default"), r.get("encoder", "cast"), r.get("variant", "in-place")

    series = sorted({label(r) for r in runs})
    for i, (mode, alloc, encoder, variant) in enumerate(series):
        rs = [r for r in runs if label(r) == (mode, alloc, encoder, variant)]
        marker = "o" if alloc == "default" else "s"
        most = max(r["saves"] / r["budget_mib"] for r in rs)
        for r in rs:
            filled = r["saves"] / r["budget_mib"] >= most
            ax.scatter([r["budget_mib"] * (1 + 0.015 * i)], [r["growth_bytes"] / bl.MiB], marker=marker, s=36, zorder=3,
                       facecolors=f"C{i}" if filled else "none", edgecolors=f"C{i}")
        ax.scatter([], [], marker=marker, color=f"C{i}",
                   label=f"backpressure={mode}, {alloc} malloc, {encoder} encoder, {variant}")
    budgets = sorted({r["budget_mib"] for r in runs})
    ax.plot(budgets, budgets, "k--", label="y = max_inflight_bytes")
    ax.plot(budgets, [2 * b for b in budgets], "k:", label="y = 2 x max_inflight_bytes")
    unb = sorted({(r["budget_mib"], r["saves"] * r["blob_mib"]) for r in runs})
    ax.scatter([u[0] for u in unb], [u[1] for u in unb], marker="x", color="grey", label="unbounded (saves x blob)")
    ax.set_xlabel("max_inflight_bytes (MiB)")
    ax.set_ylabel("peak RSS growth while stalled (MiB)")
    ax.set_title("Producer memory with every PUT stalled\n(filled: 4 x budget/blob saves, hollow: 2 x)")
    ax.legend(fontsize=7)
    bl.save_fig(fig, "memory", out_dir)


if __name__ == "__main__":
    raise SystemExit(main())

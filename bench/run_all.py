"""Run every ec-s3 benchmark, then print and save the headline ratios.

    .venv/bin/python -m bench.run_all            # full (~15 min on 2 cores)
    .venv/bin/python -m bench.run_all --quick    # ~3-4 min
    .venv/bin/python -m bench.run_all --skip-e2e --only transfer scheduler_cost

Each benchmark runs in its own process (fresh allocator, fresh SeaweedFS, no state
shared with the others) and writes ``bench/results/<name>.json`` and ``<name>.png``;
its full output goes to ``bench/results/logs/<name>.log``. This script then writes
``summary.json`` / ``summary.md`` and refreshes the results table in
``bench/README.md``. Every number is a ratio against a baseline measured in the same
run of the same benchmark (the machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl
from bench import goodput, small_ops, ttft

BENCHES = ["producer_save", "transfer", "small_ops", "scheduler_cost", "stats_cost", "prefetch", "memory",
           "gil", "promise_pickup", "poll_sockets", "gpu_check", "e2e", "ttft", "goodput", "affinity"]
# Wall-clock limits per benchmark (s): full, quick. e2e: in-process engines, then the
# served stacks (4-5 vLLM servers per blob size, ~1-2 min to load each time).
TIMEOUTS = {"producer_save": (240, 120), "transfer": (480, 180), "small_ops": (240, 120),
            "scheduler_cost": (180, 90),
            "stats_cost": (120, 60),
            "prefetch": (180, 90), "memory": (420, 120), "gil": (300, 90), "promise_pickup": (300, 120),
            "poll_sockets": (180, 120), "gpu_check": (300, 180), "e2e": (1500, 900),
            "ttft": (900, 600), "goodput": (3600, 900), "affinity": (900, 600)}
# Benchmarks that start real vLLM engines (the slowest): --skip-e2e leaves them out.
ENGINE_BENCHES = {"e2e", "ttft", "goodput", "affinity"}
# Benchmarks that may be absent (written by others): skipped with a note, reported "not measured".
OPTIONAL = {"promise_pickup"}
# Exit status 2 of gpu_check: no CUDA (a CPU dry run), reported "not run: no GPU", not a failure.
RC_OK = {"gpu_check": (0, 2)}
README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"
PERF_START, PERF_END = "<!-- perf:start -->", "<!-- perf:end -->"


def run_bench(name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    script = bl.BENCH_DIR / f"{name}.py"
    if not script.exists() and name in OPTIONAL:
        bl.log(f"=== {name}: {script.name} does not exist; skipped (reported as not measured)")
        return {"rc": 0, "elapsed_s": 0.0, "log": None, "skipped": "script absent"}
    cmd = bl.module_command(f"bench.{name}", "--out-dir", str(out_dir))
    if args.quick or name == "gpu_check":  # gpu_check: its quick preset is its GPU-time budget
        cmd.append("--quick")
    if args.no_plot:
        cmd.append("--no-plot")
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    timeout = TIMEOUTS[name][1 if args.quick else 0] * args.timeout_scale
    bl.log(f"=== {name}: {' '.join(cmd[1:])}")
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=bl.REPO)
        assert proc.stdout is not None
        try:
            deadline = started + timeout
            for line in proc.stdout:
                log.write(line)
                # progress lines and result tables; vLLM's own logging stays in the log file
                if re.match(r"^\[\d\d:\d\d:\d\d\] ", line) or line.startswith(("|", "## ")):
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
            bl.log(f"{name}: killed after {timeout:.0f} s")
    elapsed = time.monotonic() - started
    if rc in RC_OK.get(name, (0,)):
        rc = 0
    if rc != 0:
        bl.log(f"{name}: FAILED (rc={rc}); see {log_path}")
    return {"rc": rc, "elapsed_s": elapsed, "log": str(log_path)}


def load(out_dir: Path, name: str) -> dict[str, Any] | None:
    path = out_dir / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def headline(out_dir: Path) -> tuple[list[list[Any]], dict[str, Any]]:
    """Rows of (measurement, case, value, goal, met) from the result files."""
    rows: list[list[Any]] = []
    goals: dict[str, Any] = {}

    d = load(out_dir, "producer_save")
    if d:
        ok = True
        for size, r in d["sizes"].items():
            pct = r["ratio_save_to_upload"] * 100
            met = pct <= 1.0
            ok &= met
            rows.append(["1. producer: save_caches / upload time", f"{size} MiB", f"{pct:.2f}%",
                         "<= 1%", _yes(met)])
            rows.append(["1. producer: save_caches / ECExampleConnector save", f"{size} MiB",
                         f"{r['ratio_save_to_example_save']:.3f}x", "-", ""])
        goals["producer_save"] = ok

    rows.extend(small_ops.measurement_rows(load(out_dir, "small_ops")))

    d = load(out_dir, "poll_sockets")
    if d:
        for case, r in d["summary"].items():
            rows.append(["9b. promise wait: sockets per 1 s of 404 polls", case,
                         f"{r['gets']['median']:.0f} GETs, {r['connections']['median']:.0f} connections, "
                         f"{r['time_wait']['median']:.0f} TIME_WAIT; "
                         f"{r.get('ms_per_404_vs_botocore', 1.0):.2f}x botocore's ms per 404", "1 connection", ""])

    d = load(out_dir, "transfer")
    if d:
        ok = True
        for cell, r in d["summary"].items():
            for op in ("put", "get"):
                e = r[op]
                v = e.get("ec_s3_vs_best_raw")
                if v is None:
                    continue
                met = v >= 0.9
                ok &= met
                lo, hi = e.get("ec_s3_vs_best_raw_range", [v, v])
                c = e["clients"]
                cpu_ours = c["ec-s3"]["client_cpu_s_per_gib"]
                cpu_best = c[e["best_raw"]]["client_cpu_s_per_gib"]
                rows.append([f"2. transfer {op.upper()}: ec-s3 / best raw ({e['best_raw']})", cell.replace("x", " MiB x"),
                             f"{v:.2f}x [{lo:.2f}-{hi:.2f}]; CPU/GiB {cpu_ours / cpu_best:.2f}x", ">= 0.9x", _yes(met)])
        goals["transfer"] = ok

    d = load(out_dir, "scheduler_cost")
    if d:
        ok = True
        for label, s in d["summary"].items():
            if not label.startswith("ec-s3"):
                continue
            met = s["max_method_p99_us"] < 100
            ok &= met
            idle = s["per_method_us"].get("build_connector_meta@idle_step", {})
            if idle.get("n"):
                rows.append(["3. scheduler: build_connector_meta on idle steps (yields the GIL by design)", label,
                             f"p50 {idle['median']:.0f} us, p99 {idle['p99']:.0f} us", "-", ""])
            rows.append(["3. scheduler: worst method p99 (wall)", label, f"{s['max_method_p99_us']:.0f} us "
                         f"(thread CPU {s.get('max_method_thread_cpu_p99_us', float('nan')):.0f} us; "
                         f"all calls p99 {s['all_calls_us']['p99']:.0f} us, {s.get('p99_vs_0ms', float('nan')):.2f}x of 0 ms)",
                         "< 100 us", _yes(met)])
        goals["scheduler_cost"] = ok

    d = load(out_dir, "stats_cost")
    if d:
        for name, r in d["loads"].items():
            rows.append(["3. scheduler: stats call p99 (get_ec_connector_stats, every step)", name.replace("_", " "),
                         f"{r['call_us']['p99']:.0f} us (empty call {r['baseline_us']['p99']:.0f} us)",
                         f"< {d['goal_p99_us']:.0f} us", _yes(r["call_us"]["p99"] < d["goal_p99_us"])])
        goals["stats_cost"] = d["worst_p99_us"] < d["goal_p99_us"]

    d = load(out_dir, "prefetch")
    if d:
        for size, r in d["sizes"].items():
            rows.append(["4. prefetch: worker load staged / worker fetches itself", f"{size} MiB",
                         f"{r['ratio_staged_to_remote_load']:.3f}x ({r['worker_load_staged_s']['median'] * 1e3:.1f} vs "
                         f"{r['worker_load_remote_s']['median'] * 1e3:.1f} ms)", "<< 1", _yes(r["ratio_staged_to_remote_load"] < 0.5)])
            rows.append(["4. prefetch: extra time-to-scheduled / raw GET", f"{size} MiB",
                         f"{r['ratio_extra_tts_to_raw_get']:.2f}x", "~1", ""])
            if "ratio_extra_tts_spin_to_raw_get" in r:
                rows.append(["4. prefetch: same, engine loop spinning (no GIL yield)", f"{size} MiB",
                             f"{r['ratio_extra_tts_spin_to_raw_get']:.2f}x", "~1", ""])

    d = load(out_dir, "memory")
    if d:
        ok = True
        for r in d["runs"]:
            g = r["growth_vs_budget"]
            met = g <= 1.2
            if r.get("allocator", "default") == "default":
                ok &= met
            rows.append(["5. memory: peak RSS growth / max_inflight_bytes",
                         f"{r['mode']}, {r.get('allocator', 'default')} malloc, {r.get('encoder', 'cast')} encoder, "
                         f"{r.get('variant', 'in-place')}, {r['budget_mib']} MiB, {r['saves']} saves",
                         f"{g:.2f}x ({r['growth_vs_unbounded']:.2f}x of unbounded)", "<= 1.2x", _yes(met)])
        goals["memory"] = ok

    d = load(out_dir, "e2e")
    for size, r in ((d or {}).get("stack") or {}).get("sizes", {}).items():
        q = r["ratio_ecs3_vs_peer"]
        rows.append(["6. e2e stack: ec-s3 / ECExampleConnector latency via ec-s3 proxy (p50)", f"fresh {size} image",
                     f"{q['ratio']:.2f}x ({r['latency_s']['ec-s3']['median'] * 1e3:.0f} vs "
                     f"{r['latency_s']['peer']['median'] * 1e3:.0f} ms)", "<= 1.2x", _yes(q["ratio"] <= 1.2)])
        for part, v in (r.get("breakdown_s") or {}).items():
            rows.append(["6. e2e stack: critical path part (p50)", f"fresh {size} image: {part}", f"{v * 1e3:.1f} ms", "-", ""])
        if r.get("outputs_match"):
            ok = all(r["outputs_match"].values())
            rows.append(["6. e2e stack: outputs == plain (consumers' vision weights re-randomised)", size,
                         str(r["outputs_match"]), "True", _yes(ok)])
    if d and "summary" in d:
        s = d["summary"]
        runs = s["encoder_runs"]
        for kind, r in s.get("latency_ratio_by_image", {}).items():
            b = s["latency_by_image_s"]
            rows.append(["6. e2e: latency E+PD / plain (p50)", f"sequential, {kind.replace('_', ' ')}",
                         f"{r['epd_vs_plain']:.2f}x ({b['epd_sum'][kind]['median'] * 1e3:.0f} vs {b['plain'][kind]['median'] * 1e3:.0f} ms)", "-", ""])
            rows.append(["6. e2e: latency PD only / plain (p50)", f"sequential, {kind.replace('_', ' ')}",
                         f"{r['consumer_vs_plain']:.2f}x ({b['consumer'][kind]['median'] * 1e3:.0f} ms)", "-", ""])
        rows.append(["6. e2e: throughput EPD / plain", "one host / pipelined",
                     f"{s['throughput_ratio_epd_serial_vs_plain']:.2f}x / {s['throughput_ratio_epd_pipelined_vs_plain']:.2f}x", "-", ""])
        for part in ("seq", "batch"):
            rows.append(["6. e2e: encoder runs plain / producer / consumer",
                         f"{part}: {runs[part]['requests']} req, {runs[part]['distinct_images']} images",
                         f"{runs[part]['plain']} / {runs[part]['producer']} / {runs[part]['consumer']}", "consumer 0", _yes(runs[part]["consumer"] == 0)])
        rows.append(["6. e2e: consumer outputs == plain outputs (greedy)", "all", str(s["outputs_match_plain"]), "True",
                     _yes(s["outputs_match_plain"])])
    rows.extend(ttft.measurement_rows(load(out_dir, "ttft")))
    rows.extend(goodput.measurement_rows(load(out_dir, "goodput")))
    return rows, goals


# --------------------------------------------------------------------------- issue #13 goals

RAW_CLIENTS = ("boto-default", "boto-tuned", "obstore", "aiohttp")
MET, MISSED, UNMEASURED, NO_GPU = "met", "MISSED", "not measured", "not run: no GPU"


def _goal(goal: str, case: str, result: str, target: str, status: str, why: str = "") -> dict[str, str]:
    return {"goal": goal, "case": case, "result": result, "target": target, "status": status, "why": why}


def _status(ok: bool) -> str:
    return MET if ok else MISSED


def _stack(out_dir: Path) -> dict[str, Any] | None:
    d = load(out_dir, "e2e")
    return (d or {}).get("stack") if d else None


def _best_raw_s(transfer: dict[str, Any] | None, size_mib: int) -> float | None:
    """PUT + GET seconds of one ``size_mib`` blob with the fastest raw client (concurrency 1)."""
    cell = ((transfer or {}).get("summary") or {}).get(f"{size_mib}x1")
    if not cell:
        return None
    total = 0.0
    for op in ("put", "get"):
        rates = [c["mib_per_s"] for n, c in cell[op]["clients"].items() if n in RAW_CLIENTS and c.get("mib_per_s")]
        if not rates:
            return None
        total += size_mib / max(rates)
    return total


def goal_rows(out_dir: Path) -> list[dict[str, str]]:
    """One row per goal of issue #13 (and per case where a goal has several), with its
    ratio, met / MISSED / not measured, and for a miss why and what would close it."""
    rows: list[dict[str, str]] = []
    stack = _stack(out_dir)
    transfer = load(out_dir, "transfer")

    # 1. critical path
    g = "1. critical path"
    sizes = (stack or {}).get("sizes") or {}
    first = next((r for r in sizes.values() if "breakdown_s" in r), None)
    if first is None:
        why = "; ".join(f"{k}: {v}" for k, v in ((stack or {}).get("errors") or {}).items())
        rows.append(_goal(g, "fresh 4 KiB image, ec-s3 additions", "-", "<= 10 ms", UNMEASURED,
                          why or "run python -m bench.e2e (stack part)"))
    else:
        b, add = first["breakdown_s"], first["ecs3_additions_s"]
        nan = float("nan")
        parts = {"proxy hop": b["proxy hop"],
                 "producer deferral": b["producer deferral (queued -> scheduled)"]
                 - b.get("peer: producer queued -> scheduled", nan),
                 "GET": b["GET (fetch + validate)"], "hand-offs": b["scheduler hand-offs (wait - GET)"]
                 - b.get("peer: consumer queued -> scheduled", nan)}
        worst = max(parts, key=lambda k: parts[k])
        rows.append(_goal(
            g, "fresh 4 KiB image: ec-s3 additions (proxy hop + producer and consumer queue time beyond the peer's)",
            f"{add * 1e3:.1f} ms (hop {b['proxy hop'] * 1e3:.1f}, deferral {parts['producer deferral'] * 1e3:.1f}, "
            f"GET {parts['GET'] * 1e3:.1f}, other wait {parts['hand-offs'] * 1e3:.1f}; PUT {b['PUT'] * 1e3:.1f}); "
            f"E+PD {b['ec-s3 via proxy'] * 1e3:.0f} vs plain {b['plain'] * 1e3:.0f} ms",
            "<= 10 ms", _status(add <= 0.010),
            "" if add <= 0.010 else f"largest part: {worst} ({parts[worst] * 1e3:.1f} ms); "
            + _CLOSE_CRITICAL.get(worst, "")))
        for size, r in sizes.items():
            if "breakdown_s" in r:
                continue
            mib = round(r["shape"]["blob_bytes"] / bl.MiB)
            raw = _best_raw_s(transfer, mib)
            add = r["ecs3_additions_s"]
            if raw is None:
                rows.append(_goal(g, f"fresh {size} image: ec-s3 additions", f"{add * 1e3:.1f} ms",
                                  "<= 1.1x (best raw PUT + GET) + 10 ms", UNMEASURED,
                                  f"transfer.json has no {mib} MiB x1 cell for the raw clients"))
                continue
            bound = 1.1 * raw + 0.010
            rows.append(_goal(g, f"fresh {size} image: ec-s3 additions (hop from 4 KiB)",
                              f"{add * 1e3:.1f} ms vs bound {bound * 1e3:.1f} ms ({(add - 0.010) / raw:.2f}x raw PUT+GET "
                              f"{raw * 1e3:.1f} ms, + 10 ms)",
                              "<= 1.1x (best raw PUT + GET) + 10 ms", _status(add <= bound),
                              "" if add <= bound else "the consumer waits for the PUT and the GET in turn; the raw "
                              "baseline is measured alone (transfer.py), while " + _STACK_CONTENTION))
    rows.extend(_promise_pickup(out_dir))
    # 2. peer
    g = "2. peer (ECExampleConnector)"
    if not sizes:
        rows.append(_goal(g, "ec-s3 / peer latency, fresh image", "-", "<= 1.2x", UNMEASURED,
                          "run python -m bench.e2e (stack part)"))
    for size, r in sizes.items():
        q = r["ratio_ecs3_vs_peer"]
        L = r["latency_s"]
        ok = q["ratio"] <= 1.2
        pp50 = r.get("parts_p50_s", {})
        rows.append(_goal(
            g, f"ec-s3 / peer latency, fresh {size} image",
            f"{q['ratio']:.2f}x [{q.get('ratio_min', float('nan')):.2f}-{q.get('ratio_max', float('nan')):.2f}] "
            f"({L['ec-s3']['median'] * 1e3:.0f} vs {L['peer']['median'] * 1e3:.0f} ms)", "<= 1.2x", _status(ok),
            "" if ok else (f"the peer's servers queue nothing (its consumer reads a local file in the step); "
                           f"ec-s3's producer defers "
                           f"{pp50.get('producer queued -> scheduled', float('nan')) * 1e3:.0f} ms "
                           f"and its consumer waits {pp50.get('consumer wait', float('nan')) * 1e3:.0f} ms "
                           f"(PUT {pp50.get('PUT', float('nan')) * 1e3:.0f}, GET {pp50.get('GET', float('nan')) * 1e3:.0f} "
                           "ms); " + _STACK_CONTENTION)))
    # 3. transfers
    g = "3. transfers"
    if transfer is None:
        rows.append(_goal(g, "GET and PUT / best raw client", "-", ">= 0.9x, CPU/GiB <= 1.5x", UNMEASURED,
                          "run python -m bench.transfer"))
    else:
        for op in ("put", "get"):
            vals, cpus, worst = [], [], None
            for cell, r in transfer["summary"].items():
                e = r[op]
                v = e.get("ec_s3_vs_best_raw")
                if v is None:
                    continue
                c = e["clients"]
                cpu = c["ec-s3"]["client_cpu_s_per_gib"] / min(c[n]["client_cpu_s_per_gib"] for n in RAW_CLIENTS if n in c)
                vals.append(v)
                cpus.append(cpu)
                if worst is None or v < worst[1]:
                    worst = (cell, v)
            if not vals:
                continue
            ok = min(vals) >= 0.9 and max(cpus) <= 1.5
            rows.append(_goal(
                g, f"{op.upper()} / best raw client, every cell ({len(vals)})",
                f"{min(vals):.2f}-{max(vals):.2f}x; client CPU/GiB {min(cpus):.2f}-{max(cpus):.2f}x the best",
                ">= 0.9x, CPU/GiB <= 1.5x", _status(ok),
                "" if ok else f"worst cell {worst[0]} ({worst[1]:.2f}x); " + _CLOSE_TRANSFER[op]))
    # 4. GIL
    g = "4. GIL interference"
    gil = load(out_dir, "gil")
    if gil is None:
        rows.append(_goal(g, "step slowdown while ec-s3 moves data", "-", "<= 5%", UNMEASURED, "run python -m bench.gil"))
    else:
        for phase in ("upload", "download"):
            rs = [(r["size_mib"], r[phase]) for r in gil.get("sizes", []) if phase in r]
            if not rs:
                continue
            worst = max(rs, key=lambda x: x[1]["gil_cost"])
            slow = max(rs, key=lambda x: x[1]["slowdown"])
            ok = worst[1]["gil_cost"] <= 0.05
            per_gib = ", ".join(f"{m} MiB {o['step_s_lost_per_gib']:.2f} s/GiB" for m, o in rs)
            rows.append(_goal(
                g, f"Python step while ec-s3 {phase}s (1-{rs[-1][0]} MiB)",
                f"GIL cost up to {worst[1]['gil_cost'] * 100:.1f}% ({worst[0]} MiB); wall slowdown up to "
                f"{slow[1]['slowdown'] * 100:+.0f}%; step time lost {per_gib}", "GIL cost <= 5% (bench/README.md: wall time "
                "on a shared 2-core host is other processes')", _status(ok),
                "" if ok else "per request the I/O thread runs Python (signing, headers, the result hand-off), "
                "so 1 MiB blobs cost the most per GiB; bodies are read by the kernel into the destination "
                "(store/recv.py); close: fewer, larger requests, or signing and parsing outside Python"))
    # 5. memory
    g = "5. memory"
    mem = load(out_dir, "memory")
    runs = [r for r in (mem or {}).get("runs", []) if r.get("allocator", "default") == "default"]
    if not runs:
        rows.append(_goal(g, "peak RSS growth / max_inflight_bytes", "-", "<= 1.2x", UNMEASURED, "run python -m bench.memory"))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r.get("encoder", "cast"), r.get("variant", "in-place")), []).append(r)
    for (encoder, variant), group in sorted(groups.items(), key=lambda kv: (kv[0][1] != "in-place", kv[0][0])):
        hi = max(r["growth_vs_budget"] for r in group)
        lo = min(r["growth_vs_budget"] for r in group)
        ok = hi <= 1.2
        made = {"direct": "bf16 outputs made directly", "cast": "outputs cast from fp32 temporaries"}.get(encoder, encoder)
        publisher = "ec-s3 default (uploads in place)" if variant == "in-place" else "copied into pool buffers"
        why = ""
        if not ok and encoder == "cast":
            why = ("glibc keeps the encoder's freed fp32 temporaries beside the outputs in flight (1.0-1.2x with a "
                   "fixed mmap threshold; 1.0x when outputs are made directly); close: not ec-s3's memory")
        elif not ok:
            why = "the copy doubles live bytes on CPU; the pool is for pinned buffers on CUDA"
        rows.append(_goal(g, f"peak RSS growth / max_inflight_bytes, default malloc, {made}, {publisher} "
                             f"({len(group)} runs)", f"{lo:.2f}-{hi:.2f}x", "<= 1.2x", _status(ok), why))
    # 6. save_caches
    g = "6. save_caches"
    ps = load(out_dir, "producer_save")
    if ps is None:
        rows.append(_goal(g, "save_caches / upload time", "-", "<= 1%", UNMEASURED, "run python -m bench.producer_save"))
    else:
        for size, r in ps["sizes"].items():
            pct = r["ratio_save_to_upload"] * 100
            rows.append(_goal(g, f"save_caches / upload time, {size} MiB", f"{pct:.2f}%", "<= 1%", _status(pct <= 1.0),
                              "" if pct <= 1.0 else "the wake-up hands the GIL to the I/O thread inside the step; "
                              "close: fewer GIL hand-offs per step"))
    # 7. GPU
    rows.append(_gpu(out_dir))
    # 8. time to first token (issue 20): bench/ttft.py owns its goals
    rows.extend(ttft.goal_rows(load(out_dir, "ttft")))
    # 10. goodput under load (issue 26): bench/goodput.py owns its goals
    rows.extend(goodput.goal_rows(load(out_dir, "goodput")))
    return rows


_STACK_CONTENTION = (
    "in the stack 4-5 vLLM servers (each worker spins ~1 s after a step) and SeaweedFS share 2 cores, so a PUT "
    "or GET takes several times what it takes alone (4.5 KiB GET alone: ec-s3 1.24 ms, raw aiohttp 1.27 ms); "
    "close: one core per server, the store off the engines' cores"
)
_CLOSE_CRITICAL = {
    "proxy hop": "close: see bench/README.md, proxy profile",
    "producer deferral": "close: the producer must not look the bucket up before encoding a new image",
    "GET": "close: " + "one core per server in the stack (alone, a 4.5 KiB GET is 1.24 ms, raw aiohttp 1.27 ms)",
    "hand-offs": "close: poll a promised blob sooner (promise pickup) and hand staged items over in the same step",
}
_CLOSE_TRANSFER = {
    "put": "PUT is bound by SeaweedFS's CPU (12-15 server CPU-s per GiB for every client), so cells swing "
           "0.1-3x between repeats; at >= multipart_threshold_bytes ec-s3 uploads in parts, which SeaweedFS "
           "completes by copying them; close: measure against a real S3 / MinIO on other cores, raise "
           "multipart_threshold_bytes where the server completes multipart slowly",
    "get": "a blob over one part is fetched as ranged parts, the first alone (it tells the size); close: "
           "fetch every range at once when the size is known (a promise's size_bytes)",
}


def _promise_pickup(out_dir: Path) -> list[dict[str, str]]:
    """bench/promise_pickup.py: pickup delay after a promised blob becomes visible, for
    blobs that land within the dense-poll window (<= 100 ms) and over every delay."""
    g, target = "1. critical path", "<= 5 ms p90"
    case_fast = "promised blob picked up after it becomes visible (p90), visible <= 100 ms after the promise"
    case_all = "same, every delay measured (5 ms - 2 s)"
    d = load(out_dir, "promise_pickup")
    summary = d.get("summary") if isinstance(d, dict) else None
    current = summary.get("current") if isinstance(summary, dict) else None
    if not isinstance(current, dict):
        why = "run python -m bench.promise_pickup" if d is None else "promise_pickup.json has no 'current' summary"
        return [_goal(g, case_fast, "-", target, UNMEASURED, why)]
    per = current.get("per_delay_ms") or {}
    fast = [v["pickup_ms"]["p90"] for k, v in per.items() if float(k) <= 100 and "pickup_ms" in v]
    rate = (current.get("gets_per_s") or {}).get("median")
    gets_1s = ((per.get("1000") or {}).get("gets") or {}).get("median")
    cost = (f"; {rate:.0f} GET/s per waiting item (median)" if isinstance(rate, (int, float)) else "") + (
        f", {gets_1s:.0f} GETs for a 1 s wait" if isinstance(gets_1s, (int, float)) else "")
    rows = []
    if fast:
        worst = max(fast)
        rows.append(_goal(g, case_fast, f"p90 {worst:.1f} ms (worst delay){cost}", target, _status(worst <= 5.0),
                          "" if worst <= 5.0 else "2 ms polls plus one GET and a scheduler step; close: a push "
                          "from the producer (no S3 API has one)"))
    overall = (current.get("pickup_ms") or {}).get("p90")
    if isinstance(overall, (int, float)):
        dense = ((summary.get("dense") or {}).get("pickup_ms") or {}).get("p90")
        rows.append(_goal(
            g, case_all, f"p90 {overall:.1f} ms" + (f" (polling every 2 ms throughout: {dense:.1f} ms)" if dense else ""),
            target, _status(overall <= 5.0),
            "" if overall <= 5.0 else "after 100 ms the poll interval is 5% of the time waited (capped at 250 ms), "
            "so a blob is picked up within ~5% of its upload time; 5 ms at every delay needs ~200 GET/s per "
            "waiting item, or a push notification from the producer"))
    return rows


def _gpu(out_dir: Path) -> dict[str, str]:
    g, case, target = "7. GPU path", "step slowdown while publishing (device->pinned, side stream)", "<= 1.02x"
    d = load(out_dir, "gpu_check")
    if d is None or d.get("device") == "cpu":
        cpu = load(out_dir, "gpu_check_cpu")
        why = "no CUDA host here; on one: python -m bench.gpu_check --quick"
        if cpu is not None:
            rt = cpu.get("round_trips", [])
            why += (f" (CPU dry run: script ran, {sum(1 for r in rt if r.get('bit_exact'))}/{len(rt)} "
                    "round trips bit-exact; CUDA branches not exercised)")
        return _goal(g, case, "-", target, NO_GPU, why)
    slow = d.get("steps") or []
    ratios = [r["ratio"] for r in slow if isinstance(r, dict) and "ratio" in r] if isinstance(slow, list) else []
    syncs = d.get("sync_checks", [])
    rt = d.get("round_trips", [])
    sync_ok = all(r.get("ok") is not False for r in syncs)
    exact = all(r.get("bit_exact") for r in rt)
    if not ratios:
        return _goal(g, case, f"sync {'pass' if sync_ok else 'FAIL'}, round trips {'exact' if exact else 'DIFFER'}",
                     target, UNMEASURED, "gpu_check.json has no step slowdown")
    ok = max(ratios) <= 1.02 and sync_ok and exact
    return _goal(g, case, f"{min(ratios):.3f}-{max(ratios):.3f}x; no default-stream sync: {sync_ok}; "
                 f"bit-exact: {exact}", target + ", no sync, bit-exact", _status(ok),
                 "" if ok else "; ".join(d.get("problems", [])) or "see bench/results/gpu_check.json")


def goals_table(goals: list[dict[str, str]]) -> str:
    """Markdown without padding: the cells are long sentences, read in a README."""
    head = ["goal (issue #13)", "case", "result (ratio, same run)", "target", "status", "why / what would close it"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in goals:
        cells = [r["goal"], r["case"], r["result"], r["target"],
                 f"**{r['status']}**" if r["status"] == MISSED else r["status"], r["why"] or "-"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def plot_goals(goals: list[dict[str, str]], out_dir: Path) -> None:
    """One bar per goal row: met / missed / not measured."""
    plt = bl.pyplot()
    if plt is None or not goals:
        return
    colors = {MET: "C2", MISSED: "C3", UNMEASURED: "grey", NO_GPU: "lightgrey"}
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(goals) + 1))
    labels = [f"{r['goal']}: {r['case']}"[:90] for r in goals]
    ax.barh(range(len(goals)), [1] * len(goals), color=[colors.get(r["status"], "grey") for r in goals])
    for i, r in enumerate(goals):
        ax.annotate(f"{r['status']}  {r['result'][:70]}", (0.01, i), va="center", fontsize=7)
    ax.set_yticks(range(len(goals)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_title("Issue #13 goals: met (green), missed (red), not measured (grey)")
    bl.save_fig(fig, "summary", out_dir)


def _provenance(out_dir: Path, name: str) -> str:
    d = load(out_dir, name)
    if d is None and name == "gpu_check":
        name, d = "gpu_check_cpu", load(out_dir, "gpu_check_cpu")
    if not d:
        return f"{name}: missing"
    env, params = d.get("environment", {}), d.get("params", {})
    mode = "quick" if params.get("quick") or "--quick" in env.get("argv", []) else "full"
    return f"{name} {mode} {env.get('when', '?')} (load {env.get('loadavg_at_start', ['?'])[0]})"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def update_readme(md: str) -> None:
    path = bl.BENCH_DIR / "README.md"
    if not path.exists():
        return
    text = path.read_text()
    if README_START not in text or README_END not in text:
        return
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_START}\n{md}\n{README_END}{tail}")
    bl.log(f"updated {path}")


def update_perf_section(title: str, counts: dict[str, int], goals_md: str) -> None:
    """The goals table in the top-level README's Performance section (between markers)."""
    path = bl.REPO / "README.md"
    if not path.exists():
        return
    text = path.read_text()
    if PERF_START not in text or PERF_END not in text:
        bl.log(f"{path}: no {PERF_START} / {PERF_END} markers; Performance section not updated")
        return
    head, rest = text.split(PERF_START, 1)
    _, tail = rest.split(PERF_END, 1)
    body = (f"{title} ({counts[MET]} met, {counts[MISSED]} missed, {counts[UNMEASURED]} not measured, "
            f"{counts[NO_GPU]} not run: no GPU; modes, dates and load in `bench/results/summary.md`):\n\n{goals_md}")
    path.write_text(f"{head}{PERF_START}\n{body}\n{PERF_END}{tail}")
    bl.log(f"updated {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (~3-4 min)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the real-engine benchmarks (e2e, ttft, goodput: the slowest)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=None)
    parser.add_argument("--out-dir", type=Path, default=bl.RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the results table in bench/README.md")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every per-benchmark time limit")
    parser.add_argument("--summary-only", action="store_true",
                        help="run nothing: rebuild summary.md/json (and the README table) from the result files")
    args = parser.parse_args()
    names = args.only or [b for b in BENCHES if not (args.skip_e2e and b in ENGINE_BENCHES)]
    started = time.monotonic()
    runs = {} if args.summary_only else {name: run_bench(name, args, args.out_dir) for name in names}
    total = time.monotonic() - started
    rows, goals = headline(args.out_dir)
    issue = goal_rows(args.out_dir)
    cmd = "python -m bench.run_all" + (" --quick" if args.quick else "") + (" --skip-e2e" if args.skip_e2e else "")
    env = bl.environment()
    if args.summary_only:
        title = "Latest results, from the result files: " + "; ".join(_provenance(args.out_dir, b) for b in BENCHES)
    else:
        title = (f"Latest results: `.venv/bin/python {cmd}` ({'quick' if args.quick else 'full'} mode), "
                 f"{env['when']}, git {env['git']}, {env['host_cpus']} CPUs, load average at start "
                 f"{env['loadavg_at_start'][0]}; total {total / 60:.1f} min")
    counts = {st: sum(1 for r in issue if r["status"] == st) for st in (MET, MISSED, UNMEASURED, NO_GPU)}
    goals_md = goals_table(issue)
    md = (title + "\n\n### Issue #13 goals\n\n"
          + f"{counts[MET]} met, {counts[MISSED]} missed, {counts[UNMEASURED]} not measured, "
          + f"{counts[NO_GPU]} not run (no GPU); ratios are measured within one run.\n\n" + goals_md
          + "\n\n### Every measurement\n\n"
          + bl.table(["measurement", "case", "result (ratio, same run)", "goal", "met"], rows))
    print("\n" + md)
    for name, r in runs.items():
        print(f"  {name}: {'ok' if r['rc'] == 0 else 'FAILED rc=' + str(r['rc'])} in {r['elapsed_s']:.0f} s (log: {r['log']})")
    print(f"total {total / 60:.1f} min")
    (args.out_dir / "summary.md").write_text(md + "\n")
    (args.out_dir / "summary.json").write_text(json.dumps({
        "command": cmd, "environment": env, "total_s": total, "runs": runs, "goals_met": goals,
        "issue_13_goals": issue,
        "rows": [dict(zip(["measurement", "case", "result", "goal", "met"], r)) for r in rows],
    }, indent=2) + "\n")
    complete = args.summary_only or set(names) == set(BENCHES) - (ENGINE_BENCHES if args.skip_e2e else set())
    if not args.no_plot:
        plot_goals(issue, args.out_dir)
    if not args.no_readme and args.out_dir.resolve() == bl.RESULTS_DIR.resolve() and complete:
        update_readme(md)
        env_note = ("From the result files in `bench/results/`" if args.summary_only
                    else f"`python -m bench.run_all{' --quick' if args.quick else ''}`, {env['when']}, git {env['git']}")
        update_perf_section(env_note, counts, goals_md)
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

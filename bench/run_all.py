"""Run every ec-s3 benchmark, then print and save the headline ratios.

    .venv/bin/python bench/run_all.py            # full (~15 min on 2 cores)
    .venv/bin/python bench/run_all.py --quick    # ~3-4 min
    .venv/bin/python bench/run_all.py --skip-e2e --only transfer scheduler_cost

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

BENCHES = ["producer_save", "transfer", "scheduler_cost", "prefetch", "memory", "e2e"]
# Wall-clock limits per benchmark (s): full, quick.
TIMEOUTS = {"producer_save": (240, 120), "transfer": (480, 180), "scheduler_cost": (180, 90),
            "prefetch": (180, 90), "memory": (420, 120), "e2e": (420, 240)}
README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def run_bench(name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(bl.BENCH_DIR / f"{name}.py"), "--out-dir", str(out_dir)]
    if args.quick:
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
            met = g <= 1.5
            if r.get("allocator", "default") == "default":
                ok &= met
            rows.append(["5. memory: peak RSS growth / max_inflight_bytes",
                         f"{r['mode']}, {r.get('allocator', 'default')} malloc, {r['budget_mib']} MiB, {r['saves']} saves",
                         f"{g:.2f}x ({r['growth_vs_unbounded']:.2f}x of unbounded)", "~1x", _yes(met)])
        goals["memory"] = ok

    d = load(out_dir, "e2e")
    if d:
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
    return rows, goals


def _provenance(out_dir: Path, name: str) -> str:
    d = load(out_dir, name)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (~3-4 min)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the real-engine benchmark (the slowest)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=None)
    parser.add_argument("--out-dir", type=Path, default=bl.RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the results table in bench/README.md")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every per-benchmark time limit")
    parser.add_argument("--summary-only", action="store_true",
                        help="run nothing: rebuild summary.md/json (and the README table) from the result files")
    args = parser.parse_args()
    names = args.only or [b for b in BENCHES if not (args.skip_e2e and b == "e2e")]
    started = time.monotonic()
    runs = {} if args.summary_only else {name: run_bench(name, args, args.out_dir) for name in names}
    total = time.monotonic() - started
    rows, goals = headline(args.out_dir)
    cmd = "bench/run_all.py" + (" --quick" if args.quick else "") + (" --skip-e2e" if args.skip_e2e else "")
    env = bl.environment()
    if args.summary_only:
        title = "Latest results, from the result files: " + "; ".join(_provenance(args.out_dir, b) for b in BENCHES)
    else:
        title = (f"Latest results: `.venv/bin/python {cmd}` ({'quick' if args.quick else 'full'} mode), "
                 f"{env['when']}, git {env['git']}, {env['host_cpus']} CPUs, load average at start "
                 f"{env['loadavg_at_start'][0]}; total {total / 60:.1f} min")
    md = title + "\n\n" + bl.table(["measurement", "case", "result (ratio, same run)", "goal", "met"], rows)
    print("\n" + md)
    for name, r in runs.items():
        print(f"  {name}: {'ok' if r['rc'] == 0 else 'FAILED rc=' + str(r['rc'])} in {r['elapsed_s']:.0f} s (log: {r['log']})")
    print(f"total {total / 60:.1f} min")
    (args.out_dir / "summary.md").write_text(md + "\n")
    (args.out_dir / "summary.json").write_text(json.dumps({
        "command": cmd, "environment": env, "total_s": total, "runs": runs, "goals_met": goals,
        "rows": [dict(zip(["measurement", "case", "result", "goal", "met"], r)) for r in rows],
    }, indent=2) + "\n")
    complete = args.summary_only or set(names) == set(BENCHES) - ({"e2e"} if args.skip_e2e else set())
    if not args.no_readme and args.out_dir.resolve() == bl.RESULTS_DIR.resolve() and complete:
        update_readme(md)
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

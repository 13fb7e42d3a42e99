"""Run the benchmarks, then render ``summary.md`` / ``summary.json`` from their result
files, refusing any result older than the code it measured.

    .venv/bin/python -m bench.run_all                  # every benchmark, then the summary
    .venv/bin/python -m bench.run_all --quick          # small presets
    .venv/bin/python -m bench.run_all --only gil engine_cost
    .venv/bin/python -m bench.run_all --summary-only   # render from the result files as they are

Each benchmark runs in its own process (fresh allocator, fresh SeaweedFS) and writes
``bench/results/<name>.json`` with the sha256 of every file it measured
(``benchlib.measured_sources``). A result whose files no longer hash the same is left out,
``stale: <result> is older than <file>`` is printed and this script exits 1 (why hashes,
not mtimes: bench/README.md). Every figure comes from a result file through its
benchmark's ``goal_rows(d)`` (the goals table) and ``measurement_rows(d)`` (every
measurement); this script types in no number.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl

BENCHES = ["transfer", "small_ops", "engine_cost", "promise_pickup", "gil", "goodput", "affinity"]
# Wall-clock limits per benchmark (s): full, quick.
TIMEOUTS = {"transfer": (480, 180), "small_ops": (240, 120), "engine_cost": (300, 150),
            "promise_pickup": (300, 150), "gil": (300, 90), "goodput": (3600, 900), "affinity": (900, 600)}
ENGINE_BENCHES = {"goodput", "affinity"}  # starts real vLLM servers (the slowest): --skip-engines leaves it out
STATUSES = ("met", "MISSED", "not decided", "not measured")
PERF_START, PERF_END = "<!-- perf:start -->", "<!-- perf:end -->"


def run_bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One benchmark in a child process; its output goes to ``<out-dir>/logs/<name>.log``."""
    cmd = [sys.executable, "-m", f"bench.{name}", "--out-dir", str(args.out_dir), "--no-plot"]
    cmd += ["--quick"] if args.quick else []
    log_path = args.out_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timeout = TIMEOUTS[name][1 if args.quick else 0] * args.timeout_scale
    bl.log(f"=== {name}: {' '.join(cmd[1:])} (log: {log_path})")
    started = time.monotonic()
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=bl.REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    if rc != 0:
        bl.log(f"{name}: FAILED (rc={rc}{', killed after %.0f s' % timeout if rc == -9 else ''}); see {log_path}")
    return {"rc": rc, "elapsed_s": time.monotonic() - started, "log": str(log_path)}


def load(out_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def stale(name: str, d: dict[str, Any]) -> list[str]:
    """Why ``<name>.json`` is older than what it measured (empty: it is current)."""
    sources = d.get("sources")
    if not sources:
        return [f"stale: {name}.json records no source hashes (written before bench/benchlib.py recorded them)"]
    out = []
    for rel, digest in sorted(sources.items()):
        path = bl.REPO / rel
        if not path.is_file():
            out.append(f"stale: {name}.json measured {rel}, which is gone")
        elif bl.file_sha256(path) != digest:
            out.append(f"stale: {name}.json is older than {rel}")
    return out


def provenance(name: str, d: dict[str, Any]) -> str:
    env, params = d.get("environment", {}), d.get("params", {})
    mode = "quick" if params.get("quick") or "--quick" in env.get("argv", []) else "full"
    return f"`{name}` {mode}, {env.get('when', '?')}, git {env.get('git', '?')}, load {env.get('loadavg_at_start', ['?'])[0]}"


def collect(out_dir: Path, names: list[str]) -> dict[str, Any]:
    """Goal rows, measurement rows, provenance and refusals from the result files."""
    goals: list[dict[str, str]] = []
    rows: list[list[Any]] = []
    shown, refused, missing = [], [], []
    for name in names:
        d = load(out_dir, name)
        if d is None:
            missing.append(name)
            continue
        problems = stale(name, d)
        if problems:
            refused += problems
            continue
        mod = importlib.import_module(f"bench.{name}")
        goals += getattr(mod, "goal_rows", lambda _d: [])(d)
        rows += getattr(mod, "measurement_rows", lambda _d: [])(d)
        shown.append(provenance(name, d))
    return {"goals": goals, "rows": rows, "shown": shown, "refused": refused, "missing": missing}


def goals_table(goals: list[dict[str, str]]) -> str:
    """Markdown without padding: the cells are long sentences."""
    head = ["goal", "case", "result (same run)", "target", "status", "why / what would close it"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in goals:
        cells = [r["goal"], r["case"], r["result"], r["target"],
                 f"**{r['status']}**" if r["status"] == "MISSED" else r["status"], r["why"] or "-"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def render(c: dict[str, Any]) -> str:
    counts = ", ".join(f"{sum(r['status'] == s for r in c['goals'])} {s}" for s in STATUSES)
    parts = ["Rendered by `bench/run_all.py` from the result files as current as the code they measured: "
             + ("; ".join(c["shown"]) or "none") + ".",
             f"### Goals\n\n{counts}; every ratio is measured within one run.\n\n{goals_table(c['goals'])}"]
    if c["rows"]:
        parts.append("### Every measurement\n\n"
                     + bl.table(["measurement", "case", "result (same run)", "goal", "met"], c["rows"]))
    if c["refused"] or c["missing"]:
        parts.append("### Not shown\n\n" + "\n".join(f"- {m}" for m in c["refused"])
                     + "".join(f"\n- {n}: no result file (`python -m bench.{n}`)" for n in c["missing"]))
    return "\n\n".join(parts) + "\n"


def update_perf_section(goals_md: str) -> None:
    """The goals table in the top-level README, between its markers (if it has them)."""
    path = bl.REPO / "README.md"
    text = path.read_text() if path.exists() else ""
    if PERF_START in text and PERF_END in text:
        head, rest = text.split(PERF_START, 1)
        path.write_text(f"{head}{PERF_START}\n{goals_md}\n{PERF_END}{rest.split(PERF_END, 1)[1]}")
        bl.log(f"updated {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's small preset")
    parser.add_argument("--skip-engines", action="store_true", help="leave out the benchmarks that start vLLM servers")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=None)
    parser.add_argument("--out-dir", type=Path, default=bl.RESULTS_DIR)
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every per-benchmark time limit")
    parser.add_argument("--summary-only", action="store_true", help="run nothing: render from the result files")
    args = parser.parse_args()
    names = args.only or [b for b in BENCHES if not (args.skip_engines and b in ENGINE_BENCHES)]
    runs = {} if args.summary_only else {name: run_bench(name, args) for name in names}
    c = collect(args.out_dir, BENCHES)
    md = render(c)
    print(md)
    for line in c["refused"]:
        print(line, file=sys.stderr)
    (args.out_dir / "summary.md").write_text(md)
    (args.out_dir / "summary.json").write_text(json.dumps({
        "environment": bl.environment(), "runs": runs, "results": c["shown"], "refused": c["refused"],
        "missing": c["missing"], "goals": c["goals"],
        "rows": [dict(zip(["measurement", "case", "result", "goal", "met"], r)) for r in c["rows"]],
    }, indent=2, default=str) + "\n")
    if args.out_dir.resolve() == bl.RESULTS_DIR.resolve():
        update_perf_section(goals_table(c["goals"]))
    return 1 if c["refused"] or any(r["rc"] != 0 for r in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

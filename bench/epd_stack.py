"""The EPD stack as deployed, side by side with vLLM's own connector (issue #13 goals 1
and 2): real vLLM OpenAI servers, the ``ec-s3 proxy`` in front, fresh images.

Per blob size (one tiny LLaVA per size: the blob is ``image tokens x text hidden``
bf16 values, :class:`ec_s3.sandbox.tiny_model.TinyShape`) these servers are up at once:

* ``ec-s3``: an encoder (``ECS3Connector``, ``ec_producer``) and a prefill/decode
  server (``ec_consumer``) on a fresh SeaweedFS bucket, behind ``ec-s3 proxy``;
* ``peer``: the same pair with vLLM's ``ECExampleConnector`` on a local directory
  (``shared_storage_path``), behind a second ``ec-s3 proxy`` process (same code, same
  settings: the peer needs no ``ec_transfer_params``; the proxy forwards what the
  encoder answers and the peer's consumer ignores it);
* at the first size only (the critical-path breakdown): a ``plain`` server without
  a connector, and the ec-s3 pair called directly by the client (encoder, then
  prefill/decode with the encoder's ``ec_transfer_params``) to isolate the proxy hop.

Every repeat sends one fresh image down each path, the order rotated per repeat, one
request at a time with a pause between requests (``--gap-s``, default 1.2 s): a vLLM
CPU worker busy-waits ~1 s after each step and the encoders (one core) and the
prefill/decode and plain servers (the other core) share cores with their peers, so
each request starts with its cores quiet. The ec-s3 servers' ``/metrics`` are scraped
after each pause: per request (windows where a histogram counted exactly one event)
the producer's queue time (its deferral before encoding), its PUT, the consumer's
wait for the blob (queued to first scheduled: GET plus scheduler hand-offs) and GET.

Where the peer's consumer really loads the producer's outputs: at the first size the
consumer servers load after the encoders and the plain server, and the model's vision
weights are re-randomised in between (same path, so the same mm hashes): a consumer
that encoded locally would answer differently from the plain server. Outputs are
compared (greedy token ids).

Owns the stack bench; ``bench/e2e.py`` runs it (``--part stack``) and writes its
results under ``e2e.json`` -> ``stack``. Does not own the servers
(:mod:`ec_s3.sandbox.vllm_server`), the proxy, nor the chat client
(:mod:`ec_s3.demo.chat`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import benchlib as bl

# Blob sizes: name -> TinyShape keyword arguments (the 8 MiB model has one thin text
# layer: the prefill of 4096 image tokens stays well under a second on one core).
SHAPES: dict[str, dict[str, int]] = {
    "4KiB": {},
    "1MiB": {"image_size": 448, "text_hidden": 512},
    "8MiB": {"image_size": 896, "text_hidden": 1024, "text_layers": 1, "text_intermediate": 256},
}
PATHS_BREAKDOWN = ("plain", "ec-s3", "peer", "direct")
PATHS_PEER = ("ec-s3", "peer")

H_E2E = "vllm:e2e_request_latency_seconds"
H_QUEUE = "vllm:request_queue_time_seconds"
H_INFER = "vllm:request_inference_time_seconds"
H_UPLOAD = "vllm:ec_s3_upload_seconds"
H_DOWNLOAD = "vllm:ec_s3_download_seconds"
H_PROMISE = "vllm:ec_s3_promise_wait_seconds"
C_LOADED = "vllm:ec_s3_blobs_loaded_total"
C_FALLBACK = "vllm:ec_s3_fallbacks_local_total"
PROXY_ENC_S = "ec_s3_proxy_encoder_seconds_total"
PROXY_ENC_N = "ec_s3_proxy_encoder_requests_total"
# vLLM's example EPD proxy, unchanged but for a provenance comment (bench/third_party/)
VLLM_PROXY = bl.BENCH_DIR / "third_party" / "disagg_epd_proxy.py"
VLLM_PROXY_COMMIT = "7e4cd77021afa2d7298f9e6836dc789517b01925"


@dataclass
class ProxyProc:
    """A proxy in its own process and loop, as a deployment runs it: ``python -m ec_s3.proxy``
    (:meth:`start`) or any other proxy command (:meth:`spawn`)."""

    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, encoder_url: str, pd_url: str, log_path: Path, dispatch: str = "serial") -> ProxyProc:
        from ec_s3.sandbox.net import LOOPBACK, free_port

        port = free_port()
        return cls.spawn([sys.executable, "-m", "ec_s3.proxy", "--encoder-url", encoder_url, "--pd-url", pd_url,
                          "--host", LOOPBACK, "--port", str(port), "--log-level", "WARNING", "--dispatch", dispatch],
                         port, log_path, "ec-s3 proxy")

    @classmethod
    def vllm_example(cls, encoder_url: str, pd_url: str, log_path: Path) -> ProxyProc:
        """vLLM's example EPD proxy (:data:`VLLM_PROXY`) in front of one encoder and one
        prefill/decode server, with no separate prefill stage: the benches' baseline."""
        from ec_s3.sandbox.net import LOOPBACK, free_port

        port = free_port()
        return cls.spawn([sys.executable, str(VLLM_PROXY), "--host", LOOPBACK, "--port", str(port),
                          "--encode-servers-urls", encoder_url, "--prefill-servers-urls", "disable",
                          "--decode-servers-urls", pd_url], port, log_path, "vLLM's example EPD proxy")

    @classmethod
    def spawn(cls, argv: list[str], port: int, log_path: Path, what: str) -> ProxyProc:
        """Run ``argv`` (a proxy listening on loopback ``port``) until its ``/health`` answers 200."""
        from ec_s3.sandbox.net import LOOPBACK, http_get

        log = log_path.open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=bl.REPO,
                                env={**os.environ, "PYTHONPATH": str(bl.REPO)})
        log.close()
        url = f"http://{LOOPBACK}:{port}"
        deadline = time.monotonic() + 60
        while http_get(f"{url}/health", 2.0)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start; see {log_path}")
            time.sleep(0.2)
        return cls(proc, url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[float, dict[str, Any]]:
    """(seconds, JSON answer) of one POST /v1/chat/completions; raises on HTTP errors."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our loopback servers
        raw = resp.read()
    return time.perf_counter() - t0, json.loads(raw)


def _tokens(answer: dict[str, Any]) -> list[int]:
    content = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
    return [int(str(t["token"]).split(":", 1)[1]) for t in content]


def _encoder_body(body: dict[str, Any]) -> dict[str, Any]:
    """What ``ec-s3 proxy`` sends an encoder for a one-image request (media.encoder_body)."""
    from ec_s3.proxy.media import encoder_body, find_media_items

    (item,) = find_media_items(body)
    return encoder_body(body, item)


class Scraper:
    """Per-request deltas of the ec-s3 servers' histograms (one scrape per pause)."""

    def __init__(self, servers: dict[str, Any], proxy_url: str) -> None:
        self.servers = servers  # "producer"/"consumer" -> VllmServer
        self.proxy_url = proxy_url
        self.last = self._scrape()
        self.samples: dict[str, list[float]] = {}
        self.counts: dict[str, float] = {}

    def _scrape(self) -> dict[str, Any]:
        from ec_s3.sandbox.metrics import scrape_metrics

        out = {name: s.metrics() for name, s in self.servers.items()}
        out["proxy"] = scrape_metrics(f"{self.proxy_url}/metrics")
        return out

    def window(self, *, uploads_only: bool = False) -> dict[str, float]:
        """Close the window since the last call: one sample per histogram that counted
        exactly one event in it, named ``<server>:<histogram>``; counters summed.
        ``uploads_only``: the window held a text request (the final flush), not a chat
        request with an image: only the producer's upload counts. Returns this
        window's samples."""
        now = self._scrape()
        mine: dict[str, float] = {}
        plan = ((("producer", (H_UPLOAD,)),) if uploads_only else
                (("producer", (H_QUEUE, H_E2E, H_UPLOAD)),
                 ("consumer", (H_QUEUE, H_E2E, H_INFER, H_DOWNLOAD, H_PROMISE))))
        for server, hists in plan:
            a, b = now[server], self.last[server]
            for h in hists:
                n1, n0 = a.get(h + "_count"), b.get(h + "_count")
                if n1 is None or n1 - (n0 or 0.0) != 1:
                    continue
                value = a.get(h + "_sum") - (b.get(h + "_sum") or 0.0)
                self.samples.setdefault(f"{server}:{h}", []).append(value)
                mine[f"{server}:{h}"] = value
            for c in (C_LOADED, C_FALLBACK):
                v1, v0 = a.get(c), b.get(c)
                if v1 is not None:
                    self.counts[f"{server}:{c}"] = self.counts.get(f"{server}:{c}", 0.0) + v1 - (v0 or 0.0)
        self.last = now
        return mine


def run_size(size: str, repeats: int, ep: bl.Endpoint, bucket: str, work: Path, *, breakdown: bool,
             gap_s: float, max_tokens: int, seed_base: int, hop_s: float | None = None) -> dict[str, Any]:
    """One blob size; ``breakdown`` adds the plain server and the direct path (the
    proxy hop), else ``hop_s`` (measured at the first size) stands in for the hop."""
    from ec_s3.demo.chat import chat_body
    from ec_s3.sandbox.env import CPU_OFFLINE_ENV
    from ec_s3.sandbox.tiny_model import TinyShape, build_tiny_llava, reseed_vision_weights
    from ec_s3.sandbox.vllm_server import VllmServer, ec_transfer_config, start_all, stop_all, wait_all_ready

    shape = TinyShape(**SHAPES[size])
    model = str(build_tiny_llava(work / f"model-{size}", shape=shape))
    args = list(shape.server_args())
    cores = sorted(os.sched_getaffinity(0))
    enc_cores, pd_cores = [cores[-1]], [cores[0]]  # encoders on one core, PD + plain on another
    env = {**CPU_OFFLINE_ENV, **bl.BENCH_ENV, "AWS_ACCESS_KEY_ID": ep.access_key_id,
           "AWS_SECRET_ACCESS_KEY": ep.secret_access_key}
    s3_extra = {"bucket": bucket, "endpoint_url": ep.url, "prefix": f"bench-{size}"}
    peer_dir = Path(tempfile.mkdtemp(prefix=f"ecb-peer-{size}-", dir=work))
    peer_extra = {"shared_storage_path": str(peer_dir)}

    def server(name: str, role: str | None, connector: str, cpus: list[int]) -> VllmServer:
        cfg = None
        if role is not None:
            cfg = (ec_transfer_config(role, s3_extra) if connector == "ec-s3"
                   else ec_transfer_config(role, peer_extra, connector="ECExampleConnector", module_path=None))
        return VllmServer(model, name=f"{name}-{size}", args=args, env=env, ec_transfer_config=cfg, cpus=cpus,
                          log_path=work / "logs" / f"{name}-{size}.log")

    s = {
        "ec-s3 E": server("ecs3-encoder", "ec_producer", "ec-s3", enc_cores),
        "peer E": server("peer-encoder", "ec_producer", "peer", enc_cores),
        "ec-s3 PD": server("ecs3-pd", "ec_consumer", "ec-s3", pd_cores),
        "peer PD": server("peer-pd", "ec_consumer", "peer", pd_cores),
    }
    if breakdown:
        s["plain"] = server("plain", None, "", pd_cores)
    proxies: list[ProxyProc] = []
    started = time.monotonic()
    try:
        first = [v for k, v in s.items() if "PD" not in k]
        if breakdown:
            # Consumers load after the weights change: a consumer that encodes locally
            # then answers unlike the plain server (same path -> same mm hashes).
            start_all(first)
            wait_all_ready(first, 600)
            reseed_vision_weights(Path(model), seed=99)
            start_all([s["ec-s3 PD"], s["peer PD"]])
        else:
            start_all(list(s.values()))
        wait_all_ready(list(s.values()), 600)
        load_s = time.monotonic() - started
        bl.log(f"e2e stack {size}: {len(s)} servers ready in {load_s:.0f} s "
               f"(encoders on cores {enc_cores}, prefill/decode{' and plain' if breakdown else ''} on {pd_cores})")
        ecs3_proxy = ProxyProc.start(s["ec-s3 E"].url, s["ec-s3 PD"].url, work / "logs" / f"proxy-ecs3-{size}.log")
        proxies.append(ecs3_proxy)
        peer_proxy = ProxyProc.start(s["peer E"].url, s["peer PD"].url, work / "logs" / f"proxy-peer-{size}.log")
        proxies.append(peer_proxy)

        def body(seed: int) -> dict[str, Any]:
            b = chat_body(model, seed, "What is in this picture?", max_tokens=max_tokens)
            b.pop("top_logprobs", None)
            return b

        def send(path: str, seed: int) -> tuple[float, list[int]]:
            if path == "plain":
                dt, ans = _post(s["plain"].url, body(seed))
            elif path == "ec-s3":
                dt, ans = _post(ecs3_proxy.url, body(seed))
            elif path == "peer":
                dt, ans = _post(peer_proxy.url, body(seed))
            else:  # direct: the client does the proxy's job, E then PD
                b = body(seed)
                t_e, e_ans = _post(s["ec-s3 E"].url, _encoder_body(b))
                t_pd, ans = _post(s["ec-s3 PD"].url, {**b, "ec_transfer_params": e_ans.get("ec_transfer_params") or {}})
                dt = t_e + t_pd
            return dt, _tokens(ans)

        paths = PATHS_BREAKDOWN if breakdown else PATHS_PEER
        bl.log(f"e2e stack {size}: warm-up")
        for w in range(2):
            for p in paths:
                send(p, seed_base + 900 + w * 10 + paths.index(p))
                time.sleep(gap_s)
        scraper = Scraper({"producer": s["ec-s3 E"], "consumer": s["ec-s3 PD"]}, ecs3_proxy.url)
        peer_scraper = Scraper({"producer": s["peer E"], "consumer": s["peer PD"]}, peer_proxy.url)
        lat: dict[str, list[float]] = {p: [] for p in paths}
        # Client latency minus both servers' own request time, per request: what HTTP
        # and the proxy add, without the engines' step-to-step noise.
        outside: dict[str, list[float]] = {p: [] for p in paths}
        toks: dict[str, list[list[int]]] = {p: [] for p in paths}
        bl.log(f"e2e stack {size}: {repeats} repeats x {len(paths)} paths ({', '.join(paths)}), fresh images")
        for r in range(repeats):
            order = paths[r % len(paths):] + paths[: r % len(paths)]
            for p in order:
                # The direct path needs an image of its own: the same one is in the bucket by then.
                seed = seed_base + r + (5000 if p == "direct" else 0)
                dt, tk = send(p, seed)
                lat[p].append(dt)
                toks[p].append(tk)
                time.sleep(gap_s)
                # Each window holds one request of its stack: the other stack's scrape
                # only moves its starting point.
                for sc, mine in ((scraper, p in ("ec-s3", "direct")), (peer_scraper, p == "peer")):
                    if not mine:
                        sc.last = sc._scrape()
                        continue
                    w = sc.window()
                    e2e = (w.get(f"producer:{H_E2E}"), w.get(f"consumer:{H_E2E}"))
                    if None not in e2e:
                        outside[p].append(dt - e2e[0] - e2e[1])
        # The producer reports its last upload with its next engine step.
        _post(s["ec-s3 E"].url, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        time.sleep(gap_s)
        scraper.window(uploads_only=True)
        peer_files = sum(1 for _ in peer_dir.rglob("*.safetensors"))
    finally:
        for p in proxies:
            p.stop()
        stop_all(list(s.values()))
        shutil.rmtree(peer_dir, ignore_errors=True)

    med = {p: statistics.median(v) for p, v in lat.items()}
    out: dict[str, Any] = {
        "shape": {**SHAPES[size], "image_tokens": shape.num_image_tokens, "blob_bytes": shape.blob_bytes},
        "repeats": repeats, "paths": list(paths), "load_s": load_s, "gap_s": gap_s,
        "latency_s": {p: bl.summary(v) for p, v in lat.items()},
        "ratio_ecs3_vs_peer": bl.ratio_summary(lat["ec-s3"], lat["peer"]),
        "samples_s": {k: v for k, v in scraper.samples.items()},
        "parts_s": {k: bl.summary(v) for k, v in scraper.samples.items()},
        "peer_parts_s": {k: bl.summary(v) for k, v in peer_scraper.samples.items()},
        "counts": scraper.counts,
        "peer_files_written": peer_files,
        "outputs_match": {},
        "sequential_latency_s": lat,
        "outside_servers_s": {p: bl.summary(v) for p, v in outside.items() if v},
    }
    parts, peer_parts = out["parts_s"], out["peer_parts_s"]

    def p50(key: str, where: dict[str, Any] = parts) -> float:
        return where.get(key, {}).get("median", float("nan"))

    # vLLM queues a request for a few ms without any connector (the peer's queue times):
    # ec-s3's own part is what its servers queue beyond the peer's.
    deferral = p50(f"producer:{H_QUEUE}")
    wait = p50(f"consumer:{H_QUEUE}")
    get = p50(f"consumer:{H_DOWNLOAD}")
    extra = (deferral - p50(f"producer:{H_QUEUE}", peer_parts)) + (wait - p50(f"consumer:{H_QUEUE}", peer_parts))
    out["parts_p50_s"] = {
        "producer queued -> scheduled": deferral, "peer producer queued -> scheduled": p50(f"producer:{H_QUEUE}", peer_parts),
        "PUT": p50(f"producer:{H_UPLOAD}"), "consumer wait": wait, "peer consumer wait": p50(f"consumer:{H_QUEUE}", peer_parts),
        "GET": get,
    }
    if not breakdown:
        out["hop_s_from_first_size"] = hop_s
        out["ecs3_additions_s"] = (hop_s or 0.0) + extra
    if breakdown:
        out["outputs_match"] = {p: toks[p] == toks["plain"] for p in ("ec-s3", "peer")}
        # The hop: time outside both servers through the proxy minus the same without it
        # (per request, so the engines' noise cancels); the difference of the latency
        # medians is kept as a cross-check.
        if outside["ec-s3"] and outside["direct"]:
            hop = statistics.median(outside["ec-s3"]) - statistics.median(outside["direct"])
        else:
            hop = med["ec-s3"] - med["direct"]
        out["proxy_hop_latency_difference_s"] = med["ec-s3"] - med["direct"]
        out["breakdown_s"] = {
            "plain": med["plain"], "ec-s3 via proxy": med["ec-s3"], "peer via proxy": med["peer"],
            "ec-s3 direct (E then PD, no proxy)": med["direct"],
            "proxy hop": hop,
            "producer deferral (queued -> scheduled)": deferral,
            "PUT": p50(f"producer:{H_UPLOAD}"),
            "consumer wait for the blob (queued -> scheduled)": wait,
            "GET (fetch + validate)": get,
            "scheduler hand-offs (wait - GET)": wait - get,
            "peer: producer queued -> scheduled": p50(f"producer:{H_QUEUE}", peer_parts),
            "peer: consumer queued -> scheduled": p50(f"consumer:{H_QUEUE}", peer_parts),
        }
        # ec-s3's own additions on the critical path: the proxy hop, and what the
        # producer (deferral) and the consumer (wait for the blob: GET, hand-offs, the
        # PUT where it waits for it) queue beyond the peer's servers.
        out["ecs3_additions_s"] = hop + extra
    return out


def run(sizes: list[str], repeats: int, *, gap_s: float, max_tokens: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ecb-stack-"))
    (work / "logs").mkdir()
    results: dict[str, Any] = {"sizes": {}, "errors": {}}
    try:
        with bl.s3_endpoint("stack") as ep:
            bucket = bl.create_bucket(ep)
            for i, size in enumerate(sizes):
                try:
                    hop = next((r["breakdown_s"]["proxy hop"] for r in results["sizes"].values()
                                if "breakdown_s" in r), None)
                    results["sizes"][size] = run_size(size, repeats, ep, bucket, work, breakdown=i == 0,
                                                      gap_s=gap_s, max_tokens=max_tokens, seed_base=10_000 * (i + 1),
                                                      hop_s=hop)
                except Exception as exc:  # noqa: BLE001 - one size failing must not lose the others
                    bl.log(f"e2e stack {size}: FAILED: {type(exc).__name__}: {exc}")
                    results["errors"][size] = f"{type(exc).__name__}: {str(exc)[:500]}"
                    keep = bl.RESULTS_DIR / "logs" / "e2e_stack"
                    shutil.copytree(work / "logs", keep, dirs_exist_ok=True)
                    results["errors"][size] += f" (server logs: {keep})"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def print_tables(stack: dict[str, Any]) -> None:
    rows = []
    for size, r in stack["sizes"].items():
        L, q = r["latency_s"], r["ratio_ecs3_vs_peer"]
        rows.append([size, r["shape"]["image_tokens"], L["ec-s3"]["median"] * 1e3, L["peer"]["median"] * 1e3,
                     f"{q['ratio']:.2f}x [{q.get('ratio_min', float('nan')):.2f}-{q.get('ratio_max', float('nan')):.2f}]",
                     "yes" if q["ratio"] <= 1.2 else "NO", r["parts_p50_s"]["PUT"] * 1e3, r["parts_p50_s"]["GET"] * 1e3,
                     r["parts_p50_s"]["consumer wait"] * 1e3, r["ecs3_additions_s"] * 1e3])
    print(bl.table(["blob", "image tokens", "ec-s3 p50 ms", "peer p50 ms", "ec-s3 / peer", "<= 1.2x",
                    "PUT p50 ms", "GET p50 ms", "PD wait p50 ms", "ec-s3 additions ms"], rows,
                   title="EPD stack through ec-s3 proxy: ec-s3 vs ECExampleConnector (local dir), fresh images"))
    for size, r in stack["sizes"].items():
        if "breakdown_s" not in r:
            continue
        rows = [[k, v * 1e3] for k, v in r["breakdown_s"].items()]
        rows.append(["ec-s3 additions (hop + queue times beyond the peer's)", r["ecs3_additions_s"] * 1e3])
        print(bl.table(["part (median)", "ms"], rows,
                       title=f"Critical path of a fresh {size} image (outputs equal plain: {r['outputs_match']})"))
    for size, err in stack.get("errors", {}).items():
        print(f"e2e stack {size}: FAILED: {err}")


def plot(stack: dict[str, Any], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    if plt is None or not stack["sizes"]:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    sizes = list(stack["sizes"])
    for i, (path, color) in enumerate((("ec-s3", "C0"), ("peer", "C1"))):
        meds = [stack["sizes"][z]["latency_s"][path]["median"] * 1e3 for z in sizes]
        xs = [x + i * 0.4 for x in range(len(sizes))]
        a1.bar(xs, meds, 0.4, color=color, label=f"{path} via ec-s3 proxy")
    for x, z in enumerate(sizes):
        r = stack["sizes"][z]["ratio_ecs3_vs_peer"]["ratio"]
        a1.annotate(f"{r:.2f}x", (x + 0.2, stack["sizes"][z]["latency_s"]["ec-s3"]["median"] * 1e3),
                    ha="center", va="bottom", fontsize=8)
    a1.set_xticks([x + 0.2 for x in range(len(sizes))], sizes)
    a1.set_ylabel("latency p50 (ms), fresh image")
    a1.set_title("ec-s3 vs ECExampleConnector (goal <= 1.2x)")
    a1.legend(fontsize=7)
    first = next((r for r in stack["sizes"].values() if "breakdown_s" in r), None)
    if first is not None:
        names = list(first["breakdown_s"])
        vals = [first["breakdown_s"][n] * 1e3 for n in names]
        a2.barh(range(len(names)), vals, color=["grey"] * 4 + ["C3"] * (len(names) - 4))
        a2.set_yticks(range(len(names)), names, fontsize=7)
        a2.invert_yaxis()
        a2.set_xlabel("ms (median)")
        a2.set_title(f"Critical path parts; ec-s3 additions {first['ecs3_additions_s'] * 1e3:.1f} ms (goal <= 10)")
    bl.save_fig(fig, "e2e_stack", out_dir)

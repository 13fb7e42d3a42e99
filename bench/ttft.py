"""Time to first token and end-to-end latency of one streamed chat request, side by side
in one run (issue 20, items 5 and 6): where EPD pays on this host.

Paths, all serving the tiny LLaVA with :data:`~ec_s3.sandbox.tiny_model.HEAVY_VISION`
(an encoder that costs tens of milliseconds per image on one core):

* ``parallel``: ``ec-s3 proxy --dispatch parallel`` in front of an ec-s3 encoder
  (``ec_producer``) and prefill/decode server (``ec_consumer``) on a SeaweedFS bucket;
* ``serial``: a second ``ec-s3 proxy`` (``--dispatch serial``) in front of the *same*
  two servers;
* ``vllm-proxy``: vLLM's example EPD proxy (``bench/third_party/disagg_epd_proxy.py``,
  vendored unchanged: it waits for the encoders, then forwards the client's original
  request) in front of an encoder and a prefill/decode server with vLLM's
  ``ECExampleConnector`` on a shared local directory;
* ``plain``: one vLLM server without a connector, called directly.

Image sets: ``fresh`` (an image no server has seen) and ``repeated`` (an image one
encoder of the fleet already encoded and published, arriving at a prefill/decode or
plain server that has not seen it). Repeated images are made the cheapest faithful
way: just before its round, each EPD path's image is sent alone to that path's encoder
with exactly the body that path's proxy sends an encoder (ec-s3 parallel: the item
named by its content ``uuid``; serial: unnamed; vLLM's proxy: its own encoder request),
so the blob (or the peer's file) exists and the encoder has seen it, while the
prefill/decode server never has. The plain server gets a new image too (it has no
shared cache: a repeated image costs it what a fresh one does).

Every repeat sends one fresh round and one repeated round; in each round every path
gets its own image, one request at a time with a pause (``--gap-s``) so that each
request starts on quiet cores (a vLLM CPU worker busy-waits ~1 s after a step), the
path order rotated per repeat. Cores as in :mod:`bench.epd_stack`: the encoders'
workers share one core, the prefill/decode and plain servers' workers the other
(``VLLM_CPU_OMP_THREADS_BIND`` per server); all five servers are up at once, so load
hits all paths alike.

The encoder's cost inside vLLM (item 5) is measured in the same run on the ec-s3
encoder: its ``vllm:request_inference_time_seconds`` per fresh image (the encoder step)
and a producer request with an image vs one without.

Results: ``bench/results/ttft.json``; the goals (parallel / serial TTFT on fresh
images <= 0.8, repeated EPD / plain <= 0.7, parallel / vLLM's proxy <= 0.9) are rows of
``bench/results/summary.md`` (:func:`goal_rows`, called by ``bench/run_all.py``).

    python -m bench.ttft [--quick] [--repeats 12] [--max-tokens 16]

Owns this bench, its streaming client and its goal rows. Does not own the servers
(:mod:`ec_s3.sandbox.vllm_server`), the proxies (:mod:`ec_s3.proxy`, the vendored
example) nor the stack bench's helpers it reuses (:mod:`bench.epd_stack`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bench import benchlib as bl

PATHS = ("parallel", "serial", "vllm-proxy", "plain")
EPD_PATHS = ("parallel", "serial", "vllm-proxy")
SETS = ("fresh", "repeated")
H_INFER = "vllm:request_inference_time_seconds"
C_LOADED = "vllm:ec_s3_blobs_loaded_total"
C_FALLBACK = "vllm:ec_s3_fallbacks_local_total"

# (name, numerator path, numerator set, denominator path, denominator set, target): TTFT ratios of medians.
GOALS = (
    ("parallel / serial TTFT, fresh images", "parallel", "fresh", "serial", "fresh", 0.8),
    ("repeated images: EPD (parallel) / plain TTFT", "parallel", "repeated", "plain", "repeated", 0.7),
    ("parallel / vLLM proxy + ECExampleConnector TTFT, fresh images", "parallel", "fresh", "vllm-proxy", "fresh", 0.9),
)


# --------------------------------------------------------------------------- client
def stream_chat(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST a streamed chat request; seconds to the first chunk carrying content (TTFT)
    and to the end of the stream (E2E), content chunks, text, and ``error`` (None if fine)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    out: dict[str, Any] = {"ttft_s": None, "e2e_s": None, "chunks": 0, "text": "", "error": None}
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            return out
        text = []
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = json.dumps(chunk["error"])[:300]
                return out
            delta = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
            if delta:
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["chunks"] += 1
                text.append(delta)
        out["e2e_s"] = time.perf_counter() - t0
        out["text"] = "".join(text)
        if out["ttft_s"] is None:
            out["error"] = "stream ended without content"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def chat_request(model: str, seed: int, size: int, max_tokens: int) -> dict[str, Any]:
    """A streamed greedy request with one image; ``ignore_eos`` makes every answer as long."""
    from ec_s3.demo.chat import image_data_url

    return {
        "model": model, "stream": True, "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(seed, size)}},
            {"type": "text", "text": "What is in this picture?"}]}],
    }


def encoder_request(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What ``path``'s proxy sends an encoder for ``body``'s one image: repeated images are
    published with it, so each path finds its blob under the key its proxy will use."""
    from ec_s3.proxy.media import encoder_body, find_media_items
    from ec_s3.proxy.naming import name_media

    if path == "vllm-proxy":  # disagg_epd_proxy.fanout_encoder_primer, verbatim
        item = next(p for p in body["messages"][0]["content"] if p.get("type") == "image_url")
        return {"model": body["model"], "messages": [{"role": "user", "content": [item]}], "max_tokens": 1,
                "stream": False}
    named = name_media(body, give_uuids=path == "parallel")
    (item,) = find_media_items(named)
    return encoder_body(named, item)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[float, dict[str, Any]]:
    """(seconds, answer) of one non-streamed POST /v1/chat/completions."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {raw[:300]!r}")
        return time.perf_counter() - t0, json.loads(raw)
    finally:
        conn.close()


# --------------------------------------------------------------------------- ratios
def ratio_of_medians(num: list[float], den: list[float]) -> float | None:
    return statistics.median(num) / statistics.median(den) if num and den else None


def ratios(samples: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, Any]]:
    """The goals from per-set, per-path, per-metric samples (``samples[set][path]["ttft_s"]``):
    each goal's TTFT ratio of medians, its E2E ratio, target and met (None: not measured)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p_num, s_num, p_den, s_den, target in GOALS:
        num, den = samples.get(s_num, {}).get(p_num, {}), samples.get(s_den, {}).get(p_den, {})
        ttft = ratio_of_medians(num.get("ttft_s", []), den.get("ttft_s", []))
        out[name] = {"ttft_ratio": ttft, "e2e_ratio": ratio_of_medians(num.get("e2e_s", []), den.get("e2e_s", [])),
                     "target": target, "met": None if ttft is None else ttft <= target,
                     "numerator": f"{p_num} {s_num}", "denominator": f"{p_den} {s_den}",
                     "n": [len(num.get("ttft_s", [])), len(den.get("ttft_s", []))]}
    return out


def _ms(s: dict[str, Any], path: str, metric: str = "ttft_s") -> float:
    return (s.get(path) or {}).get(metric, {}).get("median", float("nan")) * 1e3


def _parts(d: dict[str, Any], st: str, p: str) -> str:
    """An ec-s3 path's median parts (its servers' histograms) in words."""
    parts = ((d.get("ecs3_parts_p50_s") or {}).get(st) or {}).get(p) or {}
    named = (("p/d queued (its wait for the blob)", "consumer:vllm:request_queue_time_seconds"),
             ("GET", "consumer:vllm:ec_s3_download_seconds"), ("PUT", "producer:vllm:ec_s3_upload_seconds"),
             ("encoder request", "producer:vllm:e2e_request_latency_seconds"))
    return ", ".join(f"{label} {parts[k] * 1e3:.0f} ms" for label, k in named if k in parts) or "no breakdown"


def _why(name: str, d: dict[str, Any]) -> str:
    """Why a goal was missed, from the same run's medians and the encoder's measured cost."""
    fresh, rep = d["latency_s"].get("fresh", {}), d["latency_s"].get("repeated", {})
    enc = (d.get("encoder_calibration") or {}).get("encoder_step_s", {}).get("median")
    enc_ms = f"{enc * 1e3:.0f} ms" if enc else "?"
    spin = ("a vLLM CPU worker busy-waits ~1 s after each step, and p/d's engine keeps stepping its worker while a "
            "request waits for a blob, so on this 2-core host both cores are held by workers (encoder computing, p/d "
            "spinning) while the encoder's front end and upload, SeaweedFS, p/d's polling GETs and the proxy need them")
    if name.startswith("parallel / serial"):
        return (f"parallel {_ms(fresh, 'parallel'):.0f} vs serial {_ms(fresh, 'serial'):.0f} ms (encoder step "
                f"{enc_ms}); parallel: {_parts(d, 'fresh', 'parallel')}; serial: {_parts(d, 'fresh', 'serial')}: "
                f"overlapped, the encoder's request is slower and p/d waits longer than it takes, because {spin}; "
                "close: a core per worker and spare cores for the front ends (any GPU host), or a consumer whose "
                "waiting request does not step its worker")
    if name.startswith("repeated"):
        return (f"plain encodes ({enc_ms} per image) and answers in {_ms(rep, 'plain'):.0f} ms; EPD "
                f"{_ms(rep, 'parallel'):.0f} ms ({_parts(d, 'repeated', 'parallel')}; serial "
                f"{_ms(rep, 'serial'):.0f} ms): the blob is in the bucket, yet {spin}; close: a core per worker and "
                "spare cores for the front ends, an encoder that costs more than a GET")
    return (f"vLLM's proxy + ECExampleConnector {_ms(fresh, 'vllm-proxy'):.0f} ms vs parallel "
            f"{_ms(fresh, 'parallel'):.0f} ms and serial {_ms(fresh, 'serial'):.0f} ms "
            f"({_parts(d, 'fresh', 'parallel')}): the peer's consumer reads a local file inside the step and never "
            f"waits; ec-s3 waits for the PUT and GETs from SeaweedFS, and {spin}; close: a core per worker and spare "
            "cores for the front ends, the store off the engines' cores")


def goal_rows(d: dict[str, Any] | None) -> list[dict[str, str]]:
    """Rows of bench/run_all.py's goals table from ``ttft.json`` (met / MISSED / not measured)."""
    g = "8. TTFT (issue 20)"
    rows: list[dict[str, str]] = []
    for name, *_rest, target in GOALS:
        r = ((d or {}).get("goals") or {}).get(name)
        if not r or r.get("ttft_ratio") is None:
            why = (d or {}).get("error") or "run python -m bench.ttft"
            rows.append({"goal": g, "case": name, "result": "-", "target": f"<= {target}", "status": "not measured",
                         "why": why})
            continue
        met = r["ttft_ratio"] <= target
        rows.append({"goal": g, "case": name,
                     "result": f"{r['ttft_ratio']:.2f}x TTFT (E2E {r['e2e_ratio']:.2f}x; n {r['n'][0]}/{r['n'][1]})",
                     "target": f"<= {target}", "status": "met" if met else "MISSED",
                     "why": "" if met else _why(name, d or {})})
    return rows


def measurement_rows(d: dict[str, Any] | None) -> list[list[Any]]:
    """Rows of bench/run_all.py's "every measurement" table: TTFT and E2E per path and set,
    and the encoder's measured cost in vLLM."""
    if not d:
        return []
    rows: list[list[Any]] = []
    for st, paths in d["latency_s"].items():
        for p, L in paths.items():
            rows.append(["8. ttft: TTFT / E2E p50 (streamed)", f"{st} images: {p}",
                         f"{_ms(paths, p):.0f} / {_ms(paths, p, 'e2e_s'):.0f} ms (n {L['ttft_s'].get('n', 0)})", "-", ""])
    c = d.get("encoder_calibration") or {}
    step = (c.get("encoder_step_s") or {}).get("median")
    if step is not None:
        shape = d["params"]["shape"]
        rows.append(["8. ttft: encoder step per image in vLLM, one core (HEAVY_VISION)",
                     f"{shape['image_size']}px, {shape['vision_layers']} CLIP layers x {shape['vision_hidden']}",
                     f"{step * 1e3:.1f} ms (producer inference time p50, n {c['encoder_step_s']['n']})", "tens of ms",
                     _yes(0.010 <= step < 0.100)])
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


# --------------------------------------------------------------------------- run
def calibrate_encoder(producer: Any, model: str, size: int, n: int, gap_s: float, seed0: int) -> dict[str, Any]:
    """The encoder's cost in vLLM on its one core: the producer's inference time per fresh
    image (the encoder step) and a producer request with an image vs one without."""
    step, image_s, text_s = [], [], []
    for i in range(n):
        before = producer.metrics()
        dt, _ = post_json(producer.url, encoder_request("serial", chat_request(model, seed0 + i, size, 1)))
        time.sleep(gap_s)
        after = producer.metrics()
        if (after.get(H_INFER + "_count") or 0) - (before.get(H_INFER + "_count") or 0) == 1:
            step.append((after.get(H_INFER + "_sum") or 0) - (before.get(H_INFER + "_sum") or 0))
        image_s.append(dt)
        try:
            dt, _ = post_json(producer.url, {"model": model, "max_tokens": 1,
                                             "messages": [{"role": "user", "content": "What is in this picture?"}]})
            text_s.append(dt)
        except (OSError, RuntimeError, ValueError) as exc:  # informative only
            bl.log(f"ttft: text-only request to the producer failed: {exc}")
        time.sleep(gap_s)
    return {"encoder_step_s": bl.summary(step), "producer_image_request_s": bl.summary(image_s),
            "producer_text_request_s": bl.summary(text_s),
            "image_minus_text_s": statistics.median(image_s) - statistics.median(text_s) if text_s else None,
            "core": producer.cores, "n": n}


def _servers(model: str, args: list[str], ep: bl.Endpoint, bucket: str, peer_dir: Path, work: Path) -> dict[str, Any]:
    from ec_s3.sandbox.env import CPU_OFFLINE_ENV
    from ec_s3.sandbox.vllm_server import VllmServer, ec_transfer_config

    cores = sorted(os.sched_getaffinity(0))
    enc, pd = [cores[-1]], [cores[0]]
    env = {**CPU_OFFLINE_ENV, **bl.BENCH_ENV, "AWS_ACCESS_KEY_ID": ep.access_key_id,
           "AWS_SECRET_ACCESS_KEY": ep.secret_access_key}
    s3 = {"bucket": bucket, "endpoint_url": ep.url, "prefix": "bench-ttft"}
    peer = {"shared_storage_path": str(peer_dir)}

    def server(name: str, cfg: dict[str, Any] | None, cpus: list[int]) -> VllmServer:
        return VllmServer(model, name=name, args=args, env=env, ec_transfer_config=cfg, cpus=cpus,
                          log_path=work / "logs" / f"{name}.log")

    peer_cfg = {r: ec_transfer_config(r, peer, connector="ECExampleConnector", module_path=None)
                for r in ("ec_producer", "ec_consumer")}
    return {
        "ec-s3 E": server("ecs3-encoder", ec_transfer_config("ec_producer", s3), enc),
        "peer E": server("peer-encoder", peer_cfg["ec_producer"], enc),
        "ec-s3 PD": server("ecs3-pd", ec_transfer_config("ec_consumer", s3), pd),
        "peer PD": server("peer-pd", peer_cfg["ec_consumer"], pd),
        "plain": server("plain", None, pd),
    }


def run(repeats: int, *, gap_s: float, max_tokens: int, calib_n: int, shape: Any) -> dict[str, Any]:
    from bench.epd_stack import VLLM_PROXY_COMMIT, ProxyProc, Scraper
    from ec_s3.sandbox.tiny_model import build_tiny_llava
    from ec_s3.sandbox.vllm_server import start_all, stop_all, wait_all_ready

    work = Path(tempfile.mkdtemp(prefix="ecb-ttft-"))
    (work / "logs").mkdir()
    model = str(build_tiny_llava(work / "model", shape=shape))
    peer_dir = Path(tempfile.mkdtemp(prefix="ecb-ttft-peer-", dir=work))
    size = shape.image_size
    proxies: list[Any] = []
    s: dict[str, Any] = {}
    try:
        with bl.s3_endpoint("ttft") as ep:
            bucket = bl.create_bucket(ep)
            s = _servers(model, list(shape.server_args()), ep, bucket, peer_dir, work)
            t0 = time.monotonic()
            start_all(list(s.values()))
            wait_all_ready(list(s.values()), 600)
            load_s = time.monotonic() - t0
            bl.log(f"ttft: 5 servers ready in {load_s:.0f} s; "
                   + ", ".join(f"{k}: {v.placement}" for k, v in s.items()))
            logs = work / "logs"
            proxies.append(ProxyProc.start(s["ec-s3 E"].url, s["ec-s3 PD"].url, logs / "proxy-parallel.log", "parallel"))
            proxies.append(ProxyProc.start(s["ec-s3 E"].url, s["ec-s3 PD"].url, logs / "proxy-serial.log", "serial"))
            proxies.append(ProxyProc.vllm_example(s["peer E"].url, s["peer PD"].url, logs / "proxy-vllm.log"))
            url = {"parallel": proxies[0].url, "serial": proxies[1].url, "vllm-proxy": proxies[2].url,
                   "plain": s["plain"].url}
            encoder = {"parallel": s["ec-s3 E"], "serial": s["ec-s3 E"], "vllm-proxy": s["peer E"]}

            bl.log(f"ttft: encoder calibration ({calib_n} images, ec-s3 encoder on core {s['ec-s3 E'].cores})")
            calib = calibrate_encoder(s["ec-s3 E"], model, size, calib_n, gap_s, seed0=900_000)
            bl.log(f"ttft: encoder step p50 {calib['encoder_step_s'].get('median', float('nan')) * 1e3:.1f} ms; "
                   f"producer request image - text {(calib['image_minus_text_s'] or float('nan')) * 1e3:.1f} ms")
            for w in range(2):  # warm-up: every path once, fresh
                for p in PATHS:
                    r = stream_chat(url[p], chat_request(model, 800_000 + 10 * w + PATHS.index(p), size, max_tokens))
                    if r["error"]:
                        raise RuntimeError(f"warm-up on {p}: {r['error']}")
                    time.sleep(gap_s)
            before = s["ec-s3 PD"].metrics()
            # Per ec-s3 request, from its servers' histograms (windows with one event):
            # producer queue and upload, consumer queue (its wait for the blob) and GET.
            scraper = Scraper({"producer": s["ec-s3 E"], "consumer": s["ec-s3 PD"]}, url["parallel"])
            parts: dict[str, dict[str, dict[str, list[float]]]] = {st: {p: {} for p in EPD_PATHS[:2]} for st in SETS}
            samples: dict[str, dict[str, dict[str, list[float]]]] = {
                st: {p: {"ttft_s": [], "e2e_s": []} for p in PATHS} for st in SETS}
            errors: list[str] = []
            bl.log(f"ttft: {repeats} repeats x {len(SETS)} sets x {len(PATHS)} paths, gap {gap_s} s")
            for r in range(repeats):
                order = PATHS[r % len(PATHS):] + PATHS[: r % len(PATHS)]
                for st in SETS:
                    seed = {p: 1_000 * (1 + SETS.index(st)) + 10 * r + PATHS.index(p) for p in PATHS}
                    bodies = {p: chat_request(model, seed[p], size, max_tokens) for p in PATHS}
                    if st == "repeated":
                        for p in EPD_PATHS:
                            post_json(encoder[p].url, encoder_request(p, bodies[p]))
                        time.sleep(gap_s)
                        scraper.last = scraper._scrape()
                    for p in order:
                        res = stream_chat(url[p], bodies[p])
                        if res["error"]:
                            errors.append(f"{st} {p} #{r}: {res['error']}")
                        else:
                            samples[st][p]["ttft_s"].append(res["ttft_s"])
                            samples[st][p]["e2e_s"].append(res["e2e_s"])
                        time.sleep(gap_s)
                        if p in parts[st]:
                            for k, v in scraper.window().items():
                                parts[st][p].setdefault(k, []).append(v)
                        else:
                            scraper.last = scraper._scrape()
                bl.log(f"ttft: repeat {r + 1}/{repeats}: " + "; ".join(
                    f"{st} " + " ".join(f"{p} {statistics.median(samples[st][p]['ttft_s']) * 1e3:.0f}"
                                        for p in PATHS if samples[st][p]['ttft_s']) for st in SETS) + " ms TTFT p50")
            after = s["ec-s3 PD"].metrics()
            consumer = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in (C_LOADED, C_FALLBACK)}
            peer_files = sum(1 for _ in peer_dir.rglob("*.safetensors"))
    finally:
        for p in proxies:
            p.stop()
        stop_all(list(s.values()))
        if os.environ.get("EC_S3_BENCH_KEEP_LOGS"):
            shutil.copytree(work / "logs", bl.RESULTS_DIR / "logs" / "ttft", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "params": {"repeats": repeats, "gap_s": gap_s, "max_tokens": max_tokens, "shape": shape,
                   "image_tokens": shape.num_image_tokens, "vllm_proxy_commit": VLLM_PROXY_COMMIT},
        "load_s": load_s, "encoder_calibration": calib,
        "latency_s": {st: {p: {m: bl.summary(v) for m, v in samples[st][p].items()} for p in PATHS} for st in SETS},
        "samples_s": samples, "goals": ratios(samples), "errors": errors,
        "ecs3_parts_p50_s": {st: {p: {k: statistics.median(v) for k, v in ks.items()} for p, ks in ps.items()}
                             for st, ps in parts.items()},
        "ecs3_consumer_counts": consumer, "peer_files_written": peer_files,
    }


def print_tables(d: dict[str, Any]) -> None:
    rows = []
    for st in SETS:
        for p in PATHS:
            L = d["latency_s"][st][p]
            rows.append([st, p, L["ttft_s"].get("median", float("nan")) * 1e3, L["ttft_s"].get("p90", float("nan")) * 1e3,
                         L["e2e_s"].get("median", float("nan")) * 1e3, L["ttft_s"].get("n", 0)])
    print(bl.table(["images", "path", "TTFT p50 ms", "TTFT p90 ms", "E2E p50 ms", "n"], rows,
                   title="Time to first token and end-to-end latency (streamed, same run)"))
    print(bl.table(["goal", "TTFT ratio", "E2E ratio", "target", "met"],
                   [[k, v["ttft_ratio"], v["e2e_ratio"], f"<= {v['target']}", v["met"]] for k, v in d["goals"].items()],
                   title="Goals (ratios of medians)"))
    c = d["encoder_calibration"]
    print(f"encoder step in vLLM (one core): p50 {c['encoder_step_s'].get('median', float('nan')) * 1e3:.1f} ms; "
          f"producer request with an image minus without: {(c['image_minus_text_s'] or float('nan')) * 1e3:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=None, help="rounds per image set (default 12, quick 4)")
    parser.add_argument("--gap-s", type=float, default=1.2, help="pause after each request (a worker spins ~1 s)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--calibration-images", type=int, default=None, help="default 8, quick 4")
    parser.add_argument("--vision-layers", type=int, default=None, help="override HEAVY_VISION's (calibration)")
    args = parser.parse_args()
    bl.setup_env()
    import dataclasses

    from ec_s3.sandbox.tiny_model import HEAVY_VISION

    shape = HEAVY_VISION if args.vision_layers is None else dataclasses.replace(HEAVY_VISION,
                                                                                 vision_layers=args.vision_layers)
    repeats = args.repeats or (4 if args.quick else 12)
    d = run(repeats, gap_s=args.gap_s, max_tokens=args.max_tokens, shape=shape,
            calib_n=args.calibration_images or (4 if args.quick else 8))
    d["params"]["quick"] = args.quick
    print_tables(d)
    bl.write_json("ttft", d, args.out_dir)
    if d["errors"]:
        print(f"{len(d['errors'])} requests failed: {d['errors'][:5]}")
    return 0 if not d["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

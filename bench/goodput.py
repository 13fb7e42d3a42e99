"""Goodput under load with vLLM's own client (issues 26 and 32): ``vllm bench serve`` over a
request-rate sweep with a TTFT SLO, plain replicas against a shared bucket and EPD
(workloads, topologies, the SLO-90 rate, result files: bench/README.md).

    python -m bench.goodput [--quick] [--workloads hot-4,hot-1] [--topologies plain-dp,shared-dp]

Owns this bench: workloads, the JSONL, driving vLLM's client, the parser of its result
JSON, the goals. Does not own the servers (:mod:`ec_s3.sandbox.vllm_server`), the
proxies (:mod:`ec_s3.proxy`, the vendored example), nor the model (:mod:`bench.costmodel`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import benchlib as bl
from bench import costmodel as cm

TOPOLOGIES = ("plain-dp", "shared-dp", "epd-parallel", "epd-serial", "vllm-epd")
SHARED = "shared-dp"
EPD_TOPOLOGIES = ("epd-parallel", "epd-serial")
KINDS = ("fresh", "zipf", "hot")
IMAGES = (1, 4)
IMAGE_TOKENS = 64  # HEAVY_VISION: 112 px / 14 px patches, squared
MAX_BATCHED_TOKENS = 512
ENCODER_CACHE_IMAGES = MAX_BATCHED_TOKENS // IMAGE_TOKENS  # vLLM: encoder_cache_size = max_num_batched_tokens
# The tiny Qwen2.5-VL (the default): a 1024x1024 photo is grid 1x70x70 = 1,225 tokens.
QWEN_PHOTO_PX = 1024
QWEN_IMAGE_TOKENS = 1225
QWEN_MAX_BATCHED_TOKENS = 4096
QWEN_CACHE_IMAGES = QWEN_MAX_BATCHED_TOKENS // QWEN_IMAGE_TOKENS
ZIPF_SET_FACTOR = 8
ZIPF_S = 1.1
HOT_SET_FACTOR = 8
HOT_REPEAT = 0.85
SLO_FRACTION = 0.9
PREFIX = "bench-goodput"  # the servers' key prefix in the bench's bucket
PROMPT = "What is in this picture?"
# Image ids: disjoint ranges per kind and, within one, per images-per-request (so that
# fresh-1 never repeats fresh-4's images, nor zipf-1 zipf-4's set), except the hot set,
# which hot-1 and hot-4 share as published; and per topology (an offset above every
# workload's range), so that none sees another's.
_ID_BASE = {"fresh": 1_000_000, "zipf": 2_000_000, "hot": 3_000_000, "hot-fresh": 4_000_000}
_IMAGES_ID_STRIDE = 100_000
_TOPOLOGY_ID_STRIDE = 10_000_000

# Counters and histograms per server role, for the run's window (sum of label series).
COUNTERS = ("vllm:ec_s3_blobs_uploaded_total", "vllm:ec_s3_uploads_already_present_total",
            "vllm:ec_s3_bytes_uploaded_total", "vllm:ec_s3_blobs_downloaded_total",
            "vllm:ec_s3_bytes_downloaded_total", "vllm:ec_s3_blobs_loaded_total", "vllm:ec_s3_fallbacks_local_total",
            "vllm:ec_s3_loads_encoded_locally_total", "vllm:ec_s3_items_encoded_total", "vllm:request_success_total",
            "vllm:prompt_tokens_total")
HISTOGRAMS = ("vllm:request_inference_time_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:ec_s3_download_seconds", "vllm:ec_s3_upload_seconds")
PROXY_ENC = "ec_s3_proxy_encoder_requests_total"

# (name, workload, target): EPD's SLO-90 rate over plain-dp's.
GOALS = (("hot, 4 images: EPD / plain-dp goodput", "hot-4", 1.3),
         ("zipf, 4 images: EPD / plain-dp goodput", "zipf-4", 1.1))
# (name, workload, target): shared-dp's SLO-90 rate over plain-dp's (issue 32), and the
# share of the cost model's bound it must reach.
SHARED_GOALS = (("hot, 4 images: shared-dp / plain-dp goodput", "hot-4", 1.5),
                ("zipf, 4 images: shared-dp / plain-dp goodput", "zipf-4", 1.2),
                ("fresh, 4 images: shared-dp / plain-dp goodput", "fresh-4", 0.95),
                ("hot, 1 image: shared-dp / plain-dp goodput", "hot-1", 1.3))
SHARED_BOUND_SHARE = 0.85


# --------------------------------------------------------------------------- workloads
def workload_name(kind: str, images: int) -> str:
    return f"{kind}-{images}"


def draw_stream(kind: str, images: int, n_requests: int, rng: random.Random, *,
                cache_images: int = ENCODER_CACHE_IMAGES, counter: dict[str, int] | None = None) -> list[list[int]]:
    """``n_requests`` requests of ``images`` image ids each (distinct within a request).
    ``counter`` carries the next fresh id per workload between segments of one stream."""
    counter = counter if counter is not None else {}

    own = _IMAGES_ID_STRIDE * images  # this workload's own range within its kind's

    def fresh(tag: str) -> int:
        counter[tag] = counter.get(tag, 0) + 1
        return _ID_BASE[tag] + own + counter[tag]

    out: list[list[int]] = []
    for _ in range(n_requests):
        req: list[int] = []
        while len(req) < images:
            if kind == "fresh":
                i = fresh("fresh")
            elif kind == "zipf":
                n = ZIPF_SET_FACTOR * cache_images
                weights = [1.0 / (r + 1) ** ZIPF_S for r in range(n)]
                i = _ID_BASE["zipf"] + own + rng.choices(range(n), weights)[0]
            elif kind == "hot":
                if rng.random() < HOT_REPEAT:
                    i = _ID_BASE["hot"] + rng.randrange(HOT_SET_FACTOR * cache_images)
                else:
                    i = fresh("hot-fresh")
            else:
                raise ValueError(f"workload kind: {kind!r} is not one of {KINDS}")
            if i not in req:
                req.append(i)
        out.append(req)
    return out


def hot_set(cache_images: int = ENCODER_CACHE_IMAGES) -> list[int]:
    """The images ``hot`` publishes before the sweep."""
    return [_ID_BASE["hot"] + i for i in range(HOT_SET_FACTOR * cache_images)]


def for_topology(stream: Sequence[Sequence[int]], topology: str) -> list[list[int]]:
    """``stream`` over ``topology``'s own images: the same draws (repeats, sizes), ids no
    other topology is sent."""
    offset = _TOPOLOGY_ID_STRIDE * (1 + TOPOLOGIES.index(topology))
    return [[offset + i for i in req] for req in stream]


def write_segment(work: Path, name: str, stream: Sequence[Sequence[int]], image_dir: Path,
                  size: int, topologies: Sequence[str] = TOPOLOGIES, photo: bool = False) -> dict[str, Path]:
    """One JSONL per topology for one segment of a workload (:func:`for_topology`)."""
    return {t: write_jsonl(work / f"{name}-{t}.jsonl", for_topology(stream, t), image_dir, size, photo=photo)
            for t in topologies}


def repeat_fraction(stream: Sequence[Sequence[int]], seen: set[int]) -> float:
    """Fraction of the images in ``stream`` already in ``seen`` (or earlier in ``stream``);
    updates ``seen``."""
    total = repeats = 0
    for req in stream:
        for i in req:
            total += 1
            repeats += i in seen
            seen.add(i)
    return repeats / total if total else 0.0


def write_jsonl(path: Path, stream: Sequence[Sequence[int]], image_dir: Path, size: int,
                prompt: str = PROMPT, photo: bool = False) -> Path:
    """vLLM's ``custom_image`` JSONL: one ``{"prompt", "image_files"}`` per request; writes
    each image once, seeded by its id: a ``size`` px PNG
    (:func:`ec_s3.sandbox.tiny_model.make_test_image`), or with ``photo`` a ``size`` px
    photo-like JPEG (:func:`ec_s3.sandbox.tiny_qwen.photo_jpeg`: what the Qwen-VL family sees)."""
    from ec_s3.sandbox.tiny_model import make_test_image
    from ec_s3.sandbox.tiny_qwen import photo_jpeg

    image_dir.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for req in stream:
            files = []
            for i in req:
                img = image_dir / f"img-{i}.{'jpg' if photo else 'png'}"
                if not img.exists():
                    if photo:
                        img.write_bytes(photo_jpeg(i, size))
                    else:
                        make_test_image(i, size).save(img, format="PNG")
                files.append(str(img))
            f.write(json.dumps({"prompt": prompt, "image_files": files}) + "\n")
    return path


# --------------------------------------------------------------------------- vLLM's client
def bench_serve_argv(*, base_url: str, model: str, dataset: Path, rate: float, n: int, slo_ms: float,
                     result_dir: Path, result_file: str, output_len: int, seed: int, concurrency: int = 0) -> list[str]:
    """``vllm bench serve``'s arguments (after ``bench serve``) for one run (``--save-detailed``:
    its result keeps each request's error)."""
    return ["--save-detailed", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base_url,
            "--model", model, "--tokenizer", model, "--dataset-name", "custom_image",
            "--dataset-path", str(dataset), "--custom-ensure-client-side-data", "--disable-shuffle",
            "--num-prompts", str(n), "--request-rate", f"{rate:g}", "--seed", str(seed),
            "--custom-output-len", str(output_len), "--ignore-eos",
            "--goodput", f"ttft:{slo_ms:g}", "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_file, *(["--max-concurrency", str(concurrency)] if concurrency else [])]


# The hot set's warm-up, one request at a time: all at once, 22 of 24 items waited past the
# proxy's 4 s encode timeout on one encoder, and prefill/decode encoded them instead.
WARM_UP = {"rate": math.inf, "slo_ms": 1e6, "output_len": 1, "seed": 0, "concurrency": 1}


class FailedRequests(RuntimeError):
    """A run in which requests failed: an error (what the server answered), never a goodput figure."""


def keep_error_bodies() -> None:
    """vLLM's chat request function keeps only a failed answer's reason phrase: here, its status and body."""
    import contextlib
    import types

    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, async_request_openai_chat_completions

    def keeping(session: Any) -> Any:
        @contextlib.asynccontextmanager
        async def post(**kw: Any) -> Any:
            async with session.post(**kw) as resp:
                if resp.status != 200:
                    resp.reason = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:1000]}"
                yield resp
        return types.SimpleNamespace(post=post)

    ASYNC_REQUEST_FUNCS["openai-chat"] = lambda request_func_input, session, pbar=None: (
        async_request_openai_chat_completions(request_func_input, keeping(session), pbar))


def run_bench_serve(argv: Sequence[str]) -> None:
    """vLLM's ``bench serve`` (its parser, its ``main``) in this process."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    keep_error_bodies()
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(list(argv)))


RESULT_KEYS = ("duration", "completed", "failed", "num_prompts", "request_rate", "request_throughput",
               "request_goodput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p50_e2el_ms",
               "p99_e2el_ms")


def parse_result(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers this bench keeps from vLLM's result JSON, plus ``good_fraction``: the
    share of the requests sent that met the SLO (``request_goodput x duration / prompts``)."""
    missing = [k for k in ("duration", "completed", "request_throughput", "p99_ttft_ms") if k not in raw]
    if missing:
        raise ValueError(f"vLLM result JSON lacks {missing} (is it a bench serve --save-result file?)")
    if raw.get("failed"):
        errors = list(dict.fromkeys(e.strip() for e in raw.get("errors") or () if e))
        raise FailedRequests(f"{raw['failed']} of {raw.get('num_prompts') or '?'} requests failed: "
                             + (" | ".join(errors[:3]) or "(no errors saved)"))
    out = {k: raw.get(k) for k in RESULT_KEYS}
    if out["p50_ttft_ms"] is None:
        out["p50_ttft_ms"] = raw.get("median_ttft_ms")
    sent = raw.get("num_prompts") or raw.get("completed") or 0
    goodput = raw.get("request_goodput")
    out["good_fraction"] = (goodput * raw["duration"] / sent) if goodput is not None and sent else None
    return out


# --------------------------------------------------------------------------- metrics
def window(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
    """Counter and histogram deltas of one server between two scrapes."""
    names = list(COUNTERS) + [h + s for h in HISTOGRAMS for s in ("_sum", "_count")] + [PROXY_ENC]
    return {name: after.get(name) - (before.get(name) or 0.0) for name in names if after.get(name) is not None}


def merge(*ws: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in ws:
        for k, v in w.items():
            out[k] = out.get(k, 0.0) + v
    return out


def counts(topo: str, d: Mapping[str, Mapping[str, float]]) -> dict[str, float | None]:
    """The per-run counts the table shows, from a topology's windows."""
    prod, cons, proxy, plain = (d.get(r) or {} for r in ("producer", "consumer", "proxy", "plain"))
    if topo == "plain-dp":
        return {"encoder requests": 0.0, **dict.fromkeys(("PUT", "GET", "bytes", "hits", "fallbacks"))}
    if topo == SHARED:  # aggregated servers: each encodes, publishes and loads
        fleet = d.get("shared") or {}
        return {"encoder requests": 0.0, "PUT": fleet.get("vllm:ec_s3_blobs_uploaded_total"),
                "GET": fleet.get("vllm:ec_s3_blobs_downloaded_total"),
                "bytes": (fleet.get("vllm:ec_s3_bytes_uploaded_total") or 0.0)
                + (fleet.get("vllm:ec_s3_bytes_downloaded_total") or 0.0),
                "hits": fleet.get("vllm:ec_s3_blobs_loaded_total"),
                "fallbacks": fleet.get("vllm:ec_s3_fallbacks_local_total"),
                "encoded": fleet.get("vllm:ec_s3_items_encoded_total")}
    enc = proxy.get(PROXY_ENC) if topo != "vllm-epd" else prod.get("vllm:request_success_total")
    return {"encoder requests": enc,
            "PUT": prod.get("vllm:ec_s3_blobs_uploaded_total"),
            "GET": cons.get("vllm:ec_s3_blobs_downloaded_total"),
            "bytes": (prod.get("vllm:ec_s3_bytes_uploaded_total") or 0.0)
            + (cons.get("vllm:ec_s3_bytes_downloaded_total") or 0.0) if topo != "vllm-epd" else None,
            "hits": cons.get("vllm:ec_s3_blobs_loaded_total"),
            "fallbacks": None if topo == "vllm-epd" else (cons.get("vllm:ec_s3_fallbacks_local_total") or 0.0)
            + (cons.get("vllm:ec_s3_loads_encoded_locally_total") or 0.0)}


def check_new_images_were_encoded(workload: str, topology: str, rate: float, stream: Sequence[Sequence[int]],
                                  repeats: float, run_counts: Mapping[str, float | None], errors: list[str]) -> None:
    """An image new to a topology must reach its encoder: fewer encoder requests than new
    images means the topology had seen them (another workload's or topology's images),
    and the run measures repeats, not what its workload says. Recorded as an error."""
    if topology not in EPD_TOPOLOGIES:
        return
    new = round((1.0 - repeats) * sum(len(r) for r in stream))
    sent = run_counts.get("encoder requests") or 0.0
    if sent < 0.9 * new:
        errors.append(f"{workload} {topology} {rate:g}: {sent:.0f} encoder requests for {new} images new to this "
                      f"topology: it had seen them before, so this run measured repeats")
        bl.log(f"goodput: {errors[-1]}")


# --------------------------------------------------------------------------- goodput and goals
def slo90_rate(points: Sequence[tuple[float, float | None]], fraction: float = SLO_FRACTION) -> dict[str, Any]:
    """The highest request rate at which >= ``fraction`` of requests met the SLO, from
    (rate, good fraction) points, interpolated linearly to the first rate that misses.
    ``bound``: "=" interpolated, ">=" every rate met (censored above), "<" none met, "~"
    not monotone: a rate missed while a higher one met (``noisy`` names them), so the
    sweep cannot tell the rate (too few requests per run) and no goal is decided on it."""
    pts = sorted((r, f) for r, f in points if f is not None)
    if not pts:
        return {"rate": None, "bound": None}
    missed = next((i for i, (_, f) in enumerate(pts) if f < fraction), None)
    if missed is None:
        return {"rate": pts[-1][0], "bound": ">="}
    met_above = [r for r, f in pts[missed + 1:] if f >= fraction]
    if met_above:
        # The rate: the highest that met, so a best-of choice picks this topology when it
        # may be the best, and its goal stays undecided.
        return {"rate": met_above[-1], "bound": "~",
                "noisy": f"missed at {pts[missed][0]:g}/s, met at {', '.join(f'{r:g}' for r in met_above)}/s"}
    if missed == 0:
        return {"rate": pts[0][0], "bound": "<"}
    (r0, f0), (r1, f1) = pts[missed - 1], pts[missed]
    return {"rate": r0 + (r1 - r0) * (f0 - fraction) / (f0 - f1), "bound": "="}


def _bounded(value: float, bound: str, unit: str) -> str | None:
    """``value`` with its censoring bound (``=`` shown bare); None for ``~`` (not monotone:
    no value to state)."""
    if bound == "~":
        return None
    return f"{bound if bound != '=' else ''}{value:.2f}{unit}"


def goodput_by_topology(runs: Sequence[Mapping[str, Any]], workload: str) -> dict[str, dict[str, Any]]:
    return {topo: slo90_rate([(r["rate"], r["vllm"]["good_fraction"]) for r in runs
                              if r["workload"] == workload and r["topology"] == topo and r.get("vllm")])
            for topo in TOPOLOGIES}


def _ratio(num: Mapping[str, Any], den: Mapping[str, Any]) -> tuple[float | None, str]:
    """Ratio of two SLO-90 rates and what the censoring allows (">=", "<=", "~")."""
    if num.get("rate") is None or den.get("rate") is None:
        return None, ""
    q = num["rate"] / den["rate"]
    nb, db = num["bound"], den["bound"]
    if nb == "=" and db == "=":
        return q, "="
    if nb in ("=", ">=") and db in ("=", "<"):
        return q, ">="
    if nb in ("=", "<") and db in ("=", ">="):
        return q, "<="
    return q, "~"


def judge(q: float | None, bound: str, need: float) -> bool | None:
    """Whether a ratio ``q`` with its censoring ``bound`` meets ``>= need``: None where
    the censoring leaves it open (a lower bound below ``need``, an upper bound above it,
    a sweep that is not monotone)."""
    if q is None or bound == "~":
        return None
    if bound == "=":
        return q >= need
    if bound == ">=":
        return True if q >= need else None
    return False if q < need else None


def goals(d: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every goal of issue 26 this bench measures, with met (None: not decidable) and why."""
    runs = d.get("runs") or []
    model = d.get("model") or {}
    out = []
    best_epd = {}
    for w in sorted({r["workload"] for r in runs}):
        g = goodput_by_topology(runs, w)
        if not any(g[t].get("rate") is not None for t in EPD_TOPOLOGIES):
            continue
        best = max(EPD_TOPOLOGIES, key=lambda t: (g[t].get("rate") or 0.0))
        best_epd[w] = (best, g)
    for name, w, target in GOALS:
        if w not in best_epd:
            out.append({"goal": name, "workload": w, "ratio": None, "bound": "", "target": f">= {target}",
                        "met": None, "why": "workload not run"})
            continue
        best, g = best_epd[w]
        q, bound = _ratio(g[best], g["plain-dp"])
        met = judge(q, bound, target)
        out.append({"goal": name, "workload": w, "ratio": q, "bound": bound, "target": f">= {target}", "met": met,
                    "epd": best, "why": "" if met else why(d, w, best)})
    for w, (best, g) in best_epd.items():
        q, bound = _ratio(g[best], g["vllm-epd"])
        met = judge(q, bound, 1.0)
        out.append({"goal": f"{w}: EPD (ec-s3) / vllm-epd goodput", "workload": w, "ratio": q, "bound": bound,
                    "target": ">= 1.0", "met": met, "epd": best, "why": "" if met else why(d, w, best, "vllm-epd")})
    out += shared_goals(d)
    for w, pred in (model.get("predicted") or {}).items():
        if w.startswith(("hot-4", "zipf-4")):
            continue
        best, g = best_epd.get(w, (None, {}))
        if best is None:
            continue
        q, bound = _ratio(g[best], g["plain-dp"])
        if q is None:
            continue
        err = q / pred["ratio"] - 1.0
        met = abs(err) <= 0.15 if bound == "=" else None
        measured = "" if bound == "~" else f"measured {bound}{q:.2f}x vs predicted {pred['ratio']:.2f}x ({err * 100:+.0f}%): "
        out.append({"goal": f"{w}: measured EPD / plain-dp within 15% of the model", "workload": w, "ratio": q,
                    "bound": bound, "target": f"{pred['ratio']:.2f} +- 15%", "met": met, "epd": best,
                    "why": "" if met else measured + why(d, w, best)})
    return out


def shared_goals(d: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 32's goals: shared-dp over plain-dp per workload, each against its target and
    against :data:`SHARED_BOUND_SHARE` of the cost model's bound, and the model within 15%."""
    runs = d.get("runs") or []
    pred = ((d.get("model") or {}).get("shared") or {}).get("predicted") or {}
    out = []
    for name, w, target in SHARED_GOALS:
        g = goodput_by_topology(runs, w)
        q, bound = _ratio(g[SHARED], g["plain-dp"])
        bound_ratio = (pred.get(w) or {}).get("ratio")
        need = max(target, SHARED_BOUND_SHARE * bound_ratio) if bound_ratio else target
        met = judge(q, bound, need)
        because = "" if met else why_shared(d, w)
        target_s = f">= {target}" + (f" and >= {SHARED_BOUND_SHARE:.0%} of the model's {bound_ratio:.2f}x"
                                     if bound_ratio else "")
        out.append({"goal": name, "workload": w, "ratio": q, "bound": bound, "target": target_s, "met": met,
                    "epd": SHARED, "why": because if runs and q is not None else "workload not run"})
        if bound_ratio and q is not None:
            err = q / bound_ratio - 1.0
            ok = abs(err) <= 0.15 if bound == "=" else None
            out.append({"goal": f"{w}: measured shared-dp / plain-dp within 15% of the model", "workload": w,
                        "ratio": q, "bound": bound, "target": f"{bound_ratio:.2f} +- 15%", "met": ok, "epd": SHARED,
                        "why": "" if ok else f"measured {q:.2f}x vs predicted {bound_ratio:.2f}x ({err * 100:+.0f}%): "
                        + why_model(runs, w, pred.get(w) or {}) + why_shared(d, w)})
    return out


def why_model(runs: Sequence[Mapping[str, Any]], w: str, pred: Mapping[str, Any]) -> str:
    """Why a measured SLO-90 ratio is not the model's: the model predicts capacity (its
    fit against the unloaded times' own ratio), while the SLO-90 rate is set by the slack
    the SLO leaves over a request's unloaded TTFT, which queueing eats."""
    low = {r["topology"]: r for r in cm.unloaded(r for r in runs if r["workload"] == w)}
    if "plain-dp" not in low or SHARED not in low or pred.get("unloaded_ratio") is None:
        return ""
    slo = low[SHARED]["slo_ttft_ms"]
    ttft = {t: (low[t].get("vllm") or {}).get("p50_ttft_ms") for t in ("plain-dp", SHARED)}
    if None in ttft.values():
        return ""
    slack = {t: f"{ttft[t]:.0f} ms at {low[t]['rate']:g}/s" for t in ttft}
    return (f"the model is a capacity ratio (the unloaded times' own ratio is {pred['unloaded_ratio']:.2f}x); the SLO-90 "
            f"rate is where queueing eats the SLO's slack over a request's unloaded TTFT ({slo:g} ms SLO; TTFT p50 "
            f"plain-dp {slack['plain-dp']}, shared-dp {slack[SHARED]}), so its ratio is steeper than capacity's where "
            f"one side starts near the SLO, and flatter where both have room; ")


def why_shared(d: Mapping[str, Any], w: str) -> str:
    """What shared-dp's servers did on workload ``w``, per request, over its runs."""
    rs = [r for r in d.get("runs") or [] if r["workload"] == w and r["topology"] == SHARED]
    ps = [r for r in d.get("runs") or [] if r["workload"] == w and r["topology"] == "plain-dp"]
    if not rs or not ps:
        return "not measured"
    fleet = merge(*((r.get("deltas") or {}).get("shared") or {} for r in rs))
    plain = merge(*((r.get("deltas") or {}).get("plain") or {} for r in ps))
    n = fleet.get("vllm:request_inference_time_seconds_count") or 0.0
    n_plain = plain.get("vllm:request_inference_time_seconds_count") or 0.0
    if not n or not n_plain:
        return "no metrics"
    k = rs[0]["images"]
    inf = (fleet.get("vllm:request_inference_time_seconds_sum") or 0.0) / n * 1e3
    inf_plain = (plain.get("vllm:request_inference_time_seconds_sum") or 0.0) / n_plain * 1e3
    repeats = sum(r["repeat_fraction"] for r in rs) / len(rs)
    return (f"over {n:.0f} requests of {k} images ({repeats:.0%} repeats): shared-dp encoded "
            f"{(fleet.get('vllm:ec_s3_items_encoded_total') or 0.0) / n:.2f} items, GET "
            f"{(fleet.get('vllm:ec_s3_blobs_downloaded_total') or 0.0) / n:.2f}, loaded "
            f"{(fleet.get('vllm:ec_s3_blobs_loaded_total') or 0.0) / n:.2f}, PUT "
            f"{(fleet.get('vllm:ec_s3_blobs_uploaded_total') or 0.0) / n:.2f} per request; inference "
            f"{inf:.0f} ms per request vs plain-dp's {inf_plain:.0f} ms")


def verdict(g: Mapping[str, Mapping[str, Any]], pred: Mapping[str, Any]) -> str:
    """Whether the measurement agrees with the model's "should win": yes / NO / undecided."""
    if not pred or not any(g[t].get("rate") is not None for t in EPD_TOPOLOGIES):
        return "-"
    best = max(EPD_TOPOLOGIES, key=lambda t: (g[t].get("rate") or 0.0))
    q, bound = _ratio(g[best], g["plain-dp"])
    if q is None or bound == "~":
        return "undecided"
    won = q > 1.0 if bound in ("=", ">=") else (False if q <= 1.0 else None)
    lost = q <= 1.0 if bound in ("=", "<=") else None
    if pred["should_win"]:
        return "yes" if won else ("NO" if lost else "undecided")
    return "yes" if lost else ("NO" if won else "undecided")


def why(d: Mapping[str, Any], w: str, epd: str, other: str = "plain-dp") -> str:
    """What the servers' metrics show took the time, for a goal on workload ``w``."""
    runs = [r for r in d.get("runs") or [] if r["workload"] == w]
    g = goodput_by_topology(runs, w)
    censored = ""
    if g[epd].get("bound") == ">=" and g[other].get("bound") == ">=":
        censored = (f"not decided: {epd} and {other} both met the SLO for 90% at every swept rate (up to "
                    f"{g[other]['rate']:g}/s): sweep higher rates (--rates-1/--rates-4); ")
    elif g[epd].get("bound") == "<" and g[other].get("bound") == "<":
        censored = f"not decided: {epd} and {other} both missed at the lowest rate swept: sweep lower rates; "
    noisy = [f"{t} {g[t]['noisy']}" for t in (epd, other) if g[t].get("bound") == "~"]
    if noisy:
        censored = (f"not decided: the sweep is not monotone ({'; '.join(noisy)}): too few requests per run to "
                    f"tell the rate; rerun with more --seconds per rate; ")
    pick = {t: [r for r in runs if r["topology"] == t] for t in (epd, other)}
    if not pick[epd] or not pick[other]:
        return "not measured"
    hi = {t: max(v, key=lambda r: r["rate"]) for t, v in pick.items()}
    e, o = hi[epd], hi[other]
    de = e.get("deltas") or {}

    def per(role: str, h: str, run: Mapping[str, Any]) -> float:
        dd = (run.get("deltas") or {}).get(role) or {}
        n = dd.get(h + "_count") or 0
        return (dd.get(h + "_sum") or 0.0) / n * 1e3 if n else float("nan")

    c = e.get("counts") or {}
    model = (d.get("model") or {}).get("costs_s") or {}
    rule = ((d.get("model") or {}).get("predicted") or {}).get(w, {}).get("why", "")
    return censored + (f"at {e['rate']:g} req/s: {epd} p99 TTFT {e['vllm']['p99_ttft_ms']:.0f} ms vs {other} "
            f"{o['vllm']['p99_ttft_ms']:.0f} ms; {epd} encoder inference {per('producer', HISTOGRAMS[0], e):.0f} ms "
            f"and queue {per('producer', HISTOGRAMS[2], e):.0f} ms per encoder request, p/d inference "
            f"{per('consumer', HISTOGRAMS[0], e):.0f} ms and queue (its wait for blobs) "
            f"{per('consumer', HISTOGRAMS[2], e):.0f} ms per request; {c.get('encoder requests')} encoder requests, "
            f"{c.get('GET')} GETs, {c.get('hits')} loads, {c.get('fallbacks')} local fallbacks"
            + (f"; model (E {model.get('E', 0) * 1e3:.0f} ms/image, P0 {model.get('P0', 0) * 1e3:.0f} ms): {rule}"
               if rule else "") + ("" if de else " (no metrics)"))


def goal_rows(d: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """Rows of bench/run_all.py's goals table from ``goodput.json``."""
    g = "10. goodput (issue 26)"
    if d and d.get("runs"):
        # Judged again from the runs by this code, so a rule changed since the run (a
        # sweep that is not monotone decides nothing) shows in the committed summary.
        d = {**d, "goals": goals(d)}
    if not d or not d.get("goals"):
        return [{"goal": g, "case": name, "result": "-", "target": f">= {t}", "status": "not measured",
                 "why": (d or {}).get("error") or "run python -m bench.goodput"} for name, _w, t in GOALS]
    rows = []
    for r in d["goals"]:
        # "~": nothing to state; the why says why.
        res = "-" if r["ratio"] is None else f"{_bounded(r['ratio'], r['bound'], 'x') or '-'} ({r.get('epd')})"
        status = {True: "met", False: "MISSED", None: "not decided"}[r["met"]]
        rows.append({"goal": g, "case": r["goal"], "result": res, "target": r["target"], "status": status,
                     "why": r["why"]})
    return rows


def measurement_rows(d: Mapping[str, Any] | None) -> list[list[Any]]:
    """Rows of run_all's "every measurement" table: SLO-90 rate per workload and topology."""
    if not d or not d.get("runs"):
        return []
    rows = []
    for w in sorted({r["workload"] for r in d["runs"]}):
        for t, g in goodput_by_topology(d["runs"], w).items():
            if g["rate"] is not None:
                result = _bounded(g["rate"], g["bound"], " req/s") or f"not monotone ({g['noisy']})"
                rows.append(["10. goodput: highest rate with >= 90% TTFT SLO", f"{w}: {t}", result, "-", ""])
    return rows


# --------------------------------------------------------------------------- the stack
@dataclasses.dataclass(frozen=True)
class Served:
    """The model a run serves and what follows from it: image size, tokens per image,
    the servers' token budget and so vLLM's encoder cache (in images)."""

    name: str  # "qwen" (the default: the family EPD serves) or "llava"
    image_px: int
    image_tokens: int
    max_batched_tokens: int
    photo: bool  # photo-like JPEGs (Qwen) or synthetic PNGs (LLaVA)

    @property
    def cache_images(self) -> int:
        return self.max_batched_tokens // self.image_tokens

    def server_args(self, dtype: str) -> list[str]:
        """Room for 4 images per request, no prefix caching, weights in ``dtype``."""
        max_len = max(self.max_batched_tokens, max(IMAGES) * self.image_tokens + 256)
        return ["--max-model-len", str(max_len), "--max-num-batched-tokens", str(self.max_batched_tokens),
                "--enforce-eager", "--limit-mm-per-prompt", json.dumps({"image": max(IMAGES)}),
                "--no-enable-prefix-caching", "--dtype", dtype]


SERVED = {"qwen": Served("qwen", QWEN_PHOTO_PX, QWEN_IMAGE_TOKENS, QWEN_MAX_BATCHED_TOKENS, photo=True),
          "llava": Served("llava", 112, IMAGE_TOKENS, MAX_BATCHED_TOKENS, photo=False)}


def start_stack(model: str, served: Served, ep: bl.Endpoint, bucket: str, work: Path,
                topologies: Sequence[str] = TOPOLOGIES,
                shared_proxy_args: Sequence[str] = (), dtype: str = "bfloat16") -> tuple[dict[str, Any], dict[str, Any]]:
    """The servers and proxies of ``topologies`` (two plain; two ec_both; ec-s3 E + PD;
    peer E + PD); returns (servers, {topology: url}) with ``servers["_proxies"]`` the
    proxy processes."""
    from bench.epd_stack import ProxyProc
    from ec_s3.sandbox.env import CPU_OFFLINE_ENV
    from ec_s3.transfer.fsutil import ensure_private_dir
    from ec_s3.sandbox.vllm_server import VllmServer, ec_transfer_config, start_all, wait_all_ready

    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = [cores[0]], [cores[-1]]
    env = {**CPU_OFFLINE_ENV, **bl.BENCH_ENV, "AWS_ACCESS_KEY_ID": ep.access_key_id,
           "AWS_SECRET_ACCESS_KEY": ep.secret_access_key}
    s3 = {"bucket": bucket, "endpoint_url": ep.url, "prefix": PREFIX}
    peer = {"shared_storage_path": str(work / "peer")}
    args = served.server_args(dtype)
    logs = work / "logs"

    def server(name: str, cfg: dict[str, Any] | None, cpus: list[int]) -> VllmServer:
        return VllmServer(model, name=name, args=args, env=env, ec_transfer_config=cfg, cpus=cpus,
                          log_path=logs / f"{name}.log")

    want = set(topologies)
    s: dict[str, Any] = {}
    if "plain-dp" in want:
        s |= {"plain A": server("plain-a", None, c0), "plain B": server("plain-b", None, c1)}
    if SHARED in want:
        # Each its own staging area: two engines on one host, as on two hosts.
        s |= {f"shared {n}": server(f"shared-{n.lower()}", ec_transfer_config(
            "ec_both", {**s3, "staging_dir": str(ensure_private_dir(work / f"staging-{n.lower()}", key="staging_dir"))}),
            cpus)
            for n, cpus in (("A", c0), ("B", c1))}
    if want & set(EPD_TOPOLOGIES):
        s |= {"ec-s3 E": server("ecs3-encoder", ec_transfer_config("ec_producer", s3), c1),
              "ec-s3 PD": server("ecs3-pd", ec_transfer_config("ec_consumer", s3), c0)}
    if "vllm-epd" in want:
        s |= {"peer E": server("peer-encoder", ec_transfer_config("ec_producer", peer, connector="ECExampleConnector",
                                                                  module_path=None), c1),
              "peer PD": server("peer-pd", ec_transfer_config("ec_consumer", peer, connector="ECExampleConnector",
                                                              module_path=None), c0)}
    servers = list(s.values())
    proxies: list[Any] = []
    s["_proxies"] = proxies
    start_all(servers)
    t0 = time.monotonic()
    wait_all_ready(servers, 900)
    bl.log(f"goodput: {len(servers)} servers ready in {time.monotonic() - t0:.0f} s")

    def dp_proxy(a: str, b: str, name: str, extra: Sequence[str] = ()) -> Any:
        return ProxyProc.start(["--pd-url", s[a].url, "--pd-url", s[b].url, *extra], logs / f"proxy-{name}.log",
                               f"ec-s3 proxy ({name}, no encoder)")

    urls: dict[str, str] = {}
    for topo in topologies:
        if topo == "plain-dp":  # the baseline of issue 26's runs: each request to the less busy server
            proxy = dp_proxy("plain A", "plain B", "plain", ("--route", "least-loaded"))
        elif topo == SHARED:
            proxy = dp_proxy("shared A", "shared B", "shared", shared_proxy_args)
        elif topo == "vllm-epd":
            proxy = ProxyProc.vllm_example(s["peer E"].url, s["peer PD"].url, logs / "proxy-vllm.log")
        else:
            dispatch = topo.removeprefix("epd-")
            proxy = ProxyProc.start(["--encoder-url", s["ec-s3 E"].url, "--pd-url", s["ec-s3 PD"].url, "--dispatch",
                                     dispatch], logs / f"proxy-{dispatch}.log")
        proxies.append(proxy)
        urls[topo] = proxy.url
    return s, urls


# A topology's servers: {role in the windows: name in start_stack's servers}.
SERVERS = {"plain-dp": {"plain A": "plain A", "plain B": "plain B"},
           SHARED: {"shared A": "shared A", "shared B": "shared B"},
           "vllm-epd": {"producer": "peer E", "consumer": "peer PD"}}
EC_S3_SERVERS = {"producer": "ec-s3 E", "consumer": "ec-s3 PD"}


def scrape(s: Mapping[str, Any], urls: Mapping[str, str], topo: str) -> dict[str, Any]:
    """One scrape of a topology's servers and proxy, by role."""
    from ec_s3.sandbox.metrics import scrape_metrics

    out = {role: s[name].metrics() for role, name in SERVERS.get(topo, EC_S3_SERVERS).items()}
    out["proxy"] = scrape_metrics(f"{urls[topo]}/metrics")
    return out


def settle_uploads(store: Any, s: Mapping[str, Any], topo: str, model: str, timeout_s: float = 60.0) -> int:
    """Lets a run's uploads land in its own window, not the next run's (issue 32): waits
    until the bucket's object count holds still for a second, then sends each of the
    topology's ec-s3 servers a 1-token text request. That request is an engine step, and
    vLLM collects a connector's counters only in a step: an idle server's ``/metrics``
    would hold the worker's uploads back until the next run. Returns the object count."""
    import urllib.request

    async def count() -> int:
        return sum([1 async for _ in store.list_async(store.config.prefix)])

    last, still_since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = store.run(count(), timeout=30)
        if n != last:
            last, still_since = n, time.monotonic()
        elif time.monotonic() - still_since >= 1.0:
            break
        time.sleep(0.25)
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    for name in SERVERS.get(topo, EC_S3_SERVERS).values():
        req = urllib.request.Request(f"{s[name].url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    return last


def deltas(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    out = {role: window(before[role], after[role]) for role in before}
    for fleet in ("plain", "shared"):
        if f"{fleet} A" in out:
            out[fleet] = merge(out.pop(f"{fleet} A"), out.pop(f"{fleet} B"))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ec_s3.sandbox.tiny_model import HEAVY_VISION, build_tiny_llava
    from ec_s3.sandbox.tiny_qwen import build_tiny_qwen
    from ec_s3.sandbox.vllm_server import stop_all

    served = SERVED[args.model]
    assert HEAVY_VISION.num_image_tokens == IMAGE_TOKENS, "IMAGE_TOKENS follows HEAVY_VISION"
    work = Path(tempfile.mkdtemp(prefix="ecb-goodput-"))
    for sub in ("logs", "peer"):
        (work / sub).mkdir()
    model = str(build_tiny_qwen(work / "model") if served.name == "qwen"
                else build_tiny_llava(work / "model", shape=HEAVY_VISION))
    sweep = Sweep(args=args, served=served, model=model, work=work, t_start=time.monotonic())
    load_s: list[float] = []
    try:
        with bl.s3_endpoint("goodput") as ep:
            bucket = bl.create_bucket(ep)
            from ec_s3.store.client import S3Store

            sweep.store = S3Store(ep.config(bucket, prefix=PREFIX))
            for pass_no, topologies in enumerate(args.passes):
                t0 = time.monotonic()
                # Each pass its share of --max-minutes, so that a slow first pass leaves the next its turn.
                sweep.deadline = t0 + args.max_minutes * 60 / len(args.passes) if args.max_minutes else math.inf
                s: dict[str, Any] = {}
                try:
                    s, urls = start_stack(model, served, ep, bucket, work, topologies, args.shared_proxy_args, args.dtype)
                    load_s.append(time.monotonic() - t0)
                    sweep.run_pass(pass_no, topologies, s, urls)
                except (TimeoutError, FailedRequests) as exc:  # its time is spent, or the warm-up failed
                    sweep.errors.append(f"pass {pass_no + 1} ({','.join(topologies)}): {exc}")
                finally:  # the pass's proxies, then its servers
                    for p in s.get("_proxies", []):
                        p.stop()
                    stop_all([v for k, v in s.items() if not k.startswith("_")])
    finally:
        if sweep.store is not None:
            sweep.store.close()
        if os.environ.get("EC_S3_BENCH_KEEP_LOGS"):
            keep = (args.out_dir or bl.RESULTS_DIR) / "logs" / "goodput"
            shutil.copytree(work / "logs", keep, dirs_exist_ok=True)
            if (work / "results").exists():  # vLLM's own result files
                shutil.copytree(work / "results", keep / "vllm-results", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    cache = served.cache_images
    d: dict[str, Any] = {
        "params": {"quick": args.quick, "rates": sweep.rates, "slo_ttft_ms": sweep.slo, "output_len": args.output_len,
                   "seconds_per_run": args.seconds, "min_requests": args.min_requests, "kinds": args.kinds,
                   "workloads": args.workloads, "full_sweep": args.full_sweep, "refine": args.refine, "extend": args.extend,
                   "model": dataclasses.asdict(served), "passes": [list(p) for p in args.passes],
                   "topologies": [t for p in args.passes for t in p],
                   "shared_proxy_args": list(args.shared_proxy_args), "image_tokens": served.image_tokens,
                   "encoder_cache_images": cache, "zipf_set": ZIPF_SET_FACTOR * cache,
                   "zipf_s": ZIPF_S, "hot_set": HOT_SET_FACTOR * cache, "hot_repeat": HOT_REPEAT,
                   "slo_fraction": SLO_FRACTION, "dtype": args.dtype},
        "load_s": load_s, "elapsed_s": time.monotonic() - sweep.t_start, "runs": sweep.runs, "errors": sweep.errors,
    }
    d["model"] = model_section(sweep.runs)
    d["goals"] = goals(d)
    return d


@dataclasses.dataclass
class Sweep:
    """The runs of one bench: per pass (a set of topologies up at once), the hot set
    published, then the rate sweep interleaved across topologies, then ``--refine``
    rounds of bisection. Every topology of a pass gets the same draws per (workload, rate)."""

    args: argparse.Namespace
    served: Served
    model: str
    work: Path
    t_start: float
    store: Any = None  # the bucket's S3Store, to wait for uploads (settle_uploads)
    uploads: tuple[str, ...] = (SHARED, *EPD_TOPOLOGIES)  # the topologies that upload to it
    deadline: float = math.inf  # this pass's end (its share of --max-minutes)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        self.rates = {1: self.args.rates_1, 4: self.args.rates_4}
        self.slo = {1: self.args.slo_ms_1, 4: self.args.slo_ms_4}
        self.rng = {w: random.Random(f"goodput-{w}") for w, _, _ in self.workloads()}
        self.fresh_ids: dict[str, dict[str, int]] = {}
        self.streams: dict[tuple[str, float, int], list[list[int]]] = {}

    def workloads(self) -> list[tuple[str, str, int]]:
        """(name, kind, images) of every workload this bench runs, in sweep order."""
        a = self.args
        return [(workload_name(kind, k), kind, k) for kind in a.kinds for k in a.images
                if not a.workloads or workload_name(kind, k) in a.workloads]

    def run_pass(self, pass_no: int, topologies: Sequence[str], s: Mapping[str, Any], urls: Mapping[str, str]) -> None:
        hot = hot_set(self.served.cache_images)
        if "hot" in self.args.kinds:
            # Publish the hot set: one earlier request per 4 images through every topology.
            paths = write_segment(self.work, f"hot-warm-p{pass_no}", [hot[i:i + 4] for i in range(0, len(hot), 4)],
                                  self.work / "images", self.served.image_px, topologies, self.served.photo)
            for t in topologies:
                run_bench_serve(bench_serve_argv(base_url=urls[t], model=self.model, dataset=paths[t], n=len(hot) // 4,
                                                 result_dir=self.work / "warm", result_file=f"warm-{t}.json", **WARM_UP))
                parse_result(json.loads((self.work / "warm" / f"warm-{t}.json").read_text()))  # raises on a failure
                if t in self.uploads:
                    settle_uploads(self.store, s, t, self.model)
            time.sleep(self.args.gap_s)
        seen = {w: {t: set(hot) if kind == "hot" else set() for t in topologies} for w, kind, _ in self.workloads()}
        missed: dict[str, set[str]] = {}  # workload -> topologies that missed the SLO at a lower rate
        ctx = (pass_no, s, urls, seen)
        for ri in range(max(len(self.rates[1]), len(self.rates[4])) + self.args.extend):
            for w, kind, k in self.workloads():
                if (rate := self.rate_at(k, ri)) is None:
                    continue
                # Past its first miss a topology's SLO-90 rate is decided (slo90_rate
                # interpolates to the first miss): a higher rate only queues, for minutes.
                full = self.args.full_sweep and ri < len(self.rates[k])
                left = [t for t in topologies if full or t not in missed.get(w, set())]
                for t, res in self.segment(ctx, w, kind, k, {t: rate for t in left}, seed=ri):
                    if (res["good_fraction"] or 0.0) < SLO_FRACTION:
                        missed.setdefault(w, set()).add(t)
        for round_no in range(self.args.refine):
            for w, kind, k in self.workloads():
                mids = {t: r for t in topologies if (r := self.midpoint(w, t)) is not None}
                self.segment(ctx, w, kind, k, mids, seed=100 + round_no)

    def rate_at(self, k: int, ri: int) -> float | None:
        """The ``ri``-th rate for ``k`` images: the swept list, then ``--extend`` steps of
        x1.4 (2 digits) past its end, for the topologies that met every rate so far (a
        ratio of two censored rates decides nothing); None past those."""
        rates = self.rates[k]
        if ri < len(rates):
            return rates[ri]
        return float(f"{rates[-1] * 1.4 ** (ri - len(rates) + 1):.2g}") if ri < len(rates) + self.args.extend else None

    def midpoint(self, w: str, t: str) -> float | None:
        """The rate between a topology's highest met and its first missed rate (geometric
        mean, 2 digits), where that bracket is wider than 20%; None where there is none."""
        pts = sorted((r["rate"], r["vllm"]["good_fraction"]) for r in self.runs
                     if r["workload"] == w and r["topology"] == t and r["vllm"].get("good_fraction") is not None)
        first_miss = next((i for i, (_, f) in enumerate(pts) if f < SLO_FRACTION), None)
        if not first_miss:  # none missed, or the lowest rate did: no bracket
            return None
        lo, hi = pts[first_miss - 1][0], pts[first_miss][0]
        return float(f"{math.sqrt(lo * hi):.2g}") if hi / lo > 1.2 else None

    def segment(self, ctx: tuple[Any, ...], w: str, kind: str, k: int, rate_of: Mapping[str, float],
                seed: int) -> list[tuple[str, dict[str, Any]]]:
        """One run per topology of ``rate_of`` at its rate, interleaved (the order rotated
        each segment); topologies at one rate share one draw, in every pass."""
        pass_no, s, urls, seen = ctx
        for rate in sorted(set(rate_of.values())):
            if (w, rate, seed) not in self.streams:  # a later pass gets the same draws
                n = max(self.args.min_requests, int(round(rate * self.args.seconds)))
                self.streams[w, rate, seed] = draw_stream(kind, k, n, self.rng[w], cache_images=self.served.cache_images,
                                                          counter=self.fresh_ids.setdefault(w, {}))
        order = list(rate_of)
        order = order[self.step % len(order):] + order[:self.step % len(order)] if order else []
        self.step += 1
        out = []
        for t in order:
            rate = rate_of[t]
            stream = self.streams[w, rate, seed]
            path = write_segment(self.work, f"{w}-{rate:g}-s{seed}", stream, self.work / "images",
                                 self.served.image_px, [t], self.served.photo)[t]
            rep = repeat_fraction(stream, seen[w][t])
            before = scrape(s, urls, t)
            fname = f"{w}-{t}-{rate:g}-s{seed}.json"
            argv = bench_serve_argv(base_url=urls[t], model=self.model, dataset=path, rate=rate, n=len(stream),
                                    slo_ms=self.slo[k], result_dir=self.work / "results", result_file=fname,
                                    output_len=self.args.output_len, seed=seed)
            try:
                run_bench_serve(argv)
                res = parse_result(json.loads((self.work / "results" / fname).read_text()))
            except Exception as exc:  # noqa: BLE001 - one run failing must not lose the sweep
                self.errors.append(f"{w} {t} {rate:g}: {type(exc).__name__}: {exc}")
                bl.log(f"goodput: {self.errors[-1]}")
                continue
            time.sleep(self.args.gap_s)  # a worker spins ~1 s after its last step
            dd = deltas(before, scrape(s, urls, t))
            if t in self.uploads:
                # vLLM's own request metrics from the scrape above (the settle step adds a
                # request), ec-s3's counters once the run's uploads have landed.
                settle_uploads(self.store, s, t, self.model)
                for role, after in deltas(before, scrape(s, urls, t)).items():
                    dd[role].update({m: v for m, v in after.items() if m.startswith("vllm:ec_s3")})
            prod = dd.get("producer") or {}
            enc_n = prod.get("vllm:request_success_total") or 0.0
            encoded = (prod.get("vllm:ec_s3_blobs_uploaded_total") or 0.0) + (
                prod.get("vllm:ec_s3_uploads_already_present_total") or 0.0)
            run_counts = counts(t, dd)
            check_new_images_were_encoded(w, t, rate, stream, rep, run_counts, self.errors)
            self.runs.append({"workload": w, "kind": kind, "images": k, "topology": t, "rate": rate, "pass": pass_no,
                              "n": len(stream), "slo_ttft_ms": self.slo[k], "repeat_fraction": rep,
                              "miss_fraction": 1.0 - rep,
                              "encoded_fraction": encoded / enc_n if enc_n and t != "vllm-epd" else None,
                              "vllm": res, "deltas": dd, "counts": run_counts,
                              "command": ["vllm", "bench", "serve", *argv]})
            out.append((t, res))
            bl.log(f"goodput: {w} {t} @{rate:g}/s (repeats {rep:.0%}): good "
                   f"{(res['good_fraction'] or 0):.0%}, goodput {res['request_goodput'] or 0:.2f}/s, "
                   f"TTFT p50/p99 {res['p50_ttft_ms']:.0f}/{res['p99_ttft_ms']:.0f} ms")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"its share of --max-minutes {self.args.max_minutes:g} is spent")
        return out


def model_section(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The cost models fitted on this run (EPD's; the shared fleet's), their predictions
    per workload, which should win."""
    shared = shared_model(runs)
    try:
        costs, record = cm.fit_costs(runs)
    except ValueError as exc:
        return {"error": str(exc), "shared": shared}
    pred = {}
    for w in sorted({r["workload"] for r in runs}):
        rs = [r for r in runs if r["workload"] == w and r["topology"] in EPD_TOPOLOGIES]
        if not rs:
            continue
        k = rs[0]["images"]
        miss = sum(r["miss_fraction"] for r in rs) / len(rs)
        win, because = cm.should_win(costs, k, miss)
        pred[w] = {"ratio": cm.predicted_ratio(costs, k, miss), "miss": miss, "should_win": win, "why": because}
    return {"costs_s": dataclasses.asdict(costs), "fit": record, "predicted": pred, "shared": shared}


def shared_model(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`bench.costmodel.fit_shared` on this run, and its bound per workload."""
    try:
        fits, record = cm.fit_shared(runs)
    except ValueError as exc:
        return {"error": str(exc)}
    pred = {}
    plain_w, shared_w = record["plain_s_by_workload"], record["shared_s_by_workload"]
    for w in sorted({r["workload"] for r in runs if r["topology"] == SHARED}):
        rs = [r for r in runs if r["workload"] == w and r["topology"] == SHARED]
        k, miss = rs[0]["images"], sum(r["miss_fraction"] for r in rs) / len(rs)
        pred[w] = {"ratio": cm.shared_ratio(fits[k], miss, plain_w.get(w)) if k in fits else None, "miss": miss,
                   # What the model's ratio is, measured: the unloaded times' ratio.
                   "unloaded_ratio": plain_w[w] / shared_w[w] if w in plain_w and shared_w.get(w) else None}
    return {"fits_s": {str(k): dataclasses.asdict(f) for k, f in fits.items()}, "fit": record, "predicted": pred}


# --------------------------------------------------------------------------- output
def print_tables(d: Mapping[str, Any]) -> None:
    rows = [[r["workload"], r["topology"], r["rate"], f"{r['repeat_fraction']:.0%}",
             *(r["vllm"][k] for k in ("request_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms",
                                      "p50_tpot_ms", "p99_tpot_ms", "p50_e2el_ms", "p99_e2el_ms")),
             *(r["counts"][k] for k in ("encoder requests", "PUT", "GET", "hits", "fallbacks"))] for r in d["runs"]]
    print(bl.table(["workload", "topology", "rate/s", "repeats", "req/s", "goodput/s", "TTFT p50", "TTFT p99",
                    "TPOT p50", "TPOT p99", "E2E p50", "E2E p99", "enc req", "PUT", "GET", "loads", "fallbacks"],
                   rows, title="vLLM bench serve per run (ms; counts from the servers' /metrics)"))
    rows = []
    for w in sorted({r["workload"] for r in d["runs"]}):
        g = goodput_by_topology(d["runs"], w)
        pred = ((d.get("model") or {}).get("predicted") or {}).get(w, {})
        shared = (((d.get("model") or {}).get("shared") or {}).get("predicted") or {}).get(w, {})
        rows.append([w, *((_bounded(g[t]["rate"], g[t]["bound"], "") or "not monotone")
                          if g[t]["rate"] is not None else "-" for t in TOPOLOGIES),
                     pred.get("ratio"), "yes" if pred.get("should_win") else "no", verdict(g, pred),
                     shared.get("ratio")])
    print(bl.table(["workload", *TOPOLOGIES, "model EPD/plain", "should win", "measured agrees",
                    "model shared/plain"], rows,
                   title="Highest rate (req/s) with >= 90% of requests under the TTFT SLO"))
    c = (d.get("model") or {}).get("costs_s")
    if c:
        c = c if isinstance(c, dict) else vars(c)
        print("cost model (fitted, ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c.items()))
    for g in d["goals"]:
        status = {True: "met", False: "MISSED", None: "not decided"}[g["met"]]
        ratio = "-" if g["ratio"] is None else (_bounded(g["ratio"], g["bound"], "x") or "-")
        print(f"goal {g['goal']}: {ratio} (target {g['target']}): {status}" + (f" - {g['why']}" if g["why"] else ""))


def plot(d: Mapping[str, Any], out_dir: Path | None) -> None:
    plt = bl.pyplot()
    ws = sorted({r["workload"] for r in d["runs"]})
    if plt is None or not ws:
        return
    fig, axes = plt.subplots(len(ws), 2, figsize=(10, 2.6 * len(ws)), squeeze=False)
    for row, w in zip(axes, ws):
        for t in TOPOLOGIES:
            rs = sorted((r for r in d["runs"] if r["workload"] == w and r["topology"] == t), key=lambda r: r["rate"])
            if not rs:
                continue
            xs = [r["rate"] for r in rs]
            row[0].plot(xs, [r["vllm"]["request_goodput"] or 0 for r in rs], marker="o", label=t)
            row[1].plot(xs, [r["vllm"]["p99_ttft_ms"] for r in rs], marker="o", label=t)
        slo = next(r["slo_ttft_ms"] for r in d["runs"] if r["workload"] == w)
        row[1].axhline(slo, color="grey", ls="--", lw=0.8)
        rep = [r["repeat_fraction"] for r in d["runs"] if r["workload"] == w and r["topology"] == "epd-parallel"]
        row[0].set_title(f"{w}: goodput (TTFT <= {slo:g} ms), repeats {sum(rep) / max(len(rep), 1):.0%}", fontsize=8)
        row[1].set_title(f"{w}: p99 TTFT", fontsize=8)
        row[0].set_ylabel("req/s")
        row[1].set(ylabel="ms", yscale="log")
    for ax in axes[-1]:
        ax.set_xlabel("request rate (req/s, Poisson)")
    axes[0][0].legend(fontsize=7)
    bl.save_fig(fig, "goodput", out_dir)


def write_fleet(out_dir: Path | None, with_plot: bool) -> None:
    """The cost model on paper for a GPU fleet: fleet.md (table and assumptions), fleet.png."""
    out_dir = out_dir or bl.RESULTS_DIR
    rows = cm.fleet_table()
    a = cm.FLEET_ASSUMPTIONS
    md = ["# The fleet on paper (bench/costmodel.py)", "",
          "Capacity per GPU of the best encoder : prefill/decode split, and of aggregated servers on a shared "
          "bucket (each encodes the misses and GETs the rest), against plain replicas, "
          f"{a['images_per_request']} images per request, by hosts and repeat rate (the share of images already "
          "in the bucket). Goodput at a TTFT SLO is taken as proportional to capacity for both.", "",
          "Assumptions:", ""]
    for key in ("gpu_costs_s", "why_costs", "why_local", "why_s3", "gpu_usd_per_hour", "why_skip", "why_hosts",
                "left_out"):
        md.append(f"- {key}: {a[key]}")
    md += ["- one GPU per host; the split is whole hosts (1 <= encoders < hosts)", ""]
    md.append(bl.table(["hosts", "repeat", "best E:PD", "plain req/s/GPU", "EPD req/s/GPU", "EPD/plain",
                        "shared req/s/GPU", "shared/plain", "PUT /1k req", "GET /1k req", "S3 $ /1k req",
                        "GPU $ /1k plain", "GPU $ /1k EPD"],
                       [[r["hosts"], f"{r['repeat_rate']:.0%}", r["split_E_PD"], r["plain_rps_per_gpu"],
                         r["epd_rps_per_gpu"], r["ratio"], r["shared_rps_per_gpu"], r["shared_ratio"],
                         r["s3_puts_per_1000"], r["s3_gets_per_1000"],
                         f"{r['s3_usd_per_1000']:.4f}", f"{r['gpu_usd_per_1000_plain']:.4f}",
                         f"{r['gpu_usd_per_1000_epd']:.4f}"] for r in rows]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fleet.md").write_text("\n".join(md) + "\n")
    bl.log(f"wrote {out_dir / 'fleet.md'}")
    plt = bl.pyplot() if with_plot else None
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for hosts in a["hosts"]:
        rs = [r for r in rows if r["hosts"] == hosts]
        a1.plot([r["repeat_rate"] * 100 for r in rs], [r["ratio"] for r in rs], marker="o", label=f"EPD, {hosts} hosts")
        a2.plot([r["repeat_rate"] * 100 for r in rs], [int(r["split_E_PD"].split(":")[0]) / hosts * 100 for r in rs],
                marker="o", label=f"{hosts} hosts")
    # A shared bucket needs no split: its ratio is the same for any number of hosts.
    a1.plot([r["repeat_rate"] * 100 for r in rs], [r["shared_ratio"] for r in rs], color="black", ls="--",
            marker="s", label="shared bucket")
    a1.axhline(1.0, color="grey", lw=0.8)
    a1.set(xlabel="repeat rate (%)", ylabel="goodput per GPU / plain's")
    a1.set_title("best EPD split and a shared bucket vs plain replicas (model)", fontsize=9)
    a2.set(xlabel="repeat rate (%)", ylabel="encoders (% of hosts)", title="best encoder share")
    a1.legend(fontsize=7)
    bl.save_fig(fig, "fleet", out_dir)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--rates-1", type=_floats, default=None, help="request rates, 1 image (default 1,2,4,6)")
    parser.add_argument("--rates-4", type=_floats, default=None, help="request rates, 4 images (default 0.5,1,2,3)")
    parser.add_argument("--slo-ms-1", type=float, default=None, help="TTFT SLO, 1 image (ms; qwen 1500, llava 400)")
    parser.add_argument("--slo-ms-4", type=float, default=None, help="TTFT SLO, 4 images (ms; qwen 4000, llava 800)")
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=None,
                        help="only these kind-images, e.g. hot-4,zipf-4 (default all of fresh, zipf, hot x 1, 4)")
    parser.add_argument("--full-sweep", action="store_true",
                        help="run every rate for every topology (default: a topology stops at its first SLO miss)")
    parser.add_argument("--model", choices=sorted(SERVED), default="qwen",
                        help="the tiny Qwen2.5-VL with 1024x1024 photos (default) or the tiny LLaVA")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the servers' weights: auto is bfloat16 on a CPU that multiplies it natively "
                             "(AVX-512 BF16, AMX), else float32 (emulated bf16 is ~90x slower: it would measure the CPU)")
    parser.add_argument("--topologies", type=lambda s: [p.split(",") for p in s.split("/")],
                        default=[["plain-dp", SHARED], [*EPD_TOPOLOGIES, "vllm-epd"]],
                        help=f"names from {','.join(TOPOLOGIES)}; '/' splits them into passes, one after the other "
                             "(default plain-dp,shared-dp/epd-parallel,epd-serial,vllm-epd)")
    parser.add_argument("--extend", type=int, default=None,
                        help="rates past the list, x1.4 each, for topologies that met every rate (default 2, quick 1)")
    parser.add_argument("--refine", type=int, default=None, help="rounds of bisection between each "
                        "topology's last met and first missed rate (default 1, quick 0)")
    parser.add_argument("--shared-proxy-args", type=lambda s: s.split(), default=[],
                        help="extra ec-s3 proxy arguments for shared-dp (its default routing is --route affinity)")
    parser.add_argument("--seconds", type=float, default=None, help="arrivals per run (default 20, quick 5)")
    parser.add_argument("--min-requests", type=int, default=None, help="default 24, quick 8")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=1.5, help="pause after each run (a worker spins ~1 s)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop the sweep after this long")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: refit the model, goals, tables and plots from goodput.json")
    args = parser.parse_args()
    if args.report_only:
        d = json.loads(((args.out_dir or bl.RESULTS_DIR) / "goodput.json").read_text())
        d.pop("benchmark", None)
        # The run's own environment (its date, load, revision) stays with its numbers.
        d["run_environment"] = d.pop("run_environment", None) or d.pop("environment", None)
        d["model"] = model_section(d["runs"])
        d["goals"] = goals(d)
        return report(d, args)
    bl.setup_env()
    args.passes = args.topologies
    flat = [t for p in args.passes for t in p]
    unknown = [t for t in flat if t not in TOPOLOGIES]
    if unknown or not all(args.passes) or len(set(flat)) < len(flat) or "plain-dp" not in flat:
        parser.error(f"--topologies: {unknown or args.passes} (need plain-dp, the baseline, and names from "
                     f"{', '.join(TOPOLOGIES)}, each in one pass)")
    names = [workload_name(k, i) for k in KINDS for i in IMAGES]
    if bad := [w for w in args.workloads or () if w not in names]:
        parser.error(f"--workloads: {bad} (names are kind-images: {', '.join(names)})")
    args.kinds = [k for k in KINDS if any(w.startswith(f"{k}-") for w in args.workloads or names)]
    args.images = sorted({int(w.split("-")[1]) for w in args.workloads or names})
    if args.dtype == "auto":
        args.dtype = "bfloat16" if bl.native_bf16() else "float32"
    qwen = args.model == "qwen"
    args.slo_ms_1 = args.slo_ms_1 or (1500.0 if qwen else 400.0)
    args.slo_ms_4 = args.slo_ms_4 or (4000.0 if qwen else 800.0)
    if qwen:  # an image costs ~0.3 s of one core to encode and prefill (ec_s3.sandbox.calibrate)
        args.rates_1 = args.rates_1 or ([1.0, 2.5] if args.quick else [0.5, 1.0, 2.0, 3.0])
        args.rates_4 = args.rates_4 or ([0.3, 0.6, 0.9] if args.quick else [0.2, 0.4, 0.6, 0.9, 1.2])
    args.rates_1 = args.rates_1 or ([2.0, 6.0] if args.quick else [1.0, 2.0, 4.0, 6.0])
    args.rates_4 = args.rates_4 or ([1.0, 3.0] if args.quick else [0.5, 1.0, 2.0, 3.0])
    args.seconds = args.seconds or (5.0 if args.quick else 20.0)
    args.min_requests = args.min_requests or (8 if args.quick else 24)
    args.max_minutes = args.max_minutes or (12.5 if args.quick else None)
    args.refine = args.refine if args.refine is not None else (0 if args.quick else 1)
    args.extend = args.extend if args.extend is not None else (1 if args.quick else 2)
    d = run(args)
    report(d, args)
    if d["errors"]:
        print(f"{len(d['errors'])} errors: {d['errors'][:5]}")
    return 0 if d["runs"] else 1


def report(d: dict[str, Any], args: argparse.Namespace) -> int:
    print_tables(d)
    bl.write_json("goodput", d, args.out_dir)
    if not args.no_plot:
        plot(d, args.out_dir)
    write_fleet(args.out_dir, not args.no_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

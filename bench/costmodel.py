"""A cost model of EPD against plain replicas (issue 26, item 4): per-request costs fitted
from one ``bench/goodput.py`` run, the goodput ratio they predict on this host, and, on
paper, the fleet the bucket is for.

The model. A request carries ``k`` images, a fraction ``m`` of them misses (not in the
bucket). Costs, in seconds of one core (here) or one GPU (the fleet):

* ``E`` encode one image; ``p`` prefill one image's tokens; ``P0`` the rest of a
  request's prefill/decode; ``e0`` an encoder request's fixed cost (front end, the
  producer's lookup, a step of 0 tokens); ``G`` one blob's GET on the prefill/decode side;
  ``hop`` the proxy's hop.
* A plain replica does everything for every request: ``k (E + p) + P0``. Its own encoder
  cache hits only what it saw itself, which the workloads keep small (their working sets
  are several times a server's encoder cache).
* 1E + 1PD: the encoder's core carries ``k (m E + e0)`` per request, prefill/decode's
  ``P0 + k p + k (1 - m) G``. Capacity is the busier core's.

So on 2 cores, 1E+1PD beats two plain replicas by ``(k (E + p) + P0) / (2 max(k (m E + e0),
P0 + k p + k (1 - m) G))``: never on fresh images (``m = 1``), and on repeats only where
the encoding that plain does and EPD skips, ``k E``, outweighs prefill/decode: the
balanced split needs ``k m E ~ P0 + k p``. :func:`should_win` says which workloads should
win here, and ``bench/goodput.py`` checks the measurement against it.

Owns the fit (:func:`fit_costs`, from per-run counter deltas), the prediction and the
fleet table (:func:`fleet_table`, its assumptions in :data:`FLEET_ASSUMPTIONS`). Does not
own running anything (``bench/goodput.py``) nor the results' files.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Costs", "FLEET_ASSUMPTIONS", "fit_costs", "SharedFit", "fit_shared", "fleet_table", "linear_fit", "plain_capacity",
           "epd_capacity", "predicted_ratio", "shared_ratio", "should_win", "unloaded"]


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-request costs in seconds (see the module docstring)."""

    E: float  # encode one image
    p: float  # prefill one image's tokens
    P0: float  # the rest of a request's prefill and decode
    e0: float = 0.0  # an encoder request's fixed cost
    G: float = 0.0  # one blob's GET, prefill/decode side
    hop: float = 0.0  # the proxy's hop per request (latency, not a core's work)

    def plain_s(self, k: int, local_hit: float = 0.0) -> float:
        """One plain replica's work per request of ``k`` images."""
        return k * ((1.0 - local_hit) * self.E + self.p) + self.P0

    def encoder_s(self, k: int, miss: float) -> float:
        return k * (miss * self.E + self.e0)

    def pd_s(self, k: int, miss: float) -> float:
        return self.P0 + k * self.p + k * (1.0 - miss) * self.G

    def aggregated_s(self, k: int, miss: float) -> float:
        """An ``ec_both`` server on a shared bucket: it encodes the misses, GETs the rest."""
        return self.P0 + k * (miss * self.E + self.p + (1.0 - miss) * self.G)



def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a x + b``: (a, b). One distinct x: (0, mean y)."""
    if not xs or len(xs) != len(ys):
        raise ValueError("linear_fit: need as many x as y, at least one")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return a, my - a * mx


def _per(d: Mapping[str, float], name: str) -> float | None:
    """Mean of a histogram's window: ``name_sum / name_count`` (None without events)."""
    n = d.get(name + "_count") or 0.0
    return (d.get(name + "_sum") or 0.0) / n if n > 0 else None


def fit_costs(runs: Iterable[Mapping[str, Any]]) -> tuple[Costs, dict[str, Any]]:
    """Costs from the runs of one bench (``bench/goodput.py``'s ``runs``: each with
    ``topology``, ``images``, ``miss_fraction`` and ``deltas``: per-server counter windows,
    ``{"plain": {...}, "producer": {...}, "consumer": {...}}``, plus ``vllm`` with the
    client's ``mean_e2el_ms``). Uses every run; busier runs batch steps, which makes a
    request's inference time overstate its share (say so where it matters).

    * plain-dp: inference time per request against ``k`` -> slope ``E + p``, intercept ``P0``;
    * the ec-s3 consumer behind serial dispatch: inference time per request against ``k``
      -> slope ``p`` (it loads blobs instead of encoding; its local fallbacks are counted);
    * the ec-s3 producer: inference time per encoder request against the workload's miss
      fraction -> slope ``E`` (used where the run varied it; else plain's slope less
      ``p``), intercept ``e0``;
    * ``G``: the consumer's ``ec_s3_download_seconds`` mean; ``hop``: plain-dp's client E2E
      minus its servers' own E2E.
    Returns (costs, the points and fits, for the record)."""
    plain_x: list[float] = []
    plain_y: list[float] = []
    pd_x: list[float] = []
    pd_y: list[float] = []
    enc_x: list[float] = []
    enc_y: list[float] = []
    gets: list[float] = []
    hops: list[float] = []
    for r in runs:
        d, k = r.get("deltas") or {}, float(r["images"])
        topo = r["topology"]
        if topo == "plain-dp":
            y = _per(d.get("plain") or {}, "vllm:request_inference_time_seconds")
            if y is not None:
                plain_x.append(k)
                plain_y.append(y)
            srv = _per(d.get("plain") or {}, "vllm:e2e_request_latency_seconds")
            cli = (r.get("vllm") or {}).get("mean_e2el_ms")
            if srv is not None and cli is not None:
                hops.append(cli / 1e3 - srv)
        elif topo.startswith("epd-"):
            # Serial only: a parallel consumer's request waits for its promised blobs
            # inside its inference time.
            y = _per(d.get("consumer") or {}, "vllm:request_inference_time_seconds")
            if y is not None and topo == "epd-serial":
                pd_x.append(k)
                pd_y.append(y)
            y = _per(d.get("producer") or {}, "vllm:request_inference_time_seconds")
            if y is not None:
                enc_x.append(float(r["miss_fraction"]))
                enc_y.append(y)
            g = _per(d.get("consumer") or {}, "vllm:ec_s3_download_seconds")
            if g is not None:
                gets.append(g)
    if not plain_x or not pd_x:
        raise ValueError("fit_costs: need plain-dp and epd runs with inference-time windows")
    a_plain, b_plain = linear_fit(plain_x, plain_y)
    a_pd, b_pd = linear_fit(pd_x, pd_y)
    a_enc, b_enc = linear_fit(enc_x, enc_y) if enc_x else (0.0, 0.0)
    p = max(a_pd, 0.0)
    # E: the producer's own slope (inference per encoder request against the share it
    # had to encode) where the run varied that share; else plain's slope less p.
    e_prod = a_enc if len(set(enc_x)) > 1 and a_enc > 0 else None
    costs = Costs(E=e_prod if e_prod is not None else max(a_plain - p, 0.0), p=p, P0=max(b_plain, 0.0), e0=max(b_enc, 0.0),
                  G=sum(gets) / len(gets) if gets else 0.0, hop=sorted(hops)[len(hops) // 2] if hops else 0.0)
    record = {"plain_inference_vs_images": {"x": plain_x, "y": plain_y, "slope": a_plain, "intercept": b_plain},
              "consumer_inference_vs_images": {"x": pd_x, "y": pd_y, "slope": a_pd, "intercept": b_pd},
              "producer_inference_vs_encoded_fraction": {"x": enc_x, "y": enc_y, "slope": a_enc, "intercept": b_enc},
              "consumer_P0": b_pd, "E_from_producer": a_enc, "E_from_plain": a_plain - p}
    return costs, record


def plain_capacity(c: Costs, k: int, replicas: int = 2, local_hit: float = 0.0) -> float:
    """Requests per second ``replicas`` plain servers (a core or GPU each) sustain."""
    return replicas / c.plain_s(k, local_hit)


def epd_capacity(c: Costs, k: int, miss: float, encoders: int = 1, pds: int = 1) -> float:
    """Requests per second of ``encoders`` + ``pds`` disaggregated instances: the busier side's."""
    enc = c.encoder_s(k, miss)
    return min(encoders / enc if enc > 0 else math.inf, pds / c.pd_s(k, miss))


def predicted_ratio(c: Costs, k: int, miss: float) -> float:
    """EPD (1E + 1PD) over plain-dp (2 replicas) capacity: the goodput ratio near saturation."""
    return epd_capacity(c, k, miss) / plain_capacity(c, k)


@dataclasses.dataclass(frozen=True)
class SharedFit:
    """One ``k`` (images per request) of the shared fleet, measured unloaded: a plain
    server's inference time per request, and an aggregated server's as a line in the
    items it encoded per request (``base_s`` + ``encode_s`` x items): ``encode_s`` is
    what one encoded item costs there (encoding, publishing) less what a repeat costs
    instead (its GET, staging); ``base_s`` the rest of the request."""

    k: int
    plain_s: float
    encode_s: float
    base_s: float

    def shared_s(self, miss: float) -> float:
        return self.base_s + self.encode_s * self.k * miss


def shared_ratio(fit: SharedFit, miss: float, plain_s: float | None = None) -> float:
    """shared-dp over plain-dp (two aggregated servers on one bucket against two plain
    ones): the capacity ratio when only the share ``miss`` of images is encoded (every
    repeat served from the bucket, a server's staging or its encoder cache). ``plain_s``:
    plain's own time on the workload (its encoder cache hits differ by workload)."""
    return (plain_s if plain_s is not None else fit.plain_s) / fit.shared_s(miss)


def unloaded(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each (workload, topology)'s runs at its lowest rate: a request's inference time
    there is its cost. At higher rates steps batch and two servers share the host's
    cores with their front ends, and the time per request moves with the load, not with
    the work (what confounded the fit over every rate)."""
    runs = list(runs)
    low: dict[tuple[str, str], float] = {}
    for r in runs:
        key = (r["workload"], r["topology"])
        low[key] = min(low.get(key, math.inf), r["rate"])
    return [r for r in runs if r["rate"] == low[r["workload"], r["topology"]]]


def fit_shared(runs: Iterable[Mapping[str, Any]]) -> tuple[dict[int, SharedFit], dict[str, Any]]:
    """Per ``k``, from the :func:`unloaded` plain-dp and shared-dp runs of one bench:
    plain's inference time per request (per workload, and their mean), and shared-dp's
    against the items its servers encoded per request (``vllm:ec_s3_items_encoded_total``;
    the workloads vary it: fresh encodes all, hot few). Measured per ``k`` rather than
    split into E and p: a run of one ``k`` cannot separate them, and the line already
    holds what an aggregated server pays to publish and to GET. The record's
    ``plain_s_by_workload`` and ``shared_s_by_workload`` are the measured points."""
    plain: dict[int, list[float]] = {}
    plain_w: dict[str, list[float]] = {}
    shared: dict[int, tuple[list[float], list[float]]] = {}
    shared_w: dict[str, list[float]] = {}
    for r in unloaded(runs):
        d, k = r.get("deltas") or {}, int(r["images"])
        if r["topology"] == "plain-dp":
            y = _per(d.get("plain") or {}, "vllm:request_inference_time_seconds")
            if y is not None:
                plain.setdefault(k, []).append(y)
                plain_w.setdefault(r["workload"], []).append(y)
        elif r["topology"] == "shared-dp":
            fleet = d.get("shared") or {}
            y = _per(fleet, "vllm:request_inference_time_seconds")
            n = fleet.get("vllm:request_inference_time_seconds_count") or 0.0
            encoded = fleet.get("vllm:ec_s3_items_encoded_total")
            if y is not None and n and encoded is not None:
                xs, ys = shared.setdefault(k, ([], []))
                xs.append(encoded / n)
                ys.append(y)
                shared_w.setdefault(r["workload"], []).append(y)
    fits: dict[int, SharedFit] = {}
    record: dict[str, Any] = {"plain_s_by_workload": {w: sum(v) / len(v) for w, v in plain_w.items()},
                              "shared_s_by_workload": {w: sum(v) / len(v) for w, v in shared_w.items()}}
    for k, (xs, ys) in sorted(shared.items()):
        if k not in plain or len(set(xs)) < 2:
            continue
        a, b = linear_fit(xs, ys)
        fits[k] = SharedFit(k=k, plain_s=sum(plain[k]) / len(plain[k]), encode_s=max(a, 0.0), base_s=max(b, 0.0))
        record[str(k)] = {"plain_inference_s": plain[k], "shared_inference_vs_encoded_per_request":
                          {"x": xs, "y": ys, "slope": a, "intercept": b}}
    if not fits:
        raise ValueError("fit_shared: need plain-dp runs and shared-dp runs of the same images per request that "
                         "encoded different shares (fresh and hot workloads)")
    return fits, record


def should_win(c: Costs, k: int, miss: float) -> tuple[bool, str]:
    """Whether 1E + 1PD should beat two plain replicas here, and why, in words."""
    enc, pd, plain = c.encoder_s(k, miss), c.pd_s(k, miss), c.plain_s(k)
    ratio = predicted_ratio(c, k, miss)
    side = "encoder" if enc >= pd else "prefill/decode"
    return ratio > 1.0, (f"plain {plain * 1e3:.0f} ms/request on each of 2 cores vs 1E+1PD: encoder "
                         f"{enc * 1e3:.0f} ms (k E m = {k * c.E * miss * 1e3:.0f} + k e0 {k * c.e0 * 1e3:.0f}), "
                         f"p/d {pd * 1e3:.0f} ms: the {side} core binds; predicted {ratio:.2f}x")


# --------------------------------------------------------------------------- the fleet, on paper
#: What the fleet table assumes (written next to it in bench/results/fleet.md).
FLEET_ASSUMPTIONS: dict[str, Any] = {
    "gpu_costs_s": {"E": 0.020, "p": 0.004, "P0": 0.060, "e0": 0.001, "G": 0.002},
    "why_costs": ("a 7B VLM on one H100-class GPU: a ~1k-token image through a ~600M-parameter ViT "
                  "~20 ms of GPU time; its tokens' prefill ~4 ms; a request's text prefill and "
                  "128 decoded tokens ~60 ms of GPU time at a batched server's throughput; a GET of "
                  "a ~10 MB blob costs the GPU ~2 ms (copy in, not network time, which overlaps)"),
    "images_per_request": 4,
    "plain_local_cache_fraction": 0.10,
    "why_local": ("a plain replica's own encoder cache holds ~10% of the fleet's repeated working set, "
                  "so it hits 10% of the repeats; the bucket holds them all"),
    "s3_usd_per_1000": {"PUT": 0.005, "GET": 0.0004, "HEAD": 0.0004},
    "why_s3": "S3 Standard list prices (us-east-1): PUT/POST $0.005, GET/HEAD $0.0004 per 1,000",
    "gpu_usd_per_hour": 2.5,
    "proxy_skips_encoder_for_known_blobs": True,
    "why_skip": ("issue 26 item 2: a repeat costs one GET and no encoder request; without it add one "
                 "HEAD per image (the producer's lookup) and e0 of encoder work"),
    "why_hosts": ("the hosts only set the split's granularity (whole hosts): per-GPU costs and the bucket's "
                  "hit rate are taken as independent of fleet size; a larger fleet mostly raises the repeat rate "
                  "the bucket sees (more encoders publish into it), read it off the rows"),
    "left_out": ("interference (a plain replica's encoder steps stall its decodes: vLLM's write-up's reason EPD "
                 "wins even on fresh images on GPUs), queueing at the SLO, network time, encoder output larger "
                 "than a GET can carry in time; every one of these moves the rows, the first towards EPD"),
    "hosts": [8, 32, 128, 1000],
    "repeat_rates": [0.0, 0.25, 0.5, 0.8, 0.9, 0.95],
    "one_gpu_per_host": True,
}


def best_split(c: Costs, k: int, miss: float, hosts: int) -> tuple[int, float]:
    """(encoders, requests/s) of the best ``encoders : hosts - encoders`` split (1 <= encoders < hosts)."""
    best = (1, 0.0)
    for n_e in range(1, hosts):
        cap = epd_capacity(c, k, miss, encoders=n_e, pds=hosts - n_e)
        if cap > best[1]:
            best = (n_e, cap)
    return best


def fleet_table(assumptions: Mapping[str, Any] = FLEET_ASSUMPTIONS) -> list[dict[str, Any]]:
    """One row per (hosts, repeat rate): best split, goodput per GPU (capacity at the SLO,
    taken as proportional to capacity for both) against plain replicas, and S3 requests
    and dollars per 1,000 requests against the GPU time saved."""
    a = assumptions
    c = Costs(**a["gpu_costs_s"])
    k = int(a["images_per_request"])
    price, gpu_h = a["s3_usd_per_1000"], float(a["gpu_usd_per_hour"])
    rows = []
    for hosts in a["hosts"]:
        for r in a["repeat_rates"]:
            miss = 1.0 - r
            plain = plain_capacity(c, k, replicas=hosts, local_hit=r * a["plain_local_cache_fraction"])
            shared = hosts / c.aggregated_s(k, miss)
            n_e, epd = best_split(c, k, miss, hosts)
            puts, gets = 1000 * k * miss, 1000 * k * r
            heads = 0.0 if a["proxy_skips_encoder_for_known_blobs"] else 1000 * k
            s3_usd = puts / 1000 * price["PUT"] + gets / 1000 * price["GET"] + heads / 1000 * price["HEAD"]
            gpu_usd = {name: 1000 / (cap / hosts) / 3600 * gpu_h for name, cap in (("plain", plain), ("epd", epd))}
            rows.append({"hosts": hosts, "repeat_rate": r, "split_E_PD": f"{n_e}:{hosts - n_e}",
                         "plain_rps_per_gpu": plain / hosts, "epd_rps_per_gpu": epd / hosts, "ratio": epd / plain,
                         "shared_rps_per_gpu": shared / hosts, "shared_ratio": shared / plain,
                         "s3_puts_per_1000": puts, "s3_gets_per_1000": gets, "s3_heads_per_1000": heads,
                         "s3_usd_per_1000": s3_usd, "gpu_usd_per_1000_plain": gpu_usd["plain"],
                         "gpu_usd_per_1000_epd": gpu_usd["epd"]})
    return rows

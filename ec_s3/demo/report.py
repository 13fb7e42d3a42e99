"""The demo's summary: per request, where the image was encoded and where
prefill/decode took it from; in total, what moved through the bucket, what the
connector and the proxy counted, and whether the answers equal the baseline's.

Owns the reading of metric deltas (scrapes before and after each step, settled until
the counters stop moving) and the tables. Does not own the metrics themselves (the
connector's and the proxy's ``/metrics``, parsed by :mod:`ec_s3.sandbox.metrics`),
nor running anything (:mod:`ec_s3.demo.run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.common import format_bytes
from ec_s3.cli.listing import key_root, list_objects_async
from ec_s3.demo.chat import ChatResult, DemoRequest, compare_results
from ec_s3.sandbox.metrics import MetricSamples

__all__ = ["Out", "Snapshot", "print_summary", "run_blobs", "settle", "step_sources"]

# Metric families of the connector (vLLM prefixes them with "vllm:"). Absent ones print n/a.
M = "vllm:ec_s3_"
M_UPLOADED, M_UPLOADED_BYTES = M + "blobs_uploaded_total", M + "bytes_uploaded_total"
M_DOWNLOADED, M_DOWNLOADED_BYTES = M + "blobs_downloaded_total", M + "bytes_downloaded_total"
M_LOADED, M_LOOKUPS = M + "blobs_loaded_total", M + "lookups_total"
M_FALLBACKS, M_UNAVAILABLE = M + "fallbacks_local_total", M + "requests_unavailable_total"
M_INVALID, M_UPLOAD_FAILURES, M_RETRIES = M + "invalid_blobs_total", M + "upload_failures_total", M + "retries_total"
M_UPLOAD_S, M_DOWNLOAD_S = M + "upload_seconds", M + "download_seconds"
P = "ec_s3_proxy_"


# --------------------------------------------------------------------------- metrics
@dataclass
class Snapshot:
    """The three servers' /metrics, and the run's blobs, at one point of the schedule."""

    producer: MetricSamples
    consumer: MetricSamples
    proxy: MetricSamples
    blobs: frozenset[str] | None = None  # blob keys under the run's prefix (bucket listing)


def _delta(after: MetricSamples, before: MetricSamples, name: str, **labels: str) -> float | None:
    a = after.get(name, **labels)
    if a is None:
        return None
    return a - (before.get(name, **labels) or 0.0)


def _fmt_num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:g}"


def _fmt_bytes(v: float | None) -> str:
    return "n/a" if v is None else format_bytes(v)


def settle(scrape: Callable[[], Snapshot], wait_s: float = 1.5, every_s: float = 0.25) -> Snapshot:
    """Scrape until two reads agree (stats reach /metrics with the engine's next output)."""
    deadline = time.monotonic() + wait_s
    snap = scrape()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        nxt = scrape()
        if all(_only_counters(getattr(nxt, r)).samples == _only_counters(getattr(snap, r)).samples
               for r in ("producer", "consumer")):
            return nxt
        snap = nxt
    return snap


_COUNTER_NAMES = frozenset({M_UPLOADED, M_DOWNLOADED, M_LOADED, M_LOOKUPS, M_FALLBACKS, M_UNAVAILABLE, M_INVALID})


def _only_counters(m: MetricSamples) -> MetricSamples:
    """The connector counters only (other vLLM families change on every scrape)."""
    return MetricSamples(tuple(s for s in m.samples if s[0] in _COUNTER_NAMES), ok=m.ok)


# --------------------------------------------------------------------------- output
class Out:
    """The demo's stdout, flushed per line, and the run's wall clock."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.t0 = time.monotonic()

    def __call__(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def run_blobs(store: Any, prefix: str, out: Out) -> list[Any] | None:
    """The blobs under the run's prefix (the probe area left out); None, said on
    ``out``, when the bucket cannot be listed."""
    try:
        objects = store.run(list_objects_async(store, key_root(prefix)), timeout=60)
    except Exception as exc:  # noqa: BLE001 - a listing failure is reported, not fatal
        out(f"      (could not list the bucket: {exc})")
        return None
    return [o for o in objects if o.key.endswith(".safetensors") and f"/{PROBE_NAMESPACE}/" not in o.key]


# --------------------------------------------------------------------------- summary
def print_summary(out: Out, schedule: Sequence[Sequence[DemoRequest]], baseline: dict[int, ChatResult],
                  results: dict[int, ChatResult], snaps: dict[int, Snapshot], final: Snapshot,
                  blobs: list[Any] | None, prefix: str, timings: Mapping[str, float],
                  tolerance: float) -> bool:
    """The per-request table and the totals; True only if every EPD answer equals
    the baseline's (token ids, and logprobs within ``tolerance``)."""
    requests = [r for step in schedule for r in step]
    rows: list[list[str]] = []
    matches = 0
    for step_reqs in schedule:
        step = step_reqs[0].step
        enc, pd = step_sources(step_reqs, snaps.get(step - 1), snaps.get(step))
        for k, r in enumerate(step_reqs):
            got, want = results[r.index], baseline[r.index]
            same, verdict = compare_results(got, want, tolerance)
            matches += same
            rows.append([
                str(r.index),
                f"{step}{'*' if len(step_reqs) > 1 else ''}",
                r.image_label,
                f"{1000 * got.latency_s:.0f}" if got.ok else f"HTTP {got.status}",
                f"{1000 * want.latency_s:.0f}",
                enc if k == 0 else '"',
                pd if k == 0 else '"',
                str(len(got.token_ids)),
                verdict,
            ])
    header = ["req", "step", "image", "EPD ms", "base ms", "encoder (via proxy)",
              "prefill/decode took it from", "tokens", "vs baseline"]
    out("")
    for line in _table(rows, header, right={0, 3, 4, 7}):
        out("  " + line)
    out("  * = sent at once; a step's encoder / prefill-decode cells count the whole step")
    out("    (deltas of the proxy's and the servers' /metrics and of the bucket listing)")

    distinct = len({r.image_seed for r in requests})
    base = snaps.get(0)
    if base is None:
        base = Snapshot(MetricSamples(), MetricSamples(), MetricSamples())
    p, c, x = final.producer, final.consumer, final.proxy
    bp, bc, bx = base.producer, base.consumer, base.proxy

    def dp(name: str, **labels: str) -> float | None:
        return _delta(p, bp, name, **labels)

    def dc(name: str, **labels: str) -> float | None:
        return _delta(c, bc, name, **labels)

    def dx(name: str, **labels: str) -> float | None:
        return _delta(x, bx, name, **labels)

    def mean_ms(after: MetricSamples, before: MetricSamples, name: str) -> str:
        total, count = _delta(after, before, name + "_sum"), _delta(after, before, name + "_count")
        return "n/a" if total is None or not count else f"{1000 * total / count:.1f} ms"

    out("")
    out(f"  totals of the {len(requests)} requests (the warm-up request excluded):")
    new_blobs = None
    if blobs is None:
        out("  bucket      : n/a (listing failed)")
    else:
        known = base.blobs or frozenset()
        fresh = [o for o in blobs if o.key not in known]
        new_blobs = len(fresh)
        flag = "" if new_blobs == distinct else "   <-- expected one per distinct image"
        out(f"  bucket      : {new_blobs} new blobs, {_fmt_bytes(sum(o.size for o in fresh))} under {prefix}/ "
            f"for {distinct} distinct images{flag} (+{len(blobs) - new_blobs} from the warm-up)")
    uploaded, loaded, downloaded = dp(M_UPLOADED), dc(M_LOADED), dc(M_DOWNLOADED)
    unreported = "  (a worker-side counter: this vLLM executor does not report it)"
    out(f"  encoder     : uploaded {_fmt_num(uploaded)} blobs / {_fmt_bytes(dp(M_UPLOADED_BYTES))}"
        f", mean upload {mean_ms(p, bp, M_UPLOAD_S)}, upload failures {_fmt_num(dp(M_UPLOAD_FAILURES))}"
        f", retries {_fmt_num(dp(M_RETRIES))}"
        + (unreported if uploaded is not None and new_blobs and uploaded < new_blobs else ""))
    hit, miss, tmo = (dc(M_LOOKUPS, outcome=o) for o in ("hit", "miss", "timeout"))
    out(f"  prefill/dec : lookups hit {_fmt_num(hit)} / miss {_fmt_num(miss)} (polls while waiting included)"
        f" / timeout {_fmt_num(tmo)}; downloaded {_fmt_num(downloaded)} blobs / "
        f"{_fmt_bytes(dc(M_DOWNLOADED_BYTES))} (mean {mean_ms(c, bc, M_DOWNLOAD_S)})")
    out(f"                loaded {_fmt_num(loaded)} encoder outputs instead of encoding"
        + (unreported if loaded is not None and downloaded and loaded < downloaded else "")
        + f"; local fallbacks {_fmt_num(dc(M_FALLBACKS))}; requests failed for want of a blob "
        f"{_fmt_num(dc(M_UNAVAILABLE))}; invalid blobs {_fmt_num(dc(M_INVALID))}")
    without = dx(P + "items_without_params_total")
    out(f"  proxy       : {_fmt_num(dx(P + 'requests_total'))} requests, "
        f"{_fmt_num(dx(P + 'mm_items_total'))} media items; encoder answers ok "
        f"{_fmt_num(dx(P + 'encoder_requests_total', outcome='ok'))}, items sent without params "
        f"{_fmt_num(without if without is not None else (0.0 if x.ok else None))}")
    ok_all = matches == len(requests)
    out(f"  outputs     : {matches}/{len(requests)} answers equal to the non-disaggregated run "
        f"(token ids and logprobs, temperature 0)")
    t = timings
    wall = out.elapsed()
    parts = [f"S3 {t.get('s3', 0):.1f} s", f"model {t.get('model', 0):.1f} s",
             f"baseline phase {t.get('baseline', 0):.0f} s", f"EPD phase {t.get('epd', 0):.0f} s"]
    if "shutdown" in t:
        parts.append(f"shutdown {t['shutdown']:.0f} s")
    out(f"  wall time   : {wall:.0f} s ({', '.join(parts)})")
    out("")
    out("PASS: the disaggregated answers equal the baseline's" if ok_all
        else "FAIL: some disaggregated answers differ from the baseline's")
    return ok_all

def step_sources(reqs: Sequence[DemoRequest], before: Snapshot | None,
                 after: Snapshot | None) -> tuple[str, str]:
    """(what the encoder did, where prefill/decode got the encoder output) for one
    step, from the deltas of the proxy's and the consumer's /metrics and of the
    bucket listing; "n/a" where a source is missing."""
    n = len(reqs)
    if before is None or after is None:
        return "n/a", "n/a"
    # Encoder side: params the proxy got back, and new blobs in the bucket (an
    # encoder that finds an image's blob already there skips encoding it).
    ok = _delta(after.proxy, before.proxy, P + "encoder_requests_total", outcome="ok")
    without = _delta(after.proxy, before.proxy, P + "items_without_params_total") or 0.0
    enc = ["n/a" if ok is None else f"{int(ok)}/{n} params"]
    if after.blobs is not None and before.blobs is not None:
        new = len(after.blobs - before.blobs)
        enc.append(f"{new} new blob{'s' if new != 1 else ''}")
    # Prefill/decode side: fetched (downloaded, or loaded where the worker's
    # counter is reported), encoded locally (promise not kept, or no params),
    # or neither: the image was still in its own encoder cache.
    fetched_src = [v for v in (_delta(after.consumer, before.consumer, M_LOADED),
                               _delta(after.consumer, before.consumer, M_DOWNLOADED)) if v is not None]
    if not fetched_src:
        if ok is None:
            return ", ".join(enc), "n/a"
        guess = f"{'encoder params' if ok else ''}{', ' if ok and without else ''}"
        guess += f"{int(without)} without params (encoded locally)" if without else ""
        return ", ".join(enc), guess + " (no connector metrics)"
    fetched = int(max(fetched_src))
    local = int((_delta(after.consumer, before.consumer, M_FALLBACKS) or 0.0) + without)
    cached = max(0, n - fetched - local)

    def count(k: int) -> str:
        return "" if n == 1 else f"{k}x "

    pd = []
    if fetched:
        pd.append(f"{count(fetched)}fetched from S3")
    if local:
        pd.append(f"{count(local)}encoded locally")
    if cached:
        pd.append(f"{count(cached)}own encoder cache")
    return ", ".join(enc), ", ".join(pd) or "n/a"

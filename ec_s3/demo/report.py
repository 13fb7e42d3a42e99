"""The demo's summary: per request its latency next to the plain server's, where that time
went and where prefill/decode took the image from; in total, what moved through the
bucket, what was counted, and whether the answers equal the baseline's.

Owns the counter deltas (settled scrapes), the n/a lines and the tables. Does not own the
metrics (parsed by :mod:`ec_s3.sandbox.metrics`), the time split (:mod:`ec_s3.demo.timing`)
nor running anything (:mod:`ec_s3.demo.epd`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO, TypeVar

from ec_s3.blob.keys import PROBE_NAMESPACE
from ec_s3.cli.common import format_bytes
from ec_s3.cli.listing import key_root, list_objects_async
from ec_s3.demo.chat import AGAIN, FLEET, FRESH, ChatResult, DemoRequest, compare_results
from ec_s3.demo.timing import H_E2E, Part, Snapshot, step_times
from ec_s3.sandbox.metrics import MetricSamples

S = TypeVar("S")  # a snapshot of the servers' /metrics (EPD or aggregated)

__all__ = ["Out", "Snapshot", "Windows", "fmt_bytes", "fmt_num", "metric_delta", "print_summary", "print_verdict",
           "run_blobs", "settle", "settle_answered", "image_source", "kind_lines", "uploads_unreported"]

# Metric families of the connector (vLLM prefixes them with "vllm:"). Absent ones print n/a.
M = "vllm:ec_s3_"
M_UPLOADED, M_UPLOADED_BYTES = M + "blobs_uploaded_total", M + "bytes_uploaded_total"
M_DOWNLOADED, M_DOWNLOADED_BYTES = M + "blobs_downloaded_total", M + "bytes_downloaded_total"
M_LOADED, M_LOOKUPS, M_POLLS = M + "blobs_loaded_total", M + "lookups_total", M + "lookup_polls_total"
M_FALLBACKS, M_UNAVAILABLE = M + "fallbacks_local_total", M + "requests_unavailable_total"
M_INVALID, M_UPLOAD_FAILURES, M_RETRIES = M + "invalid_blobs_total", M + "upload_failures_total", M + "retries_total"
M_UPLOAD_S, M_DOWNLOAD_S = M + "upload_seconds", M + "download_seconds"
P = "ec_s3_proxy_"


# --------------------------------------------------------------------------- metrics
def metric_delta(after: MetricSamples, before: MetricSamples, name: str, **labels: str) -> float | None:
    a = after.get(name, **labels)
    if a is None:
        return None
    return a - (before.get(name, **labels) or 0.0)


def fmt_num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:g}"


def lookup_hit_rate(hit: float | None, *others: float | None) -> str:
    """hit / all decided lookups, as the dashboard's panel computes it."""
    if hit is None:
        return "hit rate n/a"
    total = hit + sum(o or 0.0 for o in others)
    return f"hit rate {hit / total:.0%}" if total else "hit rate n/a"


def fmt_bytes(v: float | None) -> str:
    return "n/a" if v is None else format_bytes(v)


def _epd_counters(snap: Snapshot) -> tuple[Any, ...]:
    return tuple(_only_counters(getattr(snap, r)).samples for r in ("producer", "consumer"))


def settle(scrape: Callable[[], S], key: Callable[[S], Any] = _epd_counters, wait_s: float = 1.5,
           every_s: float = 0.25) -> S:
    """Scrape until two reads agree on ``key`` (the connector's counters: stats reach
    /metrics with the engine's next output); after ``wait_s`` the last read."""
    deadline = time.monotonic() + wait_s
    snap = scrape()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        nxt = scrape()
        if key(nxt) == key(snap):
            return nxt
        snap = nxt
    return snap


def settle_answered(scrape: Callable[[], Snapshot], start: Snapshot, n: int, wait_s: float = 5.0,
                    every_s: float = 0.05) -> Snapshot:
    """Scrape until both vLLM servers count ``n`` more finished requests than at
    ``start`` (their front ends record a request's times as its answer goes out, so the
    client can be a moment ahead); after ``wait_s`` the last scrape, short or not."""
    deadline = time.monotonic() + wait_s
    while True:
        snap = scrape()
        counted = [metric_delta(getattr(snap, r), getattr(start, r), H_E2E + "_count") for r in ("producer", "consumer")]
        if all(c is None or c >= n for c in counted) or time.monotonic() >= deadline:
            return snap
        time.sleep(every_s)


_COUNTER_NAMES = frozenset({M_UPLOADED, M_DOWNLOADED, M_LOADED, M_LOOKUPS, M_POLLS, M_FALLBACKS, M_UNAVAILABLE, M_INVALID,
                            M_UPLOAD_S + "_count", M_DOWNLOAD_S + "_count"})


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
class Windows:
    """The scrapes of the EPD phase: ``flushed[0]`` after the warm-up; per step,
    ``answered[step]`` once its answers are counted and ``flushed[step]`` after the
    encoder's next engine step (which reports its uploads)."""

    def __init__(self) -> None:
        self.answered: dict[int, Snapshot] = {}
        self.flushed: dict[int, Snapshot] = {}

    @property
    def final(self) -> Snapshot:
        return self.flushed[max(self.flushed)] if self.flushed else _EMPTY

    @property
    def start(self) -> Snapshot:
        return self.flushed.get(0, _EMPTY)


_EMPTY = Snapshot(MetricSamples(), MetricSamples(), MetricSamples())


def uploads_unreported(final: Snapshot, run_blob_count: int | None) -> str | None:
    """Why the encoder's uploads cannot be measured, or None when they can: the
    producer must have counted at least one upload in the run (the warm-up's)."""
    uploaded = final.producer.get(M_UPLOADED)
    if uploaded is None:
        return f"the encoder exports no {M_UPLOADED}"
    if uploaded > 0:
        return None
    seen = (f"although the bucket holds {run_blob_count} blob{'s' if run_blob_count != 1 else ''} of this run"
            if run_blob_count else "and the bucket listing shows none of this run's blobs")
    return (f"the encoder's {M_UPLOADED} stayed 0 for the whole run, warm-up included, {seen}: "
            "ec-s3's worker-side metrics are not reported by this vLLM executor")


def _step_cells(step_reqs: Sequence[DemoRequest], results: dict[int, ChatResult], windows: Windows,
                no_uploads: str | None, parallel: bool, why_na: dict[str, str]) -> tuple[list[str], str]:
    """One step's time-split cells and where p/d took its image from (n/a, and why, when
    a /metrics scrape is missing)."""
    step = step_reqs[0].step
    before, answered, flushed = windows.flushed.get(step - 1), windows.answered.get(step), windows.flushed.get(step)
    if before is None or answered is None or flushed is None:
        why_na["time split"] = f"step {step}: its /metrics were not scraped"
        return ["n/a"] * 8, "n/a"
    times = step_times(before, answered, flushed, uploads_reported=no_uploads is None,
                       uploads_unreported_why=no_uploads or "")
    ok_lat = [results[r.index].latency_s for r in step_reqs if results[r.index].ok]
    step_lat = statistics.fmean(ok_lat) if ok_lat else None
    named = [("to encoder", times.to_encoder), ("encoder", times.encoder), ("upload", times.upload),
             ("p/d front", times.pd_front()), ("wait", times.wait),
             ("fetch", times.fetch), ("prefill+decode", times.prefill_decode)]
    other = times.other(step_lat, parallel=parallel) if step_lat is not None else Part(None, why="no answer")
    cells: list[str] = []
    for col, part in [*named, ("other", other)]:
        if not part.measured and part.why:
            why_na.setdefault(col, part.why)
        cells.append(part.cell())
    return cells, image_source(step_reqs, before, flushed)


def _print_requests(out: Out, schedule: Sequence[Sequence[DemoRequest]], baseline: dict[int, ChatResult],
                    results: dict[int, ChatResult], windows: Windows, no_uploads: str | None, tolerance: float,
                    parallel: bool) -> int:
    """The per-request table and its legend; returns how many answers equal the baseline's."""
    rows: list[list[str]] = []
    why_na: dict[str, str] = {}  # column -> why it is n/a (one line each)
    matches = 0
    for step_reqs in schedule:
        cells, src = _step_cells(step_reqs, results, windows, no_uploads, parallel, why_na)
        for k, r in enumerate(step_reqs):
            got, want = results[r.index], baseline[r.index]
            same, verdict = compare_results(got, want, tolerance)
            matches += same
            rows.append([
                f"{r.index}{'*' if len(step_reqs) > 1 else ''}",
                r.image_label,
                r.kind,
                f"{1000 * got.latency_s:.0f}" if got.ok else f"HTTP {got.status}",
                f"{1000 * want.latency_s:.0f}",
                *(cells if k == 0 else ['"'] * len(cells)),
                src if k == 0 else '"',
                verdict,
            ])
    header = ["req", "image", "kind", "EPD ms", "base ms", "to encoder", "encoder", "upload", "p/d front", "wait", "fetch",
              "prefill+decode", "other", "p/d took the image from", "vs baseline"]
    out("")
    out("  per request: latency through the proxy (EPD) and on the plain server (base); where the EPD time")
    out("  went, in ms, from the servers' /metrics:")
    for line in _table(rows, header, right=set(range(3, 13))):
        out("  " + line)
    out("  to encoder = the proxy's request to the encoder server; encoder = that server's request time;")
    out("  upload = the encoder's PUT of the blob, after it answered; on prefill/decode (p/d): front = its")
    out("  rendering, image processing and hand-offs, wait = holding the request for the blob, fetch = the")
    out("  blob's GET + validation (inside wait), then prefill+decode; other = the proxy and HTTP;")
    if parallel:
        out("  parallel dispatch: p/d had the request while the encoder encoded, so to encoder, encoder and")
        out("  upload overlap p/d's front and wait; the latency is p/d's request time plus other;")
    out("  - = none in that step; * = sent at once (mean of the step); kind: fresh = no encoder had the image,")
    out("  again = this p/d had it in an earlier step, fleet = an encoder published it earlier for another")
    out("  front (in the bucket, new to this p/d; the plain server encodes it)")
    for col, why in why_na.items():
        out(f"  {col}: n/a: {why}")
    return matches


def _print_latency(out: Out, requests: Sequence[DemoRequest], baseline: dict[int, ChatResult],
                   results: dict[int, ChatResult]) -> None:
    ok_base = [baseline[r.index].latency_s for r in requests if baseline[r.index].ok]
    ok_epd = [results[r.index].latency_s for r in requests if results[r.index].ok]
    if not (ok_base and ok_epd):
        return
    med_e, med_b = statistics.median(ok_epd), statistics.median(ok_base)
    worst = max(results[r.index].latency_s / baseline[r.index].latency_s for r in requests
                if results[r.index].ok and baseline[r.index].ok)
    out("")
    out(f"  latency     : EPD median {1000 * med_e:.0f} ms vs plain {1000 * med_b:.0f} ms "
        f"({med_e / med_b:.1f}x); slowest EPD {1000 * max(ok_epd):.0f} ms; worst request {worst:.1f}x its plain time")
    for line in kind_lines(requests, results, baseline):
        out(line)


def print_summary(out: Out, schedule: Sequence[Sequence[DemoRequest]], baseline: dict[int, ChatResult],
                  results: dict[int, ChatResult], windows: Windows, blobs: list[Any] | None, prefix: str,
                  timings: Mapping[str, float], tolerance: float, *, parallel: bool = False) -> bool:
    """The per-request table and the totals; True only if every EPD answer equals
    the baseline's (token ids, and logprobs within ``tolerance``). ``parallel``: the
    proxy dispatched in parallel (the encoder's hop overlaps prefill/decode)."""
    requests = [r for step in schedule for r in step]
    no_uploads = uploads_unreported(windows.final, len(blobs) if blobs is not None else None)
    matches = _print_requests(out, schedule, baseline, results, windows, no_uploads, tolerance, parallel)
    _print_latency(out, requests, baseline, results)
    _print_totals(out, requests, windows, blobs, prefix, no_uploads)
    return print_verdict(out, matches, len(requests), tolerance, timings, against="the non-disaggregated run",
                         phase=("EPD", "epd"), verdicts=("the disaggregated answers equal the baseline's",
                                                         "some disaggregated answers differ from the baseline's"))


def _mean_ms(after: MetricSamples, before: MetricSamples, name: str) -> str:
    total, count = metric_delta(after, before, name + "_sum"), metric_delta(after, before, name + "_count")
    return "n/a" if total is None or not count else f"{1000 * total / count:.1f} ms"


def _print_totals(out: Out, requests: Sequence[DemoRequest], windows: Windows, blobs: list[Any] | None,
                  prefix: str, no_uploads: str | None) -> None:
    """What moved: the bucket's new blobs, the encoder's uploads, prefill/decode's lookups
    and loads, and the proxy's counts, each as the run's delta."""
    base, final = windows.start, windows.final
    distinct = len({r.image_seed for r in requests if r.kind != FLEET})  # fleet images were published before
    p, bp = final.producer, base.producer
    out(f"  totals of the {len(requests)} requests (the warm-up request excluded):")
    if blobs is None:
        out("  bucket      : n/a (listing failed)")
    else:
        known = base.blobs or frozenset()
        fresh = [o for o in blobs if o.key not in known]
        flag = "" if len(fresh) == distinct else "   <-- expected one per distinct image"
        out(f"  bucket      : {len(fresh)} new blobs, {fmt_bytes(sum(o.size for o in fresh))} under {prefix}/ "
            f"for {distinct} distinct images{flag} (+{len(blobs) - len(fresh)} from the warm-up"
            f"{' and the other front' if any(r.kind == FLEET for r in requests) else ''})")
    if no_uploads is None:
        def dp(name: str) -> float | None:
            return metric_delta(p, bp, name)

        out(f"  encoder     : uploaded {fmt_num(dp(M_UPLOADED))} blobs / {fmt_bytes(dp(M_UPLOADED_BYTES))}"
            f", mean upload {_mean_ms(p, bp, M_UPLOAD_S)}, upload failures {fmt_num(dp(M_UPLOAD_FAILURES))}"
            f", retries {fmt_num(dp(M_RETRIES))}")
    else:
        out("  encoder     : uploads n/a (why: see upload above)")
    _print_consumer_totals(out, final.consumer, base.consumer)
    _print_proxy_totals(out, final.proxy, base.proxy)


def _print_consumer_totals(out: Out, c: MetricSamples, bc: MetricSamples) -> None:
    def dc(name: str, **labels: str) -> float | None:
        return metric_delta(c, bc, name, **labels)

    loaded, downloaded = dc(M_LOADED), dc(M_DOWNLOADED)
    hit, miss, tmo, err = (dc(M_LOOKUPS, outcome=o) for o in ("hit", "miss", "timeout", "error"))
    polled = dc(M_POLLS, outcome="miss")
    out(f"  prefill/dec : lookups hit {fmt_num(hit)} / miss {fmt_num(miss)} / timeout {fmt_num(tmo)}"
        f" / error {fmt_num(err)} ({lookup_hit_rate(hit, miss, tmo, err)}; one per image a request asked for,"
        f" besides {fmt_num(polled)} polls that found nothing yet); downloaded {fmt_num(downloaded)} blobs / "
        f"{fmt_bytes(dc(M_DOWNLOADED_BYTES))} (mean {_mean_ms(c, bc, M_DOWNLOAD_S)})")
    if loaded is not None and downloaded and not c.get(M_LOADED):
        loaded_text = (f"loaded n/a: the consumer's {M_LOADED} stayed 0 for the whole run while it downloaded "
                       f"{fmt_num(downloaded)} blobs: ec-s3's worker-side metrics are not reported by this "
                       "vLLM executor")
    else:
        loaded_text = f"loaded {fmt_num(loaded)} encoder outputs instead of encoding"
    out(f"                {loaded_text}")
    out(f"                local fallbacks {fmt_num(dc(M_FALLBACKS))}; requests failed for want of a blob "
        f"{fmt_num(dc(M_UNAVAILABLE))}; invalid blobs {fmt_num(dc(M_INVALID))}")


def _print_proxy_totals(out: Out, x: MetricSamples, bx: MetricSamples) -> None:
    def dx0(name: str, **labels: str) -> str:  # a series not created yet is 0 on a proxy that answered
        v = metric_delta(x, bx, name, **labels)
        return fmt_num(v if v is not None else (0.0 if x.ok else None))

    out(f"  proxy       : {fmt_num(metric_delta(x, bx, P + 'requests_total'))} requests, "
        f"{fmt_num(metric_delta(x, bx, P + 'mm_items_total'))} media items; encoder answers ok "
        f"{fmt_num(metric_delta(x, bx, P + 'encoder_requests_total', outcome='ok'))}, items sent without params "
        f"{dx0(P + 'items_without_params_total')}")
    out(f"                metadata-only items sent to prefill/decode (no image to decode or process there): "
        f"{dx0(P + 'metadata_only_items_total')}")
    out(f"                encoder skips (items known to be in the bucket, no encoder request): "
        f"{dx0(P + 'encoder_skips_total', source='answer')} from its encoder's answers, "
        f"{dx0(P + 'encoder_skips_total', source='bucket')} found by a HEAD; "
        f"forgotten as missing {dx0(P + 'known_forgotten_total', reason='missing')}")


def print_verdict(out: Out, matches: int, total: int, tolerance: float, timings: Mapping[str, float], *,
                  against: str, phase: tuple[str, str], verdicts: tuple[str, str]) -> bool:
    """The summary's last lines (answers matched, wall time, PASS/FAIL), shared by the
    EPD and the aggregated summaries; ``phase`` is (its name, its key in ``timings``),
    ``verdicts`` the (PASS, FAIL) texts. True if every answer matched."""
    ok_all = matches == total
    out(f"  outputs     : {matches}/{total} answers equal to {against} "
        f"(token ids, and logprobs {'identical' if not tolerance else f'within {tolerance:g}'}, temperature 0)")
    t = timings
    parts = [f"S3 {t.get('s3', 0):.1f} s", f"model {t.get('model', 0):.1f} s",
             f"baseline phase {t.get('baseline', 0):.0f} s", f"{phase[0]} phase {t.get(phase[1], 0):.0f} s"]
    if "shutdown" in t:
        parts.append(f"shutdown {t['shutdown']:.0f} s")
    out(f"  wall time   : {out.elapsed():.0f} s ({', '.join(parts)})")
    out("")
    out(f"PASS: {verdicts[0]}" if ok_all else f"FAIL: {verdicts[1]}")
    return ok_all


# Issue 31's goals on the model EPD serves: EPD's median latency / the plain server's.
LATENCY_GOALS = {FLEET: 0.7, FRESH: 1.3}


def kind_lines(requests: Sequence[DemoRequest], results: Mapping[int, ChatResult],
               baseline: Mapping[int, ChatResult]) -> list[str]:
    """Median latency per kind of image (fresh, again, fleet), EPD against the plain
    server: where EPD pays (fleet: the bucket spares the encoder) and where it costs;
    with the goal of the kinds that have one (:data:`LATENCY_GOALS`), met or MISSED."""
    lines = []
    for kind, what in ((FRESH, "fresh images"), (AGAIN, "again, same p/d"), (FLEET, "fleet repeats")):
        pairs = [(results[r.index].latency_s, baseline[r.index].latency_s) for r in requests
                 if r.kind == kind and results[r.index].ok and baseline[r.index].ok]
        if not pairs:
            continue
        epd, plain = statistics.median(e for e, _ in pairs), statistics.median(b for _, b in pairs)
        goal = LATENCY_GOALS.get(kind)
        verdict = "" if goal is None else f"; goal <= {goal:g}x: {'met' if epd / plain <= goal else 'MISSED'}"
        lines.append(f"  {what:<16}: EPD median {1000 * epd:.0f} ms vs plain {1000 * plain:.0f} ms "
                     f"({epd / plain:.2f}x, {len(pairs)} requests{verdict})")
    return lines


def image_source(reqs: Sequence[DemoRequest], before: Snapshot, after: Snapshot) -> str:
    """Where prefill/decode took one step's images from, from the deltas of the
    proxy's and the consumer's /metrics: fetched from S3, encoded locally (a promise
    not kept, or no params), or neither: still in its own encoder cache."""
    n = len(reqs)
    without = metric_delta(after.proxy, before.proxy, P + "items_without_params_total") or 0.0
    # Downloaded (scheduler side, always reported), or loaded where the worker's
    # counter is reported.
    fetched_src = [v for v in (metric_delta(after.consumer, before.consumer, M_LOADED),
                               metric_delta(after.consumer, before.consumer, M_DOWNLOADED)) if v is not None]
    if not fetched_src:
        return "n/a: the consumer exports no ec-s3 counters"
    fetched = int(max(fetched_src))
    local = int((metric_delta(after.consumer, before.consumer, M_FALLBACKS) or 0.0) + without)
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
    return ", ".join(pd) or "n/a"

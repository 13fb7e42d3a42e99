"""The summary of ``ec-s3 demo --topology aggregated``: two ``ec_both`` servers on one
bucket behind the ec-s3 proxy (affinity routing, no encoder).

It checks that each distinct image was encoded once across the servers and that every
answer equals the plain server's. Owns the fleet's scrapes (:class:`FleetSnapshot`), their
deltas and the lines printed. Does not own running anything
(:mod:`ec_s3.demo.aggregated`), the EPD summary (:mod:`ec_s3.demo.report`) nor the
metrics themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ec_s3.cli.common import format_bytes
from ec_s3.demo.chat import AGAIN, FLEET, FRESH, ChatResult, DemoRequest, compare_results
from ec_s3.demo.report import Out, fmt_bytes, fmt_num, metric_delta, print_verdict, settle
from ec_s3.sandbox.metrics import MetricSamples

__all__ = ["FleetSnapshot", "FleetWindows", "ServerCounts", "print_fleet_summary", "server_counts", "settle_fleet"]

M = "vllm:ec_s3_"
M_ENCODED, M_LOADED, M_DOWNLOADED = M + "items_encoded_total", M + "blobs_loaded_total", M + "blobs_downloaded_total"
M_UPLOADED, M_UPLOADED_BYTES, M_LOOKUPS = M + "blobs_uploaded_total", M + "bytes_uploaded_total", M + "lookups_total"
M_FALLBACKS, M_PRESENT = M + "fallbacks_local_total", M + "uploads_already_present_total"
PICKS = "ec_s3_proxy_route_picks_total"


@dataclass
class FleetSnapshot:
    """Each server's /metrics (by its name, "A", "B") and the proxy's, at one point."""

    servers: dict[str, MetricSamples]
    proxy: MetricSamples
    blobs: frozenset[str] | None = None  # blob keys under the run's prefix (bucket listing)


@dataclass
class FleetWindows:
    """The aggregated phase's scrapes: ``start`` after the warm-ups, ``published`` after
    the images published for another front, ``steps[n]`` after step ``n`` of the schedule
    (each after both servers ran one more engine step, which reports uploads)."""

    start: FleetSnapshot
    published: FleetSnapshot
    steps: dict[int, FleetSnapshot] = field(default_factory=dict)

    @property
    def final(self) -> FleetSnapshot:
        return self.steps[max(self.steps)] if self.steps else self.published


@dataclass(frozen=True)
class ServerCounts:
    """What one server did between two scrapes (None: it exports no such counter)."""

    encoded: float | None
    loaded: float | None
    downloaded: float | None
    uploaded: float | None
    uploaded_bytes: float | None
    lookup_hits: float | None
    lookup_misses: float | None
    fallbacks: float | None


def worker_reported(final: MetricSamples) -> bool:
    """Whether a server's worker-side counters (uploads, loads) reach its /metrics at all
    (:mod:`ec_s3.connector.metrics`): one of them moved in the run. Each server published
    its warm-up image or met it present, so a 0 for all of them means not reported, and
    then a 0 of loads means nothing."""
    return any((final.get(name) or 0.0) > 0 for name in (M_UPLOADED, M_PRESENT, M_LOADED))


def server_counts(before: MetricSamples, after: MetricSamples, *, loads_reported: bool = True) -> ServerCounts:
    def d(name: str, **labels: str) -> float | None:
        return metric_delta(after, before, name, **labels)

    return ServerCounts(d(M_ENCODED), d(M_LOADED) if loads_reported else None, d(M_DOWNLOADED), d(M_UPLOADED),
                        d(M_UPLOADED_BYTES), d(M_LOOKUPS, outcome="hit"), d(M_LOOKUPS, outcome="miss"),
                        d(M_FALLBACKS))


def _counters(m: MetricSamples) -> tuple[Any, ...]:
    """The connector's counters only (vLLM's other families move on every scrape)."""
    return tuple(s for s in m.samples if s[0].startswith(M) and s[0].endswith("_total"))


def settle_fleet(scrape: Callable[[], FleetSnapshot]) -> FleetSnapshot:
    """Scrape until two reads of every server's connector counters agree (:func:`settle`)."""
    return settle(scrape, key=lambda snap: tuple(_counters(m) for m in snap.servers.values()))


def _picks(before: FleetSnapshot, after: FleetSnapshot, urls: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Server name -> route-pick outcome -> picks between the two scrapes."""
    out: dict[str, dict[str, float]] = {}
    for name, url in urls.items():
        for outcome in ("affinity", "spill", "no_media"):
            v = metric_delta(after.proxy, before.proxy, PICKS, upstream=url, outcome=outcome)
            if v:
                out.setdefault(name, {})[outcome] = v
    return out


def _what_it_did(c: ServerCounts, n: int) -> str:
    """One server's ``n`` requests of a step: encoded, loaded from the bucket into vLLM's
    encoder cache, or cached (that cache still held the image); and GETs whose blob vLLM
    did not need (ec_both waits for the GET of an image it published itself, whether or
    not its encoder cache still holds it)."""
    if c.encoded is None:
        return "n/a (no ec-s3 counters)"
    encoded, loaded, gets = int(c.encoded), int(c.loaded or 0), int(c.downloaded or 0)

    def times(k: int) -> str:
        return f"{k}x " if n > 1 else ""

    parts = []
    if encoded:
        parts.append(f"{times(encoded)}encoded")
    if loaded:
        parts.append(f"{times(loaded)}loaded from S3")
    cached = n - encoded - loaded
    if cached > 0:
        parts.append(f"{times(cached)}cached" if c.loaded is not None else f"{times(cached)}cached or loaded")
    if gets > loaded and c.loaded is not None:
        parts.append(f"{gets - loaded} GET unused")
    return ", ".join(parts)


def _step_cells(before: FleetSnapshot, after: FleetSnapshot, urls: Mapping[str, str], n: int,
                loads: Mapping[str, bool]) -> tuple[str, str, str | None]:
    """(the server(s) the proxy picked in one step, what each did there, the server if
    it was one), from the step's deltas."""
    picks = _picks(before, after, urls)
    if not picks:
        return "n/a", "n/a (no route picks counted)", None

    def did(name: str, k: int) -> str:
        return _what_it_did(server_counts(before.servers[name], after.servers[name], loads_reported=loads[name]), k)

    served = "+".join(name + (" (spill)" if p.get("spill") else "") for name, p in picks.items())
    if len(picks) == 1:
        name = next(iter(picks))
        return served, did(name, n), name
    return served, "; ".join(f"{name}: {did(name, int(sum(p.values())))}" for name, p in picks.items()), None


def _print_requests(out: Out, schedule: Sequence[Sequence[DemoRequest]], baseline: Mapping[int, ChatResult],
                    results: Mapping[int, ChatResult], windows: FleetWindows, urls: Mapping[str, str],
                    published: Mapping[int, str], loads: Mapping[str, bool], tolerance: float,
                    repeats: dict[str, int]) -> int:
    """The per-request table and its legend; counts where each repeat went into
    ``repeats`` and returns how many answers equal the baseline's."""
    rows, matches = [], 0
    holder: dict[int, str] = dict(published)  # image seed -> the server that encoded or published it
    prev = windows.published
    for step_reqs in schedule:
        snap = windows.steps.get(step_reqs[0].step)
        if snap is None:
            served, did, only = "n/a", "n/a (not scraped)", None
        else:
            served, did, only = _step_cells(prev, snap, urls, len(step_reqs), loads)
            prev = snap
        for r in step_reqs:
            if r.image_seed in holder:
                at = "unknown" if only is None else "holder" if only == holder[r.image_seed] else "other"
                repeats[at] += 1
            elif only is not None:
                holder[r.image_seed] = only
        for k, r in enumerate(step_reqs):
            got, want = results[r.index], baseline[r.index]
            same, verdict = compare_results(got, want, tolerance)
            matches += same
            rows.append((f"{r.index}{'*' if len(step_reqs) > 1 else ''}", r.image_label, r.kind,
                         f"{1000 * got.latency_s:.0f}" if got.ok else f"HTTP {got.status}",
                         f"{1000 * want.latency_s:.0f}", served if k == 0 else '"', did if k == 0 else '"', verdict))
    header = ("req", "image", "kind", "fleet ms", "base ms", "server", "on that server", "vs baseline")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    out("")
    out("  per request: latency through the proxy (fleet) and on the plain server (base), the server the proxy")
    out("  picked (rendezvous hashing on the image) and what that server did, from its /metrics:")
    for row in (header, tuple("-" * w for w in widths), *rows):
        out("  " + "  ".join(c.rjust(w) if i in (3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    pub = ", ".join(f"img-{s} by {n}" for s, n in sorted(published.items()))
    out("  * = sent at once; kind: fresh = no server of the fleet had the image, again = sent earlier in the")
    out(f"  schedule, fleet = published before the schedule as for another front of this fleet ({pub or 'none'});")
    out("  cached = neither encoded nor loaded: vLLM's encoder cache on that server still held it; GET unused =")
    out("  the connector fetched the blob all the same (a server waits for the GET of an image it published)")
    return matches


def _print_servers(out: Out, windows: FleetWindows, urls: Mapping[str, str],
                   loads: Mapping[str, bool]) -> dict[str, float | None]:
    """Each server's counts over the phase; returns the fleet's totals (None: n/a on some server)."""
    start, final = windows.start, windows.final
    out("")
    out("  per server, over the phase (warm-ups excluded, the publishing for another front included):")
    totals: dict[str, float | None] = {"encoded": 0.0, "loaded": 0.0, "downloaded": 0.0, "uploaded": 0.0}
    for name in urls:
        c = server_counts(start.servers[name], final.servers[name], loads_reported=loads[name])
        picks = _picks(windows.published, final, {name: urls[name]}).get(name, {})
        for key, total in totals.items():
            v = getattr(c, key)
            totals[key] = None if v is None or total is None else total + v  # n/a if any server's is
        out(f"  server {name}    : {fmt_num(sum(picks.values()))} requests routed here "
            f"(affinity {fmt_num(picks.get('affinity', 0.0))}, spill {fmt_num(picks.get('spill', 0.0))}); "
            f"encoded {fmt_num(c.encoded)} items, loaded {fmt_num(c.loaded)} from the bucket")
        out(f"                ({fmt_num(c.downloaded)} GETs; lookups hit {fmt_num(c.lookup_hits)} / miss "
            f"{fmt_num(c.lookup_misses)}), uploaded {fmt_num(c.uploaded)} blobs / "
            f"{fmt_bytes(c.uploaded_bytes)}; local fallbacks "
            f"{fmt_num(c.fallbacks)}; {urls[name]}")
    return totals


def _print_latency(out: Out, requests: Sequence[DemoRequest], baseline: Mapping[int, ChatResult],
                   results: Mapping[int, ChatResult]) -> None:
    ok_pairs = [(results[r.index].latency_s, baseline[r.index].latency_s) for r in requests
                if results[r.index].ok and baseline[r.index].ok]
    if not ok_pairs:
        return
    med_f, med_b = statistics.median(f for f, _ in ok_pairs), statistics.median(b for _, b in ok_pairs)
    out(f"  latency     : fleet median {1000 * med_f:.0f} ms vs plain {1000 * med_b:.0f} ms ({med_f / med_b:.2f}x)")
    for kind in (FRESH, AGAIN, FLEET):
        pairs = [(results[r.index].latency_s, baseline[r.index].latency_s) for r in requests
                 if r.kind == kind and results[r.index].ok and baseline[r.index].ok]
        if pairs:
            f, b = statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
            out(f"    {kind:<9} : fleet median {1000 * f:.0f} ms vs plain {1000 * b:.0f} ms "
                f"({f / b:.2f}x, {len(pairs)} requests)")


def print_fleet_summary(out: Out, schedule: Sequence[Sequence[DemoRequest]], baseline: Mapping[int, ChatResult],
                        results: Mapping[int, ChatResult], windows: FleetWindows, urls: Mapping[str, str],
                        published: Mapping[int, str], blobs: list[Any] | None, prefix: str,
                        timings: Mapping[str, float], tolerance: float) -> bool:
    """The per-request table, the per-server counts and the claim; True only if every
    answer equals the baseline's (token ids, logprobs within ``tolerance``).
    ``urls``: server name -> URL (the proxy's upstream label); ``published``: image seed
    -> the server that published it for another front before the schedule."""
    requests = [r for step in schedule for r in step]
    loads = {name: worker_reported(windows.final.servers[name]) for name in urls}
    repeats: dict[str, int] = {"holder": 0, "other": 0, "unknown": 0}
    matches = _print_requests(out, schedule, baseline, results, windows, urls, published, loads, tolerance, repeats)
    totals = _print_servers(out, windows, urls, loads)
    distinct = len({r.image_seed for r in requests})
    encoded = totals["encoded"]
    verdict = ("each encoded once" if encoded == distinct
               else "n/a: a server exports no ec-s3 counters" if encoded is None
               else f"<-- expected {distinct}: one encode per distinct image")
    out(f"  encoded     : {fmt_num(encoded)} items across the {len(urls)} servers for {distinct} distinct images "
        f"sent: {verdict}")
    out(f"                and {fmt_num(totals['loaded'])} loaded from the bucket ({fmt_num(totals['downloaded'])} GETs), "
        f"{fmt_num(totals['uploaded'])} blobs published (both servers)")
    n_rep = sum(repeats.values())
    out(f"  repeats     : {n_rep} requests of an image sent or published before: {repeats['holder']} went to the "
        f"server holding it, {repeats['other']} to the other"
        + (f", {repeats['unknown']} n/a (a step picked both servers)" if repeats["unknown"] else ""))
    if blobs is None:
        out("  bucket      : n/a (listing failed)")
    else:
        known = windows.start.blobs or frozenset()
        new = [o for o in blobs if o.key not in known]
        flag = "" if len(new) == distinct else f"   <-- expected {distinct}: one per distinct image"
        out(f"  bucket      : {len(new)} new blobs, {format_bytes(sum(o.size for o in new))} under {prefix}/ for "
            f"{distinct} distinct images{flag} (+{len(blobs) - len(new)} from the warm-ups)")
    _print_latency(out, requests, baseline, results)
    return print_verdict(out, matches, len(requests), tolerance, timings, against="the plain server's",
                         phase=("aggregated", "aggregated"),
                         verdicts=("the aggregated fleet's answers equal the baseline's",
                                   "some of the aggregated fleet's answers differ from the baseline's"))

"""Phase 4 of ``ec-s3 demo --topology aggregated`` and its summary.

Owns the fleet: two ``ec_both`` servers on one bucket, each with a private staging dir
(as on two hosts), behind the ec-s3 proxy with affinity routing and no encoder; the
images published before the schedule through the server that ranks first for them; the
scrapes around each step. Does not own the EPD topology (:mod:`ec_s3.demo.epd`), the
summary's lines (:mod:`ec_s3.demo.fleet_report`) nor the routing (:mod:`ec_s3.proxy`).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import time
from typing import Any

from ec_s3.demo.chat import QUESTIONS, ChatResult, DemoRequest, chat_body, post_chat
from ec_s3.demo.context import FLEET_SEEDS, DemoContext, Setup
from ec_s3.demo.fleet_report import FleetSnapshot, FleetWindows, print_fleet_summary, settle_fleet
from ec_s3.demo.report import run_blobs
from ec_s3.sandbox.metrics import scrape_metrics
from ec_s3.sandbox.vllm_server import (
    LoadProgress,
    ServerError,
    VllmServer,
    ec_transfer_config,
    start_all,
    wait_all_ready,
)

__all__ = ["run_aggregated"]


def run_aggregated(demo: DemoContext, stack: contextlib.ExitStack, setup: Setup,
                   baseline: dict[int, ChatResult]) -> tuple[bool, list[VllmServer], Any]:
    """Phase 4 and the summary of ``--topology aggregated``: (every answer equal to the
    baseline's, the two servers, the proxy)."""
    t = time.monotonic()
    demo.step(4, "aggregated: two ec_both servers on one bucket + ec-s3 proxy (affinity routing, no encoder)")
    servers, urls, proxy = _start(demo, stack, setup)
    fleet = list(servers.values())
    # Each server directly (the proxy would warm one): a fresh server's first image
    # request is seconds slower. Both encode img-0; it is outside the counted window.
    warm = [demo.warm_up(s.url, setup.model) for s in fleet]
    results, windows, published = _measured_schedule(
        demo, setup, servers, urls, proxy, t,
        f"warm-up requests {warm[0].latency_s:.1f} s (A), {warm[1].latency_s:.1f} s (B)")
    blobs = run_blobs(setup.store, setup.prefix, demo.out)
    if not demo.args.keep_running:
        demo.stop(fleet, proxy)
    demo.step(5, "summary")
    ok = print_fleet_summary(demo.out, demo.schedule, baseline, results, windows, urls, published, blobs,
                             setup.prefix, demo.timings, demo.args.logprob_tolerance)
    return ok, fleet, proxy


def _start(demo: DemoContext, stack: contextlib.ExitStack,
           setup: Setup) -> tuple[dict[str, VllmServer], dict[str, str], Any]:
    """(servers by name, their URLs as the proxy spells them, the proxy): started,
    loaded, and stopped (staging dirs removed) when ``stack`` closes."""
    from ec_s3.proxy.server import ProxyConfig, ProxyThread

    servers: dict[str, VllmServer] = {}
    for name in ("A", "B"):
        # A private staging area each (mkdtemp makes it 0o700), as on two hosts: the
        # default (/dev/shm) is one host's, and both servers would share it.
        staging = tempfile.mkdtemp(prefix=f"ec-s3-demo-staging-{name.lower()}-")
        stack.callback(shutil.rmtree, staging, True)  # registered first: runs after the stop
        config = ec_transfer_config("ec_both", {**setup.extra_config, "staging_dir": staging})
        servers[name] = VllmServer(setup.model, name=f"server-{name.lower()}", args=setup.server_args,
                                   env=setup.env, ec_transfer_config=config,
                                   log_path=setup.log_dir / f"server-{name.lower()}.log")
        stack.callback(servers[name].stop)
    fleet = list(servers.values())
    start_all(fleet)
    demo.out(f"      server A: {servers['A'].placement}; server B: {servers['B'].placement}")
    wait_all_ready(fleet, demo.args.load_timeout, progress=LoadProgress())
    proxy_config = ProxyConfig(encoder_urls=[], pd_urls=[s.url for s in fleet], port=0)
    urls = dict(zip(servers, proxy_config.pd_urls))  # as the proxy spells them: its metrics' labels
    proxy = ProxyThread(proxy_config)
    stack.callback(proxy.stop)
    proxy.start()
    demo.out(f"      server A {urls['A']}, server B {urls['B']}, proxy {proxy.url}")
    return servers, urls, proxy


def _measured_schedule(demo: DemoContext, setup: Setup, servers: dict[str, VllmServer], urls: dict[str, str],
                       proxy: Any, started: float,
                       warm_up: str) -> tuple[dict[int, ChatResult], FleetWindows, dict[int, str]]:
    """The fleet images published, then the schedule through the proxy with every
    server's metrics settled before, between the two and after each step; returns the
    answers, the windows and seed -> the server that published it."""
    model, store, prefix = setup.model, setup.store, setup.prefix
    fleet = list(servers.values())

    def scrape() -> FleetSnapshot:
        return FleetSnapshot({n: s.metrics() for n, s in servers.items()}, scrape_metrics(f"{proxy.url}/metrics"))

    def flush() -> FleetSnapshot:
        for s in fleet:  # a server reports its uploads with its next engine step: give each one
            demo.nudge(s.url, model)
        return settle_fleet(scrape)

    start = flush()
    listed = run_blobs(store, prefix, demo.out)
    start.blobs = None if listed is None else frozenset(o.key for o in listed)
    published = _publish_through_holders(demo, servers, urls, model, store, prefix)
    windows = FleetWindows(start, flush())

    def after_step(step: int, reqs: list[DemoRequest]) -> None:
        windows.steps[step] = flush()

    results = demo.run_phase_schedule(proxy.url, model, "aggregated", after_step, started, warm_up,
                                      id_prefix="fleet")
    return results, windows, published


def _publish_through_holders(demo: DemoContext, servers: dict[str, VllmServer], urls: dict[str, str], model: str,
                             store: Any, prefix: str) -> dict[int, str]:
    """Each image of :data:`FLEET_SEEDS` is sent to the server that ranks first for it
    (the proxy's rendezvous order over the same URLs), as another front of this fleet
    would have routed it: that server encodes and publishes it. Waits until the blobs
    are listed; returns seed -> server name. Not through a fixed server: the other one,
    sent the image later, would encode it again (docs/architecture.md, the demo's phase 4)."""
    from ec_s3.proxy.media import find_media_items
    from ec_s3.proxy.naming import name_media
    from ec_s3.proxy.routing import rendezvous_order, route_key

    names = list(urls)
    before = len(run_blobs(store, prefix, demo.out) or [])
    published: dict[int, str] = {}
    for seed in FLEET_SEEDS:
        # Named as the proxy names it (content uuids): the same identifier, hence blob key.
        body = name_media(chat_body(model, seed, QUESTIONS[0], max_tokens=demo.args.max_tokens, photo=demo.photo),
                          give_uuids=True)
        key = route_key(find_media_items(body))
        if key is None:
            raise ServerError(f"img-{seed}: the request has no media item to route by")
        name = names[rendezvous_order(key, [urls[n] for n in names])[0]]
        r = post_chat(servers[name].url, body, timeout=demo.args.request_timeout,
                      request_id=f"other-front-{seed}-{secrets.token_hex(3)}")
        if not r.ok:
            raise ServerError(f"server {name} failed img-{seed} for another front: HTTP {r.status}: {r.error}")
        published[seed] = name
    demo.wait_listed([s.url for s in servers.values()], model, store, prefix, before + len(FLEET_SEEDS),
                     f"the blobs of the {len(FLEET_SEEDS)} images published for another front")
    demo.out("      published " + ", ".join(f"img-{s} through server {n}" for s, n in published.items())
             + " for another front of this fleet (each through the server that ranks first for it)")
    return published

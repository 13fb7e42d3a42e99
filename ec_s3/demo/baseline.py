"""Phase 3 of ``ec-s3 demo``: the answers every later answer is compared with.

Owns the plain vLLM server (no EC connector, no S3 credentials: it cannot touch the
bucket), its warm-up and the schedule through it; the server is stopped before phase 4.
Does not own the comparison (:mod:`ec_s3.demo.report`) nor the requests
(:mod:`ec_s3.demo.chat`).
"""

from __future__ import annotations

import time

from ec_s3.demo.chat import ChatResult, run_schedule
from ec_s3.demo.context import DemoContext, Setup
from ec_s3.sandbox.vllm_server import LoadProgress, VllmServer, wait_all_ready

__all__ = ["run_baseline"]


def run_baseline(demo: DemoContext, setup: Setup) -> dict[int, ChatResult] | None:
    """The plain server's answers by request index; None (printed) if a request failed."""
    out, model = demo.out, setup.model
    t = time.monotonic()
    demo.step(3, "baseline: one plain vLLM server (no EC connector), the same requests")
    # No ec_transfer_config and no S3 credentials: this server cannot touch the bucket.
    server = VllmServer(model, name="baseline", args=setup.server_args,
                        env={**setup.env, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
                        log_path=setup.log_dir / "baseline.log")
    with server:
        out(f"      baseline: {server.placement}")
        wait_all_ready([server], demo.args.load_timeout, progress=LoadProgress())
        warm = demo.warm_up(server.url, model)
        t_req = time.monotonic()
        results = run_schedule(server.url, model, demo.schedule, max_tokens=demo.args.max_tokens,
                               timeout=demo.args.request_timeout, id_prefix="baseline", photo=demo.photo)
        demo.timings["baseline_requests"] = time.monotonic() - t_req
    demo.timings["baseline"] = time.monotonic() - t
    bad = [i for i, r in results.items() if not r.ok]
    out(f"      warm-up request {warm.latency_s:.1f} s; {len(results)} requests in "
        f"{demo.timings['baseline_requests']:.2f} s; server stopped ({demo.timings['baseline']:.0f} s for the phase)")
    if bad:
        for i in bad:
            out(f"      request {i} failed: HTTP {results[i].status}: {results[i].error}")
        return None
    return results

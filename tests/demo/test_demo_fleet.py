"""The summary of ``ec-s3 demo --topology aggregated`` (:mod:`ec_s3.demo.fleet_report`)
from synthetic scrapes: which server each request went to and what it did there, the
per-server counts, and the claim (each distinct image encoded once across the fleet).
The demo itself runs in tests/e2e/test_e2e.py (slow)."""

from __future__ import annotations

import io
from collections import namedtuple

from ec_s3.demo.chat import AGAIN, FLEET, FRESH, ChatResult, DemoRequest
from ec_s3.demo.fleet_report import FleetSnapshot, FleetWindows, print_fleet_summary
from ec_s3.demo.report import Out
from ec_s3.sandbox.metrics import MetricSamples, parse_prometheus

URLS = {"A": "http://127.0.0.1:1001", "B": "http://127.0.0.1:1002"}
Q = "What is in this picture?"
Obj = namedtuple("Obj", "key size")


def _server(encoded: int, loaded: int, uploaded: int, gets: int | None = None) -> MetricSamples:
    return parse_prometheus(f"vllm:ec_s3_items_encoded_total {encoded}\n"
                            f"vllm:ec_s3_blobs_loaded_total {loaded}\n"
                            f"vllm:ec_s3_blobs_downloaded_total {loaded if gets is None else gets}\n"
                            f"vllm:ec_s3_blobs_uploaded_total {uploaded}\n"
                            f"vllm:ec_s3_bytes_uploaded_total {uploaded * 1024}\n")


def _proxy(**picks: int) -> MetricSamples:
    """``A_affinity=2``: picks of server A by affinity."""
    lines = [f'ec_s3_proxy_route_picks_total{{role="prefill_decode",upstream="{URLS[k.split("_")[0]]}",'
             f'outcome="{k.split("_", 1)[1]}"}} {v}' for k, v in picks.items()]
    return parse_prometheus("\n".join(lines) + "\n")


def _snap(a: tuple[int, ...], b: tuple[int, ...], **picks: int) -> FleetSnapshot:
    return FleetSnapshot({"A": _server(*a), "B": _server(*b)}, _proxy(**picks))


def _run(encodes_twice: bool = False, differ: bool = False, to_other: bool = False) -> tuple[bool, str]:
    """Warm-ups (each server encoded img-0: outside the window), B publishes img-5 for
    another front, then: img-1 to A (encoded), img-2 to B (encoded), img-1 again to A
    (its encoder cache still held it; the GET of an image A published was not needed),
    img-5 to B (evicted from its encoder cache: loaded from the bucket).
    ``encodes_twice``: B encodes img-5 again instead; ``to_other``: img-1's repeat goes to B."""
    start = _snap((1, 0, 1), (1, 0, 0))
    start.blobs = frozenset({"p/img0.safetensors"})
    w = FleetWindows(start, _snap((1, 0, 1), (2, 0, 1)))
    w.steps[1] = _snap((2, 0, 2), (2, 0, 1), A_affinity=1)
    w.steps[2] = _snap((2, 0, 2), (3, 0, 2), A_affinity=1, B_affinity=1)
    if to_other:
        w.steps[3] = _snap((2, 0, 2), (3, 1, 2), A_affinity=1, B_affinity=1, B_spill=1)
    else:
        w.steps[3] = _snap((2, 0, 2, 1), (3, 0, 2), A_affinity=2, B_affinity=1)
    a3 = (2, 0, 2, 0 if to_other else 1)
    b3 = (3, 1, 2) if to_other else (3, 0, 2)
    picks = {"A_affinity": 1, "B_affinity": 2, "B_spill": 1} if to_other else {"A_affinity": 2, "B_affinity": 2}
    w.steps[4] = (_snap(a3, (b3[0] + 1, b3[1], 2, b3[1]), **picks) if encodes_twice
                  else _snap(a3, (b3[0], b3[1] + 1, 2), **picks))
    schedule = [[DemoRequest(1, 1, 1, Q, FRESH)], [DemoRequest(2, 2, 2, Q, FRESH)],
                [DemoRequest(3, 3, 1, Q, AGAIN)], [DemoRequest(4, 4, 5, Q, FLEET)]]
    base = {i: ChatResult(200, 0.1, [5, 6], [-0.5, -0.25]) for i in range(1, 5)}
    got = {i: ChatResult(200, 0.08, [5, 6] if not (differ and i == 4) else [5, 7], [-0.5, -0.25]) for i in range(1, 5)}
    blobs = [Obj(f"p/img{n}.safetensors", 2048) for n in (0, 1, 2, 5)]
    buf = io.StringIO()
    ok = print_fleet_summary(Out(buf), schedule, base, got, w, URLS, {5: "B"}, blobs, "p", {}, 0.0)
    return ok, buf.getvalue()


def _row(out: str, req: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [req])


def test_each_request_shows_the_server_picked_and_what_it_did() -> None:
    ok, out = _run()
    assert ok, out
    assert " A " in _row(out, "1") and "encoded" in _row(out, "1")
    assert " B " in _row(out, "2") and "encoded" in _row(out, "2")
    assert " A " in _row(out, "3") and "cached, 1 GET unused" in _row(out, "3")
    assert " B " in _row(out, "4") and "loaded from S3" in _row(out, "4") and "encoded" not in _row(out, "4")
    assert "img-5 by B" in out
    assert "repeats     : 2 requests of an image sent or published before: 2 went to the server holding it, 0 " in out


def test_a_repeat_sent_to_the_other_server_is_counted_as_such() -> None:
    ok, out = _run(to_other=True)
    assert ok, out
    assert "B (spill)" in _row(out, "3") and "loaded from S3" in _row(out, "3")
    assert "2 requests of an image sent or published before: 1 went to the server holding it, 1 to the other" in out


def test_per_server_counts_and_the_claim() -> None:
    ok, out = _run()
    # Over the phase from the warm-ups on: A encoded img-1; B published img-5 and encoded img-2.
    assert "server A    : 2 requests routed here (affinity 2, spill 0); encoded 1 items, loaded 0" in out, out
    assert "(1 GETs; lookups hit n/a / miss n/a), uploaded 1 blobs" in out
    assert "server B    : 2 requests routed here (affinity 2, spill 0); encoded 2 items, loaded 1" in out, out
    assert "uploaded 2 blobs" in out
    assert "encoded     : 3 items across the 2 servers for 3 distinct images sent: each encoded once" in out
    assert "bucket      : 3 new blobs" in out and "expected" not in out
    assert "outputs     : 4/4 answers equal" in out and out.rstrip().endswith("equal the baseline's")


def test_an_image_encoded_by_both_servers_is_flagged() -> None:
    ok, out = _run(encodes_twice=True)
    assert ok  # the answers still match: the flag is the summary's, the exit status the answers'
    assert "encoded     : 4 items across the 2 servers for 3 distinct images sent: <-- expected 3" in out
    assert "encoded" in _row(out, "4") and "loaded" not in _row(out, "4")


def test_loads_are_n_a_where_a_servers_worker_counters_are_not_reported() -> None:
    """No worker counter of B ever moved (no upload, no load, though it encoded and
    published): its 0 loads mean nothing, and its GETs are not called unused."""
    from ec_s3.demo import fleet_report

    w_final = _snap((2, 0, 2, 1), (3, 0, 0, 1))
    assert fleet_report.worker_reported(w_final.servers["A"]) and not fleet_report.worker_reported(w_final.servers["B"])
    c = fleet_report.server_counts(_server(2, 0, 0), _server(2, 0, 0, 1), loads_reported=False)
    assert c.loaded is None and fleet_report._what_it_did(c, 1) == "cached or loaded"


def test_a_different_answer_fails_the_run() -> None:
    ok, out = _run(differ=True)
    assert not ok
    assert "DIFFERENT tokens" in _row(out, "4") and "outputs     : 3/4 answers equal" in out
    assert out.rstrip().endswith("FAIL: some of the aggregated fleet's answers differ from the baseline's")


def test_the_demos_encoder_limit_is_the_proxys_with_a_model_and_30_s_on_cpu() -> None:
    """With --model the proxy keeps its GPU-sized default; the offline tiny model on CPU
    cores gets 30 s (``ec-s3 demo --model X`` once died here with NameError: ProxyConfig)."""
    from ec_s3.demo.run import CPU_ENCODE_TIMEOUT_S, _Demo, build_parser
    from ec_s3.proxy.config import ProxyConfig

    def limit(*argv: str) -> float:
        return _Demo(build_parser().parse_args(list(argv)), {}, Out(io.StringIO()))._encode_timeout_s()

    assert limit("--model", "Qwen/Qwen2.5-VL-3B-Instruct") == ProxyConfig.encode_timeout_s
    assert limit() == CPU_ENCODE_TIMEOUT_S

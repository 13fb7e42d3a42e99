"""bench/ttft.py without engines: its goal ratios and summary rows, what it sends an
encoder to publish a repeated image, and its streaming client's time to first token
(against a scripted SSE server on loopback)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bench import ttft


def _samples(ttft_ms: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {st: {p: {"ttft_s": [], "e2e_s": []} for p in ttft.PATHS} for st in ttft.SETS}
    for (st, p), values in ttft_ms.items():
        out[st][p]["ttft_s"] = [v / 1e3 for v in values]
        out[st][p]["e2e_s"] = [2 * v / 1e3 for v in values]
    return out


def test_ratios_are_ratios_of_medians_per_goal_with_met_and_not_measured() -> None:
    s = _samples({("fresh", "parallel"): [70, 80, 900], ("fresh", "serial"): [100, 100, 100],
                  ("fresh", "vllm-proxy"): [80, 90, 100], ("repeated", "parallel"): [60, 60],
                  ("repeated", "plain"): []})
    r = ttft.ratios(s)
    assert set(r) == {g[0] for g in ttft.GOALS}
    par_ser = r["parallel / serial TTFT, fresh images"]
    assert par_ser["ttft_ratio"] == pytest.approx(0.8) and par_ser["met"] is True  # median 80 / 100: an outlier ignored
    assert par_ser["e2e_ratio"] == pytest.approx(0.8) and par_ser["n"] == [3, 3]
    vs_vllm = r["parallel / vLLM proxy + ECExampleConnector TTFT, fresh images"]
    assert vs_vllm["ttft_ratio"] == pytest.approx(80 / 90) and vs_vllm["met"] is True
    repeated = r["repeated images: EPD (parallel) / plain TTFT"]
    assert repeated["ttft_ratio"] is None and repeated["met"] is None  # plain has no sample: not measured


def test_goal_rows_say_met_missed_or_not_measured_and_why() -> None:
    s = _samples({("fresh", "parallel"): [90], ("fresh", "serial"): [100], ("fresh", "vllm-proxy"): [200],
                  ("repeated", "parallel"): [50], ("repeated", "plain"): [100], ("fresh", "plain"): [40],
                  ("repeated", "serial"): [60], ("repeated", "vllm-proxy"): [70]})
    d = {"goals": ttft.ratios(s), "encoder_calibration": {"encoder_step_s": {"median": 0.03, "n": 4}},
         "latency_s": {st: {p: {m: {"median": v[0], "n": 1} if v else {"n": 0} for m, v in ms.items()}
                            for p, ms in paths.items()} for st, paths in s.items()},
         "params": {"shape": {"image_size": 112, "vision_layers": 8, "vision_hidden": 128}},
         "ecs3_parts_p50_s": {"fresh": {"parallel": {"consumer:vllm:ec_s3_download_seconds": 0.004}}}}
    rows = {r["case"]: r for r in ttft.goal_rows(d)}
    assert rows["parallel / serial TTFT, fresh images"]["status"] == "MISSED"
    why = rows["parallel / serial TTFT, fresh images"]["why"]
    assert "parallel 90 vs serial 100 ms" in why and "parallel: GET 4 ms; serial: no breakdown" in why
    assert rows["repeated images: EPD (parallel) / plain TTFT"]["status"] == "met"
    assert rows["repeated images: EPD (parallel) / plain TTFT"]["why"] == ""
    assert rows["parallel / vLLM proxy + ECExampleConnector TTFT, fresh images"]["result"].startswith("0.45x TTFT")
    unmeasured = ttft.goal_rows(None)
    assert [r["status"] for r in unmeasured] == ["not measured"] * len(ttft.GOALS)
    assert all("python -m bench.ttft" in r["why"] for r in unmeasured)
    measured = ttft.measurement_rows(d)
    assert any("fresh images: parallel" in r[1] and r[2].startswith("90 / 180 ms") for r in measured)
    assert measured[-1][2].startswith("30.0 ms") and measured[-1][4] == "yes"


def test_repeated_images_are_published_under_the_name_each_proxy_gives_them() -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]}]}
    parallel = ttft.encoder_request("parallel", body)
    serial = ttft.encoder_request("serial", body)
    vllm = ttft.encoder_request("vllm-proxy", body)
    (p_part,) = [p for p in parallel["messages"][0]["content"] if p.get("type") == "image_url"]
    (s_part,) = [p for p in serial["messages"][0]["content"] if p.get("type") == "image_url"]
    assert p_part["uuid"].startswith("ecs3-") and "uuid" not in s_part  # parallel names by content, serial does not
    assert vllm == {"model": "m", "messages": [{"role": "user", "content": [body["messages"][0]["content"][0]]}],
                    "max_tokens": 1, "stream": False}  # disagg_epd_proxy's encoder request, verbatim
    assert "uuid" not in body["messages"][0]["content"][0]  # the client's body is not modified


class _SSE(BaseHTTPRequestHandler):
    script: list[tuple[float, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delay, chunk in self.script:
            time.sleep(delay)
            self.wfile.write(chunk)
            self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def _stream_from_script() -> dict[str, Any]:
    """ttft.stream_chat against a loopback server that plays ``_SSE.script``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return ttft.stream_chat(f"http://127.0.0.1:{server.server_address[1]}", {"stream": True})
    finally:
        server.shutdown()
        server.server_close()


def _event(content: str | None) -> bytes:
    delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
    return b"data: " + json.dumps({"choices": [{"delta": delta}]}).encode() + b"\n\n"


@pytest.mark.parametrize("split", [False, True])
def test_stream_chat_times_the_first_chunk_with_content_not_the_role_chunk(split: bool) -> None:
    first = _event("Hel")
    parts = [first[:9], first[9:]] if split else [first]  # an event split across writes (vLLM's proxy: 1 KiB chunks)
    _SSE.script = [(0.0, _event(None)), (0.15, parts[0])] + [(0.0, p) for p in parts[1:]] + [
        (0.5, _event("lo")), (0.0, b"data: [DONE]\n\n")]
    r = _stream_from_script()
    assert r["error"] is None and r["text"] == "Hello" and r["chunks"] == 2
    # not the role chunk (sent at once), not the end of the stream (0.5 s after the first content)
    assert r["ttft_s"] >= 0.15 and r["e2e_s"] - r["ttft_s"] >= 0.45


def test_stream_chat_reports_errors_instead_of_raising() -> None:
    _SSE.script = [(0.0, b'data: {"error": {"message": "boom"}}\n\n')]
    r = _stream_from_script()
    assert "boom" in r["error"] and r["ttft_s"] is None
    closed = ttft.stream_chat("http://127.0.0.1:9", {"stream": True}, timeout=2)
    assert closed["error"] and closed["ttft_s"] is None

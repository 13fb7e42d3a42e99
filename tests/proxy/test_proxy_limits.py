"""The proxy's bounds and what it tells clients: fan-out and in-flight caps, bodies it
cannot read, error answers that name no upstream, and keys that stay where they belong.

Same fakes as tests/proxy/test_proxy.py (aiohttp servers on loopback); every scenario runs
under its own ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ec_s3.log import logger
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.main import build_parser, config_from_args
from ec_s3.sandbox.metrics import parse_prometheus
from test_proxy import FakePD, chat, dead_url, image, rig, run

pytestmark = pytest.mark.timeout(120)


def error_of(status: int, body: bytes) -> dict[str, Any]:
    """The OpenAI-style error object of an answer, checked for shape."""
    payload = json.loads(body)
    error = payload["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["type"], payload
    return error


@pytest.fixture
def proxy_log() -> Iterator[list[str]]:
    """Every line ec-s3's logger emits during the test, formatted."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


# --------------------------------------------------------------------------- fan-out cap
def test_too_many_media_items_is_a_400_and_reaches_no_upstream() -> None:
    async def scenario() -> None:
        async with rig() as r:
            assert r.proxy.config.max_items_per_request == 64  # the default
            status, body, _ = await r.post(chat(*(image(i) for i in range(200))))
            assert status == 400
            error = error_of(400, body)
            assert "200" in error["message"] and "64" in error["message"]
            assert r.encoders[0].bodies == [] and r.pds[0].bodies == []
            # Repeats count too: the consumer would still see 65 items.
            status, _, _ = await r.post(chat(*([image("same")] * 65)))
            assert status == 400 and r.encoders[0].bodies == []
            # At the cap: served, one encoder request per item.
            status, _, _ = await r.post(chat(*(image(i) for i in range(64))))
            assert status == 200 and len(r.encoders[0].bodies) == 64
        async with rig(max_items_per_request=2) as r:
            status, body, _ = await r.post(chat(image(1), image(2), image(3)))
            assert status == 400 and "at most 2" in error_of(400, body)["message"]
            assert r.encoders[0].bodies == []

    run(scenario())


# --------------------------------------------------------------------------- in-flight cap
def test_requests_beyond_max_in_flight_get_503_with_retry_after() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        pd = FakePD("pd0", chunks=3, gate_after_first=gate)
        async with rig(pds=[pd], max_in_flight=2) as r:
            url = f"{r.url}/v1/chat/completions"
            held = [await r.session.post(url, json=chat(image(i), stream=True)) for i in range(2)]
            for resp in held:  # both are in the relay now
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")
            status, body, headers = await r.post(chat(image(9)))
            assert status == 503
            assert int(headers["Retry-After"]) >= 1
            assert "2" in error_of(503, body)["message"]
            assert len(r.encoders[0].bodies) == 2  # the rejected one cost nothing upstream
            gate.set()
            for resp in held:
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
                resp.release()
            status, _, _ = await r.post(chat(image(10)))
            assert status == 200
            async with r.session.get(f"{r.url}/metrics") as resp:
                text = await resp.text()
            samples = parse_prometheus(text)
            assert samples.get("ec_s3_proxy_rejected_total", reason="overloaded") == 1
            assert samples.get("ec_s3_proxy_requests_in_flight") == 0

    run(scenario())


# --------------------------------------------------------------------------- bodies
def test_bodies_the_proxy_cannot_read_get_a_json_4xx_never_a_500() -> None:
    async def scenario() -> None:
        async with rig(max_body_bytes=64 * 1024) as r:
            url = f"{r.url}/v1/chat/completions"
            cases: list[tuple[str, bytes, int]] = [
                ("nested", b"[" * 30_000 + b"]" * 30_000, 400),
                ("nested_in_messages", json.dumps(chat()).replace('"Describe."', "[" * 50_000 + "]" * 50_000)
                 .encode()[: 64 * 1024 - 1], 400),
                ("too_big", json.dumps(chat(text="x" * 100_000)).encode(), 413),
            ]
            for name, raw, want in cases:
                async with r.session.post(url, data=raw, headers={"Content-Type": "application/json"}) as resp:
                    body = await resp.read()
                    assert resp.status == want, (name, resp.status, body[:200])
                    assert resp.headers["Content-Type"].startswith("application/json"), name
                    error_of(want, body)
            # Parts of the wrong types are the PD's to judge: forwarded, and vLLM's 400 relayed.
            weird = chat(
                {"type": ["image_url"], "image_url": {"url": "x"}},
                {"type": {"a": 1}}, {"type": "image_url", "image_url": 5}, 7, None, "text",
            )
            status, body, _ = await r.post(weird)
            assert status == 400 and len(r.pds[0].refused) == 1, body
            status, _, _ = await r.post({"messages": [{"content": [{"type": "image_embeds"}]}] * 3, "model": 5})
            assert status == 400 and len(r.pds[0].refused) == 2

    run(scenario())


# --------------------------------------------------------------------------- error answers
def test_error_answers_name_no_upstream_but_the_log_does(proxy_log: list[str]) -> None:
    async def scenario() -> None:
        def assert_hidden(body: bytes, *urls: str) -> None:
            for url in urls:
                port = url.rsplit(":", 1)[1]
                assert url.encode() not in body and port.encode() not in body, body
            assert b"127.0.0.1" not in body, body

        dead = [dead_url(), dead_url()]
        async with rig(encoders=[dead_url()], pds=dead) as r:
            status, body, _ = await r.post(chat(image(1)))
            assert status == 502
            assert error_of(502, body)["message"] == "prefill/decode server unavailable"
            assert_hidden(body, *dead)
            assert any(dead[0] in line for line in proxy_log)

        class Cut(FakePD):
            async def chat(self, request: web.Request) -> web.StreamResponse:
                await request.read()
                assert request.transport is not None
                request.transport.abort()  # the PD dies after the request reached it
                return web.Response()

        slow = FakePD("slow", delay=5)
        async with rig(pds=[slow], total_timeout_s=0.3) as r:
            status, body, _ = await r.post(chat(image(1)))
            assert status == 504
            assert error_of(504, body)["message"] == "prefill/decode server did not answer in time"
            assert_hidden(body, slow.url)
        cut = Cut("cut")
        async with rig(pds=[cut]) as r:
            status, body, _ = await r.post(chat(image(1)))
            assert status == 502
            assert error_of(502, body)["message"] == "prefill/decode server unavailable"
            assert_hidden(body, cut.url)
            assert any(cut.url in line for line in proxy_log)

    run(scenario())


# --------------------------------------------------------------------------- keys
def test_the_proxys_own_key_never_goes_upstream() -> None:
    async def scenario() -> None:
        async with rig(api_key="client-secret") as r:
            status, _, _ = await r.post(chat(image(1)), headers={"Authorization": "Bearer client-secret"})
            assert status == 200
            for headers in [*r.pds[0].headers, *r.encoders[0].headers]:
                assert "Authorization" not in headers
                assert not any("client-secret" in v for v in headers.values())
        async with rig(api_key="client-secret", upstream_api_key="vllm-key") as r:
            status, _, _ = await r.post(chat(image(1)), headers={"Authorization": "Bearer client-secret"})
            assert status == 200
            assert r.pds[0].headers[0]["Authorization"] == "Bearer vllm-key"
            assert r.encoders[0].headers[0]["Authorization"] == "Bearer vllm-key"

    run(scenario())


def test_keys_come_from_files_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file, up_file = tmp_path / "key", tmp_path / "upstream-key"
    key_file.write_text("from-file\n")
    up_file.write_text("  upstream-from-file  \n")
    args = build_parser().parse_args(
        ["--pd-url", "http://pd:1", "--api-key-file", str(key_file), "--upstream-api-key-file", str(up_file)]
    )
    config = config_from_args(args)
    assert (config.api_key, config.upstream_api_key) == ("from-file", "upstream-from-file")
    assert "from-file" not in repr(config) and "from-file" not in repr(args)
    monkeypatch.setenv("EC_S3_PROXY_API_KEY", "from-env")
    monkeypatch.setenv("EC_S3_PROXY_UPSTREAM_API_KEY", "upstream-from-env")
    config = config_from_args(build_parser().parse_args(["--pd-url", "http://pd:1"]))
    assert (config.api_key, config.upstream_api_key) == ("from-env", "upstream-from-env")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="api_key"):
        config_from_args(build_parser().parse_args(["--pd-url", "http://pd:1", "--api-key-file", str(empty)]))
    with pytest.raises(ValueError, match="credentials"):
        ProxyConfig(encoder_urls=["http://user:pw@enc:1"], pd_urls=["http://pd:1"])


# --------------------------------------------------------------------------- units
def test_item_cap_counts_every_part_to_encode_and_tolerates_any_json_type() -> None:
    from ec_s3.proxy.media import TooManyItems, find_media_items

    parts = [image(1), image(1), {"type": "image_embeds", "image_embeds": "AA"}, {"type": ["image_url"]},
             {"type": {"x": 1}, "image_url": {"url": "u"}}, {"type": "image_url", "image_url": None, "uuid": "c"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    items = find_media_items(body, limit=2)  # two parts to encode (one distinct), embeds and refs are free
    assert [it.indices for it in items] == [[0, 1]]
    with pytest.raises(TooManyItems) as err:
        find_media_items({"messages": [{"content": [image(i) for i in range(5)]}]}, limit=3)
    assert (err.value.count, err.value.limit) == (5, 3)
    assert "at most 3" in str(err.value)


def test_limit_flags_and_validation() -> None:
    args = build_parser().parse_args(["--pd-url", "http://pd:1", "--max-items-per-request", "8", "--max-in-flight", "9"])
    config = config_from_args(args)
    assert (config.max_items_per_request, config.max_in_flight) == (8, 9)
    for field_name in ("max_items_per_request", "max_in_flight"):
        with pytest.raises(ValueError, match=field_name):
            ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"], **{field_name: 0})
    with pytest.raises(ValueError, match="upstream_api_key"):
        ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"], upstream_api_key="a\r\nX-Evil: 1")


def test_routes_the_proxy_does_not_serve_answer_json() -> None:
    async def scenario() -> None:
        async with rig() as r:
            async with r.session.get(f"{r.url}/v1/chat/completions") as resp:
                assert resp.status == 405 and "POST" in resp.headers["Allow"]
                error_of(405, await resp.read())
            async with r.session.get(f"{r.url}/nothing-here") as resp:
                assert resp.status == 404
                error_of(404, await resp.read())

    run(scenario())

"""The proxy checks its upstreams' roles (ec_s3/proxy/fleet.py), against fake upstreams that
answer the role probe as ec-s3 servers do: swapped or wrong URLs stop the start with an
error naming them; an upstream that comes up later in the wrong role is never used and
/health says so; the pending marks carry the encoders' location. Real servers:
tests/e2e/test_e2e.py::test_the_proxy_checks_its_upstreams_roles_at_start."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ec_s3.blob.format import NAMESPACE_FIELD, PENDING_MARK, PROBE_FIELD
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.fleet import FleetMisconfigured, judge
from ec_s3.proxy.server import EPDProxy

NS = "s3://b/ec-cache/model-0123456789abcdef/"


def fake(role: str | None, tokens: int, seen: list[Any] | None = None) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "root": "/models/m"}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        params = {PROBE_FIELD: {"role": role, "namespace": NS}} if role and PROBE_FIELD in body["ec_transfer_params"] else None
        return web.json_response({"usage": {"completion_tokens": tokens}, "ec_transfer_params": params})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if seen is not None:
            seen.append(body)
        return web.json_response({"choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
                                  "usage": {"completion_tokens": tokens},
                                  "ec_transfer_params": {"u": {"key": "k"}} if not tokens else None})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


async def serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_judge() -> None:
    assert judge("encoder", "ec_producer", 0) == "" and judge("encoder", "ec_both", 1) == ""
    assert "swapped" in judge("encoder", "ec_consumer", 1)
    assert "not an encoder" in judge("encoder", None, 1)  # a plain server
    assert judge("encoder", None, 0) == ""  # another connector's encoder
    assert judge("pd", "ec_consumer", 1) == "" and judge("pd", None, 1) == ""  # a plain server serves
    assert "swapped" in judge("pd", "ec_producer", 0) and "swapped" in judge("pd", None, 0)


@pytest.mark.parametrize("case", ["swapped", "plain_encoder"])
def test_swapped_or_wrong_urls_stop_the_start_naming_them(case: str) -> None:
    async def scenario() -> None:
        enc, enc_url = await serve(fake("ec_producer", 0))
        pd, pd_url = await serve(fake("ec_consumer", 1) if case == "swapped" else fake(None, 1))
        try:
            urls = ([pd_url], [enc_url]) if case == "swapped" else ([pd_url], [pd_url])
            proxy = EPDProxy(ProxyConfig(encoder_urls=urls[0], pd_urls=urls[1], port=0))
            with pytest.raises(FleetMisconfigured) as refused:
                await proxy.start()
            text = str(refused.value)
            assert f"--encoder-url {pd_url}" in text
            if case == "swapped":
                assert f"--pd-url {enc_url}" in text and "ec_consumer" in text and "ec_producer" in text
            else:
                assert "not an encoder" in text
            assert proxy._runner is None  # nothing bound
            await proxy.stop()
        finally:
            await enc.cleanup()
            await pd.cleanup()

    run(scenario())


def test_a_late_upstream_in_the_wrong_role_is_never_used_and_health_says_so() -> None:
    async def scenario() -> None:
        late = free_port()
        pd, pd_url = await serve(fake("ec_consumer", 1))
        proxy = await EPDProxy(ProxyConfig(encoder_urls=[f"http://127.0.0.1:{late}"], pd_urls=[pd_url], port=0,
                                           health_cache_s=0)).start()
        wrong: web.AppRunner | None = None
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{proxy.url}/health") as resp:
                    health = await resp.json()
                assert resp.status == 200 and health["status"] == "degraded"  # the encoder is not there
                assert health["roles"]["encoders"][f"http://127.0.0.1:{late}"]["state"] == "unreachable"
                assert health["roles"]["prefill_decode"][pd_url] == {"state": "ok", "role": "ec_consumer",
                                                                    "namespace": NS}
                wrong, _ = await serve(fake("ec_consumer", 1), late)  # a p/d at the encoder's URL
                for _ in range(100):
                    if proxy.encoders.members[0].wrong:
                        break
                    await asyncio.sleep(0.1)
                assert proxy.encoders.members[0].wrong
                async with session.get(f"{proxy.url}/health") as resp:
                    health = await resp.json()
                assert health["status"] == "degraded" and health["encoders"] == {f"http://127.0.0.1:{late}": False}
                assert "swapped" in health["roles"]["encoders"][f"http://127.0.0.1:{late}"]["detail"]
                assert proxy.encoders.acquire() is None  # never used
        finally:
            await proxy.stop()
            await pd.cleanup()
            if wrong is not None:
                await wrong.cleanup()

    run(scenario())


def test_pending_marks_carry_the_encoders_location() -> None:
    async def scenario() -> None:
        seen: list[Any] = []
        enc, enc_url = await serve(fake("ec_producer", 0))
        pd, pd_url = await serve(fake("ec_consumer", 1, seen))
        proxy = await EPDProxy(ProxyConfig(encoder_urls=[enc_url], pd_urls=[pd_url], port=0)).start()
        try:
            png = "data:image/png;base64,iVBORw0KGgo="
            body = {"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "x"}]}]}
            async with aiohttp.ClientSession() as session, session.post(
                    f"{proxy.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            marks = [e for b in seen for e in (b.get("ec_transfer_params") or {}).values() if e.get(PENDING_MARK)]
            assert marks and all(m[NAMESPACE_FIELD] == NS for m in marks)
        finally:
            await proxy.stop()
            await enc.cleanup()
            await pd.cleanup()

    run(scenario())

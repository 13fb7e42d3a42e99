"""The EPD proxy against fake vLLM upstreams on loopback.

A fake encoder answers like an ec_producer (0 tokens, ``ec_transfer_params`` keyed by an
identifier derived from the item it was sent); a fake prefill/decode records every body it
is sent and answers JSON or an SSE stream. Knobs on both let a test slow, gate, break or
kill them. Every scenario runs under its own ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import io
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.main import build_parser, config_from_args, main
from ec_s3.proxy.media import find_media_items, merge_params
from ec_s3.proxy.naming import content_uuid
from ec_s3.proxy.server import EPDProxy, ProxyThread, create_app
from ec_s3.sandbox.metrics import parse_prometheus
from ec_s3.sandbox.net import free_port
from support.vllm_render import render_check_async

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llava"


def run(coro: Any, timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def identifier_of(part: dict[str, Any], model: str | None) -> str:
    """The fake encoder's identifier: a hash of the item and the model, like vLLM's."""
    return "mm-" + hashlib.sha256((json.dumps(part, sort_keys=True) + str(model)).encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=4096)
def png_b64(n: int | str) -> str:
    """A real 28x28 PNG (vLLM's judge decodes it, :mod:`support.vllm_render`), distinct
    per ``n``: its colour and a text chunk come from ``n``."""
    from PIL import Image, PngImagePlugin

    colour = tuple(hashlib.sha256(str(n).encode()).digest()[:3])
    info = PngImagePlugin.PngInfo()
    info.add_text("n", str(n))
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, "PNG", pnginfo=info)
    return base64.b64encode(buf.getvalue()).decode()


@functools.lru_cache(maxsize=1)
def embeds_value() -> dict[str, Any]:
    """A valid ``image_embeds`` value for the judge's tiny Qwen2.5-VL: one image token
    (grid 1x2x2, merged 2x2) and its tensor, base64 of ``torch.save`` as vLLM loads it."""
    import torch

    from ec_s3.sandbox.tiny_qwen import QWEN_SHAPE

    buf = io.BytesIO()
    torch.save(torch.zeros(1, QWEN_SHAPE.text_hidden, dtype=torch.float16), buf)
    return {"image_embeds": base64.b64encode(buf.getvalue()).decode(), "image_grid_thw": [1, 2, 2]}


def image(n: int | str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(n)}"}, **extra}


def chat(*parts: dict[str, Any], text: str = "Describe.", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": text}, *parts]},
        ],
        "max_tokens": 8,
        **extra,
    }


def dead_url() -> str:
    """A loopback URL nothing listens on: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    # uvicorn's backlog, as the vLLM servers these fakes stand for: aiohttp's 128 dropped
    # SYNs in the 1,000-request test, and each costs its client a retry 1 s later.
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class Gauge:
    """Requests in flight across several fakes, with its peak and a "reached N" event."""

    def __init__(self, target: int | None = None) -> None:
        self.now = 0
        self.peak = 0
        self.target = target
        self.reached = asyncio.Event()

    @contextlib.contextmanager
    def held(self) -> Any:
        self.now += 1
        self.peak = max(self.peak, self.now)
        if self.target is not None and self.now >= self.target:
            self.reached.set()
        try:
            yield
        finally:
            self.now -= 1


@dataclass
class FakeEncoder:
    name: str
    status: int = 200
    delay: float = 0.0
    gate: Callable[[], Any] | None = None  # awaited before answering
    with_params: bool = True
    # vLLM's placeholder metadata in each entry: {} like LLaVA; Qwen-VL reports its grid.
    metadata: dict[str, Any] = field(default_factory=dict)
    modality: str = "image"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    gauge: Gauge = field(default_factory=Gauge)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        with self.gauge.held():
            if self.gate is not None:
                await self.gate()
            if self.delay:
                await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} broke"}}, status=self.status)
        (part,) = body["messages"][0]["content"]
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{self.name}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20},
            "ec_transfer_params": None,
        }
        if self.with_params:
            identifier = identifier_of(part, body.get("model"))
            answer["ec_transfer_params"] = {
                identifier: {
                    "key": f"ec-cache/ns/{identifier}.safetensors",
                    "size_bytes": 4096,
                    "shape": [16, 128],
                    "dtype": "bfloat16",
                    "modality": self.modality,
                    "item_indices": [0],
                    "metadata": dict(self.metadata),
                    "encoder": self.name,
                }
            }
        return web.json_response(answer)


@dataclass
class FakePD:
    name: str
    chunks: int = 4
    gate_after_first: asyncio.Event | None = None  # streaming: wait for it after chunk 1
    error: tuple[int, bytes, str] | None = None  # (status, body, content type)
    delay: float = 0.0
    hold: Gauge | None = None  # wait until hold.reached before answering
    break_after_first: bool = False
    chunk_interval: float = 0.0
    pad_bytes: int = 0  # streaming: an SSE comment of this many bytes after each chunk
    health_status: int = 200
    health_delay: float = 0.0
    health_calls: int = 0
    failed_generations: int = 0  # the first N requests end as vLLM's engine-refused ones do
    # Judge every body as vLLM's front end does (support/vllm_render.py) and refuse what it
    # refuses; off only for a fake standing for something that is not vLLM.
    vllm_checks: bool = True
    refused: list[dict[str, Any]] = field(default_factory=list)  # vLLM's error bodies, as answered
    bodies: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    gauge: Gauge = field(default_factory=Gauge)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.name}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.raw.append(raw)
        self.headers.append(request.headers.copy())
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.bodies.append(body)
        if self.vllm_checks:
            status, refusal = await render_check_async(body)
            if refusal is not None:
                self.refused.append(refusal)
                return web.json_response(refusal, status=status)
        if self.error is not None:
            status, payload, ctype = self.error
            return web.Response(status=status, body=payload, headers={"Content-Type": ctype})
        if self.failed_generations > 0:
            self.failed_generations -= 1
            return await failed_generation(request, bool(isinstance(body, dict) and body.get("stream")))
        with self.gauge.held(), (self.hold.held() if self.hold else contextlib.nullcontext()):
            if self.hold is not None:
                await asyncio.wait_for(self.hold.reached.wait(), 20)
            if self.delay:
                await asyncio.sleep(self.delay)
        if not (isinstance(body, dict) and body.get("stream")):
            return web.json_response(
                {
                    "id": f"chatcmpl-{self.name}",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": f"hello from {self.name}"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34},
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        try:
            for i in range(self.chunks):
                await out.write(sse_chunk(self.name, i))
                if self.pad_bytes:
                    await out.write(b": " + b"x" * self.pad_bytes + b"\n\n")
                if i == 0 and self.break_after_first:
                    assert request.transport is not None
                    request.transport.abort()
                    return out
                if i == 0 and self.gate_after_first is not None:
                    await asyncio.wait_for(self.gate_after_first.wait(), 10)
                if self.chunk_interval:
                    await asyncio.sleep(self.chunk_interval)
            await out.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted.set()
            raise
        return out


FAILED_GENERATION = {"error": {"message": "Internal server error", "type": "InternalServerError",
                               "param": None, "code": 500}}


async def failed_generation(request: web.Request, stream: bool) -> web.StreamResponse:
    """What vLLM's chat API answers for a request its engine ended with finish_reason
    "error" before any token (vllm/entrypoints/openai/chat_completion/serving.py): a 500,
    or in a stream a role chunk, then the error event."""
    if not stream:
        return web.json_response(FAILED_GENERATION, status=500)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await out.prepare(request)
    role = {"id": "chatcmpl-x", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    await out.write(f"data: {json.dumps(role)}\n\n".encode())
    await out.write(f"data: {json.dumps(FAILED_GENERATION)}\n\n".encode())
    await out.write(b"data: [DONE]\n\n")
    return out


def sse_chunk(name: str, i: int) -> bytes:
    event = {"id": f"chatcmpl-{name}", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}
    return f"data: {json.dumps(event)}\n\n".encode()


@dataclass
class Rig:
    proxy: EPDProxy
    encoders: list[FakeEncoder]
    pds: list[FakePD]
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.proxy.url

    async def post(self, body: Any, **kw: Any) -> tuple[int, bytes, CIMultiDictProxy[str]]:
        async with self.session.post(f"{self.url}/v1/chat/completions", json=body, **kw) as resp:
            return resp.status, await resp.read(), resp.headers

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.metrics.get(name, **labels)


@contextlib.asynccontextmanager
async def rig(
    encoders: Sequence[FakeEncoder | str] | None = None,
    pds: Sequence[FakePD | str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """Start the fakes (a ``str`` stands for a URL used as is, e.g. a dead one) and a proxy
    (serial dispatch unless overridden: these tests pin what serial forwards;
    tests/proxy/test_proxy_parallel.py tests parallel dispatch)."""
    encoders = [FakeEncoder("e0")] if encoders is None else encoders
    pds = [FakePD("pd0")] if pds is None else pds
    runners: list[web.AppRunner] = []
    for fake in [*encoders, *pds]:
        if not isinstance(fake, str):
            runner, fake.url = await serve(fake.app())
            runners.append(runner)
    config = ProxyConfig(
        encoder_urls=[f if isinstance(f, str) else f.url for f in encoders],
        pd_urls=[f if isinstance(f, str) else f.url for f in pds],
        port=0,
        **{"encode_timeout_s": 5.0, "connect_timeout_s": 2.0, "dispatch": "serial", **overrides},
    )
    proxy = await EPDProxy(config).start()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        live_encoders = [e for e in encoders if not isinstance(e, str)]
        yield Rig(proxy, live_encoders, [p for p in pds if not isinstance(p, str)], session)
    finally:
        await session.close()
        await proxy.stop()
        for runner in runners:
            await runner.cleanup()


def params_of(body: dict[str, Any]) -> dict[str, Any]:
    return body.get("ec_transfer_params") or {}


def without_params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "ec_transfer_params"}


# --------------------------------------------------------------------------- happy paths
def test_non_streaming_request_gets_merged_params_and_keeps_media() -> None:
    async def scenario() -> None:
        async with rig() as r:
            img = image(1)
            request = chat(img, cache_salt="salt-1", mm_processor_kwargs={"max_pixels": 100_000}, temperature=0.0)
            status, body, headers = await r.post(request, headers={"X-Request-Id": "req-42"})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["message"]["content"] == "hello from pd0"
            assert headers["X-Request-Id"] == "req-42"

            (enc_body,) = r.encoders[0].bodies
            assert enc_body["messages"] == [{"role": "user", "content": [img]}]
            assert enc_body["max_tokens"] == 1 and enc_body["stream"] is False
            # What changes an identifier or a key travels with the item; sampling does not.
            assert enc_body["model"] == MODEL and enc_body["cache_salt"] == "salt-1"
            assert enc_body["mm_processor_kwargs"] == {"max_pixels": 100_000} and "temperature" not in enc_body
            assert r.encoders[0].headers[0]["X-Request-Id"] == "req-42-enc0"
            assert r.encoders[0].headers[0]["Content-Type"] == "application/json"  # vLLM's server requires it

            (pd_body,) = r.pds[0].bodies
            assert without_params(pd_body) == request  # the original request, media kept
            identifier = identifier_of(img, MODEL)
            assert list(params_of(pd_body)) == [identifier]
            assert params_of(pd_body)[identifier]["key"] == f"ec-cache/ns/{identifier}.safetensors"
            assert params_of(pd_body)[identifier]["item_indices"] == [0]
            assert r.pds[0].headers[0]["X-Request-Id"] == "req-42"
            assert r.metric("ec_s3_proxy_encoder_requests_total", outcome="ok") == 1

    run(scenario())


def test_streaming_is_passed_through_incrementally() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        async with rig(pds=[FakePD("pd0", chunks=5, gate_after_first=gate)]) as r:
            async with r.session.post(f"{r.url}/v1/chat/completions", json=chat(image(1), stream=True)) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                # The PD has not sent chunk 2 yet: it waits for this very event.
                assert first == sse_chunk("pd0", 0)
                gate.set()
                rest = await resp.read()
            assert rest == b"".join(sse_chunk("pd0", i) for i in range(1, 5)) + b"data: [DONE]\n\n"
            assert params_of(r.pds[0].bodies[0])  # streamed requests get params too
            assert r.pds[0].bodies[0]["stream"] is True

    run(scenario())


def test_text_only_requests_skip_encoders_and_are_forwarded_byte_for_byte() -> None:
    async def scenario() -> None:
        async with rig() as r:
            raw = json.dumps(chat(), indent=1).encode()
            async with r.session.post(
                f"{r.url}/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 200
            assert r.encoders[0].bodies == []
            assert r.pds[0].raw == [raw]
            # Plain-string content is text too.
            status, _, _ = await r.post({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and r.encoders[0].bodies == []
            # Embeddings are not encoded by anyone (a cache reference; a client's tensor is
            # refused: tests/proxy/test_proxy_client_embeds.py).
            # p/d (vLLM's own front end, in the fake) refuses a reference to an item it
            # never saw; what matters here is that no encoder was asked.
            embeds = {"type": "image_embeds", "image_embeds": None, "uuid": "cached"}
            status, _, _ = await r.post(chat(embeds))
            assert r.encoders[0].bodies == []
            assert "ec_transfer_params" not in r.pds[0].bodies[-1]
            assert status == 400 and r.pds[0].refused, (status, r.pds[0].refused)

    run(scenario())


def test_client_sent_ec_transfer_params_are_never_forwarded() -> None:
    async def scenario() -> None:
        async with rig() as r:
            forged = {"mm-forged": {"key": "other-tenant/blob.safetensors"}}
            await r.post({**chat(), "ec_transfer_params": forged})
            assert "ec_transfer_params" not in r.pds[0].bodies[-1]
            img = image(7)
            await r.post({**chat(img), "ec_transfer_params": forged})
            assert list(params_of(r.pds[0].bodies[-1])) == [identifier_of(img, MODEL)]

    run(scenario())


def test_items_of_one_request_go_to_different_encoders_in_parallel() -> None:
    async def scenario() -> None:
        both_arrived = Gauge(target=2)

        async def gate() -> None:
            # Each encoder answers only once the other one holds its item too.
            await asyncio.wait_for(both_arrived.reached.wait(), 5)

        e0, e1 = FakeEncoder("e0", gate=gate, gauge=both_arrived), FakeEncoder("e1", gate=gate, gauge=both_arrived)
        async with rig(encoders=[e0, e1]) as r:
            a, b = image("a"), image("b")
            status, body, _ = await r.post(chat(a, b))
            assert status == 200, body
            assert len(e0.bodies) == 1 and len(e1.bodies) == 1
            params = params_of(r.pds[0].bodies[0])
            assert set(params) == {identifier_of(a, MODEL), identifier_of(b, MODEL)}
            assert {p["encoder"] for p in params.values()} == {"e0", "e1"}
            assert params[identifier_of(a, MODEL)]["item_indices"] == [0]
            assert params[identifier_of(b, MODEL)]["item_indices"] == [1]

    run(scenario())


def test_identical_items_are_encoded_once_with_every_index() -> None:
    async def scenario() -> None:
        async with rig() as r:
            img = image("same")
            other = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}}
            await r.post(chat(img, other, img))
            assert len(r.encoders[0].bodies) == 2
            params = params_of(r.pds[0].bodies[0])
            assert params[identifier_of(img, MODEL)]["item_indices"] == [0, 2]
            assert params[identifier_of(other, MODEL)]["item_indices"] == [1]

    run(scenario())


def test_many_concurrent_requests_each_get_their_own_params() -> None:
    n = 40

    async def scenario() -> None:
        all_in = Gauge(target=32)  # every PD answer waits until 32 requests are at the PDs
        encoders = [FakeEncoder("e0", delay=0.02), FakeEncoder("e1", delay=0.02)]
        pds = [FakePD("pd0", hold=all_in), FakePD("pd1", hold=all_in)]
        async with rig(encoders=encoders, pds=pds) as r:
            requests = [
                chat(image(i), *([image(f"{i}-b")] if i % 3 == 0 else []), text=f"request {i}") for i in range(n)
            ]
            results = await asyncio.gather(*(r.post(req) for req in requests))
            assert [status for status, _, _ in results] == [200] * n
            assert all_in.peak >= 32
            seen = {}
            for pd in r.pds:
                for body in pd.bodies:
                    seen[body["messages"][1]["content"][0]["text"]] = body
            assert len(seen) == n and all(len(pd.bodies) > 0 for pd in r.pds)
            for i, req in enumerate(requests):
                body = seen[f"request {i}"]
                assert without_params(body) == req
                media = req["messages"][1]["content"][1:]
                assert set(params_of(body)) == {identifier_of(p, MODEL) for p in media}
            assert sum(len(e.bodies) for e in encoders) == n + len(range(0, n, 3))
            assert min(len(e.bodies) for e in encoders) >= n // 3  # both encoders carry load

    run(scenario(), timeout=60)


def test_connection_pool_is_bounded_per_upstream() -> None:
    async def scenario() -> None:
        pd = FakePD("pd0", delay=0.05)
        async with rig(pds=[pd], max_connections_per_upstream=4) as r:
            results = await asyncio.gather(*(r.post(chat(text=f"t{i}")) for i in range(16)))
            assert all(status == 200 for status, _, _ in results)
            assert pd.gauge.peak <= 4
            assert len(pd.bodies) == 16

    run(scenario())


# --------------------------------------------------------------------------- encoder failures
@pytest.mark.parametrize("failure", ["http_500", "timeout", "refused", "no_params"])
def test_a_failing_encoder_never_fails_the_request(failure: str) -> None:
    async def scenario() -> None:
        good = FakeEncoder("good")
        bad: FakeEncoder | str
        if failure == "refused":
            bad = dead_url()
        elif failure == "timeout":
            bad = FakeEncoder("bad", delay=10)
        elif failure == "no_params":
            bad = FakeEncoder("bad", with_params=False)
        else:
            bad = FakeEncoder("bad", status=500)
        # The good encoder must answer within the limit on a loaded host too: 0.5 s for every
        # failure once failed "refused" there (its second request's items lost their params).
        # Only "timeout" needs a limit below the bad encoder's 10 s.
        async with rig(encoders=[good, bad], encode_timeout_s=3.0 if failure == "timeout" else 5.0) as r:
            a, b = image("a"), image("b")
            status, body, _ = await r.post(chat(a, b))
            assert status == 200, body
            (pd_body,) = r.pds[0].bodies
            assert without_params(pd_body) == chat(a, b)  # media kept: PD encodes the rest
            (published,) = params_of(pd_body).values()  # one item each way
            assert published["encoder"] == "good"
            assert r.metric("ec_s3_proxy_items_without_params_total") == 1
            outcome = {"http_500": "http_error", "refused": "unreachable"}.get(failure, failure)
            assert r.metric("ec_s3_proxy_encoder_requests_total", outcome=outcome) == 1
            if failure == "refused":
                # The refusing encoder is skipped for a while: both items go to the good one.
                status, _, _ = await r.post(chat(image("c"), image("d")))
                assert status == 200 and len(params_of(r.pds[0].bodies[-1])) == 2
                assert r.metric("ec_s3_proxy_encoder_requests_total", outcome="unreachable") == 1
                async with r.session.get(f"{r.url}/metrics") as resp:
                    metrics = await resp.text()
                assert f'ec_s3_proxy_upstream_up{{role="encoder",upstream="{bad}"}} 0' in metrics

    run(scenario())


def test_no_encoder_at_all_still_serves() -> None:
    async def scenario() -> None:
        async with rig(encoders=[dead_url()]) as r:
            for _ in range(2):
                status, _, _ = await r.post(chat(image(1)))
                assert status == 200
                assert "ec_transfer_params" not in r.pds[0].bodies[-1]
        async with rig(encoders=[]) as r:
            status, _, _ = await r.post(chat(image(1), stream=True))
            assert status == 200 and "ec_transfer_params" not in r.pds[0].bodies[-1]

    run(scenario())


# --------------------------------------------------------------------------- PD behaviour
@pytest.mark.parametrize(
    ("status", "payload", "ctype", "stream"),
    [
        (400, json.dumps({"error": {"message": "bad max_tokens", "type": "BadRequestError", "code": 400}}).encode(),
         "application/json", False),
        (400, json.dumps({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}).encode(),
         "application/json", True),
        (503, b"engine is sleeping", "text/plain; charset=utf-8", False),
    ],
)
def test_pd_errors_are_passed_through(status: int, payload: bytes, ctype: str, stream: bool) -> None:
    async def scenario() -> None:
        async with rig(pds=[FakePD("pd0", error=(status, payload, ctype))]) as r:
            got_status, got_body, headers = await r.post(chat(image(1), stream=stream))
            assert got_status == status
            if ctype.startswith("application/json"):
                assert (got_body, headers["Content-Type"]) == (payload, ctype)
            else:  # a server error that is not JSON still reaches the client in OpenAI's shape
                error = json.loads(got_body)["error"]
                assert error["code"] == status and error["type"] == "ServiceUnavailable"
                assert payload not in got_body and headers["Content-Type"].startswith("application/json")

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_a_generation_the_engine_refused_is_sent_once_more(dispatch: str, stream: bool) -> None:
    """vLLM ends a request with finish_reason "error" when its multimodal processor cache
    drifted (an earlier request for the same image was aborted mid-preprocessing, as a
    parallel-dispatch resend does) and calls that retryable: the proxy sends it once more,
    so the client gets the answer (e2e: a 500 right after the encoder was killed)."""
    async def scenario() -> None:
        async with rig(pds=[FakePD("pd0", failed_generations=1)], dispatch=dispatch) as r:
            status, body, _ = await r.post(chat(image(1), stream=stream))
            assert status == 200 and b"hello from pd0" in body or b"tok0" in body, body
            assert b"InternalServerError" not in body
            assert len(r.pds[0].bodies) == 2 and r.pds[0].raw[0] == r.pds[0].raw[1]
            assert r.metric("ec_s3_proxy_pd_retries_total", upstream=r.pds[0].url, reason="failed_generation") == 1

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_refused_twice_is_relayed_and_real_errors_are_not_retried(stream: bool) -> None:
    """Once more, never more: a second refusal reaches the client as vLLM sent it; any
    other error (a 500 of another type, a 400) is relayed at once."""
    async def scenario() -> None:
        async with rig(pds=[FakePD("pd0", failed_generations=5)]) as r:
            status, body, _ = await r.post(chat(image(1), stream=stream))
            assert (status, b"InternalServerError" in body) == (500 if not stream else 200, True)
            assert len(r.pds[0].bodies) == 2
        other = json.dumps({"error": {"message": "boom", "type": "BadRequestError", "code": 400}}).encode()
        for error in [(500, b"Internal Server Error", "text/plain"), (400, other, "application/json")]:
            async with rig(pds=[FakePD("pd0", error=error)]) as r:
                assert (await r.post(chat(image(1), stream=stream)))[0] == error[0]
                assert len(r.pds[0].bodies) == 1

    run(scenario())


def test_unreachable_pd_is_skipped_and_all_unreachable_is_502() -> None:
    async def scenario() -> None:
        async with rig(pds=[dead_url(), FakePD("pd1")]) as r:
            for _ in range(3):
                status, body, _ = await r.post(chat(image(1)))
                assert status == 200 and b"hello from pd1" in body
        async with rig(pds=[dead_url(), dead_url()]) as r:
            status, body, _ = await r.post(chat())
            assert status == 502
            assert json.loads(body)["error"]["code"] == 502

    run(scenario())


def test_stream_broken_by_pd_ends_with_an_error_event() -> None:
    async def scenario() -> None:
        async with rig(pds=[FakePD("pd0", chunks=3, break_after_first=True)]) as r:
            status, body, _ = await r.post(chat(stream=True))
            assert status == 200
            first, rest = body.split(b"\n\n", 1)
            assert first + b"\n\n" == sse_chunk("pd0", 0)
            assert rest.startswith(b"data: ") and json.loads(rest[6:])["error"]["code"] == 502

    run(scenario())


def test_client_hanging_up_aborts_the_pd_stream() -> None:
    async def scenario() -> None:
        pd = FakePD("pd0", chunks=400, chunk_interval=0.02)
        async with rig(pds=[pd]) as r:
            resp = await r.session.post(f"{r.url}/v1/chat/completions", json=chat(stream=True))
            await resp.content.readuntil(b"\n\n")
            resp.close()  # drop the connection mid-stream
            await asyncio.wait_for(pd.aborted.wait(), 5)
            await asyncio.sleep(0.1)
            assert r.proxy.pds.members[0].in_flight == 0

    run(scenario())


def test_forward_media_false_drops_only_published_uuid_media() -> None:
    async def scenario() -> None:
        async with rig(forward_media=False) as r:
            with_uuid, plain = image("u", uuid="client-uuid-1"), image("p")
            await r.post(chat(with_uuid, plain))
            parts = r.pds[0].bodies[0]["messages"][1]["content"]
            # The client's uuid is replaced by the content identifier (never passed on as is).
            assert parts[1] == {**with_uuid, "image_url": None, "uuid": content_uuid("image_url", with_uuid["image_url"])}
            assert parts[2] == plain
            assert len(params_of(r.pds[0].bodies[0])) == 2

    run(scenario())


# --------------------------------------------------------------------------- other routes
def test_health_models_and_metrics() -> None:
    async def scenario() -> None:
        sick = FakePD("sick", health_status=500)
        async with rig(pds=[dead_url(), sick, FakePD("pd2")], health_cache_s=0) as r:
            async with r.session.get(f"{r.url}/health") as resp:
                assert resp.status == 200
                health = await resp.json()
                assert list(health["prefill_decode"].values()) == [False, False, True]
                assert list(health["encoders"].values()) == [True]
            async with r.session.get(f"{r.url}/v1/models") as resp:
                assert resp.status == 200
                assert (await resp.json())["data"][0]["owned_by"] == "sick"  # first that answers 200
            sick.health_status = 503
            r.pds[1].health_status = 503
            async with r.session.get(f"{r.url}/health") as resp:
                assert resp.status == 503
            await r.post(chat(image(1)))
            async with r.session.get(f"{r.url}/metrics") as resp:
                text = await resp.text()
            assert resp.headers["Content-Type"].startswith("text/plain")
            samples = parse_prometheus(text)
            assert samples.get("ec_s3_proxy_requests_total", kind="multimodal") == 1
            assert samples.get("ec_s3_proxy_mm_items_total") == 1
            assert "# TYPE ec_s3_proxy_in_flight gauge" in text
        async with rig(pds=[dead_url()]) as r, r.session.get(f"{r.url}/v1/models") as resp:
            assert resp.status == 503

    run(scenario())


def test_api_keys() -> None:
    async def scenario() -> None:
        async with rig(api_key="client-secret") as r:
            status, _, _ = await r.post(chat(image(1)))
            assert status == 401 and r.pds[0].bodies == []
            status, _, _ = await r.post(chat(image(1)), headers={"Authorization": "Bearer client-secret"})
            assert status == 200
            # The proxy's own key stays with the proxy (tests/proxy/test_proxy_limits.py has more).
            assert "Authorization" not in r.pds[0].headers[0]
            assert "Authorization" not in r.encoders[0].headers[0]
            async with r.session.get(f"{r.url}/health") as resp:  # probes stay open
                assert resp.status == 200
        async with rig(upstream_api_key="vllm-key") as r:
            await r.post(chat(image(1)), headers={"Authorization": "Bearer client"})
            assert r.pds[0].headers[0]["Authorization"] == "Bearer vllm-key"
            assert r.encoders[0].headers[0]["Authorization"] == "Bearer vllm-key"
        async with rig() as r:  # a proxy that checks no key passes the client's on
            await r.post(chat(image(1)), headers={"Authorization": "Bearer for-vllm"})
            assert r.pds[0].headers[0]["Authorization"] == "Bearer for-vllm"
        async with rig(pass_authorization=False) as r:
            await r.post(chat(image(1)), headers={"Authorization": "Bearer client"})
            assert "Authorization" not in r.pds[0].headers[0]
        assert "client-secret" not in repr(ProxyConfig([], ["http://pd:1"], api_key="client-secret"))

    run(scenario())


def test_create_app_serves_through_aiohttp() -> None:
    async def scenario() -> None:
        pd = FakePD("pd0")
        runner, pd.url = await serve(pd.app())
        app_runner, url = await serve(create_app(ProxyConfig(encoder_urls=[], pd_urls=[pd.url])))
        try:
            async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
        finally:
            await app_runner.cleanup()
            await runner.cleanup()

    run(scenario())


# --------------------------------------------------------------------------- units and CLI
def test_item_discovery_and_merge() -> None:
    parts = [
        {"type": "text", "text": "x"},
        image(1),
        {"type": "image_embeds", "image_embeds": "AAAA"},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://media/v.mp4"}},
        {"image_url": {"url": "http://media/untyped.png"}},  # vLLM accepts untyped parts
        {"type": "image_url", "image_url": None, "uuid": "cached-elsewhere"},  # nothing to encode
    ]
    items = find_media_items({"messages": [{"role": "user", "content": parts}]})
    assert [(it.part, it.indices) for it in items] == [
        (parts[1], [0]), (parts[3], [2]), (parts[4], [3]), (parts[5], [4]),
    ]
    assert find_media_items({"messages": "nope"}) == []
    merged = merge_params([(items[0], {"x": {"key": "k", "item_indices": [0]}}), (items[1], None),
                           (items[2], {"x": {"key": "k", "item_indices": [0]}, "y": {"key": "k2"}})])
    assert merged == {"x": {"key": "k", "item_indices": [0, 3]}, "y": {"key": "k2"}}


def test_cli_flags() -> None:
    args = build_parser().parse_args([
        "--encoder-url", "http://e1:8001,http://e2:8001/", "--encode-servers-urls", "http://e3:8001",
        "--pd-url", "http://pd:8002", "--port", "0", "--encode-timeout", "3", "--total-timeout", "0",
        "--no-forward-media", "--max-connections-per-upstream", "8",
    ])
    config = config_from_args(args)
    assert config.encoder_urls == ("http://e1:8001", "http://e2:8001", "http://e3:8001")
    assert config.pd_urls == ("http://pd:8002",)
    assert config.total_timeout_s is None and config.encode_timeout_s == 3
    assert config.forward_media is False and config.max_connections_per_upstream == 8
    assert main(["--help"]) == 0
    assert main([]) == 2  # --pd-url is required
    assert main(["--pd-url", "ftp://pd"]) == 2
    with pytest.raises(ValueError):
        ProxyConfig(encoder_urls=[], pd_urls=[])
    with pytest.raises(ValueError):
        ProxyConfig(encoder_urls=["e1:8001"], pd_urls=["http://pd:1"])


@contextlib.asynccontextmanager
async def proxy_process(
    pd: FakePD, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, bytearray]]:
    """``python -m ec_s3.proxy`` in front of ``pd`` (and a dead encoder), once /health
    answers: (the process, its URL, its output so far); killed afterwards if it still runs.

    Its output is read all along: a pipe nobody reads fills at 64 KiB, and the proxy's
    next log line then blocks its event loop (a thousand requests' worth of lines wedged
    it on a loaded CI host)."""
    runner, pd.url = await serve(pd.app())
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ec_s3.proxy", "--pd-url", pd.url, "--encoder-url", dead_url(),
        "--port", str(port), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    output = bytearray()

    async def drain() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            output.extend(chunk)

    drainer = asyncio.create_task(drain())
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("proxy did not come up")
        yield proc, url, output
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await drainer  # EOF once the process is gone
        await runner.cleanup()


def test_python_m_ec_s3_proxy_serves_and_stops_on_sigterm() -> None:
    async def scenario() -> None:
        async with proxy_process(FakePD("pd0")) as (proc, url, output):
            async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=chat(image(1))) as resp:
                assert resp.status == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        log = output.decode()  # whole: the context waited for the output's end
        assert f"listening on {url}" in log
        assert "failed" in log  # the dead encoder was logged, not raised

    run(scenario())


@pytest.mark.parametrize(("shutdown_timeout", "finishes"), [(10.0, True), (0.3, False)])
def test_sigterm_lets_requests_in_flight_finish_for_shutdown_timeout(shutdown_timeout: float, finishes: bool) -> None:
    """On SIGTERM the proxy stops listening at once and gives a request in flight (p/d
    answers after 5 s) --shutdown-timeout to finish: it is relayed in full within it, and
    cut past it, when the proxy exits 0 without waiting for it."""
    async def scenario() -> None:
        pd = FakePD("pd0", delay=5.0)
        async with proxy_process(pd, "--shutdown-timeout", str(shutdown_timeout)) as (proc, url, _output):
            async with aiohttp.ClientSession() as s:
                async def ask() -> int:
                    async with s.post(f"{url}/v1/chat/completions", json=chat(image(1))) as resp:
                        await resp.read()
                        return resp.status

                in_flight = asyncio.ensure_future(ask())
                while pd.gauge.now < 1:
                    await asyncio.sleep(0.01)
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                    await ask()
                if finishes:
                    assert await asyncio.wait_for(in_flight, 10) == 200
                else:
                    with pytest.raises(aiohttp.ClientError):
                        await asyncio.wait_for(in_flight, 10)
                assert await asyncio.wait_for(proc.wait(), 15) == 0
                assert (time.monotonic() - started < 3.5) == (not finishes)

    run(scenario(), timeout=60)


def test_proxy_thread_for_synchronous_callers() -> None:
    import urllib.error
    import urllib.request

    with ProxyThread(ProxyConfig(encoder_urls=[], pd_urls=[dead_url()], port=0, health_timeout_s=0.5)) as proxy:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{proxy.url}/health", timeout=10)
        assert err.value.code == 503
        with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as resp:
            assert b"ec_s3_proxy_upstream_up" in resp.read()

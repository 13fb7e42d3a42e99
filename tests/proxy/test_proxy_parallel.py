"""Parallel dispatch against stub upstreams on loopback (our own aiohttp servers).

The stub prefill/decode behaves like an ec_consumer under pending marks: while its
request marks items pending it holds its answer (the consumer waits for the blobs) until
released or ``promised_wait_s`` passes; a request without marks is answered at once (the
consumer encodes locally). That is enough to check what the proxy sends, when, and
that an encoder's failure turns into one resend the client never sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from ec_s3.blob.format import PENDING_MARK
from ec_s3.proxy.main import build_parser, config_from_args
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.naming import CLIENT_PREFIX, content_uuid, name_media
from ec_s3.sandbox.metrics import parse_prometheus
from test_proxy import FakeEncoder, FakePD, chat, dead_url, image, rig, run, sse_chunk

pytestmark = pytest.mark.timeout(120)

PROMISED_WAIT_S = 8.0  # the stub consumer's bound; a test that reaches it has failed


@dataclass
class PendingPD(FakePD):
    """A p/d that waits for ``release`` while its request marks any item pending."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[float] = field(default_factory=list)
    cancelled: int = 0
    # How long a request with marks waits at most (the consumer's promised_wait_s).
    bound_s: float = PROMISED_WAIT_S
    # Requests with fewer marks are answered at once (e.g. the good encoder's blob is
    # there by the time of the resend).
    hold_from_marks: int = 1

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.started.append(time.monotonic())
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}  # not ours to judge: answered like any
        self.raw.append(raw)
        self.bodies.append(body)
        params = body.get("ec_transfer_params")
        pending = [e for e in (params.values() if isinstance(params, dict) else []) if e.get(PENDING_MARK)]
        stream = body.get("stream") is True
        out: web.StreamResponse | None = None
        if stream:  # like vLLM: headers at once, the first chunk with the first token
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        try:
            if pending and len(pending) >= self.hold_from_marks:
                await asyncio.wait_for(self.release.wait(), self.bound_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except asyncio.TimeoutError:
            pass
        answer = f"{self.name}: {len(pending)} pending"
        if out is None:
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]})
        for i in range(self.chunks):
            await out.write(sse_chunk(answer, i))
            if i == 0 and self.gate_after_first is not None:
                await asyncio.wait_for(self.gate_after_first.wait(), 10)
        await out.write(b"data: [DONE]\n\n")
        return out


def pending_of(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (body.get("ec_transfer_params") or {}).items() if v.get(PENDING_MARK)}


def parts_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for m in body["messages"] if isinstance(m.get("content"), list) for p in m["content"]]


def test_pd_gets_the_request_before_the_encoders_answer_with_items_named_and_marked() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        enc = FakeEncoder("e0", gate=gate.wait)
        pd = PendingPD("pd0")
        async with rig(encoders=[enc], pds=[pd], dispatch="parallel") as r:
            a, b = image("a", uuid="forged"), image("b")
            ref = {"type": "image_url", "image_url": None, "uuid": "someone-elses"}
            post = asyncio.ensure_future(r.post(chat(a, b, a, ref, ec_transfer_params={"x": {"key": "forged"}})))
            while not pd.bodies:  # p/d has the request while the encoders still encode
                await asyncio.sleep(0.01)
            assert not gate.is_set() and len(enc.bodies) == 2
            body = pd.bodies[0]
            ua, ub = content_uuid("image_url", a["image_url"]), content_uuid("image_url", b["image_url"])
            parts = parts_of(body)
            namespaced = CLIENT_PREFIX + hashlib.sha256(b"someone-elses").hexdigest()
            assert [p.get("uuid") for p in parts[1:]] == [ua, ub, ua, namespaced]
            assert parts[4]["image_url"] is None
            assert parts[1]["image_url"] == a["image_url"]  # media kept: p/d can encode it itself
            # Marks for the items sent to encoders only, indexed as p/d numbers them; the
            # client's params are dropped.
            assert body["ec_transfer_params"] == {
                ua: {PENDING_MARK: True, "item_indices": [0, 2]}, ub: {PENDING_MARK: True, "item_indices": [1]},
            }
            # The encoders were sent the same names.
            assert sorted(parts_of(e)[0]["uuid"] for e in enc.bodies) == sorted([ua, ub])
            gate.set()
            await asyncio.sleep(0.05)
            pd.release.set()
            status, raw, _ = await post
            assert status == 200 and b"2 pending" in raw
            assert len(pd.bodies) == 1 and r.metric("ec_s3_proxy_pd_resends_total") == 0

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", ["http_error", "timeout", "dead", "no_params"])
def test_encoder_failure_resends_pd_without_its_mark_and_the_client_sees_one_answer(stream: bool, failure: str) -> None:
    async def scenario() -> None:
        good = FakeEncoder("good")
        bad: FakeEncoder | str
        if failure == "dead":
            bad = dead_url()
        else:
            bad = FakeEncoder("bad", status=500 if failure == "http_error" else 200,
                              delay=30 if failure == "timeout" else 0.05, with_params=failure != "no_params")
        pd = PendingPD("pd0", hold_from_marks=2)
        async with rig(encoders=[good, bad], pds=[pd], dispatch="parallel", encode_timeout_s=1.0) as r:
            started = time.monotonic()
            a, b = image("a"), image("b")
            status, raw, _ = await asyncio.wait_for(r.post(chat(a, b, stream=stream)), PROMISED_WAIT_S - 2)
            took = time.monotonic() - started
            assert status == 200
            # The first attempt (both marked) was dropped (a refused connection fails so
            # fast that it may be dropped before p/d read it); the second marks only the
            # good encoder's item, and the client got the second's answer only.
            assert len(pd.bodies) == (1 if failure == "dead" and len(pd.bodies) == 1 else 2), pd.bodies
            assert [len(pending_of(b)) for b in pd.bodies] == [2, 1][-len(pd.bodies):]
            assert pd.cancelled == len(pd.bodies) - 1
            if stream:
                events = [e for e in raw.split(b"\n\n") if e]
                assert events[-1] == b"data: [DONE]" and len(events) == pd.chunks + 1
                assert all(b"1 pending" in e for e in events[:-1])
            else:
                assert json.loads(raw)["choices"][0]["message"]["content"] == "pd0: 1 pending"
            assert r.metric("ec_s3_proxy_pd_resends_total") == 1
            assert r.metric("ec_s3_proxy_items_without_params_total") == 1
            async with r.session.get(f"{r.url}/metrics") as resp:  # rendered, not only counted
                assert parse_prometheus(await resp.text()).get("ec_s3_proxy_pd_resends_total") == 1
            assert took < PROMISED_WAIT_S - 2

    run(scenario(), timeout=60)


def test_an_answer_that_has_begun_is_never_dropped() -> None:
    """An encoder failing after p/d's stream has begun changes nothing: one stream."""
    async def scenario() -> None:
        fail_now = asyncio.Event()

        async def later() -> None:
            await fail_now.wait()

        bad = FakeEncoder("bad", status=500, gate=later)
        first_chunk_out = asyncio.Event()
        pd = PendingPD("pd0", gate_after_first=first_chunk_out)
        pd.release.set()  # p/d found the blob (e.g. already in the bucket): it streams at once
        async with rig(encoders=[bad], pds=[pd], dispatch="parallel") as r:
            async with r.session.post(f"{r.url}/v1/chat/completions", json=chat(image("a"), stream=True)) as resp:
                first = await resp.content.readuntil(b"\n\n")
                assert b"tok0" in first
                fail_now.set()  # the encoder fails now, after the answer began
                await asyncio.sleep(0.2)
                first_chunk_out.set()
                rest = await resp.read()
            assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"tok") == pd.chunks - 1
            assert len(pd.bodies) == 1 and r.metric("ec_s3_proxy_pd_resends_total") == 0

    run(scenario())


def test_client_leaving_cancels_pd_and_encoders_and_frees_everything() -> None:
    async def scenario() -> None:
        never = asyncio.Event()
        enc = FakeEncoder("e0", gate=never.wait)
        pd = PendingPD("pd0")
        async with rig(encoders=[enc], pds=[pd], dispatch="parallel") as r:
            post = asyncio.ensure_future(r.post(chat(image("a"))))
            while not pd.bodies or not enc.bodies:
                await asyncio.sleep(0.01)
            post.cancel()
            for _ in range(200):
                if pd.cancelled and r.proxy.pds.members[0].in_flight == 0 and r.proxy.encoders.members[0].in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert pd.cancelled == 1
            assert r.proxy.pds.members[0].in_flight == 0 and r.proxy.encoders.members[0].in_flight == 0
            assert r.metric("ec_s3_proxy_requests_in_flight") == 0

    run(scenario())


def test_no_encoders_or_serial_or_no_params_send_no_marks() -> None:
    async def scenario() -> None:
        for overrides in ({"encoders": []}, {"dispatch": "serial"}, {"forward_params": False}):
            async with rig(**{"dispatch": "parallel", **overrides}) as r:
                status, _, _ = await r.post(chat(image("a")))
                assert status == 200
                assert not pending_of(r.pds[0].bodies[0])

    run(scenario())


def test_items_of_encoders_known_down_are_never_marked() -> None:
    """Once the only encoder refused a connection (down for down_cooldown_s), the next
    request is sent without marks: no attempt to drop, no resend."""
    async def scenario() -> None:
        pd = PendingPD("pd0")
        async with rig(encoders=[dead_url()], pds=[pd], dispatch="parallel", down_cooldown_s=30) as r:
            assert (await r.post(chat(image("a"))))[0] == 200
            resends = r.metric("ec_s3_proxy_pd_resends_total")
            assert (await r.post(chat(image("b"))))[0] == 200
            assert not pending_of(pd.bodies[-1])
            assert r.metric("ec_s3_proxy_pd_resends_total") == resends
            assert r.metric("ec_s3_proxy_encoder_requests_total", outcome="skipped") == 1

    run(scenario())


def test_naming_units_and_dispatch_flag() -> None:
    url = {"url": "http://media/a.png"}
    assert content_uuid("image_url", url) == content_uuid("image_url", {**url, "detail": "high"})
    assert content_uuid("image_url", url) != content_uuid("video_url", url)  # modality is in the name
    assert content_uuid("image_url", url) != content_uuid("image_url", {"url": "http://media/b.png"})
    body = chat(image("a"))
    assert name_media(body, give_uuids=False) is body  # serial: nothing to rename
    named = name_media(body, give_uuids=True)
    assert body["messages"][1]["content"][1].get("uuid") is None  # the input is not modified
    assert named["messages"][1]["content"][1]["uuid"].startswith("ecs3-")
    assert config_from_args(build_parser().parse_args(["--pd-url", "http://pd:1"])).dispatch == "parallel"
    args = build_parser().parse_args(["--pd-url", "http://pd:1", "--dispatch", "serial"])
    assert config_from_args(args).dispatch == "serial"
    with pytest.raises(ValueError, match="dispatch"):
        ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"], dispatch="fast")

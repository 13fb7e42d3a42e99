"""Repeated images never reach an encoder: the proxy's table of items known to be in the
bucket (ec_s3/proxy/known.py), against the fake upstreams of tests/proxy/test_proxy.py and,
for the opt-in HEAD, the real S3 server. Through real vLLM servers:
tests/e2e/test_proxy_skip_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from ec_s3.blob.format import MISSING_REPORT, PLACEHOLDER_METADATA_KEY, PRESENT_MARK
from ec_s3.blob.keys import KeySpace
from ec_s3.blob.placeholder import placeholder_json
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.known import KnownBlobs
from ec_s3.proxy.main import build_parser, config_from_args
from ec_s3.proxy.media import find_media_items
from ec_s3.proxy.naming import content_uuid, name_media
from ec_s3.store.client import S3Store
from support.faultproxy import FaultProxy
from test_proxy import MODEL, FakeEncoder, FakePD, chat, image, identifier_of, params_of, rig, run

pytestmark = pytest.mark.timeout(120)
SKIPS = "ec_s3_proxy_encoder_skips_total"


@dataclass
class ReportingPD(FakePD):
    """A prefill/decode that found the blobs of ``missing`` keys absent (a consumer's
    answer lists them in its ec_transfer_params)."""

    missing: list[str] | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        resp = await super().chat(request)
        if not self.missing or not isinstance(resp, web.Response):
            return resp
        payload = json.loads(resp.body)  # type: ignore[arg-type]
        payload["ec_transfer_params"] = {MISSING_REPORT: self.missing}
        return web.json_response(payload)


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_a_repeat_skips_the_encoder_with_its_promise_then_marked_present(dispatch: str) -> None:
    async def scenario() -> None:
        async with rig(dispatch=dispatch, known_settle_s=0.3) as r:
            img = image(1)
            for text in ("first", "again at once", "again later"):
                if text == "again later":
                    await asyncio.sleep(0.4)
                status, body, _ = await r.post(chat(img, text=text))
                assert status == 200, body
            assert len(r.encoders[0].bodies) == 1  # the repeats never reached the encoder
            assert r.metric(SKIPS, source="answer") == 2
            first, soon, later = (params_of(b) for b in r.pds[0].bodies)
            if dispatch == "parallel":
                ((uuid, mark),) = first.items()
                assert mark["ec_s3_pending"] is True
            (identifier,) = soon
            assert soon[identifier]["key"].endswith(".safetensors")
            # Within known_settle_s the blob may still be uploading: the encoder's promise.
            assert PRESENT_MARK not in soon[identifier]
            assert later[identifier] == {**soon[identifier], PRESENT_MARK: True}
            assert later[identifier]["item_indices"] == [0]

    run(scenario())


def test_a_consumer_that_found_the_blob_missing_makes_the_proxy_forget_it() -> None:
    async def scenario() -> None:
        pd = ReportingPD("pd0")
        async with rig(pds=[pd], known_settle_s=0.0) as r:
            img = image(2)
            assert (await r.post(chat(img)))[0] == 200
            key = f"ec-cache/ns/{identifier_of(img, MODEL)}.safetensors"
            pd.missing = [key]
            status, body, _ = await r.post(chat(img))  # marked present; the consumer found no blob
            assert status == 200
            assert json.loads(body)["ec_transfer_params"] is None  # the report is the proxy's, not the client's
            assert len(r.encoders[0].bodies) == 1
            assert r.metric("ec_s3_proxy_known_forgotten_total", reason="missing") == 1
            pd.missing = None
            assert (await r.post(chat(img)))[0] == 200
            assert len(r.encoders[0].bodies) == 2  # forgotten: the encoder runs (and publishes) again
            assert r.metric("ec_s3_proxy_known_entries") == 1

    run(scenario())


def test_off_streams_and_failed_encoders() -> None:
    async def scenario() -> None:
        async with rig(known_max_entries=0) as r:
            for _ in range(2):
                assert (await r.post(chat(image(3))))[0] == 200
            assert len(r.encoders[0].bodies) == 2 and r.metric(SKIPS) == 0
        async with rig(encoders=[FakeEncoder("e0", with_params=False)]) as r:
            for _ in range(2):
                assert (await r.post(chat(image(4))))[0] == 200
            assert len(r.encoders[0].bodies) == 2  # an answer without keys promises nothing
        async with rig(dispatch="parallel") as r:
            for _ in range(2):
                status, body, _ = await r.post(chat(image(5), stream=True))
                assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            assert len(r.encoders[0].bodies) == 1

    run(scenario())


def test_the_table_is_bounded_by_entries_bytes_and_time() -> None:
    def params(n: int) -> dict[str, Any]:
        return {f"id-{n}": {"key": f"p/ns/{n:064x}.safetensors", "item_indices": [0]}}

    t = KnownBlobs(max_entries=3, max_bytes=1 << 20, ttl_s=10.0, settle_s=1.0)
    for n in range(5):
        assert t.remember_answer(f"ref-{n}", params(n), now=0.0)
    assert len(t) == 3 and t.get("ref-0", 0.0) is None and t.forgotten["evicted"] == 2
    assert t.get("ref-2", 0.5) is not None  # used: now the most recent
    t.remember_answer("ref-5", params(5), now=0.5)
    assert t.get("ref-3", 0.5) is None and t.get("ref-2", 0.5) is not None
    assert PRESENT_MARK not in t.get("ref-2", 0.5).params([1], 0.5)["id-2"]  # type: ignore[union-attr]
    assert t.get("ref-2", 2.0).params([1], 2.0)["id-2"][PRESENT_MARK] is True  # type: ignore[union-attr]
    assert t.get("ref-2", 10.5) is None and t.forgotten["expired"] == 1
    assert not t.remember_answer("ref-x", {"id": {"item_indices": [0]}})  # no key: no promise

    small = KnownBlobs(max_entries=1000, max_bytes=2000, ttl_s=10.0, settle_s=0.0)
    for n in range(10):
        small.remember_answer(f"ref-{n}", params(n), now=0.0)
    assert 0 < small.nbytes <= 2000 and len(small) < 10
    assert small.forget_keys([params(9)["id-9"]["key"], 7, None]) == 1 and small.get("ref-9", 0.0) is None


def test_config_keys_are_validated_and_on_the_command_line() -> None:
    base = {"encoder_urls": [], "pd_urls": ["http://127.0.0.1:1"]}
    for bad, name in (({"known_max_entries": -1}, "known_max_entries"), ({"known_max_bytes": 10}, "known_max_bytes"),
                      ({"known_ttl_s": 0}, "known_ttl_s"), ({"known_settle_s": 500.0}, "known_settle_s"),
                      ({"bucket_lookup_timeout_s": 0}, "bucket_lookup_timeout_s"),
                      ({"bucket_lookup": {"bucket": "b", "no_such_key": 1}}, "bucket_lookup")):
        with pytest.raises(ValueError, match=name):
            ProxyConfig(**base, **bad)
    args = build_parser().parse_args(["--pd-url", "http://127.0.0.1:1", "--known-ttl", "60", "--known-settle", "2",
                                      "--bucket-lookup", '{"bucket": "fleet", "prefix": "p"}'])
    config = config_from_args(args)
    assert (config.known_ttl_s, config.known_settle_s, dict(config.bucket_lookup or {})) == (
        60.0, 2.0, {"bucket": "fleet", "prefix": "p"})
    assert "fleet" not in repr(config)


def test_bucket_lookup_refuses_a_literal_secret_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's command line is readable by every local user: a literal secret in
    --bucket-lookup is refused, naming the key and the way out; references are fine."""
    for key in ("secret_access_key", "session_token"):
        args = build_parser().parse_args(["--pd-url", "http://127.0.0.1:1", "--bucket-lookup",
                                          json.dumps({"bucket": "fleet", key: "hunter2-literal"})])
        with pytest.raises(ValueError, match=f"bucket_lookup: {key} is given literally") as err:
            config_from_args(args)
        assert "hunter2" not in str(err.value) and "env:NAME" in str(err.value)
    monkeypatch.setenv("FLEET_SECRET", "from-the-environment")
    args = build_parser().parse_args(["--pd-url", "http://127.0.0.1:1", "--bucket-lookup",
                                      '{"bucket": "fleet", "access_key_id": "fleet", "secret_access_key": "env:FLEET_SECRET"}'])
    assert dict(config_from_args(args).bucket_lookup or {})["secret_access_key"] == "env:FLEET_SECRET"


class KeyedEncoder(FakeEncoder):
    """An encoder whose keys are the real key scheme's (identifier = the proxy's uuid)."""

    space: KeySpace | None = None

    async def chat(self, request: web.Request) -> web.Response:
        resp = await super().chat(request)
        body = self.bodies[-1]
        (part,) = body["messages"][0]["content"]
        payload = json.loads(resp.body)  # type: ignore[arg-type]
        assert self.space is not None
        payload["ec_transfer_params"] = {part["uuid"]: {**next(iter(payload["ec_transfer_params"].values())),
                                                        "key": self.space.key_for(part["uuid"])}}
        return web.json_response(payload)


def test_a_second_proxy_learns_from_the_bucket_with_a_head(
    extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Proxy A's encoder published img-6; proxy B (bucket_lookup) never saw it: its HEAD
    finds the blob, so B sends it marked present and makes no encoder request. B learned
    the key space from one encoder answer of its own (img-7); a miss goes to the encoder."""
    extra = extra_config(prefix="fleet")
    space = KeySpace("fleet", "tiny-0123456789abcdef")
    store = make_store()

    async def scenario() -> None:
        enc_a, enc_b = KeyedEncoder("a"), KeyedEncoder("b")
        enc_a.space = enc_b.space = space
        async with rig(encoders=[enc_a], dispatch="parallel") as a, \
                rig(encoders=[enc_b], dispatch="parallel", bucket_lookup=extra, bucket_lookup_timeout_s=10.0) as b:
            assert (await a.post(chat(image(6))))[0] == 200
            published = enc_a.bodies[0]["messages"][0]["content"][0]["uuid"]
            # The encoder's upload (the store runs on its own loop).
            await asyncio.wrap_future(store.submit(store.put_async(space.key_for(published), bytearray(b"blob"))))
            assert (await b.post(chat(image(7))))[0] == 200  # B's first answer shows it the key space
            assert (await b.post(chat(image(6))))[0] == 200
            assert len(enc_b.bodies) == 1  # img-6 never reached B's encoder
            assert b.metric(SKIPS, source="bucket") == 1
            assert b.metric("ec_s3_proxy_bucket_lookups_total", outcome="hit") == 1
            assert params_of(b.pds[0].bodies[-1]) == {published: {PRESENT_MARK: True, "item_indices": [0]}}
            assert (await b.post(chat(image(8))))[0] == 200  # in nobody's bucket: HEAD miss, then the encoder
            assert len(enc_b.bodies) == 2 and b.metric("ec_s3_proxy_bucket_lookups_total", outcome="miss") == 1

    run(scenario())


def test_a_late_bucket_lookup_sends_the_item_to_an_encoder_and_says_so(
    extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store], fault_proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A HEAD slower than bucket_lookup_timeout_s (a slow store, a busy host) counts as a
    miss: the published item goes to the encoder, which is always right, and the proxy
    logs why with the key to raise (before: only a metric said so, and a CI run whose
    lookup was late failed the e2e test with nothing in the log)."""
    extra = extra_config(endpoint_url=fault_proxy.endpoint_url, prefix="fleet")
    space = KeySpace("fleet", "tiny-0123456789abcdef")
    store = make_store()

    async def scenario() -> None:
        enc = KeyedEncoder("b")
        enc.space = space
        async with rig(encoders=[enc], dispatch="parallel", bucket_lookup=extra, bucket_lookup_timeout_s=0.2) as b:
            assert (await b.post(chat(image(7))))[0] == 200  # shows B the key space
            (item,) = find_media_items(name_media(chat(image(6)), give_uuids=True))
            await asyncio.wrap_future(store.submit(store.put_async(space.key_for(item.part["uuid"]), bytearray(b"blob"))))
            fault_proxy.set_latency(1.0, methods=["HEAD"])
            with caplog.at_level(logging.WARNING, logger="vllm.ec_s3"):
                assert (await b.post(chat(image(6))))[0] == 200
            assert len(enc.bodies) == 2 and b.metric(SKIPS, source="bucket") == 0
            assert b.metric("ec_s3_proxy_bucket_lookups_total", outcome="timeout") == 1
            (line,) = [r.getMessage() for r in caplog.records if "bucket lookup" in r.getMessage()]
            assert "bucket_lookup_timeout_s (0.2 s)" in line and "--bucket-lookup-timeout" in line, line

    run(scenario())


def test_the_bucket_client_is_warm_before_the_first_lookup(
    extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    """A proxy with ``bucket_lookup`` opens its S3 connection at start: the first lookup
    must not pay for the credential chain, the client and a handshake, which on a busy
    host outlasted the default bucket_lookup_timeout_s (0.25 s) and sent a published item
    to an encoder (CI: ``assert 2 == 1`` in the test above)."""
    extra = extra_config(endpoint_url=fault_proxy.endpoint_url, prefix="fleet")

    async def scenario() -> None:
        async with rig(encoders=[KeyedEncoder("b")], dispatch="parallel", bucket_lookup=extra):
            # No chat request yet: the S3 server already saw the warm-up's HEAD.
            await asyncio.to_thread(fault_proxy.wait_until, lambda c: c.forwarded >= 1, 20.0)

    run(scenario())


def test_a_bucket_lookup_that_cannot_start_leaves_nothing_bound(
    extra_config: Callable[..., dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup config is resolved again at start (``env:NAME`` secrets): when that
    fails, start raises the config error and holds no port (the caller's ``async with``
    never reaches its exit, so start must clean up itself)."""
    from ec_s3.config import ConfigError
    from ec_s3.proxy.server import EPDProxy
    from ec_s3.sandbox.net import free_port

    extra = extra_config(prefix="fleet")
    monkeypatch.setenv("FLEET_SECRET", extra["secret_access_key"])
    config = ProxyConfig(encoder_urls=[], pd_urls=["http://127.0.0.1:1"], port=free_port(),
                         bucket_lookup={**extra, "secret_access_key": "env:FLEET_SECRET"})
    monkeypatch.delenv("FLEET_SECRET")

    async def scenario() -> None:
        with pytest.raises(ConfigError, match="FLEET_SECRET"):
            await EPDProxy(config).start()
        # The port is free again: a second proxy binds it.
        monkeypatch.setenv("FLEET_SECRET", extra["secret_access_key"])
        proxy = await EPDProxy(config).start()
        await proxy.stop()

    run(scenario())


def test_a_blob_found_by_head_with_its_grid_goes_to_prefill_decode_metadata_only(
    extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """A producer stores an item's placeholder metadata with its blob (S3 object
    metadata): a proxy whose HEAD finds it sends prefill/decode a metadata-only part, no
    image (issue 31: fleet repeats found by HEAD used to carry their media)."""
    extra = extra_config(prefix="fleet")
    space = KeySpace("fleet", "tiny-0123456789abcdef")
    store = make_store()
    grid = {"image_grid_thw": [1, 70, 70]}
    stored = {PLACEHOLDER_METADATA_KEY: placeholder_json({"modality": "image", "metadata": grid})}

    async def scenario() -> None:
        enc = KeyedEncoder("b")
        enc.space = space
        async with rig(encoders=[enc], dispatch="parallel", bucket_lookup=extra, bucket_lookup_timeout_s=10.0) as b:
            assert (await b.post(chat(image(7))))[0] == 200  # learns the key space
            uuid6 = content_uuid("image_url", image(6)["image_url"])
            await asyncio.wrap_future(store.submit(store.put_async(space.key_for(uuid6), bytearray(b"blob"),
                                                                   metadata=stored)))
            uuid9 = content_uuid("image_url", image(9)["image_url"])
            await asyncio.wrap_future(store.submit(store.put_async(space.key_for(uuid9), bytearray(b"blob"))))
            assert (await b.post(chat(image(6), image(9))))[0] == 200
            assert len(enc.bodies) == 1
            sent = [p for p in b.pds[0].bodies[-1]["messages"][-1]["content"] if p.get("type") != "text"]
            # Image 9 was stored without placeholder metadata, so its media go; and then
            # image 6's too: vLLM refuses raw and embeddings images in one request (issue 40).
            assert [p["type"] for p in sent] == ["image_url", "image_url"] and sent[0]["uuid"] == uuid6
            params = params_of(b.pds[0].bodies[-1])
            assert params[uuid6][PRESENT_MARK] is True and params[uuid9] == {PRESENT_MARK: True, "item_indices": [1]}
            assert b.metric("ec_s3_proxy_metadata_only_items_total") == 0
            assert (await b.post(chat(image(6))))[0] == 200  # alone: metadata-only
            sent = [p for p in b.pds[0].bodies[-1]["messages"][-1]["content"] if p.get("type") != "text"]
            assert sent == [{"type": "image_embeds", "image_embeds": grid, "uuid": uuid6}]
            assert b.metric("ec_s3_proxy_metadata_only_items_total") == 1
            assert b.pds[0].refused == []

    run(scenario())

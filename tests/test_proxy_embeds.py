"""Embeddings parts through the proxy: a client's uuid on them is never trusted, a
client's metadata-only part is refused (unless the proxy trusts its clients), and the
proxy itself sends prefill/decode a metadata-only part for an item in the bucket whose
placeholder metadata an encoder reported (Qwen-VL), keeping the media for a resend.

Before this, a client's ``{"type": "image_embeds", "image_embeds": {"image_grid_thw":
...}, "uuid": X}`` went to prefill/decode unchanged: one such request for an X in no store
killed a Qwen-VL prefill/decode engine (issue 31)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.embeds import metadata_only_part
from ec_s3.proxy.main import build_parser, config_from_args
from ec_s3.proxy.naming import CLIENT_PREFIX, CONTENT_PREFIX, is_metadata_only
from test_proxy import FakeEncoder, FakePD, chat, embeds_value, image, params_of, rig, run

GRID = {"image_grid_thw": [1, 70, 70]}


def metadata_part(uuid: str = "mm-victim", **value: Any) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": value or dict(GRID), "uuid": uuid}


def user_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in body["messages"][-1]["content"] if p.get("type") != "text"]


@pytest.mark.parametrize("part, expected", [
    (metadata_part(), True),
    ({"type": "image_embeds", "image_embeds": None, "uuid": "x"}, False),  # vLLM refuses it itself
    ({"type": "video_embeds", "video_embeds": {"video_grid_thw": [[2, 4, 4]]}}, True),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, False),  # a base64 tensor
    ({"type": "image_embeds", "image_embeds": {"image_embeds": "AAAA", **GRID}}, False),
    (image(1), False),
])
def test_metadata_only_parts_are_recognised(part: dict[str, Any], expected: bool) -> None:
    assert is_metadata_only(part) is expected


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_a_clients_metadata_only_part_is_refused(dispatch: str) -> None:
    async def scenario() -> None:
        async with rig(dispatch=dispatch) as r:
            status, body, _ = await r.post(chat(metadata_part()))
            assert status == 400, body
            error = json.loads(body)["error"]
            assert "metadata only" in error["message"]
            assert r.pds[0].bodies == [] and r.encoders[0].bodies == []
    run(scenario())


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_a_clients_uuid_on_an_embeddings_part_is_namespaced(dispatch: str) -> None:
    async def scenario() -> None:
        async with rig(dispatch=dispatch) as r:
            embeds = {"type": "image_embeds", "image_embeds": embeds_value(), "uuid": "mm-victim"}
            status, _, _ = await r.post(chat(embeds))
            assert status == 200
            (sent,) = user_parts(r.pds[0].bodies[0])
            assert sent["uuid"].startswith(CLIENT_PREFIX) and sent["uuid"] != "mm-victim"
            assert sent["image_embeds"] == embeds_value()
    run(scenario())


def test_a_trusted_clients_metadata_only_part_is_forwarded_as_is() -> None:
    async def scenario() -> None:
        async with rig(trust_client_embeds=True) as r:
            status, _, _ = await r.post(chat(metadata_part()))
            assert status == 200
            assert user_parts(r.pds[0].bodies[0]) == [metadata_part()]
    run(scenario())


def test_the_flags_reach_the_config() -> None:
    base = ["--pd-url", "http://127.0.0.1:1"]
    assert config_from_args(build_parser().parse_args(base)).metadata_only is True
    assert config_from_args(build_parser().parse_args(base)).trust_client_embeds is False
    cfg = config_from_args(build_parser().parse_args([*base, "--no-metadata-only", "--trust-client-embeds"]))
    assert cfg.metadata_only is False and cfg.trust_client_embeds is True
    assert ProxyConfig(encoder_urls=[], pd_urls=["http://127.0.0.1:1"]).metadata_only is True


def test_metadata_only_part_needs_the_proxys_uuid_and_metadata() -> None:
    entry = {"modality": "image", "metadata": GRID, "key": "k"}
    named = {**image(1), "uuid": CONTENT_PREFIX + "ab"}
    assert metadata_only_part(named, entry) == {"type": "image_embeds", "image_embeds": GRID,
                                                "uuid": CONTENT_PREFIX + "ab"}
    assert metadata_only_part(image(1), entry) is None  # no uuid, no identifier: vLLM's hash of the media
    assert metadata_only_part(image(1), entry, "mm-abc") == {"type": "image_embeds", "image_embeds": GRID,
                                                             "uuid": "mm-abc"}
    assert metadata_only_part({**image(1), "uuid": "client-x"}, entry) is None
    assert metadata_only_part(named, {**entry, "metadata": {}}) is None  # LLaVA: nothing to size it
    assert metadata_only_part(named, {**entry, "modality": "point_cloud"}) is None
    assert metadata_only_part(named, {**entry, "metadata": {"image_grid_thw": "1,70,70"}}) is None


def test_serial_sends_published_items_metadata_only() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], dispatch="serial") as r:
            named = {**image(1), "uuid": "client-given"}  # a client uuid: the proxy names it by content
            status, _, _ = await r.post(chat(named, image(2)))
            assert status == 200
            first, second = user_parts(r.pds[0].bodies[0])
            params = params_of(r.pds[0].bodies[0])
            assert first["type"] == "image_embeds" and first["image_embeds"] == GRID
            assert first["uuid"].startswith(CONTENT_PREFIX)
            # Not named by the proxy: the encoder's identifier is its uuid (no processor kwargs).
            assert second["type"] == "image_embeds" and second["uuid"] in params
            assert len(params) == 2
            assert r.metric("ec_s3_proxy_metadata_only_items_total") == 2
            # With processor kwargs vLLM would hash that uuid again: the media go.
            status, _, _ = await r.post(chat(image(2), mm_processor_kwargs={"max_pixels": 100_000}))
            assert status == 200
            (kept,) = user_parts(r.pds[0].bodies[1])
            assert kept["type"] == "image_url"
    run(scenario())


def test_parallel_sends_known_items_metadata_only_and_pending_items_with_media() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], dispatch="parallel", known_settle_s=0.0) as r:
            assert (await r.post(chat(image(1))))[0] == 200
            (first,) = user_parts(r.pds[0].bodies[0])
            assert first["type"] == "image_url"  # pending: its metadata comes with the encoder's answer
            for _ in range(100):  # the encoder's answer is remembered when it comes
                if len(r.proxy.skips.known):
                    break
                await asyncio.sleep(0.01)
            assert (await r.post(chat(image(1), image(3))))[0] == 200
            repeat, fresh = user_parts(r.pds[0].bodies[1])
            assert repeat == {"type": "image_embeds", "image_embeds": GRID, "uuid": first["uuid"]}
            assert fresh["type"] == "image_url"
            assert len(r.encoders[0].bodies) == 2  # image 1 once, image 3 once
    run(scenario())


def test_no_metadata_only_flag_keeps_the_media() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], metadata_only=False) as r:
            assert (await r.post(chat(image(1, uuid="x"))))[0] == 200
            (part,) = user_parts(r.pds[0].bodies[0])
            assert part["type"] == "image_url"
    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_metadata_only_request_is_sent_again_with_the_media(stream: bool) -> None:
    """The consumer could not get the blob of a metadata-only item (deleted, corrupt) and
    failed the request alone: the proxy sends it once more with the image."""
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], [FakePD("pd0", failed_generations=1)]) as r:
            status, body, _ = await r.post(chat(image(1, uuid="x"), stream=stream))
            assert status == 200
            assert (b"tok0" if stream else b"hello from pd0") in body
            slim, full = r.pds[0].bodies
            assert user_parts(slim)[0]["type"] == "image_embeds"
            assert user_parts(full)[0]["type"] == "image_url"
            assert params_of(slim) == params_of(full)
            assert r.metric("ec_s3_proxy_pd_retries_total", reason="metadata_only_failed") == 1
    run(scenario())

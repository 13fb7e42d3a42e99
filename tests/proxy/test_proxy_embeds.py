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
from test_proxy import FakeEncoder, FakePD, chat, image, params_of, rig, run

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
            # A cache reference (a client's tensor is refused: tests/proxy/test_proxy_client_embeds.py).
            embeds = {"type": "image_embeds", "image_embeds": None, "uuid": "mm-victim"}
            status, _, _ = await r.post(chat(embeds))
            # vLLM (the fake's judge) refuses a reference to an item it never saw; what
            # matters here is the uuid p/d was sent.
            assert status == 400 and r.pds[0].refused
            (sent,) = user_parts(r.pds[0].bodies[0])
            assert sent["uuid"].startswith(CLIENT_PREFIX) and sent["uuid"] != "mm-victim"
            assert sent["image_embeds"] is None
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


async def _known(r: Any, n: int) -> None:
    """Wait until the proxy has remembered ``n`` encoder answers (they come after p/d's)."""
    for _ in range(200):
        if len(r.proxy.skips.known) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the proxy knows {len(r.proxy.skips.known)} items, not {n}")


def test_parallel_sends_known_items_metadata_only_and_pending_items_with_media() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], dispatch="parallel", known_settle_s=0.0) as r:
            assert (await r.post(chat(image(1))))[0] == 200
            (first,) = user_parts(r.pds[0].bodies[0])
            assert first["type"] == "image_url"  # pending: its metadata comes with the encoder's answer
            await _known(r, 1)
            assert (await r.post(chat(image(1))))[0] == 200
            (repeat,) = user_parts(r.pds[0].bodies[1])
            assert repeat == {"type": "image_embeds", "image_embeds": GRID, "uuid": first["uuid"]}
            assert len(r.encoders[0].bodies) == 1
    run(scenario())


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_a_known_image_beside_a_new_one_keeps_its_media(dispatch: str) -> None:
    """Issue 40: a known image (metadata-only) beside a pending one (media) made the body
    vLLM refuses ("Mixing raw image and embedding inputs is not allowed"): every second
    turn of a chat that resends its history with a new image got a 400. Now every image
    of such a request keeps its media, the known one still marked present (p/d fetches
    its blob, and encodes only the new one). Under serial dispatch the new image's
    encoder is down (the same 400 before: that image had no metadata)."""
    async def scenario() -> None:
        encoders: list[Any] = [FakeEncoder("e0", metadata=GRID)]
        async with rig(encoders, dispatch=dispatch, known_settle_s=0.0) as r:
            assert (await r.post(chat(image(1))))[0] == 200
            await _known(r, 1)
            if dispatch == "serial":
                r.encoders[0].status = 503  # the new image's encoder fails: it has no metadata
            slimmed = r.metric("ec_s3_proxy_metadata_only_items_total")  # serial: image 1 went metadata-only
            status, body, _ = await r.post(chat(image(1), image(3)))
            assert status == 200, body
            assert r.pds[0].refused == []  # vLLM's front end (tests/support/vllm_render.py) took every body
            repeat, fresh = user_parts(r.pds[0].bodies[-1])
            assert repeat["type"] == "image_url" and fresh["type"] == "image_url"
            (entry,) = [e for e in params_of(r.pds[0].bodies[-1]).values() if e["item_indices"] == [0]]
            assert entry["ec_s3_present"] is True and entry["key"]
            assert r.metric("ec_s3_proxy_metadata_only_items_total") == slimmed
    run(scenario())


def test_the_mixing_rule_is_per_modality() -> None:
    """A known image goes metadata-only beside a new audio (another modality); vLLM
    judges the mixing per modality."""
    from ec_s3.proxy.embeds import metadata_only_body
    from ec_s3.proxy.media import find_media_items

    entry = {"modality": "image", "metadata": GRID, "key": "k", "item_indices": [0]}
    known = {**image(1), "uuid": CONTENT_PREFIX + "aa"}
    audio = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}, "uuid": CONTENT_PREFIX + "bb"}
    body = chat(known, audio)
    items = find_media_items(body)
    slim, slimmed = metadata_only_body(body, items[:1], {"U": entry})
    assert [i.part for i in slimmed] == [known] and user_parts(slim)[0]["type"] == "image_embeds"
    both = chat(known, image(2))
    slim, slimmed = metadata_only_body(both, find_media_items(both)[:1], {"U": entry})
    assert slimmed == [] and slim is both


@pytest.mark.parametrize("modality, metadata, exact", [
    ("image", {"image_grid_thw": [1, 4, 4]}, True),
    # Qwen2.5-VL video: M-RoPE scales time by second_per_grid_ts, which vLLM does not
    # publish; prefill/decode would take 1.0 (issue 40: answers off by 0.004-0.008).
    ("video", {"video_grid_thw": [2, 4, 4]}, False),
    ("video", {"video_grid_thw": [2, 4, 4], "second_per_grid_ts": [0.5]}, True),
    ("audio", {"audio_feature_lengths": [10]}, False),  # no model proven exact
    ("image", {"image_sizes": [28, 28]}, False),  # not the metadata the rule knows
])
def test_metadata_only_only_where_the_metadata_is_exact(modality: str, metadata: dict[str, Any], exact: bool) -> None:
    part = {"type": f"{modality}_url", f"{modality}_url": {"url": "data:x;base64,AAAA"}, "uuid": CONTENT_PREFIX + "ab"}
    made = metadata_only_part(part, {"modality": modality, "metadata": metadata, "key": "k"})
    assert (made is not None) is exact
    if exact:
        assert made == {"type": f"{modality}_embeds", f"{modality}_embeds": metadata, "uuid": CONTENT_PREFIX + "ab"}


def test_a_known_video_keeps_its_media() -> None:
    """End to end through the proxy: an encoder that reports a video's grid (vLLM's only
    published video metadata) never makes the repeat metadata-only."""
    async def scenario() -> None:
        enc = FakeEncoder("e0", metadata={"video_grid_thw": [[2, 4, 4]]}, modality="video")
        async with rig([enc], dispatch="serial") as r:
            video = {"type": "video_url", "video_url": {"url": "https://example.invalid/clip.mp4"}}
            r.pds[0].vllm_checks = False  # the judge would fetch the URL; the body is what is checked here
            assert (await r.post(chat(video)))[0] == 200
            (sent,) = user_parts(r.pds[0].bodies[0])
            assert sent["type"] == "video_url"
            assert r.metric("ec_s3_proxy_metadata_only_items_total") == 0
    run(scenario())


def test_no_metadata_only_flag_keeps_the_media() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], metadata_only=False) as r:
            assert (await r.post(chat(image(1, uuid="x"))))[0] == 200
            (part,) = user_parts(r.pds[0].bodies[0])
            assert part["type"] == "image_url"
    run(scenario())


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_metadata_only_request_is_sent_again_as_new_items(stream: bool, dispatch: str) -> None:
    """The consumer could not get the blob of a metadata-only item (deleted by gc,
    corrupt) and failed the request alone: the proxy sends it once more with the image
    under a fresh uuid and without its entry, so that vLLM treats it as a new item (its
    front-end processor cache would hand the engine the metadata-only item again under
    the old uuid: 500 twice, issue 40), and forgets the item, so that the next repeat
    goes to an encoder instead of failing again."""
    async def scenario() -> None:
        pd = FakePD("pd0")
        async with rig([FakeEncoder("e0", metadata=GRID)], [pd], dispatch=dispatch, known_settle_s=0.0) as r:
            assert (await r.post(chat(image(1), stream=stream)))[0] == 200
            await _known(r, 1)
            pd.failed_generations = 1
            status, body, _ = await r.post(chat(image(1), stream=stream))
            assert status == 200
            assert (b"tok0" if stream else b"hello from pd0") in body
            slim, full = pd.bodies[1:]
            (slim_part,), (full_part,) = user_parts(slim), user_parts(full)
            assert slim_part["type"] == "image_embeds"
            assert full_part["type"] == "image_url" and full_part["uuid"] != slim_part["uuid"]
            assert full_part["uuid"].startswith(slim_part["uuid"] + "-resend-")
            assert params_of(slim) and not params_of(full)  # no entry: p/d encodes it itself
            assert r.metric("ec_s3_proxy_pd_retries_total", reason="metadata_only_failed") == 1
            assert len(r.proxy.skips.known) == 0
            assert r.proxy.metrics.get("ec_s3_proxy_known_forgotten_total", reason="resent") == 1
            # The next repeat goes to an encoder again (parallel: with its media, pending;
            # serial: metadata-only once that encoder answered, its blob on its way).
            assert (await r.post(chat(image(1), stream=stream)))[0] == 200
            assert len(r.encoders[0].bodies) == 2
            assert user_parts(pd.bodies[-1])[0]["type"] == ("image_url" if dispatch == "parallel" else "image_embeds")
            assert pd.refused == []
    run(scenario())

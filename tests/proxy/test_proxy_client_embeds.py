"""A client's embeddings tensors through the proxy (issue 40, item 3): refused unless the
proxy trusts its clients, and then checked against their grid; and an engine-death
answer is never sent again.

Before this, ``{"type": "image_embeds", "image_embeds": <100 rows>}`` for a 288-token grid
reached prefill/decode, whose engine died (``split_with_sizes``), and the proxy sent it
twice (``pd_retries_total{reason="failed_generation"}``)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from ec_s3.proxy.client_embeds import EmbedsRules, check_client_embeds, read_tensor_header
from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.server import EPDProxy
from test_proxy import FakeEncoder, FakePD, chat, image, rig, run, serve

# The fake encoder publishes shape [16, 128]: a grid of 64 patches, merge size 2.
GRID = {"image_grid_thw": [1, 8, 8]}


def b64_torch(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def b64_npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def embeds(rows: int, width: int = 128, grid: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    tensor = b64_torch(torch.zeros(rows, width, dtype=torch.bfloat16))
    return {"type": "image_embeds",
            "image_embeds": {"image_embeds": tensor, "image_grid_thw": grid or GRID["image_grid_thw"]}, **extra}


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
@pytest.mark.parametrize("part", [
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "video_embeds", "video_embeds": {"video_embeds": "AAAA", "video_grid_thw": [1, 2, 2]}},
    # vLLM parses a uuid-carrying part by its first field present: this is image_embeds to vLLM.
    {"type": "image_url", "uuid": "u", "image_embeds": "AAAA"},
    {"image_embeds": "AAAA"},
])
def test_an_untrusted_clients_tensor_is_refused(dispatch: str, part: dict[str, Any]) -> None:
    async def scenario() -> None:
        async with rig(dispatch=dispatch) as r:
            status, body, _ = await r.post(chat(part))
            assert status == 400, body
            error = json.loads(body)["error"]
            assert error["type"] == "BadRequestError" and "send the media" in error["message"]
            assert r.pds[0].bodies == [] and r.encoders[0].bodies == []
            assert r.metric("ec_s3_proxy_rejected_total", reason="client_embeds") == 1
    run(scenario())


def test_a_trusted_clients_tensor_is_checked_against_its_grid() -> None:
    async def scenario() -> None:
        async with rig([FakeEncoder("e0", metadata=GRID)], trust_client_embeds=True) as r:
            # Nothing learned yet: the proxy cannot check the rows, so it refuses.
            status, body, _ = await r.post(chat(embeds(16)))
            assert status == 400 and b"cannot check" in body, body
            status, _, _ = await r.post(chat(image(1)))  # the encoder's entry: [16, 128] for [1, 8, 8]
            assert status == 200
            sent = len(r.pds[0].bodies)
            status, body, _ = await r.post(chat(embeds(16)))
            assert status == 200, body
            assert len(r.pds[0].bodies) == sent + 1
            bad = [embeds(100), embeds(16, width=64), embeds(16, grid=[1, 8, 16]), embeds(16, grid=[1, 7, 8]),
                   {"type": "image_embeds", "image_embeds": b64_torch(torch.zeros(16, 128))},
                   {"type": "image_embeds", "image_embeds": {"image_embeds": "AAAA", **GRID}},
                   {"type": "image_embeds", "image_embeds": {
                       "image_embeds": b64_torch(torch.zeros(16, 128, dtype=torch.int64)), **GRID}}]
            for part in bad:
                status, body, _ = await r.post(chat(part))
                assert status == 400, (part, body)
            assert len(r.pds[0].bodies) == sent + 1
            assert r.metric("ec_s3_proxy_rejected_total", reason="client_embeds") == 1 + len(bad)
    run(scenario())


def test_tensor_headers_are_read_without_torch() -> None:
    header = read_tensor_header(b64_torch(torch.zeros(3, 5, dtype=torch.bfloat16)))
    assert (header.dtype, header.shape, header.floating) == ("bfloat16", (3, 5), True)
    header = read_tensor_header(b64_torch(torch.zeros(4, 6)[1:]))  # a view with an offset
    assert header.shape == (3, 6)
    header = read_tensor_header(b64_npy(np.zeros((2, 7), dtype=np.float32)))
    assert (header.dtype, header.shape) == ("float32", (2, 7))
    for bad in ["AAAA", "not base64!", b64_torch(torch.zeros(2, 2).to_sparse()),
                b64_npy(np.zeros((2, 2), dtype=np.int64)), b64_torch({"x": torch.zeros(1)})]:
        with pytest.raises(ValueError):
            read_tensor_header(bad)
    # A pickle that names anything else builds nothing.
    class Boom:
        def __reduce__(self) -> Any:
            return (print, ("pwned",))
    buf = io.BytesIO()
    torch.save(Boom(), buf)
    with pytest.raises(ValueError):
        read_tensor_header(base64.b64encode(buf.getvalue()).decode())


def test_rules_disagreeing_leave_the_modality_unverifiable() -> None:
    rules = EmbedsRules()
    rules.learn({"a": {"modality": "image", "metadata": GRID, "shape": [16, 128]}})
    check_client_embeds({"messages": [{"content": [embeds(16)]}]}, trusted=True, rules=rules)
    rules.learn({"b": {"modality": "image", "metadata": GRID, "shape": [16, 256]}})
    with pytest.raises(ValueError):
        check_client_embeds({"messages": [{"content": [embeds(16)]}]}, trusted=True, rules=rules)


ENGINE_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "type": "InternalServerError", "param": None, "code": 500}}


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_death_is_not_sent_again(stream: bool) -> None:
    async def scenario() -> None:
        dead = FakePD("pd0", error=(500, json.dumps(ENGINE_DEAD).encode(), "application/json"))
        async with rig(pds=[dead]) as r:
            status, body, _ = await r.post(chat(image(1), stream=stream))
            assert (status, len(dead.bodies)) == (500, 1), body  # relayed as it is, sent once
            assert b"EngineCore" in body
            assert r.metric("ec_s3_proxy_pd_retries_total", upstream=dead.url, reason="failed_generation") == 0
    run(scenario())


def test_only_vllms_retryable_failures_are_retried() -> None:
    from ec_s3.proxy.answer import _is_failed_generation

    assert not _is_failed_generation(ENGINE_DEAD)
    assert _is_failed_generation({"error": {"message": "Internal server error", "type": "InternalServerError"}})
    assert _is_failed_generation({"error": {"message": "Request failed; please retry",
                                            "type": "ServiceUnavailableError"}})


def test_ec_transfer_params_never_reach_a_client_and_a_producer_at_a_pd_url_is_an_error() -> None:
    """Issue 40, item 5: encoder and p/d URLs swapped answered 200, empty content, and the
    encoder's ec_transfer_params to the client."""
    async def scenario() -> None:
        swapped = FakeEncoder("enc-at-pd", metadata=GRID)
        runner, swapped.url = await serve(swapped.app())
        try:
            proxy = await EPDProxy(ProxyConfig(encoder_urls=[], pd_urls=[swapped.url], port=0)).start()
            try:
                async with aiohttp.ClientSession() as session:
                    one = {"model": "m", "messages": [{"role": "user", "content": [image(1)]}]}
                    async with session.post(f"{proxy.url}/v1/chat/completions", json=one) as resp:
                        body = await resp.read()
                        assert resp.status == 502, body
                        assert b"ec_transfer_params" not in body and b"misconfigured" in body
                assert proxy.metrics.get("ec_s3_proxy_pd_failures_total", upstream=swapped.url,
                                         reason="producer_answer") == 1
            finally:
                await proxy.stop()
        finally:
            await runner.cleanup()
    run(scenario())

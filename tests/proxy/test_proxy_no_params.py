"""ec-s3 behind a proxy that forwards no ``ec_transfer_params`` (vLLM's example proxy).

``ec-s3 proxy --no-forward-params`` plays that contract: every item still goes to an
encoder (which publishes it), but prefill/decode receives the client's request only, so
consumers must find blobs with ``lookup: always`` (docs/proxy.md). What the consumer
then does is the connector's business and is tested there; here: no params reach PD.
"""

from __future__ import annotations

import json

import pytest

from ec_s3.proxy.main import build_parser, config_from_args
from test_proxy import FakeEncoder, chat, image, rig, run

pytestmark = pytest.mark.timeout(120)


def test_no_forward_params_sends_encoders_the_items_and_pd_the_clients_request_only() -> None:
    async def scenario() -> None:
        encoders = [FakeEncoder("e0"), FakeEncoder("e1")]
        async with rig(encoders=encoders, forward_params=False) as r:
            a, b = image("a"), image("b")
            request = chat(a, b, cache_salt="s")
            raw = json.dumps(request).encode()
            for stream in (False, True):
                body = {**request, "stream": True} if stream else request
                data = raw if not stream else json.dumps(body).encode()
                async with r.session.post(f"{r.url}/v1/chat/completions", data=data,
                                          headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 200
                    await resp.read()
                assert r.pds[0].raw[-1] == data  # byte for byte: nothing added, nothing dropped
            sent = [body["messages"][0]["content"] for e in encoders for body in e.bodies]
            assert sorted(map(json.dumps, sent)) == sorted(map(json.dumps, [[a], [b]] * 2))
            assert r.metric("ec_s3_proxy_encoder_requests_total", outcome="ok") == 4
            # A client's params are dropped as always: the proxy never trusts them.
            await r.post({**request, "ec_transfer_params": {"mm-forged": {"key": "elsewhere"}}})
            assert r.pds[0].bodies[-1] == request
            for pd_body in r.pds[0].bodies:
                assert "ec_transfer_params" not in pd_body

    run(scenario())


def test_no_forward_params_flag() -> None:
    args = build_parser().parse_args(["--pd-url", "http://pd:1", "--no-forward-params"])
    assert config_from_args(args).forward_params is False
    assert config_from_args(build_parser().parse_args(["--pd-url", "http://pd:1"])).forward_params is True

"""The proxy's body rewriting without re-serialising the media (ec_s3/proxy/media.py):
the spliced prefill/decode body and the encoder body reuse the client's bytes and the
part's one serialisation, and mean exactly what the re-encoded bodies meant."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ec_s3.proxy.media import (
    dump_body,
    encoder_body,
    encoder_payload,
    find_media_items,
    parse_body,
    splice_params,
)

PARAMS = {"mm-1": {"key": "k/1", "item_indices": [0], "size_bytes": 4200}}


def _request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 100}},
        {"type": "text", "text": "ünïcode \"quoted\" \\ text"},
    ]}], "max_tokens": 3, "cache_salt": "s", **extra}


@pytest.mark.parametrize("raw", [
    json.dumps(_request()).encode(),
    json.dumps(_request(), indent=2, ensure_ascii=False).encode(),  # pretty, raw UTF-8
    b"  \r\n" + json.dumps(_request()).encode() + b"\n\t ",  # whitespace around the object
])
def test_spliced_body_parses_to_the_request_plus_the_params(raw: bytes) -> None:
    body = parse_body(raw)
    assert body is not None
    out = splice_params(raw, body, PARAMS)
    assert out is not None
    assert json.loads(out) == {**body, "ec_transfer_params": PARAMS}


def test_splice_refuses_what_it_cannot_do_byte_for_byte() -> None:
    req = _request()
    # A client's own field must be replaced, not duplicated: the caller re-encodes.
    forged = {**req, "ec_transfer_params": {"mm-x": {"key": "elsewhere"}}}
    assert splice_params(json.dumps(forged).encode(), forged, PARAMS) is None
    # Encodings JSON parsers accept but that are not UTF-8 text: never spliced.
    for raw in (json.dumps(req).encode("utf-16"), json.dumps(req).encode("utf-16-le"),
                b"\xef\xbb\xbf" + json.dumps(req).encode()):
        assert splice_params(raw, req, PARAMS) is None
    # The empty object gets no leading comma.
    assert json.loads(splice_params(b"{}", {}, PARAMS) or b"") == {"ec_transfer_params": PARAMS}


def test_encoder_payload_means_the_encoder_body() -> None:
    body = _request(mm_processor_kwargs={"a": 1}, stream=True, temperature=0.5)
    items = find_media_items(body)
    assert len(items) == 1
    assert json.loads(encoder_payload(body, items[0])) == encoder_body(body, items[0])
    # An item built without its serialisation still works (the slow way).
    items[0].part_json = ""
    assert encoder_payload(body, items[0]) == dump_body(encoder_body(body, items[0]))

"""The direct path's SigV4 (ec_s3/store/sigv4.py) signs exactly as botocore's
S3SigV4Auth with payload signing off, the signer it replaced: the same headers, byte
for byte, over hostile keys (through the path's own object_url), both addressing
styles, default and other ports, IPv6, queries in any order, header spellings and
spacing, headers never signed, and with or without a session token. Real servers check
it too: every direct-path test signs with it."""

from __future__ import annotations

import datetime
import itertools

import pytest

from ec_s3.store.sigv4 import signed_headers
from ec_s3.store.wire import object_url
from support.botocore_sigv4 import botocore_signed_headers

NOW = datetime.datetime(2026, 12, 3, 6, 5, 4, tzinfo=datetime.timezone.utc)
KEYS = ["prefix/ns/abc.safetensors", "a b/ü€/x+y=z~%/&?#", "..//dots/./", "ключ", "trailing/"]
ENDPOINTS = [("http://127.0.0.1:8333", "path", True), ("https://s3.eu-central-1.amazonaws.com", "virtual", False),
             ("https://minio.example:443", "path", True), ("http://[::1]:9000", "path", True),
             ("http://Upper.Example", "path", True)]
HEADERS = [{}, {"Range": "bytes=0-8388607", "If-Match": '"0123abcd"'},
           {"If-None-Match": "*", "Content-Type": "application/octet-stream", "Content-Length": "16680",
            "x-amz-meta-ec-s3-crc32": "deadbeef", "x-amz-meta-ec-s3-write": "  spaced   out  "},
           {"Host": "127.0.0.1:8333", "User-Agent": "not signed", "Expect": "100-continue"},
           {"X-Amz-Date": "stale", "Authorization": "stale", "x-amz-content-sha256": "stale"}]


@pytest.mark.parametrize("endpoint,style,custom", ENDPOINTS)
def test_signatures_equal_botocores(endpoint: str, style: str, custom: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: NOW)
    for key, headers, token, region, method, query in itertools.product(
            KEYS, HEADERS, (None, "FQoG/session+token=="), ("us-east-1", "eu-central-1"), ("GET", "HEAD", "PUT"),
            ("", "uploadId=up%2Fid&partNumber=3", "partNumber=1&uploadId=x")):
        url = object_url(endpoint, "bucket-1", key, style, custom_endpoint=custom)
        url = f"{url}?{query}" if query else url
        creds = {"access_key": "AKIDEXAMPLE", "secret_key": "wJalr/XUtnFEMI+K7MDENG", "token": token, "region": region}
        want = botocore_signed_headers(method, url, headers, **creds)
        got = signed_headers(method, url, headers, **creds, now=NOW)
        assert {k.lower(): v for k, v in got.items()} == {k.lower(): v for k, v in want.items()}, (url, headers)


def test_a_date_header_is_refused() -> None:
    with pytest.raises(ValueError, match="Date"):
        signed_headers("GET", "http://h/b/k", {"date": "x"}, access_key="a", secret_key="s", token=None,
                       region="us-east-1")

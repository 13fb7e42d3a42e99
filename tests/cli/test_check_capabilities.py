"""``ec-s3 check``'s capability table against SeaweedFS, and through a proxy that makes
the server look as if it ignored ``If-None-Match: *`` or a wrong checksum (the answers
are rewritten on the way back, so SigV4 stays intact and the real server keeps the
state honest). Every run must leave no probe object and no probe upload behind.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ec_s3.cli import main as cli
from ec_s3.cli.check import CheckReport, check_access
from ec_s3.config import ECS3Config
from ec_s3.sandbox.net import free_port
from ec_s3.store.client import S3Store
from support.faultproxy import FaultProxy

PREFIX = "ec-cache"
# What a gateway that drops the condition answers: a 200 (with a body Complete's parser takes).
_OK_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<CompleteMultipartUploadResult><ETag>"0"</ETag></CompleteMultipartUploadResult>'
_OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n%s" % (len(_OK_BODY), _OK_BODY)


def _rows(report: CheckReport) -> dict[str, tuple[str, str, str]]:
    return {c.name: (c.status, c.detail, c.action) for c in report.capabilities}


def _leftovers(store: S3Store) -> tuple[list[str], list[str]]:
    """(object keys, upload keys) anywhere in the bucket."""

    async def collect() -> tuple[list[str], list[str]]:
        client = await store._get_client()
        objects = await client.list_objects_v2(Bucket=store.bucket)
        uploads = await client.list_multipart_uploads(Bucket=store.bucket)
        return ([o["Key"] for o in objects.get("Contents") or []],
                [u["Key"] for u in uploads.get("Uploads") or []])

    return store.run(collect(), timeout=30)


def _check(config: ECS3Config, **kwargs: Any) -> CheckReport:
    report = check_access(config, timeout=120, environ={}, **kwargs)
    assert report.ok, report
    return report


def test_capabilities_of_seaweedfs(make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]) -> None:
    """SeaweedFS honours every probed capability; plain http is reported with what it means."""
    rows = _rows(_check(make_config()))
    for name in ("ranged GET", "conditional PUT", "conditional Complete", "multipart upload", "checksum headers",
                 "clock skew"):
        assert rows[name][0] == "ok", (name, rows[name])
    assert rows["TLS"][0] == "missing" and "in clear" in rows["TLS"][2]
    assert rows["region"][0] == "info" and rows["region"][1].startswith("us-east-1 (from ")
    assert _leftovers(make_store()) == ([], [])


def test_tls_row_names_the_ca_and_the_region_its_source(make_config: Callable[..., ECS3Config], https_endpoint: Any,
                                                         clean_aws_env: pytest.MonkeyPatch) -> None:
    """Over real TLS with a private CA trusted through AWS_CA_BUNDLE, and the region
    from AWS_REGION: the rows say which CA and which region, and where each came from."""
    clean_aws_env.setenv("AWS_CA_BUNDLE", str(https_endpoint.ca_path))
    clean_aws_env.setenv("AWS_REGION", "eu-west-3")
    rows = _rows(_check(make_config(https_endpoint.url)))
    assert rows["TLS"] == ("ok", f"https, verified with {https_endpoint.ca_path} (from AWS_CA_BUNDLE)", "")
    assert rows["region"] == ("info", "eu-west-3 (from AWS_REGION)", "")
    rows = _rows(check_access(make_config(https_endpoint.url, verify_tls=False), timeout=120, environ={}))
    assert rows["TLS"][0] == "missing" and "impersonate" in rows["TLS"][2]


def test_ignored_conditions_are_reported_with_what_ec_s3_does(make_config: Callable[..., ECS3Config],
                                                              make_store: Callable[..., S3Store],
                                                              fault_proxy: FaultProxy) -> None:
    """The second conditional PUT and the second conditional Complete answer 200 (as on
    moto or Ceph RGW 16.2 for Complete): both rows say "missing" and what ec-s3 does; the
    upload the server still holds is aborted by the cleanup."""
    fault_proxy.rewrite_answer_next(2, 412, _OK_ANSWER)
    rows = _rows(_check(make_config(fault_proxy.endpoint_url)))
    assert fault_proxy.counters.rewritten == 2
    for name in ("conditional PUT", "conditional Complete"):
        status, detail, action = rows[name]
        assert status == "missing" and "ignored" in detail and "same bytes" in action, rows[name]
    assert "If-Match" in rows["conditional PUT"][2]
    assert rows["multipart upload"][0] == "ok" and rows["ranged GET"][0] == "ok"
    assert _leftovers(make_store()) == ([], [])


def test_unverified_checksum_is_reported(make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store],
                                         fault_proxy: FaultProxy) -> None:
    """A wrong x-amz-checksum-crc32 "accepted" (RGW 16.2 stores it): reported, and the
    object the server would have kept is deleted."""
    fault_proxy.rewrite_answer_next(1, 400, _OK_ANSWER, ["PUT"], target_contains="-crc")
    rows = _rows(_check(make_config(fault_proxy.endpoint_url)))
    status, detail, action = rows["checksum headers"]
    assert status == "missing" and "accepted" in detail and "ec-s3-crc32" in action
    assert _leftovers(make_store()) == ([], [])


def test_ignored_range_and_clock_skew_are_reported(make_config: Callable[..., ECS3Config],
                                                   make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """A 200 to the ranged GET (rclone serve s3 answers so) and a server Date an hour
    ahead: both rows say what they mean for ec-s3."""
    whole = b"HTTP/1.1 200 OK\r\nContent-Length: 64\r\n\r\n" + bytes(64)
    fault_proxy.rewrite_answer_next(1, 206, whole, ["GET"], target_contains="cap-")
    rows = _rows(_check(make_config(fault_proxy.endpoint_url)))
    status, detail, action = rows["ranged GET"]
    assert status == "missing" and "Range ignored" in detail and "whole object" in action
    ahead = email.utils.formatdate(time.time() + 3600, usegmt=True)
    fault_proxy.rewrite_answer_next(1, 404, f"HTTP/1.1 404 Not Found\r\nDate: {ahead}\r\n"
                                    "Content-Length: 0\r\n\r\n".encode(), ["HEAD"], target_contains="cap-")
    rows = _rows(_check(make_config(fault_proxy.endpoint_url)))
    status, detail, action = rows["clock skew"]
    assert status == "missing" and detail.startswith("+3") and "RequestTimeTooSkewed" in action
    assert _leftovers(make_store()) == ([], [])


def test_probes_clean_up_when_a_probe_fails(make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store],
                                           fault_proxy: FaultProxy) -> None:
    """UploadPart refused: the multipart rows say so, and the open upload is aborted."""
    fault_proxy.error_next(5, 500, ["PUT"], target_contains="partNumber=")
    rows = _rows(_check(make_config(fault_proxy.endpoint_url)))
    assert rows["multipart upload"][0] == "missing" and "500" in rows["multipart upload"][1]
    assert rows["conditional Complete"][0] == "skipped"
    assert rows["conditional PUT"][0] == "ok"
    assert _leftovers(make_store()) == ([], [])


def test_read_only_skips_the_writing_probes(make_config: Callable[..., ECS3Config],
                                           make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    body = os.urandom(100)
    store.run(store.put_async(f"{PREFIX}/ns/blob", body), timeout=30)
    seen_before = _leftovers(store)
    rows = _rows(_check(make_config(), read_only=True))
    assert rows["ranged GET"][0] == "ok"
    for name in ("conditional PUT", "conditional Complete", "multipart upload", "checksum headers"):
        assert rows[name][0] == "skipped" and "--read-only" in rows[name][1]
    assert _leftovers(store) == seen_before


def test_check_prints_the_table_and_json(make_config: Callable[..., ECS3Config], s3_endpoint: Any, bucket: str,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.credentials.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.credentials.secret_access_key)
    base = ["--bucket", bucket, "--endpoint-url", s3_endpoint.url]
    assert cli.main(["check", *base]) == 0
    out = capsys.readouterr().out
    assert "endpoint capabilities:" in out and "conditional Complete  ok" in out
    assert "ec-s3 without TLS:" in out
    assert cli.main(["check", "--json", *base]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in report["capabilities"]} >= {"ranged GET", "clock skew", "TLS", "region"}
    tls = next(c for c in report["capabilities"] if c["name"] == "TLS")
    assert report["region_source"] and tls["status"] == "missing" and tls["detail"].startswith("plain http")
    assert cli.main(["check", "--read-only", *base]) == 0
    assert "skipped  --read-only: writing probes skipped" in capsys.readouterr().out


# ---------------------------------------------------------------------- moto
@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A moto server (ignores If-None-Match on Complete). Tiny on purpose: to be replaced
    by the matrix's moto fixture (tests/support/moto_s3.py) once that is on main."""
    pytest.importorskip("moto.server")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_moto_accepts_a_wrong_checksum(moto_url: str, make_config: Callable[..., ECS3Config]) -> None:
    """A real server that stores a wrong x-amz-checksum-crc32 (moto 5.2): the table says
    so, and the probe object it kept is deleted. moto checks If-None-Match on Complete
    without a lock: a sequential probe sees a 412 (a race is not visible from here)."""
    store = S3Store(make_config(moto_url))
    try:
        store.run(store.create_bucket_async(), timeout=30)
        rows = _rows(_check(make_config(moto_url)))
        status, detail, action = rows["checksum headers"]
        assert status == "missing" and "accepted and stored" in detail and "ec-s3-crc32" in action
        for name in ("conditional PUT", "conditional Complete", "multipart upload", "ranged GET"):
            assert rows[name][0] == "ok", rows[name]
        assert _leftovers(store) == ([], [])
    finally:
        store.close()
